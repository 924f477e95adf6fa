"""Timing helpers shared by every benchmark in this package.

Called by `runtime_vs_hf`, `kv_sparse` and the `python -m flashx_batch.bench` harness. Nothing here
knows about models: it times callables and summarises samples, so every figure is computed one way.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def timed(fn: Callable[..., T], *args, **kwargs) -> tuple[T, float]:
    """Call `fn(*args, **kwargs)` once -> (its result, wall seconds)."""
    started = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - started


def seconds(fn: Callable[..., object], *args, **kwargs) -> float:
    """Wall seconds of one call `fn(*args, **kwargs)` (result dropped)."""
    return timed(fn, *args, **kwargs)[1]


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100] (numpy's default method, without numpy)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def spread(values: Sequence[float]) -> dict[str, float]:
    """{"median", "min", "max"} of repeated measurements: the three figures every report carries."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def rotated(items: Sequence[T], turn: int) -> list[T]:
    """`items` started at position `turn`: interleaved repeats rotate who runs first, so a slow
    moment of a shared machine does not always land on the same variant."""
    k = turn % len(items) if items else 0
    return list(items[k:]) + list(items[:k])
