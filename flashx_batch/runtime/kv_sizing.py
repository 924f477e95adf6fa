"""How an engine cuts its KV arena and which batch layout it runs: pure functions of the options.

Static cache: `max_batch_size` stripes of max_input_len + max_output_len (whole segments).
Segment-sparse: the same bytes cut into shorter stripes (a merged prompt needs fewer slots), so more
rows fit; a few spare segments hold the last row's prompt before it is merged down. Prefix reuse: a
cache region and one trash segment after the stripes.
"""

from __future__ import annotations

import dataclasses

from flashx_batch.errors import ConfigError
from flashx_batch.kvcache.geometry import ArenaGeometry
from flashx_batch.runtime.options import EngineOptions


def rows_for_budget(options: EngineOptions, bytes_per_slot: int) -> EngineOptions:
    """`options` with max_batch_size = the full-length rows (max_input_len + max_output_len, whole
    segments) that `kv_budget_mb` holds at `bytes_per_slot` (the model's KV bytes per token, every
    layer), after the prefix cache region; unchanged without a budget. Segment-sparse then cuts the
    same bytes into more, shorter stripes (`arena_geometry`), so a budget admits more rows there."""
    if options.kv_budget_mb is None:
        return options
    budget = int(options.kv_budget_mb * 2**20)
    if options.prefix_cache_tokens:  # the prefix cache region (and its trash segment) comes out of the budget
        seg = options.segment_size
        budget -= (-(-options.prefix_cache_tokens // seg) + 1) * seg * bytes_per_slot
    row = options.row_capacity * bytes_per_slot
    if budget < row:
        raise ConfigError(f"kv_budget_mb={options.kv_budget_mb} holds {max(0, budget) // bytes_per_slot} KV slots for "
                          f"rows (after any prefix cache); one row of max_input_len + max_output_len needs "
                          f"{options.row_capacity} slots ({row / 2**20:.2f} MiB for this model and dtype). Raise the "
                          "budget or lower the lengths.")
    return dataclasses.replace(options, max_batch_size=budget // row)


def arena_geometry(options: EngineOptions, prompt_slots: int) -> ArenaGeometry:
    """`prompt_slots`: the most KV slots a prompt holds once cached (fewer than max_input_len when merged)."""
    o = options
    rows, capacity, extra = o.max_batch_size, o.row_capacity, 0
    if o.prefix_cache_tokens:  # cache region + one trash segment after the stripes
        extra = -(-o.prefix_cache_tokens // o.segment_size) + 1
    if o.cache_policy == "segment_sparse":
        seg = o.segment_size
        capacity = -(-(prompt_slots + o.max_output_len) // seg) * seg
        extra = -(-max(0, o.max_input_len - capacity) // seg)
        rows = max(1, (o.max_batch_size * o.row_capacity - extra * seg) // capacity)
    return ArenaGeometry(o.segment_size, rows, capacity, extra)


def grows_batches(options: EngineOptions) -> bool:
    """Whether batches of short rows take more rows in the same arena (`batch_growth`).

    Stripes are cut for the longest row still decoding or queued, so they only ever get shorter and
    no row waits for room. Sorted rows (`sort_by_length`) are what lets them shrink early: in
    arrival order one long row near the end of the queue keeps every stripe long until it is
    admitted. Static cache only: segment-sparse stripes are already cut for merged prompts, and
    prefix reuse runs paged batches with their own growth."""
    o = options
    return o.batch_growth > 1 and o.cache_policy == "static" and not o.prefix_cache_tokens


def uses_extents(options: EngineOptions, backend_prefers_extents: bool) -> bool:
    """Whether refilled batches keep each row in an extent of its own instead of equal stripes:
    `kv_layout=extents`, or `auto` on a backend that prefers them (one attention call per run of
    rows: cheap on CPU, a kernel launch each on a GPU). Needs `grows_batches`, refill (static batches
    keep stripes), and prompts that fit max_input_len (a rolled long prompt's positions and slots
    part ways: stripes handle that)."""
    o = options
    wanted = o.kv_layout == "extents" or (o.kv_layout == "auto" and backend_prefers_extents)
    return wanted and grows_batches(o) and o.refill and o.long_input != "rolling_merge"
