"""`ModelConfig.from_hf`: the single place that reads Hugging Face `config.json` quirks.

Called by the loader when an engine starts. Everything downstream (layers, weight loading, KV
arena sizing) reads this frozen dataclass, never the raw dict, so a new family is one entry in
`ARCHITECTURES` plus whatever flag it needs here.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashx_batch.errors import ModelLoadError
from flashx_batch.kvcache.spec import LayerCache


@dataclass(frozen=True)
class FamilyFlags:
    """What distinguishes one decoder family from another (mini-sglang style: flags, not classes)."""

    qkv_bias_default: bool = False  # bias on q/k/v when config.json does not say `attention_bias`
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    sandwich_norm: bool = False  # Glm4: extra norms after attention and after the MLP
    interleaved_rope: bool = False  # GLM: rotate (x0,x1),(x2,x3)… pairs instead of halves
    default_partial_rotary: float = 1.0  # GLM rotates only half of each head by default
    fused_gate_up_in_checkpoint: bool = False  # GLM ships `gate_up_proj` already fused


ARCHITECTURES: dict[str, FamilyFlags] = {
    "LlamaForCausalLM": FamilyFlags(),
    "MistralForCausalLM": FamilyFlags(),
    "Qwen2ForCausalLM": FamilyFlags(qkv_bias_default=True),
    "Qwen3ForCausalLM": FamilyFlags(qk_norm=True),
    "GlmForCausalLM": FamilyFlags(
        qkv_bias_default=True, interleaved_rope=True, default_partial_rotary=0.5,
        fused_gate_up_in_checkpoint=True,
    ),
    "Glm4ForCausalLM": FamilyFlags(
        qkv_bias_default=True, interleaved_rope=True, default_partial_rotary=0.5,
        fused_gate_up_in_checkpoint=True, sandwich_norm=True,
    ),
    # mixture-of-experts variants: the same attention, MLPs per `MoESpec`
    "MixtralForCausalLM": FamilyFlags(),
    "Qwen2MoeForCausalLM": FamilyFlags(qkv_bias_default=True),
    "Qwen3MoeForCausalLM": FamilyFlags(qk_norm=True),
    # GLM-4.5 / 4.6: half of each head rotated (as halves, not pairs); q/k norms where `use_qk_norm`
    "Glm4MoeForCausalLM": FamilyFlags(default_partial_rotary=0.5),
    # latent attention (`MLASpec`) + sigmoid-routed experts; GLM-5 adds the sparse-attention indexer (`DSASpec`)
    "DeepseekV3ForCausalLM": FamilyFlags(),
    "GlmMoeDsaForCausalLM": FamilyFlags(),
}
CLASSIFIER_SUFFIX = "ForSequenceClassification"
MLA_ARCHITECTURES = ("DeepseekV3ForCausalLM", "GlmMoeDsaForCausalLM")


@dataclass(frozen=True)
class MoESpec:
    """A mixture-of-experts MLP: `top_k` of `num_experts` SwiGLU experts per token, chosen by a softmax
    router (weights renormalised over the chosen ones with `norm_topk_prob`), plus an optional shared
    expert, gated by a sigmoid of one more projection where the model has one (Qwen2-MoE)."""

    num_experts: int
    top_k: int
    intermediate: int  # of each routed expert
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]  # per layer: experts (else the dense MLP of `intermediate_size`)
    shared_intermediate: int = 0  # 0: no shared expert
    shared_gate: bool = False
    # sigmoid routing (GLM-4.5, DeepSeek-V3): experts chosen by sigmoid score + a per-expert correction
    # bias, only within the `topk_groups` best of `groups` expert groups (a group scored by its best two);
    # the chosen experts weighted by their sigmoid scores (renormalised) x `scaling`
    sigmoid: bool = False
    # Qwen2 / Qwen3-MoE cast the routing weights to the model's dtype before weighting the experts
    weights_in_model_dtype: bool = False
    groups: int = 1
    topk_groups: int = 1
    scaling: float = 1.0


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V3, GLM-5): each token's keys and values are kept as one
    normalised latent of `kv_lora_rank` values plus a rotary key of `qk_rope_head_dim` values shared by
    every head; `kv_b` expands the latent into per-head key and value parts (`qk_nope_head_dim`,
    `v_head_dim`). Queries come through a low-rank `q_lora_rank` bottleneck."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # rotary channels stored as (x0, x1), (x2, x3)… pairs in the projections' output
    scale: float  # softmax scale: (nope + rope)^-0.5

    @property
    def latent_dim(self) -> int:
        """Values one token keeps per layer: the latent and the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class DSASpec:
    """DeepSeek sparse attention's indexer (GLM-5): a light multi-head scorer picks, per query, the
    `index_topk` keys that query attends to. Layers marked full run their own indexer (and cache its
    `head_dim`-wide key per token); the others reuse the last full layer's choice."""

    index_topk: int
    heads: int
    head_dim: int
    full_layers: tuple[bool, ...]


