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
        sources = [ROOT / "benchmarks" / "results" / m for m in re.findall(r"\.\./benchmarks/results/([\w.]+)\)", text)]
        quoted = [line for line in _quoted(text) if not _table_header(line)]
        if not quoted:
            continue
        assert sources, f"docs/benchmarks.md, {name}: figures without a results file"
        lines = {line.strip() for source in sources for line in source.read_text().splitlines()}
        for line in quoted:
            if name == "`atorch` command start-up":  # the results file has before and after columns
                command, wall, cpu = [cell.strip() for cell in line.strip("|").split("|")]
                assert any(row.startswith(f"| {command} |") and row.endswith(f"| {wall} | {cpu} |") for row in lines), \
                    f"docs/benchmarks.md, {name}: {line!r} is not the 'after' of a row in {sources}"
            else:
                assert line.strip() in lines, f"docs/benchmarks.md, {name}: {line!r} is not in {[s.name for s in sources]}"
            checked += 1
    assert checked > 60


def test_benchmarks_page_is_reference_not_history():
    import re

    for page in ("benchmarks.md", "search.md", "cli.md", "user_guide.md"):
        text = (ROOT / "docs" / page).read_text()
        assert len(text.splitlines()) < 400, page
        assert not re.search(r"\b(at|since|before) [0-9a-f]{7}\b", text), f"docs/{page} names a commit"
        assert "Now (" not in text and "**Before" not in text, f"docs/{page} narrates its history"
    assert len((ROOT / "docs" / "benchmarks.md").read_text().splitlines()) < 250
