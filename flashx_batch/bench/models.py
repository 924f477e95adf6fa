"""Benchmark models: the bundled demo model, and random models of a named shape built on the fly
(a Llama, and a Qwen3-MoE for the mixture-of-experts workload)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

# ~27 M parameters: the "small real model" shape the issues ask for, random weights.
LLAMA_27M = dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                 num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                 tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                 # wider than the 0.02 default: greedy continuations vary instead of repeating one token,
                 # and top-2 logit margins are large enough that a parity check compares real sequences
                 initializer_range=0.1)

# ~78 M parameters (77,757,696), 35.3 M of them used per token (top-2 experts): a Qwen3-MoE shape with 8 experts, top-2,
# in every layer. Per layer: attention 0.79 M (8 query heads, 4 KV heads of 64, q/k norms), router 4 K,
# experts 8 x 3 x 512 x 768 = 9.44 M; 6 layers; a 32 K vocabulary tied to the LM head (16.4 M).
# `intermediate_size` is the dense MLP's, unused while every layer is sparse.
QWEN3_MOE_78M = dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                     num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=8,
                     num_experts_per_tok=2, moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1,
                     mlp_only_layers=[], max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=1,
                     eos_token_id=2, initializer_range=0.1)  # wide init: as LLAMA_27M
# many-expert shapes (GLM-4.5 / DeepSeek-V3 route 8 of 128-256): 4 layers at hidden 256, so that a CPU run fits
_MANY = dict(QWEN3_MOE_78M, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=8192)
QWEN3_MOE_16X4 = dict(_MANY, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256)
QWEN3_MOE_64X8 = dict(_MANY, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256)
QWEN3_MOE_128X8 = dict(_MANY, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=128)
MOE_SHAPES = {"qwen3-moe-16x4": QWEN3_MOE_16X4, "qwen3-moe-64x8": QWEN3_MOE_64X8, "qwen3-moe-128x8": QWEN3_MOE_128X8}


def _save_random(config_cls: str, model_cls: str, shape: dict, seed: int, out_dir: Path | None,
                 dtype: torch.dtype) -> Path:
    import transformers

    out = Path(out_dir or tempfile.mkdtemp(prefix="flashx-bench-"))
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**shape)).to(dtype)
    model.save_pretrained(out)  # model.safetensors + config.json
    return out


def random_llama(shape: dict, seed: int = 0, out_dir: Path | None = None, dtype: torch.dtype = torch.float32) -> Path:
    """Save a random-weight `LlamaForCausalLM` of `shape` and return its directory."""
    return _save_random("LlamaConfig", "LlamaForCausalLM", shape, seed, out_dir, dtype)


def random_qwen3_moe(shape: dict = QWEN3_MOE_78M, seed: int = 0, out_dir: Path | None = None,
                     dtype: torch.dtype = torch.float32) -> Path:
    """Save a random-weight `Qwen3MoeForCausalLM` of `shape` and return its directory."""
    return _save_random("Qwen3MoeConfig", "Qwen3MoeForCausalLM", shape, seed, out_dir, dtype)


def parameter_count(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            count = 1
            for dim in f.get_slice(name).get_shape():
                count *= dim
            total += count
    return total


def moe_shape(model_dir: Path) -> dict | None:
    """A mixture-of-experts checkpoint's routed-expert shape from its config.json, or None for a dense
    model: experts, top_k, the expert intermediate size, sparse layers and the parameters in routed
    experts (all, and the top_k a token runs). Qwen2/3-MoE and Mixtral spellings; a shared expert or
    dense layer counts as dense."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    if experts <= 1 or not top_k:
        return None
    layers = int(cfg["num_hidden_layers"])
    if "moe_intermediate_size" in cfg:  # Qwen-MoE: sparse every decoder_sparse_step layers, except mlp_only_layers
        inter = int(cfg["moe_intermediate_size"])
        step, dense = int(cfg.get("decoder_sparse_step") or 1), set(cfg.get("mlp_only_layers") or [])
        sparse = sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
    else:  # Mixtral: every layer
        inter, sparse = int(cfg["intermediate_size"]), layers
    per_expert = 3 * int(cfg["hidden_size"]) * inter  # gate, up, down
    return {"experts": experts, "top_k": top_k, "expert_intermediate": inter, "sparse_layers": sparse,
            "expert_parameters": sparse * experts * per_expert, "active_expert_parameters": sparse * top_k * per_expert}


