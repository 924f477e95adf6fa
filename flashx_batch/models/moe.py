"""Mixture-of-experts MLP: a router picks `top_k` experts per token; the (token, expert) pairs are sorted
by expert, so each expert's tokens are one contiguous run, and the experts run in one of three ways:

- **decode kernel** (a host call of at most `DECODE_MAX_PAIRS` pairs spread thin over the experts, float32,
  two threads or more): `backends.cpu_moe`, every pair's rows in one compiled call, no per-expert dispatch
  (empty experts cost nothing); see `DECODE_PAIRS_PER_EXPERT` for where it pays.
- **grouped** (few rows per expert: other devices and dtypes, small prefills, decode steps on one thread or
  with pairs dense over the experts): one grouped GEMM per
  projection over all experts at once (`torch._grouped_mm`, the sorted rows and each expert's end offset),
  no host read-back and no Python loop over experts. Same products as the loop, bit for bit, on the CPU.
- **loop** (many rows per expert: prefills): one matmul per active expert on its slice of the stacked weight,
  after reading the expert counts back to the host once per layer. No oneDNN-packed copies of the experts, as
  the dense linears have: they doubled the experts' memory, and on the many-expert benchmarks (prefill and decode
  alternating with another model that evicts the cache) the run was no faster with them.

`GROUPED_MAX_MACS` picks between them by the work of an average expert's call; where this torch has no grouped
GEMM for the device and dtype (probed once), the loop serves every call. No ONNX export for these models yet.

A stacked weight can be replaced by a quantized one (`quantized["gate_up"]` / `quantized["down"]`: the quant
layer's int8 experts, `quant.int8_experts`), any module with `sorted_rows(rows, experts, counts) -> outputs`
over the same expert-sorted rows; the two projections then run one at a time, each in its own format.

Expert weights live stacked, `[experts, 2 x intermediate, hidden]` (gate and up fused) and
`[experts, hidden, intermediate]`, filled straight from the checkpoint's per-expert tensors by the
loader. The router is a plain matmul: near-tied experts must be chosen as the reference implementation
chooses them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashx_batch.backends import cpu_moe, on_host
from flashx_batch.models.config import MoESpec
from flashx_batch.models.layers import GatedMLP, Linear

# multiply-adds of an average expert's gate / up call (pairs / experts x 2 x intermediate x hidden) up to which the
# grouped GEMM runs, the loop past them. Measured on the CPU, one thread, against the loop over stacked slices:
# the grouped form 1.7-2.1x faster at 4 rows an expert; even near 20 rows at intermediate 256 and hidden 256
# (2.6 M) and near 64 rows at intermediate 128 (4.2 M); the loop ~1.5x faster at 160-262 rows
GROUPED_MAX_MACS = 3 << 20
GROUPED_MAX_ROWS = 96  # off the CPU: rows an expert up to which the grouped GEMM runs
# (token, expert) pairs up to which a host call takes the decode kernel (`backends.cpu_moe`): a decode step's
# batch x top-k; more (prefills) go to the grouped GEMM or the loop
DECODE_MAX_PAIRS = 256
# The decode kernel serves on `DECODE_MIN_THREADS` threads or more, and where a call has fewer pairs than
# `DECODE_PAIRS_PER_EXPERT` x experts (most experts empty or one row: the grouped GEMM's walk over every expert
# costs more than its faster reads). Whole W1 jobs, decode kernel against grouped GEMM (2026-12-06, one process,
# alternating): one thread, the grouped GEMM 1.17x / 1.16x / 1.04x faster at 16x4 / 64x8 / 128x8 (3.9 / 1.9 / 0.9
# pairs an expert); two threads, 1.04x / 1.09x faster at 16x4 / 64x8 and the kernel 1.22x faster at 128x8
DECODE_MIN_THREADS = 2
DECODE_PAIRS_PER_EXPERT = 1.5
_grouped_ok: dict[tuple[str, torch.dtype], bool] = {}


def grouped_mm_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` runs here for `dtype`, checked once per (device type, dtype) on a tiny case
    against per-group matmuls."""
    key = (device.type, dtype)
    if key not in _grouped_ok:
        try:
            g = torch.Generator().manual_seed(0)
            a, b = torch.randn(5, 16, generator=g), torch.randn(3, 8, 16, generator=g)
            offs = torch.tensor([2, 2, 5], dtype=torch.int32, device=device)
            got = torch._grouped_mm(a.to(device, dtype), b.to(device, dtype).transpose(1, 2), offs=offs).float().cpu()
            want = torch.cat([a[:2] @ b[0].T, a[2:] @ b[2].T])
            _grouped_ok[key] = bool(torch.allclose(got, want, rtol=2e-2, atol=2e-2))
        except (AttributeError, RuntimeError, NotImplementedError):
            _grouped_ok[key] = False
    return _grouped_ok[key]


def _decode_kernel_serves(pairs: int, experts: int, x: torch.Tensor, grouped: bool) -> bool:
    """Whether a call of `pairs` (token, expert) pairs over `experts` experts on `x`'s device takes the decode
    kernel: a decode step's few pairs on the host; where the grouped GEMM would serve the call instead
    (`grouped`), only with the pairs spread thin and `DECODE_MIN_THREADS` threads."""
    if pairs > DECODE_MAX_PAIRS or not on_host(x):
        return False
    if not grouped:
        return True  # else the loop over experts, with its read-back of the counts
    return pairs < DECODE_PAIRS_PER_EXPERT * experts and torch.get_num_threads() >= DECODE_MIN_THREADS


