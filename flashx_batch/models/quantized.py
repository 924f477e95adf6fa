"""Pre-quantized checkpoints: which `quantization_config` schemes the loader reads, and how.

Each scheme says which checkpoint tensors belong to a quantized linear (`auxiliaries`, `weight_name`),
checks them from the headers (`read`: shapes and dtypes against each other, naming the tensor) and
turns one linear's tensors into a row layout (`layout`, `models.quantized_rows`). The loader keeps the
layout as it is (a module that dequantizes per matmul, or our int8 kernel) or dequantizes it at load
where the model has no module for it (stacked experts, latent attention's `kv_b`).

- FP8 block-wise, as DeepSeek-V3 / R1, Qwen3 and GLM-4.5 FP8 releases ship it (`quant_method: fp8`,
  `fmt: e4m3`, `weight_block_size: [rows, cols]`): a linear's `weight` is float8_e4m3fn and its
  `weight_scale_inv` [ceil(out / rows), ceil(in / cols)] float32 holds one scale per block; the float
  weight is each block times its scale.
- GPTQ int4 (`quant_method: gptq`, AutoGPTQ / GPTQModel layout): `qweight` int32 [in / 8, out], eight
  4-bit values of consecutive input channels per int32, lowest nibble first; `qzeros` int32
  [groups, out / 8], eight output channels' zero points per int32 (`checkpoint_format: gptq` stores each
  word minus 0x11111111, a zero point of 0 borrowing from the next nibble, as GPTQModel converts them;
  `gptq_v2` stores them as they are); `scales` float16 [groups, out]; `g_idx` int32 [in], each
  input channel's group (`desc_act` reorders them; without it, channel // group_size). Weight [out, in]
  = scales[g_idx] * (q - zero), transposed.
- AWQ int4 (`quant_method: awq`, `version: gemm`, AutoAWQ layout): `qweight` int32 [in, out / 8] and
  `qzeros` int32 [groups, out / 8], each int32 eight output channels in the order 0 2 4 6 1 3 5 7 from
  the lowest nibble up; `scales` float16 [groups, out]; weight = (q - zero) * scale, transposed.
- compressed-tensors (`quant_method: compressed-tensors`): `models.compressed_tensors`.

Refused, naming the scheme and this list: every other `quant_method` (bitsandbytes, NVFP4, ...), FP8
without block scales or other than e4m3, int4 schemes of other bit widths, AWQ's GEMV layout or without
zero points, a quantized LM head.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from flashx_batch.errors import ModelLoadError
from flashx_batch.models.quantized_rows import (
    FP8_DTYPES,
    Headers,
    QuantizedRead,
    RowLayout,
    awq_rows,
    check_groups,
    check_parts,
    fp8_block_rows,
    gptq_rows,
    header_shape,
)

SCALE_SUFFIX = "_scale_inv"  # `<name>.weight_scale_inv` scales `<name>.weight`
SUPPORTED = ("fp8 block-wise (quant_method: fp8, fmt: e4m3, weight_block_size: [rows, cols]), gptq and awq "
             "(gemm) int4, compressed-tensors int8 (W8A8, W8A16), int4 (pack-quantized W4A16) and fp8 weights")
INT4_PARTS = ("qweight", "qzeros", "scales", "g_idx")  # an int4 linear's tensors, `<name>.<part>`


class Scheme(Protocol):
    def describe(self) -> str: ...

    def record(self) -> dict: ...

    def auxiliaries(self, located: dict[str, Path]) -> set[str]: ...

    def weight_name(self, hf_name: str) -> str | None: ...

    def read(self, path: Path, hf_name: str, info: dict, located: dict[str, Path],
             headers: Headers) -> QuantizedRead | None: ...

    def layout(self, read: QuantizedRead, tensors: dict[str, torch.Tensor]) -> RowLayout: ...


@dataclass(frozen=True)
class Fp8Blocks:
    """FP8 block-wise weights: one float32 scale per `rows` x `cols` block of each quantized weight."""

    rows: int
    cols: int

    def scale_shape(self, weight_shape: tuple[int, ...]) -> tuple[int, int]:
        out, inp = weight_shape
        return -(-out // self.rows), -(-inp // self.cols)

    def describe(self) -> str:
        return f"fp8 e4m3, blocks {self.rows}x{self.cols}"

    def record(self) -> dict:
        return {"format": "fp8", "scheme": "block-wise e4m3", "block": [self.rows, self.cols]}

    def auxiliaries(self, located: dict[str, Path]) -> set[str]:
        return {name for name in located if name.endswith(SCALE_SUFFIX)}

    def weight_name(self, hf_name: str) -> str | None:
        return None

    def read(self, path: Path, hf_name: str, info: dict, located: dict[str, Path],
             headers: Headers) -> QuantizedRead | None:
        """An FP8 weight's read, its scale checked: there, float, one per block (None: a float tensor)."""
        if info.get("dtype") not in FP8_DTYPES:
            return None
        shape, name = header_shape(info), scale_of(hf_name)
        if len(shape) != 2:
            raise ModelLoadError(f"{path.name}:{hf_name}: an FP8 tensor of shape {list(shape)}; {self.describe()} "
                                 "quantizes 2-D linear weights only.")
        if name not in located:
            raise ModelLoadError(f"{path.name}:{hf_name}: an FP8 weight {list(shape)} without its {name} (the "
                                 f"checkpoint declares {self.describe()}); is a shard file missing?")
        got = headers[located[name]][name]
        want = self.scale_shape(shape)
        if header_shape(got) != want or got.get("dtype") not in ("F32", "BF16", "F16"):
            raise ModelLoadError(f"{located[name].name}:{name}: shape {got['shape']} {got.get('dtype')}, but "
                                 f"{hf_name} {list(shape)} in {self.rows}x{self.cols} blocks needs float scales "
                                 f"{list(want)}.")
        return QuantizedRead((shape[0], shape[1]), {"weight": (path, hf_name), "scale": (located[name], name)})

    def layout(self, read: QuantizedRead, tensors: dict[str, torch.Tensor]) -> RowLayout:
        return fp8_block_rows(tensors["weight"], tensors["scale"], self.rows, self.cols)


