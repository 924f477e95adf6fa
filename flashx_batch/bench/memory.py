"""Peak host memory of one variant on W1, each side in a fresh process of its own.

Called by the harness after a model's timed runs (`measure`), which starts this module once per
variant (`python -m flashx_batch.bench.memory ...`). Why a process each: in one process the two sides'
weights are both resident, and memory one side freed stays in the allocator's cache for the next one
(no page faults, no RSS growth), so a delta measured in-process depends on who ran first. A fresh
process sees only its own side.

The child imports the same libraries whichever side it runs (torch, transformers, our engine), reads
its RSS (the baseline), loads the model (transformers `from_pretrained` in float32, or our `Engine`
with the harness's options: weights plus its KV arena), resets the kernel's high-water mark
(`/proc/self/clear_refs`), runs W1 once as the harness times it, and reads the high-water mark
(`VmHWM`): the run's peak RSS. Figures in MiB:

- `run_peak_rss_mib`: peak RSS during the W1 run (weights resident, working set, caches);
- `run_peak_over_baseline_mib`: the same minus the after-import baseline, what the model and the run
  cost on top of the libraries;
- `process_peak_rss_mib`: the process's peak over its whole life (loading included);
- `baseline_rss_mib`, `loaded_rss_mib`: after the imports, after the load.

Linux only (`/proc/self/status`); elsewhere `measure` records why nothing was measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kib(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", STATUS.read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"{STATUS} has no {field}")
    return int(match.group(1))


def rss_mib() -> float:
    return _status_kib("VmRSS") / 1024


def peak_rss_mib() -> float:
    """The process's RSS high-water mark since it started or since `reset_peak`."""
    return _status_kib("VmHWM") / 1024


def reset_peak() -> bool:
    """Reset the RSS high-water mark to the current RSS (Linux >= 4.0); False where not allowed."""
    try:
        CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


def measure_side(model_dir: Path, variant: str, quick: bool, batch_size: int, max_input_len: int,
                 max_output_len: int, threads: int, seed: int) -> dict:
    """In this (fresh) process: load `variant`'s side of `model_dir`, run W1 once, return the figures."""
    import torch
    from transformers import AutoModelForCausalLM

    from flashx_batch.bench.variants import build_variants
    from flashx_batch.bench.workloads import FULL, QUICK, build_all

    torch.set_num_threads(threads)
    cfg = json.loads((model_dir / "config.json").read_text())
    workload = build_all(QUICK if quick else FULL, cfg["vocab_size"], seed)["W1"]
    gc.collect()
    baseline = rss_mib()
    hf = (AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
          if variant.startswith("transformers") else None)
    pad_id = cfg.get("pad_token_id") if cfg.get("pad_token_id") is not None else 0
    runner = build_variants(model_dir, hf, batch_size, max_input_len, max_output_len, threads, pad_id,
                            include=(variant,)).by_name()[variant]
    gc.collect()
    loaded, process_peak_at_load = rss_mib(), peak_rss_mib()
    reset = reset_peak()
    started = time.perf_counter()
    result = runner.run(workload)
    wall = time.perf_counter() - started
    run_peak = peak_rss_mib()
    out = {"variant": variant, "baseline_rss_mib": baseline, "loaded_rss_mib": loaded,
           "process_peak_rss_mib": max(run_peak, process_peak_at_load), "run_s": wall,
           "output_tokens": result.output_tokens, "threads": threads}
    if reset:
        out.update(run_peak_rss_mib=run_peak, run_peak_over_baseline_mib=run_peak - baseline)
    else:  # the high-water mark still holds the load's peak: the run's own peak is unknown
        out["note"] = "could not reset the RSS high-water mark: only the process peak is known"
    return out


def measure(model_dir: Path, variants: tuple[str, ...], quick: bool, batch_size: int, max_input_len: int,
            max_output_len: int, threads: int, seed: int, timeout_s: float = 1800.0) -> dict[str, dict]:
    """Each variant's figures from a fresh child process, one after another; a child that fails is
    recorded as {"error": ...} and the others still run."""
    if not STATUS.is_file():
        return {v: {"error": f"not measured: {STATUS} does not exist on this platform"} for v in variants}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    out = {}
    for variant in variants:
        cmd = [sys.executable, "-m", "flashx_batch.bench.memory", "--model", str(model_dir), "--variant", variant,
               "--batch-size", str(batch_size), "--max-input-len", str(max_input_len),
               "--max-output-len", str(max_output_len), "--threads", str(threads), "--seed", str(seed)]
        if quick:
            cmd.append("--quick")
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            out[variant] = {"error": f"timed out after {timeout_s:.0f}s"}
            continue
        lines = done.stdout.strip().splitlines()
        if done.returncode != 0 or not lines:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            out[variant] = {"error": f"exit status {done.returncode}: {' | '.join(tail)}"}
            continue
        out[variant] = json.loads(lines[-1])
        log.info("  peak RSS %s: %.0f MiB during W1 (%.0f over the %.0f MiB baseline)", variant,
                 out[variant].get("run_peak_rss_mib", float("nan")),
                 out[variant].get("run_peak_over_baseline_mib", float("nan")), out[variant]["baseline_rss_mib"])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashx_batch.bench.memory", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--variant", required=True, help="a harness variant name, e.g. ours_bucketed")
    parser.add_argument("--quick", action="store_true", help="the quick W1")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-input-len", type=int, required=True)
    parser.add_argument("--max-output-len", type=int, required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    figures = measure_side(args.model, args.variant, args.quick, args.batch_size, args.max_input_len,
                           args.max_output_len, args.threads, args.seed)
    print(json.dumps(figures))  # the last stdout line is the parent's answer
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
