"""Write a float checkpoint as a compressed-tensors W8A8 int8 checkpoint (`python -m flashx_batch.quantize
model.path=M output.checkpoint=DIR`), so that a model is quantized once and every node loads the result.

What is written is what `compressed-tensors`' W8A8 preset describes and vLLM / llm-compressor read: each
decoder projection (q / k / v / o, gate / up / down; experts and routers excluded) as `weight` int8 [N, K]
with `weight_scale` float32 [N, 1], symmetric per output channel (round to nearest of weight / scale,
scale = max |row| / 127), activations to be rounded to int8 per token at run time; every other tensor
as it was. The config's `quantization_config` is the library's own (`preset_name_to_scheme("W8A8")`,
format `int-quantized`), so the library's validation is what the writer and our loader both go by.
Shards keep their names; tokenizer and other files are copied. Tensors are read one at a time.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from flashx_batch.errors import ConfigError
from flashx_batch.models.config import ModelConfig
from flashx_batch.models.loader import weight_files
from flashx_batch.models.quantized import checkpoint_scheme
from flashx_batch.quant.formats import quantize_int8

# the linears written as int8: a decoder layer's attention and dense-MLP projections (not experts, routers)
TARGET = r"re:.*layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(shared_experts?\.)?(gate|up|down)_proj)$"
_TARGET = re.compile(TARGET[3:])


def write_w8a8(model_dir: Path, out: Path) -> dict:
    """Quantize `model_dir` into `out` (a new or empty directory); returns counts of what was written."""
    try:
        from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, preset_name_to_scheme
    except ImportError:
        raise ConfigError("output.checkpoint writes a compressed-tensors checkpoint, which needs the library: "
                          "pip install 'flashx-batch[compressed-tensors]'.") from None
    from safetensors import safe_open
    from safetensors.torch import save_file

    ModelConfig.from_dir(model_dir)  # an architecture this runtime runs
    scheme = checkpoint_scheme(model_dir)
    if scheme is not None:
        raise ConfigError(f"{model_dir}: already quantized ({scheme.describe()}); quantize the float checkpoint.")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"output.checkpoint={out}: not empty; give a new directory.")
    out.mkdir(parents=True, exist_ok=True)
    files = weight_files(model_dir)
    weight_map, quantized, kept = {}, 0, 0
    for path in files:
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(path), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                tensor = fh.get_tensor(name)
                module = name[: -len(".weight")] if name.endswith(".weight") else None
                if module is not None and _TARGET.match(module) and tensor.dim() == 2 and tensor.is_floating_point():
                    q, scales = quantize_int8(tensor)
                    tensors[name], tensors[module + ".weight_scale"] = q, scales[:, None].contiguous()
                    quantized += 1
                else:
                    tensors[name] = tensor
                    kept += 1
        save_file(tensors, str(out / path.name), metadata={"format": "pt"})
        weight_map.update({name: path.name for name in tensors})
        del tensors
    if quantized == 0:
        shutil.rmtree(out)
        raise ConfigError(f"{model_dir}: no decoder projection matched {TARGET}; nothing to quantize.")
    config = json.loads((model_dir / "config.json").read_text())
    quant = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme("W8A8", [TARGET])},
                               format="int-quantized", ignore=["lm_head"],
                               quantization_status=QuantizationStatus.COMPRESSED)
    config["quantization_config"] = json.loads(quant.model_dump_json())
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if len(files) > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map},
                                                                     indent=2))
    for other in model_dir.iterdir():
        if other.is_file() and other.suffix != ".safetensors" and other.name not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy2(other, out / other.name)
    return {"quantized_linears": quantized, "other_tensors": kept, "files": len(files)}