@dataclass(frozen=True)
class Int4Groups:
    """GPTQ or AWQ int4 weights in groups of `group_size` input channels (module doc: the layouts)."""

    method: str  # gptq | awq
    group_size: int  # -1: one group per output channel (all inputs)
    zeros_minus_one: bool = False  # GPTQ v1: zero points stored minus one

    def describe(self) -> str:
        return f"{self.method} int4, group size {self.group_size}"

    def record(self) -> dict:
        scheme = ("v1" if self.zeros_minus_one else "v2") if self.method == "gptq" else "gemm"
        return {"format": self.method, "scheme": f"int4 {scheme}", "group_size": self.group_size}

    def weight_shape(self, qweight_shape: tuple[int, ...]) -> tuple[int, int]:
        """[out, in] of the float weight a `qweight` of this shape packs."""
        rows, cols = qweight_shape
        return (cols, rows * 8) if self.method == "gptq" else (cols * 8, rows)

    def groups(self, in_features: int) -> int:
        return 1 if self.group_size == -1 else -(-in_features // self.group_size)

    def auxiliaries(self, located: dict[str, Path]) -> set[str]:
        return {name for name in located for part in INT4_PARTS[1:]
                if name.endswith("." + part) and name[: -len(part)] + "qweight" in located}

    def weight_name(self, hf_name: str) -> str | None:
        """`<linear>.weight` for an int4 linear's `<linear>.qweight`."""
        return hf_name[: -len("qweight")] + "weight" if hf_name.endswith(".qweight") else None

    def read(self, path: Path, hf_name: str, info: dict, located: dict[str, Path],
             headers: Headers) -> QuantizedRead | None:
        """An int4 linear's read, its parts checked against each other (shapes, dtypes)."""
        if self.weight_name(hf_name) is None:
            return None
        base, qshape = hf_name[: -len("qweight")], header_shape(info)
        if info.get("dtype") != "I32" or len(qshape) != 2:
            raise ModelLoadError(f"{path.name}:{hf_name}: {info.get('dtype')} {list(qshape)}; {self.method} packs "
                                 "int4 into a 2-D int32 qweight.")
        out, inp = self.weight_shape(qshape)
        groups = self.groups(inp)
        want = {"qzeros": ("I32", (groups, -(-out // 8))), "scales": (None, (groups, out))}
        if self.method == "gptq" and base + "g_idx" in located:
            want["g_idx"] = ("I32", (inp,))
        what = f"{list(qshape)} ({self.describe()}: a [{out}, {inp}] weight)"
        parts = {"qweight": (path, hf_name)} | check_parts(path, hf_name, base, want, located, headers, what)
        return QuantizedRead((out, inp), parts)

    def layout(self, read: QuantizedRead, tensors: dict[str, torch.Tensor]) -> RowLayout:
        if self.method == "gptq":
            layout = gptq_rows(tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors.get("g_idx"),
                               self.group_size, self.zeros_minus_one)
            check_groups(layout, read.parts.get("g_idx"))
            return layout
        return awq_rows(tensors["qweight"], tensors["qzeros"], tensors["scales"], self.group_size)


def checkpoint_scheme(model_dir: Path) -> Scheme | None:
    """The checkpoint's quantization scheme (None: float weights); ModelLoadError naming a scheme this
    loader does not read, and what it reads."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    quant = raw.get("quantization_config")
    if not quant:
        return None
    where = f"{model_dir}/config.json"
    if not isinstance(quant, dict):
        raise ModelLoadError(f"{where}: quantization_config is not an object; supported: {SUPPORTED}.")
    method = str(quant.get("quant_method", "?"))
    if method in ("gptq", "awq"):
        return _int4_scheme(quant, method, where)
    if method == "compressed-tensors":
        from flashx_batch.models.compressed_tensors import compressed_tensors_scheme

        return compressed_tensors_scheme(quant, where, SUPPORTED)
    if method != "fp8":
        raise ModelLoadError(f"{where}: a pre-quantized checkpoint (quant_method={method}) this runtime does not "
                             f"read; supported: {SUPPORTED}. Use the float checkpoint (with runtime.precision_map for "
                             "our own int8 / int4).")
    fmt = str(quant.get("fmt", "e4m3"))
    block = quant.get("weight_block_size")
    if fmt != "e4m3" or not (isinstance(block, list | tuple) and len(block) == 2
                             and all(isinstance(b, int) and b > 0 for b in block)):
        raise ModelLoadError(f"{where}: fp8 with fmt={fmt} and weight_block_size={block} is not read; supported: "
                             f"{SUPPORTED}.")
    return Fp8Blocks(int(block[0]), int(block[1]))


def scale_of(hf_name: str) -> str:
    """The name of the scale tensor of quantized weight `hf_name`."""
    return hf_name + SCALE_SUFFIX


def _int4_scheme(quant: dict, method: str, where: str) -> Int4Groups:
    bits, group = quant.get("bits", quant.get("w_bit")), quant.get("group_size", quant.get("q_group_size"))
    problems = []
    if bits != 4:
        problems.append(f"bits={bits} (int4 only)")
    if not isinstance(group, int) or not (group == -1 or group > 0):
        problems.append(f"group_size={group}")
    if quant.get("lm_head"):
        problems.append("lm_head=true (a quantized LM head)")
    if method == "awq" and str(quant.get("version", "gemm")).lower() != "gemm":
        problems.append(f"version={quant.get('version')} (the GEMM layout only)")
    if method == "awq" and quant.get("zero_point") is False:
        problems.append("zero_point=false")
    if quant.get("dynamic"):
        problems.append(f"dynamic={sorted(quant['dynamic'])[:3]} (per-module overrides)")
    fmt = str(quant.get("checkpoint_format", "gptq"))
    if method == "gptq" and fmt not in ("gptq", "gptq_v2"):
        problems.append(f"checkpoint_format={fmt}")
    if problems:
        raise ModelLoadError(f"{where}: {method} with {', '.join(problems)} is not read; supported: {SUPPORTED}.")
    return Int4Groups(method, int(group), zeros_minus_one=method == "gptq" and fmt == "gptq")
