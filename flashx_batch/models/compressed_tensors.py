"""compressed-tensors checkpoints (`quant_method: compressed-tensors`, as llm-compressor and vLLM users write them).

The `quantization_config` is parsed and validated by the `compressed-tensors` library itself
(`QuantizationConfig`: its config groups, preset names, targets and ignore list), and its module
targets matched with the library's own `match_name` (`re:` regexes or exact names; the class target
`Linear` covers every quantized linear, the only modules that hold these tensors); 4-bit values are
unpacked with its `unpack_from_int32`. Tensors are read by our loader, each once, into the row layouts
of `models.quantized_rows` (the library's own decompressors would produce float weights, which is what
this path exists to avoid).

Read, per config group (each with its own `format` or the config's):
- int8 weights, symmetric, one scale per output channel or per tensor (`int-quantized` /
  `naive-quantized`: `weight` int8 [N, K], `weight_scale`): with activations dynamic, symmetric, per
  token int8 (W8A8) onto our int8 kernel, which rounds activations the same way; without activation
  quantization (W8A16) weight-only.
- int4 weights, symmetric or with zero points, per group or channel, act-order group indices
  (`pack-quantized`: `weight_packed` int32 [N, ceil(K / 8)] holding value + 8, `weight_shape`,
  `weight_scale` [N, G], `weight_zero_point` int32 [ceil(N / 8), G] packed along rows, `weight_g_idx`).
- float8 e4m3 weights per tensor, channel, group or block (`float-quantized` / `naive-quantized`).
  Their FP8 activation quantization, if any, is not applied: activations stay in the compute dtype (more
  precise than the checkpoint was calibrated for, never less).
- Config groups that match one module with different arguments are refused (which one the writer applied
  is ambiguous); group indices out of range are refused when the weights are read.

Refused in preflight, naming the group and what is read: other bit widths and types (NVFP4, MXFP4, ...),
asymmetric int8, int8 per group, asymmetric int4 per tensor, FP8 per token or head, static activation
scales, integer weights with quantized float activations (W4AFP8), int4 weights with quantized
activations, output activations, transforms (`transform_config`: rotations), sparsity compressors.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from flashx_batch.errors import ModelLoadError
from flashx_batch.models.quantized_rows import (
    FP8_DTYPES,
    Fp8Rows,
    Int4Rows,
    Int8Rows,
    QuantizedRead,
    RowLayout,
    check_groups,
    check_parts,
    fp8_block_rows,
    groups_of,
    pack_pairs,
)

log = logging.getLogger(__name__)

INT_FORMATS = ("int-quantized", "naive-quantized")
FLOAT_FORMATS = ("float-quantized", "naive-quantized")
QUANTIZED_SUFFIXES = (".weight", ".weight_packed")  # the tensor a quantized linear is routed by
AUXILIARY = ("weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
_UNPACK_ROWS_VALUES = 1 << 22  # 4-bit values unpacked per step


@dataclass(frozen=True)
class ModuleArgs:
    """How one config group's linears are stored: `kind` int8 | int4 | fp8."""

    kind: str
    strategy: str  # tensor | channel | group | block
    group_size: int | None = None
    block: tuple[int, int] | None = None
    symmetric: bool = True
    activations: bool = False  # int8: activations rounded to int8 per token (W8A8)

    def describe(self) -> str:
        size = f" {self.group_size}" if self.group_size else (f" {self.block[0]}x{self.block[1]}" if self.block else "")
        what = {"int8": "int8", "int4": "int4", "fp8": "fp8 e4m3"}[self.kind]
        acts = ", int8 activations per token" if self.activations else ""
        return f"{what} per {self.strategy}{size}{'' if self.symmetric else ' with zero points'}{acts}"


