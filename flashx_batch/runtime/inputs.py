"""Input checks an engine makes before any row runs: options against the model and the backend,
prompts against the vocabulary and max_input_len, sampling settings against max_output_len.

`check_options` is also the job preflight's: a job is refused before its output directory is
touched for exactly what the engine would refuse.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch

from flashx_batch.backends import Backend
from flashx_batch.errors import ConfigError, PromptTooLongError
from flashx_batch.models.config import ModelConfig
from flashx_batch.models.parallel import rank_config
from flashx_batch.runtime.options import EngineOptions
from flashx_batch.runtime.params import SamplingParams

log = logging.getLogger(__name__)
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_options(options: EngineOptions, cfg: ModelConfig | None = None,
                  backend: Backend | None = None) -> torch.dtype | None:
    """Every refusal an engine makes for `options` (on the model `cfg`, on `backend`, where known);
    returns the weight dtype on `backend`."""
    if options.backend == "onnx":
        if options.precision_map:
            raise ConfigError("runtime.precision_map does not apply to backend=onnx (the export needs float "
                              "weights); drop one of the two.")
        if options.dtype not in ("auto", "float32"):
            raise ConfigError(f"model.dtype={options.dtype} is not supported by runtime.backend=onnx; use float32.")
        # the exported graphs hold a plain growing cache: the lossless static path only
        if options.cache_policy != "static" or options.long_input not in ("error", "truncate"):
            raise ConfigError(f"runtime.backend=onnx supports cache_policy=static and long_input=error|truncate, "
                              f"not cache_policy={options.cache_policy} long_input={options.long_input}.")
    if options.tensor_parallel_size > 1:
        check_tensor_parallel(options, cfg, backend)
    if cfg is not None:
        cfg = effective_config(cfg, options)
        needed = options.max_input_len + options.max_output_len
        if needed > cfg.max_position_embeddings:
            log.warning("max_input_len + max_output_len = %d exceeds the model's max_position_embeddings=%d",
                        needed, cfg.max_position_embeddings)
        if cfg.sliding_window is not None:
            check_sliding_window(options, cfg.sliding_window)
        if cfg.moe is not None:
            check_experts(options)
        if cfg.mla is not None:
            check_latent_attention(options, cfg)
    if backend is None:
        return None
    if options.cuda_graphs == "on" and not backend.supports_graphs:
        raise ConfigError(f"runtime.cuda_graphs=on needs a backend that captures CUDA graphs (cuda); this "
                          f"engine runs on {backend.name}. Use cuda_graphs=auto (graphs where the "
                          "backend has them) or off.")
    dtype = backend.default_dtype if options.dtype == "auto" else TORCH_DTYPES[options.dtype]
    if dtype not in backend.supported_dtypes:
        raise ConfigError(f"model.dtype={options.dtype} is not supported on {backend.name}.")
    return dtype


def check_tensor_parallel(options: EngineOptions, cfg: ModelConfig | None, backend: Backend | None) -> None:
    """Tensor parallelism splits our own torch decoder over ranks that talk through the backend's
    collective library; precision maps are planned for the whole model's tensors, so they do not apply
    to a rank's slices (yet)."""
    n = options.tensor_parallel_size
    if options.backend == "onnx" or (backend is not None and (not backend.torch_runtime or backend.collective is None)):
        raise ConfigError(f"runtime.tensor_parallel_size={n} needs a torch backend (cpu, cuda, rocm, npu), not "
                          f"{options.backend}; set tensor_parallel_size=1 or pick a torch backend.")
    if options.precision_map:
        raise ConfigError(f"runtime.precision_map does not combine with tensor_parallel_size={n} yet (the map is "
                          "planned for whole tensors, a rank holds slices); drop one of the two.")
    if options.cuda_graphs == "on":
        raise ConfigError(f"runtime.cuda_graphs=on does not combine with tensor_parallel_size={n} (decode steps "
                          "with collectives run eager); use cuda_graphs=auto or off.")
    if cfg is not None:
        rank_config(cfg, n)  # every split dimension divides evenly, or a ConfigError saying which does not


def effective_config(cfg: ModelConfig, options: EngineOptions) -> ModelConfig:
    """`cfg` as an engine with `options` runs it: a sliding window that no row (prompt + new tokens,
    no rolling merge) can outgrow never hides a key, so such a model is full attention there."""
    window, needed = cfg.sliding_window, options.max_input_len + options.max_output_len
    if window is None or options.long_input == "rolling_merge" or needed > window:
        return cfg
    return dataclasses.replace(cfg, sliding_window=None, window_layers=(False,) * cfg.num_layers)


def check_experts(options: EngineOptions) -> None:
    """Mixture-of-experts models: the expert loop reads each expert's token count back to the host,
    which neither an ONNX graph nor a CUDA graph can hold, and precision maps know dense MLPs only."""
    if options.backend == "onnx" or options.cuda_graphs == "on" or options.precision_map:
        raise ConfigError("a mixture-of-experts model runs on a torch backend, with cuda_graphs=auto or off and "
                          "no runtime.precision_map (its expert loop is data-dependent and precision maps cover "
                          "dense MLPs only); drop runtime.backend=onnx, cuda_graphs=on or precision_map.")


