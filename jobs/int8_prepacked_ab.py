"""int8 on CPU: layers run prepacked (oneDNN, the engine's choice for large weights) vs `torch._int_mm`
alone, end to end on W1 and W2, one process, interleaved repeats, one thread.

    PYTHONPATH=. python jobs/int8_prepacked_ab.py [--shape llama-134m] [--full]

Prints each workload's median seconds per variant (lower is better) and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from flashx_batch import Engine, SamplingParams
from flashx_batch.bench.int8_cpu import quantize_all
from flashx_batch.bench.models import random_llama_with_bundled_tokenizer
from flashx_batch.bench.peers import SHAPES
from flashx_batch.bench.workloads import FULL, QUICK, equal_lengths, mixed_intake
from flashx_batch.quant import linear as quant_linear
from flashx_batch.runtime.options import bundled_model_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=tuple(SHAPES), default=None, help="a random Llama (default: bundled)")
    parser.add_argument("--full", action="store_true", help="the full workload sizes (default: quick)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = bundled_model_dir()
    if args.shape:
        model = random_llama_with_bundled_tokenizer(SHAPES[args.shape][0], Path(tempfile.mkdtemp()) / args.shape)
    vocab = SHAPES[args.shape][0]["vocab_size"] if args.shape else 4096
    sizes = FULL if args.full else QUICK
    threshold = quant_linear.PREPACKED_MIN_WEIGHTS
    for w in (mixed_intake(sizes, vocab, 0), equal_lengths(sizes, vocab, 0)):
        common = dict(backend="cpu", dtype="float32", max_batch_size=8, max_input_len=w.max_prompt_len,
                      max_output_len=w.max_output_len, num_threads=1)
        engines = {}
        for name, limit in (("int_mm", 10**12), ("prepacked", threshold)):
            quant_linear.PREPACKED_MIN_WEIGHTS = limit  # read when the layers are quantized
            engines[name] = Engine.from_pretrained(model, **common)
            quantize_all(engines[name])
        quant_linear.PREPACKED_MIN_WEIGHTS = threshold
        params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in w.max_new_tokens]
        seconds: dict[str, list[float]] = {name: [] for name in engines}
        for engine in engines.values():
            engine.generate(w.prompts, params)  # warm-up
        for _ in range(args.repeats):
            for name, engine in engines.items():
                start = time.perf_counter()
                engine.generate(w.prompts, params)
                seconds[name].append(time.perf_counter() - start)
        medians = {name: statistics.median(v) for name, v in seconds.items()}
        print(f"{w.name}: {', '.join(f'{k} {v:.3f} s' for k, v in medians.items())}; "
              f"int_mm / prepacked = {medians['int_mm'] / medians['prepacked']:.2f}")


if __name__ == "__main__":
    main()
