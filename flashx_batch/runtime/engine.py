"""`Engine`: the public Python API (`Engine.from_pretrained`, `generate`, `score`, `loglikelihood`,
`loglikelihood_rolling`, `choice_logprobs`).

Who calls it: users directly, each Ray actor / the local executor once per shard, the benchmarks.
An engine is three parts: a `Scheduler` (plain Python: which rows run, where their KV lives), a
`ModelRunner` (the device: `TorchRunner`, or `OnnxRunner` for `backend=onnx`) and the loop between
them in `generate`. Input checks live in `runtime.inputs`, arena sizing in `runtime.kv_sizing`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from flashx_batch.backends import Backend, get_backend, ray_accelerator_ids
from flashx_batch.backends.distributed import Rendezvous, ReplicaBroken
from flashx_batch.errors import ConfigError
from flashx_batch.kvcache.arena import KVArena
from flashx_batch.kvcache.geometry import ArenaGeometry
from flashx_batch.kvcache.spec import slot_bytes
from flashx_batch.models.config import ModelConfig
from flashx_batch.models.loader import load_model
from flashx_batch.models.lora import LoraSet
from flashx_batch.models.parallel import TensorShard, rank_config
from flashx_batch.models.peft_adapter import read_adapter
from flashx_batch.quant.checkpoint_linear import quantized_linear
from flashx_batch.runtime import kv_sizing
from flashx_batch.runtime.capabilities import Capabilities, capabilities
from flashx_batch.runtime.checkpoint_pooling import UnsupportedPooling, checkpoint_pooling
from flashx_batch.runtime.decode_graphs import DecodeGraphs
from flashx_batch.runtime.grammar import BadConstraint, GrammarBook
from flashx_batch.runtime.inputs import (
    check_lora_options,
    check_options,
    effective_config,
    fit_prompts,
    generation_eos,
    per_row_params,
)
from flashx_batch.runtime.json_budget import bound_reached
from flashx_batch.runtime.kv_merge import MergeSettings, max_compressed_length, protect_nats_for
from flashx_batch.runtime.loglikelihood import ChoiceScores, LogLikelihood
from flashx_batch.runtime.options import EngineOptions, bundled_model_dir
from flashx_batch.runtime.params import SamplingParams
from flashx_batch.runtime.results import GenerateStats, RequestOutput
from flashx_batch.runtime.rows import Row
from flashx_batch.runtime.runner import ModelRunner
from flashx_batch.runtime.scheduler import Scheduler, SchedulerConfig
from flashx_batch.runtime.scoring_api import ScoringApi
from flashx_batch.runtime.tensor_parallel import ReplicaRank, ReplicaRunner, local_thread_share
from flashx_batch.runtime.tokenizer import Tokenizer
from flashx_batch.runtime.torch_runner import PrefillPolicy, TorchRunner

log = logging.getLogger(__name__)

__all__ = ["ChoiceScores", "Engine", "GenerateStats", "RequestOutput", "check_options"]


class Engine(ScoringApi):
    def __init__(self, model_dir: Path, options: EngineOptions, onnx_cache_dir: Path | None = None,
                 rendezvous: Rendezvous | None = None, lora_adapters: Mapping[str, str | Path] | None = None) -> None:
        """`onnx_cache_dir`: where backend=onnx keeps its exports (default: `onnx.sessions.default_cache_dir`).
        `rendezvous`: this engine is one rank of a tensor-parallel replica whose ranks meet there (Ray
        actors); None with tensor_parallel_size > 1: this process is rank 0 and spawns the other ranks.
        `lora_adapters`: {name: PEFT adapter directory}, loaded once; `generate(..., adapters=)` picks one
        per prompt (`models.lora`)."""
        started = time.perf_counter()
        # `options`: as the caller gave them, never replaced. `run_options`: what this engine runs with, the
        # same but for what it derives: max_batch_size from kv_budget_mb, a local rank's share of threads
        self.model_dir, self.options, self.run_options = Path(model_dir), options, options
        self.backend: Backend = get_backend(options.backend)
        self.config = effective_config(ModelConfig.from_dir(self.model_dir), options)
        self.dtype = check_options(options, self.config, self.backend)
        self.lora_adapters = dict(lora_adapters or {})
        self._adapter_slot = {name: i + 1 for i, name in enumerate(self.lora_adapters)}  # `LoraSet`'s slots
        self.adapter_digests: dict[str, str] = {}  # name -> content digest of each adapter loaded
        if self.lora_adapters:
            check_lora_options(options, self.config)
        # what this model, these options and this backend can run: the runner's parts read it
        self.capabilities: Capabilities = capabilities(self.config, options, self.backend)
        self.replica: ReplicaRank | None = None  # this engine's place in a tensor-parallel replica
        if options.tensor_parallel_size > 1:
            if rendezvous is None:  # local ranks share this machine's cores
                options = self.run_options = local_thread_share(options)
            self.replica = ReplicaRank.start(self.model_dir, options, onnx_cache_dir, rendezvous)
        try:
            self._build(onnx_cache_dir)
        except BaseException as exc:
            if self.replica is not None:
                self._leave_replica(f"{type(exc).__name__}: {exc}")
            raise
        if self.replica is not None:
            try:
                self.replica.comm.agree(None)  # every rank loaded (else: which did not, and why)
            except BaseException:
                self._leave_replica(None)
                raise
            if self.replica.rank == 0:
                self.runner = ReplicaRunner(self.runner, self.replica.comm, on_broken=self.replica.close)
        log.info("engine ready: %s %s on %s (%s), arena %.1f MiB%s, %.2fs", self.config.architecture,
                 self.model_dir.name, self.device, self.dtype, self.runner.kv_bytes / 2**20,
                 f", rank {self.replica.rank} of {self.replica.size}" if self.replica else "",
                 time.perf_counter() - started)

    def _build(self, onnx_cache_dir: Path | None) -> None:
        options = self.run_options
        self.backend.setup_threads(options.cpu_threads())
        assigned = lambda: self.backend.assigned_device_index(ray_accelerator_ids())  # noqa: E731
        index = self.replica.device_index(assigned) if self.replica is not None else assigned()
        self.backend.set_device(index)
        self.device = self.backend.device(index)
        if self.replica is not None:
            self.replica.connect(self.backend, self.device)
        has_tokenizer = (self.model_dir / "tokenizer.json").is_file()
        self.tokenizer: Tokenizer | None = Tokenizer(self.model_dir) if has_tokenizer else None
        self.eos_token_ids = tuple(dict.fromkeys(self.config.eos_token_ids + generation_eos(self.model_dir)))
        # the arena's geometry (rows, slots) from the bytes one slot takes on this device: a tensor-parallel
        # rank's share of the KV heads (the same on every rank, so every rank plans the same slots)
        local = rank_config(self.config, self.replica.size) if self.replica is not None else self.config
        slot = slot_bytes(local.cache_spec(), self.dtype.itemsize)
        options = self.run_options = kv_sizing.rows_for_budget(options, slot)
        merge = MergeSettings(options.merge_fraction, sinks=4, window=options.kv_observe_window,
                              evict_share=options.evict_share, protect_nats=protect_nats_for(self.config.vocab_size))
        # the most slots a prompt holds once in the cache (what a rolling merge folds a long one into)
        limit, sparse = options.max_input_len, options.cache_policy == "segment_sparse"
        self.prompt_slots = max_compressed_length(limit, merge) if sparse else limit
        self.geometry: ArenaGeometry = kv_sizing.arena_geometry(options, self.prompt_slots)
        if self.backend.torch_runtime:
            self.runner: ModelRunner = self._torch_runner(merge)
        else:
            from flashx_batch.runtime.onnx_runner import OnnxRunner

            self.runner = OnnxRunner(self.model_dir, options, self.config, self.backend, onnx_cache_dir)
        self.scheduler = Scheduler(self._scheduler_config(), self.geometry, self.eos_token_ids,
                                   self.tokenizer.decode if self.tokenizer is not None else (lambda ids: ""),
                                   prefix_reuse=options.prefix_cache_tokens > 0 and self.runner.traits.kv_arena)
        self.last_stats = GenerateStats()
        self._lm: LogLikelihood | None = None
        self._grammars: GrammarBook | None = None
        try:  # a sentence-transformers checkpoint's own embedding head (None: it has none)
            own = checkpoint_pooling(self.model_dir)
            self._own_pooling = own.to(self.device) if own is not None else None
        except UnsupportedPooling as exc:  # refused when something embeds, not for generation
            self._own_pooling = exc

    def _leave_replica(self, failure: str | None) -> None:
        """This rank could not start: tell the others why (when the group formed), end local ranks."""
        replica = self.replica
        if replica.comm is None:
            replica.fail_before_connecting(failure or "start-up failed")
        elif failure is not None:
            with contextlib.suppress(ReplicaBroken):
                replica.comm.agree(failure)
        replica.close()

    def close(self) -> None:
        """Release what outlives a Python object: a tensor-parallel replica's other ranks (stopped, and
        their processes ended). A single-rank engine holds nothing to release."""
        if self.replica is not None and self.replica.rank == 0:
            self.replica.close(self.runner)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _torch_runner(self, merge: MergeSettings) -> TorchRunner:
        o, cfg = self.run_options, self.config
        shard = TensorShard(self.replica.rank, self.replica.size, self.replica.comm) if self.replica else None
        model = load_model(self.model_dir, self.dtype, self.device, o.row_capacity, cfg, shard,
                           quantized_linears=quantized_linear if o.quantized_weights == "keep" else None)
        if self.lora_adapters:
            model.lora = LoraSet(model, [read_adapter(n, p, cfg) for n, p in self.lora_adapters.items()])
            self.adapter_digests = {a.name: a.digest for a in model.lora.adapters}
        if o.precision_map:
            from flashx_batch.quant import apply_precision_map, load_precision_map

            apply_precision_map(model, load_precision_map(o.precision_map), self.model_dir)
        arena = KVArena(model.local_config.cache_spec(), self.geometry.num_slots, self.dtype, self.device)
        if o.prepack_weights:
            self.backend.prepare_model(model)
        policy = PrefillPolicy(o.max_input_len, self.prompt_slots, o.cache_policy == "segment_sparse",
                               o.segment_size, o.max_output_len, self.geometry.base_capacity)
        caps, graphs = self.capabilities, None
        if o.cuda_graphs != "off" and caps.decode_graphs and not self.lora_adapters:  # graphs hold no adapters
            graphs = lambda passes: DecodeGraphs(passes, backend=self.backend)  # noqa: E731
        return TorchRunner(model, arena, self.backend, policy, merge, pad_id=cfg.pad_token_id or 0,
                           fuse_int8_decode=bool(caps.fused_int8_decode), graphs=graphs,
                           packed_scoring=bool(caps.packed_scoring))

    def _scheduler_config(self) -> SchedulerConfig:
        o, arena_free = self.run_options, not self.runner.traits.kv_arena
        return SchedulerConfig(
            max_input_len=o.max_input_len, prompt_slots=self.prompt_slots,
            refill=o.refill and not arena_free, sort_by_length=o.sort_by_length, batch_growth=o.batch_growth,
            grows_batches=self.grows_batches, uses_extents=self.uses_extents,
            segment_bytes=self.geometry.segment_size * self.runner.kv_bytes_per_slot,
            layer_slot_bytes=self.runner.kv_bytes_per_slot // max(1, self.config.num_layers),
            split_min_bytes=self.backend.attention_split_min_bytes)

    @classmethod
    def from_pretrained(cls, path: str | Path | None = None, onnx_cache_dir: Path | None = None,
                        lora_adapters: Mapping[str, str | Path] | None = None, **options) -> Engine:
        """Load a local Hugging Face directory (None = the bundled demo model) with `EngineOptions` knobs.
        `backend="onnx"` runs the same engine over ONNX Runtime sessions (`OnnxRunner`).
        `lora_adapters`: {name: PEFT adapter directory} that `generate(..., adapters=)` can pick per prompt."""
        model_dir = Path(path) if path is not None else bundled_model_dir()
        return cls(model_dir, EngineOptions(**options), onnx_cache_dir, lora_adapters=lora_adapters)

    @property
    def merge(self) -> MergeSettings | None:
        """The segment-sparse merge settings (the torch runner's; None for a runner that merges nothing)."""
        return getattr(self.runner, "merge", None)

    # ---- layout policy (see runtime.kv_sizing) ----------------------------------------------
    @property
    def admitted_batch_size(self) -> int:
        """Rows per static batch of full-length rows (more than max_batch_size under segment_sparse;
        with `grows_batches`, a batch of shorter rows holds more, see `layout_for`)."""
        return self.geometry.base_rows

    @property
    def grows_batches(self) -> bool:
        return kv_sizing.grows_batches(self.run_options) and self.runner.traits.kv_arena

    @property
    def uses_extents(self) -> bool:
        return (kv_sizing.uses_extents(self.run_options, self.backend.prefers_row_extents)
                and self.runner.traits.kv_arena)

    def layout_for(self, slots: int) -> tuple[int, int]:
        """(stripe capacity, rows) for rows of at most `slots` KV slots each (see `ArenaGeometry`)."""
        return self.geometry.layout_for(slots, self.run_options.batch_growth)

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
                 sampling: SamplingParams | list[SamplingParams] | None = None,
                 adapters: Sequence[str | None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in input order. A prompt
        whose params ask for n > 1 samples gives n consecutive outputs (sample_index 0..n-1), each a
        row of its own seeded by `SamplingParams.sample_seed` (prefix reuse computes their shared
        prompt once; without it each sample prefills its own copy). `adapters`: per prompt, the name
        of a LoRA adapter the engine loaded, or None for the base model; prompts of different adapters
        share batches."""
        self._need_lm_head("generate")
        slots = self._adapter_slots(adapters, len(prompts))
        params = per_row_params(sampling, len(prompts), self.run_options.max_output_len)
        compiles = self._check_constraints(params)
        token_lists, truncated = fit_prompts([self.encode(p) for p in prompts], self.run_options,
                                             self.config.vocab_size)
        rows, owners = [], []  # owners[i]: (prompt index, sample index) of rows[i]
        for i, (ids, p, cut, slot) in enumerate(zip(token_lists, params, truncated, slots)):
            for s in range(p.n):
                one = p if p.n == 1 else dataclasses.replace(p, seed=p.sample_seed(s), n=1)
                rows.append(Row(len(rows), ids, one, min(len(ids), self.prompt_slots) + p.max_new_tokens,
                                truncated=cut, adapter=slot))
                owners.append((i, s))
        stats = GenerateStats(kv_bytes_arena=self.runner.kv_bytes)
        self._run(rows, stats)
        stats.grammar_compiles = self.grammar_compiles - compiles
        self.last_stats = stats
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        outs = [RequestOutput(i, r.state.token_ids, r.state.final_text(decode) if decode else None,
                              r.state.finish_reason or "length", len(r.prompt), r.truncated, s,
                              r.state.logprobs, r.state.top_logprobs,
                              r.grammar.met if r.grammar is not None else None) for r, (i, s) in zip(rows, owners)]
        for out, row in zip(outs, rows):
            p = row.params
            if p.json_schema is not None and p.json_fit_budget and out.text is not None:
                out.json_bound_reached = bound_reached(p.json_schema, p.max_new_tokens, out.text)
        return outs

    def _adapter_slots(self, adapters: Sequence[str | None] | None, count: int) -> list[int]:
        """Each prompt's adapter slot in the model's `LoraSet` (0: the base model); ConfigError for a
        name this engine did not load or a list of the wrong length."""
        if adapters is None:
            return [0] * count
        if len(adapters) != count:
            raise ConfigError(f"generate: {len(adapters)} adapters for {count} prompts; give one per prompt "
                              "(None for the base model).")
        names = self._adapter_slot
        unknown = sorted({a for a in adapters if a is not None and a not in names})
        if unknown:
            loaded = ", ".join(names) or "none"
            raise ConfigError(f"generate: LoRA adapter(s) {unknown} were not loaded (loaded: {loaded}); pass "
                              "them in lora_adapters={name: directory} when building the engine.")
        return [0 if a is None else names[a] for a in adapters]

    # ---- constrained decoding (runtime/grammar.py) -------------------------------------------
    @property
    def grammars(self) -> GrammarBook:
        """The grammar library's state for this engine (built on first use: the tokenizer read once)."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise ConfigError(f"{self.model_dir}/tokenizer.json is missing; constrained decoding (json_schema, "
                                  "regex, choice, grammar) needs the model's tokenizer to know what each token spells.")
            self._grammars = GrammarBook(self.tokenizer.path, self.config.vocab_size, self.eos_token_ids)
            self.scheduler.grammars = self._grammars
        return self._grammars

    @property
    def grammar_compiles(self) -> int:
        """Grammars this engine has compiled (each distinct constraint once, while it stays cached)."""
        return self._grammars.compiles if self._grammars is not None else 0

    def _check_constraints(self, params: list[SamplingParams]) -> int:
        """Compile every distinct constraint of the call before any work (`BadConstraint`, naming the first
        prompt that asked for it) -> this engine's compile count before the call."""
        before = self.grammar_compiles
        seen: set = set()
        for i, p in enumerate(params):
            c = p.constraint
            if c is None or c in seen:
                continue
            seen.add(c)
            problem = self.grammars.problem(c)
            if problem is not None:
                raise BadConstraint(f"prompt {i}: {p.describe_constraint()} cannot be compiled: {problem}")
        return before

    def warm_up(self) -> None:
        """One tiny greedy generation through this engine's paths, so that the kernels its steps use compile
        (or load from their disk cache) now, at load, and not inside a job's first shard and its watchdog."""
        ids = list(range(1, min(9, self.config.vocab_size)))
        self.generate([ids], SamplingParams(max_new_tokens=min(2, self.run_options.max_output_len), ignore_eos=True))

    def _run(self, rows: list[Row], stats: GenerateStats) -> None:
        """The loop: the scheduler plans a step, the runner runs it, the scheduler takes the tokens.
        Prefills (with the KV copies before them) count as prefill time, the rest as decode time."""
        scheduler, runner = self.scheduler, self.runner
        scheduler.start(rows, stats)
        clock = time.perf_counter()
        try:
            while (plan := scheduler.schedule()) is not None:
                out = runner.run(plan, masks=scheduler.masks_for(plan))
                runner.synchronize()
                now = time.perf_counter()
                if plan.prefill is not None:
                    stats.prefill_s += now - clock
                else:
                    stats.decode_s += now - clock
                clock = now
                scheduler.postprocess(plan, out)
        except BaseException:
            scheduler.abort()
            runner.reset()
            raise
