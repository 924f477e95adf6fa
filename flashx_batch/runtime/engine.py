"""`Engine`: the public Python API (DESIGN.md "Python API") for static-batch generation.

Who calls it: users directly, each Ray actor / the local executor once per shard, the benchmarks.
One `generate` call = rows sorted by length; the first batch is prefilled together (packed, no
padding), then decode steps run until every row stops. A finished row leaves the batch at once, so
it costs no more compute, and with `refill` the next queued rows are prefilled into the freed KV
(extents or stripes, see `kv_layout`) between two steps. Without refill (or with prefix reuse, whose
batches are paged) the queue is cut into static batches.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from flashx_batch.backends import Backend, get_backend
from flashx_batch.errors import ConfigError, PromptTooLongError
from flashx_batch.models.config import ModelConfig
from flashx_batch.models.layers import RotaryTable
from flashx_batch.models.loader import load_model
from flashx_batch.runtime.batches import ExtentBatch, PagedBatch, StripedBatch, share_prefixes
from flashx_batch.runtime.decode_graphs import DecodeGraphs
from flashx_batch.runtime.kv import KVArena
from flashx_batch.runtime.kv_merge import MergeSettings, apply_plan, max_compressed_length, plan_oldest
from flashx_batch.runtime.model_runner import ModelRunner
from flashx_batch.runtime.options import EngineOptions, bundled_model_dir
from flashx_batch.runtime.prefix_cache import PrefixCache
from flashx_batch.runtime.sampling import SamplingBatch, SamplingParams, sample
from flashx_batch.runtime.stops import RowState
from flashx_batch.runtime.tokenizer import Tokenizer

log = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# packed weight copies for every grown decode batch size only while the model is small: 4 sizes of a 1 GiB model
# are 4 GiB more host memory
PACK_ALL_SIZES_BYTES = 1 << 30
PAGED_GROWTH = 4  # a batch of rows sharing cached prefixes may hold up to 4 x max_batch_size rows


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
    cached_prompt_tokens: int = 0  # prompt tokens read from the prefix cache instead of computed
    prefix_tokens_computed: int = 0  # shared-prefix tokens computed once and cached
    batch_sizes: list[int] = field(default_factory=list)
    peak_rows: int = 0  # the most rows decoding at once (batch_growth and refill can exceed a batch's start)
    relayouts: int = 0  # times a batch moved its live KV: stripes re-cut for more, shorter rows, or extents compacted
    row_latency_s: list[float] = field(default_factory=list)  # per row: its prefill start -> its last token

    @property
    def padding_efficiency(self) -> float:
        """Useful ÷ computed token slots. Useful: the prompt tokens actually computed (prefix-cache hits
        are not computed at all) plus all but one generated token per row (the last sampled token is
        never fed back through the model)."""
        useful = self.prefill_tokens_computed + self.output_tokens - self.rows
        return useful / self.computed_slots if self.computed_slots else 1.0

    @property
    def prefill_tokens_computed(self) -> int:
        """Prompt tokens run through the model: each row's own part plus shared prefixes once."""
        return self.input_tokens - self.cached_prompt_tokens + self.prefix_tokens_computed

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
            "kv_bytes_static_peak": self.kv_bytes_static_peak,
            "max_batch_size": max(self.batch_sizes + [self.peak_rows]), "relayouts": self.relayouts,
            "decode_steps": self.decode_steps, "cached_prompt_tokens": self.cached_prompt_tokens,
            "prefill_tokens_computed": self.prefill_tokens_computed,
            "prefix_hit_rate": self.cached_prompt_tokens / self.input_tokens if self.input_tokens else 0.0,
        }


