"""Where a segment-sparse prefill's time goes, next to a static prefill of the same prompts.

    python jobs/experiments/kv_prefill_parts.py --out DIR [--backend cuda] [--dtype bfloat16] [--static-rows 8]
        [--rows 24] [--prompt-len 512] [--repeats 3]

Both engines get the arena of `--static-rows` full rows (as `python -m flashx_batch.bench.kv_sparse`);
the workload is `--rows` held-out prompts and one new token, so the timed work is the prefill. The parts
of segment_sparse's compressed prefill are timed by wrapping the runner's calls (with a device
synchronize before each clock read, so a part's time is its own work): the packed prefill passes, the
surprisal probe rounds (final layer + LM head for the asked-for tokens), the plans (host), the merges.
Writes DIR/kv_prefill_parts.json: per engine the median prefill seconds, the packs it ran, and
segment_sparse's parts (median over repeats, seconds per job) with what is left over ("other": the
scheduler, the packs' staging arithmetic, the rest of `generate`). The ratio comes from runs without the
parts' clocks; the parts from a run with them (on a GPU, each clock read waits for the device).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from flashx_batch import Engine, SamplingParams
from flashx_batch.quality.heldout import token_windows
from flashx_batch.runtime import compressed_prefill, kv_merge, torch_runner
from flashx_batch.runtime.options import bundled_model_dir

PARTS = {  # part name -> the (owner, attribute)s wrapped while timing
    "packed prefill": [(torch_runner.TorchRunner, "prefill_packed_at")],
    "surprisal probe": [(torch_runner.SurprisalProbe, "tokens")],
    "plans": [(compressed_prefill, "plan_groups")],
    "protection search": [(kv_merge.ProtectionSearch, a) for a in ("__init__", "wanted", "feed", "plan")],
    "merges": [(compressed_prefill, "apply_plans")],
}


def timed_parts(sync) -> tuple[dict[str, float], dict[str, int], list]:
    """Wrap each part's callables: seconds and calls accumulate per part (a call made inside a timed
    call is not timed again); returns the undo list."""
    seconds: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    depth = [0]
    undo = []
    for name, targets in PARTS.items():
        for owner, attr in targets:
            original = getattr(owner, attr)

            def wrapper(*args, _original=original, _name=name, **kwargs):
                if depth[0]:
                    return _original(*args, **kwargs)
                sync()
                start = time.perf_counter()
                depth[0] += 1
                try:
                    return _original(*args, **kwargs)
                finally:
                    depth[0] -= 1
                    sync()
                    seconds[_name] += time.perf_counter() - start
                    calls[_name] += 1

            setattr(owner, attr, wrapper)
            undo.append((owner, attr, original))
    return seconds, calls, undo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--backend", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--static-rows", type=int, default=8)
    parser.add_argument("--rows", type=int, default=24)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    common = dict(backend=args.backend, dtype=args.dtype, max_batch_size=args.static_rows,
                  max_input_len=args.prompt_len, max_output_len=64, segment_size=16)
    engines = {"static": Engine.from_pretrained(bundled_model_dir(), **common),
               "segment_sparse": Engine.from_pretrained(bundled_model_dir(), cache_policy="segment_sparse", **common)}
    device = engines["static"].runner.device
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    prompts = token_windows(engines["static"].tokenizer, args.prompt_len, args.rows)
    one = SamplingParams(max_new_tokens=1, ignore_eos=True)
    for engine in engines.values():  # warm-up at the timed shapes
        engine.generate(prompts, one)
    prefill: dict[str, list[float]] = {name: [] for name in engines}
    parts: dict[str, list[float]] = defaultdict(list)
    timed: list[float] = []  # segment_sparse's prefill with the parts' clocks (and syncs) in it
    calls: dict[str, int] = {}
    for _ in range(args.repeats):
        for name, engine in engines.items():  # the ratio: both without the parts' clocks
            engine.generate(prompts, one)
            prefill[name].append(engine.last_stats.prefill_s)
        seconds, counted, undo = timed_parts(sync)
        try:
            engines["segment_sparse"].generate(prompts, one)
        finally:
            for owner, attr, original in undo:
                setattr(owner, attr, original)
        timed.append(engines["segment_sparse"].last_stats.prefill_s)
        for name in PARTS:
            parts[name].append(seconds[name])
        calls = dict(counted)
        parts["other"].append(timed[-1] - sum(seconds.values()))
    result = {
        "backend": args.backend, "dtype": args.dtype, "device": str(device), "rows": len(prompts),
        "prompt_len": args.prompt_len, "static_rows": args.static_rows,
        "admitted_batch_size": {n: e.admitted_batch_size for n, e in engines.items()},
        "prefill_s": {n: statistics.median(v) for n, v in prefill.items()},
        "segment_sparse_timed_prefill_s": statistics.median(timed),
        "segment_sparse_parts_s": {n: statistics.median(v) for n, v in parts.items()},
        "segment_sparse_calls": calls,
        "ratio_prefill_sparse_over_static": statistics.median(prefill["segment_sparse"])
        / statistics.median(prefill["static"]),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kv_prefill_parts.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("prefill_s", "segment_sparse_parts_s", "segment_sparse_calls",
                                             "ratio_prefill_sparse_over_static")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
