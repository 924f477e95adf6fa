"""Segment-sparse decode with and without the stripe mask, side by side in one process.

    python jobs/experiments/kv_decode_mask_ab.py --out DIR [--dtype bfloat16] [--rows 12] [--repeats 25]

Evict-only plans (both presets) leave no merge bias, so aligned rows step with no mask
(`KVArena.has_merge_bias` False). The masked variant sets the flag by hand, as a merge would, so every
step builds the bias mask and the decode kernel reads it. Workload as `python -m
flashx_batch.bench.kv_sparse` (held-out 512-token prompts, 64 new tokens, EOS ignored, the arena of 8
full rows); the two variants alternate on one engine. Writes DIR/kv_decode_mask_ab.json: median decode
seconds per variant, their ratio, and whether the tokens are identical.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from flashx_batch import Engine, SamplingParams
from flashx_batch.quality.heldout import token_windows
from flashx_batch.runtime.options import bundled_model_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rows", type=int, default=12, help="one segment_sparse batch")
    parser.add_argument("--repeats", type=int, default=25)
    args = parser.parse_args(argv)
    engine = Engine.from_pretrained(bundled_model_dir(), backend="cpu", dtype=args.dtype, max_batch_size=8,
                                    max_input_len=512, max_output_len=64, segment_size=16,
                                    cache_policy="segment_sparse")
    arena = engine.runner.arena
    prompts = token_windows(engine.tokenizer, 512, args.rows)
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    engine.generate(prompts, params)  # warm-up
    if arena.has_merge_bias:
        raise SystemExit("the default plans merged: this comparison needs evict-only plans")
    decode: dict[str, list[float]] = {"unmasked": [], "masked": []}
    tokens: dict[str, list] = {}
    for _ in range(args.repeats):
        for name in decode:
            arena.has_merge_bias = name == "masked"
            outs = engine.generate(prompts, params)
            decode[name].append(engine.last_stats.decode_s)
            tokens[name] = [o.token_ids for o in outs]
    result = {
        "dtype": args.dtype, "rows": len(prompts), "admitted_batch_size": engine.admitted_batch_size,
        "decode_s": decode, "decode_s_median": {n: statistics.median(v) for n, v in decode.items()},
        "ratio_decode_speed_unmasked": statistics.median(decode["masked"]) / statistics.median(decode["unmasked"]),
        "paired": sorted(m / u for m, u in zip(decode["masked"], decode["unmasked"])),
        "paired_median": statistics.median(m / u for m, u in zip(decode["masked"], decode["unmasked"])),
        "tokens_identical": tokens["unmasked"] == tokens["masked"],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kv_decode_mask_ab.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("decode_s_median", "ratio_decode_speed_unmasked", "paired_median",
                                             "tokens_identical")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