class CompressedTensors:
    """The scheme of a compressed-tensors checkpoint: its config groups' targets and arguments."""

    def __init__(self, groups: list[tuple[list[str], ModuleArgs]], ignore: list[str]) -> None:
        self.groups, self.ignore = groups, ignore

    def describe(self) -> str:
        return "compressed-tensors " + "; ".join(sorted({args.describe() for _, args in self.groups}))

    def record(self) -> dict:
        sizes = sorted({a.group_size for _, a in self.groups if a.group_size})
        return {"format": "compressed-tensors", "scheme": sorted({a.describe() for _, a in self.groups}),
                "group_size": sizes[0] if len(sizes) == 1 else sizes or None}

    def module_args(self, module: str) -> ModuleArgs | None:
        """The arguments of the config groups whose targets match `module` (a name, a `re:` regex, or the class
        `Linear`, which every quantized linear is); None when ignored or matched by none. Groups that match
        it with different arguments are refused: which one the writer applied is not something to guess."""
        from compressed_tensors.utils.match import match_name

        if any(match_name(module, target) for target in self.ignore):
            return None
        matched = {args for targets, args in self.groups
                   if any(target == "Linear" or match_name(module, target) for target in targets)}
        if len(matched) > 1:
            raise ModelLoadError(f"compressed-tensors: module {module} is matched by config groups of different "
                                 f"schemes ({'; '.join(sorted(a.describe() for a in matched))}); the checkpoint's "
                                 "config is ambiguous for it.")
        return next(iter(matched), None)

    def auxiliaries(self, located: dict[str, Path]) -> set[str]:
        return {name for name in located for part in AUXILIARY if name.endswith("." + part)}

    def weight_name(self, hf_name: str) -> str | None:
        return hf_name[: -len("_packed")] if hf_name.endswith(".weight_packed") else None

    def read(self, path: Path, hf_name: str, info: dict, located: dict[str, Path], headers: dict[Path, dict]):
        dtype = info.get("dtype")
        packed = hf_name.endswith(".weight_packed")
        if not packed and not (hf_name.endswith(".weight") and (dtype == "I8" or dtype in FP8_DTYPES)):
            return None
        module = hf_name.rsplit(".", 1)[0]
        args = self.module_args(module)
        stored = "int4" if packed else ("int8" if dtype == "I8" else "fp8")
        if args is None or args.kind != stored:
            raise ModelLoadError(f"{path.name}:{hf_name}: a {stored} tensor, but quantization_config gives module "
                                 f"{module} {'no scheme' if args is None else args.describe()}; is config.json "
                                 "from the same checkpoint?")
        shape = tuple(int(d) for d in info["shape"])
        if packed:
            out, inp = _packed_shape(path, hf_name, info, located, headers)
        elif len(shape) != 2:
            raise ModelLoadError(f"{path.name}:{hf_name}: {list(shape)}; a quantized linear's weight is 2-D.")
        else:
            out, inp = shape
        base, what = module + ".", f"{list(shape)} (compressed-tensors {args.describe()}: a [{out}, {inp}] weight)"
        want = {"weight_scale": (None, _scale_shape(args, out, inp, located, base))}
        if packed:
            want["weight_shape"] = (headers[located[base + "weight_shape"]][base + "weight_shape"]["dtype"], (2,))
            want["weight_packed"] = ("I32", (out, -(-inp // 8)))
            if not args.symmetric:
                want["weight_zero_point"] = ("I32", (-(-out // 8), want["weight_scale"][1][1]))
            if base + "weight_g_idx" in located:
                want["weight_g_idx"] = ("I32", (inp,))
        parts = check_parts(path, hf_name, base, want, located, headers, what)
        return QuantizedRead((out, inp), parts if packed else {"weight": (path, hf_name)} | parts, args)

    def layout(self, read, tensors: dict[str, torch.Tensor]) -> RowLayout:
        args: ModuleArgs = read.detail
        out, inp = read.shape
        scale = tensors["weight_scale"].float()
        if args.kind == "int8":
            return Int8Rows(tensors["weight"], scale.reshape(-1).expand(out).contiguous(), args.activations)
        if args.kind == "fp8":
            if args.strategy == "block":
                return fp8_block_rows(tensors["weight"], scale, *args.block)
            scale = scale.reshape(-1, 1).expand(out, 1) if args.strategy == "tensor" else scale
            return Fp8Rows(tensors["weight"], scale.contiguous(), args.group_size or inp)
        layout = _int4_rows(args, tensors["weight_packed"], tensors["weight_scale"], tensors.get("weight_zero_point"),
                            tensors.get("weight_g_idx"), out, inp)
        check_groups(layout, read.parts.get("weight_g_idx"))
        return layout


def _packed_shape(path: Path, hf_name: str, info: dict, located: dict[str, Path], headers: dict[Path, dict]
                  ) -> tuple[int, int]:
    """[out, in] of a packed weight, from its `weight_shape` tensor (16 bytes read: the header alone leaves the
    width ambiguous to 8 columns)."""
    name = hf_name[: -len("packed")] + "shape"
    if name not in located:
        raise ModelLoadError(f"{path.name}:{hf_name}: its {name} is missing; is a shard file missing?")
    got = headers[located[name]][name]
    if got.get("dtype") not in ("I64", "I32") or [int(d) for d in got["shape"]] != [2]:
        raise ModelLoadError(f"{located[name].name}:{name}: {got.get('dtype')} {got['shape']}; the shape of "
                             f"{hf_name} is an integer [2].")
    dtype = torch.int64 if got["dtype"] == "I64" else torch.int32
    with open(located[name], "rb") as fh:
        start = 8 + int.from_bytes(fh.read(8), "little") + int(got["data_offsets"][0])
        fh.seek(start)
        out, inp = (int(v) for v in torch.frombuffer(bytearray(fh.read(2 * dtype.itemsize)), dtype=dtype))
    if out <= 0 or inp <= 0 or int(info["shape"][0]) != out:
        raise ModelLoadError(f"{located[name].name}:{name}: [{out}, {inp}] does not fit {hf_name} {info['shape']}.")
    return out, inp


def _scale_shape(args: ModuleArgs, out: int, inp: int, located: dict[str, Path], base: str) -> tuple[int, ...]:
    if args.strategy == "tensor":
        return (1,)
    if args.strategy == "channel":
        return (out, 1)
    if args.strategy == "group":
        return (out, -(-inp // args.group_size))
    return (-(-out // args.block[0]), -(-inp // args.block[1]))


def _int4_rows(args: ModuleArgs, packed: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
               g_idx: torch.Tensor | None, out: int, inp: int) -> Int4Rows:
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    pairs = torch.empty(out, -(-inp // 2), dtype=torch.uint8)
    step = max(1, _UNPACK_ROWS_VALUES // inp)
    for first in range(0, out, step):
        chunk = packed[first : first + step]
        values = unpack_from_int32(chunk, 4, torch.Size((chunk.shape[0], inp)), packed_dim=1)  # int8 -8..7
        pairs[first : first + step] = pack_pairs((values.to(torch.int16) + 8).to(torch.uint8))
    scale = scale.reshape(out, -1) if args.strategy != "tensor" else scale.reshape(1, 1).expand(out, 1)
    if zero_point is None:
        zeros = torch.full(tuple(scale.shape), 8, dtype=torch.uint8)
    else:
        zeros = (unpack_from_int32(zero_point, 4, torch.Size(scale.shape), packed_dim=0).to(torch.int16) + 8)
        zeros = zeros.to(torch.uint8)
    group = groups_of(inp, args.group_size if args.strategy == "group" else -1, g_idx)
    return Int4Rows(pairs, zeros.contiguous(), scale.contiguous(), group, inp)


def compressed_tensors_scheme(quant: dict, where: str, supported: str) -> CompressedTensors:
    """The scheme of a compressed-tensors `quantization_config`, validated by the library; ModelLoadError
    naming what is not read."""
    try:
        from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    except ImportError:
        raise ModelLoadError(f"{where}: a compressed-tensors checkpoint needs the `compressed-tensors` package "
                             "(pip install 'flashx-batch[compressed-tensors]').") from None
    if quant.get("transform_config"):
        raise ModelLoadError(f"{where}: compressed-tensors with a transform_config (rotations) is not read; "
                             f"supported: {supported}.")
    sparsity = quant.get("sparsity_config") or {}
    if sparsity.get("format") not in (None, "dense"):
        raise ModelLoadError(f"{where}: compressed-tensors sparsity ({sparsity.get('format')}) is not read; supported: "
                             f"{supported}.")
    try:
        config = QuantizationConfig.model_validate(quant)
    except Exception as exc:  # pydantic's ValidationError, or a preset the library does not know
        errors = exc.errors() if hasattr(exc, "errors") else []
        detail = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors[:3])
        raise ModelLoadError(f"{where}: quantization_config is not a valid compressed-tensors config: "
                             f"{detail or str(exc).splitlines()[0]}; supported: {supported}.") from None
    groups = []
    for name, scheme in config.config_groups.items():
        if isinstance(scheme, list):  # a preset name mapped to its targets
            scheme = preset_name_to_scheme(name, scheme)
        fmt = getattr(scheme, "format", None) or config.format
        groups.append((list(scheme.targets), _module_args(name, scheme, str(fmt), where, supported)))
    if config.kv_cache_scheme is not None:
        log.info("%s: the checkpoint's kv_cache_scheme is not applied: the KV cache stays in the compute dtype", where)
    return CompressedTensors(groups, list(config.ignore or []))


def _module_args(name: str, scheme, fmt: str, where: str, supported: str) -> ModuleArgs:
    w, acts = scheme.weights, scheme.input_activations

    def refuse(what: str) -> ModelLoadError:
        return ModelLoadError(f"{where}: compressed-tensors config group {name} ({fmt}): {what} is not read; "
                              f"supported: {supported}.")

    if w is None or scheme.output_activations is not None:
        raise refuse("quantized activations without weights, or output activations")
    kind = {("int", 8): "int8", ("int", 4): "int4", ("float", 8): "fp8"}.get((str(w.type), w.num_bits))
    strategy = str(w.strategy)
    formats = {"int8": INT_FORMATS, "int4": ("pack-quantized",), "fp8": FLOAT_FORMATS}.get(kind, ())
    if kind is None or fmt not in formats:
        raise refuse(f"{w.type}{w.num_bits} weights")
    if kind == "int8" and (not w.symmetric or strategy not in ("channel", "tensor")):
        raise refuse(f"int8 weights {'with zero points' if not w.symmetric else 'per ' + strategy}")
    if kind == "int4" and (strategy not in ("group", "channel", "tensor") or strategy == "tensor" and not w.symmetric):
        raise refuse(f"int4 weights per {strategy}{'' if w.symmetric else ' with zero points'}")
    if kind == "fp8" and (not w.symmetric or strategy not in ("tensor", "channel", "group", "block")):
        raise refuse(f"fp8 weights per {strategy}{'' if w.symmetric else ' with zero points'}")
    activations = False
    if acts is not None and str(acts.type) == "int":
        if kind != "int8" or acts.num_bits != 8 or not acts.symmetric or acts.dynamic is not True \
                or str(acts.strategy) != "token":
            raise refuse(f"int{acts.num_bits} activations ({acts.strategy}, "
                         f"{'dynamic' if acts.dynamic else 'static'}, {'' if acts.symmetric else 'a'}symmetric) "
                         f"with {kind} weights (int8 activations: dynamic, symmetric, per token, with int8 weights)")
        activations = True
    elif acts is not None and (str(acts.type) != "float" or kind != "fp8"):
        # float activations are left unquantized only beside FP8 weights (module doc); with integer weights
        # (W4AFP8, W8AFP8) the checkpoint was calibrated for a rounding this runtime would not apply
        raise refuse(f"{acts.type}{acts.num_bits} activations with {kind} weights")
    block = tuple(w.block_structure) if strategy == "block" and w.block_structure else None
    if strategy == "block" and block is None:
        raise refuse("block weights without a block_structure")
    return ModuleArgs(kind, strategy, w.group_size if strategy == "group" else None, block, bool(w.symmetric),
                      activations)
