"""Weight formats and the quantized linear modules against dequantized float references."""

from __future__ import annotations

import pytest
import torch

from flashx_batch.quant import formats as fm
from flashx_batch.quant.linear import QuantLinear, SplitLinear, build_linear

pytestmark = pytest.mark.usefixtures("one_thread")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _weight(n: int = 96, k: int = 256, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


def test_int4_pack_unpack_round_trip():
    q = torch.randint(0, 16, (48, 130), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    packed = fm.pack_int4(q)
    assert packed.shape == (48, 65) and packed.dtype == torch.uint8
    assert torch.equal(fm.unpack_int4(packed), q)
    assert int(packed[0, 0]) == int(q[0, 0]) | (int(q[0, 1]) << 4)  # documented nibble order


def test_int4_pack_rejects_odd_rows():
    with pytest.raises(ValueError, match="even"):
        fm.pack_int4(torch.zeros(2, 3, dtype=torch.uint8))


def test_int8_quantize_round_trip_error_bounded():
    w = _weight()
    q, scales = fm.quantize_int8(w)
    assert q.dtype == torch.int8 and scales.shape == (96,)
    err = (fm.dequantize_int8(q, scales) - w).abs()
    assert (err <= scales[:, None] / 2 + 1e-6).all()  # round to nearest: at most half a step


def test_int4_quantize_round_trip_error_bounded():
    w = _weight()
    q, scales, zeros = fm.quantize_int4(w, 64)
    assert int(q.max()) <= 15 and scales.shape == zeros.shape == (96, 4)
    back = fm.dequantize_int4(fm.pack_int4(q), scales, zeros)
    step = scales.repeat_interleave(64, dim=1)
    assert ((back - w).abs() <= step / 2 + 1e-5).all()
    # already-quantized values survive a second round trip exactly
    q2, s2, z2 = fm.quantize_int4(back, 64)
    assert torch.allclose(fm.dequantize_int4_values(q2, s2, z2), back, atol=1e-5)


def test_int4_group_size_falls_back_to_a_divisor():
    assert fm.int4_group_size(256, 128) == 128
    assert fm.int4_group_size(704, 128) == 64  # 704 = 11 x 64
    assert fm.int4_group_size(40, 64) is None


def _independent_reference(w: torch.Tensor, fmt: str, group: int) -> torch.Tensor:
    """The float weight `fmt` should compute with, derived from the pure functions only."""
    if fmt == "int8":
        return fm.dequantize_int8(*fm.quantize_int8(w))
    if fmt == "int4":
        return fm.dequantize_int4_values(*fm.quantize_int4(w, group))
    return w.to(fm.FLOAT_FORMATS[fmt]).float()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 5e-3)])
@pytest.mark.parametrize("fmt", ["int8", "int4", "bf16", "fp16", "fp32"])
def test_quant_linear_matches_dequantized_reference(fmt, dtype, tol):
    w = _weight()
    x = torch.randn(2, 5, 256, generator=torch.Generator().manual_seed(2)).to(dtype)  # [B, T, K]
    module = QuantLinear.from_float(w, fmt, dtype, group_size=64)
    # int8 with float32 activations on CPU also rounds the inputs, one scale per row (int8_dynamic)
    inputs = fm.fake_quantize_rows(x) if module.kernel == "int8_dynamic" else x
    reference = inputs.float() @ _independent_reference(w, fmt, 64).T
    out = module(x)
    assert out.shape == (2, 5, 96) and out.dtype == dtype
    assert _rel(out, reference) <= tol, module.kernel
    # int8_dynamic keeps a small weight twice where it can: prepacked, and plain for few-row calls
    both = module.kernel == "int8_dynamic" and module._packed is not None and module.qweight_t is not None
    assert module.nbytes() == fm.weight_bytes(fmt, 96, 256, module.group_size, dtype) + (96 * 256 if both else 0)


