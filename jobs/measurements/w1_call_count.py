"""Count the Python calls of one W1 run (the benchmark's mixed intake, bundled model, 1 thread, batch 8) under
cProfile, after an untimed run: a deterministic measure of the host work a change adds per step, where
wall-clock comparisons on a shared machine cannot resolve a few per cent.
`PYTHONPATH=<checkout> python jobs/measurements/w1_call_count.py` on each checkout.
"""

from __future__ import annotations

import cProfile
import json
import pstats

import torch


def main() -> None:
    torch.set_num_threads(1)
    from flashx_batch import Engine, SamplingParams
    from flashx_batch.bench.workloads import FULL, mixed_intake
    from flashx_batch.runtime.options import bundled_model_dir

    model = bundled_model_dir()
    w1 = mixed_intake(FULL, json.loads((model / "config.json").read_text())["vocab_size"])
    max_input = -(-max(map(len, w1.prompts)) // 16) * 16
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in w1.max_new_tokens]
    engine = Engine.from_pretrained(model, backend="cpu", dtype="float32", max_batch_size=8, max_input_len=max_input,
                                    max_output_len=max(w1.max_new_tokens), segment_size=16, num_threads=1,
                                    sort_by_length=True)
    engine.generate(w1.prompts, params)  # untimed: kernels compiled, caches warm
    profile = cProfile.Profile()
    profile.enable()
    engine.generate(w1.prompts, params)
    profile.disable()
    stats = pstats.Stats(profile)
    print(json.dumps({"calls": stats.total_calls, "primitive_calls": stats.prim_calls}))


if __name__ == "__main__":
    main()
