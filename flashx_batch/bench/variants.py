"""What the harness compares: each variant runs a whole workload, timing each batch (or each row).

Called by the harness (`__main__`), the correctness gate and the GPU protocol. Every variant has the
same surface — `name`, `lossless`, `batch_size`, `run(workload) -> RunResult`. Static-batch variants
report each batch's latency; in-flight runs (no batch boundaries) report each row's.

- `transformers_arrival`: `transformers` `generate` on padded static batches in arrival order (left
  padding + attention mask, each batch generating its longest row's output length: one
  `max_new_tokens` per call), as vLLM's `--backend hf` offline benchmark does.
- `transformers_sorted`: the same, rows sorted by prompt length first.
- `ours_unbucketed` / `ours_bucketed`: our `Engine` with `sort_by_length` off / on, the whole workload
  in one `generate` call as a job shard runs it (in-flight refill keeps the batch full; on CPU each
  row in a KV extent of its own, `kv_layout=auto`).
- `ours_static`: bucketed, static batches (one call per batch, so no refill; prompts still packed), for reference.
- `ours_segment_sparse`: bucketed, `cache_policy="segment_sparse"` (lossy, so outside the gate).
- `ours_prefix_reuse`: the hook `prefix_reuse_options` — runs only once the engine offers prefix reuse.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from flashx_batch import Engine, SamplingParams
from flashx_batch.backends import for_device
from flashx_batch.bench.timing import timed
from flashx_batch.bench.workloads import Workload
from flashx_batch.runtime.options import EngineOptions

log = logging.getLogger(__name__)

# The EngineOptions field that turns prefix reuse on. The variant runs only when the engine has it.
PREFIX_REUSE_OPTION = "prefix_cache_tokens"


@dataclass
class BatchRecord:
    """One static batch as a variant ran it."""

    size: int
    seconds: float
    input_tokens: int  # useful: the rows' own prompt tokens
    output_tokens: int  # useful: the rows' own requested tokens
    computed_slots: float  # token positions the model ran, padding included
    useful_slots: float  # computed positions that were real tokens (prefix-cache hits are not computed)
    peak_rows: int = 0  # the most rows decoding at once (ours: batch growth and refill)


@dataclass
class RunResult:
    """A variant's pass over a workload: useful output tokens per row (workload order) and batches."""

    outputs: list[list[int]]
    batches: list[BatchRecord] = field(default_factory=list)
    row_latencies: list[float] | None = None  # in-flight runs: per row, admission -> last token

    @property
    def latencies(self) -> list[float]:
        """What the latency percentiles are taken over: each static batch's seconds, or, for a run
        that refills rows in flight (no batch boundaries), each row's own latency."""
        return self.row_latencies if self.row_latencies is not None else [b.seconds for b in self.batches]

    @property
    def wall_s(self) -> float:
        return sum(b.seconds for b in self.batches)

    @property
    def output_tokens(self) -> int:
        return sum(b.output_tokens for b in self.batches)

    @property
    def total_tokens(self) -> int:
        return sum(b.input_tokens + b.output_tokens for b in self.batches)

    @property
    def padding_efficiency(self) -> float:
        """Useful ÷ computed token slots, the engine's definition: prompt tokens computed plus all but
        each row's last generated token (which is never fed back through the model)."""
        computed = sum(b.computed_slots for b in self.batches)
        return sum(b.useful_slots for b in self.batches) / computed if computed else 1.0


class Variant(Protocol):
    name: str
    lossless: bool  # exact by design: greedy tokens equal transformers'
    gated: bool  # a token mismatch fails the run (ours); the baseline's is only logged
    batch_size: int

    def run(self, workload: Workload) -> RunResult: ...


def batch_order(workload: Workload, sort_by_length: bool, with_output: bool = False) -> list[int]:
    """Row indices in the order batches are cut: arrival order, or longest prompt first (with
    `with_output`: most prompt + new tokens first, the stable key the torch `Engine.generate` uses for
    prompts within max_input_len, so our per-batch slicing equals the engine's own)."""
    order = list(range(workload.rows))
    if sort_by_length:
        extra = workload.max_new_tokens if with_output else [0] * workload.rows
        order.sort(key=lambda i: -(len(workload.prompts[i]) + extra[i]))
    return order


def cut(order: list[int], size: int) -> list[list[int]]:
    return [order[start : start + size] for start in range(0, len(order), size)]


def hf_greedy(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, new_tokens: int,
              pad_id: int) -> torch.Tensor:
    """`transformers` greedy generation of exactly `new_tokens` per row (EOS ignored) -> [B, T + new],
    on the model's device, finished there (synchronized) before it returns, so a timer around it is honest."""
    device = model.device
    with torch.inference_mode():
        out = model.generate(input_ids.to(device), attention_mask=attention_mask.to(device), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=pad_id)
    for_device(device).synchronize()
    return out


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids [B, T] and attention mask [B, T] (what `generate` needs for a padded batch)."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    return ids, mask


class TransformersStatic:
    """`transformers` `generate` on padded static batches (the baseline)."""

    lossless = True
    gated = False

    def __init__(self, name: str, model, batch_size: int, sort_by_length: bool, pad_id: int = 0) -> None:
        self.name, self.model, self.batch_size = name, model, batch_size
        self.sort_by_length, self.pad_id = sort_by_length, pad_id

    def run(self, workload: Workload) -> RunResult:
        outputs: list[list[int]] = [[] for _ in range(workload.rows)]
        result = RunResult(outputs)
        for batch in cut(batch_order(workload, self.sort_by_length), self.batch_size):
            prompts = [workload.prompts[i] for i in batch]
            wanted = [workload.max_new_tokens[i] for i in batch]
            ids, mask = left_pad(prompts, self.pad_id)
            new = max(wanted)  # one max_new_tokens per call: shorter rows run on, their extra tokens wasted
            out, took = timed(hf_greedy, self.model, ids, mask, new, self.pad_id)
            width = ids.shape[1]
            for row, i in enumerate(batch):
                outputs[i] = out[row, width : width + wanted[row]].tolist()
            useful = sum(map(len, prompts)) + sum(wanted) - len(batch)
            result.batches.append(BatchRecord(len(batch), took, sum(map(len, prompts)), sum(wanted),
                                              computed_slots=len(batch) * (width + new - 1), useful_slots=useful,
                                              peak_rows=len(batch)))
        return result


