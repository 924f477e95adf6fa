"""A compressed-tensors W8A8 checkpoint of the bundled model against float32 and against our own int8 path.

Writes the bundled model as W8A8 (`python -m flashx_batch.quantize output.checkpoint=...`: int8 weights per
output channel, LM head kept in float), loads it (its linears onto our int8 kernels with the checkpoint's
values and scales), and measures in one process, side by side:
- quality, teacher-forced on held-out windows: perplexity, ΔPPL = ppl / ppl_fp32 - 1 and top-1 agreement
  with float32, for the checkpoint and for our own int8 path (every linear but the LM head to int8 at load
  from the float weights, `bench.int8_cpu.quantize_all`; it rotates the down projection's inputs, which
  the checkpoint format has no place for);
- speed: greedy generation of `--new-tokens` from `--batch` held-out prompts, the three engines in
  alternating order `--repeats` times; median prefill and decode tokens/s and each ratio to float32.

    PYTHONPATH=. python jobs/measurements/w8a8_checkpoint.py --out docs/results/w8a8_checkpoint

Writes OUT/w8a8_checkpoint.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from flashx_batch import Engine, SamplingParams
from flashx_batch.bench.int8_cpu import quality, quantize_all
from flashx_batch.quality.heldout import token_windows
from flashx_batch.quant.linear import QuantLinear
from flashx_batch.runtime.options import bundled_model_dir

log = logging.getLogger("w8a8_checkpoint")


def speed(engines: dict[str, Engine], prompts: list[list[int]], new_tokens: int, repeats: int) -> dict:
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    for engine in engines.values():
        engine.generate(prompts[:2], params)  # warm-up
    rates = {name: {"prefill": [], "decode": []} for name in engines}
    order = list(engines)
    for r in range(repeats):
        for name in order if r % 2 == 0 else reversed(order):
            engines[name].generate(prompts, params)
            s = engines[name].last_stats
            rates[name]["prefill"].append(sum(map(len, prompts)) / s.prefill_s)
            rates[name]["decode"].append((s.output_tokens - s.rows) / s.decode_s)
    med = {n: {k: statistics.median(v) for k, v in r.items()} for n, r in rates.items()}
    return {"tok_per_s": med, "ratio_to_fp32": {n: {k: med[n][k] / med["fp32"][k] for k in ("prefill", "decode")}
                                                 for n in engines if n != "fp32"}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/w8a8_checkpoint"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--windows", type=int, default=64)
    parser.add_argument("--window-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "w8a8"
        subprocess.run([sys.executable, "-m", "flashx_batch.quantize", f"output.checkpoint={checkpoint}"], check=True)
        common = dict(backend="cpu", dtype="float32", max_batch_size=args.batch, num_threads=args.threads,
                      max_input_len=max(args.window_len, args.prompt_len), max_output_len=args.new_tokens)
        fp32 = Engine.from_pretrained(bundled_model_dir(), **common)
        ours = Engine.from_pretrained(bundled_model_dir(), **common)
        quantize_all(ours, keep=("lm_head",))
        w8a8 = Engine.from_pretrained(checkpoint, **common)
        kernels = sorted({m.kernel for m in w8a8.runner.model.modules() if isinstance(m, QuantLinear)})
        windows = token_windows(fp32.tokenizer, args.window_len, args.windows)
        result = {"model": "bundled", "threads": args.threads, "checkpoint_kernels": kernels,
                  "fused_int8_decode": {"w8a8_checkpoint": w8a8.runner.passes.int8_decode() is not None,
                                        "our_int8_at_load": ours.runner.passes.int8_decode() is not None},
                  "quality": {"w8a8_checkpoint": quality(fp32, w8a8, windows),
                              "our_int8_at_load": quality(fp32, ours, windows)}}
        log.info("quality: %s", result["quality"])
        prompts = token_windows(fp32.tokenizer, args.prompt_len, args.batch)
        result["speed"] = speed({"fp32": fp32, "w8a8_checkpoint": w8a8, "our_int8_at_load": ours}, prompts,
                                args.new_tokens, args.repeats)
        log.info("speed: %s", result["speed"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "w8a8_checkpoint.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
