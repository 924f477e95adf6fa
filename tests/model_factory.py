"""Tiny random-weight models built with `transformers`' own classes, saved to a directory.

Tests compare our engine against these models; nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

import torch

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "glm", "glm4"]
MOE_ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe"]  # 8 experts, top-2
MLA_ARCHS = ["deepseek_v3", "glm_moe_dsa"]  # latent attention + sigmoid-routed experts (GLM-5: + DSA indexer)

_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               rms_norm_eps=1e-5, initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0)

_MLA = dict(num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
            v_head_dim=24, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, first_k_dense_replace=1,
            routed_scaling_factor=2.5, n_shared_experts=1, num_hidden_layers=3)


def build(arch: str, out_dir: Path, seed: int = 0, **overrides):
    """Save a random `arch` model to `out_dir`; returns the transformers model (float32, eval)."""
    import transformers as tf

    classes = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM, dict(sliding_window=None)),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(head_dim=32)),
        "glm": (tf.GlmConfig, tf.GlmForCausalLM, dict(head_dim=16)),
        "glm4": (tf.Glm4Config, tf.Glm4ForCausalLM, dict(head_dim=16)),
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM, dict(
            head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True)),
        "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM, dict(
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=96)),
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM, dict(
            num_local_experts=8, num_experts_per_tok=2, sliding_window=None)),
        # one dense layer first; sigmoid routing within the best of 4 groups; a shared expert; q/k norms
        "glm4_moe": (tf.Glm4MoeConfig, tf.Glm4MoeForCausalLM, dict(
            head_dim=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, first_k_dense_replace=1,
            n_group=4, topk_group=2, routed_scaling_factor=2.5, n_shared_experts=1, use_qk_norm=True,
            attention_bias=True, num_hidden_layers=3)),
        # latent attention: rank-32 latent + 16 rotary values per token, 16 + 16 query/key dims, 24 value dims
        "deepseek_v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM, dict(_MLA, n_group=4, topk_group=2)),
        # GLM-5: the indexer keeps each query to its index_topk best keys (8 heads of 32)
        "glm_moe_dsa": (tf.GlmMoeDsaConfig, tf.GlmMoeDsaForCausalLM, dict(
            _MLA, index_topk=8, index_head_dim=32, index_n_heads=8)),
    }
    config_cls, model_cls, extra = classes[arch]
    config = config_cls(**{**_COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    # Default init leaves logits nearly flat and greedy output collapses into one repeated token; wider
    # weights give varied continuations, so a parity test compares real sequences, not a constant.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:  # stacked expert weights too
                p.mul_(3.0)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zero at init: make the correction matter
                buffer.copy_(torch.randn(buffer.shape, generator=torch.Generator().manual_seed(seed)) * 0.1)
    model.save_pretrained(out_dir)
    return model
