"""Numbers as the report and compare print them, and the median both take over repeats."""

from __future__ import annotations

import statistics

GiB = 2 ** 30
SIMULATED_NOTE = "simulated devices: functional only, not a performance figure"


def median(values):
    """Median of the values that are not None; None when none are."""
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def ratio(a, b):
    return a / b if a is not None and b not in (None, 0) else None


def human_bytes(n) -> str:
    if n is None:
        return "n/a"
    for unit, size in (("GiB", GiB), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def ms(seconds, digits: int = 2) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.{digits}f}"


def num(x, fmt="{:.3g}") -> str:
    return "n/a" if x is None else fmt.format(x)


def fmt_ratio(x) -> str:
    return f"{x:.2f}x" if x is not None else "n/a"


def md_escape(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")
