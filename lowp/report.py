"""Small shared helpers for the command-line reports: aligned text tables, markdown, CSV."""
from __future__ import annotations

import csv
import io
from collections.abc import Sequence


def _cell(value: object) -> str:
    if isinstance(value, float):
        if value == 0 or 1e-3 <= abs(value) < 1e6:
            return f"{value:.6g}"
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def _check_rows(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """ValueError naming the first row whose length differs from the headers' (zip would drop cells)."""
    for i, row in enumerate(rows):
        if len(row) != len(headers):
            raise ValueError(f"rows: expected {len(headers)} cells per row (one per header), row {i} has {len(row)}")


def text_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain aligned table for the terminal."""
    _check_rows(headers, rows)
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.rjust(w) if _numeric(c) else c.ljust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(out)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-flavoured markdown table."""
    _check_rows(headers, rows)
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(out)


def csv_text(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """CSV text with a header line."""
    _check_rows(headers, rows)
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(headers)
    writer.writerows(rows)
    return buf.getvalue()


def _numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