def _read_mla(raw: dict[str, Any], arch: str, source: str, rotary: RopeConfig) -> MLASpec | None:
    if arch not in MLA_ARCHITECTURES:
        return None
    if raw.get("q_lora_rank") is None:
        raise ModelLoadError(f"{source}: latent attention without a query bottleneck (q_lora_rank null, "
                             "DeepSeek-V2-Lite style) is not supported; supported: DeepSeek-V3 and GLM-5 shapes.")
    nope, rope = int(raw["qk_nope_head_dim"]), int(raw["qk_rope_head_dim"])
    scale = (nope + rope) ** -0.5
    if rotary.mscale_all_dim:  # yarn-extended DeepSeek checkpoints sharpen the softmax with the context
        scale *= yarn_mscale(rotary.factor, rotary.mscale_all_dim) ** 2
    return MLASpec(int(raw["q_lora_rank"]), int(raw["kv_lora_rank"]), nope, rope, int(raw["v_head_dim"]),
                   # GLM-5 always pairs its rotary channels; DeepSeek-V3 says so in its config
                   arch == "GlmMoeDsaForCausalLM" or bool(raw.get("rope_interleave", True)), scale)


def _read_dsa(raw: dict[str, Any], arch: str, num_layers: int, source: str) -> DSASpec | None:
    if arch != "GlmMoeDsaForCausalLM":
        return None
    kinds = raw.get("indexer_types") or _indexer_types(raw, num_layers)
    if len(kinds) != num_layers or kinds[0] != "full" or set(kinds) - {"full", "shared"}:
        raise ModelLoadError(f"{source}: indexer_types {kinds} must list 'full' or 'shared' for each of the "
                             f"{num_layers} layers, the first one 'full' (a shared layer reuses an earlier choice).")
    return DSASpec(int(raw.get("index_topk", 2048)), int(raw.get("index_n_heads", 32)),
                   int(raw.get("index_head_dim", 128)), tuple(k == "full" for k in kinds))


def _indexer_types(raw: dict[str, Any], num_layers: int) -> list[str]:
    """Each layer's indexer ("full": its own, "shared": the last full layer's choice) where config.json
    does not list them, as transformers' GlmMoeDsaConfig derives them: from `index_topk_pattern` ("F" /
    "S" per layer, or a list), else from `index_topk_freq` (default 1) and `index_skip_topk_offset`
    (default 2): layer i is full iff max(i - offset + 1, 0) % freq == 0 (with the defaults, every layer)."""
    pattern = raw.get("index_topk_pattern")
    if pattern is not None:
        kinds = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else list(pattern)
        return kinds
    freq = max(int(raw.get("index_topk_freq", 1)), 1)
    offset = int(raw.get("index_skip_topk_offset", 2))
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)]


