"""`python -m flashx_batch.quality --out DIR`: KV-compression quality on the held-out split.

1. Sweep `kv_merge_fraction` for segment_sparse (and, at each fraction, evict-only at the same slot
   budget); choose the largest fraction that saves >= 35 % of prompt KV, keeps top-1 >= 0.90 and
   mean KL <= 0.05, and beats evict-only at the same budget on both top-1 and KL (the default in
   EngineOptions is set from this run's result, written down in the README). Every window of the
   held-out split is scored by default: 24 windows read ~0.03 higher top-1 than all 151 at fraction
   0.8, enough to pass a default that fails on the full split.
2. At the chosen fraction, compare segment_sparse with merging alone, evict-only (same groups; and
   as many of the least attended groups as keep as many slots), random groups, merges without the
   log-count bias / score weights / re-rotation, and StreamingLLM (sinks + recent, same budget); then
   sweep `kv_evict_share` (0 = merge only, 1 = evict only) at that fraction.
3. Long input: a prompt of 3 x the budget under rolling_merge versus truncate.
Writes DIR/quality.json and DIR/quality.md.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from flashx_batch import Engine
from flashx_batch.quality.ablations import POLICIES
from flashx_batch.quality.heldout import token_windows
from flashx_batch.quality.kv_quality import long_input_quality, policy_quality
from flashx_batch.runtime.kv_merge import MergeSettings
from flashx_batch.runtime.options import bundled_model_dir

log = logging.getLogger("flashx_batch.quality")
TARGETS = {"max_kv_bytes_ratio": 0.65, "min_top1_agreement": 0.90, "max_mean_kl": 0.05}


def _meets(r: dict) -> bool:
    return (r["kv_bytes_ratio"] <= TARGETS["max_kv_bytes_ratio"]
            and r["top1_agreement"] >= TARGETS["min_top1_agreement"] and r["mean_kl"] <= TARGETS["max_mean_kl"])


def _beats_eviction(r: dict, evict: dict) -> bool:
    return r["top1_agreement"] > evict["top1_agreement"] and r["mean_kl"] < evict["mean_kl"]


def _table(rows: dict[str, dict], title: str) -> str:
    lines = [f"### {title}", "", "| policy | KV bytes ratio | top-1 agreement | mean KL | ΔNLL (nats/token) |",
             "|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['kv_bytes_ratio']:.3f} | {r['top1_agreement']:.4f} | {r['mean_kl']:.4f} | "
                     f"{r['delta_nll']:+.4f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", type=Path, default=None, help="model dir (default: the bundled model)")
    parser.add_argument("--samples", type=int, default=1000,
                        help="held-out windows to score (default: every one the split holds, 151 for 512 + 128)")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--cont-len", type=int, default=128)
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--fractions", default="0.3,0.4,0.5,0.6,0.7,0.8,0.9")
    parser.add_argument("--evict-share", type=float, default=MergeSettings.evict_share,
                        help="segment_sparse's kv_evict_share during the fraction sweep (default: the engine's)")
    parser.add_argument("--evict-shares", default="0,0.5,0.7,0.8,0.9,1",
                        help="kv_evict_share values swept at the chosen fraction")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    long_len = 3 * args.prompt_len
    engine = Engine.from_pretrained(args.model or bundled_model_dir(), backend="cpu", dtype="float32",
                                    max_batch_size=1, max_input_len=long_len + args.cont_len, max_output_len=1,
                                    kv_observe_window=args.window)
    short = token_windows(engine.tokenizer, args.prompt_len + args.cont_len + 1, args.samples)
    log.info("%d held-out windows of %d + %d tokens", len(short), args.prompt_len, args.cont_len)

    fractions = {f"{float(f):.2f}": MergeSettings(fraction=float(f), window=args.window, evict_share=args.evict_share)
                 for f in args.fractions.split(",")}
    both = policy_quality(engine, short, args.prompt_len,
                          {f: (at, ("segment_sparse", "evict_same_ratio")) for f, at in fractions.items()})
    sweep = {f: r["segment_sparse"] for f, r in both.items()}
    evict_sweep = {f: r["evict_same_ratio"] for f, r in both.items()}
    for f in fractions:
        log.info("fraction %s: %s; evict at the same slot budget: %s", f, sweep[f], evict_sweep[f])
    passing = [f for f, r in sweep.items() if _meets(r) and _beats_eviction(r, evict_sweep[f])]
    chosen = max(passing, key=float) if passing else min(
        (f for f, r in sweep.items() if r["kv_bytes_ratio"] <= TARGETS["max_kv_bytes_ratio"]),
        key=lambda f: sweep[f]["mean_kl"])
    settings = MergeSettings(fraction=float(chosen), window=args.window, evict_share=args.evict_share)
    runs = {"policies": (settings, POLICIES)}
    for share in (float(s) for s in args.evict_shares.split(",")):
        runs[f"{share:.2f}"] = (MergeSettings(fraction=float(chosen), window=args.window, evict_share=share),
                                ("segment_sparse",))
    measured = policy_quality(engine, short, args.prompt_len, runs)
    policies = measured.pop("policies")
    shares = {share: r["segment_sparse"] for share, r in measured.items()}
    for share, r in shares.items():
        log.info("evict share %s: %s", share, r)

    long_windows = token_windows(engine.tokenizer, long_len + args.cont_len + 1, max(4, args.samples // 3))
    long_input = long_input_quality(engine, long_windows, long_len, args.prompt_len, settings)

    result = {
        "model": str(args.model or bundled_model_dir()), "targets": TARGETS, "chosen_fraction": float(chosen),
        "chosen_meets_targets": bool(passing), "settings": {"prompt_len": args.prompt_len, "cont_len": args.cont_len,
                                                           "window": args.window, "sinks": settings.sinks,
                                                           "evict_share": args.evict_share,
                                                           "samples": len(short)},
        "policies": policies, "fraction_sweep": sweep, "fraction_sweep_evict_same_ratio": evict_sweep,
        "evict_share_sweep": shares,
        "long_input": {"prompt_len": long_len, "budget": args.prompt_len, "samples": len(long_windows),
                       "policies": long_input},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quality.json").write_text(json.dumps(result, indent=2))
    md = [f"# KV compression quality ({len(short)} held-out windows, {args.prompt_len}-token prompts, "
          f"{args.cont_len}-token teacher-forced continuations)\n",
          _table(policies, f"Policies at kv_merge_fraction={chosen}, kv_evict_share={args.evict_share}"),
          _table({f"{name} @ {f}": r for f in sweep for name, r in (("segment_sparse", sweep[f]),
                                                                   ("evict_same_ratio", evict_sweep[f]))},
                 "Fraction sweep"),
          _table({f"segment_sparse, kv_evict_share {s}": r for s, r in shares.items()},
                 f"Evict-share sweep at kv_merge_fraction={chosen} (0 = merge only, 1 = evict only)"),
          _table(long_input, f"Long input: {long_len}-token prompt into {args.prompt_len} slots")]
    (args.out / "quality.md").write_text("\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
