"""Plain-text tables for the operator CLI."""

from __future__ import annotations

from collections.abc import Sequence

from driver.observability.logs import escaped


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns two spaces apart, one line per row, newline-terminated;
    non-printable characters in a cell escaped (`driver.observability.logs.escaped`)."""
    table = [tuple(headers), *(tuple(escaped(c) for c in r) for r in rows)]
    widths = [max(len(r[i]) for r in table) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in table]
    return "\n".join(lines) + "\n"