@dataclass
class _LiveRows:
    """The rows still decoding, in batch-position order, with their device-side state: the last
    sampled token (the next step's input), tokens generated so far, and sampling knobs."""

    rows: list[int]
    tokens: torch.Tensor
    steps: torch.Tensor
    sampling: SamplingBatch | None

    @classmethod
    def empty(cls, device: torch.device) -> _LiveRows:
        none = torch.zeros(0, dtype=torch.long, device=device)
        return cls([], none, none.clone(), None)

    def join(self, rows: list[int], tokens: torch.Tensor, steps: torch.Tensor, sampling: SamplingBatch) -> None:
        self.rows += rows
        self.tokens, self.steps = torch.cat((self.tokens, tokens)), torch.cat((self.steps, steps))
        self.sampling = sampling if self.sampling is None else self.sampling.extend(sampling)

    def keep(self, positions: list[int]) -> None:
        """Keep only these batch positions, in this order (what `batch.drop` returned)."""
        self.rows = [self.rows[j] for j in positions]
        index = torch.tensor(positions, dtype=torch.long, device=self.tokens.device)
        self.tokens, self.steps, self.sampling = self.tokens[index], self.steps[index], self.sampling.select(index)


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


def check_prompt_ids(index: int, ids: list[int], vocab_size: int) -> None:
    """Refuse an empty prompt or token ids outside the vocabulary (which would otherwise fail deep in
    the embedding lookup with a bare IndexError), naming the prompt."""
    if not ids:
        raise ConfigError(f"prompt {index} is empty after tokenization; an empty prompt has nothing to continue.")
    if min(ids) < 0 or max(ids) >= vocab_size:
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise ConfigError(f"prompt {index} holds token id {bad}, outside the model's vocabulary "
                          f"(0..{vocab_size - 1}); pass ids from this model's tokenizer, or text.")


def check_options(options: EngineOptions, cfg: ModelConfig | None = None,
                  backend: Backend | None = None) -> torch.dtype | None:
    """Every refusal an engine makes for `options` (on the model `cfg`, on `backend`, where known);
    returns the weight dtype on `backend`. The engine and the job's preflight both call it, so a job
    is refused before its output directory is touched for exactly what the engine would refuse."""
    if options.backend == "onnx" and options.precision_map:
        raise ConfigError("runtime.precision_map does not apply to backend=onnx (the export needs float weights); "
                          "drop one of the two.")
    if cfg is not None:
        needed = options.max_input_len + options.max_output_len
        if needed > cfg.max_position_embeddings:
            log.warning("max_input_len + max_output_len = %d exceeds the model's max_position_embeddings=%d",
                        needed, cfg.max_position_embeddings)
        if cfg.sliding_window is not None and needed > cfg.sliding_window:
            raise ConfigError(
                f"max_input_len + max_output_len = {needed} exceeds the model's sliding_window="
                f"{cfg.sliding_window}; sliding-window attention is not implemented, keep rows within it."
            )
    if backend is None:
        return None
    if options.cuda_graphs == "on" and not backend.supports_graphs:
        raise ConfigError(f"runtime.cuda_graphs=on needs a backend that captures CUDA graphs (cuda); this "
                          f"engine runs on {backend.name}. Use cuda_graphs=auto (graphs where the "
                          "backend has them) or off.")
    dtype = backend.default_dtype if options.dtype == "auto" else _DTYPES[options.dtype]
    if dtype not in backend.supported_dtypes:
        raise ConfigError(f"model.dtype={options.dtype} is not supported on {backend.name}.")
    return dtype


