"""A sentence-transformers checkpoint's own embedding head: `modules.json` and the modules it lists.

Supported: `Transformer` (the model itself), `Pooling` (last token, mean or cls; `include_prompt` true),
`Dense` (a linear layer with Identity or Tanh after it, weights in safetensors) and `Normalize`, in that
order, as sentence-transformers applies them. Anything else in the list — another pooling mode (max,
weighted mean, mean over sqrt(length)), another activation, another module type, a module whose files
cannot be read — is refused with its name (`UnsupportedPooling`), so a checkpoint's vectors are never
computed some other way than its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from flashx_batch.errors import ConfigError

ACTIVATIONS = {"torch.nn.modules.linear.Identity": None, "torch.nn.modules.activation.Tanh": torch.tanh}
MODES = (("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean"), ("pooling_mode_cls_token", "cls"))
UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


class UnsupportedPooling(ConfigError):
    """A checkpoint's modules.json asks for an embedding head this runtime does not compute."""


@dataclass(frozen=True)
class DenseLayer:
    """sentence-transformers' `Dense`: y = activation(x W^T + b)."""

    weight: torch.Tensor  # [out, in] float32, on the engine's device
    bias: torch.Tensor | None
    tanh: bool

    def to(self, device: torch.device) -> DenseLayer:
        return DenseLayer(self.weight.to(device), None if self.bias is None else self.bias.to(device), self.tanh)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.linear(x, self.weight, self.bias)
        return torch.tanh(y) if self.tanh else y


@dataclass(frozen=True)
class CheckpointPooling:
    pooling: str
    normalize: bool
    dense: tuple[DenseLayer, ...] = ()

    def to(self, device: torch.device) -> CheckpointPooling:
        """The same head with its Dense layers on `device` (moved once, not per batch)."""
        return CheckpointPooling(self.pooling, self.normalize, tuple(layer.to(device) for layer in self.dense))

    def width(self, hidden_size: int) -> int:
        """Components of this head's vectors (before any Matryoshka cut)."""
        return self.dense[-1].weight.shape[0] if self.dense else hidden_size


def checkpoint_pooling(model_dir: Path) -> CheckpointPooling | None:
    """The embedding head a sentence-transformers checkpoint declares, None for a checkpoint without
    `modules.json`; UnsupportedPooling naming the file and what in it this runtime does not compute."""
    model_dir = Path(model_dir)
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return None
    try:
        modules = json.loads(modules_file.read_text())
        kinds = [(str(m["type"]).rpartition(".")[2], str(m.get("path", ""))) for m in modules]
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise UnsupportedPooling(f"{modules_file}: not a sentence-transformers module list ({exc}); fix or remove "
                                 "it.") from None
    order = [kind for kind, _ in kinds]
    if (order[:1] != ["Transformer"] or order.count("Pooling") != 1 or "Normalize" in order[:-1]
            or any(k == "Dense" and order.index("Pooling") > i for i, k in enumerate(order))):
        raise UnsupportedPooling(f"{modules_file}: modules {order}; this runtime computes Transformer, Pooling, "
                                 "then Dense layers, then Normalize, in that order.")
    pooling, normalize, dense = None, False, []
    for kind, path in kinds:
        where = model_dir / path
        if kind == "Transformer":
            continue
        if kind == "Pooling":
            pooling = _pooling_mode(where / "config.json")
        elif kind == "Dense":
            dense.append(_dense(where))
        elif kind == "Normalize":
            normalize = True
        else:
            raise UnsupportedPooling(f"{modules_file}: module {kind!r} ({path}) is not one this runtime applies "
                                     "(Transformer, Pooling, Dense, Normalize); its vectors would differ from the "
                                     "checkpoint's own.")
    if pooling is None:
        raise UnsupportedPooling(f"{modules_file}: lists no Pooling module; pass the pooling explicitly "
                                 "(embed.pooling / pooling=) after removing modules.json.")
    return CheckpointPooling(pooling, normalize, tuple(dense))


def _pooling_mode(config_file: Path) -> str:
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise UnsupportedPooling(f"{config_file}: cannot read the Pooling module's config ({exc}).") from None
    other = [key for key in UNSUPPORTED_MODES if config.get(key)]
    chosen = [name for key, name in MODES if config.get(key)]
    if other or len(chosen) != 1:
        raise UnsupportedPooling(f"{config_file}: pooling {other or chosen or 'none'}; this runtime pools by exactly "
                                 "one of last token, mean, cls.")
    if config.get("include_prompt", True) is False:
        raise UnsupportedPooling(f"{config_file}: include_prompt=false (pooling that skips an instruction) is not "
                                 "supported.")
    return chosen[0]


def _dense(directory: Path) -> DenseLayer:
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise UnsupportedPooling(f"{directory}/config.json: cannot read the Dense module's config ({exc}).") from None
    if config.get("module_input_name", "sentence_embedding") != "sentence_embedding":
        raise UnsupportedPooling(f"{directory}/config.json: a Dense layer over {config['module_input_name']} (not "
                                 "the pooled sentence embedding) is not supported.")
    activation = config.get("activation_function", "torch.nn.modules.activation.Tanh")
    if activation not in ACTIVATIONS:
        raise UnsupportedPooling(f"{directory}/config.json: Dense activation {activation!r} is not supported "
                                 f"({', '.join(ACTIVATIONS)}).")
    weights = directory / "model.safetensors"
    if not weights.is_file():
        raise UnsupportedPooling(f"{directory}: the Dense module's weights are not in model.safetensors; save the "
                                 "checkpoint again with safe_serialization=True.")
    from safetensors.torch import load_file

    tensors = load_file(str(weights))
    weight, bias = tensors.get("linear.weight"), tensors.get("linear.bias")
    shape = (config.get("out_features"), config.get("in_features"))
    if weight is None or tuple(weight.shape) != shape or (config.get("bias", True) and bias is None):
        raise UnsupportedPooling(f"{weights}: expected linear.weight {list(shape)}"
                                 f"{' and linear.bias' if config.get('bias', True) else ''}; found "
                                 f"{ {k: list(v.shape) for k, v in tensors.items()} }.")
    return DenseLayer(weight.float(), bias.float() if bias is not None else None,
                      ACTIVATIONS[activation] is not None)