def _read_moe(raw: dict[str, Any], arch: str, num_layers: int) -> MoESpec | None:
    if arch == "MixtralForCausalLM":  # every layer sparse; the chosen weights always renormalised
        return MoESpec(int(raw["num_local_experts"]), int(raw["num_experts_per_tok"]), int(raw["intermediate_size"]),
                       True, (True,) * num_layers)
    if arch in ("Glm4MoeForCausalLM", *MLA_ARCHITECTURES):
        experts = int(raw.get("n_routed_experts") or raw.get("num_local_experts") or 0)
        # transformers' defaults here and below; GLM-5 may list each layer's MLP kind instead
        first_sparse = int(raw.get("first_k_dense_replace", 1 if arch == "Glm4MoeForCausalLM" else 3))
        kinds = raw.get("mlp_layer_types")
        if kinds and len(kinds) != num_layers:
            raise ModelLoadError(f"config.json lists {len(kinds)} mlp_layer_types for {num_layers} layers")
        sparse = (tuple(k == "sparse" and experts > 0 for k in kinds) if kinds else
                  tuple(i >= first_sparse and experts > 0 for i in range(num_layers)))
        inter = int(raw["moe_intermediate_size"])
        return MoESpec(experts, int(raw["num_experts_per_tok"]), inter, bool(raw.get("norm_topk_prob", True)),
                       sparse,
                       shared_intermediate=inter * int(raw.get("n_shared_experts", 1)), sigmoid=True,
                       groups=int(raw.get("n_group") or 1), topk_groups=int(raw.get("topk_group") or 1),
                       scaling=float(raw.get("routed_scaling_factor") or 1.0))
    if arch not in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        return None
    # hub checkpoints say num_experts; transformers 5 writes num_local_experts
    experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    step = int(raw.get("decoder_sparse_step") or 1)
    dense = set(raw.get("mlp_only_layers") or [])
    sparse = tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(num_layers))
    shared = int(raw.get("shared_expert_intermediate_size") or 0) if arch == "Qwen2MoeForCausalLM" else 0
    return MoESpec(experts, int(raw["num_experts_per_tok"]), int(raw["moe_intermediate_size"]),
                   bool(raw.get("norm_topk_prob", False)), sparse, shared, shared_gate=shared > 0,
                   weights_in_model_dtype=True)

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    partial_rotary_factor: float = 1.0
    interleaved: bool = False
    # yarn: frequencies blended between `factor`-interpolated and original by a ramp over the rotary
    # channels (`beta_fast` / `beta_slow` rotations), cos / sin scaled by `attention_factor`
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True
    mscale_all_dim: float = 0.0  # DeepSeek: latent attention's softmax scale grows by yarn_mscale(factor, this)^2


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class ClassifierSpec:
    """A `*ForSequenceClassification` checkpoint: its `score` head ([num_labels, hidden], no bias) takes the
    place of the LM head, and reads the last token's final hidden state."""

    labels: tuple[str, ...]  # id2label in index order (LABEL_i where the config names none)
    multi_label: bool = False  # problem_type multi_label_classification: independent sigmoids, not a softmax

    @property
    def num_labels(self) -> int:
        return len(self.labels)