class SparseMoE(nn.Module):
    def __init__(self, spec: MoESpec, hidden: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.spec, self.hidden = spec, hidden
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
        # "gate_up" / "down": a quantized replacement of that stacked weight (module docstring), set by the quant layer
        self.quantized = nn.ModuleDict()

    def _expert_linear(self, x: torch.Tensor, expert: int, which: int) -> torch.Tensor:
        """x through expert's gate / up (`which` 0) or down (1) weight."""
        return F.linear(x, (self.experts_gate_up, self.experts_down)[which][expert])

    def _grouped_serves(self, pairs: int, rows: torch.Tensor) -> bool:
        """Whether the grouped GEMM serves `pairs` sorted rows like `rows`: this torch has one for their device
        and dtype, and they are few enough an expert — `GROUPED_MAX_MACS` on the host, where it was measured;
        elsewhere up to `GROUPED_MAX_ROWS` rows an expert (a GPU's grouped GEMM also spares the loop's read-back
        of the counts)."""
        spec = self.spec
        if not on_host(rows):
            fits = pairs <= GROUPED_MAX_ROWS * spec.num_experts
        else:
            fits = pairs * 2 * spec.intermediate * self.hidden <= GROUPED_MAX_MACS * spec.num_experts
        return fits and grouped_mm_available(rows.device, rows.dtype)

    def _grouped(self, rows: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """Sorted rows [pairs, hidden] through their experts (`ends`: each expert's end offset): [pairs, hidden]."""
        gate, up = torch._grouped_mm(rows, self.experts_gate_up.transpose(1, 2), offs=ends).split(
            self.spec.intermediate, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, self.experts_down.transpose(1, 2), offs=ends)

    def _decode_rows(self, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor | None:
        """Sorted rows through their experts by the CPU's decode kernel (`backends.cpu_moe`); None where it
        does not serve (no numba, another dtype)."""
        gate_up = cpu_moe.expert_rows(rows, experts, self.experts_gate_up)
        if gate_up is None:
            return None
        gate, up = gate_up.split(self.spec.intermediate, dim=-1)
        return cpu_moe.expert_rows(F.silu(gate) * up, experts, self.experts_down)

    def _project(self, which: int, rows: torch.Tensor, experts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Sorted rows through one projection (`which`: 0 gate / up, 1 down) of their experts, in that
        projection's own format: the quantized replacement's, or the float forms of `forward`."""
        name = ("gate_up", "down")[which]
        if name in self.quantized:
            return self.quantized[name].sorted_rows(rows, experts, counts)
        weights = (self.experts_gate_up, self.experts_down)[which]
        grouped = self._grouped_serves(len(rows), rows)
        if _decode_kernel_serves(len(rows), self.spec.num_experts, rows, grouped):
            out = cpu_moe.expert_rows(rows, experts, weights)
            if out is not None:
                return out
        if grouped:
            return torch._grouped_mm(rows, weights.transpose(1, 2), offs=counts.cumsum(0).to(torch.int32))
        out, start = rows.new_empty(len(rows), weights.shape[1]), 0
        for expert, count in enumerate(counts.tolist()):
            if count:
                out[start : start + count] = self._expert_linear(rows[start : start + count], expert, which)
                start += count
        return out

    def _loop(self, flat: torch.Tensor, tokens: torch.Tensor, slot_weights: torch.Tensor, counts: list[int],
              out: torch.Tensor) -> None:
        inter, start = self.spec.intermediate, 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            rows = tokens[start : start + count]
            gate, up = self._expert_linear(flat[rows], expert, 0).split(inter, dim=-1)
            h = self._expert_linear(F.silu(gate) * up, expert, 1) * slot_weights[start : start + count, None]
            out.index_add_(0, rows, h.float())  # experts in ascending order
            start += count

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
        counts = torch.bincount(flat_choice, minlength=self.spec.num_experts)
        pairs = len(flat_choice)
        h, grouped = None, self._grouped_serves(pairs, flat)
        if len(self.quantized):  # a projection in another format: one projection at a time (module docstring)
            sorted_experts = flat_choice[order]
            gate, up = self._project(0, flat[tokens], sorted_experts, counts).split(self.spec.intermediate, dim=-1)
            h = self._project(1, F.silu(gate) * up, sorted_experts, counts)
        elif _decode_kernel_serves(pairs, self.spec.num_experts, flat, grouped):
            h = self._decode_rows(flat[tokens], flat_choice[order])
        if h is None and grouped:
            h = self._grouped(flat[tokens], counts.cumsum(0).to(torch.int32))
        if h is not None:
            out.index_add_(0, tokens, (h * slot_weights[:, None]).float())  # expert order: a token's ascending
        else:
            self._loop(flat, tokens, slot_weights, counts.tolist(), out)
        out = out.to(flat.dtype)
        if self.shared is not None:
            shared = self.shared.forward(flat)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate.forward(flat)) * shared
            out = out + shared
        return out.view(shape)
