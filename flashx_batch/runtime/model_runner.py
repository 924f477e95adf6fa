"""The model runner owns the device: weights, the KV arena, RoPE tables, forward passes.

Called by `Engine` once per prefill and once per decode step. It never decides which rows run
or when they stop — that is the engine's bookkeeping — so a backend can swap its kernels here
without touching the batching logic.
"""

from __future__ import annotations

import torch

from flashx_batch.models.decoder import DecoderModel, ForwardContext
from flashx_batch.runtime.kv import KVArena


class ModelRunner:
    def __init__(self, model: DecoderModel, arena: KVArena, pad_id: int = 0) -> None:
        self.model = model
        self.arena = arena
        self.device = model.embed.device
        self.pad_id = pad_id
        self._slot_range = torch.arange(arena.row_capacity, device=self.device)

    def _prefill_inputs(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, ForwardContext]:
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        positions = self._slot_range[:width][None, :]  # [1, T], broadcast over rows
        cos, sin = self.model.rotary.lookup(positions)
        return ids.to(self.device), lengths, ForwardContext(True, cos, sin, positions)

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        """Right-padded prefill of rows 0..B-1 into stripes 0..B-1 -> last-token logits [B, V]."""
        ids, lengths, ctx = self._prefill_inputs(prompts)
        hidden = self.model.hidden_states(ids, ctx, self.arena)  # [B, T, hidden]
        last = hidden[torch.arange(len(prompts), device=self.device), lengths - 1]
        return self.model.logits(last)

    @torch.inference_mode()
    def score(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """Teacher-forced logits for every position of every prompt: list of [T_i, V] float32."""
        ids, _, ctx = self._prefill_inputs(prompts)
        hidden = self.model.hidden_states(ids, ctx, self.arena)
        return [self.model.logits(hidden[i, : len(p)]) for i, p in enumerate(prompts)]

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, kv_len: int) -> torch.Tensor:
        """One step: tokens [B] at positions [B] (row i = stripe i) -> logits [B, V]."""
        cos, sin = self.model.rotary.lookup(positions[:, None])
        mask = (self._slot_range[:kv_len][None, :] <= positions[:, None])[:, None, None, :]
        ctx = ForwardContext(False, cos, sin, positions, kv_len, mask)
        hidden = self.model.hidden_states(tokens[:, None], ctx, self.arena)
        return self.model.logits(hidden[:, 0])

    def move_row(self, src: int, dst: int, length: int) -> None:
        self.arena.move_stripe(src, dst, length)
