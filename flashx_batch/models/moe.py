"""Mixture-of-experts MLP: a router picks `top_k` experts per token; tokens are grouped by expert and
each active expert runs one matmul over all of its tokens (no per-token loop).

Expert weights live stacked, `[experts, 2 x intermediate, hidden]` (gate and up fused) and
`[experts, hidden, intermediate]`, filled straight from the checkpoint's per-expert tensors by the
loader. The router is a plain matmul, never a packed one: near-tied experts must be chosen as the
reference implementation chooses them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashx_batch.models.config import MoESpec
from flashx_batch.models.layers import GatedMLP, Linear


class SparseMoE(nn.Module):
    def __init__(self, spec: MoESpec, hidden: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.spec = spec
        experts, inter = spec.num_experts, spec.intermediate
        self.router = nn.Parameter(torch.empty(experts, hidden, dtype=dtype, device=device), requires_grad=False)
        self.experts_gate_up = nn.Parameter(torch.empty(experts, 2 * inter, hidden, dtype=dtype, device=device),
                                            requires_grad=False)
        self.experts_down = nn.Parameter(torch.empty(experts, hidden, inter, dtype=dtype, device=device),
                                         requires_grad=False)
        self.shared = GatedMLP(hidden, spec.shared_intermediate, dtype, device) if spec.shared_intermediate else None
        self.shared_gate = Linear(1, hidden, False, dtype, device) if spec.shared_gate else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> (chosen experts [N, top_k], their weights [N, top_k]): softmax over every
        expert in float32, the top k, renormalised over them with `norm_topk_prob`."""
        probs = F.softmax(F.linear(x, self.router), dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(self.spec.top_k, dim=-1)
        if self.spec.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        return chosen, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        chosen, weights = self.route(flat)
        out = torch.zeros_like(flat)
        # every (token, choice) pair sorted by expert: each expert's tokens are one contiguous run
        flat_choice = chosen.reshape(-1)
        order = flat_choice.argsort(stable=True)
        tokens, slot_weights = order // self.spec.top_k, weights.reshape(-1)[order]
        counts = torch.bincount(flat_choice, minlength=self.spec.num_experts).tolist()
        inter, start = self.spec.intermediate, 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            rows = tokens[start : start + count]
            gate, up = F.linear(flat[rows], self.experts_gate_up[expert]).split(inter, dim=-1)
            h = F.linear(F.silu(gate) * up, self.experts_down[expert]) * slot_weights[start : start + count, None]
            out.index_add_(0, rows, h.to(out.dtype))  # experts in ascending order, as the reference sums them
            start += count
        if self.shared is not None:
            shared = self.shared.forward(flat)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate.forward(flat)) * shared
            out = out + shared
        return out.view(shape)
