"""KV-compression benchmark: segment_sparse vs static under the same KV arena, long prompts.

    python -m flashx_batch.bench.kv_sparse --out results/kv_sparse [--rows N] [--repeats 3]

Both engines get `--static-rows` (8) full-length rows' worth of arena bytes (the KV budget);
segment_sparse merges prompt KV and so admits more rows per static batch. Workload: prompts of
`max_input_len` held-out tokens, 64 new tokens each, EOS ignored, greedy. Runs interleaved;
medians, and the ratio of each back-to-back pair (median / min / max: on a shared machine a pair
sees the same load); writes OUT/kv_sparse.json.

Rows: by default the least common multiple of the two engines' batch sizes (56 for 8 and 14 at the
defaults), so neither runs a part-empty last batch: the steady state of a long job. A row count that
suits only one side skews the ratio — 48 rows are 6 full static batches but 3 full merged batches and
one 6/14 full — so `--rows` reports the tail effect when you want it (the JSON records the rows used).
Where that multiple is large (32 and 49 rows on a GPU: 1568), the default is instead the smallest
multiple of static's batch that fills at least four segment_sparse batches: static runs only full
batches and segment_sparse's last one is part-empty, a tail that counts against segment_sparse. Where
the held-out split holds too few non-overlapping windows, windows overlap (the stride is halved until
there are enough; the JSON records it).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
from pathlib import Path

from flashx_batch import Engine, SamplingParams
from flashx_batch.bench.timing import seconds as timed_seconds
from flashx_batch.bench.timing import spread
from flashx_batch.quality.heldout import token_windows
from flashx_batch.runtime.options import bundled_model_dir

log = logging.getLogger("flashx_batch.bench.kv_sparse")


def default_rows(static_batch: int, sparse_batch: int) -> int:
    """Whole batches on both sides where that is few enough; else whole static batches (see the module doc)."""
    both = math.lcm(static_batch, sparse_batch)
    if both <= 4 * max(static_batch, sparse_batch):
        return both
    return static_batch * -(-4 * sparse_batch // static_batch)


def prompt_windows(tokenizer, prompt_len: int, rows: int) -> tuple[list[list[int]], int]:
    """`rows` held-out windows of `prompt_len` tokens, overlapping only where the split is too short."""
    stride = prompt_len
    while True:
        prompts = token_windows(tokenizer, prompt_len, rows, stride=stride)
        if len(prompts) == rows:
            return prompts, stride
        if stride <= 16:
            raise SystemExit(f"the held-out split holds {len(prompts)} windows of {prompt_len} tokens even {stride} "
                             f"tokens apart, {rows} were asked for: pass a smaller --rows or --prompt-len")
        stride //= 2


def free_compression_ceiling(phases: dict[str, dict[str, list[float]]]) -> float:
    """The whole-job ratio if segment_sparse's prefill cost no more than static's, its decode as
    measured: static's (prefill + decode) ÷ (static's prefill + segment_sparse's decode), medians.

    The compression pays in decode (more rows per step) and costs in prefill (scores, surprisal,
    merges); this is the most the decode side alone can give on this workload and machine, so a
    ratio short of a target can be read as the compression's cost or as the workload's shape."""
    med = {name: {phase: statistics.median(v) for phase, v in p.items()} for name, p in phases.items()}
    static, sparse = med["static"], med["segment_sparse"]
    return (static["prefill_s"] + static["decode_s"]) / (static["prefill_s"] + sparse["decode_s"])


def run(model_dir: Path, rows: int | None, prompt_len: int, new_tokens: int, repeats: int,
        static_rows: int = 8, preset: str | None = None, threads: int | None = None, backend: str = "cpu",
        dtype: str = "float32") -> dict:
    common = dict(backend=backend, dtype=dtype, max_batch_size=static_rows, max_input_len=prompt_len,
                  max_output_len=new_tokens, segment_size=16, num_threads=threads)
    sparse = dict(cache_policy="segment_sparse", **({"kv_preset": preset} if preset else {}))
    engines = {"static": Engine.from_pretrained(model_dir, **common),
               "segment_sparse": Engine.from_pretrained(model_dir, **sparse, **common)}
    if rows is None:
        rows = default_rows(engines["static"].admitted_batch_size, engines["segment_sparse"].admitted_batch_size)
    prompts, stride = prompt_windows(engines["static"].tokenizer, prompt_len, rows)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    for engine in engines.values():  # warm-up at a full batch: on a GPU, kernels and graphs for its shapes
        engine.generate(prompts[: engine.admitted_batch_size], params)
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    phases: dict[str, dict[str, list[float]]] = {name: {"prefill_s": [], "decode_s": []} for name in engines}
    stats = {}
    for _ in range(repeats):
        for name, engine in engines.items():
            seconds[name].append(timed_seconds(engine.generate, prompts, params))
            stats[name] = engine.last_stats.as_dict()
            for phase, values in phases[name].items():
                values.append(stats[name][phase])
    tok_s = {name: len(prompts) * new_tokens / statistics.median(s) for name, s in seconds.items()}
    return {
        "model": str(model_dir), "backend": backend, "dtype": dtype,
        "rows": len(prompts), "prompt_len": prompt_len, "window_stride": stride, "new_tokens": new_tokens,
        "arena_bytes": {n: e.runner.arena.nbytes for n, e in engines.items()},
        "admitted_batch_size": {n: e.admitted_batch_size for n, e in engines.items()},
        "kv_preset": engines["segment_sparse"].options.kv_preset,
        "kv_bytes_peak": {n: s["kv_bytes_peak"] for n, s in stats.items()},
        # KV held at the fullest moment ÷ what a static cache would hold for the same rows
        "kv_bytes_saved": 1 - stats["segment_sparse"]["kv_bytes_peak"]
        / stats["segment_sparse"]["kv_bytes_static_peak"],
        "output_tok_per_s": tok_s, "seconds": seconds, "phases": phases,  # per repeat, from `generate` stats
        "ratio_admitted_rows": engines["segment_sparse"].admitted_batch_size / engines["static"].admitted_batch_size,
        "ratio_output_tok_per_s": tok_s["segment_sparse"] / tok_s["static"],
        # the two phases apart (static's median seconds ÷ segment_sparse's): decode gains from the extra
        # rows, prefill pays for scoring and merging; the whole-job ratio lies between them
        "ratio_phase_speed": {phase: statistics.median(phases["static"][phase])
                              / statistics.median(phases["segment_sparse"][phase])
                              for phase in ("prefill_s", "decode_s")},
        "ratio_ceiling_free_compression": free_compression_ceiling(phases),
        # each repeat runs static then segment_sparse back to back: a pair shares the machine's mood
        "ratio_output_tok_per_s_paired": spread([a / b for a, b in zip(seconds["static"], seconds["segment_sparse"])]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/kv_sparse"))
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--rows", type=int, default=None,
                        help="prompts (default: the least common multiple of the two batch sizes)")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--static-rows", type=int, default=8,
                        help="the KV budget, in full-length rows: both engines get the arena bytes of this many")
    parser.add_argument("--preset", default=None, help="segment_sparse's kv_preset (default: the engine's)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads per engine (default: all)")
    parser.add_argument("--backend", default="cpu", help="cpu (default), cuda, rocm, npu")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    result = run(args.model or bundled_model_dir(), args.rows, args.prompt_len, args.new_tokens, args.repeats,
                 args.static_rows, args.preset, args.threads, args.backend, args.dtype)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kv_sparse.json").write_text(json.dumps(result, indent=2))
    paired = result["ratio_output_tok_per_s_paired"]
    log.info("admitted rows %s (ratio %.2f); output tok/s %s (ratio %.2f; paired repeats: median %.2f, %.2f-%.2f); "
             "phase speed ratios: prefill %.2f, decode %.2f; with a free compression: %.2f",
             result["admitted_batch_size"], result["ratio_admitted_rows"],
             {k: round(v, 1) for k, v in result["output_tok_per_s"].items()}, result["ratio_output_tok_per_s"],
             paired["median"], paired["min"], paired["max"], result["ratio_phase_speed"]["prefill_s"],
             result["ratio_phase_speed"]["decode_s"], result["ratio_ceiling_free_compression"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
