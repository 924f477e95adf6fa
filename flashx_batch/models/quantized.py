"""Pre-quantized checkpoints: which `quantization_config` schemes the loader reads, and how.

Read now, each dequantized into the model's compute dtype while loading (kept in memory quantized,
with per-matmul scales, is not built yet: the weights are resident in the compute dtype):

- FP8 block-wise, as DeepSeek-V3 / R1, Qwen3 and GLM-4.5 FP8 releases ship it (`quant_method: fp8`,
  `fmt: e4m3`, `weight_block_size: [rows, cols]`): a linear's `weight` is float8_e4m3fn and its
  `weight_scale_inv` [ceil(out / rows), ceil(in / cols)] float32 holds one scale per block; the float
  weight is each block times its scale. Dequantized block-row by block-row as it is read
  (`dequantize_rows`): a float copy of a whole tensor never exists.
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
  Both int4 formats are dequantized one linear at a time (`dequantize_gptq`, `dequantize_awq`).

Refused, naming the scheme and this list: every other `quant_method` (compressed-tensors, bitsandbytes,
NVFP4, ...), FP8 without block scales or other than e4m3, int4 schemes of other bit widths, AWQ's GEMV
layout or without zero points, a quantized LM head.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from flashx_batch.errors import ModelLoadError

FP8_DTYPES = {"F8_E4M3": torch.float8_e4m3fn}  # safetensors dtype name -> torch dtype
SCALE_SUFFIX = "_scale_inv"  # `<name>.weight_scale_inv` scales `<name>.weight`
SUPPORTED = ("fp8 block-wise (quant_method: fp8, fmt: e4m3, weight_block_size: [rows, cols]), gptq and awq "
             "(gemm) int4")
INT4_PARTS = ("qweight", "qzeros", "scales", "g_idx")  # an int4 linear's tensors, `<name>.<part>`


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


@dataclass(frozen=True)
class Int4Groups:
    """GPTQ or AWQ int4 weights in groups of `group_size` input channels (module doc: the layouts)."""

    method: str  # gptq | awq
    group_size: int  # -1: one group per output channel (all inputs)
    zeros_minus_one: bool = False  # GPTQ v1: zero points stored minus one

    def describe(self) -> str:
        return f"{self.method} int4, group size {self.group_size}"

    def weight_shape(self, qweight_shape: tuple[int, ...]) -> tuple[int, int]:
        """[out, in] of the float weight a `qweight` of this shape packs."""
        rows, cols = qweight_shape
        return (cols, rows * 8) if self.method == "gptq" else (cols * 8, rows)

    def groups(self, in_features: int) -> int:
        return 1 if self.group_size == -1 else -(-in_features // self.group_size)

    def dequantize(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.method == "gptq":
            return dequantize_gptq(parts["qweight"], parts["qzeros"], parts["scales"], parts.get("g_idx"),
                                   self.group_size, self.zeros_minus_one)
        return dequantize_awq(parts["qweight"], parts["qzeros"], parts["scales"], self.group_size)


Scheme = Fp8Blocks | Int4Groups
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble i of an int32 holds output channel AWQ_ORDER[i] of its 8
_AWQ_UNPACK = tuple(AWQ_ORDER.index(c) for c in range(8))


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., n] -> its eight 4-bit values [..., n, 8], lowest nibble first."""
    return (packed[..., None] >> _SHIFTS) & 0xF


def _group_of(in_features: int, group_size: int, g_idx: torch.Tensor | None) -> torch.Tensor:
    if g_idx is not None:
        return g_idx.long()
    return torch.zeros(in_features, dtype=torch.long) if group_size == -1 else torch.arange(in_features) // group_size


def dequantize_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                    group_size: int, zeros_minus_one: bool) -> torch.Tensor:
    """A GPTQ int4 linear -> its float32 weight [out, in]."""
    out = qweight.shape[1]
    q = _nibbles(qweight).permute(0, 2, 1).reshape(-1, out)  # [in, out]: row 8i + s is nibble s of row i
    if zeros_minus_one:  # v1 stores each word minus 0x11111111 (borrows across nibbles): add it back as a word
        qzeros = ((qzeros.to(torch.int64) + 0x11111111) & 0xFFFFFFFF).to(torch.int32)  # wraps like the int32 sum
    zeros = _nibbles(qzeros).reshape(qzeros.shape[0], -1)[:, :out]  # [groups, out]
    group = _group_of(q.shape[0], group_size, g_idx)
    return ((q - zeros[group]).float() * scales.float()[group]).t().contiguous()


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """An AWQ (GEMM layout) int4 linear -> its float32 weight [out, in]."""
    q = _nibbles(qweight)[..., list(_AWQ_UNPACK)].reshape(qweight.shape[0], -1)  # [in, out]
    zeros = _nibbles(qzeros)[..., list(_AWQ_UNPACK)].reshape(qzeros.shape[0], -1)  # [groups, out]
    group = _group_of(q.shape[0], group_size, None)
    return ((q - zeros[group]).float() * scales.float()[group]).t().contiguous()


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


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, first_row: int, blocks: Fp8Blocks) -> torch.Tensor:
    """Rows first_row.. of a quantized weight (`q` [r, in] float8) as float32: each element times its block's
    scale (`scale`: the whole [ceil(out / rows), ceil(in / cols)] table)."""
    rows = torch.arange(first_row, first_row + q.shape[0]) // blocks.rows
    cols = torch.arange(q.shape[1]) // blocks.cols
    return q.float().mul_(scale[rows][:, cols])


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


