"""Plain-text tables for the CLI (status, plan)."""

from __future__ import annotations

from collections.abc import Collection, Sequence


def format_table(
    header: Sequence[str], rows: Sequence[Sequence[str]], right_aligned: Collection[int] = ()
) -> list[str]:
    """Lines of a table whose columns are as wide as their widest cell; numbers usually right-aligned."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return [
        "  ".join(
            cell.rjust(width) if i in right_aligned else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in [header, *rows]
    ]
