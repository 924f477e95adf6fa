"""The precision map: a versioned JSON file that says which format every weight runs in, and why.

Written by `python -m flashx_batch.quantize`; read by the engine (`runtime.precision_map=PATH`)
through `load_precision_map` + `apply_precision_map`. The map holds formats, not quantized weights:
quantization is deterministic round-to-nearest, so the engine re-quantizes the float checkpoint at
load (seconds) and gets exactly the tensors that were measured.

Layout (version 1):
    format, version, created, tool
    model      path, weights_sha256 (of the safetensors files), architecture, num_layers, hidden_size,
               intermediate_size, vocab_size, q_size, kv_size, dtype (the float dtype planned and
               measured in), tied_lm_head
    protocol   calibration / validation (source, windows, tokens per window, tokens), formats tried,
               group_size, sensitivity method, search, bootstrap, budget
    tensors    one entry per unit: unit, tensor (the fused weight it lives in), rows [start, stop),
               shape, format, group_size, kernel (on the planning device), bytes, sensitivity
               (format -> {delta_nll, kl, top1})
    kept       every other weight (embedding, norms, biases) with its format and bytes
    result     the validated map: delta_ppl + ci95 (bootstrap), delta_nll, mean_kl, top1, bytes,
               average bits, budget, passed, upgrades
    references the same figures for all-int8 (and all-int4) and the unquantized model's bytes
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from flashx_batch.errors import ConfigError
from flashx_batch.models.decoder import DecoderModel
from flashx_batch.models.loader import weight_files
from flashx_batch.quant import formats as fm
from flashx_batch.quant.units import FormatSwap, Unit, model_units

log = logging.getLogger(__name__)

MAP_FORMAT = "flashx-batch/precision-map"
MAP_VERSION = 1
_SHAPE_KEYS = ("architecture", "num_layers", "hidden_size", "intermediate_size", "vocab_size", "q_size", "kv_size")


class PrecisionMapError(ConfigError):
    """A precision map that cannot be used: unreadable, wrong version, or for a different model."""


def weights_sha256(model_dir: Path) -> str:
    """sha256 over the checkpoint's safetensors files in order (streamed; ~1-2 GB/s)."""
    digest = hashlib.sha256()
    for path in weight_files(Path(model_dir)):
        with path.open("rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def model_identity(model: DecoderModel, model_dir: Path, sha256: str | None = None) -> dict:
    """The `model` block of a map: shapes from the loaded model, hash from the checkpoint files."""
    cfg = model.config
    return {
        "path": str(model_dir), "weights_sha256": sha256 or weights_sha256(model_dir),
        "architecture": cfg.architecture, "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size, "q_size": cfg.q_size,
        "kv_size": cfg.kv_size, "dtype": fm.format_of_dtype(model.embed.dtype),
        "tied_lm_head": model.lm_head.weight is model.embed,
    }


@dataclass
class PrecisionMap:
    """The parsed file; `data` is the JSON object as written (see the module docstring)."""

    data: dict
    path: Path | None = None

    @property
    def assignment(self) -> dict[str, str]:
        return {t["unit"]: t["format"] for t in self.data["tensors"]}

    @property
    def group_size(self) -> int:
        return int(self.data["protocol"]["group_size"])

    def save(self, path: Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1) + "\n")
        tmp.replace(path)
        self.path = path

    def check_matches(self, model: DecoderModel, model_dir: Path | None, check_hash: bool = True) -> None:
        """Raise `PrecisionMapError` naming the difference unless this map was planned for `model`."""
        where = f"precision map {self.path or ''}".strip()
        planned = self.data["model"]
        current = model_identity(model, model_dir or Path("."), sha256="-")
        diffs = [f"{k}: map {planned.get(k)!r}, model {current[k]!r}" for k in _SHAPE_KEYS
                 if planned.get(k) != current[k]]
        if diffs:
            raise PrecisionMapError(f"{where} was planned for a different model ({planned.get('path')}): "
                                    + "; ".join(diffs) + ". Re-run `python -m flashx_batch.quantize` for this model.")
        units = {u.name: u for u in model_units(model)}
        listed = {t["unit"] for t in self.data["tensors"]}
        if listed != set(units):
            missing, extra = sorted(set(units) - listed), sorted(listed - set(units))
            raise PrecisionMapError(f"{where} does not list every unit of the model: missing {missing[:4]}, "
                                    f"unknown {extra[:4]}.")
        for t in self.data["tensors"]:
            unit = units[t["unit"]]
            if list(t["rows"]) != [unit.start, unit.stop] or t["tensor"] != unit.tensor:
                raise PrecisionMapError(f"{where}: {t['unit']} is rows {t['rows']} of {t['tensor']} in the map but "
                                        f"rows {[unit.start, unit.stop]} of {unit.tensor} in the model.")
            if t["format"] not in fm.FORMATS:
                raise PrecisionMapError(f"{where}: {t['unit']} has unknown format {t['format']!r}; "
                                        f"known: {', '.join(fm.FORMATS)}.")
        if check_hash and model_dir is not None:
            sha = weights_sha256(model_dir)
            if sha != planned.get("weights_sha256"):
                raise PrecisionMapError(
                    f"{where} was planned for weights with sha256 {str(planned.get('weights_sha256'))[:12]}…, but "
                    f"{model_dir} has {sha[:12]}… (same shapes, different weights: a fine-tune or another "
                    "checkpoint). Its sensitivities do not apply; re-run `python -m flashx_batch.quantize`.")


