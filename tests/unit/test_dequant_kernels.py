"""The host kernels that dequantize a kept checkpoint weight write exactly the row layouts' reference weights
(`to_float()`), for contiguous groups (a partial last group, an odd width), act-order groups and FP8 blocks
(every one of the 256 codes), and `DequantizingLinear` takes them on the host."""

from __future__ import annotations

import pytest
import torch

from flashx_batch.models.quantized_rows import Fp8Rows, Int4Rows, groups_of, pack_pairs
from flashx_batch.quant import dequant_kernels
from flashx_batch.quant.checkpoint_linear import DequantizingLinear

pytestmark = pytest.mark.skipif(dequant_kernels.kernels() is None, reason="numba unavailable")


def _int4(rows: int, width: int, group_size: int, act_order: bool) -> Int4Rows:
    g = torch.Generator().manual_seed(width)
    values = torch.randint(0, 16, (rows, width), dtype=torch.uint8, generator=g)
    group = groups_of(width, group_size)
    if act_order:
        group = group[torch.randperm(width, generator=g)]
    groups = int(group.max()) + 1
    zeros = torch.randint(0, 16, (rows, groups), dtype=torch.uint8, generator=g)
    scales = (torch.rand(rows, groups, generator=g) * 0.1).to(torch.bfloat16)
    return Int4Rows(pack_pairs(values), zeros, scales, group, width)


@pytest.mark.parametrize("width, group_size, act_order", [(256, 64, False), (704, 128, False), (99, 32, False),
                                                          (96, -1, False), (128, 32, True)],
                         ids=["divides", "partial-last-group", "odd-width", "per-channel", "act-order"])
def test_int4_kernels_write_the_reference_weight_bit_for_bit(width, group_size, act_order):
    layout = _int4(37, width, group_size, act_order)
    module = DequantizingLinear(layout, None, torch.float32, torch.device("cpu"))
    assert (module.group_size is None) == (act_order or width % 2 == 1 and group_size == -1)
    out = dequant_kernels.buffer(37, width)
    assert dequant_kernels.dequantize_into(out, "int4", dict(module.named_buffers()), module.group_size)
    assert torch.equal(out, layout.to_float())
    x = torch.randn(5, width)
    assert torch.equal(module(x), torch.nn.functional.linear(x, layout.to_float()))


def test_fp8_kernel_reads_every_code_and_its_block_scale():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(3, 1)  # every code, NaNs included
    q = codes.view(torch.float8_e4m3fn)
    scales = torch.rand(3, 3) + 0.5
    layout = Fp8Rows(q, scales, 100)  # 256 columns in blocks of 100: the last block partial
    out = dequant_kernels.buffer(3, 256)
    parts = {"q": q, "scales": scales, "block_cols": 100}
    assert dequant_kernels.dequantize_into(out, "fp8", parts, None)
    assert int(torch.isnan(out).sum()) == 6  # e4m3's two NaN codes, on each of the 3 rows
    assert torch.allclose(out, layout.to_float(), rtol=0, atol=0, equal_nan=True)


def test_a_weight_over_the_buffer_is_dequantized_and_multiplied_in_row_blocks(monkeypatch):
    layout = _int4(50, 64, 32, False)
    bias = torch.randn(50)
    module = DequantizingLinear(layout, bias, torch.float32, torch.device("cpu"))
    x = torch.randn(3, 7, 64)
    whole = module(x)
    monkeypatch.setattr(dequant_kernels, "BUFFER_VALUES", 64 * 16)  # 16 rows a block: 4 blocks, the last of 2
    assert dequant_kernels.block_rows(50, 64) == 16
    blocked = module(x)
    assert torch.allclose(blocked, whole, rtol=1e-6, atol=1e-6)
    assert torch.allclose(whole, torch.nn.functional.linear(x, layout.to_float(), bias), rtol=1e-6, atol=1e-6)
