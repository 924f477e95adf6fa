"""Pre-quantized checkpoints: which `quantization_config` schemes the loader reads, and how.

Read now: FP8 block-wise, as DeepSeek-V3 / R1, Qwen3 and GLM-4.5 FP8 releases ship it
(`quant_method: fp8`, `fmt: e4m3`, `weight_block_size: [rows, cols]`): a linear's `weight` is
float8_e4m3fn and its `weight_scale_inv` [ceil(out / rows), ceil(in / cols)] float32 holds one scale
per block; the float weight is each block times its scale. The loader dequantizes block-row by
block-row into the model's dtype while reading (`dequantize_rows`), so a float copy of a whole
tensor never exists. Kept in memory as FP8 with per-matmul scales (what memory-bound hosts and FP8
GPUs want) is not built yet: the model's weights are resident in its compute dtype.

Refused, naming the scheme and this list: every other `quant_method` (GPTQ, AWQ, compressed-tensors,
bitsandbytes, NVFP4, ...), FP8 without block scales, FP8 formats other than e4m3.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from flashx_batch.errors import ModelLoadError

FP8_DTYPES = {"F8_E4M3": torch.float8_e4m3fn}  # safetensors dtype name -> torch dtype
SCALE_SUFFIX = "_scale_inv"  # `<name>.weight_scale_inv` scales `<name>.weight`
SUPPORTED = "fp8 block-wise (quant_method: fp8, fmt: e4m3, weight_block_size: [rows, cols])"


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


def checkpoint_scheme(model_dir: Path) -> Fp8Blocks | None:
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
