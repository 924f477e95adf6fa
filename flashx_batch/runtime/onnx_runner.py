"""`OnnxRunner`: the `ModelRunner` over ONNX Runtime sessions (`runtime.backend=onnx`).

For ROCm / Hygon DCU hosts whose torch is not a HIP build: the decoder is exported once
(`onnx.sessions.ensure_export`) and runs in onnxruntime with MIGraphX / ROCm providers where
present, the CPU provider otherwise. The graphs carry their own growing cache
`[layers, 2, rows, kv_heads, T, head_dim]` instead of the KV arena, so the scheduler gives this
runner static striped batches only (`traits.kv_arena = False`) and it reads only the rows, the
positions and `keep` of a plan. Sampling, logprobs and stop bookkeeping are the torch runtime's own
(host tensors), so only the forward passes differ.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from flashx_batch.backends.onnx import OnnxBackend
from flashx_batch.models.config import ModelConfig
from flashx_batch.onnx.sessions import OnnxSessions, ensure_export
from flashx_batch.runtime.grammar import StepMasks
from flashx_batch.runtime.options import EngineOptions
from flashx_batch.runtime.plan import StepOutput, StepPlan, StripeDecode, StripePrefill
from flashx_batch.runtime.runner import ModelRunner, RunnerTraits
from flashx_batch.runtime.sampling import SamplingBatch, host_tokens, sample

log = logging.getLogger(__name__)


class OnnxRunner(ModelRunner):
    traits = RunnerTraits(kv_arena=False)
    kv_bytes = 0  # no arena: the graphs' cache grows per batch

    def __init__(self, model_dir: Path, options: EngineOptions, config: ModelConfig, backend: OnnxBackend,
                 cache_dir: Path | None = None) -> None:
        self.config = config
        self.device = torch.device("cpu")  # sampling and bookkeeping run on the host
        # the graphs' own cache is not accounted in the stats (kv_bytes_* stay 0, as the arena's would)
        self.kv_bytes_per_slot = 0
        self.export_dir = ensure_export(model_dir, options.row_capacity, cache_dir)
        self.sessions = OnnxSessions(self.export_dir, backend.providers(), options.cpu_threads())
        log.info("onnx runner ready: %s on %s", model_dir.name, self.sessions.providers)
        self.reset()

    def reset(self) -> None:
        self.cache: np.ndarray | None = None  # [L, 2, B, Hkv, T, D]
        # valid[j, s]: cache slot s of batch position j holds a real token (prompt or generated);
        # right-padding leaves slots len_j..width-1 empty, so they are masked out of every step
        self.valid: np.ndarray | None = None
        self.tokens = self.steps = torch.zeros(0, dtype=torch.long)
        self.sampling: SamplingBatch | None = None

    def synchronize(self) -> None:
        """onnxruntime's `run` returns when the work is done."""

    def run(self, plan: StepPlan, masks: StepMasks | None = None) -> StepOutput:
        if plan.keep is not None:
            keep = np.array(plan.keep, dtype=np.int64)
            index = torch.from_numpy(keep)
            # finished rows leave the batch: their cache rows go, so they cost no more compute
            self.cache = None if keep.size == 0 else np.ascontiguousarray(self.cache[:, :, keep])
            self.valid = None if keep.size == 0 else self.valid[keep]
            self.tokens, self.steps = self.tokens[index], self.steps[index]
            self.sampling = self.sampling.select(index) if keep.size else None
        allowed = masks.fill() if masks is not None else None
        if isinstance(plan.prefill, StripePrefill):
            return self._prefill(plan.prefill, allowed)
        if isinstance(plan.decode, StripeDecode):
            return self._decode(plan.decode, allowed)
        if plan.prefill is not None or plan.decode is not None:
            raise TypeError(f"the ONNX runner takes static striped batches, not {plan.prefill or plan.decode}")
        return StepOutput([])

    def _prefill(self, p: StripePrefill, allowed: torch.Tensor | None) -> StepOutput:
        if self.cache is not None:
            raise ValueError("the ONNX runner prefills a batch only when it starts (no refill)")
        prompts = [r.prompt for r in p.rows]
        width = max(map(len, prompts))
        ids = np.full((len(prompts), width), self.config.pad_token_id or 0, dtype=np.int64)
        for i, prompt in enumerate(prompts):
            ids[i, : len(prompt)] = prompt
        lengths = np.array([len(prompt) for prompt in prompts], dtype=np.int64)
        logits, self.cache = self.sessions.prefill(ids, lengths - 1)
        self.valid = np.arange(width)[None, :] < lengths[:, None]
        self.sampling = SamplingBatch.build([r.params for r in p.rows], logits.shape[-1], self.device)
        self.steps = torch.zeros(len(prompts), dtype=torch.long)
        logits = torch.from_numpy(logits)
        self.tokens = sample(logits, self.sampling, self.steps, allowed)
        tokens, logprobs, top = host_tokens(logits, self.tokens, self.sampling)
        return StepOutput(tokens, None, len(prompts) * width, logprobs, top)

    def _decode(self, d: StripeDecode, allowed: torch.Tensor | None) -> StepOutput:
        rows = len(d.positions)
        self.valid = np.concatenate((self.valid, np.ones((rows, 1), dtype=bool)), axis=1)
        bias = np.where(self.valid, 0.0, -np.inf).astype(np.float32)[:, None, None, :]  # [B, 1, 1, P+1]
        step_ids = self.tokens.numpy().astype(np.int64)[:, None]
        positions = np.array(d.positions, dtype=np.int64)
        logits, self.cache = self.sessions.decode(step_ids, positions, bias, self.cache)
        self.steps += 1
        logits = torch.from_numpy(logits)
        self.tokens = sample(logits, self.sampling, self.steps, allowed)
        tokens, logprobs, top = host_tokens(logits, self.tokens, self.sampling)
        return StepOutput(tokens, None, rows, logprobs, top)