def test_cpu_kernel_policy():
    """PyTorch's int kernels for half-precision activations; int8 with fp32 activations runs int8 x int8
    (activations quantized per row); int4 with fp32 takes float BLAS (measured faster)."""
    assert QuantLinear.from_float(_weight(), "int8", torch.bfloat16).kernel == "int8pack_mm"
    assert QuantLinear.from_float(_weight(), "int4", torch.bfloat16, 64).kernel == "int4pack_mm_cpu"
    assert QuantLinear.from_float(_weight(), "int8", torch.float32).kernel == "int8_dynamic"
    assert QuantLinear.from_float(_weight(), "int4", torch.float32, 64).kernel == "dequant"
    # 40 rows is not a multiple of 16: the CPU int4 kernel cannot take it, the fallback must
    odd = QuantLinear.from_float(_weight(40, 128), "int4", torch.float32, 64)
    assert odd.kernel == "dequant"
    x = torch.randn(3, 128)
    assert _rel(odd(x), x @ _independent_reference(_weight(40, 128), "int4", 64).T) <= 1e-5


@pytest.mark.parametrize("rows", [1, 16, 40])  # around SMALL_M: int8pack_mm below, scaled BLAS above
def test_int8_kernel_and_blas_routes_agree(rows):
    w = _weight()
    module = QuantLinear.from_float(w, "int8", torch.bfloat16)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    assert _rel(module(x), x.float() @ _independent_reference(w, "int8", 64).T) <= 1e-2


@pytest.mark.skipif(not fm.onednn_int8_available(), reason="this torch build has no oneDNN int8 linear")
def test_large_int8_layers_run_prepacked_with_the_same_rounding():
    """A layer of INT_MM_MAX_WEIGHTS weights or more keeps its int8 weight prepacked for oneDNN only (no
    reorder per call): every row rounded on its own grid, calls of any row count (padded past 64)
    agreeing with each other and with the int8 reference, the weight read back exactly, one byte a
    weight resident."""
    from flashx_batch.quant.linear import INT_MM_MAX_WEIGHTS

    g = torch.Generator().manual_seed(6)
    w = torch.randn(INT_MM_MAX_WEIGHTS // 64, 64, generator=g) * 0.05
    module = QuantLinear.from_float(w, "int8", torch.float32)
    simulated = QuantLinear.from_float(w, "int8", torch.float32, kernel="simulated")
    assert module._packed is not None and module.qweight_t is None
    assert torch.equal(module.reference_weight(), simulated.reference_weight())
    assert module.nbytes() == fm.weight_bytes("int8", *w.shape, None, torch.float32)
    x = torch.randn(70, 64, generator=g) * torch.logspace(-2, 2, 70)[:, None]
    out = module(x)
    for part in (slice(0, 1), slice(3, 11), slice(60, 70)):
        assert torch.allclose(out[part], module(x[part]), rtol=1e-6, atol=1e-6)
    reference = fm.fake_quantize_rows(x) @ module.reference_weight().T
    # the float reference's own rounding scales with its row (rows here span 1e-2 to 1e2)
    assert ((out - reference).abs() <= 1e-4 * reference.abs() + 1e-6 * reference.abs().amax(1, keepdim=True)).all()
    assert _rel(out, x @ w.T) <= 2e-2


@pytest.mark.skipif(not (fm.onednn_int8_available() and fm.has_vnni()),
                    reason="needs oneDNN's int8 linear on a 127-step grid (VNNI)")
@pytest.mark.parametrize("shape", [(96, 256), (1408, 256), (64, 4096), (3, 40)])
def test_small_int8_layers_take_int_mm_for_few_rows_with_the_same_bits(shape, monkeypatch):
    """Below INT_MM_MAX_WEIGHTS a layer keeps its weight prepacked and plain: calls of at most
    INT_MM_MAX_ROWS rows go through `torch._int_mm`, larger ones through the prepacked kernel, and a
    row's output is the same bits either way (rows at the grid's ends, tiny and huge rows, a long K
    whose int32 sums pass 2^24, a strided view, an all-zero row). On a CPU whose two kernels differ in
    the last bits (`formats.int_mm_matches_packed`), the prepacked kernel alone serves every call."""
    from flashx_batch.quant.linear import INT_MM_MAX_ROWS, INT_MM_MAX_WEIGHTS

    g = torch.Generator().manual_seed(15)
    w = torch.randn(*shape, generator=g) * 0.05
    w[0] = 1.0  # a row of one repeated value: every code at the grid's end, the largest int32 sums
    module = QuantLinear.from_float(w, "int8", torch.float32)
    both = fm.int_mm_matches_packed()
    assert shape[0] * shape[1] < INT_MM_MAX_WEIGHTS and module._packed is not None
    assert (module.qweight_t is not None) == both
    wide = torch.randn(90, 2 * shape[1], generator=g) * torch.logspace(-3, 3, 90)[:, None]
    wide[5] = 0.0
    wide[6] = wide[6].abs()  # all codes at +127 against the all-127 weight row: K x 127 x 127
    x = wide[:, : shape[1]]
    int_mm_calls = []
    real_int_mm = torch._int_mm
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: int_mm_calls.append(len(a)) or real_int_mm(a, b))
    many = module(x)
    assert not int_mm_calls  # 90 rows: prepacked
    for part in (slice(0, 1), slice(0, INT_MM_MAX_ROWS), slice(5, 12), slice(60, 90)):
        few = module(x[part])
        if both:
            assert torch.equal(few, many[part]), part
        else:  # one kernel, which like float BLAS may sum a row in another order for another row count
            assert torch.allclose(few, many[part], rtol=1e-6, atol=1e-6), part
    # every call of at most INT_MM_MAX_ROWS rows through `_int_mm` where it gives the same bits, none elsewhere
    assert int_mm_calls == ([1, INT_MM_MAX_ROWS, 7, 30] if both else [])
    reference = fm.fake_quantize_rows(x) @ module.reference_weight().T
    # exact int32 sums where `_int_mm` agrees; a oneDNN that scales AMX products in float may round a long
    # K's sum to float32's precision of the row's largest value
    spread = 1e-6 if both else 1e-4
    assert ((many - reference).abs() <= 1e-4 * reference.abs() + spread * reference.abs().amax(1, keepdim=True)).all()


