"""Batch layouts: where the rows of one batch keep their KV, as plain bookkeeping (no tensors).

The scheduler drives one layout object per batch through the interface of `base.Layout` (admit,
admitted, joinable, before_refill, decode, stepped, drop, release): plain integers and plan objects,
never a tensor.

- `stripes.StripeLayout`: row i in stripe i (segment-sparse, rolling merge, and the static cache
  on GPUs / NPUs); the stripes are re-cut shorter as long rows leave.
- `extents.ExtentLayout`: each row one contiguous extent of its own prompt + new tokens (static
  cache on CPU).
- `paged.PagedLayout`: rows share read-only prefix segments from the prefix cache.

A new layout is a new `Layout` subclass here, a `DecodeStep` / `Prefill` pair in
`runtime.plan` if the existing ones do not describe its reads, the runner's handling of that pair,
and a branch in `Scheduler._next_batch` that picks it.
"""
