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
from dataclasses import dataclass, field
from pathlib import Path

import torch

from flashx_batch.backends import Backend, get_backend
from flashx_batch.errors import ConfigError, PromptTooLongError
from flashx_batch.models.config import ModelConfig
from flashx_batch.models.loader import load_model
from flashx_batch.runtime.kv import KVArena
from flashx_batch.runtime.kv_merge import (
    MergeSettings,
    apply_plan,
    choose_groups,
    compressed_length,
    plan_groups,
    plan_oldest,
)
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
    kv_bytes_static_peak: int = 0  # what a static cache would have held for the same rows
    batch_sizes: list[int] = field(default_factory=list)

    @property
    def padding_efficiency(self) -> float:
        """Useful ÷ computed token slots. A row's last sampled token is never fed back through the
        model, so the useful slots are its prompt plus all but one generated token."""
        useful = self.input_tokens + self.output_tokens - self.rows
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
            "kv_bytes_arena": self.kv_bytes_arena,
            "kv_bytes_static_peak": self.kv_bytes_static_peak, "max_batch_size": max(self.batch_sizes, default=0),
            "decode_steps": self.decode_steps,
        }


def _ray_accelerator_ids() -> dict[str, list[str]] | None:
    """Inside a Ray actor: the accelerator ids Ray assigned to it; elsewhere None."""
    import sys

    ray = sys.modules.get("ray")  # never import Ray just to ask: the local path must not need it
    if ray is None or not ray.is_initialized():
        return None
    return ray.get_runtime_context().get_accelerator_ids()


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
        if not self.backend.torch_runtime:
            raise ConfigError(f"runtime.backend={options.backend} runs through Engine.from_pretrained, "
                              "which dispatches it to its own engine; do not construct Engine directly.")
        self.dtype = self._resolve_dtype(options.dtype)
        if self.backend.name == "cpu":
            torch.set_num_threads(options.cpu_threads())
        index = self.backend.assigned_device_index(_ray_accelerator_ids())
        self.backend.set_device(index)
        self.device = self.backend.device(index)
        self.config = ModelConfig.from_dir(self.model_dir)
        self._check_context(self.config, options)
        started = time.perf_counter()
        model = load_model(self.model_dir, self.dtype, self.device, options.row_capacity)
        self.merge = MergeSettings(options.kv_merge_fraction, sinks=4, window=options.kv_observe_window)
        arena = self._build_arena()
        self.runner = ModelRunner(model, arena, pad_id=self.config.pad_token_id or 0)
        has_tokenizer = (self.model_dir / "tokenizer.json").is_file()
        self.tokenizer: Tokenizer | None = Tokenizer(self.model_dir) if has_tokenizer else None
        self.eos_token_ids = tuple(dict.fromkeys(self.config.eos_token_ids + _read_generation_eos(self.model_dir)))
        self.last_stats = GenerateStats()
        log.info("engine ready: %s %s on %s (%s), arena %.1f MiB, %.2fs", self.config.architecture,
                 self.model_dir.name, self.device, self.dtype, arena.nbytes / 2**20, time.perf_counter() - started)

    def _build_arena(self) -> KVArena:
        """Static: `max_batch_size` stripes of max_input_len + max_output_len. Segment-sparse: the
        same bytes cut into shorter stripes (a merged prompt needs fewer slots), so more rows fit;
        a few spare segments hold the last row's prompt before it is merged down."""
        o, cfg = self.options, self.config
        rows, capacity, extra = o.max_batch_size, o.row_capacity, 0
        if o.cache_policy == "segment_sparse":
            seg = o.segment_size
            capacity = -(-(compressed_length(o.max_input_len, self.merge) + o.max_output_len) // seg) * seg
            extra = -(-max(0, o.max_input_len - capacity) // seg)
            rows = max(1, (o.max_batch_size * o.row_capacity - extra * seg) // capacity)
        return KVArena(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, rows, capacity, o.segment_size,
                       self.dtype, self.device, extra_segments=extra)

    @property
    def admitted_batch_size(self) -> int:
        """Rows per static batch this engine runs (more than max_batch_size under segment_sparse)."""
        return self.runner.arena.max_rows

    @classmethod
    def from_pretrained(cls, path: str | Path | None = None, **options) -> Engine:
        """Load a local Hugging Face directory (None = the bundled demo model) with `EngineOptions` knobs.

        `backend="onnx"` returns the ONNX Runtime engine (same `generate` contract) instead."""
        opts = EngineOptions(**options)
        model_dir = Path(path) if path is not None else bundled_model_dir()
        if opts.backend == "onnx":
            from flashx_batch.onnx import OnnxEngine

            return OnnxEngine(model_dir, opts)
        return cls(model_dir, opts)

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
        size = self.admitted_batch_size
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
            if len(ids) > limit and self.options.long_input != "rolling_merge":
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
        decode_text = self.tokenizer.decode if self.tokenizer is not None else (lambda ids: "")
        held: list[list[int]] = []
        try:
            started = time.perf_counter()
            logits, slots = self._prefill(prompts, stats)
            # segments held per row: its (possibly merged) prompt plus room for every new token
            held = [allocator.take(arena.stripe_segments(i)[: allocator.segments_for(n + p.max_new_tokens)])
                    for i, (n, p) in enumerate(zip(slots, params))]
            token_bytes = arena.segment_size * arena.bytes_per_token()
            stats.kv_bytes_peak = max(stats.kv_bytes_peak, sum(map(len, held)) * token_bytes)
            static_need = sum(allocator.segments_for(len(t) + p.max_new_tokens) for t, p in zip(prompts, params))
            stats.kv_bytes_static_peak = max(stats.kv_bytes_static_peak, static_need * token_bytes)
            sampling = SamplingBatch.build(params, logits.shape[-1], self.device)
            steps = torch.zeros(len(prompts), dtype=torch.long, device=self.device)
            tokens = sample(logits, sampling, steps)
            sync()
            stats.prefill_s += time.perf_counter() - started
            started = time.perf_counter()
            # active[j] = index into `rows` of the row in batch position (= stripe) j
            active = list(range(len(prompts)))
            positions = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=self.device)
            merged = slots != [len(p) for p in prompts]  # RoPE positions and cache slots part ways
            write_slots = torch.tensor(slots, dtype=torch.long, device=self.device) if merged else None
            while True:
                finished = [j for j, tok in enumerate(tokens.tolist()) if rows[active[j]].append(tok, decode_text)]
                if finished:
                    keep = self._compact(active, slots, held, finished)
                    if not active:
                        break
                    keep_t = torch.tensor(keep, device=self.device)
                    tokens, positions, steps = tokens[keep_t], positions[keep_t], steps[keep_t]
                    write_slots = write_slots[keep_t] if merged else None
                    sampling = sampling.select(keep_t)
                logits = runner.decode(tokens, positions, max(slots) + 1, write_slots)
                steps += 1
                tokens = sample(logits, sampling, steps)
                positions += 1
                if merged:
                    write_slots += 1
                slots = [n + 1 for n in slots]
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

    def _prefill(self, prompts: list[list[int]], stats: GenerateStats) -> tuple[torch.Tensor, list[int]]:
        """Fill stripes 0..B-1 with the prompts' KV -> (last-token logits [B, V], cache slots per row).

        Plain static rows share one right-padded batched prefill. Segment-sparse rows and rows longer
        than max_input_len (rolling merge) are prefilled one at a time into their own region, then
        merged down, so a row never needs more than its stripe once its prefill is done.
        """
        arena, limit = self.runner.arena, self.options.max_input_len
        arena.bias.zero_()
        sparse = self.options.cache_policy == "segment_sparse"
        if not sparse and all(len(p) <= limit for p in prompts):
            stats.computed_slots += len(prompts) * max(map(len, prompts))
            return self.runner.prefill(prompts), [len(p) for p in prompts]
        budget = compressed_length(limit, self.merge) if sparse else limit
        last_logits, slots = [], []
        for i, prompt in enumerate(prompts):
            start = i * arena.row_capacity
            if len(prompt) > limit:
                logits, used = self.rolling_prefill(prompt, start, budget)
            else:
                observe = self.merge.window if sparse else 0
                logits, scores = self.runner.extend(prompt, start, 0, 0, observe=observe)
                used = len(prompt)
                if sparse:
                    plan = plan_groups(used, choose_groups(scores, used, self.merge, "segment_sparse"))
                    used = apply_plan(arena, start, used, start, plan)
            stats.computed_slots += len(prompt)
            last_logits.append(logits[-1])
            slots.append(used)
        return torch.stack(last_logits), slots

    def rolling_prefill(self, prompt: list[int], start: int, budget: int) -> tuple[torch.Tensor, int]:
        """long_input=rolling_merge: prefill segment by segment; before a segment would overflow
        `budget` slots, fold the oldest slots 4:1 (again and again for the oldest history).

        Called by `_prefill` for over-long rows and by the quality harness. Returns the last
        position's logits and the slots the row now holds at flat slot `start`."""
        chunk = min(self.options.segment_size, budget - self.merge.sinks - self.merge.window)
        if chunk < 1:
            raise ConfigError(f"max_input_len={self.options.max_input_len} leaves no room to roll a long prompt "
                              f"past {self.merge.sinks} sink and {self.merge.window} window tokens; raise it.")
        # positions run on past the slots: the RoPE table must cover the true token count
        self.runner.model.build_rotary(len(prompt) + self.options.max_output_len)
        counts: list[int] = []
        logits = None
        for begin in range(0, len(prompt), chunk):
            piece = prompt[begin : begin + chunk]
            overflow = len(counts) + len(piece) - budget
            if overflow > 0:
                plan = plan_oldest(counts, overflow, self.merge)
                if plan.num_slots + len(piece) > budget:
                    raise ConfigError(f"rolling merge cannot fit a {len(prompt)}-token prompt into {budget} slots; "
                                      "raise max_input_len or shorten the prompt.")
                apply_plan(self.runner.arena, start, len(counts), start, plan)
                counts = plan.counts
            logits, _ = self.runner.extend(piece, start, len(counts), begin)
            counts += [1] * len(piece)
        return logits, len(counts)

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
