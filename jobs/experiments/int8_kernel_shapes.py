"""int8 on CPU, one linear layer at a time: the prepacked oneDNN kernel (`formats.PackedInt8`) against
`torch._int_mm` and float32 `F.linear`, each with its activation rounding included, at decode's 8 rows
and a prefill's 512, for the layer shapes of the bundled model and the 27 M / 134 M Llamas. One
thread; the weight is re-read from cache on every call (these are kernel costs, not memory-bound
model steps: end-to-end figures come from `python -m flashx_batch.bench.peers`).

    PYTHONPATH=. python jobs/experiments/int8_kernel_shapes.py --out DIR

Writes DIR/int8_kernel_shapes.json: per shape and row count, median microseconds per call of each
kernel and the ratio int_mm / prepacked (above 1: prepacked is faster), with the engine's choice
(`quant.linear.INT_MM_MAX_WEIGHTS` / `INT_MM_MAX_ROWS`: `_int_mm` for few rows on small weights).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from flashx_batch.quant import formats as fm
from flashx_batch.quant.linear import INT_MM_MAX_ROWS, INT_MM_MAX_WEIGHTS

# (in, out) of each linear layer kind: qkv, o, gate_up, down, LM head
SHAPES = {
    "bundled": [(256, 512), (256, 256), (256, 1408), (704, 256), (256, 4096)],
    "llama-27m": [(512, 1024), (512, 512), (512, 2816), (1408, 512), (512, 8192)],
    "llama-134m": [(768, 2304), (768, 768), (768, 5888), (2944, 768), (768, 32000)],
}


def _microseconds(fn, calls: int) -> float:
    fn()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    result: dict = {"threads": 1, "int_mm_max_weights": INT_MM_MAX_WEIGHTS, "int_mm_max_rows": INT_MM_MAX_ROWS,
                    "shapes": {}}
    for model, shapes in SHAPES.items():
        for k, n in shapes:
            w = torch.randn(n, k, generator=g) * 0.05
            q, scales = fm.quantize_int8(w)
            q_t, packed = q.t().contiguous(), fm.PackedInt8(q, scales)
            few = "int_mm" if n * k < INT_MM_MAX_WEIGHTS else "prepacked"
            row: dict = {"model": model, "engine_choice_8_rows": few, "engine_choice_512_rows": "prepacked"}
            for m in (8, 512):
                x = torch.randn(m, k, generator=g)
                calls = 50 if m == 8 else 5
                kernels = {"prepacked": functools.partial(packed.matmul, x),
                           "int_mm": functools.partial(fm.int8_dynamic_matmul, x, q_t, scales),
                           "float32": functools.partial(F.linear, x, w)}
                us = {name: _microseconds(fn, calls) for name, fn in kernels.items()}
                row[f"rows_{m}"] = {**{f"{name}_us": round(v, 1) for name, v in us.items()},
                                    "int_mm_over_prepacked": round(us["int_mm"] / us["prepacked"], 2)}
            result["shapes"][f"{k}->{n}"] = row
            print(f"{model:10s} {k:5d} -> {n:5d}", json.dumps({m: row[m] for m in row if m.startswith("rows")}))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "int8_kernel_shapes.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
