"""`ModelRunner`: what the engine needs from a device — run one step plan, score sequences.

Two implementations: `torch_runner.TorchRunner` (CPU, CUDA, ROCm, NPU: our own forward passes over
the KV arena) and `onnx_runner.OnnxRunner` (ONNX Runtime sessions on ROCm / DCU hosts without a HIP
build of torch). A new device path — a vendor attention kernel, another inference runtime — is a new
runner: the engine, the scheduler and the layouts stay as they are.

A runner mirrors the scheduler's live rows in batch order (their last sampled token, sampling
state) and applies each `StepPlan` in field order; see `runtime.plan`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flashx_batch.errors import ConfigError
from flashx_batch.runtime.plan import StepOutput, StepPlan

if TYPE_CHECKING:
    from flashx_batch.runtime.grammar import StepMasks


@dataclass(frozen=True)
class RunnerTraits:
    """What the scheduler may plan for a runner. A runner without a KV arena (ONNX Runtime keeps its
    own growing cache per batch) takes static striped batches only: no refill, no batch growth, no
    segment-sparse merging, no prefix reuse."""

    kv_arena: bool = True


class ModelRunner(ABC):
    traits = RunnerTraits()
    kv_bytes: int  # bytes of KV cache the runner holds for its rows (the arena; 0 where it grows per batch)
    kv_bytes_per_slot: int  # bytes one token's keys and values take, every layer

    @abstractmethod
    def run(self, plan: StepPlan, masks: StepMasks | None = None) -> StepOutput:
        """Apply `plan` (keep, KV ops, then a prefill or a decode step) and return the sampled tokens.
        `masks`: the step's allowed tokens for constrained rows (`runtime.grammar`), in the order of the
        rows the step samples (the prefill's rows, or every live row)."""

    @abstractmethod
    def reset(self) -> None:
        """Forget the live rows' device-side state (after a failed plan; the scheduler aborts too)."""

    @abstractmethod
    def synchronize(self) -> None:
        """Wait for queued device work, so wall-clock timings are honest."""

    def score(self, prompts: list[list[int]]) -> list:
        """Teacher-forced float32 logits [T_i, V] for each whole sequence."""
        raise ConfigError(f"Engine.score needs every position's logits, which {type(self).__name__} does not "
                          "compute (its prefill returns the last position's); score on a torch backend.")

    def target_logprobs(self, ids, pick, targets, positions=None, visible=None) -> tuple:
        """Teacher-forced log-probabilities of `targets` at picked positions (see `TorchRunner`)."""
        raise ConfigError(f"log-likelihoods need teacher-forced logits, which {type(self).__name__} does not "
                          "compute (its prefill returns the last position's); score on a torch backend.")
