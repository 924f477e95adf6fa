"""Float32 linears on CPU, side by side in one process: oneDNN with a packed weight against MKL's sgemm.

    python jobs/experiments/linear_kernels_ab.py --threads 1 [--repeats 5] [--skip-end-to-end]

Part 1, one decode step's (or one prefill's) matmuls alone: every linear weight of a model shape (the
bundled 5.5 M Llama, the random 27 M and 134 M Llamas of the peers benchmark; LM head included)
multiplied by M rows, through MKL's plain sgemm (`F.linear`), MKL's packed sgemm for exactly M rows
(`torch.ops.mkl._mkl_linear`, what decode used before) and oneDNN's linear on a weight packed once
for any row count (`models.layers.Linear.pack`). Median of `--repeats` timings of the whole set;
ratios are each form's time ÷ oneDNN's.

Part 2, end to end: the bundled model on W1 and W2 (`bench.workloads` FULL) and the 134 M Llama on W2
(QUICK), greedy, EOS ignored: the same checkpoint loaded with `prepack_weights` on (oneDNN) and off
(plain sgemm), alternating order per repeat; median seconds, the paired ratio (off ÷ on) and how
many rows' tokens are identical.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from flashx_batch import Engine, SamplingParams
from flashx_batch.backends.cpu import onednn_packs
from flashx_batch.bench.models import LLAMA_27M, LLAMA_134M, random_llama_with_bundled_tokenizer
from flashx_batch.bench.workloads import FULL, QUICK, equal_lengths, mixed_intake
from flashx_batch.models.layers import Linear
from flashx_batch.runtime.options import bundled_model_dir


def step_shapes(hidden: int, intermediate: int, layers: int, vocab: int, q: int, kv: int) -> list[tuple[int, int]]:
    """[N, K] of every linear a token passes through: fused qkv, o, fused gate / up, down per layer; LM head."""
    return [(q + 2 * kv, hidden), (hidden, q), (2 * intermediate, hidden), (hidden, intermediate)] * layers + \
        [(vocab, hidden)]


SHAPES = {
    "bundled 5.5 M": step_shapes(256, 704, 6, 4096, 256, 128),
    "27 M": step_shapes(LLAMA_27M["hidden_size"], LLAMA_27M["intermediate_size"], LLAMA_27M["num_hidden_layers"],
                        LLAMA_27M["vocab_size"], 512, 256),
    "134 M": step_shapes(768, 2944, 12, 32000, 768, 768),
}


def median_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _onednn(layers: list[Linear], x: dict[int, torch.Tensor]) -> None:
    for layer in layers:
        layer.forward(x[layer.weight.shape[1]])


def _sgemm(weights: list[torch.Tensor], x: dict[int, torch.Tensor]) -> None:
    for w in weights:
        F.linear(x[w.shape[1]], w)


def _mkl_packed(weights: list[torch.Tensor], packed: list[torch.Tensor], x: dict[int, torch.Tensor], rows: int) -> None:
    for w, p in zip(weights, packed, strict=True):
        torch.ops.mkl._mkl_linear(x[w.shape[1]], p, w, None, rows)


def matmuls(repeats: int) -> None:
    mkl = torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
    for name, shapes in SHAPES.items():
        weights = [torch.randn(n, k) for n, k in shapes]
        layers = []
        for w in weights:
            layer = Linear(w.shape[0], w.shape[1], False, torch.float32, torch.device("cpu"))
            layer.weight.data.copy_(w)
            layer.pack()
            layers.append(layer)
        for rows in (8, 20, 512):
            x = {k: torch.randn(rows, k) for k in {s[1] for s in shapes}}
            onednn = median_seconds(functools.partial(_onednn, layers, x), repeats)
            sgemm = median_seconds(functools.partial(_sgemm, weights, x), repeats)
            line = f"{name}, {rows} rows: oneDNN {onednn * 1e3:.2f} ms, sgemm ÷ oneDNN {sgemm / onednn:.2f}"
            if mkl and rows <= 32:
                packed = [torch.ops.mkl._mkl_reorder_linear_weight(w, rows) for w in weights]
                mkl_time = median_seconds(functools.partial(_mkl_packed, weights, packed, x, rows), repeats)
                line += f", MKL packed for {rows} rows ÷ oneDNN {mkl_time / onednn:.2f}"
            print(line, flush=True)


def end_to_end(threads: int, repeats: int) -> None:
    big = random_llama_with_bundled_tokenizer(LLAMA_134M, Path(tempfile.mkdtemp()) / "llama-134m")
    runs = [("bundled", bundled_model_dir(), mixed_intake(FULL, 4096, 0)),
            ("bundled", bundled_model_dir(), equal_lengths(FULL, 4096, 0)),
            ("134 M", big, equal_lengths(QUICK, 32000, 0))]
    for name, model, work in runs:
        longest, most = work.max_prompt_len, work.max_output_len
        engines = {packed: Engine.from_pretrained(model, backend="cpu", dtype="float32", max_batch_size=8,
                                                  max_input_len=longest, max_output_len=most, num_threads=threads,
                                                  prepack_weights=packed) for packed in (True, False)}
        params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in work.max_new_tokens]
        seconds: dict[bool, list[float]] = {True: [], False: []}
        tokens = {}
        for r in range(-1, repeats):  # -1: warm-up
            for packed in ((True, False) if r % 2 else (False, True)):
                start = time.perf_counter()
                out = engines[packed].generate(work.prompts, params)
                if r >= 0:
                    seconds[packed].append(time.perf_counter() - start)
                tokens[packed] = [o.token_ids for o in out]
        pairs = [off / on for off, on in zip(seconds[False], seconds[True], strict=True)]
        same = sum(a == b for a, b in zip(tokens[True], tokens[False], strict=True))
        print(f"{threads} thread(s), {name} {work.name}: oneDNN {statistics.median(seconds[True]):.3f} s, sgemm "
              f"{statistics.median(seconds[False]):.3f} s, sgemm ÷ oneDNN {statistics.median(pairs):.3f} "
              f"({min(pairs):.3f}–{max(pairs):.3f}), rows with identical tokens {same}/{work.rows}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-end-to-end", action="store_true")
    args = parser.parse_args()
    if not onednn_packs(torch.float32):
        raise SystemExit("this torch build has no oneDNN linear: nothing to compare")
    torch.set_num_threads(args.threads)
    matmuls(args.repeats)
    if not args.skip_end_to_end:
        end_to_end(args.threads, max(2, args.repeats // 2 * 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