class Engine:
    def __init__(self, model_dir: Path, options: EngineOptions) -> None:
        self.model_dir = Path(model_dir)
        self.options = options
        self.backend: Backend = get_backend(options.backend)
        if not self.backend.torch_runtime:
            raise ConfigError(f"runtime.backend={options.backend} runs through Engine.from_pretrained, "
                              "which dispatches it to its own engine; do not construct Engine directly.")
        self.config = ModelConfig.from_dir(self.model_dir)
        self.dtype = check_options(options, self.config, self.backend)
        if self.backend.name == "cpu":
            torch.set_num_threads(options.cpu_threads())
        index = self.backend.assigned_device_index(_ray_accelerator_ids())
        self.backend.set_device(index)
        self.device = self.backend.device(index)
        started = time.perf_counter()
        model = load_model(self.model_dir, self.dtype, self.device, options.row_capacity)
        if options.precision_map:
            from flashx_batch.quant import apply_precision_map, load_precision_map

            apply_precision_map(model, load_precision_map(options.precision_map), self.model_dir)
        self.merge = MergeSettings(options.kv_merge_fraction, sinks=4, window=options.kv_observe_window,
                                   evict_share=options.kv_evict_share)
        # the most slots a prompt holds once in the cache (what a rolling merge folds a long one into)
        limit, sparse = options.max_input_len, options.cache_policy == "segment_sparse"
        self.prompt_slots = max_compressed_length(limit, self.merge) if sparse else limit
        arena = self._build_arena()
        if options.prepack_weights:
            self.backend.prepare_model(model, self._decode_pack_sizes(model, arena.base_rows))
        self.runner = ModelRunner(model, arena, pad_id=self.config.pad_token_id or 0)
        if options.cuda_graphs != "off" and self.backend.supports_graphs:
            self.runner.graphs = DecodeGraphs(self.runner)
        self.prefix_cache: PrefixCache | None = None
        self.trash_slot = -1  # paged batches only: where padding positions write (the arena's last segment)
        if options.prefix_cache_tokens:
            self.trash_slot = (arena.num_segments - 1) * arena.segment_size
            first = arena.striped_segments
            self.prefix_cache = PrefixCache(arena.allocator, range(first, arena.num_segments - 1),
                                            arena.num_segments - 1 - first)
            arena.allocator.take([arena.num_segments - 1])  # the trash segment is never handed out
        has_tokenizer = (self.model_dir / "tokenizer.json").is_file()
        self.tokenizer: Tokenizer | None = Tokenizer(self.model_dir) if has_tokenizer else None
        self.eos_token_ids = tuple(dict.fromkeys(self.config.eos_token_ids + _read_generation_eos(self.model_dir)))
        self.last_stats = GenerateStats()
        log.info("engine ready: %s %s on %s (%s), arena %.1f MiB, %.2fs", self.config.architecture,
                 self.model_dir.name, self.device, self.dtype, arena.nbytes / 2**20, time.perf_counter() - started)

    def _decode_pack_sizes(self, model: torch.nn.Module, base_rows: int) -> list[int]:
        """Decode batch sizes to keep packed weights for: the base rows, and with growing batches each
        multiple of them up to the growth cap — one more copy of the weights per size, so a model over
        PACK_ALL_SIZES_BYTES of weights keeps the base size only (grown batches then use plain sgemm)."""
        growth = self.options.batch_growth if self.grows_batches else 1
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        if growth > 1 and weight_bytes > PACK_ALL_SIZES_BYTES:
            log.info("weights of %.1f GiB: packed for %d-row decode batches only", weight_bytes / 2**30, base_rows)
            growth = 1
        return [base_rows * k for k in range(1, growth + 1)]

    def _build_arena(self) -> KVArena:
        """Static: `max_batch_size` stripes of max_input_len + max_output_len. Segment-sparse: the
        same bytes cut into shorter stripes (a merged prompt needs fewer slots), so more rows fit;
        a few spare segments hold the last row's prompt before it is merged down."""
        o, cfg = self.options, self.config
        rows, capacity, extra = o.max_batch_size, o.row_capacity, 0
        if o.prefix_cache_tokens:  # cache region + one trash segment after the stripes
            extra = -(-o.prefix_cache_tokens // o.segment_size) + 1
        if o.cache_policy == "segment_sparse":
            seg = o.segment_size
            capacity = -(-(self.prompt_slots + o.max_output_len) // seg) * seg
            extra = -(-max(0, o.max_input_len - capacity) // seg)
            rows = max(1, (o.max_batch_size * o.row_capacity - extra * seg) // capacity)
        return KVArena(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, rows, capacity, o.segment_size,
                       self.dtype, self.device, extra_segments=extra)

    @property
    def admitted_batch_size(self) -> int:
        """Rows per static batch of full-length rows (more than max_batch_size under segment_sparse;
        with `grows_batches`, a batch of shorter rows holds more, see `layout_for`)."""
        return self.runner.arena.base_rows

    @property
    def grows_batches(self) -> bool:
        """Whether batches of short rows take more rows in the same arena (`batch_growth`).

        Stripes are cut for the longest row still decoding or queued, so they only ever get shorter and
        no row waits for room. Sorted rows (`sort_by_length`) are what lets them shrink early: in
        arrival order one long row near the end of the queue keeps every stripe long until it is
        admitted. Static cache only: segment-sparse stripes are already cut for merged prompts, and
        prefix reuse runs paged batches with their own growth (`PAGED_GROWTH`)."""
        o = self.options
        return o.batch_growth > 1 and o.cache_policy == "static" and not o.prefix_cache_tokens

    @property
    def uses_extents(self) -> bool:
        """Whether refilled batches keep each row in an extent of its own (`batches.ExtentBatch`)
        instead of equal stripes: `kv_layout=extents`, or `auto` on a backend that prefers them
        (one attention call per run of rows: cheap on CPU, a kernel launch each on a GPU). Needs
        `grows_batches` (static cache, no prefix reuse, batch_growth > 1), refill (static batches
        keep stripes), and prompts that fit max_input_len (a rolled long prompt's positions and
        slots part ways: stripes handle that)."""
        layout = self.options.kv_layout
        wanted = layout == "extents" or (layout == "auto" and self.backend.prefers_row_extents)
        o = self.options
        return wanted and self.grows_batches and o.refill and o.long_input != "rolling_merge"

    def layout_for(self, slots: int) -> tuple[int, int]:
        """(stripe capacity, rows) for rows of at most `slots` KV slots each: as many rows as the stripe
        region holds, at most batch_growth x the base rows, each stripe as long as that leaves it (the
        slack lets slightly longer rows, with more new tokens, join later without a re-cut)."""
        arena = self.runner.arena
        seg = arena.segment_size
        need = max(seg, -(-slots // seg) * seg)
        rows = max(1, min(arena.base_rows * self.options.batch_growth, arena.striped_slots // need))
        return (arena.striped_slots // rows) // seg * seg, rows

    def _slots_needed(self, prompt: list[int], params: SamplingParams) -> int:
        """KV slots a row holds once it is done: its prompt (an over-long one is rolled into
        `prompt_slots`) plus every new token it may generate."""
        return min(len(prompt), self.prompt_slots) + params.max_new_tokens

    @classmethod
    def from_pretrained(cls, path: str | Path | None = None, **options) -> Engine:
        """Load a local Hugging Face directory (None = the bundled demo model) with `EngineOptions` knobs.

        `backend="onnx"` returns the ONNX Runtime engine (same `generate` contract) instead."""
        opts = EngineOptions(**options)
        model_dir = Path(path) if path is not None else bundled_model_dir()
        if opts.backend == "onnx":
            from flashx_batch.onnx import OnnxEngine

            check_options(opts)
            return OnnxEngine(model_dir, opts)
        return cls(model_dir, opts)

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
        needs = [self._slots_needed(t, p) for t, p in zip(token_lists, params)]  # KV slots each row ends with
        if self.prefix_cache is not None:  # rows sharing a prefix become neighbours, then batch-mates
            order.sort(key=lambda i: token_lists[i])
        elif self.options.sort_by_length:  # longest first, by the KV slots a row will hold at its end
            order.sort(key=lambda i: -needs[i])
        stats = GenerateStats(kv_bytes_arena=self.runner.arena.nbytes)
        results: dict[int, RequestOutput] = {}
        queue = deque(order)
        # per row: the most KV slots any row from it to the end of the queue will hold (batch growth
        # cuts stripes no shorter, so no queued row ever waits for room)
        longest_from, longest = {}, 0
        for i in reversed(order):
            longest = longest_from[i] = max(longest, needs[i])
        while queue:
            # in-flight refill: the batch takes the next queued rows into finished rows' KV (not under
            # prefix reuse: there a striped batch is a fallback, and the rows after it may share
            # prefixes again in a paged batch)
            refill = queue if self.options.refill and self.prefix_cache is None else None
            batch, runner = self._next_batch(queue, token_lists, params, stats, needs, longest_from if refill else None)
            done = self._run_batch(runner, batch, token_lists, params, stats, refill)
            for i, row in done.items():
                results[i] = RequestOutput(i, row.token_ids, self._final_text(row), row.finish_reason or "length",
                                           len(token_lists[i]), truncated[i])
        self.last_stats = stats
        return [results[i] for i in range(len(prompts))]

    @torch.inference_mode()
    def score(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """Teacher-forced float32 logits [T_i, V] for each whole sequence (quality measurements, parity
        tests). Sequences are never truncated or merged: each must fit a row of the arena."""
        capacity = self.runner.arena.row_capacity
        too_long = [i for i, p in enumerate(prompts) if not 0 < len(p) <= capacity]
        if too_long:
            raise ConfigError(f"score: sequences {too_long[:5]} are empty or longer than a row of the KV arena "
                              f"({capacity} tokens); raise max_input_len + max_output_len.")
        out: list[torch.Tensor] = []
        size = self.admitted_batch_size
        for start in range(0, len(prompts), size):
            out.extend(self.runner.score(prompts[start : start + size]))
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
            check_prompt_ids(i, ids, self.config.vocab_size)
            if len(ids) > limit and self.options.long_input != "rolling_merge":
                if self.options.long_input == "error":
                    raise PromptTooLongError(i, len(ids), limit)
                ids = ids[-limit:]  # truncate keeps the tail: the instruction usually comes last
            fitted.append(ids)
            truncated.append(len(ids) != len(token_lists[i]))
        return fitted, truncated

    def _final_text(self, row: RowState) -> str | None:
        return row.final_text(self.tokenizer.decode) if self.tokenizer is not None else None

    def _run_batch(self, batch: ExtentBatch | StripedBatch | PagedBatch, indices: list[int],
                   token_lists: list[list[int]], params: list[SamplingParams], stats: GenerateStats,
                   refill: deque[int] | None = None) -> dict[int, RowState]:
        """Prefill, then decode until every row has stopped; finished rows leave the batch at once.

        With `refill` (an extent or striped batch and the rest of the queue), freed KV is refilled
        from the front of the queue between two decode steps (one packed prefill for all the rows
        taken), so the batch stays full until the queue runs dry. Returns the rows by index into
        `token_lists`."""
        sync, device = self.backend.synchronize, self.device
        rows: dict[int, RowState] = {}
        began: dict[int, float] = {}  # row -> when its prefill started
        decode_text = self.tokenizer.decode if self.tokenizer is not None else (lambda ids: "")
        clock = time.perf_counter()

        def lap() -> float:  # seconds since the last lap, the device's queued work included
            nonlocal clock
            sync()
            now = time.perf_counter()
            took, clock = now - clock, now
            return took

        def start(new: list[int], logits: torch.Tensor, since: float) -> None:
            """Rows `new` were just prefilled (from time `since`) into the batch's next positions:
            sample their first tokens and join them to `live`; any that stop right there leave again."""
            for i in new:
                rows[i], began[i] = RowState.start(params[i], self.eos_token_ids), since
            sampling = SamplingBatch.build([params[i] for i in new], logits.shape[-1], device)
            steps = torch.zeros(len(new), dtype=torch.long, device=device)
            base = len(live.rows)
            live.join(new, sample(logits, sampling, steps), steps, sampling)
            stats.peak_rows = max(stats.peak_rows, len(live.rows))
            firsts = live.tokens[base:].tolist()
            stop([base + k for k, tok in enumerate(firsts) if rows[new[k]].append(tok, decode_text)])

        def stop(done: list[int]) -> None:
            if done:
                now = time.perf_counter()
                stats.row_latency_s.extend(now - began[live.rows[j]] for j in done)
                live.keep(batch.drop(done))

        live = _LiveRows.empty(device)
        try:
            start(list(indices), batch.prefill(), clock)
            stats.prefill_s += lap()
            while True:
                if refill and batch.joinable(refill):
                    stats.decode_s += lap()
                    batch.prepare_refill(refill)  # growing stripes: re-cut them for the rows left
                    while refill and (take := batch.joinable(refill)):  # rows that stop on their first token
                        new = [refill.popleft() for _ in range(take)]  # free room again
                        since = time.perf_counter()
                        start(new, batch.admit([token_lists[i] for i in new], [params[i] for i in new]), since)
                    stats.prefill_s += lap()
                if not live.rows:
                    break
                logits = batch.step(live.tokens)
                live.steps += 1
                live.tokens = sample(logits, live.sampling, live.steps)
                stats.decode_steps += 1
                stats.computed_slots += len(live.rows)
                stop([j for j, tok in enumerate(live.tokens.tolist()) if rows[live.rows[j]].append(tok, decode_text)])
            stats.decode_s += lap()
        finally:
            batch.release()
        stats.rows += len(rows)
        stats.batches += 1
        stats.batch_sizes.append(len(indices))
        stats.input_tokens += sum(len(token_lists[i]) for i in rows)
        stats.output_tokens += sum(len(r.token_ids) for r in rows.values())
        return rows

    def _next_batch(self, queue: deque[int], token_lists: list[list[int]], params: list[SamplingParams],
                    stats: GenerateStats, needs: list[int], longest_from: dict[int, int] | None
                    ) -> tuple[list[int], ExtentBatch | StripedBatch | PagedBatch]:
        """Take the next batch off the front of `queue` (indices into token_lists / params).

        Striped: `admitted_batch_size` rows. Paged (rows share cached prefix segments): a row only
        needs segments for its own suffix and new tokens, so as many rows as the stripe region can
        hold join — up to PAGED_GROWTH x max_batch_size — which is where prefix sharing saves memory.
        """
        size = self.admitted_batch_size
        if self.prefix_cache is not None:
            candidates = list(itertools.islice(queue, size * PAGED_GROWTH))
            prompts = [token_lists[i] for i in candidates]
            if all(len(p) <= self.options.max_input_len for p in prompts):
                shared = share_prefixes(self, prompts, stats)
                if shared is not None:
                    fit = self._paged_fit(prompts, [params[i] for i in candidates], shared, size)
                    for segments in shared[fit:]:  # rows left for the next batch drop their references
                        self.runner.arena.allocator.release(segments)
                    batch = [queue.popleft() for _ in range(fit)]
                    return batch, PagedBatch(self, prompts[:fit], [params[i] for i in batch], stats, shared[:fit])
        if self.uses_extents and longest_from is not None:
            first = ExtentBatch(self, [], [], stats, needs)
            batch = [queue.popleft() for _ in range(max(1, first.joinable(queue)))]
            return batch, ExtentBatch(self, [token_lists[i] for i in batch], [params[i] for i in batch], stats, needs)
        if self.grows_batches:
            self.runner.arena.set_layout(*self._first_layout(queue, needs, longest_from))
            size = self.runner.arena.max_rows
        batch = [queue.popleft() for _ in range(min(size, len(queue)))]
        return batch, StripedBatch(self, [token_lists[i] for i in batch], [params[i] for i in batch], stats,
                                   longest_from if self.grows_batches else None)

    def _first_layout(self, queue: deque[int], needs: list[int], longest_from: dict[int, int] | None
                      ) -> tuple[int, int]:
        """The layout a striped batch starts in. Refilled (`longest_from` given): stripes for the longest
        row still queued, since every one of them may join this batch. Static batches (no refill): for
        the longest of the rows this batch takes, shrinking the row count until they all fit."""
        if longest_from is not None:
            return self.layout_for(longest_from[queue[0]])
        need = needs[queue[0]]
        while True:
            capacity, rows = self.layout_for(need)
            longest = max(needs[i] for i in itertools.islice(queue, rows))
            if longest <= capacity:
                return capacity, rows
            need = longest

    def _paged_fit(self, prompts: list[list[int]], params: list[SamplingParams], shared: list[list[int]],
                   at_least: int) -> int:
        """How many leading rows' own segments fit in the stripe region (at least `at_least`)."""
        arena = self.runner.arena
        free = arena.allocator.free_in(range(arena.striped_segments))
        need, fit = 0, 0
        for prompt, p, segments in zip(prompts, params, shared):
            need += arena.allocator.segments_for(len(prompt) - len(segments) * arena.segment_size + p.max_new_tokens)
            if need > free:
                break
            fit += 1
        return max(fit, min(at_least, len(prompts)))

    def _record_kv(self, stats: GenerateStats, segments_held: int, static_segments: int) -> None:
        segment_bytes = self.runner.arena.segment_size * self.runner.arena.bytes_per_token()
        stats.kv_bytes_peak = max(stats.kv_bytes_peak, segments_held * segment_bytes)
        stats.kv_bytes_static_peak = max(stats.kv_bytes_static_peak, static_segments * segment_bytes)

    def rolling_prefill(self, prompt: list[int], start: int, budget: int) -> tuple[torch.Tensor, int]:
        """long_input=rolling_merge: prefill segment by segment; before a segment would overflow
        `budget` slots, fold the oldest slots 4:1 (again and again for the oldest history).

        Called by `StripedBatch._fill_rolling` (budget `prompt_slots`) and by the quality harness. Returns the last
        position's logits and the slots the row now holds at flat slot `start`."""
        chunk = min(self.options.segment_size, budget - self.merge.sinks - self.merge.window)
        if chunk < 1:
            raise ConfigError(f"max_input_len={self.options.max_input_len} leaves no room to roll a long prompt "
                              f"past {self.merge.sinks} sink and {self.merge.window} window tokens; raise it.")
        # positions run on past the slots: the RoPE table must cover the true token count
        self.runner.model.build_rotary(len(prompt) + self.options.max_output_len)
        counts: list[int] = []
        positions: list[float] = []
        logits = None
        for begin in range(0, len(prompt), chunk):
            piece = prompt[begin : begin + chunk]
            overflow = len(counts) + len(piece) - budget
            if overflow > 0:
                plan = plan_oldest(counts, positions, overflow, self.merge)
                if plan.num_slots + len(piece) > budget:
                    raise ConfigError(f"rolling merge cannot fit a {len(prompt)}-token prompt into {budget} slots; "
                                      "raise max_input_len or shorten the prompt.")
                apply_plan(self.runner.arena, start, len(counts), start, plan, rotary=self.merge_rotary,
                           src_positions=positions)
                counts, positions = plan.counts, plan.positions
            logits, _ = self.runner.extend(piece, start, len(counts), begin)
            counts += [1] * len(piece)
            positions += [float(p) for p in range(begin, begin + len(piece))]
        return logits, len(counts)

    @property
    def merge_rotary(self) -> RotaryTable | None:
        """The RoPE table merges re-rotate keys with (None: average rotated keys as they are)."""
        return self.runner.model.rotary if self.merge.rerotate else None
