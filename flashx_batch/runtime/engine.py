"""`Engine`: the public Python API (DESIGN.md "Python API") for static-batch generation.

Who calls it: users directly, each Ray actor / the local executor once per shard, the benchmarks.
One `generate` call = rows sorted by length, cut into static batches of up to `max_batch_size`;
each batch is one prefill and decode steps until every row stops. A finished row leaves the batch
at once (the last active row takes its stripe), so it costs no more compute.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from flashx_batch.backends import Backend, get_backend
from flashx_batch.errors import ConfigError, PromptTooLongError
from flashx_batch.models.config import ModelConfig
from flashx_batch.models.loader import load_model
from flashx_batch.runtime.kv import KVArena
from flashx_batch.runtime.model_runner import ModelRunner
from flashx_batch.runtime.options import EngineOptions, bundled_model_dir
from flashx_batch.runtime.sampling import SamplingBatch, SamplingParams, sample
from flashx_batch.runtime.stops import RowState
from flashx_batch.runtime.tokenizer import Tokenizer

log = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class RequestOutput:
    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str  # "stop" | "length"
    num_input_tokens: int
    truncated: bool = False  # long_input=truncate dropped the head of the prompt

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class GenerateStats:
    """Figures for one `generate` call (the runner turns them into per-shard stats rows)."""

    rows: int = 0
    batches: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    computed_slots: int = 0  # token positions the model actually ran, padding included
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    kv_bytes_peak: int = 0  # bytes of the segments held at the fullest moment
    kv_bytes_arena: int = 0
    batch_sizes: list[int] = field(default_factory=list)

    @property
    def padding_efficiency(self) -> float:
        useful = self.input_tokens + self.output_tokens
        return useful / self.computed_slots if self.computed_slots else 1.0

    @property
    def wall_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def output_tok_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0

    def as_dict(self) -> dict:
        return {
            "rows": self.rows, "batches": self.batches, "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens, "padding_efficiency": self.padding_efficiency,
            "prefill_s": self.prefill_s, "decode_s": self.decode_s, "wall_s": self.wall_s,
            "output_tok_per_s": self.output_tok_per_s, "kv_bytes_peak": self.kv_bytes_peak,
            "kv_bytes_arena": self.kv_bytes_arena, "decode_steps": self.decode_steps,
        }


def _read_generation_eos(model_dir: Path) -> tuple[int, ...]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return ()
    value = json.loads(path.read_text()).get("eos_token_id")
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(value)


class Engine:
    def __init__(self, model_dir: Path, options: EngineOptions) -> None:
        self.model_dir = Path(model_dir)
        self.options = options
        self.backend: Backend = get_backend(options.backend)
        self.dtype = self._resolve_dtype(options.dtype)
        if self.backend.name == "cpu":
            torch.set_num_threads(options.cpu_threads())
        self.device = self.backend.device()
        self.config = ModelConfig.from_dir(self.model_dir)
        self._check_context(self.config, options)
        started = time.perf_counter()
        model = load_model(self.model_dir, self.dtype, self.device, options.row_capacity)
        arena = KVArena(self.config.num_layers, self.config.num_kv_heads, self.config.head_dim,
                        options.max_batch_size, options.row_capacity, options.segment_size, self.dtype, self.device)
        self.runner = ModelRunner(model, arena, pad_id=self.config.pad_token_id or 0)
        self.tokenizer: Tokenizer | None = Tokenizer(self.model_dir) if (self.model_dir / "tokenizer.json").is_file() else None
        self.eos_token_ids = tuple(dict.fromkeys(self.config.eos_token_ids + _read_generation_eos(self.model_dir)))
        self.last_stats = GenerateStats()
        log.info("engine ready: %s %s on %s (%s), arena %.1f MiB, %.2fs", self.config.architecture,
                 self.model_dir.name, self.device, self.dtype, arena.nbytes / 2**20, time.perf_counter() - started)

    @classmethod
    def from_pretrained(cls, path: str | Path | None = None, **options) -> Engine:
        """Load a local Hugging Face directory (None = the bundled demo model) with `EngineOptions` knobs."""
        return cls(Path(path) if path is not None else bundled_model_dir(), EngineOptions(**options))

    def _resolve_dtype(self, name: str) -> torch.dtype:
        dtype = self.backend.default_dtype if name == "auto" else _DTYPES[name]
        if dtype not in self.backend.supported_dtypes:
            raise ConfigError(f"model.dtype={name} is not supported on {self.backend.name}.")
        return dtype

    @staticmethod
    def _check_context(cfg: ModelConfig, options: EngineOptions) -> None:
        needed = options.max_input_len + options.max_output_len
        if needed > cfg.max_position_embeddings:
            log.warning("max_input_len + max_output_len = %d exceeds the model's max_position_embeddings=%d",
                        needed, cfg.max_position_embeddings)
        if cfg.sliding_window is not None and needed > cfg.sliding_window:
            raise ConfigError(
                f"max_input_len + max_output_len = {needed} exceeds the model's sliding_window="
                f"{cfg.sliding_window}; sliding-window attention is not implemented, keep rows within it."
            )

    # ---- public API -------------------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ConfigError(f"{self.model_dir}/tokenizer.json is missing, so text prompts cannot be "
                                  "tokenized; pass token-id lists instead.")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def decode(self, token_ids: list[int]) -> str | None:
        return self.tokenizer.decode(token_ids) if self.tokenizer is not None else None

    def generate(self, prompts: list[str] | list[list[int]],
                 sampling: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in input order."""
        params = self._per_row(sampling, len(prompts))
        token_lists = [self.encode(p) for p in prompts]
        token_lists, truncated = self._fit_inputs(token_lists)
        order = list(range(len(prompts)))
        if self.options.sort_by_length:
            order.sort(key=lambda i: -len(token_lists[i]))
        stats = GenerateStats(kv_bytes_arena=self.runner.arena.nbytes)
        results: dict[int, RequestOutput] = {}
        size = self.options.max_batch_size
        for start in range(0, len(order), size):
            batch = order[start : start + size]
            rows = self._run_batch([token_lists[i] for i in batch], [params[i] for i in batch], stats)
            for i, row in zip(batch, rows):
                results[i] = RequestOutput(i, row.token_ids, self._final_text(row), row.finish_reason or "length",
                                           len(token_lists[i]), truncated[i])
        self.last_stats = stats
        return [results[i] for i in range(len(prompts))]

    @torch.inference_mode()
    def score(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """Teacher-forced float32 logits [T_i, V] for each prompt (quality measurements, parity tests)."""
        out: list[torch.Tensor] = []
        size = self.options.max_batch_size
        for start in range(0, len(prompts), size):
            chunk = prompts[start : start + size]
            self._fit_inputs(chunk)
            out.extend(self.runner.score(chunk))
        return out

    # ---- internals --------------------------------------------------------------------------
    def _per_row(self, sampling: SamplingParams | list[SamplingParams] | None, n: int) -> list[SamplingParams]:
        params = sampling if isinstance(sampling, list) else [sampling or SamplingParams()] * n
        if len(params) != n:
            raise ConfigError(f"got {len(params)} SamplingParams for {n} prompts; pass one, or one per prompt.")
        for p in params:
            if p.max_new_tokens > self.options.max_output_len:
                raise ConfigError(f"sampling.max_new_tokens={p.max_new_tokens} exceeds runtime.max_output_len="
                                  f"{self.options.max_output_len}; raise max_output_len when starting the engine.")
        return params

    def _fit_inputs(self, token_lists: list[list[int]]) -> tuple[list[list[int]], list[bool]]:
        limit = self.options.max_input_len
        fitted, truncated = [], []
        for i, ids in enumerate(token_lists):
            if not ids:
                raise ConfigError(f"prompt {i} is empty after tokenization; an empty prompt has nothing to continue.")
            if len(ids) > limit:
                if self.options.long_input == "error":
                    raise PromptTooLongError(i, len(ids), limit)
                ids = ids[-limit:]  # truncate keeps the tail: the instruction usually comes last
            fitted.append(ids)
            truncated.append(len(ids) != len(token_lists[i]))
        return fitted, truncated

    def _final_text(self, row: RowState) -> str | None:
        return row.final_text(self.tokenizer.decode) if self.tokenizer is not None else None

    def _run_batch(self, prompts: list[list[int]], params: list[SamplingParams],
                   stats: GenerateStats) -> list[RowState]:
        runner, arena, sync = self.runner, self.runner.arena, self.backend.synchronize
        allocator = arena.allocator
        rows = [RowState.start(p, self.eos_token_ids) for p in params]
        held = [allocator.take(arena.stripe_segments(i)[: allocator.segments_for(len(ids) + p.max_new_tokens)])
                for i, (ids, p) in enumerate(zip(prompts, params))]
        stats.kv_bytes_peak = max(stats.kv_bytes_peak, sum(map(len, held)) * arena.segment_size * arena.bytes_per_token())
        decode_text = self.tokenizer.decode if self.tokenizer is not None else (lambda ids: "")
        try:
            started = time.perf_counter()
            logits = runner.prefill(prompts)
            sampling = SamplingBatch.build(params, logits.shape[-1], self.device)
            steps = torch.zeros(len(prompts), dtype=torch.long, device=self.device)
            tokens = sample(logits, sampling, steps)
            sync()
            stats.prefill_s += time.perf_counter() - started
            stats.computed_slots += len(prompts) * max(map(len, prompts))
            started = time.perf_counter()
            # active[j] = index into `rows` of the row in batch position (= stripe) j
            active = list(range(len(prompts)))
            lengths = [len(p) for p in prompts]  # tokens in the cache per batch position
            positions = torch.tensor(lengths, dtype=torch.long, device=self.device)
            while True:
                finished = [j for j, tok in enumerate(tokens.tolist()) if rows[active[j]].append(tok, decode_text)]
                if finished:
                    keep = self._compact(active, lengths, held, finished)
                    if not active:
                        break
                    keep_t = torch.tensor(keep, device=self.device)
                    tokens, positions, steps = tokens[keep_t], positions[keep_t], steps[keep_t]
                    sampling = sampling.select(keep_t)
                logits = runner.decode(tokens, positions, max(lengths) + 1)
                steps += 1
                tokens = sample(logits, sampling, steps)
                positions += 1
                lengths = [n + 1 for n in lengths]
                stats.decode_steps += 1
                stats.computed_slots += len(active)
            sync()
            stats.decode_s += time.perf_counter() - started
        finally:
            for segments in held:
                allocator.release(segments)
        stats.rows += len(prompts)
        stats.batches += 1
        stats.batch_sizes.append(len(prompts))
        stats.input_tokens += sum(map(len, prompts))
        stats.output_tokens += sum(len(r.token_ids) for r in rows)
        return rows

    def _compact(self, active: list[int], lengths: list[int], held: list[list[int]],
                 finished: list[int]) -> list[int]:
        """Drop finished batch positions; the last active rows move into the holes.

        Mutates `active`, `lengths` and `held` (segments per batch position); returns, for each new
        position, its old position. A moved row re-takes the same number of segments in its new stripe.
        """
        arena, allocator = self.runner.arena, self.runner.arena.allocator
        old_of = list(range(len(active)))
        for j in sorted(finished, reverse=True):
            last = len(active) - 1
            allocator.release(held[j])
            if j != last:
                self.runner.move_row(last, j, lengths[last])
                allocator.release(held[last])
                held[j] = allocator.take(arena.stripe_segments(j)[: len(held[last])])
                active[j], lengths[j], old_of[j] = active[last], lengths[last], old_of[last]
            held.pop()
            active.pop()
            lengths.pop()
            old_of.pop()
        return old_of
