"""Side by side in one process: an all-int8 model's decode step fused (`quant.int8_decode`) and layer by layer.

    python jobs/experiments/fused_int8_decode_ab.py --out docs/results/fused_int8_decode [--shape llama-27m]
        [--threads 1] [--repeats 5] [--rows 1,8,16]

int8_dynamic on every linear layer (`bench.int8_cpu.quantize_all`), float32 activations, greedy, EOS
ignored. Two measurements, each alternating which path goes first per repeat:
- the decode step alone: `--rows` rows of 192-token prompts, (time for 49 new tokens - time for 1) / 48;
- the benchmark workloads (`bench.workloads` FULL: W1, W2, W3 with prefix reuse and prefixes no earlier
  run has seen) end to end.
Prints and writes OUT/fused_int8_decode.json: median seconds of each path, the median of the paired
ratios (layer by layer ÷ fused: above 1, fused is faster), and how many rows' greedy tokens differ between
the paths (none should: the fused step computes the modules' bits; not counted for W3, whose runs each
draw their own prefixes).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from flashx_batch import Engine, SamplingParams
from flashx_batch.bench.int8_cpu import quantize_all
from flashx_batch.bench.peers import SHAPES
from flashx_batch.bench.variants import prefix_reuse_options
from flashx_batch.bench.workloads import FULL, equal_lengths, few_shot, mixed_intake
from flashx_batch.runtime.options import bundled_model_dir


def _paired(run, repeats: int, same_inputs: bool = True) -> dict:
    """run(fused) -> (seconds, tokens), `repeats` pairs after a warm-up pair, order alternating."""
    seconds: dict[bool, list[float]] = {True: [], False: []}
    tokens = {}
    for r in range(-1, repeats):
        for fused in ((True, False) if r % 2 else (False, True)):
            took, tokens[fused] = run(fused)
            if r >= 0:
                seconds[fused].append(took)
    pairs = [off / on for off, on in zip(seconds[False], seconds[True], strict=True)]
    return {"fused_s": statistics.median(seconds[True]), "layer_by_layer_s": statistics.median(seconds[False]),
            "ratio": statistics.median(pairs), "pairs": pairs,
            "rows_with_other_tokens": sum(a != b for a, b in zip(tokens[True], tokens[False], strict=True))
            if same_inputs else None,
            "rows": len(tokens[True])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", choices=sorted(SHAPES), help="a random model of this shape, not the bundled one")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rows", default="1,8,16")  # 16: one batch (the KV budget holds 19 such rows)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="fused-int8-"))
    model_dir = bundled_model_dir() if args.shape is None else SHAPES[args.shape][0](work / args.shape)
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    common = dict(backend="cpu", dtype="float32", max_batch_size=8, max_input_len=512, max_output_len=96,
                  num_threads=args.threads)
    reuse = prefix_reuse_options(512) or {}
    # one engine per (prefix sharing, fused step): the switch is a constructor option, never flipped on a live runner
    engines = {(sharing, fused): Engine.from_pretrained(model_dir, **common, **(reuse if sharing else {}),
                                                        fused_int8_decode=fused)
               for sharing in (False, True) for fused in (False, True)}
    for engine in engines.values():
        quantize_all(engine)
    result: dict = {"model": args.shape or "bundled", "threads": args.threads, "repeats": args.repeats, "step": {},
                    "workloads": {}}

    rng = random.Random(0)
    for rows in map(int, args.rows.split(",")):
        prompts = [[rng.randrange(3, vocab) for _ in range(192)] for _ in range(rows)]

        def step(fused: bool, prompts=prompts) -> tuple[float, list]:
            engine = engines[(False, fused)]
            took = {}
            for n in (1, 49):
                start = time.perf_counter()
                out = engine.generate(prompts, SamplingParams(max_new_tokens=n, ignore_eos=True))
                took[n] = time.perf_counter() - start
            return (took[49] - took[1]) / 48, [o.token_ids for o in out]

        result["step"][rows] = _paired(step, args.repeats)
        print(f"step of {rows} rows: {result['step'][rows]}", flush=True)

    workloads = {"W1": mixed_intake(FULL, vocab, 0), "W2": equal_lengths(FULL, vocab, 0),
                 "W3": few_shot(FULL, vocab, 0)}
    for name, w in workloads.items():
        params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in w.max_new_tokens]
        fresh = iter(range(1000))

        def whole(fused: bool, w=w, params=params, name=name, fresh=fresh) -> tuple[float, list]:
            engine = engines[(name == "W3", fused)]
            # W3: prefixes no run has seen (a cached prefix would favour whichever path goes second)
            run = w.with_fresh_prefixes(next(fresh)) if name == "W3" else w
            start = time.perf_counter()
            out = engine.generate(run.prompts, params)
            return time.perf_counter() - start, [o.token_ids for o in out]

        result["workloads"][name] = _paired(whole, args.repeats, same_inputs=name != "W3")
        print(f"{name}: {result['workloads'][name]}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fused_int8_decode.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