@pytest.mark.parametrize("fmt", ["int8", "int4", "bf16"])
def test_simulated_kernel_uses_the_same_weight_values(fmt):
    w = _weight()
    real = QuantLinear.from_float(w, fmt, torch.float32, 64)
    fake = QuantLinear.from_float(w, fmt, torch.float32, 64, kernel="simulated")
    x = torch.randn(7, 256)
    assert torch.equal(fake.reference_weight(), real.reference_weight().float())
    assert _rel(fake(x), real(x)) <= 1e-6


def test_split_linear_concatenates_formats_and_adds_bias():
    w, bias = _weight(), torch.randn(96)
    module = build_linear(w, bias, [(0, 32, "int4"), (32, 64, "int8"), (64, 96, "int8")], torch.float32, 64)
    assert isinstance(module, SplitLinear) and len(module.parts) == 2  # the two int8 pieces run as one
    x = torch.randn(4, 256)
    # the int8 rows run int8_dynamic on a float32 CPU engine: their inputs are rounded per row too
    ref = torch.cat([x @ _independent_reference(w[:32], "int4", 64).T,
                     fm.fake_quantize_rows(x) @ _independent_reference(w[32:], "int8", 64).T], dim=1)
    assert _rel(module(x), ref + bias) <= 1e-5
    single = build_linear(w, None, [(0, 48, "int8"), (48, 96, "int8")], torch.float32, 64)
    assert isinstance(single, QuantLinear)
    with pytest.raises(ValueError, match="tile"):
        build_linear(w, None, [(0, 48, "int8")], torch.float32, 64)


def test_quant_linear_does_not_alias_its_source():
    w = _weight()
    module = QuantLinear.from_float(w, "fp32", torch.float32)
    module.weight.add_(1.0)
    assert torch.equal(w, _weight())


def test_int8_dynamic_is_batch_invariant_and_simulated_exactly():
    """A row is rounded the same whatever the other rows of its batch (per-row activation scales), and
    the planner measures int8 for a float32 CPU engine with that very kernel. Like float32 BLAS, the GEMM
    may sum a row in another order for another row count: last-bit differences only (a per-tensor scale
    would move the other rows by about 1e-2 here)."""
    w = _weight()
    module = QuantLinear.from_float(w, "int8", torch.float32)
    simulated = QuantLinear.from_float(w, "int8", torch.float32, kernel="simulated")
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(4))
    x[3] *= 50  # an outlier row must not change the others' rounding
    for part in (slice(0, 3), slice(4, 6), slice(5, 6)):
        assert torch.allclose(module(x)[part], module(x[part]), rtol=1e-6, atol=1e-6)
    broken = x.clone()
    broken[1, 5], broken[2, 0] = float("nan"), float("inf")  # a diverging row stays its own problem
    out = module(broken)
    assert not out[1:3].isfinite().all(dim=1).any() and out[[0, 3, 4, 5]].isfinite().all()
    assert torch.allclose(out[[0, 3, 4, 5]], module(x)[[0, 3, 4, 5]], rtol=1e-6, atol=1e-6)
    assert simulated.kernel == "int8_dynamic" and torch.equal(simulated(x), module(x))
    assert _rel(module(x), x @ w.T) <= 2e-2