def check_latent_attention(options: EngineOptions, cfg: ModelConfig) -> None:
    """Latent attention (DeepSeek-V3, GLM-5) caches one compressed entry per token, read by our own
    latent attention: segment-sparse KV and rolling merges, which average keys and values slot by slot
    with rotary re-alignment, are written for full keys and values (and DSA already keeps each query to
    its top keys); the ONNX export and CUDA decode graphs carry the full-K/V attention only."""
    name = "GLM-5 sparse (DSA) latent attention" if cfg.dsa is not None else "latent attention (MLA)"
    if options.cache_policy == "segment_sparse" or options.long_input == "rolling_merge":
        raise ConfigError(f"runtime.cache_policy=segment_sparse and long_input=rolling_merge merge full keys and "
                          f"values, and this model ({cfg.architecture}) caches {name} entries instead; use "
                          "cache_policy=static (prefix reuse works) with long_input=error or truncate.")
    if options.backend == "onnx" or options.cuda_graphs == "on" or options.precision_map:
        raise ConfigError(f"{cfg.architecture} ({name}) runs on a torch backend, with cuda_graphs=auto or off and "
                          "no runtime.precision_map; drop runtime.backend=onnx, cuda_graphs=on or precision_map.")


def check_sliding_window(options: EngineOptions, window: int) -> None:
    """A sliding-window model (Mistral, Qwen2 with use_sliding_window) keeps every token's KV and masks
    each sliding layer to its last `window` positions. That needs a slot per position: merged slots
    stand for several positions at once, so segment-sparse KV and rolling merges are refused, as are the
    ONNX graphs and CUDA graphs, which carry no window mask."""
    where = f"the model attends through a sliding window of {window} tokens"
    if options.cache_policy == "segment_sparse" or options.long_input == "rolling_merge":
        raise ConfigError(f"runtime.cache_policy=segment_sparse and long_input=rolling_merge merge several positions "
                          f"into one KV slot, and {where}, which needs one slot per position; use "
                          "cache_policy=static with long_input=error or truncate.")
    if options.backend == "onnx":
        raise ConfigError(f"runtime.backend=onnx: the exported graphs have no sliding-window mask, and {where}; "
                          "use a torch backend.")
    if options.cuda_graphs == "on":
        raise ConfigError(f"runtime.cuda_graphs=on: decode graphs carry no sliding-window mask, and {where}; "
                          "use cuda_graphs=auto (eager steps for this model) or off.")


def check_prompt_ids(index: int, ids: list[int], vocab_size: int) -> None:
    """Refuse an empty prompt or token ids outside the vocabulary (which would otherwise fail deep in
    the embedding lookup with a bare IndexError), naming the prompt."""
    if not ids:
        raise ConfigError(f"prompt {index} is empty after tokenization; an empty prompt has nothing to continue.")
    if min(ids) < 0 or max(ids) >= vocab_size:
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise ConfigError(f"prompt {index} holds token id {bad}, outside the model's vocabulary "
                          f"(0..{vocab_size - 1}); pass ids from this model's tokenizer, or text.")


def per_row_params(sampling: SamplingParams | list[SamplingParams] | None, n: int,
                   max_output_len: int) -> list[SamplingParams]:
    """One `SamplingParams` per prompt (one given for all, or one each), each within max_output_len."""
    params = sampling if isinstance(sampling, list) else [sampling or SamplingParams()] * n
    if len(params) != n:
        raise ConfigError(f"got {len(params)} SamplingParams for {n} prompts; pass one, or one per prompt.")
    for p in params:
        if p.max_new_tokens > max_output_len:
            raise ConfigError(f"sampling.max_new_tokens={p.max_new_tokens} exceeds runtime.max_output_len="
                              f"{max_output_len}; raise max_output_len when starting the engine.")
    return params


def fit_prompts(token_lists: list[list[int]], options: EngineOptions, vocab_size: int
                ) -> tuple[list[list[int]], list[bool]]:
    """Prompts checked and fitted to max_input_len per `long_input` -> (prompts, truncated flags).
    error: PromptTooLongError; truncate: keep the tail (the instruction usually comes last);
    rolling_merge: left long (the runner folds it while prefilling)."""
    limit = options.max_input_len
    fitted, truncated = [], []
    for i, ids in enumerate(token_lists):
        check_prompt_ids(i, ids, vocab_size)
        if len(ids) > limit and options.long_input != "rolling_merge":
            if options.long_input == "error":
                raise PromptTooLongError(i, len(ids), limit)
            ids = ids[-limit:]
        fitted.append(ids)
        truncated.append(len(ids) != len(token_lists[i]))
    return fitted, truncated


def generation_eos(model_dir: Path) -> tuple[int, ...]:
    """EOS ids from generation_config.json (a list or one id; none when the file or key is missing)."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return ()
    value = json.loads(path.read_text()).get("eos_token_id")
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(value)
