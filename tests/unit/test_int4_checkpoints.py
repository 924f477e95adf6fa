"""GPTQ and AWQ int4 checkpoints: tiny random Llama and Qwen2 models (q / k / v biases) quantized and packed as
AutoGPTQ's `QuantLinear.pack` and AutoAWQ's `WQLinear_GEMM.from_linear` pack them (symmetric and asymmetric, group
sizes 16 / 32 / 64 and per channel, GPTQ with `desc_act` group indices, v1 and v2 zero points) load and generate
the greedy tokens `transformers` generates on the same weights dequantized to float32; parts of the wrong shape
are refused naming the tensor."""

from __future__ import annotations

import pytest
import torch
from parity_support import cpu_engine, hf_greedy, prompts
from quantized_support import projections, quantized_checkpoint

from flashx_batch.errors import ModelLoadError
from flashx_batch.models.loader import check_checkpoint
from flashx_batch.quant.checkpoint_linear import DequantizingLinear
from flashx_batch.runtime.params import SamplingParams

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _pack_words(values: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """[..., 8k] values 0..15 -> unsigned 32-bit words (int64) [..., k]: value order[i] of each eight at nibble i."""
    grouped = values.reshape(*values.shape[:-1], -1, 8).to(torch.int64)
    packed = torch.zeros(grouped.shape[:-1], dtype=torch.int64)
    for i, column in enumerate(order):
        packed |= (grouped[..., column] & 0xF) << (4 * i)
    return packed


def _pack_nibbles(values: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    return _int32(_pack_words(values, order))


def _gptq_v1_zeros(zeros: torch.Tensor) -> torch.Tensor:
    """GPTQ v1 qzeros: the packed word minus 0x11111111 (GPTQModel's v2 -> v1 conversion; a zero point of 0
    borrows from the next nibble)."""
    return _int32((_pack_words(zeros) - 0x11111111) % 2**32)


def _int32(packed: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words (in int64) as the int32 tensors the checkpoints store (the same bits)."""
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def quantize_linear(weight: torch.Tensor, method: str, group: int, sym: bool, desc_act: bool, v2: bool,
                    seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Packed tensors of one linear (qweight, qzeros, scales[, g_idx]) and its dequantized float32 weight."""
    out, inp = weight.shape
    size = inp if group == -1 else group
    g_idx = torch.arange(inp) // size
    if desc_act:  # GPTQ with act-order: channels quantized in another order, each keeping its group index
        g_idx = g_idx[torch.randperm(inp, generator=torch.Generator().manual_seed(seed))]
    groups = int(g_idx.max()) + 1
    scales, zeros = torch.empty(groups, out), torch.empty(groups, out, dtype=torch.int64)
    for g in range(groups):
        block = weight[:, g_idx == g]
        if sym:
            scales[g] = block.abs().amax(1).clamp(min=1e-8) / 7.5
            zeros[g] = 8
        else:
            low, high = block.amin(1), block.amax(1)
            scales[g] = ((high - low) / 15).clamp(min=1e-8)
            zeros[g] = torch.round(-low / scales[g]).clamp(0, 15).long()
    scales = scales.half()
    q = torch.round(weight.t() / scales.float()[g_idx] + zeros[g_idx]).clamp(0, 15).long()  # [in, out]
    dequantized = ((q - zeros[g_idx]).float() * scales.float()[g_idx]).t()
    if method == "gptq":
        qzeros = _pack_nibbles(zeros) if v2 else _gptq_v1_zeros(zeros)
        parts = {"qweight": _pack_rows_gptq(q), "qzeros": qzeros, "scales": scales}
        if desc_act:
            parts["g_idx"] = g_idx.to(torch.int32)
    else:
        parts = {"qweight": _pack_nibbles(q, AWQ_ORDER), "qzeros": _pack_nibbles(zeros, AWQ_ORDER), "scales": scales}
    return parts, dequantized


def _pack_rows_gptq(q: torch.Tensor) -> torch.Tensor:
    """AutoGPTQ: qweight [in / 8, out], row i holding input channels 8i..8i+7, channel 8i + s at nibble s."""
    rows = q.reshape(-1, 8, q.shape[1]).to(torch.int64)
    packed = torch.zeros(rows.shape[0], q.shape[1], dtype=torch.int64)
    for s in range(8):
        packed |= rows[:, s] << (4 * s)
    return _int32(packed)


def int4_checkpoint(arch: str, directory, method: str, group: int, sym: bool, desc_act: bool = False,
                    v2: bool = False):
    """A random `arch` model saved packed as `method` int4; transformers' model on the dequantized weights."""
    quant = {"quant_method": method, "bits": 4, "group_size": group}
    quant.update({"sym": sym, "desc_act": desc_act, "checkpoint_format": "gptq_v2" if v2 else "gptq"}
                 if method == "gptq" else {"zero_point": True, "version": "gemm"})
    pack = projections(lambda w, i: quantize_linear(w, method, group, sym, desc_act, v2, i), LINEARS)
    return quantized_checkpoint(arch, directory, pack, quant)


CASES = [("gptq", 32, True, False, False), ("gptq", 16, False, True, False), ("gptq", -1, False, False, True),
         ("awq", 64, False, False, False), ("awq", 16, False, False, False)]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("method, group, sym, desc_act, v2", CASES,
                         ids=["gptq-sym-g32", "gptq-asym-g16-desc_act", "gptq_v2-per-channel", "awq-g64", "awq-g16"])
def test_int4_checkpoints_generate_transformers_tokens_on_the_dequantized_weights(tmp_path, one_thread, arch, method,
                                                                                 group, sym, desc_act, v2):
    hf = int4_checkpoint(arch, tmp_path / "model", method, group, sym, desc_act, v2)
    check_checkpoint(tmp_path / "model")
    engine = cpu_engine(tmp_path / "model")
    for layer in engine.runner.model.layers:  # every linear kept packed (act-order parts of different orders: split)
        for linear in (layer.attn.qkv, layer.attn.o_proj, layer.mlp.gate_up, layer.mlp.down):
            parts = list(linear.parts) if desc_act and linear in (layer.attn.qkv, layer.mlp.gate_up) else [linear]
            assert all(isinstance(p, DequantizingLinear) and p.packed.dtype == torch.uint8 for p in parts)
    batch = prompts(4, (6, 19, 11))
    got = [o.token_ids for o in engine.generate(batch, SamplingParams(max_new_tokens=12, ignore_eos=True))]
    assert got == [hf_greedy(hf, p, 12) for p in batch]


def test_an_int4_part_of_the_wrong_shape_is_refused_naming_it(tmp_path):
    from safetensors.torch import load_file, save_file

    int4_checkpoint("llama", tmp_path / "model", "gptq", 32, True)
    path = tmp_path / "model" / "model.safetensors"
    tensors = load_file(str(path))
    name = "model.layers.1.mlp.down_proj.scales"
    tensors[name] = tensors[name][:1].clone()
    save_file(tensors, str(path))
    with pytest.raises(ModelLoadError, match=rf"{name}: F16 \[1, 64\], but model.layers.1.mlp.down_proj.qweight "
                                             r"\[16, 64\] \(gptq int4, group size 32: a \[64, 128\] weight\) needs "
                                             r"float \[4, 64\]"):
        check_checkpoint(tmp_path / "model")


def test_gptq_v1_zero_points_of_zero_and_fifteen_come_back():
    """v1 zero points are stored as the word minus 0x11111111: a 0 borrows from its neighbour, which must come
    back exactly (a per-nibble + 1 would read 16 and one less for the neighbour)."""
    from flashx_batch.models.quantized_rows import gptq_rows

    zeros = torch.tensor([[0, 5, 8, 15, 0, 0, 1, 15], [15, 0, 7, 0, 3, 0, 15, 9]])
    q = torch.randint(0, 16, (8, 8), generator=torch.Generator().manual_seed(0))
    scales = torch.rand(2, 8).half() + 0.1
    g_idx = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1], dtype=torch.int32)
    got = gptq_rows(_pack_rows_gptq(q), _gptq_v1_zeros(zeros), scales, g_idx, 4, zeros_minus_one=True).to_float()
    want = ((q - zeros[g_idx.long()]).float() * scales.float()[g_idx.long()]).t()
    assert torch.equal(got, want)
