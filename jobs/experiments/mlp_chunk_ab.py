"""CPU prefill with the gated MLP in row chunks (the engine's default) vs in one piece, end to end: the
prefill of 8 prompts of 192 tokens (1,536 packed rows) on a random Llama, float32 and int8, one
thread, both variants in one process, interleaved repeats.

    PYTHONPATH=. python jobs/experiments/mlp_chunk_ab.py [--shape llama-134m] [--repeats 5]

Prints each precision's median prefill seconds per variant and whole / chunked (above 1: chunks faster).
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
from flashx_batch.bench.models import random_llama_with_bundled_tokenizer
from flashx_batch.bench.peers import SHAPES
from flashx_batch.bench.workloads import FULL, equal_lengths
from flashx_batch.models import layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=tuple(SHAPES), default="llama-134m")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    shape = SHAPES[args.shape][0]
    model = random_llama_with_bundled_tokenizer(shape, Path(tempfile.mkdtemp()) / args.shape)
    w = equal_lengths(FULL, shape["vocab_size"], 0)
    prompts, params = w.prompts[:8], [SamplingParams(max_new_tokens=1, ignore_eos=True)] * 8
    chunk_bytes = layers.MLP_CHUNK_BYTES
    for precision in ("float32", "int8"):
        engine = Engine.from_pretrained(model, backend="cpu", dtype="float32", max_batch_size=8,
                                        max_input_len=w.max_prompt_len, max_output_len=1, num_threads=1)
        if precision == "int8":
            quantize_all(engine)
        seconds: dict[str, list[float]] = {"whole": [], "chunked": []}
        for repeat in range(args.repeats + 1):
            variants = (("whole", 1 << 40), ("chunked", chunk_bytes))
            for name, limit in variants[repeat % 2 :] + variants[: repeat % 2]:  # who goes first alternates
                layers.MLP_CHUNK_BYTES = limit  # read on every MLP call
                start = time.perf_counter()
                engine.generate(prompts, params)
                if repeat:  # the first round warms both up
                    seconds[name].append(time.perf_counter() - start)
        layers.MLP_CHUNK_BYTES = chunk_bytes
        medians = {name: statistics.median(v) for name, v in seconds.items()}
        print(f"{args.shape} {precision}: whole {medians['whole']:.3f} s, chunked {medians['chunked']:.3f} s; "
              f"whole / chunked = {medians['whole'] / medians['chunked']:.2f}")


if __name__ == "__main__":
    main()
