"""Mixture-of-experts MLP: a router picks `top_k` experts per token; tokens are grouped by expert and
each active expert runs one matmul over all of its tokens (no per-token loop). Each expert count is
read back to the host once per layer (a Python loop over the active experts): no CUDA graphs, no ONNX
export for these models yet; a fixed-shape grouped matmul would lift both.

Expert weights live stacked, `[experts, 2 x intermediate, hidden]` (gate and up fused) and
`[experts, hidden, intermediate]`, filled straight from the checkpoint's per-expert tensors by the
loader. The router is a plain matmul, never a packed one: near-tied experts must be chosen as the
reference implementation chooses them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashx_batch.backends import on_host
from flashx_batch.backends.cpu import onednn_linear, onednn_pack
from flashx_batch.models.config import MoESpec
from flashx_batch.models.layers import GatedMLP, Linear


class SparseMoE(nn.Module):
    cpu_packable = True  # the CPU backend's `prepare_model` calls `pack` where oneDNN takes the experts' dtype

    def __init__(self, spec: MoESpec, hidden: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.spec = spec
        experts, inter = spec.num_experts, spec.intermediate
        # sigmoid routers score in float32 whatever the model's dtype (as the reference keeps them)
        router_dtype = torch.float32 if spec.sigmoid else dtype
        self.router = nn.Parameter(torch.empty(experts, hidden, dtype=router_dtype, device=device), requires_grad=False)
        self.router_bias = (nn.Parameter(torch.empty(experts, dtype=torch.float32, device=device), requires_grad=False)
                            if spec.sigmoid else None)
        self.experts_gate_up = nn.Parameter(torch.empty(experts, 2 * inter, hidden, dtype=dtype, device=device),
                                            requires_grad=False)
        self.experts_down = nn.Parameter(torch.empty(experts, hidden, inter, dtype=dtype, device=device),
                                         requires_grad=False)
        self.shared = GatedMLP(hidden, spec.shared_intermediate, dtype, device) if spec.shared_intermediate else None
        self.shared_gate = Linear(1, hidden, False, dtype, device) if spec.shared_gate else None
        self.packed: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # CPU: per expert, see `pack`

    @property
    def pack_dtype(self) -> torch.dtype | None:
        """The dtype `pack` would pack (None off the CPU)."""
        return self.experts_gate_up.dtype if on_host(self.experts_gate_up) else None

    def pack(self) -> None:
        """Keep each expert's two weights in oneDNN's layout as well and multiply through oneDNN's linear
        (`models.layers.Linear.pack`: the same kernels, the same reasons). The router stays a plain
        matmul (module docstring)."""
        self.packed = [(onednn_pack(self.experts_gate_up[e]), onednn_pack(self.experts_down[e]))
                       for e in range(self.spec.num_experts)]

    def _expert_linear(self, x: torch.Tensor, expert: int, which: int) -> torch.Tensor:
        """x through expert's gate / up (`which` 0) or down (1) weight: its packed copy where there is one."""
        if self.packed is not None:
            return onednn_linear(x, self.packed[expert][which])
        return F.linear(x, (self.experts_gate_up, self.experts_down)[which][expert])

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> (chosen experts [N, top_k], their weights [N, top_k]): softmax over every
        expert in float32, the top k, renormalised over them with `norm_topk_prob`; or sigmoid routing
        (see `MoESpec`)."""
        if self.spec.sigmoid:
            return self._route_sigmoid(x)
        probs = F.softmax(F.linear(x, self.router), dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(self.spec.top_k, dim=-1)
        if self.spec.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        return chosen, weights.to(x.dtype) if self.spec.weights_in_model_dtype else weights

    def _route_sigmoid(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        spec = self.spec
        scores = F.linear(x.float(), self.router).sigmoid()
        choice = scores + self.router_bias
        if spec.groups > 1:  # only experts of the best groups, a group scored by its two best experts
            grouped = choice.view(-1, spec.groups, spec.num_experts // spec.groups)
            best = grouped.topk(2, dim=-1)[0].sum(dim=-1).topk(spec.topk_groups, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best, True)
            choice = choice.masked_fill(~keep.repeat_interleave(spec.num_experts // spec.groups, dim=1),
                                        float("-inf"))
        chosen = choice.topk(spec.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, chosen)
        if spec.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
        return chosen, weights * spec.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        chosen, weights = self.route(flat)
        # each token's experts summed in float32 and cast once (as the reference's grouped path does)
        out = torch.zeros(flat.shape, dtype=torch.float32, device=flat.device)
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
            gate, up = self._expert_linear(flat[rows], expert, 0).split(inter, dim=-1)
            h = self._expert_linear(F.silu(gate) * up, expert, 1) * slot_weights[start : start + count, None]
            out.index_add_(0, rows, h.float())  # experts in ascending order
            start += count
        out = out.to(flat.dtype)
        if self.shared is not None:
            shared = self.shared.forward(flat)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate.forward(flat)) * shared
            out = out + shared
        return out.view(shape)
