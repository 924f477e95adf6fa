"""`EngineOptions`: every knob fixed when an engine starts (the `runtime.*` config group maps here)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from flashx_batch.errors import ConfigError

CACHE_POLICIES = ("static", "segment_sparse")
LONG_INPUT_POLICIES = ("error", "truncate", "rolling_merge")
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_LAYOUTS = ("auto", "stripes", "extents")
CUDA_GRAPHS = ("auto", "on", "off")


def bundled_model_dir() -> Path:
    """The demo model committed inside the package (see its README.md model card)."""
    return Path(__file__).resolve().parent.parent / "assets" / "models" / "legal-tiny"


@dataclass(frozen=True)
class EngineOptions:
    backend: str = "auto"
    dtype: str = "auto"
    max_batch_size: int = 8
    max_input_len: int = 512
    max_output_len: int = 128
    cache_policy: str = "static"
    segment_size: int = 16  # small segments: merged rows and shared prefixes waste less of the arena
    long_input: str = "error"
    num_threads: int | None = None  # CPU only; None = every core this process may run on
    sort_by_length: bool = True  # generate() groups similar lengths into a batch (bucketing)
    refill: bool = True  # a finished row's stripe takes the next queued row mid-batch (in-flight refill)
    # static cache: stripes cut for the longest row still decoding or queued, so short rows run up to
    # batch_growth x max_batch_size at once in the KV arena sized for max_batch_size full rows; 1 = fixed size
    batch_growth: int = 4
    kv_merge_fraction: float = 0.8  # segment_sparse: share of eligible 4-token groups merged 4:1
    kv_observe_window: int = 32  # segment_sparse: last queries whose attention scores the groups
    kv_evict_share: float = 0.8  # segment_sparse: share of the freed slots freed by evicting the least attended groups
    prefix_cache_tokens: int = 0  # prefix reuse: KV tokens kept for shared prefixes (0 = off)
    precision_map: str | None = None  # JSON from `python -m flashx_batch.quantize`: per-tensor weight formats
    prepack_weights: bool = True  # CPU float32: MKL-packed weight copies for the decode batch (2x weight memory)
    # growing refilled batches: "stripes" (equal, cut for the longest row), "extents" (each row its own
    # prompt + new tokens), "auto" (the backend's preference: extents on CPU)
    kv_layout: str = "auto"
    # striped decode steps replayed from CUDA graphs (`runtime.decode_graphs`): "auto" where the backend
    # captures them (cuda), "on" (an error elsewhere), "off" (eager steps)
    cuda_graphs: str = "auto"

    def __post_init__(self) -> None:
        checks = [
            (self.max_batch_size >= 1, f"max_batch_size must be >= 1, got {self.max_batch_size}"),
            (self.max_input_len >= 1, f"max_input_len must be >= 1, got {self.max_input_len}"),
            (self.max_output_len >= 1, f"max_output_len must be >= 1, got {self.max_output_len}"),
            (self.segment_size >= 1, f"segment_size must be >= 1, got {self.segment_size}"),
            (self.cache_policy in CACHE_POLICIES,
             f"cache_policy={self.cache_policy!r} is not one of {', '.join(CACHE_POLICIES)}"),
            (self.long_input in LONG_INPUT_POLICIES,
             f"long_input={self.long_input!r} is not one of {', '.join(LONG_INPUT_POLICIES)}"),
            (0.0 <= self.kv_merge_fraction <= 1.0,
             f"kv_merge_fraction must be in [0, 1], got {self.kv_merge_fraction}"),
            (0.0 <= self.kv_evict_share <= 1.0, f"kv_evict_share must be in [0, 1], got {self.kv_evict_share}"),
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
            (self.cuda_graphs in CUDA_GRAPHS,
             f"cuda_graphs={self.cuda_graphs!r} is not one of {', '.join(CUDA_GRAPHS)}"),
        ]
        if self.dtype not in DTYPES:  # the job config calls it model.dtype, the engine dtype
            raise ConfigError(f"model.dtype={self.dtype!r} is not one of {', '.join(DTYPES)}.")
        for ok, message in checks:
            if not ok:
                raise ConfigError(f"runtime.{message}.")

    @property
    def row_capacity(self) -> int:
        """Token slots a row may hold, rounded up to whole segments."""
        tokens = self.max_input_len + self.max_output_len
        return -(-tokens // self.segment_size) * self.segment_size

    def cpu_threads(self) -> int:
        return self.num_threads or len(os.sched_getaffinity(0))