class OursEngine:
    """Our `Engine`, run the way a job runs it: the whole workload in one `generate` call (rows
    sorted or not per `sort_by_length`, finished stripes refilled in flight), latency per row.

    `per_batch=True` is static batching instead: the batches one call would cut, each run as its
    own call (nothing to refill from), latency per batch."""

    def __init__(self, name: str, engine: Engine, lossless: bool = True, per_batch: bool = False) -> None:
        self.name, self.engine, self.lossless, self.gated = name, engine, lossless, lossless
        self.batch_size = engine.admitted_batch_size
        self.per_batch = per_batch

    def run(self, workload: Workload) -> RunResult:
        outputs: list[list[int]] = [[] for _ in range(workload.rows)]
        result = RunResult(outputs, row_latencies=None if self.per_batch else [])
        order = list(range(workload.rows))
        sort = self.engine.options.sort_by_length
        calls = cut(batch_order(workload, sort, with_output=True), self.batch_size) if self.per_batch else [order]
        for batch in calls:
            prompts = [workload.prompts[i] for i in batch]
            params = [SamplingParams(max_new_tokens=workload.max_new_tokens[i], ignore_eos=True) for i in batch]
            outs, took = timed(self.engine.generate, prompts, params)
            for out, i in zip(outs, batch):
                outputs[i] = list(out.token_ids)
            stats = self.engine.last_stats
            result.batches.append(BatchRecord(len(batch), took, stats.input_tokens, stats.output_tokens,
                                              computed_slots=stats.computed_slots,
                                              useful_slots=stats.prefill_tokens_computed + stats.output_tokens
                                              - stats.rows, peak_rows=stats.peak_rows))
            if result.row_latencies is not None:
                result.row_latencies += stats.row_latency_s
        return result


def prefix_reuse_options(max_input_len: int) -> dict | None:
    """Hook for prefix reuse (the article's dialogue-state reuse): the `EngineOptions` knobs that turn
    it on, or None while the engine has no such option — then the variant is reported as not run."""
    if PREFIX_REUSE_OPTION not in EngineOptions.__dataclass_fields__:
        return None
    return {PREFIX_REUSE_OPTION: 4 * max_input_len}  # room for a few groups' prefixes at once


@dataclass
class VariantSet:
    """The variants for one model at one batch size, plus why any were not run."""

    variants: list[Variant]
    skipped: dict[str, str] = field(default_factory=dict)

    def by_name(self) -> dict[str, Variant]:
        return {v.name: v for v in self.variants}


def build_variants(model_dir: Path, hf_model, batch_size: int, max_input_len: int, max_output_len: int,
                   threads: int | None, pad_id: int = 0, include: tuple[str, ...] | None = None,
                   backend: str = "cpu", dtype: str = "float32") -> VariantSet:
    """Every variant for `model_dir` at `batch_size` (or only those named in `include`).

    Engines are built here once and reused for every workload and repeat (load is not measured)."""
    common = dict(backend=backend, dtype=dtype, max_batch_size=batch_size, max_input_len=max_input_len,
                  max_output_len=max_output_len, segment_size=16, num_threads=threads)
    wanted = set(include) if include else None

    def want(name: str) -> bool:
        return wanted is None or name in wanted

    out = VariantSet([])
    if want("transformers_arrival"):
        out.variants.append(TransformersStatic("transformers_arrival", hf_model, batch_size, False, pad_id))
    if want("transformers_sorted"):
        out.variants.append(TransformersStatic("transformers_sorted", hf_model, batch_size, True, pad_id))
    if want("ours_unbucketed"):
        engine = Engine.from_pretrained(model_dir, sort_by_length=False, **common)
        out.variants.append(OursEngine("ours_unbucketed", engine))
    bucketed = Engine.from_pretrained(model_dir, **common) if want("ours_bucketed") or want("ours_static") else None
    if want("ours_bucketed"):
        out.variants.append(OursEngine("ours_bucketed", bucketed))
    if want("ours_static"):
        out.variants.append(OursEngine("ours_static", bucketed, per_batch=True))
    if want("ours_segment_sparse"):
        engine = Engine.from_pretrained(model_dir, cache_policy="segment_sparse", **common)
        out.variants.append(OursEngine("ours_segment_sparse", engine, lossless=False))
    if want("ours_prefix_reuse"):
        knobs = prefix_reuse_options(max_input_len)
        if knobs is None:
            out.skipped["ours_prefix_reuse"] = (f"not run: the engine has no prefix reuse yet "
                                                f"(EngineOptions.{PREFIX_REUSE_OPTION} is absent)")
        else:
            try:
                engine = Engine.from_pretrained(model_dir, **common, **knobs)
            except Exception as exc:  # an unfinished feature must not take the other variants down
                log.warning("ours_prefix_reuse not run: %s", exc)
                out.skipped["ours_prefix_reuse"] = f"not run: engine start failed: {exc}"
            else:
                out.variants.append(OursEngine("ours_prefix_reuse", engine))
    return out
