#!/usr/bin/env python
"""How many files a finished job leaves, and how fast its rerun returns.

    python jobs/measurements/output_layout_check.py --rows 20000 --out build/output_layout [--output-dir s3://...]

Writes `--rows` synthetic rows (short licence-like prompts, two Parquet files) and runs them through
the smoke preset on the bundled model (one new token per row: the point is the output layout, not
the generation), with the default shard size (16 rows), so the job commits rows / 16 pieces. Then it
counts the files of each kind, times a rerun of the finished job (a fresh process: planning plus the
"already done" check), and writes `<out>/output_layout.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

WORDS = ("the licence permits copying modification and distribution of this software provided that notice "
         "warranty liability copyright holder source code binary form conditions").split()


def write_rows(root: Path, rows: int, files: int = 2) -> Path:
    rng = random.Random(0)
    root.mkdir(parents=True, exist_ok=True)
    per = -(-rows // files)
    for f in range(files):
        ids = range(f * per, min(rows, (f + 1) * per))
        prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 24))) for _ in ids]
        pq.write_table(pa.table({"id": list(ids), "prompt": prompts}), root / f"part-{f}.parquet")
    return root


def run_cli(args: list[str]) -> tuple[int, float, str]:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "flashx_batch", *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    return done.returncode, time.perf_counter() - started, done.stderr


def count_files(output_dir: str) -> dict[str, int]:
    import pyarrow.fs as pafs

    from flashx_batch import storage

    fs, base = storage.filesystem(output_dir)
    counts = {}
    for kind in ("generations", "errors", "stats"):
        infos = fs.get_file_info(pafs.FileSelector(f"{base}/{kind}", allow_not_found=True))
        counts[kind] = sum(i.type == pafs.FileType.File for i in infos)
    return counts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--out", type=Path, default=Path("build/output_layout"))
    p.add_argument("--output-dir", default=None, help="the job's output.dir (default: OUT/job)")
    args = p.parse_args()
    data = write_rows(args.out / "in", args.rows)
    output_dir = args.output_dir or str(args.out / "job")
    job = ["conf=smoke", f"data.path={data}", "data.limit=null", "data.passthrough_columns=[]",
           "data.passthrough_if_present=[]",
           f"output.dir={output_dir}", "runtime.shard_size=16", "runtime.max_batch_size=16",
           "sampling.max_new_tokens=1", "executor.progress_interval_s=1000"]
    code, first_s, log = run_cli(job)
    if code != 0:
        print(log[-3000:], file=sys.stderr)
        return code
    files = count_files(output_dir)
    code, rerun_s, log = run_cli(job)
    result = {"rows": args.rows, "shard_size": 16, "pieces": -(-args.rows // 16), "files_per_kind": files,
              "job_s": round(first_s, 1), "rerun_s": round(rerun_s, 2), "rerun_exit": code,
              "rerun_already_done": "already done" in log, "output_dir": output_dir,
              "command": f"python jobs/measurements/output_layout_check.py --rows {args.rows} --out {args.out}"}
    (args.out / "output_layout.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0 if code == 0 else code


if __name__ == "__main__":
    raise SystemExit(main())
