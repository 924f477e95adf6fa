#!/usr/bin/env python
"""The driver's planning cost: peak RSS and wall time of `plan_job` on synthetic Parquet inputs.

    python jobs/measurements/plan_memory.py --rows 100000,1000000 --out docs/results/plan_memory [--files 4]

For each row count: `--files` Parquet files of licence-like prompts (4-40 words, row groups of 64k
rows) under --data/in-<rows>/ (reused when present), then a fresh Python process plans the job (the
smoke preset on the bundled model and tokenizer, shard size 16 as in the default preset, default
buckets, nothing written) and reports its peak RSS (`ru_maxrss`) and the time `plan_job` took.
Writes OUT/plan_memory.json with each count's figures and the ratio of the largest count's peak to
the smallest's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

WORDS = ("the licence permits copying modification and distribution of this software provided that notice "
         "warranty liability copyright holder source code binary form conditions redistribution merchantability "
         "fitness particular purpose damages contract tort negligence").split()

PROBE = r"""
import json, resource, sys, time
from flashx_batch.config import compose_job
from flashx_batch.runner.job import plan_job
job = compose_job(json.loads(sys.argv[1]))
start = time.perf_counter()
plan = plan_job(job).plan
seconds = time.perf_counter() - start
print(json.dumps({"plan_s": seconds, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "rows": plan.num_rows, "shards": len(plan.shards) + len(plan.error_shards)}))
"""


def write_input(root: Path, rows: int, files: int) -> Path:
    if (root / "done").is_file():
        return root
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(rows)
    per = -(-rows // files)
    for f in range(files):
        ids = list(range(f * per, min(rows, (f + 1) * per)))
        prompts = [" ".join(rng.choices(WORDS, k=rng.randint(4, 40))) for _ in ids]
        pq.write_table(pa.table({"id": ids, "prompt": prompts}), root / f"part-{f}.parquet", row_group_size=65536)
    (root / "done").write_text("")
    return root


def measure(data: Path) -> dict:
    overrides = ["conf=smoke", f"data.path={data}", "data.limit=null", "data.passthrough_columns=[]",
                 "data.passthrough_if_present=[]",
                 "runtime.shard_size=16", f"output.dir={data.parent / 'unused-out'}"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(overrides)], capture_output=True, text=True,
                          env=env)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="100000,1000000")
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--out", type=Path, default=Path("build/plan_memory"))
    p.add_argument("--data", type=Path, default=Path("build/plan_memory_inputs"), help="where inputs are kept")
    args = p.parse_args()
    counts = [int(x) for x in args.rows.split(",")]
    results = {}
    for rows in counts:
        results[rows] = measure(write_input(args.data / f"in-{rows}", rows, args.files))
        print(rows, results[rows], flush=True)
    small, large = results[min(counts)], results[max(counts)]
    out = {"runs": results, "files": args.files,
           "ratio_peak_rss": large["peak_rss_mb"] / small["peak_rss_mb"],
           "command": (f"python jobs/measurements/plan_memory.py --rows {args.rows} --files {args.files} "
                       f"--out {args.out}")}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "plan_memory.json").write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
