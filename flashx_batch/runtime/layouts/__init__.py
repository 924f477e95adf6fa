"""Batch layouts: where the rows of one batch keep their KV, as plain bookkeeping (no tensors).

The scheduler drives one layout object per batch through the same calls:

- `admit(rows) -> (kv_ops, prefill)`: place rows joining the batch, say what the runner must do;
- `admitted(rows, slots)`: the runner reports the KV slots each new row holds (merged rows fewer);
- `joinable(queue) -> int`: how many rows from the front of the queue fit now (in-flight refill);
- `before_refill(queue) -> kv_ops`: a chance to re-cut the arena before a refill round;
- `decode() -> DecodeStep` then `stepped()`: one token for every live row;
- `drop(finished) -> (keep, kv_ops)`: finished rows leave; `keep` is the new order by old position;
- `release()`: every segment back to the allocator (also after a failure).

`rows` holds the live rows in batch-position order; the runner's device-side state follows that
order through the plans' `keep`.

- `stripes.StripeLayout`: row i in stripe i (segment-sparse, rolling merge, and the static cache
  on GPUs / NPUs); the stripes are re-cut shorter as long rows leave.
- `extents.ExtentLayout`: each row one contiguous extent of its own prompt + new tokens (static
  cache on CPU).
- `paged.PagedLayout`: rows share read-only prefix segments from the prefix cache.

A new layout is a new module here with those methods, a `DecodeStep` / `Prefill` pair in
`runtime.plan` if the existing ones do not describe its reads, the runner's handling of that pair,
and a branch in `Scheduler._next_batch` that picks it.
"""
