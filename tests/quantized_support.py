"""What the pre-quantized checkpoint tests share: a tiny random model saved quantized, beside the same model
on its dequantized float32 weights (the reference `transformers` runs)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from model_factory import build

# (checkpoint name, float weight, its index) -> (tensors stored in its place, the dequantized weight), or None
Quantize = Callable[[str, torch.Tensor, int], tuple[dict[str, torch.Tensor], torch.Tensor] | None]


def quantized_checkpoint(arch: str, directory: Path, quantize: Quantize, quantization_config: dict):
    """A random `arch` model saved in `directory` with each tensor `quantize` takes replaced by what it stores,
    config.json declaring `quantization_config`; returns `transformers`' model on the dequantized weights
    (saved in float32 beside it)."""
    from safetensors.torch import load_file, save_file

    hf = build(arch, directory)
    tensors = load_file(str(directory / "model.safetensors"))
    reference = directory.parent / f"{directory.name}-dequantized"
    hf.save_pretrained(reference)
    stored, dequantized = {}, dict(tensors)
    for i, (name, tensor) in enumerate(tensors.items()):
        done = quantize(name, tensor.float(), i)
        if done is None:
            stored[name] = tensor
        else:
            stored.update(done[0])
            dequantized[name] = done[1]
    save_file(stored, str(directory / "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, str(reference / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (directory / "config.json").write_text(json.dumps(config))
    return type(hf).from_pretrained(reference, dtype=torch.float32).eval()


def projections(quantize_weight: Callable[[torch.Tensor, int], tuple[dict[str, torch.Tensor], torch.Tensor]],
                suffixes: tuple[str, ...]) -> Quantize:
    """A `Quantize` for the decoder's projections (`<module>.weight` ending in one of `suffixes`):
    `quantize_weight(weight, index)` gives the module's parts by their own names ("qweight", "weight_scale"),
    stored as `<module>.<part>`."""
    def quantize(name: str, weight: torch.Tensor, index: int):
        if not name.endswith(tuple(f"{s}.weight" for s in suffixes)):
            return None
        parts, dequantized = quantize_weight(weight, index)
        base = name[: -len("weight")]
        return {base + part: value for part, value in parts.items()}, dequantized
    return quantize
