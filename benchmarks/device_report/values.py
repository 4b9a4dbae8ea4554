"""Formatting the report's values: numbers that may be missing or odd in a JSON file, and Markdown tables."""

from __future__ import annotations

import math


DASH = "—"


def num(x) -> float | None:
    """A finite number as float; None for None, NaN, inf, strings, booleans, anything else."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def fmt(x, digits: int = 3, suffix: str = "") -> str:
    v = num(x)
    return DASH if v is None else f"{v:.{digits}f}{suffix}"


def signed(x, digits: int = 1, suffix: str = " %") -> str:
    v = num(x)
    return DASH if v is None else f"{v:+.{digits}f}{suffix}"


def change_pct(new, old) -> float | None:
    new, old = num(new), num(old)
    return None if new is None or old is None or old == 0 else 100 * (new - old) / old


def ratio(a, b) -> float | None:
    a, b = num(a), num(b)
    return None if a is None or b is None or b == 0 else a / b


def tb_s(bytes_per_s) -> str:
    return fmt(None if num(bytes_per_s) is None else num(bytes_per_s) / 1e12, 2, " TB/s")


def cuda_version(v) -> str:
    """12080 -> '12.8 (12080)', as cudaDriverGetVersion / cudaRuntimeGetVersion report it."""
    if isinstance(v, int) and not isinstance(v, bool) and v > 0:
        return f"{v // 1000}.{v % 1000 // 10} ({v})"
    return DASH if v is None else str(v)


def as_dict(x) -> dict:
    return x if isinstance(x, dict) else {}


def as_list(x) -> list:
    return x if isinstance(x, list) else []


def dicts(x) -> list[dict]:
    return [r for r in as_list(x) if isinstance(r, dict)]


def as_int(x) -> int | None:
    if isinstance(x, bool):
        return None
    if isinstance(x, int):
        return x
    if isinstance(x, str):
        try:
            return int(x)
        except ValueError:
            return None
    if isinstance(x, float) and x.is_integer():
        return int(x)
    return None


def cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def table(headers: list[str], rows: list[list], right: set[int] | None = None) -> list[str]:
    """A Markdown table; columns in `right` (default: all but the first) are right-aligned."""
    right = set(range(1, len(headers))) if right is None else right
    lines = ["| " + " | ".join(cell(h) for h in headers) + " |",
             "| " + " | ".join("---:" if i in right else "---" for i in range(len(headers))) + " |"]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return lines