def test_quantize_rows_is_the_same_for_any_row_count_stride_and_size():
    """The activation rounding every int8-activation kernel shares: a row's codes and peak are the same
    alone or among many (past the size where the peak is taken in four ops instead of two), read
    through a strided view or a contiguous copy; padding rows are zero codes; values within half a step."""
    g = torch.Generator().manual_seed(11)
    wide = torch.randn(300, 2 * 512, generator=g) * torch.logspace(-3, 3, 300)[:, None]
    rows = wide[:, :512]  # a view with a row stride of 1,024, as a fused projection's half is
    assert rows.numel() > fm._SMALL_ROWS
    codes, peak = fm.quantize_rows(rows, 127.0, padded=320)
    codes, peak = codes.clone(), peak.clone()  # the codes live in a workspace the next call reuses
    assert codes.shape == (320, 512) and not codes[300:].any()
    for i in (0, 7, 150, 299):
        alone, alone_peak = fm.quantize_rows(rows[i : i + 1].contiguous())
        assert torch.equal(alone[0], codes[i]) and torch.equal(alone_peak[0], peak[i])
    assert codes[:300].abs().amax(dim=1).eq(127).all()  # each row's largest value lands on the grid's end
    assert ((codes[:300].float() * peak / 127 - rows).abs() <= peak / 254 * (1 + 1e-5)).all()


def test_rotated_int8_input_keeps_the_function_and_cuts_heavy_tailed_error():
    """A down projection's int8 layer holds its weight rotated and rotates each input the same way: the
    same function (reference_weight is back in the input's own basis), rows still rounded alone, and
    on rows whose size sits in a few channels (a gated product) a smaller error than without."""
    g = torch.Generator().manual_seed(12)
    w = torch.randn(96, 256, generator=g) * 0.05
    plain = QuantLinear.from_float(w, "int8", torch.float32)
    rotated = QuantLinear.from_float(w, "int8", torch.float32, rotate_input=True)
    assert rotated.rotated and not plain.rotated and "input rotated" in repr(rotated)
    assert _rel(rotated.reference_weight(), w) <= 1e-2
    x = torch.randn(40, 256, generator=g) * torch.randn(40, 256, generator=g)  # a product: heavy tails
    x[:, 7] *= 30
    exact = x @ w.T
    assert _rel(rotated(x), exact) < 0.5 * _rel(plain(x), exact)
    expected = fm.fake_quantize_rows(fm.rotate_blocks(x)) @ fm.rotate_blocks(rotated.reference_weight()).T
    assert torch.allclose(rotated(x), expected, rtol=1e-4, atol=1e-5)
    for part in (slice(0, 1), slice(5, 30)):
        assert torch.allclose(rotated(x)[part], rotated(x[part]), rtol=1e-6, atol=1e-6)
    # where activations stay float, or the block does not divide the row, the flag changes nothing
    assert not QuantLinear.from_float(w, "int8", torch.bfloat16, rotate_input=True).rotated
    assert not QuantLinear.from_float(torch.randn(8, 40), "int8", torch.float32, rotate_input=True).rotated


def test_rotate_blocks_is_orthonormal_and_its_own_inverse():
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(13))
    once = fm.rotate_blocks(x)
    assert torch.allclose(fm.rotate_blocks(once), x, atol=1e-5)
    assert torch.allclose(once.norm(dim=-1), x.norm(dim=-1), rtol=1e-5)
    assert torch.allclose(once[..., :16], x[..., :16] @ fm.hadamard(16), atol=1e-6)


def test_quantize_rows_serves_inference_mode_and_plain_calls_alike():
    """The rounding workspace is per thread: a buffer made under torch.inference_mode (the engine's
    forwards) must not be what a later plain call (a probe, a weight read-back) writes into."""
    x = torch.randn(4, 64)
    with torch.inference_mode():
        inside = fm.quantize_rows(x)[0].clone()
    assert torch.equal(fm.quantize_rows(x)[0], inside)
    with torch.inference_mode():
        assert torch.equal(fm.quantize_rows(x)[0], inside)


