"""CPU decode attention: our slot-by-slot kernel against torch's attention, on the arena's layout.

    python -m flashx_batch.bench.cpu_decode --out results/cpu_decode [--threads 1,2] [--repeats 5]
        [--end-to-end-rows 24]

One decode step's attention for one layer: `rows` queries (G query heads per KV head) against their
rows' first `slots` cached slots, read through the strided [rows, Hkv, slots, D] views a stripe
decode hands the attention (rows `capacity` slots apart, six layers' worth of arena so that the
cache is not all in the CPU's caches, as in a job). Both paths see the same tensors, interleaved,
median of `--repeats` paired timings of 50 calls each; the ratio is torch's time ÷ the kernel's.
Then end to end: the bundled model generating for `--end-to-end-rows` held-out prompts of 512 tokens
(64 greedy tokens each, EOS ignored, float32, 2 threads), static and segment-sparse, with the kernel
and with torch's attention in its place (the same engine, `cpu_decode.usable` answering no), paired
repeats; decode seconds of each and whether the tokens are identical row for row.
Writes OUT/cpu_decode.json. The shapes: the bundled model (4 KV heads x 32), the 134 M Llama of
the peers benchmark (12 x 64), a GQA model with head_dim 128, each at a batch of rows and at one
long row.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from flashx_batch.backends import cpu_decode

log = logging.getLogger("flashx_batch.bench.cpu_decode")

# (rows, slots, kv heads, query heads per kv head, head dim)
SHAPES = ((8, 540, 4, 2, 32), (12, 340, 4, 2, 32), (24, 300, 4, 2, 32), (1, 2000, 4, 2, 32),
          (8, 540, 12, 1, 64), (1, 2000, 12, 1, 64), (4, 1000, 8, 4, 128))
LAYERS = 6
CALLS = 50


def measure(rows: int, slots: int, heads: int, group: int, dim: int, dtype: torch.dtype, repeats: int) -> dict:
    capacity = slots + 32  # a stripe holds the row's next tokens too
    store = torch.randn(LAYERS, 2, rows, capacity, heads, dim).to(dtype)
    views = [(store[i, 0, :, :slots].transpose(1, 2), store[i, 1, :, :slots].transpose(1, 2)) for i in range(LAYERS)]
    q = torch.randn(rows, heads, group, dim).to(dtype)
    scale = dim ** -0.5
    if not cpu_decode.usable(*views[0]):
        return {"kernel": False}

    def torch_path(k, v):
        return F.scaled_dot_product_attention(q, k, v, scale=scale)

    def kernel(k, v):
        return cpu_decode.attend(q, k, v, None, scale)

    error = (kernel(*views[0]).float() - torch_path(*views[0]).float()).abs().max().item()
    times: dict[str, list[float]] = {"torch": [], "kernel": []}
    for turn in range(repeats + 1):  # the first round warms both up and is dropped
        for name, fn in ((("torch", torch_path), ("kernel", kernel)) if turn % 2 else
                         (("kernel", kernel), ("torch", torch_path))):
            started = time.perf_counter()
            for i in range(CALLS):
                fn(*views[i % LAYERS])
            if turn:
                times[name].append((time.perf_counter() - started) / CALLS)
    pairs = [t / k for t, k in zip(times["torch"], times["kernel"])]
    return {"kernel": True, "torch_us": statistics.median(times["torch"]) * 1e6,
            "kernel_us": statistics.median(times["kernel"]) * 1e6, "ratio": statistics.median(pairs),
            "ratio_min": min(pairs), "ratio_max": max(pairs), "max_abs_error": error}


def end_to_end(rows: int, repeats: int) -> list[dict]:
    """Decode seconds with the kernel and with torch's attention, same engine, interleaved."""
    from flashx_batch import Engine, SamplingParams
    from flashx_batch.quality.heldout import token_windows
    from flashx_batch.runtime.options import bundled_model_dir

    torch.set_num_threads(2)
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    real = cpu_decode.usable
    results = []
    for policy in ("static", "segment_sparse"):
        engine = Engine.from_pretrained(bundled_model_dir(), backend="cpu", dtype="float32", cache_policy=policy,
                                        max_batch_size=8, max_input_len=512, max_output_len=64, num_threads=2)
        prompts = token_windows(engine.tokenizer, 512, rows)
        decode: dict[str, list[float]] = {"torch": [], "kernel": []}
        tokens: dict[str, list] = {}
        try:
            for turn in range(repeats + 1):  # the first round warms up and is dropped
                for name in (("torch", "kernel") if turn % 2 else ("kernel", "torch")):
                    cpu_decode.usable = real if name == "kernel" else (lambda keys, values: False)
                    tokens[name] = [o.token_ids for o in engine.generate(prompts, params)]
                    if turn:
                        decode[name].append(engine.last_stats.decode_s)
        finally:
            cpu_decode.usable = real
        pairs = [t / k for t, k in zip(decode["torch"], decode["kernel"])]
        same = sum(a == b for a, b in zip(tokens["torch"], tokens["kernel"]))
        row = {"policy": policy, "rows": len(prompts), "decode_s_torch": statistics.median(decode["torch"]),
               "decode_s_kernel": statistics.median(decode["kernel"]), "decode_ratio": statistics.median(pairs),
               "decode_ratio_min": min(pairs), "decode_ratio_max": max(pairs),
               "rows_identical": f"{same}/{len(prompts)}"}
        log.info("%s", row)
        results.append(row)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--end-to-end-rows", type=int, default=24, help="0: the microbenchmark only")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    cpu_decode.warm_up()
    results = []
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for dtype in (torch.float32, torch.bfloat16):
            for rows, slots, heads, group, dim in SHAPES:
                row = {"threads": threads, "dtype": str(dtype).removeprefix("torch."), "rows": rows, "slots": slots,
                       "kv_heads": heads, "group": group, "head_dim": dim,
                       **measure(rows, slots, heads, group, dim, dtype, args.repeats)}
                log.info("%s", row)
                results.append(row)
    engine_runs = end_to_end(args.end_to_end_rows, 3) if args.end_to_end_rows else []
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "cpu_decode.json"
    command = "python -m flashx_batch.bench.cpu_decode " + " ".join(sys.argv[1:] if argv is None else argv)
    path.write_text(json.dumps({"command": command, "date": datetime.date.today().isoformat(),
                                "torch": torch.__version__, "results": results,
                                "end_to_end": engine_runs}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
