"""CUDA graphs for the striped decode step: one kernel launch per step instead of hundreds.

A decode step of a small model on a GPU can be bound by launching its kernels rather than by the
device: a step dispatches ~30 non-view ops per layer (counted on CPU: 190 for the bundled model's 6
layers), so a 16-layer 1B model launches ~500 — ~2.5 ms if each costs ~5 us, an assumption, not a
measurement — to read ~2.5 GB of weights, ~0.5 ms at an H200's nominal 4.8 TB/s. A captured graph
replays them all in one launch. (Not yet measured on a GPU: `bench.gpu_protocol` reports graphs
against eager steps when one is available.)

A graph replays fixed shapes and fixed addresses, so each step is padded to a *bucket*:
- rows up to the next of 1, 2, 4, 8, 16, 32, 48, 64, ... (16 apart), at most the stripes of the
  current layout; a padding row decodes token 0 at position 0 of its own (free) stripe, and its
  output is dropped. Live rows are always stripes 0..B-1 (`layouts.stripes.StripeLayout` keeps them dense).
- slots read up to the next multiple of SLOT_BUCKET (coarser past 1024, see `slots_bucket`), at
  most the stripe capacity. The mask (always present in a graph) hides the slots past each row's
  own, as it does for rows of mixed lengths.
Graphs are keyed by (rows, stripe capacity, slots) and captured on first use, MAX_GRAPHS at most per
engine (a growing batch re-cuts its stripes into a few capacities); a step of a new shape past that
runs eagerly at its own shape. A graph ends at the final norm; the LM head runs after it on the
live rows only. The graphs share one memory pool and may replay in any order: no graph reads
another's output, and each graph's static output stays referenced, so no later capture places its
temporaries over it.

Inputs live in static tensors the graph reads; the KV arena and the RoPE tables are allocated once
(a rolling merge that grows the RoPE table drops every graph). The backend captures
(`Backend.capture_graph`: the CUDA one warms the step up on a side stream first), on the step's own
inputs, so the KV the capture writes is the step's own (the replay writes the same values again).

Decision: CUDA graphs, not `torch.compile`. Graphs need no compiler, no Triton and no
recompiles as rows come and go, and keep our kernels (SDPA, cuBLAS) as they are. A compiled decode
step on CPU (torch 2.13 inductor, bundled model, 16 rows, static shapes; a throwaway script) ran
5x slower than eager, the time inside the compiled graph's own kernels, so it is not the CPU path
either.

`capture=False` runs the same padded static-shape step eagerly: what the CPU tests check for equal
tokens (the padding, the buckets and the mask); capture itself needs a GPU (tests/device), or a
stand-in backend (the CPU tests' replays).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from flashx_batch.backends import Backend, GraphReplay

if TYPE_CHECKING:
    from flashx_batch.runtime.forward_passes import ForwardPasses

log = logging.getLogger(__name__)

SLOT_BUCKET = 128  # the finest step of the slots read per row (masked reads past a row are cheap next to launches)
MAX_GRAPHS = 96  # graphs held per engine; steps of a new shape past it run eagerly, unpadded


def rows_bucket(rows: int, limit: int) -> int:
    """Padded row count for `rows` live rows: 1, 2, 4, 8, then multiples of 16, never above `limit`."""
    if rows > limit:
        raise ValueError(f"{rows} rows do not fit {limit} stripes")
    padded = 1
    while padded < min(rows, 16):
        padded *= 2
    if rows > 16:
        padded = -(-rows // 16) * 16
    return min(padded, limit)


def slots_bucket(slots: int, capacity: int) -> int:
    """Padded slots read for a step whose longest row reads `slots`, never above the stripe `capacity`:
    the next multiple of SLOT_BUCKET up to 1024, then of an eighth of the next power of two (four
    buckets per doubling: under 25 % of the reads padding, and few graphs for long stripes)."""
    if slots > capacity:
        raise ValueError(f"{slots} slots do not fit stripes of {capacity}")
    step = max(SLOT_BUCKET, 1 << max(0, (slots - 1).bit_length() - 3))
    return min(-(-slots // step) * step, capacity)


@dataclass
class _Captured:
    graph: GraphReplay
    inputs: tuple[torch.Tensor, ...]  # tokens, positions, write_flat, mask: what the graph reads
    # what it writes: final-norm hidden states [rows, hidden]. Kept referenced for the graph's life, so
    # no later capture in the shared pool places its temporaries over it.
    hidden: torch.Tensor


class DecodeGraphs:
    """Striped decode steps at bucketed static shapes, replayed from CUDA graphs (see the module doc).

    `capture=False` runs the padded step eagerly instead (the CPU tests' stand-in for a replay).
    `backend` captures the graphs (`Backend.capture_graph`); None: the passes' own backend."""

    def __init__(self, passes: ForwardPasses, capture: bool = True, backend: Backend | None = None) -> None:
        self.passes = passes
        self.capture = capture
        self.backend = backend if backend is not None else passes.backend
        self.failed = False  # a capture failed: every step runs eagerly, unpadded, from then on
        self.graphs: dict[tuple[int, int, int], _Captured] = {}
        self.pool: Any = None  # the backend's memory pool, shared by every graph
        self.rotary = None  # the RoPE table the graphs read (dropped with it)
        self.steps = self.replays = self.padding_rows = 0  # padded steps run here, from graphs, padding rows added

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, kv_len: int,
               write_slots: torch.Tensor | None, cap: int, stripes: int) -> torch.Tensor | None:
        """`ForwardPasses.decode` for rows 0..B-1 of `stripes` stripes of `cap` slots (no groups): logits
        [B, V], or None when the step should run eagerly at its own shape (a capture failed, or
        MAX_GRAPHS are held and this shape is new)."""
        passes = self.passes
        rows = len(tokens)
        padded, slots = rows_bucket(rows, stripes), slots_bucket(kv_len, cap)
        key = (padded, cap, slots)
        if self.capture:
            if self.rotary is not passes.model.rotary:  # a rebuilt RoPE table: old graphs read the freed one
                self.graphs.clear()
                self.rotary = passes.model.rotary
            if self.failed or (key not in self.graphs and len(self.graphs) >= MAX_GRAPHS):
                return None
        if padded > rows:  # padding rows: token 0 at slot 0 of their own free stripe
            pad = torch.zeros(padded - rows, dtype=tokens.dtype, device=tokens.device)
            tokens, positions = torch.cat((tokens, pad)), torch.cat((positions, pad))
            if write_slots is not None:
                write_slots = torch.cat((write_slots, pad))
        mask = passes.stripe_mask(positions, write_slots, slots, cap)
        write_flat = passes.stripe_starts(cap, padded) + (positions if write_slots is None else write_slots)
        inputs = (tokens, positions, write_flat, mask)
        runs = ((0, padded, 0, cap, slots, False),)
        if not self.capture:
            hidden = passes.step_hidden(*inputs, runs)
        else:
            captured = self.graphs.get(key)
            if captured is None:
                captured = self._capture_or_none(key, inputs, runs)
                if captured is None:
                    return None
            else:
                for static, value in zip(captured.inputs, inputs):
                    static.copy_(value)
            captured.graph.replay()
            self.replays += 1
            hidden = captured.hidden
        self.steps += 1
        self.padding_rows += padded - rows
        # the LM head outside the graph, on the live rows only: no vocab-wide logits for padding rows,
        # and no vocab-wide static output per graph (a graph keeps only [rows, hidden])
        return passes.model.logits(hidden[:rows])

    def _capture_or_none(self, key: tuple[int, int, int], inputs: tuple[torch.Tensor, ...], runs: tuple
                         ) -> _Captured | None:
        """Capture the graph for `key`; on failure log why, drop every graph and leave steps to the
        eager path from now on (same tokens, slower). A warm-up that failed part way wrote KV the
        eager step writes again (the same values)."""
        try:
            captured = self._capture(inputs, runs)
        except RuntimeError:
            log.warning("capturing a CUDA graph for the decode step failed; decode steps run eagerly from now on "
                        "(runtime.cuda_graphs=off skips the attempt)", exc_info=True)
            self.failed = True
            self.graphs.clear()
            return None
        self.graphs[key] = captured
        if len(self.graphs) == MAX_GRAPHS:
            log.warning("%d decode graphs captured: steps of new shapes now run eagerly", MAX_GRAPHS)
        return captured

    def _capture(self, inputs: tuple[torch.Tensor, ...], runs: tuple) -> _Captured:
        static = tuple(t.clone() for t in inputs)  # outside the pool: no graph's temporaries overlap them
        graph, hidden, self.pool = self.backend.capture_graph(lambda: self.passes.step_hidden(*static, runs), self.pool)
        return _Captured(graph, static, hidden)