@pytest.mark.skipif(not fm.onednn_int8_available(), reason="this torch build has no oneDNN int8 linear")
def test_rotated_prepacked_layer_keeps_the_function_and_batch_invariance():
    """A down projection large enough to run prepacked, input rotated: output as the rotated reference
    computes it, rows alone equal to rows in a padded call of 70."""
    from flashx_batch.quant.linear import INT_MM_MAX_WEIGHTS

    g = torch.Generator().manual_seed(14)
    w = torch.randn(INT_MM_MAX_WEIGHTS // 256, 256, generator=g) * 0.05
    module = QuantLinear.from_float(w, "int8", torch.float32, rotate_input=True)
    assert module._packed is not None and module.rotated
    x = torch.randn(70, 256, generator=g) * torch.randn(70, 256, generator=g)
    out = module(x)
    expected = fm.fake_quantize_rows(fm.rotate_blocks(x), module._packed.steps) @ \
        fm.rotate_blocks(module.reference_weight()).T
    assert torch.allclose(out, expected, rtol=1e-4, atol=1e-4)
    assert _rel(out, x @ w.T) <= 2e-2
    for part in (slice(0, 1), slice(60, 70)):
        assert torch.allclose(out[part], module(x[part]), rtol=1e-5, atol=1e-5)


def test_the_compiled_rounding_of_few_rows_matches_the_torch_ops(monkeypatch):
    """Decode's few rows go through `row_kernel` (one compiled pass): the same codes and peaks as the torch
    ops give, with a zero-point offset, padding, a strided view, an all-zero row and rows holding NaN or
    infinity (whose codes are meaningless: only their peak is compared)."""
    from flashx_batch.quant import row_kernel

    assert row_kernel.kernel() is not None
    g = torch.Generator().manual_seed(12)
    wide = torch.randn(9, 2 * 96, generator=g) * torch.logspace(-2, 2, 9)[:, None]
    wide[3] = 0.0
    wide[5, 7], wide[6, 1] = float("nan"), float("-inf")
    rows = wide[:, :96]
    fused = [t.clone() for t in fm.quantize_rows(rows, 63.0, padded=12, offset=64)]
    monkeypatch.setattr(row_kernel, "kernel", lambda: None)
    torch_ops = [t.clone() for t in fm.quantize_rows(rows, 63.0, padded=12, offset=64)]
    finite = [i for i in range(9) if i not in (5, 6)] + [9, 10, 11]
    assert torch.equal(fused[0][finite], torch_ops[0][finite])
    assert fused[0][9:].view(torch.uint8).eq(64).all()  # padding: the zero point
    torch.testing.assert_close(fused[1], torch_ops[1], equal_nan=True, rtol=0, atol=0)
    assert fused[1][5].isnan().all() and fused[1][6].isinf().all() and fused[1][3].item() == pytest.approx(1e-12)


@pytest.mark.parametrize("offset", [0, 64])
def test_the_compiled_rounding_rotates_as_rotate_blocks_does(monkeypatch, offset):
    """A rotated layer's few rows are rotated inside the compiled pass: the same codes and peaks, bit
    for bit, as `rotate_blocks` (a GEMM) followed by the torch ops, strided rows included."""
    from flashx_batch.quant import row_kernel

    assert row_kernel.kernel() is not None
    g = torch.Generator().manual_seed(15)
    wide = torch.randn(24, 2 * 176, generator=g) * torch.randn(24, 2 * 176, generator=g)
    wide[:, 5] *= 40  # heavy-tailed, as a gated product is
    rows = wide[:, :176]
    fused = [t.clone() for t in fm.quantize_rows(rows, 127.0, padded=24, offset=offset, rotate=True)]
    monkeypatch.setattr(row_kernel, "kernel", lambda: None)
    torch_ops = [t.clone() for t in fm.quantize_rows(rows, 127.0, padded=24, offset=offset, rotate=True)]
    unrotated = fm.quantize_rows(rows, 127.0, padded=24, offset=offset)[0]
    assert torch.equal(fused[0], torch_ops[0]) and torch.equal(fused[1], torch_ops[1])
    assert not torch.equal(fused[0], unrotated)  # the rotation did happen

