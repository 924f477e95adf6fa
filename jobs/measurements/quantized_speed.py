"""Pre-quantized checkpoints on the CPU: weights kept as stored (dequantized per matmul) against dequantized
at load, against the float32 model they came from.

A random 27 M Llama (`bench.models.LLAMA_27M`, bundled tokenizer) is written as each format
(`quantized_load_memory.write_format`: FP8 block-wise 128x128, GPTQ int4 group 128, compressed-tensors
W4A16 group 128 and W8A8) and loaded twice, `runtime.quantized_weights=keep` and `=dequantize`, beside the
float32 original. Greedy generation of `--new-tokens` tokens from `--batch` held-out prompts, the engines
in alternating order `--repeats` times; median prefill and decode tokens/s, each ratio to float32, and
the resident weight bytes of each.

    PYTHONPATH=. python jobs/measurements/quantized_speed.py --out docs/results/quantized_speed

Writes OUT/quantized_speed.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quantized_load_memory  # noqa: E402  (the sibling measurement: its format writers)

from flashx_batch import Engine, SamplingParams  # noqa: E402
from flashx_batch.bench.models import LLAMA_27M, random_llama_with_bundled_tokenizer  # noqa: E402
from flashx_batch.quality.heldout import token_windows  # noqa: E402
from flashx_batch.quant.precision_map import loaded_summary  # noqa: E402

FORMATS = ("fp8_block", "gptq_int4", "ct_w4a16", "ct_w8a8")


def rates(engines: dict[str, Engine], prompts: list[list[int]], new_tokens: int, repeats: int) -> dict:
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    for engine in engines.values():
        engine.generate(prompts[:2], params)
    got = {n: {"prefill": [], "decode": []} for n in engines}
    for r in range(repeats):
        for name in list(engines) if r % 2 == 0 else list(reversed(engines)):
            engines[name].generate(prompts, params)
            s = engines[name].last_stats
            got[name]["prefill"].append(sum(map(len, prompts)) / s.prefill_s)
            got[name]["decode"].append((s.output_tokens - s.rows) / s.decode_s)
    return {n: {k: statistics.median(v) for k, v in r.items()} for n, r in got.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/quantized_speed"))
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    common = dict(backend="cpu", dtype="float32", max_batch_size=args.batch, num_threads=args.threads,
                  max_input_len=args.prompt_len, max_output_len=args.new_tokens)
    result: dict = {"model": "random LLAMA_27M", "threads": args.threads, "formats": {}}
    with tempfile.TemporaryDirectory() as tmp:
        source = random_llama_with_bundled_tokenizer(LLAMA_27M, Path(tmp) / "float")
        fp32 = Engine.from_pretrained(source, **common)
        prompts = token_windows(fp32.tokenizer, args.prompt_len, args.batch)
        for fmt in args.formats.split(","):
            directory = Path(tmp) / fmt
            quantized_load_memory.write_format(source, directory, fmt)
            engines = {"fp32": fp32, "keep": Engine.from_pretrained(directory, quantized_weights="keep", **common),
                       "dequantize": Engine.from_pretrained(directory, quantized_weights="dequantize", **common)}
            med = rates(engines, prompts, args.new_tokens, args.repeats)
            result["formats"][fmt] = {
                "tok_per_s": med,
                "ratio_to_fp32": {n: {k: round(med[n][k] / med["fp32"][k], 3) for k in ("prefill", "decode")}
                                  for n in ("keep", "dequantize")},
                "weight_bytes": {n: loaded_summary(e.runner.model)["weight_bytes"] for n, e in engines.items()}}
            log = result["formats"][fmt]
            logging.info("%s: %s", fmt, {"ratio": log["ratio_to_fp32"], "bytes": log["weight_bytes"]})
            del engines
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quantized_speed.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