# ~134 M parameters (134,289,408): a GPT-2-small / SmolLM-class shape, 768 wide, 12 layers of 12 heads
# (no grouping), a 32 K vocabulary tied to the LM head (24.6 M).
LLAMA_134M = dict(vocab_size=32000, hidden_size=768, intermediate_size=2944, num_hidden_layers=12,
                  num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=2048,
                  tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, initializer_range=0.1)


def random_llama_with_bundled_tokenizer(shape: dict, out_dir: Path | None = None, seed: int = 0) -> Path:
    """A random Llama of `shape` with a tokenizer of exactly its vocabulary (`add_bundled_tokenizer`)."""
    return add_bundled_tokenizer(random_llama(shape, seed=seed, out_dir=out_dir), shape["vocab_size"])


def random_qwen3_moe_with_bundled_tokenizer(shape: dict = QWEN3_MOE_78M, out_dir: Path | None = None,
                                            seed: int = 0) -> Path:
    """A random Qwen3-MoE of `shape` with a tokenizer of exactly its vocabulary (`add_bundled_tokenizer`)."""
    return add_bundled_tokenizer(random_qwen3_moe(shape, seed=seed, out_dir=out_dir), shape["vocab_size"])


def add_bundled_tokenizer(model: Path, vocab_size: int) -> Path:
    """Give a random model's directory the bundled tokenizer, its vocabulary filled up with placeholder
    tokens `<|fill_N|>` (never produced by encoding text) to `vocab_size`. Peers that take token strings
    or build their vocabulary from the tokenizer (CTranslate2, llama.cpp's converter) then see every id
    the model can emit."""
    import shutil

    from flashx_batch.runtime.options import bundled_model_dir

    tokenizer = json.loads((bundled_model_dir() / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    taken = len(set(vocab.values()) | {t["id"] for t in tokenizer.get("added_tokens", [])})
    if taken > vocab_size:
        raise ValueError(f"the bundled tokenizer has {taken} tokens, more than vocab_size={vocab_size}")
    for i in range(taken, vocab_size):
        vocab[f"<|fill_{i}|>"] = i
    (model / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    shutil.copy(bundled_model_dir() / "tokenizer_config.json", model / "tokenizer_config.json")
    return model


def upcycled_bundled_moe(out_dir: Path | None = None, experts: int = 8, top_k: int = 2, noise: float = 0.05,
                         seed: int = 0) -> Path:
    """A mixture of experts with trained weights: the bundled Llama "sparse upcycled" into a Mixtral
    (Komatsuzaki et al., 2022) — every expert a copy of its layer's trained MLP with each weight scaled by
    (1 + `noise` x a standard normal), a random router choosing `top_k` of `experts` per token (Mixtral
    renormalises their weights to sum to 1). Attention, norms, embeddings and tokenizer are the bundled
    model's. The experts then hold trained weight distributions (what int8 rounding is measured on) and
    their outputs differ, so routing matters, while the model stays near the dense one's quality."""
    import shutil

    import transformers

    from flashx_batch.runtime.options import bundled_model_dir

    source = bundled_model_dir()
    dense = transformers.LlamaForCausalLM.from_pretrained(source, dtype=torch.float32)
    c = dense.config
    config = transformers.MixtralConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        rope_parameters=c.rope_parameters, tie_word_embeddings=True,
        bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id,
        num_local_experts=experts, num_experts_per_tok=top_k, sliding_window=None)
    gen = torch.Generator().manual_seed(seed)
    moe = transformers.MixtralForCausalLM(config).float()
    params = dict(moe.named_parameters())
    with torch.no_grad():
        for name, tensor in dense.named_parameters():
            if ".mlp." not in name and name in params:
                params[name].copy_(tensor)
        for i, layer in enumerate(dense.model.layers):
            mlp, prefix = layer.mlp, f"model.layers.{i}.mlp"
            gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
            for e in range(experts):
                params[f"{prefix}.experts.gate_up_proj"][e] = gate_up * (1 + noise * torch.randn(gate_up.shape,
                                                                                               generator=gen))
                params[f"{prefix}.experts.down_proj"][e] = mlp.down_proj.weight * (
                    1 + noise * torch.randn(mlp.down_proj.weight.shape, generator=gen))
            params[f"{prefix}.gate.weight"].copy_(torch.randn(experts, c.hidden_size, generator=gen)
                                                  * 2 / c.hidden_size**0.5)
    out = Path(out_dir or tempfile.mkdtemp(prefix="flashx-upcycled-"))
    moe.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, out / name)
    return out
