"""Load Hugging Face safetensors into a `DecoderModel`, fusing projections on the way.

Weight loading is data, not code (nano-vllm's `packed_modules_mapping`): `RENAMES` maps a Hugging
Face parameter suffix to ours, `PACKED` says which suffixes land in one fused tensor and in what
order. One loader serves every family.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open

from flashx_batch.errors import ModelLoadError
from flashx_batch.models.config import ModelConfig
from flashx_batch.models.decoder import DecoderModel

log = logging.getLogger(__name__)

# HF suffix (after `model.layers.N.`) -> our parameter path (after `layers.N.`)
RENAMES = {
    "input_layernorm.weight": "input_norm.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight",
    "post_self_attn_layernorm.weight": "post_attn_norm.weight",
    "post_mlp_layernorm.weight": "post_mlp_norm.weight",
    "self_attn.o_proj.weight": "attn.o_proj.weight",
    "self_attn.q_norm.weight": "attn.q_norm.weight",
    "self_attn.k_norm.weight": "attn.k_norm.weight",
    "mlp.down_proj.weight": "mlp.down.weight",
    "mlp.gate_up_proj.weight": "mlp.gate_up.weight",
}
# HF suffix -> (our fused parameter, position among its parts)
PACKED = {
    "self_attn.q_proj.weight": ("attn.qkv.weight", 0),
    "self_attn.k_proj.weight": ("attn.qkv.weight", 1),
    "self_attn.v_proj.weight": ("attn.qkv.weight", 2),
    "self_attn.q_proj.bias": ("attn.qkv.bias", 0),
    "self_attn.k_proj.bias": ("attn.qkv.bias", 1),
    "self_attn.v_proj.bias": ("attn.qkv.bias", 2),
    "mlp.gate_proj.weight": ("mlp.gate_up.weight", 0),
    "mlp.up_proj.weight": ("mlp.gate_up.weight", 1),
}
TOP_LEVEL = {"model.embed_tokens.weight": "embed", "model.norm.weight": "norm.weight",
             "lm_head.weight": "lm_head.weight"}
IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint, single-file or sharded by an index."""
    single = model_dir / "model.safetensors"
    index = model_dir / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise ModelLoadError(f"{index}: lists shard files that do not exist: {missing}.")
        return [model_dir / s for s in shards]
    raise ModelLoadError(
        f"{model_dir}: no model.safetensors or model.safetensors.index.json; "
        "convert the checkpoint with `save_pretrained(..., safe_serialization=True)`."
    )


def _our_name(hf_name: str) -> tuple[str, int | None] | None:
    """Map one HF tensor name to (our parameter path, part index or None); None = not ours."""
    if hf_name in TOP_LEVEL:
        return TOP_LEVEL[hf_name], None
    match = LAYER.match(hf_name)
    if not match:
        return None
    layer, suffix = match.groups()
    if suffix in PACKED:
        target, part = PACKED[suffix]
        return f"layers.{layer}.{target}", part
    if suffix in RENAMES:
        return f"layers.{layer}.{RENAMES[suffix]}", None
    return None


def load_weights(model: DecoderModel, model_dir: Path) -> None:
    """Fill every parameter of `model` from the checkpoint; errors name the file and tensor."""
    params = dict(model.named_parameters(remove_duplicate=False))
    parts: dict[str, dict[int, torch.Tensor]] = {}
    origin: dict[str, Path] = {}
    loaded: set[str] = set()
    unexpected: list[str] = []
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for hf_name in f.keys():
                mapped = _our_name(hf_name)
                if mapped is None or mapped[0] not in params:
                    if not IGNORED.match(hf_name):
                        unexpected.append(hf_name)
                    continue
                name, part = mapped
                tensor = f.get_tensor(hf_name)
                origin[name] = path
                if part is None:
                    _copy_checked(params[name], tensor, name, f"{path.name}:{hf_name}")
                    loaded.add(name)
                else:
                    parts.setdefault(name, {})[part] = tensor
    for name, pieces in parts.items():
        fused = torch.cat([pieces[i] for i in sorted(pieces)], dim=0)
        _copy_checked(params[name], fused, name, f"{origin[name].name}:{name} (fused from {len(pieces)} parts)")
        loaded.add(name)
    if model.config.tie_word_embeddings:
        loaded.add("lm_head.weight")
    missing = sorted(set(params) - loaded)
    if missing:
        raise ModelLoadError(
            f"{model_dir}: checkpoint lacks tensors for {missing[:6]}{' …' if len(missing) > 6 else ''} "
            f"({model.config.architecture}); is config.json from the same model as the weights?"
        )
    if unexpected:
        log.warning("ignored %d checkpoint tensors the model does not use, e.g. %s", len(unexpected), unexpected[:3])


def _copy_checked(param: torch.Tensor, tensor: torch.Tensor, name: str, where: str) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise ModelLoadError(
            f"{where}: shape {tuple(tensor.shape)} does not match {tuple(param.shape)} expected for {name} "
            "from config.json."
        )
    with torch.no_grad():
        param.copy_(tensor.to(param.dtype))


def load_model(model_dir: Path, dtype: torch.dtype, device: torch.device,
               max_positions: int) -> DecoderModel:
    """Build the decoder for `model_dir` on `device`, weights fused, contiguous and resident."""
    cfg = ModelConfig.from_dir(model_dir)
    with torch.device("meta"):
        model = DecoderModel(cfg, dtype, torch.device("meta"))
    model = model.to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed  # to_empty breaks the tie; restore it
    load_weights(model, model_dir)
    model.build_rotary(max_positions)
    model.eval()
    return model
