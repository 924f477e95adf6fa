"""Export our decoder to two ONNX graphs with the KV cache as explicit inputs and outputs.

Who calls it: `onnx.sessions.ensure_export` when an ONNX runner starts (once per model directory;
the files are cached), and tests. The graphs reuse the loaded `DecoderModel`'s weights and blocks
(norms, MLP, RoPE), but replace its arena-writing attention with a functional one, because an ONNX
graph cannot mutate a tensor it does not own:

  prefill: input_ids [B, T] int64, last_index [B] int64
           -> logits [B, V] float32 (at last_index), present [L, 2, B, Hkv, T, D]
  decode:  input_ids [B, 1] int64, position_ids [B] int64, attn_bias [B, 1, 1, P+1] float,
           past [L, 2, B, Hkv, P, D]
           -> logits [B, V] float32, present [L, 2, B, Hkv, P+1, D]

Prefill rows are right-padded; causal attention keeps real tokens blind to the padding after
them, exactly as the torch runtime does. One stacked cache tensor (not 2L tensors) keeps the
session I/O and the host-side row compaction to a single array.
"""

from __future__ import annotations

import hashlib
import json
import logging
import warnings
from pathlib import Path

import torch
from torch import nn

from flashx_batch.models.decoder import Attention, DecoderLayer, DecoderModel

log = logging.getLogger(__name__)

OPSET = 18  # widely supported by the ROCm / MIGraphX providers; nothing here needs newer ops
GRAPH_VERSION = 2  # bump when the graph signature changes, so cached exports are rebuilt


