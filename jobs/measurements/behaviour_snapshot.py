"""Greedy and seeded generations over a grid of runtime settings, written as one JSON file.

Run the same script against two checkouts and compare the files: a refactor that claims to leave
behaviour unchanged must produce byte-identical token ids, finish reasons and score logits.

    PYTHONPATH=<checkout> python jobs/measurements/behaviour_snapshot.py --out before.json
    python jobs/measurements/behaviour_snapshot.py --out after.json && cmp before.json after.json

`--compare-jobs A B` compares two finished job output directories instead: every generations and
errors row (all columns, sorted by id) must be equal.

Models: the tiny random families of tests/model_factory.py (built into --models once: the dense six,
the mixture-of-experts and the latent-attention ones) and the bundled model. Settings: the engine's
layouts (extents, stripes, static batches, arrival order), segment-sparse, rolling merge,
truncation, prefix reuse and fixed batch size; a setting a family refuses is recorded as refused.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

SETTINGS = {
    "default": {},
    "stripes": {"kv_layout": "stripes"},
    "static_batches": {"refill": False},
    "arrival_order": {"sort_by_length": False},
    "arrival_stripes": {"sort_by_length": False, "kv_layout": "stripes"},
    "fixed_size": {"batch_growth": 1},
    "segment_sparse": {"cache_policy": "segment_sparse"},
    "segment_sparse_arrival": {"cache_policy": "segment_sparse", "sort_by_length": False},
    "rolling_merge": {"cache_policy": "segment_sparse", "long_input": "rolling_merge", "max_input_len": 96},
    "truncate": {"long_input": "truncate"},
    "prefix_reuse": {"prefix_cache_tokens": 256},
    "prefix_reuse_mixed": {"prefix_cache_tokens": 256, "mixed": True},  # paged, then striped batches
}


def _prompts(seed: int, lengths: list[int], vocab: int, prefix: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, vocab, (prefix,), generator=g).tolist()
    return [shared + torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _params():
    from flashx_batch import SamplingParams

    news = (30, 1, 12, 40, 6, 25, 2, 18, 33, 9, 14, 20)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in news]
    params[3] = SamplingParams(max_new_tokens=40, temperature=0.8, top_k=20, seed=5, ignore_eos=True)
    params[6] = SamplingParams(max_new_tokens=40, temperature=1.0, seed=9, stop_token_ids=[7, 8, 9, 10, 11])
    params[9] = SamplingParams(max_new_tokens=30, temperature=0.7, top_p=0.9, seed=3)
    return params


def snapshot(model_dir: Path, vocab: int) -> dict:
    from flashx_batch import Engine
    from flashx_batch.errors import ConfigError

    out = {}
    for name, extra in SETTINGS.items():
        extra = dict(extra)
        mixed = extra.pop("mixed", False)
        opts = {"backend": "cpu", "dtype": "float32", "max_batch_size": 4, "max_input_len": 64,
                "max_output_len": 48, "segment_size": 16, "num_threads": 1, **extra}
        try:
            engine = Engine.from_pretrained(model_dir, **opts)
        except ConfigError as exc:  # a setting this family refuses (latent attention merges no KV): the refusal
            out[name] = {"refused": str(exc)}
            continue
        lengths = [12, 40, 5, 33, 64, 9, 21, 50, 3, 17, 28, 60]
        if extra.get("long_input") in ("rolling_merge", "truncate"):
            lengths[1], lengths[7] = 150, 97
        prompts = _prompts(11, lengths, vocab, prefix=37 if "prefix_cache_tokens" in extra else 0)
        if "prefix_cache_tokens" in extra:
            prompts = [p[: 37 + max(1, n // 3)] for p, n in zip(prompts, lengths)]
        if mixed:  # half the rows share the prefix, half share nothing
            prompts = [p if i % 2 else _prompts(100 + i, [len(p)], vocab)[0] for i, p in enumerate(prompts)]
        runs = []
        for _ in range(2):  # a second call: prefix cache hits, arena reuse
            outs = engine.generate(prompts, _params())
            runs.append([[o.token_ids, o.finish_reason, o.num_input_tokens, o.truncated] for o in outs])
        digest = hashlib.sha256()
        for logits in engine.score(_prompts(4, [5, 30, 17], vocab)):
            digest.update(logits.numpy().tobytes())
        out[name] = {"generations": runs, "score_sha256": digest.hexdigest()}
    return out


def compare_jobs(a: Path, b: Path) -> int:
    import pyarrow.parquet as pq

    for table in ("generations", "errors"):
        left, right = (pq.read_table(d / table).sort_by("id") for d in (a, b))
        if left.num_rows != right.num_rows or not left.equals(right.select(left.column_names)):
            print(f"{table}: DIFFERENT ({left.num_rows} vs {right.num_rows} rows)")
            return 1
        print(f"{table}: {left.num_rows} rows, every column equal")
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--models", type=Path, default=Path("/tmp/flashx-snapshot-models"))
    parser.add_argument("--compare-jobs", type=Path, nargs=2, metavar=("A", "B"))
    args = parser.parse_args()
    if args.compare_jobs:
        sys.exit(compare_jobs(*args.compare_jobs))
    if args.out is None:
        parser.error("--out is required (or --compare-jobs A B)")
    torch.set_num_threads(1)
    from model_factory import ARCHS, MLA_ARCHS, MOE_ARCHS, build

    import flashx_batch
    from flashx_batch.runtime.options import bundled_model_dir

    result = {"package": str(Path(flashx_batch.__file__).parent)}
    for arch in ARCHS + MOE_ARCHS + MLA_ARCHS:
        model_dir = args.models / arch
        if not (model_dir / "config.json").is_file():
            build(arch, model_dir)
        result[arch] = snapshot(model_dir, 256)
        print(arch, "done", flush=True)
    bundled = bundled_model_dir()
    vocab = json.loads((bundled / "config.json").read_text())["vocab_size"]
    result["bundled"] = snapshot(bundled, vocab)
    args.out.write_text(json.dumps({k: v for k, v in result.items() if k != "package"}, sort_keys=True))
    print("written", args.out, "from", result["package"])


if __name__ == "__main__":
    main()