def _read_classifier(raw: dict[str, Any], classify: bool) -> ClassifierSpec | None:
    if not classify:
        return None
    id2label = raw.get("id2label") or {}
    count = int(raw.get("num_labels") or len(id2label) or 2)
    return ClassifierSpec(tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(count)),
                          raw.get("problem_type") == "multi_label_classification")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    flags: FamilyFlags
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope: RopeConfig
    sliding_window: int | None  # keys a query sees in a sliding layer (itself included); None: no sliding layer
    window_layers: tuple[bool, ...]  # per layer: sliding-window attention (else full causal attention)
    moe: MoESpec | None  # mixture-of-experts MLPs (None: dense)
    mla: MLASpec | None  # latent attention (None: every layer keeps full keys and values)
    dsa: DSASpec | None  # the sparse-attention indexer of an MLA model (None: queries see every earlier key)
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    pad_token_id: int | None
    classifier: ClassifierSpec | None = None  # a sequence classifier (reward model, reranker): no LM head
    quantized: str | None = None  # a pre-quantized checkpoint's quant_method (`models.quantized` reads its scheme)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rope.partial_rotary_factor)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def cache_spec(self) -> tuple[LayerCache, ...]:
        """What each layer keeps per token (the KV arena's sizing)."""
        if self.mla is not None:
            index = self.dsa.head_dim if self.dsa is not None else 0
            return tuple(LayerCache("latent", 1, 1, self.mla.latent_dim + (index if self.dsa and self.dsa.full_layers[i]
                                                                              else 0))
                         for i in range(self.num_layers))
        return tuple(LayerCache("kv", 2, self.num_kv_heads, self.head_dim,
                                self.sliding_window if self.window_layers[i] else None)
                     for i in range(self.num_layers))

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{path}: missing. A model directory needs the Hugging Face config.json.")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{path}: not valid JSON ({exc}).") from exc
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{path}: holds a JSON {type(raw).__name__}, not a model config.")
        try:
            return cls.from_hf(raw, source=str(path))
        except KeyError as exc:
            raise ModelLoadError(f"{path}: lacks {exc}, which the model needs; is it a complete Hugging Face "
                                 "config.json?") from None
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(f"{path}: a value has the wrong type ({exc}).") from None

    @classmethod
    def from_hf(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        archs = raw.get("architectures") or []
        # a sequence classifier is its family's decoder with a score head: the family's name for the rest
        classify = [a for a in archs if a.endswith(CLASSIFIER_SUFFIX)
                    and a[: -len(CLASSIFIER_SUFFIX)] + "ForCausalLM" in ARCHITECTURES]
        if classify:
            archs = [classify[0][: -len(CLASSIFIER_SUFFIX)] + "ForCausalLM"]
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"{source}: architecture {archs or '(none given)'} is not supported; "
                f"supported: {', '.join(sorted(ARCHITECTURES))}."
            )
        flags = ARCHITECTURES[arch]
        if arch == "Glm4MoeForCausalLM" and raw.get("use_qk_norm"):
            flags = dataclasses.replace(flags, qk_norm=True)
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        head_dim = raw.get("head_dim") or hidden // heads
        is_mla = arch in MLA_ARCHITECTURES
        rope = _read_rope(raw, flags, source, is_mla)
        mla = _read_mla(raw, arch, source, rope)
        if mla is not None:  # the rotary tables serve the rotary slice, rotated as halves (see models.mla)
            head_dim = mla.qk_rope_head_dim
        bias = raw.get("attention_bias")
        window_layers = _read_window_layers(raw, arch, int(raw["num_hidden_layers"]))
        window = _read_sliding_window(raw, arch) if any(window_layers) else None
        return cls(
            architecture=arch,
            flags=flags,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)) and not classify,
            # Qwen2's modeling code hard-wires q/k/v bias; its config.json does not say so.
            attention_bias=flags.qkv_bias_default if arch == "Qwen2ForCausalLM" or bias is None else bool(bias),
            rope=rope,
            sliding_window=window,
            window_layers=window_layers,
            moe=_read_moe(raw, arch, int(raw["num_hidden_layers"])),
            mla=mla,
            dsa=_read_dsa(raw, arch, int(raw["num_hidden_layers"]), source),
            eos_token_ids=_as_ids(raw.get("eos_token_id")),
            bos_token_id=raw.get("bos_token_id"),
            pad_token_id=raw.get("pad_token_id"),
            classifier=_read_classifier(raw, bool(classify)),
            quantized=str((raw.get("quantization_config") or {}).get("quant_method", "?"))
            if raw.get("quantization_config") else None,
        )


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _read_rope(raw: dict[str, Any], flags: FamilyFlags, source: str, mla: bool = False) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters`; older checkpoints write `rope_theta` + `rope_scaling`.
    params = dict(raw.get("rope_scaling") or {})
    params.update(raw.get("rope_parameters") or {})
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}."
        )
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    factor = params.get("factor")
    original = params.get("original_max_position_embeddings")
    if factor is None:  # DeepSeek-style yarn: the context extension over the pretrained length
        factor = (float(raw["max_position_embeddings"]) / float(original)
                  if rope_type == "yarn" and original and raw.get("max_position_embeddings") else 1.0)
    attention_factor = params.get("attention_factor")
    if rope_type == "yarn" and attention_factor is None:  # transformers' default, from the paper
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = (yarn_mscale(float(factor), mscale) / yarn_mscale(float(factor), mscale_all)
                            if mscale and mscale_all else yarn_mscale(float(factor)))
    return RopeConfig(
        theta=float(params.get("rope_theta", raw.get("rope_theta", 10000.0))),
        rope_type=rope_type,
        factor=float(factor),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", raw.get("max_position_embeddings", 8192))
        ),
        partial_rotary_factor=float(flags.default_partial_rotary if partial is None or mla else partial),
        interleaved=flags.interleaved_rope,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=float(attention_factor or 1.0),
        truncate=bool(params.get("truncate", True)),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0) if rope_type != "default" else 0.0,
    )


def _read_window_layers(raw: dict[str, Any], arch: str, num_layers: int) -> tuple[bool, ...]:
    """Which layers attend through the sliding window: `layer_types` where the config lists them;
    otherwise Qwen2 / Qwen3's layers from `max_window_layers` on (with `use_sliding_window`), and every
    layer of a model with a `sliding_window` (Mistral)."""
    if _read_sliding_window(raw, arch) is None:
        return (False,) * num_layers
    layer_types = raw.get("layer_types")
    if layer_types:
        if len(layer_types) != num_layers:
            raise ModelLoadError(f"config.json lists {len(layer_types)} layer_types for {num_layers} layers")
        return tuple(t == "sliding_attention" for t in layer_types)
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        first = int(raw.get("max_window_layers", 28))  # transformers' default
        return tuple(i >= first for i in range(num_layers))
    return (True,) * num_layers


def _read_sliding_window(raw: dict[str, Any], arch: str) -> int | None:
    window = raw.get("sliding_window")
    if window is None or int(window) <= 0:  # transformers 5 writes 0 when sliding is off
        return None
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        layer_types = raw.get("layer_types") or []
        if not raw.get("use_sliding_window") and "sliding_attention" not in layer_types:
            return None
    return int(window)