Source = tuple[Path, str]  # (safetensors file, tensor name)


@dataclass(frozen=True)
class QuantizedRead:
    """How the loader reads one quantized weight: `kind` fp8 (its `scale`) or int4 (its packed parts), the
    float weight's [out, in] `shape`."""

    kind: str
    shape: tuple[int, int]
    parts: dict[str, Source]


def quantization_auxiliaries(located: dict[str, Path], scheme: Scheme | None) -> set[str]:
    """The checkpoint's tensors read with a quantized weight rather than routed on their own: FP8 scales,
    int4 zero points, scales and group indices."""
    if isinstance(scheme, Fp8Blocks):
        return {name for name in located if name.endswith(SCALE_SUFFIX)}
    if isinstance(scheme, Int4Groups):
        return {name for name in located for part in INT4_PARTS[1:]
                if name.endswith("." + part) and name[: -len(part)] + "qweight" in located}
    return set()


def int4_weight_name(hf_name: str, scheme: Scheme | None) -> str | None:
    """`<linear>.weight` for an int4 linear's `<linear>.qweight` (None for any other tensor)."""
    if isinstance(scheme, Int4Groups) and hf_name.endswith(".qweight"):
        return hf_name[: -len("qweight")] + "weight"
    return None


def fp8_read(path: Path, hf_name: str, shape: tuple[int, ...], located: dict[str, Path], headers: dict[Path, dict],
             scheme: Fp8Blocks) -> QuantizedRead:
    """An FP8 weight's read, its scale checked: there, float32, one per block."""
    name = scale_of(hf_name)
    if len(shape) != 2 or name not in located:
        raise ModelLoadError(f"{path.name}:{hf_name}: an FP8 weight {list(shape)} without its {name} (the "
                             f"checkpoint declares {scheme.describe()}); is a shard file missing?")
    info = headers[located[name]][name]
    want = scheme.scale_shape(shape)
    if tuple(int(d) for d in info["shape"]) != want or info.get("dtype") not in ("F32", "BF16", "F16"):
        raise ModelLoadError(f"{located[name].name}:{name}: shape {info['shape']} {info.get('dtype')}, but "
                             f"{hf_name} {list(shape)} in {scheme.rows}x{scheme.cols} blocks needs float scales "
                             f"{list(want)}.")
    return QuantizedRead("fp8", (int(shape[0]), int(shape[1])), {"scale": (located[name], name)})


def int4_read(path: Path, hf_name: str, info: dict, located: dict[str, Path], headers: dict[Path, dict],
              scheme: Int4Groups) -> QuantizedRead:
    """An int4 linear's read, its parts checked against each other (shapes, dtypes)."""
    base = hf_name[: -len("qweight")]
    qshape = tuple(int(d) for d in info["shape"])
    if info.get("dtype") != "I32" or len(qshape) != 2:
        raise ModelLoadError(f"{path.name}:{hf_name}: {info.get('dtype')} {list(qshape)}; {scheme.method} packs int4 "
                             "into a 2-D int32 qweight.")
    out, inp = scheme.weight_shape(qshape)
    groups = scheme.groups(inp)
    want = {"qzeros": ("I32", (groups, -(-out // 8))), "scales": (None, (groups, out))}
    if scheme.method == "gptq" and base + "g_idx" in located:
        want["g_idx"] = ("I32", (inp,))
    parts: dict[str, Source] = {"qweight": (path, hf_name)}
    for part, (dtype, shape) in want.items():
        name = base + part
        if name not in located:
            raise ModelLoadError(f"{path.name}:{hf_name}: its {name} is missing ({scheme.describe()}); is a shard "
                                 "file missing?")
        got = headers[located[name]][name]
        wrong_dtype = got.get("dtype") != dtype if dtype is not None else got.get("dtype") not in ("F32", "BF16", "F16")
        if tuple(int(d) for d in got["shape"]) != shape or wrong_dtype:
            raise ModelLoadError(f"{located[name].name}:{name}: {got.get('dtype')} {got['shape']}, but {hf_name} "
                                 f"{list(qshape)} ({scheme.describe()}: a [{out}, {inp}] weight) needs "
                                 f"{dtype or 'float'} {list(shape)}.")
        parts[part] = (located[name], name)
    return QuantizedRead("int4", (out, inp), parts)
