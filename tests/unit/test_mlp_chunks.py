"""A CPU prefill's gated MLP in row chunks computes what the whole MLP does, float32 and int8."""

from __future__ import annotations

import pytest
import torch

from flashx_batch.models import layers
from flashx_batch.quant.linear import QuantLinear


def _mlp(seed: int) -> layers.GatedMLP:
    g = torch.Generator().manual_seed(seed)
    mlp = layers.GatedMLP(64, 96, torch.float32, torch.device("cpu"))
    mlp.gate_up.weight.copy_(torch.randn(192, 64, generator=g) * 0.1)
    mlp.down.weight.copy_(torch.randn(64, 96, generator=g) * 0.1)
    return mlp


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("shape", [(300, 64), (2, 150, 64)])
def test_chunked_mlp_equals_the_whole(monkeypatch, int8, shape):
    mlp = _mlp(0)
    if int8:
        mlp.gate_up = QuantLinear.from_float(mlp.gate_up.weight, "int8", torch.float32)
        mlp.down = QuantLinear.from_float(mlp.down.weight, "int8", torch.float32, rotate_input=True)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    whole = mlp(x)
    monkeypatch.setattr(layers, "MLP_CHUNK_BYTES", 64 * 2 * 96 * 4)  # 64 rows a chunk: 300 rows in 5, the last short
    assert mlp.chunk_rows(4) == 64
    chunked = mlp(x)
    assert chunked.shape == whole.shape
    assert torch.allclose(chunked, whole, rtol=1e-5, atol=1e-6)
