"""`ForwardPasses`: the model's forward passes over the KV arena — packed prefill, chunk extension,
decode steps over stripes and extents, paged batches — for the torch runner, the compressed prefill
and the decode graphs, none of which calls back into another.

It owns the model, the arena's per-layer views, the position tables the passes read and each pass's
attention metadata (`backends.attention.meta`); the model's `AttentionSet` runs the attention. It
never samples and never decides which rows run (`torch_runner.TorchRunner` and the scheduler do).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from flashx_batch.backends import Backend, cpu_decode
from flashx_batch.backends.attention.meta import Decode, Extend, FinalLayerInputs, Packed, Paged
from flashx_batch.kvcache.arena import KVArena
from flashx_batch.models.decoder import DecoderModel
from flashx_batch.models.lora import RowAdapters
from flashx_batch.quant.int8_decode import MAX_ROWS as FUSED_MAX_ROWS
from flashx_batch.quant.int8_decode import Int8Decode, Reads


class ForwardPasses:
    def __init__(self, model: DecoderModel, arena: KVArena, backend: Backend, row_capacity: int,
                 fuse_int8_decode: bool = True, graphs: Callable[[ForwardPasses], Any] | None = None) -> None:
        """`row_capacity`: slots of a full-length row (whole segments). `fuse_int8_decode`: an all-int8
        model's host decode steps in a few compiled calls a layer (`quant.int8_decode`); False runs them
        module by module. `graphs`: builds the decode-graph runner (`runtime.decode_graphs.DecodeGraphs`)
        striped decode steps replay from; None: every step eager."""
        self.model, self.arena, self.backend, self.row_capacity = model, arena, backend, row_capacity
        self.device = model.embed.device
        self.caches = arena.layer_views()
        self.window = model.config.sliding_window  # sliding layers' window (None: every layer attends in full)
        self.fuse_int8_decode = fuse_int8_decode
        self._slot_range = torch.arange(row_capacity, device=self.device)
        self._starts: dict[int, torch.Tensor] = {}  # stripe capacity -> flat slot where each stripe begins
        self._fused: tuple[tuple, Int8Decode | None] | None = None  # (what it was built over, the step)
        self.graphs = graphs(self) if graphs is not None else None

    def forget_fused(self) -> None:
        """Drop the fused int8 step: built again at the next decode step (after a failed plan)."""
        self._fused = None

    def prefill_packed(self, prompts: list[list[int]], first_row: int = 0, capacity: int | None = None,
                       adapters: RowAdapters | None = None) -> torch.Tensor:
        """Prompts packed end to end, no padding, into stripes first_row, first_row + 1, ... of
        `capacity` slots (default: a full-length row's, whole segments) -> last-token logits [B, V]."""
        cap = capacity or self.row_capacity
        starts = [(first_row + r) * cap for r in range(len(prompts))]
        return self.prefill_packed_at(prompts, starts, adapters=adapters)[0]

    @torch.inference_mode()
    def prefill_packed_at(self, prompts: list[list[int]], starts: list[int], observe: int = 0,
                          keep_final: bool = False, adapters: RowAdapters | None = None
                          ) -> tuple[torch.Tensor, list[torch.Tensor] | None, tuple[Packed, torch.Tensor] | None]:
        """Packed prefill with row r's KV written to flat slots starts[r], starts[r] + 1, ...
        -> (last-token logits [B, V], with `observe` each row's pooled window scores [len_r], with
        `keep_final` the pass's metadata holding its final layer's inputs and the packed ids [N]: what
        `Scorer.probe` asks any of the prompts' tokens' surprisal from, on demand)."""
        lengths = [len(p) for p in prompts]
        ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=self.device)[None]
        positions = torch.cat([self.arange(n) for n in lengths])
        first_slots = torch.repeat_interleave(torch.tensor(starts, device=self.device),
                                              torch.tensor(lengths, device=self.device))
        cos, sin = self.model.rotary.lookup(positions[None])
        scores = torch.zeros(len(positions), device=self.device) if observe else None
        meta = Packed(cos, sin, write_flat=first_slots + positions, row_lengths=tuple(lengths),
                      last_only=True, observe=observe, scores=scores,
                      final=FinalLayerInputs() if keep_final else None)
        hidden = self.model.hidden_states(ids, meta, self.caches, adapters)[0]  # [B, hidden]: each row's last token
        logits = self.model.logits(hidden)  # [B, V]
        kept = (meta, ids[0]) if keep_final else None
        return logits, (list(scores.split(lengths)) if observe else None), kept

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
        window = None
        if self.window:  # sliding layers: query t (position cached + t) sees slots (cached + t - window, cached + t]
            keys, queries = self.arange(cached + count), self.arange(count) + cached
            outside = (keys[None, :] > queries[:, None]) | (keys[None, :] <= queries[:, None] - self.window)
            base = mask if mask is not None else torch.zeros(1, 1, count, cached + count, device=self.device,
                                                               dtype=self.arena.storage.dtype)
            window = base.masked_fill(outside[None, None], float("-inf"))
        meta = Extend(cos, sin, start=start, cached=cached, mask=mask, window_mask=window, observe=observe,
                      scores=scores,
                      last_only=not all_logits)
        hidden = self.model.hidden_states(ids, meta, self.caches)[0]  # [C, hidden], or [1, hidden] for the last
        self.arena.clear_bias(start + cached, start + cached + count)
        return self.model.logits(hidden), meta.scores

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, kv_len: int, capacity: int, stripes: int,
               write_slots: torch.Tensor | None = None, aligned: bool = False,
               groups: tuple[tuple[int, int, int], ...] | None = None, adapters: RowAdapters | None = None
               ) -> torch.Tensor:
        """One step: tokens [B] at RoPE positions [B], row i in stripe i of `stripes` stripes of
        `capacity` slots -> logits [B, V].

        `write_slots` (default = positions) differ from positions once a row's KV is merged; then
        the mask also carries each slot's log-count bias from the arena. `aligned`: every row writes
        slot kv_len - 1 (rows of one length stepping together), so every slot is visible: no mask (for
        merged rows too while the arena holds no merge bias: `KVArena.has_merge_bias`).
        `groups` (see `layouts.stripes.attention_groups`): attend in runs of rows (start, end, slots
        read); only rows of mixed lengths are split, so `aligned` (no mask) never comes with groups.
        With `graphs` set, the step runs from a CUDA graph at padded shapes (groups are not needed
        there) unless the graphs hand it back (see `DecodeGraphs.decode`). `adapters`: each row's LoRA
        adapter (`models.lora`; graphs never hold them: such a step runs eager).
        """
        if self.graphs is not None and adapters is None:
            logits = self.graphs.decode(tokens, positions, kv_len, write_slots, capacity, stripes)
            if logits is not None:
                return logits
        # aligned rows see every slot: no mask, unless merged slots carry a bias (evicting leaves none)
        plain = aligned and (write_slots is None or not self.arena.has_merge_bias)
        mask = None if plain else self.stripe_mask(positions, write_slots, kv_len, capacity)
        runs = tuple((a, b, a * capacity, capacity, n, mask is None)
                     for a, b, n in groups or ((0, len(tokens), kv_len),))
        write_flat = self.stripe_starts(capacity, stripes)[: len(tokens)]
        write_flat = write_flat + (positions if write_slots is None else write_slots)
        return self.model.logits(self.step_hidden(tokens, positions, write_flat, mask, runs, adapters=adapters))

    def stripe_starts(self, capacity: int, stripes: int) -> torch.Tensor:
        """[stripes] flat slot where each stripe of `capacity` slots begins (built once per capacity)."""
        starts = self._starts.get(capacity)
        if starts is None:
            fits = self.arena.num_slots // capacity
            starts = self._starts[capacity] = torch.arange(fits, device=self.device) * capacity
        return starts[:stripes]

    def stripe_mask(self, positions: torch.Tensor, write_slots: torch.Tensor | None, kv_len: int,
                    capacity: int) -> torch.Tensor:
        """Additive mask [B, 1, 1, kv_len] for rows 0..B-1 of the stripes: slots past each row's new one
        hidden; once rows are merged (`write_slots`), visible slots also carry the arena's log-count bias."""
        if write_slots is None:
            return self.visible(kv_len, positions)
        bias = self.arena.stripe_bias(len(positions), capacity)[:, :kv_len]
        mask = bias.masked_fill(self.arange(kv_len)[None, :] > write_slots[:, None], float("-inf"))
        return mask.to(self.arena.storage.dtype)[:, None, None, :]

    @torch.inference_mode()
    def decode_runs(self, tokens: torch.Tensor, positions: torch.Tensor, starts: torch.Tensor,
                    runs: tuple[tuple[int, int, int, int, int, bool], ...], extents: cpu_decode.RowExtents,
                    adapters: RowAdapters | None = None) -> torch.Tensor:
        """One step for rows in extents of their own: row i's cache begins at flat slot starts[i] and its
        new token goes to slot positions[i] of it; attention reads the `runs`
        (`layouts.extents.extent_runs`), or every row at once from `extents` (the same starts and lengths, built
        on the host from the plan: no read-back from the device) where its backend can -> logits [B, V]."""
        mask = None
        if not all(run[-1] for run in runs):  # some run holds rows of different lengths
            mask = self.visible(max(run[4] for run in runs), positions)
        return self.model.logits(self.step_hidden(tokens, positions, starts + positions, mask, runs, extents, adapters))

    def step_hidden(self, tokens: torch.Tensor, positions: torch.Tensor, write_flat: torch.Tensor,
                    mask: torch.Tensor | None, runs: tuple[tuple[int, int, int, int, int, bool], ...],
                    extents: cpu_decode.RowExtents | None = None, adapters: RowAdapters | None = None
                    ) -> torch.Tensor:
        """The decode forward up to the final norm -> hidden [B, hidden]: each run of rows (first row,
        end row, first flat slot, stride, slots read, aligned) attends through one strided view of the
        cache; `mask` [B, 1, 1, L] hides the slots past each row of a run that is not aligned.
        `extents` (each row's first flat slot and its slots read): where the attention can, it reads
        all rows in one call from these instead (`Decode.row_extents`), and an all-int8 model runs the
        step fused (`quant.int8_decode`) where it can."""
        if (extents is not None and adapters is None and len(tokens) <= FUSED_MAX_ROWS
                and (fused := self.int8_decode()) is not None):
            return fused.hidden(tokens, positions, write_flat, Reads.extents(extents))
        cos, sin = self.model.rotary.lookup(positions[:, None])
        # each run's cache of every layer as one view [layers, parts, rows, heads, slots, D] (parts: keys
        # and values, or one latent), built once per step (not per layer: a few microseconds per view,
        # rows x layers of them)
        storage = self.arena.storage
        layers, parts, _, heads, dim = storage.shape
        views = []
        for a, b, first, stride, slots, aligned in runs:
            kv = storage[:, :, first : first + (b - a) * stride].view(layers, parts, b - a, stride, heads, dim)
            views.append((a, b, kv[:, :, :, :slots].transpose(3, 4), None if aligned else slots))
        # sliding layers: each row's last `window` slots (slots are positions: such models keep every token)
        window = self.visible(max(run[4] for run in runs), positions, self.window) if self.window else None
        meta = Decode(cos, sin, write_flat=write_flat, attn_mask=mask, runs=tuple(views), window_mask=window,
                      row_extents=extents)
        return self.model.hidden_states(tokens[:, None], meta, self.caches, adapters)[:, 0]

    def int8_decode(self) -> Int8Decode | None:
        """The fused int8 decode step for the model as it is now (built again once a module or cache was
        swapped, e.g. by a precision change), or None where it does not serve it."""
        if not self.fuse_int8_decode:
            return None
        key = Int8Decode.fingerprint(self.model, self.caches)
        if self._fused is None or self._fused[0] != key:
            self._fused = (key, Int8Decode.build(self.model, self.caches))
        return self._fused[1]

    @torch.inference_mode()
    def paged(self, tokens: torch.Tensor, positions: torch.Tensor, write_slots: torch.Tensor,
              slot_table: torch.Tensor, last: torch.Tensor, adapters: RowAdapters | None = None) -> torch.Tensor:
        """Rows reading through slot tables (shared prefix segments): tokens / positions / write_slots
        [B, T], slot_table [B, L] with L > every position; returns logits at column `last` [B] -> [B, V]."""
        cos, sin = self.model.rotary.lookup(positions)
        kv_len = slot_table.shape[1]
        mask = (self.arange(kv_len)[None, None, :] <= positions[:, :, None])[:, None]  # [B, 1, T, L]
        window = None
        if self.window:  # sliding layers: only each query's last `window` positions
            window = mask & (self.arange(kv_len)[None, None, :] > positions[:, :, None] - self.window)[:, None]
        meta = Paged(cos, sin, write_slots=write_slots, slot_table=slot_table, attn_mask=mask, window_mask=window)
        hidden = self.model.hidden_states(tokens, meta, self.caches, adapters)
        return self.model.logits(hidden[torch.arange(len(tokens), device=self.device), last])

    @torch.inference_mode()
    def paged_decode(self, tokens: torch.Tensor, positions: torch.Tensor, table: torch.Tensor, kv_len: int,
                     adapters: RowAdapters | None = None) -> torch.Tensor:
        """One decode step of rows reading through slot tables: tokens [B], positions [B, 1], table
        [B, L], `kv_len` past every position -> logits [B, V] (an all-int8 model's step fused where the
        host kernels serve it)."""
        writes = table.gather(1, positions)
        if (self.backend.host_kernels and adapters is None and len(writes) <= FUSED_MAX_ROWS
                and (fused := self.int8_decode()) is not None):
            reads = Reads.paged(table[:, :kv_len], positions[:, 0])
            return self.model.logits(fused.hidden(tokens, positions[:, 0], writes[:, 0], reads))
        last = torch.zeros(len(positions), dtype=torch.long, device=self.device)
        return self.paged(tokens[:, None], positions, writes, table[:, :kv_len], last, adapters)

    def visible(self, kv_len: int, last: torch.Tensor, window: int | None = None) -> torch.Tensor:
        """Additive mask [B, 1, 1, kv_len]: 0 up to each row's `last` slot (and, with `window`, from
        `last - window + 1` on), -inf elsewhere (built once per step, so no layer converts a boolean
        mask again)."""
        slots = self.arange(kv_len)[None, :]
        hidden = slots > last[:, None]
        if window is not None:
            hidden |= slots <= last[:, None] - window
        zeros = torch.zeros(hidden.shape, dtype=self.arena.storage.dtype, device=self.device)
        return zeros.masked_fill_(hidden, float("-inf"))[:, None, None, :]

    def arange(self, n: int) -> torch.Tensor:
        if n > len(self._slot_range):
            self._slot_range = torch.arange(n, device=self.device)
        return self._slot_range[:n]
