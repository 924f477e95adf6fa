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
from flashx_batch.runtime.capabilities import Capabilities, capabilities
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
    if cfg is not None and cfg.quantized:
        kept = options.quantized_weights == "keep"
        clashes = [what for what, clash in (
            ("runtime.precision_map with runtime.quantized_weights=keep (its weights are quantized already)",
             bool(options.precision_map) and kept),
            (f"runtime.tensor_parallel_size={options.tensor_parallel_size} (quantized weights are not split "
             "across ranks yet)", options.tensor_parallel_size > 1)) if clash]
        if clashes:
            raise ConfigError(f"a pre-quantized checkpoint ({cfg.quantized}) does not combine with "
                              f"{'; '.join(clashes)}: drop that setting, or use the float checkpoint.")
    split = options.backend == "onnx" or options.tensor_parallel_size > 1
    if cfg is not None and cfg.classifier is not None and split:
        raise ConfigError("a sequence classifier (*ForSequenceClassification) runs on a torch backend with "
                          "tensor_parallel_size=1 (its score head is neither split nor exported).")
    if cfg is not None:
        cfg = effective_config(cfg, options)
        needed = options.max_input_len + options.max_output_len
        if needed > cfg.max_position_embeddings:
            log.warning("max_input_len + max_output_len = %d exceeds the model's max_position_embeddings=%d",
                        needed, cfg.max_position_embeddings)
    check_capabilities(options, capabilities(cfg, options, backend))
    if options.tensor_parallel_size > 1 and cfg is not None:
        rank_config(cfg, options.tensor_parallel_size)  # every split dimension divides, or which does not
    if backend is None:
        return None
    dtype = backend.default_dtype if options.dtype == "auto" else TORCH_DTYPES[options.dtype]
    if dtype not in backend.supported_dtypes:
        raise ConfigError(f"model.dtype={options.dtype} is not supported on {backend.name}.")
    return dtype


def check_lora_options(options: EngineOptions, cfg: ModelConfig | None = None) -> None:
    """Refuse what LoRA adapters (`models.lora`) do not run with, naming the setting."""
    clashes = [what for what, clash in (
        (f"runtime.tensor_parallel_size={options.tensor_parallel_size} (the stacked adapters are not split "
         "across ranks)", options.tensor_parallel_size > 1),
        ("runtime.backend=onnx (the exported graphs hold the base weights only)", options.backend == "onnx"),
        ("runtime.cache_policy=segment_sparse (its compressed prefill runs no adapters)",
         options.cache_policy == "segment_sparse"),
        ("runtime.long_input=rolling_merge (its chunked prefill runs no adapters)",
         options.long_input == "rolling_merge"),
        ("runtime.precision_map (adapters apply to float linears only)", bool(options.precision_map)),
        ("a sequence classifier (adapters apply to generation)", cfg is not None and cfg.classifier is not None),
        (f"a pre-quantized checkpoint ({cfg and cfg.quantized}) kept as stored (adapters apply to float linears "
         "only; runtime.quantized_weights=dequantize gives them float ones)",
         cfg is not None and cfg.quantized is not None and options.quantized_weights == "keep"),
    ) if clash]
    if clashes:
        raise ConfigError("model.lora_adapters does not combine with " + "; ".join(clashes) + ": drop the adapters "
                          "or that setting.")


def check_capabilities(options: EngineOptions, caps: Capabilities) -> None:
    """Refuse what `options` ask of a row of the capabilities record that does not hold, naming the
    setting and the row's reason."""
    n = options.tensor_parallel_size
    if n > 1:
        caps.require("tensor_parallel", f"runtime.tensor_parallel_size={n}")
    merging = [f"runtime.{key}={value}" for key, value, merges in (
        ("cache_policy", options.cache_policy, options.cache_policy == "segment_sparse"),
        ("long_input", options.long_input, options.long_input == "rolling_merge")) if merges]
    if merging:
        caps.require("merges_kv", " and ".join(merging))
    if options.backend == "onnx":
        caps.require("onnx_export", "runtime.backend=onnx")
    if options.cuda_graphs == "on":
        caps.require("decode_graphs", "runtime.cuda_graphs=on")
    if options.precision_map:
        caps.require("precision_map", "runtime.precision_map")


def effective_config(cfg: ModelConfig, options: EngineOptions) -> ModelConfig:
    """`cfg` as an engine with `options` runs it: a sliding window that no row (prompt + new tokens,
    no rolling merge) can outgrow never hides a key, so such a model is full attention there."""
    window, needed = cfg.sliding_window, options.max_input_len + options.max_output_len
    if window is None or options.long_input == "rolling_merge" or needed > window:
        return cfg
    return dataclasses.replace(cfg, sliding_window=None, window_layers=(False,) * cfg.num_layers)


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
