"""The exported decoder on disk and its two ONNX Runtime sessions (prefill, decode).

`ensure_export` exports a model directory once into a cache folder keyed by the export fingerprint
(several Ray actors may start on one host at once: each exports beside the target and renames);
`OnnxSessions` opens the graphs with the backend's providers. Numpy in, numpy out: the runner that
drives them is `runtime.onnx_runner.OnnxRunner`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from flashx_batch.models.loader import load_model
from flashx_batch.onnx.export import export_decoder, export_fingerprint

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """Where exports are kept between runs (`FLASHX_ONNX_CACHE` overrides)."""
    if os.environ.get("FLASHX_ONNX_CACHE"):
        return Path(os.environ["FLASHX_ONNX_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flashx-batch" / "onnx"


def ensure_export(model_dir: Path, row_capacity: int, cache_dir: Path | None = None) -> Path:
    """The export folder of `model_dir` (float32, RoPE tables for `row_capacity` positions), exporting
    it first if the cache does not hold it."""
    dtype = torch.float32
    key = export_fingerprint(model_dir, dtype, row_capacity)
    out = (cache_dir or default_cache_dir()) / f"{model_dir.name}-{key}"
    if (out / "export.json").is_file():
        return out
    started = time.perf_counter()
    model = load_model(model_dir, dtype, torch.device("cpu"), row_capacity)
    staging = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    export_decoder(model, staging)
    try:
        staging.rename(out)
    except OSError:  # another process finished first: its export is the same graph
        shutil.rmtree(staging, ignore_errors=True)
    log.info("exported %s to ONNX in %.1fs", model_dir.name, time.perf_counter() - started)
    return out


def read_export_info(export_dir: Path) -> dict:
    """The `export.json` written next to the graphs (opset, torch version, shapes)."""
    return json.loads((Path(export_dir) / "export.json").read_text())


class OnnxSessions:
    """The two `InferenceSession`s and their calls; numpy in, numpy out."""

    def __init__(self, export_dir: Path, providers: list[str], num_threads: int | None) -> None:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        if num_threads:
            opts.intra_op_num_threads = num_threads
            opts.inter_op_num_threads = 1
        self.prefill_session = ort.InferenceSession(str(export_dir / "prefill.onnx"), opts, providers=providers)
        self.decode_session = ort.InferenceSession(str(export_dir / "decode.onnx"), opts, providers=providers)
        self.providers = self.prefill_session.get_providers()

    def prefill(self, ids: np.ndarray, last_index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        logits, present = self.prefill_session.run(None, {"input_ids": ids, "last_index": last_index})
        return logits, present

    def decode(self, ids: np.ndarray, positions: np.ndarray, bias: np.ndarray,
               past: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        feeds = {"input_ids": ids, "position_ids": positions, "attn_bias": bias, "past": past}
        logits, present = self.decode_session.run(None, feeds)
        return logits, present
