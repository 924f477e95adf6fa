"""One record of what a (model config, options, backend) combination can run.

`capabilities(cfg, options, backend)` answers every "can this engine do X here?" question once, in
a frozen `Capabilities`: the engine reads it to build its runner (decode graphs, the packed scoring
pass), `inputs.check_options` reads it to refuse a job before it touches its output, and a refusal
names the record's row and its reason (`Capabilities.require`). Each row is a `Capability`: whether
it holds and, where it does not, why in words a user can act on. A new capability is a new row here
and its rule in `capabilities`; no caller tests model families or device kinds for it again.

What is decided elsewhere, on purpose: the fused int8 decode step also needs every layer quantized
to int8 (`quant.int8_decode._why_not`, read from the loaded modules, which a config does not know);
this record holds the half a config and a backend decide (`fused_int8_decode`, from the same
`int8_decode.config_why_not`).
"""

from __future__ import annotations

from dataclasses import dataclass

from flashx_batch.backends import Backend
from flashx_batch.errors import ConfigError
from flashx_batch.models.config import ModelConfig
from flashx_batch.quant import int8_decode
from flashx_batch.runtime.options import EngineOptions


@dataclass(frozen=True)
class Capability:
    ok: bool
    why: str = ""  # where not ok: the reason, in words a refusal can quote

    def __bool__(self) -> bool:
        return self.ok


YES = Capability(True)


@dataclass(frozen=True)
class Capabilities:
    """What one combination can run; each row a `Capability` (see the module doc)."""

    merges_kv: Capability  # segment-sparse KV and rolling merges (several positions folded into one slot)
    onnx_export: Capability  # the ONNX Runtime path's exported graphs
    decode_graphs: Capability  # decode steps replayed from device graphs (CUDA graphs)
    precision_map: Capability  # per-tensor weight formats from a precision map
    tensor_parallel: Capability  # one replica split over ranks
    packed_scoring: Capability  # teacher-forced scoring rows packed end to end (`Scorer.packed_target_logprobs`)
    fused_int8_decode: Capability  # the config-and-device half of the fused int8 decode step's conditions

    def require(self, row: str, setting: str) -> None:
        """ConfigError unless `row` holds: `setting` (what the user set) and the row's reason."""
        capability: Capability = getattr(self, row)
        if not capability:
            raise ConfigError(f"{setting}: {capability.why}")


def _attention_family(cfg: ModelConfig) -> str | None:
    """The model's attention that limits what runs on it, named for a refusal (None: plain full attention)."""
    if cfg.mla is not None:
        return "GLM-5 sparse (DSA) latent attention" if cfg.dsa is not None else "latent attention (MLA)"
    if cfg.sliding_window is not None:
        return f"a sliding window of {cfg.sliding_window} tokens"
    return None


def capabilities(cfg: ModelConfig | None, options: EngineOptions, backend: Backend | None) -> Capabilities:
    """The record for `cfg` as an engine with `options` runs it (`inputs.effective_config` applied by
    the caller) on `backend`; None for either where it is not known yet (a preflight without a
    model, or without a device): the rows they decide then hold. A model's own limits come before a
    device's, so a refusal names the first thing a user would have to change."""
    latent = cfg is not None and cfg.mla is not None
    window = cfg is not None and cfg.sliding_window is not None
    experts = cfg is not None and cfg.moe is not None
    sharded = options.tensor_parallel_size > 1
    family = _attention_family(cfg) if cfg is not None else None
    name = cfg.architecture if cfg is not None else ""
    moe = ("a mixture-of-experts model runs on a torch backend, with cuda_graphs=auto or off (its expert loop "
           "reads each expert's token count back to the host, which neither an ONNX graph nor a CUDA graph can hold)")
    mla = f"{name} ({family}) runs on a torch backend, with cuda_graphs=auto or off and no runtime.precision_map"
    int8_reason = int8_decode.config_why_not(cfg) if cfg is not None else None

    # experts and latent attention run on our torch modules only: the same reason for two rows
    torch_only = (experts or latent, moe if experts else mla)
    return Capabilities(
        merges_kv=_first(
            (latent, f"segment-sparse KV and rolling merges merge full keys and values, and this model ({name}) "
                     f"caches {family} entries instead; use cache_policy=static (prefix reuse works) with "
                     "long_input=error or truncate"),
            (window, f"segment-sparse KV and rolling merges merge several positions into one KV slot, and the model "
                     f"attends through {family}, which needs one slot per position; use cache_policy=static with "
                     "long_input=error or truncate")),
        onnx_export=_first(
            torch_only,
            (window, f"the exported graphs have no sliding-window mask, and the model attends through {family}; "
                     "use a torch backend")),
        decode_graphs=_first(
            torch_only,
            (window, f"decode graphs carry no sliding-window mask, and the model attends through {family}; use "
                     "cuda_graphs=auto (eager steps for this model) or off"),
            (sharded, f"decode steps with collectives between tensor_parallel_size={options.tensor_parallel_size} "
                      "ranks run eagerly; use cuda_graphs=auto or off"),
            (backend is not None and not backend.supports_graphs,
             f"decode graphs need a backend that captures CUDA graphs (cuda); this engine runs on "
             f"{getattr(backend, 'name', None)}. Use cuda_graphs=auto (graphs where the backend has them) or off")),
        precision_map=_first(
            (latent, f"{name} ({family}): precision maps cover grouped-query attention and (expert) MLPs, not "
                     "latent attention's projections; drop runtime.precision_map"),
            (sharded, f"a map is planned for whole tensors, and a rank of tensor_parallel_size="
                      f"{options.tensor_parallel_size} holds slices; drop one of the two")),
        tensor_parallel=_first(
            (options.backend == "onnx" or (backend is not None and (not backend.torch_runtime
                                                                     or backend.collective is None)),
             f"tensor parallelism needs a torch backend (cpu, cuda, rocm, npu), not {options.backend}; set "
             "tensor_parallel_size=1 or pick a torch backend")),
        packed_scoring=_first(
            (latent or window, f"rows packed end to end need our dense attention without windows, and the model "
                               f"attends through {family}")),
        fused_int8_decode=_first(
            (not options.fused_int8_decode, "fused_int8_decode=False"),
            (sharded, "a tensor-parallel rank"),
            (backend is not None and not backend.host_kernels,
             f"the fused step runs on the host kernels, and this engine runs on {getattr(backend, 'name', None)}"),
            (int8_reason is not None, str(int8_reason))),
    )


def _first(*rules: tuple[bool, str]) -> Capability:
    """A row: refused by the first rule that holds, with its reason; held where none does."""
    return next((Capability(False, why) for holds, why in rules if holds), YES)
