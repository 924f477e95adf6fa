"""Gated-MLP chunk size on a CPU prefill, side by side in one process: 8 MB against 24 MB chunks.

    python jobs/experiments/mlp_chunk_size_ab.py --threads 2 [--repeats 4]

The random 134 M Llama (`bench.models.LLAMA_134M`), prefills of 16 x 64 and 8 x 192 tokens (one new
token each), `layers.MLP_CHUNK_BYTES` switched between runs, alternating order. Prints the median
seconds of each and the paired ratios (24 MB ÷ 8 MB time).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from flashx_batch import Engine, SamplingParams
from flashx_batch.bench.models import LLAMA_134M, random_llama_with_bundled_tokenizer
from flashx_batch.models import layers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = random_llama_with_bundled_tokenizer(LLAMA_134M, Path(tempfile.mkdtemp()) / "llama-134m")
    engine = Engine.from_pretrained(model, backend="cpu", dtype="float32", max_batch_size=8, max_input_len=256,
                                    max_output_len=4, num_threads=args.threads)
    rng = random.Random(0)
    sizes = {"8MB": 8 << 20, "24MB": 24 << 20}
    for length, rows in ((64, 16), (192, 8)):
        prompts = [[rng.randrange(3, 32000) for _ in range(length)] for _ in range(rows)]
        params = [SamplingParams(max_new_tokens=1, ignore_eos=True)] * rows
        seconds: dict[str, list[float]] = {k: [] for k in sizes}
        for r in range(-1, args.repeats):  # -1: warm-up
            for name in (list(sizes) if r % 2 else list(sizes)[::-1]):
                layers.MLP_CHUNK_BYTES = sizes[name]
                start = time.perf_counter()
                engine.generate(prompts, params)
                if r >= 0:
                    seconds[name].append(time.perf_counter() - start)
        pairs = [a / b for a, b in zip(seconds["24MB"], seconds["8MB"], strict=True)]
        print(f"{args.threads} thread(s), {rows} x {length} tokens: " +
              ", ".join(f"{k} {statistics.median(v):.3f} s" for k, v in seconds.items()) +
              f"; 24 MB ÷ 8 MB {statistics.median(pairs):.3f} ({min(pairs):.3f}–{max(pairs):.3f})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
