"""Plain-text numbers and tables the `estimate` report prints (SI prefixes, aligned columns)."""

from __future__ import annotations


def si(value: float, unit: str = "") -> str:
    """1.35e11 -> '135.00 G'; plain below 1000."""
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.2f} {prefix}{unit}"
    return f"{value:.3g} {unit}".rstrip()


def table(header: list[str], rows: list[list[str]]) -> str:
    """Plain text, first column left-aligned, the others right-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)])
