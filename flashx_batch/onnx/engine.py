"""`OnnxEngine`: static-batch generation with ONNX Runtime (`runtime.backend=onnx`).

For ROCm / Hygon DCU hosts whose torch is not a HIP build: the decoder is exported once
(`export.py`) and runs in `onnxruntime` with MIGraphX / ROCm providers where present, the CPU
provider otherwise. Who calls it: `Engine.from_pretrained(..., backend="onnx")` dispatches here
(see the engine's backend switch), tests, and users directly. Its `generate` takes and returns
what `Engine.generate` does; batching, stops and sampling are the torch runtime's own code
(`RowState`, `sample`) run on host tensors, so only the forward passes differ.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from flashx_batch.backends import get_backend
from flashx_batch.backends.onnx import OnnxBackend
from flashx_batch.errors import ConfigError, PromptTooLongError
from flashx_batch.models.config import ModelConfig
from flashx_batch.models.loader import load_model
from flashx_batch.onnx.export import export_decoder, export_fingerprint
from flashx_batch.runtime.engine import GenerateStats, RequestOutput, _read_generation_eos, check_prompt_ids
from flashx_batch.runtime.options import EngineOptions, bundled_model_dir
from flashx_batch.runtime.sampling import SamplingBatch, SamplingParams, sample
from flashx_batch.runtime.stops import RowState
from flashx_batch.runtime.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """Where exports are kept between runs (`FLASHX_ONNX_CACHE` overrides)."""
    if os.environ.get("FLASHX_ONNX_CACHE"):
        return Path(os.environ["FLASHX_ONNX_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flashx-batch" / "onnx"


class OnnxSessions:
    """The two `InferenceSession`s and their calls; numpy in, numpy out."""

    def __init__(self, export_dir: Path, providers: list[str], num_threads: int | None) -> None:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        if num_threads:
            opts.intra_op_num_threads = num_threads
            opts.inter_op_num_threads = 1
        self.prefill_session = ort.InferenceSession(str(export_dir / "prefill.onnx"), opts, providers=providers)
        self.decode_session = ort.InferenceSession(str(export_dir / "decode.onnx"), opts, providers=providers)
        self.providers = self.prefill_session.get_providers()

    def prefill(self, ids: np.ndarray, last_index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        logits, present = self.prefill_session.run(None, {"input_ids": ids, "last_index": last_index})
        return logits, present

    def decode(self, ids: np.ndarray, positions: np.ndarray, bias: np.ndarray,
               past: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        feeds = {"input_ids": ids, "position_ids": positions, "attn_bias": bias, "past": past}
        logits, present = self.decode_session.run(None, feeds)
        return logits, present


class OnnxEngine:
    """Same public surface as `Engine` for generation: `from_pretrained`, `generate`, `last_stats`."""

    def __init__(self, model_dir: Path, options: EngineOptions, cache_dir: Path | None = None) -> None:
        self.model_dir = Path(model_dir)
        self.options = options
        self.backend: OnnxBackend = get_backend("onnx")  # type: ignore[assignment]
        if options.dtype not in ("auto", "float32"):
            raise ConfigError(f"model.dtype={options.dtype} is not supported by runtime.backend=onnx; use float32.")
        # The graphs hold a plain growing cache: the lossless static path only.
        if options.cache_policy != "static" or options.long_input not in ("error", "truncate"):
            raise ConfigError(f"runtime.backend=onnx supports cache_policy=static and long_input=error|truncate, "
                              f"not cache_policy={options.cache_policy} long_input={options.long_input}.")
        self.dtype = torch.float32
        self.device = torch.device("cpu")  # sampling and bookkeeping run on the host
        self.config = ModelConfig.from_dir(self.model_dir)
        self.export_dir = self._ensure_export(cache_dir or default_cache_dir())
        threads = options.num_threads or len(os.sched_getaffinity(0))
        self.sessions = OnnxSessions(self.export_dir, self.backend.providers(), threads)
        has_tokenizer = (self.model_dir / "tokenizer.json").is_file()
        self.tokenizer: Tokenizer | None = Tokenizer(self.model_dir) if has_tokenizer else None
        self.eos_token_ids = tuple(dict.fromkeys(self.config.eos_token_ids + _read_generation_eos(self.model_dir)))
        self.last_stats = GenerateStats()
        log.info("onnx engine ready: %s on %s", self.model_dir.name, self.sessions.providers)

    @classmethod
    def from_pretrained(cls, path: str | Path | None = None, cache_dir: Path | None = None, **options) -> OnnxEngine:
        """Load (exporting on first use) a local Hugging Face directory; None = the bundled model."""
        options = {**options, "backend": "onnx"}
        return cls(Path(path) if path is not None else bundled_model_dir(), EngineOptions(**options), cache_dir)

    def _ensure_export(self, cache_dir: Path) -> Path:
        key = export_fingerprint(self.model_dir, self.dtype, self.options.row_capacity)
        out = cache_dir / f"{self.model_dir.name}-{key}"
        if (out / "export.json").is_file():
            return out
        started = time.perf_counter()
        model = load_model(self.model_dir, self.dtype, torch.device("cpu"), self.options.row_capacity)
        # Export beside the target and rename: several Ray actors may start on one host at once.
        staging = out.with_name(f"{out.name}.tmp-{os.getpid()}")
        export_decoder(model, staging)
        try:
            staging.rename(out)
        except OSError:  # another process finished first: its export is the same graph
            shutil.rmtree(staging, ignore_errors=True)
        log.info("exported %s to ONNX in %.1fs", self.model_dir.name, time.perf_counter() - started)
        return out

    # ---- public API (mirrors Engine) ------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ConfigError(f"{self.model_dir}/tokenizer.json is missing; pass token-id lists instead.")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def generate(self, prompts: list[str] | list[list[int]],
                 sampling: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in input order."""
        params = sampling if isinstance(sampling, list) else [sampling or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ConfigError(f"got {len(params)} SamplingParams for {len(prompts)} prompts.")
        for p in params:
            if p.max_new_tokens > self.options.max_output_len:
                raise ConfigError(f"sampling.max_new_tokens={p.max_new_tokens} exceeds runtime.max_output_len="
                                  f"{self.options.max_output_len}.")
        token_lists, truncated = self._fit([self.encode(p) for p in prompts])
        order = list(range(len(prompts)))
        if self.options.sort_by_length:
            order.sort(key=lambda i: -len(token_lists[i]))
        stats = GenerateStats()
        results: dict[int, RequestOutput] = {}
        size = self.options.max_batch_size
        for start in range(0, len(order), size):
            batch = order[start : start + size]
            rows = self._run_batch([token_lists[i] for i in batch], [params[i] for i in batch], stats)
            for i, row in zip(batch, rows, strict=True):
                text = row.final_text(self.tokenizer.decode) if self.tokenizer is not None else None
                results[i] = RequestOutput(i, row.token_ids, text, row.finish_reason or "length",
                                           len(token_lists[i]), truncated[i])
        self.last_stats = stats
        return [results[i] for i in range(len(prompts))]

    # ---- internals -----------------------------------------------------------------------------
    def _fit(self, token_lists: list[list[int]]) -> tuple[list[list[int]], list[bool]]:
        limit, fitted, truncated = self.options.max_input_len, [], []
        for i, ids in enumerate(token_lists):
            check_prompt_ids(i, ids, self.config.vocab_size)
            if len(ids) > limit:
                if self.options.long_input == "error":
                    raise PromptTooLongError(i, len(ids), limit)
                ids = ids[-limit:]
            fitted.append(ids)
            truncated.append(len(ids) != len(token_lists[i]))
        return fitted, truncated

    def _run_batch(self, prompts: list[list[int]], params: list[SamplingParams],
                   stats: GenerateStats) -> list[RowState]:
        rows = [RowState.start(p, self.eos_token_ids) for p in params]
        decode_text = self.tokenizer.decode if self.tokenizer is not None else (lambda ids: "")
        width = max(map(len, prompts))
        ids = np.full((len(prompts), width), self.config.pad_token_id or 0, dtype=np.int64)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = p
        lengths = np.array([len(p) for p in prompts], dtype=np.int64)

        started = time.perf_counter()
        logits, cache = self.sessions.prefill(ids, lengths - 1)  # cache [L, 2, B, Hkv, T, D]
        sampling = SamplingBatch.build(params, logits.shape[-1], self.device)
        steps = torch.zeros(len(prompts), dtype=torch.long)
        tokens = sample(torch.from_numpy(logits), sampling, steps)
        stats.prefill_s += time.perf_counter() - started
        stats.computed_slots += len(prompts) * width

        # valid[j, s]: cache slot s of batch position j holds a real token (prompt or generated);
        # right-padding leaves slots len_j..width-1 empty, so they are masked out of every step.
        valid = np.arange(width)[None, :] < lengths[:, None]
        active = np.arange(len(prompts))  # batch position -> index into `rows`
        positions = lengths.copy()  # next position per batch position
        started = time.perf_counter()
        while True:
            done = [j for j, tok in enumerate(tokens.tolist()) if rows[active[j]].append(tok, decode_text)]
            if done:
                keep = np.array([j for j in range(len(active)) if j not in set(done)], dtype=np.int64)
                if keep.size == 0:
                    break
                # Finished rows leave the batch: drop their cache rows so they cost no more compute.
                active, positions, valid = active[keep], positions[keep], valid[keep]
                cache = np.ascontiguousarray(cache[:, :, keep])
                keep_t = torch.from_numpy(keep)
                tokens, steps, sampling = tokens[keep_t], steps[keep_t], sampling.select(keep_t)
            valid = np.concatenate((valid, np.ones((len(active), 1), dtype=bool)), axis=1)
            bias = np.where(valid, 0.0, -np.inf).astype(np.float32)[:, None, None, :]  # [B, 1, 1, P+1]
            step_ids = tokens.numpy().astype(np.int64)[:, None]
            logits, cache = self.sessions.decode(step_ids, positions, bias, cache)
            steps += 1
            tokens = sample(torch.from_numpy(logits), sampling, steps)
            positions = positions + 1
            stats.decode_steps += 1
            stats.computed_slots += len(active)
        stats.decode_s += time.perf_counter() - started
        stats.rows += len(prompts)
        stats.batches += 1
        stats.batch_sizes.append(len(prompts))
        stats.peak_rows = max(stats.peak_rows, len(prompts))
        stats.input_tokens += int(lengths.sum())
        stats.output_tokens += sum(len(r.token_ids) for r in rows)
        return rows


def read_export_info(export_dir: Path) -> dict:
    """The `export.json` written next to the graphs (opset, torch version, shapes)."""
    return json.loads((Path(export_dir) / "export.json").read_text())