def load_precision_map(path: str | Path) -> PrecisionMap:
    """Read and structurally check a map file; model matching happens in `apply_precision_map`."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise PrecisionMapError(f"runtime.precision_map={path}: no such file.") from exc
    except json.JSONDecodeError as exc:
        raise PrecisionMapError(f"runtime.precision_map={path}: not valid JSON ({exc}).") from exc
    if not isinstance(data, dict) or data.get("format") != MAP_FORMAT:
        raise PrecisionMapError(f"{path} is not a flashx-batch precision map (no \"format\": \"{MAP_FORMAT}\").")
    if data.get("version") != MAP_VERSION:
        raise PrecisionMapError(f"{path}: precision map version {data.get('version')} is not supported "
                                f"(this build reads version {MAP_VERSION}); re-run the quantize step.")
    for key in ("model", "protocol", "tensors"):
        if key not in data:
            raise PrecisionMapError(f"{path}: precision map lacks its {key!r} block.")
    return PrecisionMap(data, path)


def apply_precision_map(model: DecoderModel, pmap: PrecisionMap, model_dir: Path | None = None,
                        check_hash: bool = True) -> dict:
    """Swap `model`'s Linear modules for the map's formats, in place; refuse a map for another model.

    Called by the engine right after `load_model` (and by the speed benchmark). Pass `model_dir` so the
    weight hash can be checked; `check_hash=False` skips reading the files again (tests). Returns a
    summary: units per format, kernels used, resident weight bytes."""
    pmap.check_matches(model, model_dir, check_hash=check_hash)
    planned, native = pmap.data["model"]["dtype"], fm.format_of_dtype(model.embed.dtype)
    assignment = pmap.assignment
    if planned != native:
        # "unquantized" in the map means the model's own precision, whichever dtype the engine runs
        assignment = {unit: native if fmt == planned else fmt for unit, fmt in assignment.items()}
        log.warning("precision map was measured in %s; this engine runs %s, so its quality figures are "
                    "approximate here (its %s units run in %s)", planned, native, planned, native)
    swap = FormatSwap(model, assignment, pmap.group_size)
    swap.originals.clear()  # permanent: drop the float modules so their memory is freed
    summary = loaded_summary(model)
    planned_kernels = {t.get("kernel") for t in pmap.data["tensors"] if t["format"] == "int8"}
    if "int8_dynamic" in summary["kernels"] and planned_kernels and "int8_dynamic" not in planned_kernels:
        log.warning("precision map %s was measured with weight-only int8 (kernel %s); this engine runs int8 with "
                    "int8 activations (int8_dynamic), a second rounding its quality figures do not include: "
                    "plan the map again (python -m flashx_batch.quantize) for figures that match",
                    pmap.path or "", ", ".join(sorted(k for k in planned_kernels if k)))
    log.info("precision map %s applied: %s; kernels %s; weights %.2f MiB", pmap.path or "", summary["formats"],
             summary["kernels"], summary["weight_bytes"] / 2**20)
    return summary


def loaded_summary(model: DecoderModel) -> dict:
    """Units per format, modules per kernel and resident weight bytes of a (possibly quantized) model."""
    formats: dict[str, int] = {}
    kernels: dict[str, int] = {}
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        for tensor in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
            if id(tensor) not in seen:
                seen.add(id(tensor))
                total += tensor.numel() * tensor.element_size()
        kernel = getattr(module, "kernel", None)
        if kernel is not None:
            kernels[kernel] = kernels.get(kernel, 0) + 1
    native = fm.format_of_dtype(model.embed.dtype)
    for unit in model_units(model):
        fmt = _unit_format(model, unit, native)
        formats[fmt] = formats.get(fmt, 0) + 1
    return {"formats": formats, "kernels": kernels, "weight_bytes": total}


def _unit_format(model: DecoderModel, unit: Unit, native: str) -> str:
    module, row = model.get_submodule(unit.module), unit.start
    if unit.stack:  # a `SparseMoE`'s stacked weight: its quantized replacement's format, if any
        return module.quantized[unit.stack].fmt if unit.stack in module.quantized else native
    if hasattr(module, "parts"):
        start = 0
        for part in module.parts:
            if start <= row < start + part.out_features:
                return part.fmt
            start += part.out_features
    return getattr(module, "fmt", native)

