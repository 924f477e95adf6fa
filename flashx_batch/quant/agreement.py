"""Teacher-forced comparison of two logit sequences over the same tokens: KL, top-1 agreement, ΔNLL.

Used by the quantization planner (`quant.sensitivity`: quantized model vs the float model) and by
the quality harness (`quality.kv_quality`: compressed KV cache vs the full cache).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Agreement:
    """Running sums; `summary()` gives per-position means."""

    positions: int = 0
    kl_sum: float = 0.0
    top1_sum: float = 0.0
    nll_ref_sum: float = 0.0
    nll_sum: float = 0.0
    per_sample_delta: list[float] = field(default_factory=list)

    def add(self, reference: torch.Tensor, candidate: torch.Tensor, targets: torch.Tensor) -> None:
        """reference / candidate: [T, V] float32 logits at the same positions; targets: [T] next tokens."""
        ref_logp = reference.float().log_softmax(-1)
        cand_logp = candidate.float().log_softmax(-1)
        kl = (ref_logp.exp() * (ref_logp - cand_logp)).sum(-1)  # KL(reference || candidate) per position
        nll_ref = -ref_logp.gather(1, targets[:, None]).squeeze(1)
        nll = -cand_logp.gather(1, targets[:, None]).squeeze(1)
        self.positions += len(targets)
        self.kl_sum += kl.sum().item()
        self.top1_sum += (reference.argmax(-1) == candidate.argmax(-1)).float().sum().item()
        self.nll_ref_sum += nll_ref.sum().item()
        self.nll_sum += nll.sum().item()
        self.per_sample_delta.append((nll - nll_ref).mean().item())

    def summary(self) -> dict[str, float]:
        n = max(self.positions, 1)
        return {
            "top1_agreement": self.top1_sum / n,
            "mean_kl": self.kl_sum / n,
            "delta_nll": (self.nll_sum - self.nll_ref_sum) / n,
            "nll_reference": self.nll_ref_sum / n,
            "positions": self.positions,
            "samples": len(self.per_sample_delta),
        }
