"""The step plan: what the scheduler hands a model runner, and what the runner hands back.

Plain data, no tensors (the scheduler imports no torch). One `StepPlan` per runner call, applied in
field order: the live rows that stay (`keep`), KV copies and bias clears (`kv_ops`), then at most one
of a prefill (rows joining the batch) or a decode step (every live row, one token). Batch positions
are the order of the scheduler's live rows, which the runner mirrors for its device-side state (last
token, sampling state, slot tables).

Flat slot numbers address the KV arena (`kvcache.geometry`); a runner without an arena (ONNX
Runtime) keeps its own cache and reads only what it needs (rows, positions, `keep`).
"""

from __future__ import annotations

from dataclasses import dataclass

from flashx_batch.runtime.params import SamplingParams


@dataclass(frozen=True)
class SlotMove:
    """Copy n flat slots (keys, values and merge bias of every layer) from src to dst."""

    src: int
    dst: int
    n: int


@dataclass(frozen=True)
class ClearBias:
    """No merge bias left in flat slots [start, end)."""

    start: int
    end: int


KVOp = SlotMove | ClearBias


@dataclass(frozen=True)
class NewRow:
    """A row joining the batch: its prompt (already fitted to max_input_len, or longer for a rolling
    merge), sampling settings and LoRA adapter slot (0: the base model)."""

    prompt: list[int]
    params: SamplingParams
    adapter: int = 0


@dataclass(frozen=True)
class StripePrefill:
    """Rows into stripes first, first + 1, ... of stripes `capacity` slots long. A segment-sparse
    runner merges each down into its stripe and reports the slots it kept."""

    rows: tuple[NewRow, ...]
    first: int
    capacity: int


@dataclass(frozen=True)
class ExtentPrefill:
    """Rows into extents of their own: row r's KV from flat slot starts[r] on."""

    rows: tuple[NewRow, ...]
    starts: tuple[int, ...]


@dataclass(frozen=True)
class PrefixBlock:
    """Shared prompt blocks to compute once into prefix-cache segments: `tokens` at positions
    first_position.., each written to `table[position]`, reading `table[:position]`."""

    tokens: tuple[int, ...]
    first_position: int
    table: tuple[int, ...]
    adapter: int = 0  # the LoRA adapter slot of the rows sharing it (prefix keys are per adapter)


@dataclass(frozen=True)
class PagedPrefill:
    """Rows reading shared prefix segments: row r's slot table is `tables[r]` (flat slots of its
    shared segments, then its own), its first `cached[r]` prompt tokens are already there. `blocks`
    are computed first (in order: a later block may read an earlier one). Positions past a row's
    table read and write `trash`, a slot no row owns."""

    rows: tuple[NewRow, ...]
    tables: tuple[tuple[int, ...], ...]
    cached: tuple[int, ...]
    trash: int
    blocks: tuple[PrefixBlock, ...] = ()


@dataclass(frozen=True)
class StripeDecode:
    """One token per row, row i in stripe i of `stripes` stripes `capacity` slots long, at RoPE
    position positions[i], written to slot write_slots[i] of its stripe (None: the positions; merged
    rows' slots and positions part ways, and then every read carries the arena's merge bias, if it
    holds any). Attention reads `kv_len` slots; `aligned`: every row writes slot kv_len - 1, no mask
    (unless a merge bias must be added); `groups`:
    runs of rows (start, end, slots read) each read only as far as it needs."""

    positions: tuple[int, ...]
    write_slots: tuple[int, ...] | None
    kv_len: int
    aligned: bool
    groups: tuple[tuple[int, int, int], ...] | None
    capacity: int
    stripes: int


@dataclass(frozen=True)
class ExtentDecode:
    """One token per row, row i's cache from flat slot starts[i], its new token at slot positions[i]
    of it; attention reads the `runs` (first row, end row, first slot, stride, slots read, aligned)."""

    positions: tuple[int, ...]
    starts: tuple[int, ...]
    runs: tuple[tuple[int, int, int, int, int, bool], ...]


@dataclass(frozen=True)
class PagedDecode:
    """One token per row through the slot tables the batch's prefill set up."""

    positions: tuple[int, ...]


Prefill = StripePrefill | ExtentPrefill | PagedPrefill
DecodeStep = StripeDecode | ExtentDecode | PagedDecode


@dataclass(frozen=True)
class StepPlan:
    keep: tuple[int, ...] | None = None  # live rows that stay, by old batch position, in their new order
    kv_ops: tuple[KVOp, ...] = ()
    prefill: Prefill | None = None
    decode: DecodeStep | None = None


@dataclass
class StepOutput:
    """tokens: one sampled token per admitted row (prefill) or per live row (decode). slots: prefill
    only, the KV slots each admitted row holds (fewer than its prompt once merged). computed: token
    positions the model ran, padding included. logprobs / top_logprobs: only when a row of the batch
    asked for logprobs (None otherwise): per row, its token's raw-model logprob and the batch's top-K
    (token id, logprob) pairs, most likely first (the scheduler keeps each row's own K)."""

    tokens: list[int]
    slots: list[int] | None = None
    computed: int = 0
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
