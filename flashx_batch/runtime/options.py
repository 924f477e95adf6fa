"""`EngineOptions`: every knob fixed when an engine starts, declared once with its meaning.

The job schema's `runtime.*` group (`config.RuntimeSection`) is derived from these fields; see `knob`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashx_batch.errors import ConfigError

CACHE_POLICIES = ("static", "segment_sparse")
LONG_INPUT_POLICIES = ("error", "truncate", "rolling_merge")
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_LAYOUTS = ("auto", "stripes", "extents")
CUDA_GRAPHS = ("auto", "on", "off")
# segment_sparse presets: (kv_merge_fraction, kv_evict_share), chosen on the tuning task families only
# (`quality.kv_families`: copy, recall, perplexity) and reported on the held-out ones (docs/benchmarks.md,
# "Segment-sparse KV"; `python -m flashx_batch.quality.kv_tasks --split tuning|held_out` reruns both). The
# rule: among candidate fractions, `balanced` is the largest keeping >= 0.98 of the static cache's score on
# every tuning family (0.6; 0.65 passed by 0.002 and was not taken over the default already in use), and
# `aggressive` the largest keeping >= 0.95 (0.72: 0.75 fell to 0.93 on recall; the earlier 0.9 kept 0.72).
# Both evict only: on those curves, freeing a share of the slots by merging instead matched eviction at
# 25 % saved and lost copy and recall at 50 and 75 % (a merged slot's mean key answers no single key's
# query, and merging touches 4/3 as many groups for the same slots).
KV_PRESETS = {
    "balanced": (0.6, 1.0),
    "aggressive": (0.72, 1.0),
}


def bundled_model_dir() -> Path:
    """The demo model committed inside the package (see its README.md model card)."""
    return Path(__file__).resolve().parent.parent / "assets" / "models" / "legal-tiny"


def knob(default: Any, meaning: str, choices: tuple[str, ...] = ()) -> Any:
    """An `EngineOptions` field with its one-line meaning and, for an enum, its allowed values.

    The job schema (`config.RuntimeSection`) is built from these fields and the tests check the README's
    Config keys table against them, so a knob is declared here once.
    """
    return field(default=default, metadata={"help": meaning, "choices": choices})


@dataclass(frozen=True)
class EngineOptions:
    backend: str = knob("auto", "device backend: auto, or a name in flashx_batch.backends.BACKENDS")
    dtype: str = knob("auto", "weight and activation dtype (model.dtype in a job); auto = float32 on CPU, bfloat16 "
                              "on accelerators", DTYPES)
    max_batch_size: int = knob(8, "rows per static batch; under segment_sparse the KV budget in full rows")
    kv_budget_mb: float | None = knob(None, "KV arena size in MiB instead (per device: a tensor-parallel rank's "
                                            "share of the KV heads): max_batch_size becomes the full-length rows that "
                                            "fit (whatever the model's bytes per token); None = max_batch_size rows")
    max_input_len: int = knob(512, "prompt tokens a row may hold; longer prompts follow long_input")
    max_output_len: int = knob(128, "new tokens a row may generate; the KV arena holds max_batch_size x "
                                    "(max_input_len + max_output_len) tokens, allocated once")
    cache_policy: str = knob("static", "KV cache: static, or segment_sparse (low-attention 4-token groups evicted "
                                       "or merged 4:1)", CACHE_POLICIES)
    # small segments: merged rows and shared prefixes waste less of the arena
    segment_size: int = knob(16, "tokens per KV arena segment")
    long_input: str = knob("error", "prompts over max_input_len: error (an error row), truncate (keep the tail), "
                                    "rolling_merge (prefill segment by segment, folding the oldest KV)",
                           LONG_INPUT_POLICIES)
    num_threads: int | None = knob(None, "CPU threads per engine (CPU only); None = every core this process may "
                                         "run on")
    sort_by_length: bool = knob(True, "generate() orders rows longest first (bucketing): by KV slots with "
                                                "stripes, by new tokens with extents")
    refill: bool = knob(True, "in-flight refill: a finished row's KV (stripe or extent) takes the next queued row "
                              "mid-batch; false = classic static batches")
    batch_growth: int = knob(4, "static cache: short rows run up to batch_growth x max_batch_size at once in the "
                                "same KV memory; 1 = fixed batch size")
    kv_preset: str = knob("balanced", "segment_sparse: named setting of kv_merge_fraction and kv_evict_share "
                                      "(balanced, aggressive; docs/benchmarks.md has what each saves and costs)",
                          tuple(KV_PRESETS))
    kv_merge_fraction: float | None = knob(None, "segment_sparse: KV freed = as much as merging this share of the "
                                                 "eligible 4-token groups 4:1 would; None = the preset's")
    kv_observe_window: int = knob(32, "segment_sparse: last queries whose attention scores the groups")
    kv_evict_share: float | None = knob(None, "segment_sparse: share of the freed slots freed by evicting the "
                                              "least valuable groups; the rest by 4:1 merges (0 = merge only); "
                                              "None = the preset's")
    prefix_cache_tokens: int = knob(0, "prefix reuse: KV tokens kept for shared prefixes (0 = off)")
    precision_map: str | None = knob(None, "JSON from `python -m flashx_batch.quantize`: per-tensor weight "
                                           "formats")
    quantized_weights: str = knob("keep", "a pre-quantized checkpoint's linears: keep (as stored: int8 on our int8 "
                                          "kernels, int4 / FP8 dequantized per matmul; memory near the checkpoint's "
                                          "bytes) or dequantize (to the compute dtype at load: 2-8x the memory)",
                                  ("keep", "dequantize"))
    prepack_weights: bool = knob(True, "CPU float32 / bfloat16: linear weights packed for oneDNN, which then "
                                       "runs every matmul (2x weight memory)")
    kv_layout: str = knob("auto", "growing refilled batches: stripes (equal, cut for the longest row), extents "
                                  "(each row its own prompt + new tokens), auto (the backend's preference: extents "
                                  "on CPU)",
                          KV_LAYOUTS)
    cuda_graphs: str = knob("auto", "striped decode steps replayed from CUDA graphs: auto (where the backend "
                                    "captures them: cuda), on (an error elsewhere), off (eager steps)", CUDA_GRAPHS)
    fused_int8_decode: bool = knob(True, "an all-int8 model's CPU decode steps in a few compiled calls a layer "
                                         "(false: module by module, the same tokens; for A / B measurements)")
    tensor_parallel_size: int = knob(1, "ranks one model replica is split over (attention heads, MLP columns, "
                                        "vocabulary); each rank drives one device and holds 1/N of the weights")

    def __post_init__(self) -> None:
        checks = [
            (self.max_batch_size >= 1, f"max_batch_size must be >= 1, got {self.max_batch_size}"),
            (self.kv_budget_mb is None or self.kv_budget_mb > 0, f"kv_budget_mb must be > 0, got {self.kv_budget_mb}"),
            (self.max_input_len >= 1, f"max_input_len must be >= 1, got {self.max_input_len}"),
            (self.max_output_len >= 1, f"max_output_len must be >= 1, got {self.max_output_len}"),
            (self.segment_size >= 1, f"segment_size must be >= 1, got {self.segment_size}"),
            (self.cache_policy in CACHE_POLICIES,
             f"cache_policy={self.cache_policy!r} is not one of {', '.join(CACHE_POLICIES)}"),
            (self.long_input in LONG_INPUT_POLICIES,
             f"long_input={self.long_input!r} is not one of {', '.join(LONG_INPUT_POLICIES)}"),
            (self.kv_preset in KV_PRESETS,
             f"kv_preset={self.kv_preset!r} is not one of {', '.join(KV_PRESETS)}"),
            (self.kv_merge_fraction is None or 0.0 <= self.kv_merge_fraction <= 1.0,
             f"kv_merge_fraction must be in [0, 1], got {self.kv_merge_fraction}"),
            (self.kv_evict_share is None or 0.0 <= self.kv_evict_share <= 1.0,
             f"kv_evict_share must be in [0, 1], got {self.kv_evict_share}"),
            (self.kv_observe_window >= 1, f"kv_observe_window must be >= 1, got {self.kv_observe_window}"),
            (self.long_input != "rolling_merge" or self.max_input_len >= 4 + self.kv_observe_window + 8,
             f"max_input_len={self.max_input_len} is too small to roll long prompts: it must exceed the 4 sink "
             f"and {self.kv_observe_window} window tokens by at least 8"),
            (self.prefix_cache_tokens >= 0, f"prefix_cache_tokens must be >= 0, got {self.prefix_cache_tokens}"),
            (not (self.prefix_cache_tokens and self.cache_policy == "segment_sparse"),
             "prefix_cache_tokens (prefix reuse) does not combine with cache_policy=segment_sparse yet; pick one"),
            (self.num_threads is None or self.num_threads >= 1, f"num_threads must be >= 1, got {self.num_threads}"),
            (self.batch_growth >= 1, f"batch_growth must be >= 1, got {self.batch_growth}"),
            (self.kv_layout in KV_LAYOUTS, f"kv_layout={self.kv_layout!r} is not one of {', '.join(KV_LAYOUTS)}"),
            (self.tensor_parallel_size >= 1, f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}"),
            (self.cuda_graphs in CUDA_GRAPHS,
             f"cuda_graphs={self.cuda_graphs!r} is not one of {', '.join(CUDA_GRAPHS)}"),
        ]
        if self.dtype not in DTYPES:  # the job config calls it model.dtype, the engine dtype
            raise ConfigError(f"model.dtype={self.dtype!r} is not one of {', '.join(DTYPES)}.")
        for ok, message in checks:
            if not ok:
                raise ConfigError(f"runtime.{message}.")

    @property
    def merge_fraction(self) -> float:
        """kv_merge_fraction as set, else the preset's."""
        return KV_PRESETS[self.kv_preset][0] if self.kv_merge_fraction is None else self.kv_merge_fraction

    @property
    def evict_share(self) -> float:
        """kv_evict_share as set, else the preset's."""
        return KV_PRESETS[self.kv_preset][1] if self.kv_evict_share is None else self.kv_evict_share

    @property
    def row_capacity(self) -> int:
        """Token slots a row may hold, rounded up to whole segments."""
        tokens = self.max_input_len + self.max_output_len
        return -(-tokens // self.segment_size) * self.segment_size

    def cpu_threads(self) -> int:
        return self.num_threads or len(os.sched_getaffinity(0))
