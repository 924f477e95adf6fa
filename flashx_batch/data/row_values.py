"""Values read from one input row (a sampling column's cell, an OpenAI Batch body field, a scoring
column's answer index): each read as its type, or None when it cannot be one, never an exception.

A row's value is the user's data, and no value may end a job: a 400-digit integer where a float
belongs (Python's `float()` and `math.isfinite` raise on it), an integer past int64 (Arrow and torch
raise on it), NaN, a list where a number belongs, a number where text belongs. The callers turn None
into that row's error row, naming the field and `describe(value)`; `describe` itself never raises
(Python refuses to print an integer of more than 4,300 digits).
"""

from __future__ import annotations

import math
from typing import Any

INT64 = 2**63  # integers a column or a tensor holds: [-2**63, 2**63)


def as_float(raw: Any) -> float | None:
    """A finite float from an int or a float (not a bool, not text), or None."""
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        return None
    try:
        value = float(raw)  # an int past float's range raises OverflowError
    except OverflowError:
        return None
    return value if math.isfinite(value) else None


def as_int(raw: Any, low: int = -INT64, high: int = INT64) -> int | None:
    """An int in [low, high) from an int, or from a float holding a whole number (an int column with
    nulls, read as floats); None for anything else (bools, text, lists, NaN, 1.5, 10**400)."""
    if isinstance(raw, bool):
        return None
    if isinstance(raw, float):
        if not math.isfinite(raw) or not raw.is_integer():
            return None
        raw = int(raw)
    if not isinstance(raw, int):
        return None
    return raw if low <= raw < high else None


def as_strings(raw: Any) -> tuple[str, ...] | None:
    """A string or a list of strings as a tuple of strings, or None."""
    if isinstance(raw, str):
        return (raw,)
    if isinstance(raw, list | tuple) and all(isinstance(s, str) for s in raw):
        return tuple(raw)
    return None


def describe(raw: Any, limit: int = 80) -> str:
    """`raw` as an error message shows it: its repr cut to `limit` characters and its type; an integer
    too long to print by its size. Never raises."""
    if isinstance(raw, int) and not isinstance(raw, bool) and raw.bit_length() > 256:
        return f"an integer of about {int(raw.bit_length() * math.log10(2)) + 1} digits (int)"
    try:
        text = repr(raw)
    except Exception:  # a value whose repr fails (a huge int inside a list, say)
        text = f"<{type(raw).__name__}>"
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{text} ({type(raw).__name__})"
