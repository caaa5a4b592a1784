"""Every registered method has a docs page that names each of its config fields."""

from pathlib import Path

import pytest

from atorch.auto import get_method, method_names

DOCS = Path(__file__).resolve().parents[1] / "docs" / "methods"


@pytest.mark.parametrize("name", method_names())
def test_method_page_lists_every_field(name):
    page = DOCS / f"{name}.md"
    assert page.is_file(), f"docs/methods/{name}.md is missing"
    text = page.read_text()
    missing = [field for field in get_method(name).config_cls.model_fields if f"`{field}`" not in text]
    assert not missing, f"docs/methods/{name}.md does not describe {missing}"


ROOT = Path(__file__).resolve().parents[1]


def _sections(page: Path) -> dict[str, str]:
    sections, name = {}, None
    for line in page.read_text().splitlines():
        if line.startswith("## "):
            name = line[3:]
            sections[name] = ""
        elif name is not None:
            sections[name] += line + "\n"
    return sections


def _quoted(text: str) -> list[str]:
    """Table rows, result lines and lines of a ```text block: what a section quotes from its files."""
    lines, in_text = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            in_text = line == "```text"
            continue
        if in_text and line.strip():
            lines.append(line)
        elif line.startswith("| ") and not line.startswith("| command |") and "---" not in line:
            lines.append(line)
        elif line.startswith("- ") and "Spearman" in line:
            lines.append(line)
    return lines


def _table_header(line: str) -> bool:
    return any(line.startswith(f"| {word} |") for word in ("strategy", "model", "scenario")) or line.startswith("strategy ")


def test_benchmarks_page_quotes_its_results_files():
    """Every figure docs/benchmarks.md quotes is a line of the results file its section names, so a
    re-run that changes the file fails here until the page says the same (issue 40: quoted
    figures went stale)."""
    import re

    page = ROOT / "docs" / "benchmarks.md"
    checked = 0
    for name, text in _sections(page).items():
        sources = [ROOT / "benchmarks" / "results" / m for m in re.findall(r"\.\./benchmarks/results/([\w.-]+)\)", text)]
        quoted = [line for line in _quoted(text) if not _table_header(line)]
        if not quoted:
            continue
        assert sources, f"docs/benchmarks.md, {name}: figures without a results file"
        lines = {line.strip() for source in sources for line in source.read_text().splitlines()}
        for line in quoted:
            assert line.strip() in lines, f"docs/benchmarks.md, {name}: {line!r} is not in {[s.name for s in sources]}"
            checked += 1
    assert checked > 50  # the page's tables (the start-up table is on cli.md, checked below)


def test_benchmarks_page_is_reference_not_history():
    import re

    for page in ("benchmarks.md", "search.md", "cli.md", "user_guide.md"):
        text = (ROOT / "docs" / page).read_text()
        assert len(text.splitlines()) < 400, page
        assert not re.search(r"\b(at|since|before) [0-9a-f]{7}\b", text), f"docs/{page} names a commit"
        assert "Now (" not in text and "**Before" not in text, f"docs/{page} narrates its history"
    assert len((ROOT / "docs" / "benchmarks.md").read_text().splitlines()) < 250


# Pages that quote benchmark figures beside docs/benchmarks.md (checked above).
QUOTING_PAGES = ("cli.md", "compression.md", "gpu_check.md", "integrations.md", "pipeline.md", "zero_profile.md")


def _quoted_rows_missing(page: Path) -> tuple[int, list[str]]:
    """(rows checked, rows not found): every table row of a section that links a results file
    (``](../benchmarks/results/NAME.md)``) must be a line of one of the files it links."""
    import re

    checked, missing = 0, []
    for name, text in _sections(page).items():
        sources = re.findall(r"\]\((?:\.\./)+benchmarks/results/([\w.-]+\.md)\)", text)
        if not sources:
            continue
        lines = {line.strip() for s in sources for line in (ROOT / "benchmarks" / "results" / s).read_text().splitlines()}
        for line in _quoted(text):
            if _table_header(line) or line.startswith("| flag |"):
                continue
            checked += 1
            if line.strip() not in lines:
                missing.append(f"{page.name}, {name}: {line!r} is not in {sources}")
    return checked, missing


@pytest.mark.parametrize("page", QUOTING_PAGES)
def test_quoted_figures_are_lines_of_their_results_files(page):
    """A figure a page quotes from a benchmark is a line of the results file its section links, so
    a re-run that changes the file fails here until the page says the same (issue 40: docs/cli.md
    said 34.5 GiB where the tool printed 39.52)."""
    checked, missing = _quoted_rows_missing(ROOT / "docs" / page)
    assert checked >= 2, f"docs/{page} quotes no results file any more: take it off QUOTING_PAGES"
    assert not missing, "\n".join(missing)


def test_a_changed_figure_fails_the_quote_check(tmp_path):
    page = tmp_path / "page.md"
    rows = [line for line in (ROOT / "benchmarks" / "results" / "profile_zero.md").read_text().splitlines()
            if line.startswith("| compute |")]
    page.write_text("## Profile\n\nSource: [p](../benchmarks/results/profile_zero.md).\n\n" + rows[0] + "\n"
                    + rows[0].replace("232.8", "232.9") + "\n")
    checked, missing = _quoted_rows_missing(page)
    assert checked == 2 and len(missing) == 1 and "232.9" in missing[0]


def test_pages_are_reference_not_history():
    """No page is a lab notebook: under 400 lines, no commit named, no dated 'Now (...)' or
    '**Before' entries (the history is in CHANGELOG.md and benchmarks/results/history_*.md)."""
    import re

    pages = [p for p in sorted((ROOT / "docs").rglob("*.md")) if "dev" not in p.parts]
    assert len(pages) > 30
    for page in pages:
        text = page.read_text()
        assert len(text.splitlines()) < 400, page.name
        assert not re.search(r"\b(at|since|before|in) [0-9a-f]{7,40}\b", text), f"{page.name} names a commit"
        assert "Now (" not in text and "**Before" not in text, f"{page.name} narrates its history"
