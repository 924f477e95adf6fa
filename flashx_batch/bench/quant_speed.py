"""Quantization speed benchmark: decode tokens/s of a planned precision map ÷ the unquantized model, side by side.

    python -m flashx_batch.bench.quant_speed --map results/quant/precision_map.json --out results/quant
        [--model PATH] [--dtypes float32,bfloat16] [--batch-sizes 1,8] [--prompt-len 64] [--new-tokens 32]
        [--repeats 7] [--threads 1]

For each dtype, two engines over the same checkpoint: unquantized, and the same engine with the map
applied (`apply_precision_map`, exactly what `runtime.precision_map=PATH` does). Workload: `batch`
held-out prompts of `prompt-len` tokens, greedy, `new-tokens` each with EOS ignored. Both engines run
interleaved, `repeats` times (alternating who goes first); figures are medians. Decode tokens/s =
tokens sampled by decode steps (every token but each row's first, which prefill yields) ÷ decode
seconds; prefill tokens/s is reported beside it, because CPU int kernels that help decode can hurt
prefill. The map was measured in its own dtype; in another dtype its unquantized units run in that
dtype and its quality figures are approximate (the speed figures are what this measures).
Writes OUT/quant_speed.json and OUT/quant_speed.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from pathlib import Path

import torch

from flashx_batch import Engine, SamplingParams
from flashx_batch.quality.heldout import token_windows
from flashx_batch.quant import apply_precision_map, load_precision_map
from flashx_batch.quant.precision_map import loaded_summary
from flashx_batch.runtime.options import bundled_model_dir

log = logging.getLogger("flashx_batch.bench.quant_speed")


def _rates(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> dict[str, float]:
    engine.generate(prompts, params)
    s = engine.last_stats
    decoded = s.output_tokens - s.rows
    return {"decode_tok_s": decoded / s.decode_s, "prefill_tok_s": s.input_tokens / s.prefill_s}


def compare(model_dir: Path, map_path: Path, dtype: str, batch: int, prompt_len: int, new_tokens: int,
            repeats: int, threads: int | None) -> dict:
    """One dtype, one batch size: medians for both engines and their ratios."""
    common = dict(backend="cpu", dtype=dtype, max_batch_size=batch, max_input_len=prompt_len,
                  max_output_len=new_tokens, num_threads=threads)
    engines = {"unquantized": Engine.from_pretrained(model_dir, **common),
               "planned": Engine.from_pretrained(model_dir, **common)}
    summary = apply_precision_map(engines["planned"].runner.model, load_precision_map(map_path), model_dir)
    prompts = token_windows(engines["unquantized"].tokenizer, prompt_len, batch)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    for engine in engines.values():
        engine.generate(prompts[:1], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
    names = list(engines)
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            samples[name].append(_rates(engines[name], prompts, params))
    med = {name: {k: statistics.median(s[k] for s in runs) for k in runs[0]} for name, runs in samples.items()}
    return {
        "dtype": dtype, "batch_size": batch, "prompt_len": prompt_len, "new_tokens": new_tokens, "repeats": repeats,
        "threads": torch.get_num_threads(), "median": med, "samples": samples,
        "weight_bytes": {"unquantized": loaded_summary(engines["unquantized"].runner.model)["weight_bytes"],
                         "planned": summary["weight_bytes"]},
        "kernels": summary["kernels"], "formats": summary["formats"],
        "ratio_decode_tok_s": med["planned"]["decode_tok_s"] / med["unquantized"]["decode_tok_s"],
        "ratio_prefill_tok_s": med["planned"]["prefill_tok_s"] / med["unquantized"]["prefill_tok_s"],
    }


def markdown(results: list[dict], map_path: Path) -> str:
    lines = [f"Decode speed of `{map_path}` vs unquantized, CPU, medians of interleaved repeats "
             f"({results[0]['threads']} threads; ratios only — the machine is shared).", "",
             "| dtype | batch | kernels (planned) | decode tok/s unquantized | planned | ratio | prefill ratio "
             "| weight bytes ratio |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        m = r["median"]
        kernels = ", ".join(f"{k} {n}" for k, n in sorted(r["kernels"].items()))
        lines.append(f"| {r['dtype']} | {r['batch_size']} | {kernels} | {m['unquantized']['decode_tok_s']:.1f} | "
                     f"{m['planned']['decode_tok_s']:.1f} | **{r['ratio_decode_tok_s']:.2f}** | "
                     f"{r['ratio_prefill_tok_s']:.2f} | "
                     f"{r['weight_bytes']['planned'] / r['weight_bytes']['unquantized']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--map", type=Path, default=Path("results/quant/precision_map.json"))
    parser.add_argument("--out", type=Path, default=Path("results/quant"))
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads (1: on a shared CPU, waiting OpenMP siblings make timings erratic)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    model_dir = args.model or bundled_model_dir()
    results = []
    for dtype in args.dtypes.split(","):
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            results.append(compare(model_dir, args.map, dtype, batch, args.prompt_len, args.new_tokens, args.repeats,
                                   args.threads))
            log.info("%s batch %d: decode ratio %.2f, prefill ratio %.2f", dtype, batch,
                     results[-1]["ratio_decode_tok_s"], results[-1]["ratio_prefill_tok_s"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quant_speed.json").write_text(json.dumps({"model": str(model_dir), "map": str(args.map),
                                                           "results": results}, indent=1))
    md = markdown(results, args.map)
    (args.out / "quant_speed.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
