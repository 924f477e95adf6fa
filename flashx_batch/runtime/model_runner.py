"""The model runner owns the device: weights, the KV arena, RoPE tables, forward passes.

Called by `Engine` once per prefill and once per decode step. It never decides which rows run
or when they stop — that is the engine's bookkeeping — so a backend can swap its kernels here
without touching the batching logic.
"""

from __future__ import annotations

import torch

from flashx_batch.models.decoder import DecoderModel, ForwardContext
from flashx_batch.runtime.decode_graphs import DecodeGraphs
from flashx_batch.runtime.kv import KVArena


class ModelRunner:
    def __init__(self, model: DecoderModel, arena: KVArena, pad_id: int = 0) -> None:
        self.model = model
        self.arena = arena
        self.device = model.embed.device
        self.pad_id = pad_id
        self._slot_range = torch.arange(arena.row_capacity, device=self.device)
        self.graphs: DecodeGraphs | None = None  # striped decode steps from CUDA graphs (`Engine` sets it)

    def _prefill_inputs(self, prompts: list[list[int]]) -> tuple[torch.Tensor, ForwardContext]:
        """Right-padded ids [B, T] for teacher-forced scoring (every position's logits)."""
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        positions = self._slot_range[:width][None, :]  # [1, T], broadcast over rows
        cos, sin = self.model.rotary.lookup(positions)
        return ids.to(self.device), ForwardContext("prefill", cos, sin)

    @torch.inference_mode()
    def prefill_packed(self, prompts: list[list[int]], first_row: int = 0) -> torch.Tensor:
        """Prompts packed end to end, no padding, into stripes first_row, first_row + 1, ...
        -> last-token logits [B, V] (rows of one length attend as one batch)."""
        starts = [(first_row + r) * self.arena.row_capacity for r in range(len(prompts))]
        return self.prefill_packed_at(prompts, starts)[0]

    @torch.inference_mode()
    def prefill_packed_at(self, prompts: list[list[int]], starts: list[int], observe: int = 0
                          ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """Packed prefill with row r's KV written to flat slots starts[r], starts[r] + 1, ...
        -> (last-token logits [B, V], and with `observe` each row's pooled window scores [len_r])."""
        lengths = [len(p) for p in prompts]
        ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=self.device)[None]
        positions = torch.cat([self._range(n) for n in lengths])
        first_slots = torch.repeat_interleave(torch.tensor(starts, device=self.device),
                                              torch.tensor(lengths, device=self.device))
        cos, sin = self.model.rotary.lookup(positions[None])
        scores = torch.zeros(len(positions), device=self.device) if observe else None
        ctx = ForwardContext("packed", cos, sin, write_flat=first_slots + positions, row_lengths=tuple(lengths),
                             last_only=True, observe=observe, scores=scores)
        logits = self.model.logits(self.model.hidden_states(ids, ctx, self.arena)[0])  # [B, hidden] -> [B, V]
        return logits, (list(scores.split(lengths)) if observe else None)

    @torch.inference_mode()
    def score(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """Teacher-forced logits for every position of every prompt: list of [T_i, V] float32."""
        ids, ctx = self._prefill_inputs(prompts)
        hidden = self.model.hidden_states(ids, ctx, self.arena)
        return [self.model.logits(hidden[i, : len(p)]) for i, p in enumerate(prompts)]

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, kv_len: int,
               write_slots: torch.Tensor | None = None, aligned: bool = False,
               groups: tuple[tuple[int, int, int], ...] | None = None) -> torch.Tensor:
        """One step: tokens [B] at RoPE positions [B] (row i = stripe i) -> logits [B, V].

        `write_slots` (default = positions) differ from positions once a row's KV is merged; then
        the mask also carries each slot's log-count bias from the arena. `aligned`: every row writes
        slot kv_len - 1 (rows of one length stepping together), so every slot is visible: no mask.
        `groups` (see `batches.attention_groups`): attend in runs of rows (start, end, slots read);
        only rows of mixed lengths are split, so `aligned` (no mask) never comes with groups.
        With `graphs` set, the step runs from a CUDA graph at padded shapes (groups are not needed
        there) unless the graphs hand it back (see `DecodeGraphs.decode`).
        """
        if self.graphs is not None:
            logits = self.graphs.decode(tokens, positions, kv_len, write_slots)
            if logits is not None:
                return logits
        mask = None if aligned and write_slots is None else self.stripe_mask(positions, write_slots, kv_len)
        cap = self.arena.row_capacity  # stripe i begins at flat slot i * cap
        runs = tuple((a, b, a * cap, cap, n, mask is None) for a, b, n in groups or ((0, len(tokens), kv_len),))
        write_flat = self.arena.stripe_starts()[: len(tokens)] + (positions if write_slots is None else write_slots)
        return self.model.logits(self._step(tokens, positions, write_flat, mask, runs))

    def stripe_mask(self, positions: torch.Tensor, write_slots: torch.Tensor | None, kv_len: int) -> torch.Tensor:
        """Additive mask [B, 1, 1, kv_len] for rows 0..B-1 of the stripes: slots past each row's new one
        hidden; once rows are merged (`write_slots`), visible slots also carry the arena's log-count bias."""
        if write_slots is None:
            return self._visible(kv_len, positions)
        bias = self.arena.stripe_bias()[: len(positions), :kv_len]
        mask = bias.masked_fill(self._range(kv_len)[None, :] > write_slots[:, None], float("-inf"))
        return mask.to(self.arena.storage.dtype)[:, None, None, :]

    @torch.inference_mode()
    def decode_runs(self, tokens: torch.Tensor, positions: torch.Tensor, starts: torch.Tensor,
                    runs: tuple[tuple[int, int, int, int, int, bool], ...]) -> torch.Tensor:
        """One step for rows in extents of their own (`batches.ExtentBatch`): row i's cache begins at
        flat slot starts[i] and its new token goes to slot positions[i] of it; attention reads the
        `runs` (`batches.extent_runs`) -> logits [B, V]."""
        mask = None
        if not all(run[-1] for run in runs):  # some run holds rows of different lengths
            mask = self._visible(max(run[4] for run in runs), positions)
        return self.model.logits(self._step(tokens, positions, starts + positions, mask, runs))

    def _step(self, tokens: torch.Tensor, positions: torch.Tensor, write_flat: torch.Tensor,
              mask: torch.Tensor | None, runs: tuple[tuple[int, int, int, int, int, bool], ...]) -> torch.Tensor:
        """The decode forward up to the final norm -> hidden [B, hidden]: each run of rows (first row,
        end row, first flat slot, stride, slots read, aligned) attends through one strided view of the
        cache; `mask` [B, 1, 1, L] hides the slots past each row of a run that is not aligned."""
        cos, sin = self.model.rotary.lookup(positions[:, None])
        # each run's keys and values of every layer as one view [layers, 2, rows, Hkv, slots, D], built
        # once per step (not per layer: a few microseconds per view, rows x layers of them)
        storage = self.arena.storage
        layers, _, _, heads, dim = storage.shape
        views = []
        for a, b, first, stride, slots, aligned in runs:
            kv = storage[:, :, first : first + (b - a) * stride].view(layers, 2, b - a, stride, heads, dim)
            views.append((a, b, kv[:, :, :, :slots].transpose(3, 4), None if aligned else slots))
        ctx = ForwardContext("decode", cos, sin, write_flat=write_flat, attn_mask=mask, runs=tuple(views))
        return self.model.hidden_states(tokens[:, None], ctx, self.arena)[:, 0]

    def _visible(self, kv_len: int, last: torch.Tensor) -> torch.Tensor:
        """Additive mask [B, 1, 1, kv_len]: 0 up to each row's `last` slot, -inf after (built once
        per step, so no layer converts a boolean mask again)."""
        hidden = self._range(kv_len)[None, :] > last[:, None]
        zeros = torch.zeros(hidden.shape, dtype=self.arena.storage.dtype, device=self.device)
        return zeros.masked_fill_(hidden, float("-inf"))[:, None, None, :]

    @torch.inference_mode()
    def extend(self, tokens: list[int], start: int, cached: int, first_position: int, observe: int = 0,
               all_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append `tokens` to one row's flat region at `start`, after `cached` slots already there.

        Cached slots are all visible, with their log-count bias; the new tokens attend causally.
        Returns logits (last position, or every position with `all_logits`) and, when `observe` > 0,
        the pooled attention the last `observe` queries paid to each slot.
        """
        count = len(tokens)
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        positions = torch.arange(first_position, first_position + count, device=self.device)[None, :]
        cos, sin = self.model.rotary.lookup(positions)
        mask = None
        if cached:
            dtype = self.arena.storage.dtype
            causal = torch.full((count, count), float("-inf"), device=self.device).triu(1)
            bias = self.arena.bias[start : start + cached][None, :].expand(count, cached)
            mask = torch.cat((bias, causal), dim=1)[None, None].to(dtype)  # [1, 1, C, cached + C]
        scores = torch.zeros(cached + count, device=self.device) if observe else None
        ctx = ForwardContext("extend", cos, sin, start=start, cached=cached, extend_mask=mask, observe=observe,
                             scores=scores, last_only=not all_logits)
        hidden = self.model.hidden_states(ids, ctx, self.arena)[0]  # [C, hidden], or [1, hidden] for the last
        self.arena.bias[start + cached : start + cached + count] = 0.0
        return self.model.logits(hidden), ctx.scores

    @torch.inference_mode()
    def paged(self, tokens: torch.Tensor, positions: torch.Tensor, write_slots: torch.Tensor,
              slot_table: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """Rows reading through slot tables (shared prefix segments): tokens / positions / write_slots
        [B, T], slot_table [B, L] with L > every position; returns logits at column `last` [B] -> [B, V]."""
        cos, sin = self.model.rotary.lookup(positions)
        kv_len = slot_table.shape[1]
        mask = (self._range(kv_len)[None, None, :] <= positions[:, :, None])[:, None]  # [B, 1, T, L]
        ctx = ForwardContext("paged", cos, sin, write_slots=write_slots, slot_table=slot_table, attn_mask=mask)
        hidden = self.model.hidden_states(tokens, ctx, self.arena)
        return self.model.logits(hidden[torch.arange(len(tokens), device=self.device), last])

    def _range(self, n: int) -> torch.Tensor:
        if n > len(self._slot_range):
            self._slot_range = torch.arange(n, device=self.device)
        return self._slot_range[:n]

    def move_row(self, src: int, dst: int, length: int) -> None:
        self.arena.move_stripe(src, dst, length)
