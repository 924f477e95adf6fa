"""LoRA adapters in PEFT's format, read and checked against a model (`check_adapter`, `read_adapter`).

Format: a directory with `adapter_config.json` and `adapter_model.safetensors`, as PEFT's
`save_pretrained` writes it (PEFT is the format nearly every LoRA fine-tune ships in, so that is
the one read here; PEFT itself is not needed at run time). Supported: LoRA on the attention and
dense-MLP projections (`q_proj k_proj v_proj o_proj gate_proj up_proj down_proj`), any rank per
module (`rank_pattern`), `lora_alpha` / `alpha_pattern`, rsLoRA scaling, `layers_to_transform`
(the tensors say which layers). Everything else a PEFT config can ask for (DoRA, trained biases,
`modules_to_save`, embeddings or the LM head as targets, expert weights, latent-attention
projections) is refused by `check_adapter`, with the names, rather than run as something else.
How the adapters run: `models.lora`.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from flashx_batch.errors import ModelLoadError
from flashx_batch.models.config import ModelConfig
from flashx_batch.models.safetensors_file import safetensors_header

# PEFT module name -> (our linear inside a decoder layer, part of it, parts it has)
TARGETS = {
    "q_proj": ("attn.qkv", 0, 3), "k_proj": ("attn.qkv", 1, 3), "v_proj": ("attn.qkv", 2, 3),
    "o_proj": ("attn.o_proj", 0, 1),
    "gate_proj": ("mlp.gate_up", 0, 2), "up_proj": ("mlp.gate_up", 1, 2), "down_proj": ("mlp.down", 0, 1),
}
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.([A-Za-z0-9_]+)"
                  r"\.lora_([AB])(?:\.[A-Za-z0-9_-]+)?\.weight$")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


def module_shape(cfg: ModelConfig, module: str) -> tuple[int, int]:
    """(in, out) features of a target projection in this model."""
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}[module]


@dataclass
class AdapterModule:
    """One target projection of one layer: A [r, in], B [out, r] (None until read), its scaling."""

    rank: int
    scale: float
    a_name: str
    b_name: str
    a: torch.Tensor | None = None
    b: torch.Tensor | None = None


@dataclass
class LoraAdapter:
    name: str
    path: Path
    digest: str  # sha256 of the config and the weights: what a job's fingerprint records
    modules: dict[tuple[int, str], AdapterModule] = field(default_factory=dict)  # (layer, PEFT module name)

    @property
    def rank(self) -> int:
        """Columns this adapter takes in a stacked linear: its widest module's rank."""
        return max(m.rank for m in self.modules.values())


