"""Which int8 weights also keep a plain copy for `torch._int_mm`: two thresholds side by side, end to end.

    python jobs/experiments/int8_split_ab.py --threads 1 [--limits 262144,1048576] [--repeats 4]

`quant.linear.INT_MM_MAX_WEIGHTS` decides which int8_dynamic weights serve a decode step's calls
through `torch._int_mm` (below it) instead of the prepacked oneDNN kernel. A kernel microbenchmark
reads each weight from a warm cache; in a job every layer's weight streams from memory each step,
and `_int_mm` reorders its weight on every call. So: the bundled model and the random 27 M Llama, W1
and W2 (`bench.workloads` FULL), int8 on every linear, one engine per limit built from the same
checkpoint, alternating order per repeat; median seconds of each and the paired ratios against the
first limit, and whether the tokens are identical (they must be: both kernels give the same bits).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from flashx_batch import Engine, SamplingParams
from flashx_batch.bench.int8_cpu import quantize_all
from flashx_batch.bench.models import LLAMA_27M, random_llama_with_bundled_tokenizer
from flashx_batch.bench.workloads import FULL, equal_lengths, mixed_intake
from flashx_batch.quant import linear as quant_linear
from flashx_batch.runtime.options import bundled_model_dir


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--limits", default=f"{256 * 1024},{1 << 20}")
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    limits = [int(v) for v in args.limits.split(",")]
    models = {"bundled": (bundled_model_dir(), 4096),
              "27 M": (random_llama_with_bundled_tokenizer(LLAMA_27M, Path(tempfile.mkdtemp()) / "llama-27m"), 8192)}
    for name, (model, vocab) in models.items():
        engines = {}
        for limit in limits:
            quant_linear.INT_MM_MAX_WEIGHTS = limit  # read when each layer is quantized
            engine = Engine.from_pretrained(model, backend="cpu", dtype="float32", max_batch_size=8, max_input_len=512,
                                            max_output_len=96, num_threads=args.threads)
            quantize_all(engine)
            engines[limit] = engine
        for work in (mixed_intake(FULL, vocab, 0), equal_lengths(FULL, vocab, 0)):
            params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in work.max_new_tokens]
            seconds: dict[int, list[float]] = {limit: [] for limit in limits}
            tokens = {}
            for r in range(-1, args.repeats):  # -1: warm-up
                for limit in (limits if r % 2 else limits[::-1]):
                    start = time.perf_counter()
                    out = engines[limit].generate(work.prompts, params)
                    if r >= 0:
                        seconds[limit].append(time.perf_counter() - start)
                    tokens[limit] = [o.token_ids for o in out]
            first = limits[0]
            line = (f"{args.threads} thread(s), {name} {work.name} int8: limit {first} "
                    f"{statistics.median(seconds[first]):.3f} s")
            for limit in limits[1:]:
                pairs = [a / b for a, b in zip(seconds[first], seconds[limit], strict=True)]
                line += (f"; limit {limit} {statistics.median(seconds[limit]):.3f} s, time of {first} ÷ {limit} "
                         f"{statistics.median(pairs):.3f} ({min(pairs):.3f}–{max(pairs):.3f}), tokens identical: "
                         f"{tokens[limit] == tokens[first]}")
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
