"""Text the atorch command prints, within the terminal's width: folded lines and aligned tables
whose cells wrap at word (and ``" + "``, ``", "``, ``" x "``) boundaries, never inside a word."""

import re
import shutil
import textwrap
from collections.abc import Callable, Sequence

# The widest the output gets, whatever the terminal: docs/cli.md promises 120 columns.
MAX_WIDTH = 120
MIN_WIDTH = 40
GAP = "  "


def output_width() -> int:
    """``$COLUMNS`` or the terminal's width, at most MAX_WIDTH (MAX_WIDTH when neither is known)."""
    columns = shutil.get_terminal_size((MAX_WIDTH, 24)).columns
    return max(MIN_WIDTH, min(MAX_WIDTH, columns))


def fold(line: str, width: int, indent: int = 4) -> list[str]:
    """``line`` within ``width`` at spaces, its continuations indented ``indent`` more than its own
    leading spaces; a word longer than the room keeps its own line whole."""
    if len(line) <= width:
        return [line]
    lead = line[: len(line) - len(line.lstrip(" "))]
    return textwrap.wrap(line[len(lead):], width, initial_indent=lead, subsequent_indent=lead + " " * indent,
                         break_long_words=False, break_on_hyphens=False) or [line]


def fold_text(text: str, width: int) -> str:
    return "\n".join(part for line in text.split("\n") for part in fold(line, width))


def wrap_cell(text: str, width: int) -> list[str]:
    """``text`` in lines of at most ``width``, broken only where _BREAKS allows, preferring the
    separators between names to the spaces inside one; a word longer than ``width`` stays whole."""
    pieces = _pieces(text)
    lines: list[str] = []
    for piece in pieces:
        if lines and len(lines[-1]) + 1 + len(piece) <= width:
            lines[-1] += " " + piece
        elif len(piece) <= width:
            lines.append(piece)
        else:
            lines += textwrap.wrap(piece, width, break_long_words=False, break_on_hyphens=False) or [piece]
    return lines or [""]


def _pieces(text: str) -> list[str]:
    """``text`` split after its separators (" + ", ", ", " x "), each piece keeping its separator."""
    return [p for p in re.split(r"(?<= \+) |(?<=,) |(?<= x) ", text) if p]


def _longest_word(text: str) -> int:
    return max((len(word) for word in text.split()), default=0)


def table(rows: Sequence[Sequence[str]], width: int, wrap: Sequence[int] = (), right: Sequence[int] = (),
          fill: int | None = None, fill_min: int = 24, title: Sequence[int] = (),
          title_text: Callable[[list[str]], str] = " ".join) -> list[str]:
    """``rows`` (the first is the header) as aligned columns within ``width``.

    Columns in ``wrap`` fold their cells (:func:`wrap_cell`) when the table would pass ``width``;
    the ``fill`` column (often the last: a status and its reason) takes what width is left, at
    least ``fill_min`` or its longest word, and wraps under itself. Columns in ``right`` are
    right-aligned. Where even the narrowest columns pass ``width`` (an 80-column terminal), each
    row becomes a block instead: its ``title`` columns on one line (``title_text`` of their cells),
    then the others as ``header value`` pairs, indented, folded at spaces."""
    count = len(rows[0])
    natural = [max(len(row[i]) for row in rows) for i in range(count)]
    shrinkable = {*wrap, *(() if fill is None else (fill,))}
    least = [max(_longest_word(row[i]) for row in rows) if i in shrinkable else natural[i] for i in range(count)]
    if fill is not None:
        least[fill] = min(natural[fill], max(least[fill], fill_min))
    widths = list(natural)
    # the fill column gives way first, down to a readable width; then the wrapping columns, the
    # widest first, to their longest word; then the fill column to its own
    if fill is not None:
        _shrink(widths, [fill], {fill: max(least[fill], min(natural[fill], FILL_READABLE))}, width)
    _shrink(widths, list(wrap), least, width)
    _shrink(widths, list(shrinkable), least, width)
    if title and sum(widths) + len(GAP) * (count - 1) > width:
        return stacked(rows, width, title, title_text)
    return [line for row in rows for line in _row_lines(row, widths, set(wrap), set(right), fill)]


# The width a wrapping reason keeps before the name columns give way.
FILL_READABLE = 40


def _shrink(widths: list[int], columns: list[int], floor, width: int) -> None:
    """Narrow ``columns`` (the widest above its ``floor`` first) until the row fits ``width``."""
    while sum(widths) + len(GAP) * (len(widths) - 1) > width:
        room = [i for i in columns if widths[i] > floor[i]]
        if not room:
            return
        widths[max(room, key=lambda i: widths[i] - floor[i])] -= 1


def stacked(rows: Sequence[Sequence[str]], width: int, title: Sequence[int],
            title_text: Callable[[list[str]], str] = " ".join) -> list[str]:
    """Each row after the header as a block: its ``title`` cells on one line, the other cells as
    ``header value`` pairs under it (empty and ``-`` cells left out), all within ``width``."""
    header, lines = rows[0], []
    for row in rows[1:]:
        lines += fold(title_text([row[i] for i in title if row[i]]), width)
        pairs = [f"{header[i]} {row[i]}" if header[i] else row[i]
                 for i in range(len(row)) if i not in title and row[i] not in ("", "-")]
        lines += fold("    " + "; ".join(pairs), width)
    return lines


def _row_lines(row: Sequence[str], widths: list[int], wrapping: set[int], right: set[int],
               fill: int | None = None) -> list[str]:
    """A row's lines: names and layouts fold at their separators, the fill column (prose) at spaces."""
    cells = [wrap_cell(cell, w) if i in wrapping
             else (textwrap.wrap(cell, w, break_long_words=False, break_on_hyphens=False) or [""]) if i == fill
             else [cell] for i, (cell, w) in enumerate(zip(row, widths))]
    lines = []
    for k in range(max(len(cell) for cell in cells)):
        parts = []
        for i, (cell, w) in enumerate(zip(cells, widths)):
            text = cell[k] if k < len(cell) else ""
            parts.append(text.rjust(w) if i in right else text.ljust(w))
        lines.append(GAP.join(parts).rstrip())
    return lines