def _pattern_value(patterns: dict, key: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: a pattern matches a module whose name ends with it."""
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


def check_adapter(name: str, path: str | Path, cfg: ModelConfig) -> LoraAdapter:
    """Everything that can be wrong with an adapter directory for this model, found from its config
    and the safetensors header (no tensor read) -> the adapter with its modules still unread.
    ModelLoadError naming the file and what to do."""
    where = Path(path)
    config_path, weights_path = where / CONFIG_FILE, where / WEIGHTS_FILE
    if not where.is_dir():
        raise ModelLoadError(f"LoRA adapter {name!r}: {where} is not a directory (PEFT's save_pretrained writes "
                             f"{CONFIG_FILE} and {WEIGHTS_FILE} into one).")
    try:
        raw = json.loads(config_path.read_text())
        if not isinstance(raw, dict):
            raise ValueError("not an object")
    except FileNotFoundError:
        raise ModelLoadError(f"LoRA adapter {name!r}: {config_path} is missing; is {where} a PEFT adapter "
                             "directory?") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"LoRA adapter {name!r}: {config_path} is not valid JSON ({exc}).") from None
    problems = []
    if str(raw.get("peft_type", "LORA")).upper() != "LORA":
        problems.append(f"peft_type={raw.get('peft_type')} (only LORA is supported)")
    for key, why in (("use_dora", "DoRA"), ("lora_bias", "trained LoRA biases"), ("fan_in_fan_out", "Conv1D layouts")):
        if raw.get(key):
            problems.append(f"{key}=true ({why} not supported)")
    if raw.get("bias", "none") != "none":
        problems.append(f"bias={raw['bias']!r} (trained biases not supported; only 'none')")
    for key in ("modules_to_save", "target_parameters", "trainable_token_indices"):
        if raw.get(key):
            problems.append(f"{key}={raw[key]!r} (fully trained modules / parameters not supported)")
    if problems:
        raise ModelLoadError(f"LoRA adapter {name!r} ({config_path}): " + "; ".join(problems) + ".")
    if not weights_path.is_file():
        hint = (" (adapter_model.bin: save it again with safe_serialization=True)"
                if (where / "adapter_model.bin").is_file() else "")
        raise ModelLoadError(f"LoRA adapter {name!r}: {weights_path} is missing{hint}.")
    header = safetensors_header(weights_path)
    alpha = raw.get("lora_alpha", 8)
    rslora = bool(raw.get("use_rslora"))
    pairs: dict[tuple[int, str], dict[str, tuple[str, list[int]]]] = {}
    unsupported = []
    for key, info in header.items():
        match = _KEY.match(key)
        if match is None or match.group(2) not in TARGETS:
            unsupported.append(key)
            continue
        layer, module, which = int(match.group(1)), match.group(2), match.group(3)
        pairs.setdefault((layer, module), {})[which] = (key, [int(d) for d in info["shape"]])
    if unsupported:
        raise ModelLoadError(f"LoRA adapter {name!r} ({weights_path.name}): targets this runtime cannot apply to "
                             f"{cfg.architecture}: {sorted(unsupported)[:6]}{' …' if len(unsupported) > 6 else ''}; "
                             f"supported are {', '.join(TARGETS)} of standard-attention layers and dense MLPs.")
    if not pairs:
        raise ModelLoadError(f"LoRA adapter {name!r}: {weights_path} holds no LoRA weights.")
    adapter = LoraAdapter(name, where, _digest(config_path, weights_path))
    for (layer, module), parts in sorted(pairs.items()):
        label = f"layer {layer} {module}"
        if set(parts) != {"A", "B"}:
            raise ModelLoadError(f"LoRA adapter {name!r} ({weights_path.name}): {label} has lora_{''.join(parts)} "
                                 "only; the file is incomplete.")
        if layer >= cfg.num_layers:
            raise ModelLoadError(f"LoRA adapter {name!r}: {label}, but {cfg.architecture} has {cfg.num_layers} "
                                 "layers; was it trained on another base model?")
        if cfg.mla is not None and module in ("q_proj", "k_proj", "v_proj", "o_proj"):
            raise ModelLoadError(f"LoRA adapter {name!r}: {label}: latent-attention projections are not supported.")
        if module in ("gate_proj", "up_proj", "down_proj") and cfg.moe is not None and cfg.moe.sparse_layers[layer]:
            raise ModelLoadError(f"LoRA adapter {name!r}: {label}: layer {layer}'s MLP is a mixture of experts; "
                                 "LoRA on experts is not supported.")
        (a_name, a_shape), (b_name, b_shape) = parts["A"], parts["B"]
        fan_in, fan_out = module_shape(cfg, module)
        rank = a_shape[0] if len(a_shape) == 2 else -1
        if a_shape != [rank, fan_in] or b_shape != [fan_out, rank] or rank < 1:
            raise ModelLoadError(f"LoRA adapter {name!r} ({weights_path.name}): {label} has A {a_shape} and B "
                                 f"{b_shape}; {cfg.architecture} needs A [r, {fan_in}] and B [{fan_out}, r]. Was it "
                                 "trained on another base model?")
        block = "mlp" if TARGETS[module][0].startswith("mlp") else "self_attn"
        peft_key = f"model.layers.{layer}.{block}.{module}"
        module_alpha = float(_pattern_value(raw.get("alpha_pattern"), peft_key, alpha))
        scale = module_alpha / math.sqrt(rank) if rslora else module_alpha / rank
        adapter.modules[(layer, module)] = AdapterModule(rank, scale, a_name, b_name)
    return adapter


def _digest(*files: Path) -> str:
    h = hashlib.sha256()
    for path in files:
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
        h.update(b"\0")
    return h.hexdigest()


def read_adapter(name: str, path: str | Path, cfg: ModelConfig) -> LoraAdapter:
    """`check_adapter`, then the A / B tensors read (float32, host)."""
    from safetensors import safe_open

    adapter = check_adapter(name, path, cfg)
    with safe_open(str(adapter.path / WEIGHTS_FILE), framework="pt") as fh:
        for module in adapter.modules.values():
            module.a = fh.get_tensor(module.a_name).float()
            module.b = fh.get_tensor(module.b_name).float()
    return adapter
