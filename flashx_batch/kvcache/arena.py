"""`KVArena`: device storage for the keys and values of every layer, allocated once.

One tensor `[layers, parts, slots, heads, dim]` shaped by the layers' `spec.LayerCache`s — keys and
values `[layers, 2, slots, kv_heads, head_dim]`, or one latent entry per token for latent attention
`[layers, 1, slots, 1, entry]` — (slot = segment * segment_size + offset, see `geometry`) and a per-slot
merge bias: log(tokens a slot stands for), 0 for an ordinary slot, log 4
for a 4:1 merged one. Nothing here allocates per decode step and nothing here decides where a row
goes: the scheduler does, on `SegmentAllocator` and `ArenaGeometry`, and hands the runner slot
numbers and slot copies.

Model layers never see the arena: they get `layer_views()`, each layer's keys and values as flat
`[slots, heads, dim]` views (one per part), and the runner builds the strided read views per step.
"""

from __future__ import annotations

import torch

from flashx_batch.kvcache.spec import LayerCache, arena_shape


class KVArena:
    def __init__(self, spec: tuple[LayerCache, ...], num_slots: int, dtype: torch.dtype, device: torch.device
                 ) -> None:
        self.num_slots = num_slots
        parts, heads, dim = arena_shape(spec)
        self.storage = torch.zeros(len(spec), parts, num_slots, heads, dim, dtype=dtype, device=device)
        self.bias = torch.zeros(num_slots, dtype=torch.float32, device=device)
        # host-side: False while no slot has ever held a merge bias (evict-only plans write none), so a
        # decode step whose rows all write their last slot needs no mask at all; once True it stays True
        self.has_merge_bias = False
        # per-layer views, built once: slicing the storage anew costs every layer of every step
        self._flat = [tuple(self.storage[layer].unbind(0)) for layer in range(len(spec))]

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()

    def bytes_per_token(self) -> int:
        return self.nbytes // self.num_slots

    def layer_slot_bytes(self) -> int:
        """Bytes of one slot's keys and values in one layer (what attention reads per slot and layer)."""
        return self.bytes_per_token() // self.storage.shape[0]

    def layer_views(self) -> list[tuple[torch.Tensor, ...]]:
        """Per layer, [slots, heads, dim] views of its parts: keys and values, or its latents (what layers write)."""
        return self._flat

    def flat(self, layer: int) -> tuple[torch.Tensor, ...]:
        return self._flat[layer]

    def write_bias(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        """Set the merge bias of flat `slots` to `values` (host tensors: the flag is read from them)."""
        if bool(values.any()):
            self.has_merge_bias = True
        self.bias.index_copy_(0, slots.to(self.bias.device), values.to(self.bias.device, self.bias.dtype))

    def stripe_bias(self, rows: int, capacity: int) -> torch.Tensor:
        """[rows, capacity] log-count bias per slot of stripes 0..rows-1 cut `capacity` slots long."""
        return self.bias[: rows * capacity].view(rows, capacity)

    def move_slots(self, moves) -> None:
        """Copy each (src, dst, n) run of flat slots — keys, values and merge bias, all layers — in
        order. A run that overlaps its own destination is copied out first; the caller orders the
        moves so that no destination overwrites a source still to come."""
        for src, dst, n in moves:
            if src == dst:
                continue
            overlaps = dst < src + n and src < dst + n
            kv, bias = self.storage[:, :, src : src + n], self.bias[src : src + n]
            self.storage[:, :, dst : dst + n] = kv.clone() if overlaps else kv
            self.bias[dst : dst + n] = bias.clone() if overlaps else bias

    def clear_bias(self, start: int, end: int) -> None:
        """No merge bias left in slots [start, end) (where a row's next tokens, or a new row, go)."""
        self.bias[start:end] = 0.0
