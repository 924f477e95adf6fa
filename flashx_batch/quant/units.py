"""Quantization units of a `DecoderModel` and the module swap that gives each unit its format.

A *unit* is what the issue names q / k / v / o / gate / up / down / lm_head. Our loader fuses q, k, v
into one `attn.qkv` weight and gate, up into one `mlp.gate_up` weight, so a unit is a **row range of a
fused weight** (`layers.3.attn.qkv.weight[0:256]` is layer 3's q), not a separate tensor. int8 and
int4 scale each output row independently, so quantizing a row range is exactly quantizing the
unfused projection; when neighbouring units share a format they are packed into one kernel again
(`quant.linear.build_linear`), so an all-int8 layer still runs one qkv matmul.

Embeddings and norms are never units: they keep the model's precision. A tied `lm_head` gets its own
quantized copy; the embedding table it shared stays untouched.

A mixture-of-experts layer's routed experts are two units, `experts_gate_up` and `experts_down`: a whole stacked
weight each, every expert's rows, in int8 or the model's own format (`quant.int8_experts`); its shared expert is
gate / up / down as a dense MLP's. Routers are never units (near-tied experts must be chosen as the float model
chooses them). Latent attention's projections have no units yet: such a model is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from flashx_batch.errors import ConfigError
from flashx_batch.models.decoder import DecoderModel
from flashx_batch.models.layers import Linear
from flashx_batch.models.moe import SparseMoE
from flashx_batch.quant import formats as fm
from flashx_batch.quant.int8_experts import Int8Experts
from flashx_batch.quant.linear import build_linear

UNIT_KINDS = ("q", "k", "v", "o", "gate", "up", "down", "experts_gate_up", "experts_down", "lm_head")
EXPERT_KINDS = ("experts_gate_up", "experts_down")  # a stacked weight of a `SparseMoE`, int8 or native only
EXPERT_FORMATS = ("int8",)  # the formats expert units take besides the model's own


@dataclass(frozen=True)
class Unit:
    """One quantizable projection: rows [start, stop) of the weight of module `module`."""

    name: str  # "layers.3.attn.q", "lm_head"
    module: str  # dotted path of the Linear holding it: "layers.3.attn.qkv"
    start: int
    stop: int
    in_features: int
    layer: int | None  # None for lm_head (after every layer)
    weight: str = "weight"  # the module's tensor (a `SparseMoE`'s stacked `experts_gate_up` / `experts_down`)

    @property
    def out_features(self) -> int:
        return self.stop - self.start

    @property
    def tensor(self) -> str:
        return f"{self.module}.{self.weight}"

    @property
    def params(self) -> int:
        return self.out_features * self.in_features

    @property
    def kind(self) -> str:
        return self.name.rsplit(".", 1)[-1]

    @property
    def stack(self) -> str | None:
        """For an expert unit, the `SparseMoE.quantized` key of its stacked weight ("gate_up" / "down"); else None."""
        return self.kind.removeprefix("experts_") if self.kind in EXPERT_KINDS else None


def model_units(model: DecoderModel) -> list[Unit]:
    """Every unit of `model`, in forward order (layer 0 q, k, v, o, gate, up, down, ..., lm_head)."""
    cfg = model.config
    if cfg.mla is not None:
        raise ConfigError(f"{cfg.architecture}: precision maps cover grouped-query attention; latent attention's "
                          "projections have no per-tensor formats yet. Run it unquantized.")
    hidden = cfg.hidden_size
    units: list[Unit] = []
    for i, layer in enumerate(model.layers):
        attn, mlp = f"layers.{i}.attn", f"layers.{i}.mlp"
        q, kv = cfg.q_size, cfg.kv_size
        units += [
            Unit(f"{attn}.q", f"{attn}.qkv", 0, q, hidden, i),
            Unit(f"{attn}.k", f"{attn}.qkv", q, q + kv, hidden, i),
            Unit(f"{attn}.v", f"{attn}.qkv", q + kv, q + 2 * kv, hidden, i),
            Unit(f"{attn}.o", f"{attn}.o_proj", 0, hidden, q, i),
        ]
        if isinstance(layer.mlp, SparseMoE):
            experts, inter = layer.mlp.spec.num_experts, layer.mlp.spec.intermediate
            units += [Unit(f"{mlp}.experts_gate_up", mlp, 0, experts * 2 * inter, hidden, i, "experts_gate_up"),
                      Unit(f"{mlp}.experts_down", mlp, 0, experts * hidden, inter, i, "experts_down")]
            if layer.mlp.shared is not None:
                units += _mlp_units(f"{mlp}.shared", layer.mlp.spec.shared_intermediate, hidden, i)
        else:
            units += _mlp_units(mlp, cfg.intermediate_size, hidden, i)
    units.append(Unit("lm_head", "lm_head", 0, cfg.vocab_size, hidden, None))
    return units


def _mlp_units(mlp: str, inter: int, hidden: int, layer: int) -> list[Unit]:
    return [Unit(f"{mlp}.gate", f"{mlp}.gate_up", 0, inter, hidden, layer),
            Unit(f"{mlp}.up", f"{mlp}.gate_up", inter, 2 * inter, hidden, layer),
            Unit(f"{mlp}.down", f"{mlp}.down", 0, hidden, inter, layer)]


def available_formats(unit: Unit, formats: list[str], group_size: int) -> list[str]:
    """`formats` minus int4 where the row length admits no group size; for expert units, int8 only."""
    if unit.stack:
        return [f for f in formats if f in EXPERT_FORMATS]
    return [f for f in formats if f != "int4" or fm.int4_group_size(unit.in_features, group_size) is not None]


def get_module(model: nn.Module, path: str) -> nn.Module:
    return model.get_submodule(path)


def set_module(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)


class FormatSwap:
    """Give some units a format by swapping their modules; `restore()` puts the originals back.

    Used by the sensitivity scan and the planner's validation (many short-lived assignments) and by
    `apply_precision_map` (one permanent one). Units whose module keeps the model's own float format
    in every row are left untouched (a tied lm_head then still shares the embedding table).
    `simulate=True` builds `simulated` modules (precomputed dequantized weights, float matmul): the
    measurements' weights are the real formats' values, at float speed for any batch shape.
    """

    def __init__(self, model: DecoderModel, assignment: dict[str, str], group_size: int,
                 units: list[Unit] | None = None, simulate: bool = False) -> None:
        self.model = model
        self.originals: dict[str, nn.Module | _ExpertsOriginal] = {}
        dtype = model.embed.dtype
        native = fm.format_of_dtype(dtype)
        try:
            self._swap(assignment, group_size, units, simulate, dtype, native)
        except BaseException:
            self.restore()  # a refused unit leaves no half-swapped model behind
            raise

    def _swap(self, assignment: dict[str, str], group_size: int, units: list[Unit] | None, simulate: bool,
              dtype: torch.dtype, native: str) -> None:
        model = self.model
        by_module: dict[str, list[Unit]] = {}
        for unit in units or model_units(model):
            if unit.stack:
                self._swap_experts(unit, assignment.get(unit.name, native), native, dtype)
                continue
            by_module.setdefault(unit.module, []).append(unit)
        for path, members in by_module.items():
            formats = [assignment.get(u.name, native) for u in members]
            if all(f == native for f in formats):
                continue
            original = get_module(model, path)
            if not isinstance(original, Linear):
                raise ValueError(f"{path} is already {type(original).__name__}: a precision map is applied once, "
                                 "to a freshly loaded float model")
            pieces = [(u.start, u.stop, f) for u, f in zip(members, formats)]
            rows = original.weight.shape[0]
            covered = sum(u.out_features for u in members)
            if covered != rows:
                raise ValueError(f"{path}: units cover {covered} of {rows} rows")
            # a gated MLP's down projection reads silu(gate) * up, a product of two roughly normal
            # values: a few channels per row far above the rest (peak / rms ~10 on the bundled model,
            # ~3 for every other projection's input), which int8 activation rounding handles badly
            rotate = all(u.kind == "down" for u in members)
            replacement = build_linear(original.weight, original.bias, pieces, dtype, group_size,
                                       kernel="simulated" if simulate else None, rotate_input=rotate)
            set_module(model, path, replacement)
            self.originals[path] = original

    def _swap_experts(self, unit: Unit, fmt: str, native: str, dtype: torch.dtype) -> None:
        """A `SparseMoE`'s stacked weight to int8 (`quant.int8_experts`); the float one is kept in `originals`
        (restored by `restore`, freed when a caller clears them). Measurements (`simulate`) run the real module:
        its kernel is the one a dense int8 layer is measured with on the same engine (`int8_dynamic` on a
        float32 CPU, weight-only elsewhere, as `QuantLinear.from_float` measures them)."""
        if fmt == native:
            return
        if fmt not in EXPERT_FORMATS:
            raise ConfigError(f"{unit.name}: a mixture-of-experts layer's stacked experts take "
                              f"{' or '.join(EXPERT_FORMATS)} or the model's own {native}, not {fmt}.")
        moe, which = get_module(self.model, unit.module), unit.stack
        if which in moe.quantized:
            raise ValueError(f"{unit.name} is already {moe.quantized[which].fmt}: a precision map is applied once, "
                             "to a freshly loaded float model")
        weight = getattr(moe, unit.weight)
        moe.quantized[which] = Int8Experts.from_float(weight, dtype, rotate_input=which == "down")
        setattr(moe, unit.weight, nn.Parameter(weight.new_empty(0), requires_grad=False))  # the float stack freed
        self.originals[unit.name] = _ExpertsOriginal(moe, which, unit.weight, weight)

    def restore(self) -> None:
        for path, original in self.originals.items():
            if isinstance(original, _ExpertsOriginal):
                original.restore()
            else:
                set_module(self.model, path, original)
        self.originals.clear()

    def __enter__(self) -> FormatSwap:
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


@dataclass(frozen=True)
class _ExpertsOriginal:
    """A stacked float expert weight that `FormatSwap` replaced, and where it goes back."""

    moe: SparseMoE
    which: str
    attribute: str
    weight: nn.Parameter

    def restore(self) -> None:
        setattr(self.moe, self.attribute, self.weight)
        del self.moe.quantized[self.which]


def unit_bytes(unit: Unit, fmt: str, group_size: int, dtype: torch.dtype) -> int:
    """Bytes unit `unit` holds in `fmt` (its own rows only; what a decode step streams)."""
    group = fm.int4_group_size(unit.in_features, group_size) if fmt == "int4" else None
    return fm.weight_bytes(fmt, unit.out_features, unit.in_features, group, dtype)


def resident_unit_bytes(unit: Unit, fmt: str, group_size: int, dtype: torch.dtype, tied: bool) -> int:
    """Bytes the unit adds to resident memory: a tied lm_head in the model's own format shares the
    embedding table and adds nothing; quantized, it is an extra copy."""
    if unit.name == "lm_head" and tied and fmt == fm.format_of_dtype(dtype):
        return 0
    return unit_bytes(unit, fmt, group_size, dtype)


def kept_tensors(model: DecoderModel) -> dict[str, tuple[list[int], int]]:
    """Tensors that are never quantized (embedding, norms, biases): name -> (shape, bytes)."""
    unit_weights = {u.tensor for u in model_units(model)}
    kept = {}
    for name, tensor in model.named_parameters(remove_duplicate=True):
        if name not in unit_weights:
            kept[name] = (list(tensor.shape), tensor.numel() * tensor.element_size())
    return kept
