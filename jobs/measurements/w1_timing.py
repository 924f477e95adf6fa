"""Time the W1 benchmark workload (mixed intake) on one checkout, for old-vs-new comparisons.

Builds the benchmark harness's W1 (full sizes, seed 0) and its `ours_bucketed` and `ours_unbucketed`
engines (bundled model, 1 thread, batch 8) through the public API only, so the same script runs on
any checkout: `PYTHONPATH=<checkout> python jobs/measurements/w1_timing.py`. One untimed run, then `--repeats`
timed runs of each; prints one JSON line (wall seconds per run, output tok/s, a digest of the tokens).
Alternate processes of two checkouts and compare medians: the machine drifts between processes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from flashx_batch import Engine, SamplingParams
    from flashx_batch.bench.workloads import FULL, mixed_intake
    from flashx_batch.runtime.options import bundled_model_dir

    model = bundled_model_dir()
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    w1 = mixed_intake(FULL, vocab)
    max_input = -(-max(map(len, w1.prompts)) // 16) * 16
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in w1.max_new_tokens]
    result = {}
    for name, sort in (("ours_bucketed", True), ("ours_unbucketed", False)):
        engine = Engine.from_pretrained(model, backend="cpu", dtype="float32", max_batch_size=8,
                                        max_input_len=max_input, max_output_len=max(w1.max_new_tokens),
                                        segment_size=16, num_threads=1, sort_by_length=sort)
        outs = engine.generate(w1.prompts, params)  # untimed
        digest = hashlib.sha256(json.dumps([o.token_ids for o in outs]).encode()).hexdigest()[:16]
        walls = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            engine.generate(w1.prompts, params)
            walls.append(time.perf_counter() - started)
        result[name] = {"wall_s": walls, "median_s": statistics.median(walls),
                        "output_tok_per_s": w1.output_tokens / statistics.median(walls), "tokens_sha": digest}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
