"""What a forward pass needs besides the token ids: one metadata type per layout of a pass.

The runner builds one per call; every layer reads it, and the model's `AttentionSet` picks the attention
backend registered for its type (`backends.attention.base`). None of them holds the KV arena:
layers get their cache as plain views (`DecoderModel.hidden_states`'s `caches`, one `(keys, values)`
pair of `[slots, kv_heads, head_dim]` per layer), and a decode step's read views arrive ready-made in
`Decode.runs`. Flat slot numbers are the arena's addressing
(glossary: docs/architecture.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashx_batch.backends.cpu_decode import RowExtents


def split_rows(lengths: tuple[int, ...], *packed: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """Packed [1, N, ...] tensors cut into their rows, in order: one batch [B, n, ...] when every row
    has n tokens (one kernel call for all), else one [1, n_r, ...] slice per row."""
    if len(set(lengths)) == 1:
        return [tuple(t[0].view(len(lengths), lengths[0], *t.shape[2:]) for t in packed)]
    bounds = torch.tensor((0, *lengths)).cumsum(0).tolist()
    return [tuple(t[:, a:b] for t in packed) for a, b in zip(bounds, bounds[1:])]


@dataclass
class TeacherForced:
    """Teacher-forced rows right-padded to T, causal attention over the rows' own keys; writes no
    cache (quality measurements, parity tests, quantization sensitivity, log-likelihoods).

    `visible` [B, T, T] (bool, query sees key) replaces the causal mask: a row holding a token tree
    (a context followed by several continuations, each attending to the context and to itself, at
    positions given by `cos` / `sin`); `window_visible` is the same within a sliding layer's window."""

    cos: torch.Tensor  # [B or 1, T, 1, rotary_dim]
    sin: torch.Tensor
    last_only: bool = False  # never: a score wants every position
    visible: torch.Tensor | None = None
    window_visible: torch.Tensor | None = None


@dataclass
class FinalLayerInputs:
    """What the final layer of a `last_only` packed prefill computed for every token, kept so that
    the hidden states of chosen positions can follow afterwards (`DecoderModel.final_hidden_at`):
    segment-sparse asks for the surprisal of the few groups it would compress, not of every token."""

    residual: torch.Tensor | None = None  # [1, N, hidden]: the final layer's input
    q: torch.Tensor | None = None  # [1, N, H, D] post-RoPE queries
    k: torch.Tensor | None = None  # [1, N, Hkv, D] post-RoPE keys
    v: torch.Tensor | None = None  # [1, N, Hkv, D]


@dataclass
class Packed:
    """Rows' prompts end to end in one [1, N] sequence, no padding: token t goes to flat slot
    `write_flat[t]`; each row attends causally to its own `row_lengths[r]` tokens only, so the
    matmuls run on N real tokens instead of B x longest. With `last_only` the final layer computes
    attention, o_proj and MLP for each row's last token only (it still writes every token's K and V;
    the caller wants last-token logits). With `observe`, each layer adds the attention each row's last
    `observe` queries pay its keys to `scores` [N] (segment-sparse compression). With `final`, a
    `last_only` pass keeps the final layer's inputs there."""

    cos: torch.Tensor
    sin: torch.Tensor
    write_flat: torch.Tensor  # [N]
    row_lengths: tuple[int, ...]
    last_only: bool = False
    observe: int = 0
    scores: torch.Tensor | None = None
    final: FinalLayerInputs | None = None  # filled by a last_only pass: later positions on demand

    def last_tokens(self, device: torch.device) -> torch.Tensor:
        """Sequence positions of each row's last token."""
        return torch.tensor(self.row_lengths, device=device).cumsum(0) - 1


@dataclass
class Decode:
    """One new token per row: row i writes flat slot `write_flat[i]`; each run of rows in `runs`
    reads its own strided view of the cache (stripes, or extents of their own), and `attn_mask`
    [B, 1, 1, L] (float, carrying merged slots' log-count bias) hides the slots past each row of a
    run whose rows differ in length."""

    cos: torch.Tensor
    sin: torch.Tensor
    write_flat: torch.Tensor  # [B]
    attn_mask: torch.Tensor | None
    # per run of rows: (first row, end row, keys and values of every layer [layers, 2, rows, Hkv, slots, D],
    # slots the mask covers or None: every row of the run that long, no mask)
    runs: tuple[tuple[int, int, torch.Tensor, int | None], ...]
    window_mask: torch.Tensor | None = None  # sliding layers: [B, 1, 1, L], each row's last `window` slots
    last_only: bool = False
    # rows in extents of their own (`cpu_decode.RowExtents`, built on the host and checked once per step): a
    # backend that can (the CPU kernels, `triton_decode`) reads every row in one call from these, not one per run
    row_extents: RowExtents | None = None


@dataclass
class Extend:
    """One row: a chunk of C tokens appended after `cached` slots of a flat region starting at slot
    `start` (rolling merge, the quality harness). `mask` [1, 1, C, cached + C] is None for a plain
    causal chunk with nothing cached. `last_only` / `observe` / `scores` [cached + C] as in `Packed`."""

    cos: torch.Tensor
    sin: torch.Tensor
    start: int
    cached: int
    mask: torch.Tensor | None = None
    window_mask: torch.Tensor | None = None  # sliding layers: [1, 1, C, cached + C], the band of each query
    last_only: bool = False
    observe: int = 0
    scores: torch.Tensor | None = None

    def last_tokens(self, device: torch.device) -> torch.Tensor:
        return torch.tensor([-1], device=device)


@dataclass
class Paged:
    """Rows read through per-row slot tables (shared prefix segments + their own), any T: token t of
    row b is written to flat slot `write_slots[b, t]`; keys are gathered from `slot_table` [B, L]
    (position j -> flat slot) and `attn_mask` [B, 1, T, L] hides the rest."""

    cos: torch.Tensor
    sin: torch.Tensor
    write_slots: torch.Tensor  # [B, T]
    slot_table: torch.Tensor  # [B, L]
    attn_mask: torch.Tensor
    window_mask: torch.Tensor | None = None  # sliding layers: attn_mask within each query's window
    last_only: bool = False


@dataclass
class PackedTrees:
    """Teacher-forced rows end to end in one [1, N] sequence, no padding, no cache (log-likelihood
    scoring): row r is the next `row_lengths[r]` tokens and attends causally to its own keys, except
    the queries of `trees[r]` = (row-local query indices [n], visible [n, len_r] bool): a token tree's
    continuations after its first, which see the context and their own earlier tokens only. A row's
    first continuation follows the context directly, so its queries are plain causal ones."""

    cos: torch.Tensor  # [1, N, 1, rotary_dim]
    sin: torch.Tensor
    row_lengths: tuple[int, ...]
    trees: tuple[tuple[torch.Tensor, torch.Tensor] | None, ...]
    last_only: bool = False


ForwardMeta = TeacherForced | Packed | Decode | Extend | Paged | PackedTrees
