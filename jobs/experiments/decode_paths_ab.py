"""Side by side in one process: the paged decode kernel and the compiled int8 row rounding, on and off.

    python jobs/experiments/decode_paths_ab.py [--threads 1] [--precisions float32,int8] [--repeats 4]

The bundled model on the benchmark workloads (`bench.workloads` FULL: W1, W2, W3; W3 with prefix reuse
on and fresh prefixes per repeat), float32 and int8 (`int8_dynamic` on every linear layer). "off" runs
the code paths they replaced: a paged batch's pages gathered into a copy before the kernel reads them
(`cpu_decode.usable_paged` False), and the int8 activation rounding as torch ops (`row_kernel.kernel`
None). Alternating order per repeat; prints the median seconds of each and the median of the paired
ratios (off ÷ on), and whether the greedy tokens are identical. float32 skips W1 / W2, where neither
change applies.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from flashx_batch import Engine, SamplingParams
from flashx_batch.backends import cpu_decode
from flashx_batch.bench.int8_cpu import quantize_all
from flashx_batch.bench.variants import prefix_reuse_options
from flashx_batch.bench.workloads import FULL, equal_lengths, few_shot, mixed_intake
from flashx_batch.quant import row_kernel
from flashx_batch.runtime.options import bundled_model_dir


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--precisions", default="float32,int8")
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernel, usable_paged = row_kernel.kernel, cpu_decode.usable_paged

    def use(new: bool) -> None:
        row_kernel.kernel = kernel if new else (lambda: None)
        cpu_decode.usable_paged = usable_paged if new else (lambda keys, values: False)

    workloads = {"W1": mixed_intake(FULL, 4096, 0), "W2": equal_lengths(FULL, 4096, 0), "W3": few_shot(FULL, 4096, 0)}
    for precision in args.precisions.split(","):
        engines = {}
        for sharing in (False, True):
            engine = Engine.from_pretrained(bundled_model_dir(), backend="cpu", dtype="float32", max_batch_size=8,
                                            max_input_len=512, max_output_len=96, num_threads=args.threads,
                                            **(prefix_reuse_options(512) if sharing else {}))
            if precision == "int8":
                quantize_all(engine)
            engines[sharing] = engine
        for name, work in workloads.items():
            if precision == "float32" and name != "W3":
                continue
            engine = engines[name == "W3"]
            params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in work.max_new_tokens]
            seconds: dict[bool, list[float]] = {True: [], False: []}
            tokens = {}
            for r in range(-1, args.repeats):  # -1: warm-up
                run = work.with_fresh_prefixes(r) if name == "W3" else work
                for new in ((True, False) if r % 2 else (False, True)):
                    use(new)
                    start = time.perf_counter()
                    out = engine.generate(run.prompts, params)
                    if r >= 0:
                        seconds[new].append(time.perf_counter() - start)
                    tokens[new] = [o.token_ids for o in out]
            pairs = [off / on for off, on in zip(seconds[False], seconds[True], strict=True)]
            print(f"{precision} {name}: off {statistics.median(seconds[False]):.3f} s, on "
                  f"{statistics.median(seconds[True]):.3f} s, off ÷ on {statistics.median(pairs):.3f} "
                  f"({min(pairs):.3f}–{max(pairs):.3f}), tokens identical: {tokens[True] == tokens[False]}",
                  flush=True)
    use(True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
