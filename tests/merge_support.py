"""A check shared by the production merge tests and the ablation tests."""

from __future__ import annotations

import torch

from flashx_batch.kvcache.arena import KVArena
from flashx_batch.kvcache.spec import LayerCache
from flashx_batch.runtime.kv_merge import _apply_any, apply_plan


def assert_dense_path_equals_scatter(plans, length: int, rotary) -> None:
    """`apply_plan` reduces 4:1 groups densely; for each plan it must leave the same cache as the general
    scatter-add path (same random cache before, keys re-rotated with `rotary` when given)."""
    for plan in plans:
        caches = []
        for dense in (True, False):
            arena = KVArena((LayerCache("kv", 2, 2, 16),) * 2, num_slots=length, dtype=torch.float32,
                            device=torch.device("cpu"))
            arena.storage.copy_(torch.randn(arena.storage.shape, generator=torch.Generator().manual_seed(5)))
            if dense:
                apply_plan(arena, 0, length, 0, plan, rotary=rotary)
            else:
                kept = (plan.target >= 0).nonzero().squeeze(1)
                _apply_any(arena, 0, length, 0, plan, kept, rotary, None)
            caches.append(arena.storage[:, :, : plan.num_slots].clone())
        assert torch.allclose(caches[0], caches[1], atol=1e-6), plan.counts[:12]