def _attention(attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               past: torch.Tensor | None, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One attention block without the arena -> (output [B, T, hidden], present [2, B, Hkv, S, D])."""
    batch, seq = x.shape[0], x.shape[1]
    q, k, v = (t.transpose(1, 2) for t in attn.project(x, cos, sin))  # [B, H or Hkv, T, D]
    if past is not None:
        k = torch.cat((past[0], k), dim=2)  # [B, Hkv, P+T, D]
        v = torch.cat((past[1], v), dim=2)
    present = torch.stack((k, v))
    group = attn.num_heads // attn.num_kv_heads
    # Grouped-query attention spelled out (expand + reshape): every provider runs plain MatMul.
    k_all = k[:, :, None].expand(-1, -1, group, -1, -1).reshape(batch, attn.num_heads, -1, attn.head_dim)
    v_all = v[:, :, None].expand(-1, -1, group, -1, -1).reshape(batch, attn.num_heads, -1, attn.head_dim)
    scores = torch.matmul(q, k_all.transpose(-1, -2)) * attn.scale  # [B, H, T, S]
    if bias is None:  # prefill: causal over the T new tokens
        causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    else:
        scores = scores + bias
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out = torch.matmul(probs, v_all).transpose(1, 2).reshape(batch, seq, attn.num_heads * attn.head_dim)
    return attn.o_proj(out), present


def _layer(layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           past: torch.Tensor | None, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    presents: list[torch.Tensor] = []

    def attend(h: torch.Tensor) -> torch.Tensor:
        out, present = _attention(layer.attn, h, cos, sin, past, bias)
        presents.append(present)
        return out

    return layer.block(x, attend), presents[0]


class PrefillGraph(nn.Module):
    """Right-padded prompts -> last-token logits and the prompt's KV cache."""

    def __init__(self, model: DecoderModel) -> None:
        super().__init__()
        self.model = model
        self.register_buffer("cos", model.rotary.cos, persistent=False)  # [P_max, rotary_dim]
        self.register_buffer("sin", model.rotary.signed_sin, persistent=False)  # sign folded in: RotaryTable

    def forward(self, input_ids: torch.Tensor, last_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m, seq = self.model, input_ids.shape[1]
        cos, sin = self.cos[:seq][None, :, None], self.sin[:seq][None, :, None]  # [1, T, 1, rd]
        x = torch.nn.functional.embedding(input_ids, m.embed)
        presents = []
        for layer in m.layers:
            x, present = _layer(layer, x, cos, sin, None, None)
            presents.append(present)
        rows = torch.arange(input_ids.shape[0], device=input_ids.device)
        last = m.norm(x[rows, last_index])  # [B, hidden]
        return m.logits(last), torch.stack(presents)


class DecodeGraph(nn.Module):
    """One token per row at its own position, attending to the past cache through `attn_bias`."""

    def __init__(self, model: DecoderModel) -> None:
        super().__init__()
        self.model = model
        self.register_buffer("cos", model.rotary.cos, persistent=False)
        self.register_buffer("sin", model.rotary.signed_sin, persistent=False)  # sign folded in: RotaryTable

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attn_bias: torch.Tensor,
                past: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.model
        cos, sin = self.cos[position_ids][:, None, None], self.sin[position_ids][:, None, None]  # [B, 1, 1, rd]
        x = torch.nn.functional.embedding(input_ids, m.embed)
        presents = []
        for i, layer in enumerate(m.layers):
            x, present = _layer(layer, x, cos, sin, past[i], attn_bias)
            presents.append(present)
        return m.logits(m.norm(x[:, 0])), torch.stack(presents)


def export_fingerprint(model_dir: Path, dtype: torch.dtype, max_positions: int) -> str:
    """Key of a cached export: weights and config (by size and mtime), dtype, positions, torch, graph."""
    files = sorted(p for p in Path(model_dir).iterdir() if p.suffix in (".json", ".safetensors", ".bin"))
    parts = [f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files]
    parts += [str(dtype), str(max_positions), torch.__version__, str(GRAPH_VERSION)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _export(module: nn.Module, args: tuple, path: Path, input_names: list[str],
            dynamic_shapes: dict[str, dict[int, object]]) -> None:
    # The dynamo exporter is torch's supported path from 2.9 on (it needs `onnxscript`); the
    # TorchScript exporter is deprecated. Warnings it prints about guards are informational.
    registration_log = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registration_log.level
    registration_log.setLevel(logging.ERROR)  # "torchvision is not installed" lines: irrelevant to us
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            program = torch.onnx.export(module, args, dynamo=True, input_names=input_names,
                                    output_names=["logits", "present"], dynamic_shapes=dynamic_shapes,
                                    opset_version=OPSET, optimize=True, verbose=False)
        finally:
            registration_log.setLevel(level)
    program.save(str(path), external_data=True)


def export_decoder(model: DecoderModel, out_dir: Path) -> tuple[Path, Path]:
    """Write `prefill.onnx` and `decode.onnx` (+ external weight files) to `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    batch, seq, past = torch.export.Dim("batch", min=1), torch.export.Dim("seq", min=2), torch.export.Dim("past")
    ids = torch.randint(3, cfg.vocab_size, (2, 5))
    with torch.no_grad():
        prefill_path = out_dir / "prefill.onnx"
        _export(PrefillGraph(model).eval(), (ids, torch.tensor([4, 2])), prefill_path,
                ["input_ids", "last_index"], {"input_ids": {0: batch, 1: seq}, "last_index": {0: batch}})
        p = 6
        shape = (cfg.num_layers, 2, 2, cfg.num_kv_heads, p, cfg.head_dim)
        decode_args = (ids[:, :1], torch.tensor([5, 3]), torch.zeros(2, 1, 1, p + 1, dtype=model.embed.dtype),
                       torch.zeros(shape, dtype=model.embed.dtype))
        decode_path = out_dir / "decode.onnx"
        _export(DecodeGraph(model).eval(), decode_args, decode_path,
                ["input_ids", "position_ids", "attn_bias", "past"],
                {"input_ids": {0: batch}, "position_ids": {0: batch}, "attn_bias": {0: batch, 3: past + 1},
                 "past": {2: batch, 4: past}})
    (out_dir / "export.json").write_text(json.dumps({
        "graph_version": GRAPH_VERSION, "opset": OPSET, "torch": torch.__version__,
        "dtype": str(model.embed.dtype), "max_positions": model.rotary.max_positions,
        "num_layers": cfg.num_layers, "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
    }, indent=2))
    log.info("exported %s to %s", cfg.architecture, out_dir)
    return prefill_path, decode_path
