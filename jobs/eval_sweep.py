#!/usr/bin/env python
"""Evaluation sweep: run a Hydra multirun over a grid, then gather every run into one table.

    python jobs/eval_sweep.py --out outputs/eval_sweep [key=v1,v2 ...]   # run the grid, then gather
    python jobs/eval_sweep.py --out outputs/eval_sweep --gather-only     # gather an existing sweep

Without grid overrides the grid is the one in conf/eval_sweep.yaml (hydra.sweeper.params). Each
point runs in `<out>/<override_dirname>/` (see flashx_batch/cli.py); the comparison lands in
`<out>/comparison.md` and `<out>/comparison.csv`, one row per point, from the committed stats.
Exit code: the sweep's (0 only if every point finished), or 2 if there is nothing to gather.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

COLUMNS = ("point", "status", "rows", "error_rows", "shards", "output_tokens", "shard_wall_s", "output_tok_per_s",
           "padding_efficiency", "max_batch_size", "cache_policy", "retried_shards")


def run_sweep(out: Path, overrides: list[str]) -> int:
    cmd = [sys.executable, "-m", "flashx_batch", "-m", "conf=eval_sweep", f"output.dir={out}", *overrides]
    print("+", " ".join(cmd), flush=True)
    return subprocess.call(cmd)


def gather(out: Path) -> list[dict[str, Any]]:
    """One summary row per run directory under `out` (a directory with a job.json)."""
    rows = []
    for job_json in sorted(out.glob("*/job.json")):
        run_dir = job_json.parent
        record = json.loads(job_json.read_text())
        parts = sorted((run_dir / "stats").glob("part-*.parquet"))
        stats = pa.concat_tables([pq.read_table(p) for p in parts]).to_pylist() if parts else []
        out_tok = sum(r["output_tokens"] for r in stats)
        wall = sum(r["wall_s"] for r in stats)
        useful = sum(r["input_tokens"] + r["output_tokens"] for r in stats)
        slots = sum((r["input_tokens"] + r["output_tokens"]) / max(r["padding_efficiency"], 1e-9) for r in stats)
        totals = record.get("totals", {})
        rows.append({
            "point": run_dir.name, "status": record.get("status"), "rows": sum(r["rows"] for r in stats),
            "error_rows": totals.get("error_rows", ""), "shards": len(stats), "output_tokens": out_tok,
            "shard_wall_s": round(wall, 3), "output_tok_per_s": round(out_tok / wall, 2) if wall else 0.0,
            "padding_efficiency": round(useful / slots, 4) if slots else 1.0,
            "max_batch_size": record["config"]["runtime"]["max_batch_size"],
            "cache_policy": record["config"]["runtime"]["cache_policy"],
            "retried_shards": sum(1 for r in stats if r["attempt"] > 1),
        })
    return rows


def write_tables(out: Path, rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(r[c]) for c in COLUMNS) + " |" for r in rows]
    text = "\n".join(lines) + "\n"
    (out / "comparison.md").write_text("# Evaluation sweep\n\nThroughput is per summed shard wall time.\n\n" + text)
    with open(out / "comparison.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("outputs/eval_sweep"))
    p.add_argument("--gather-only", action="store_true")
    args, overrides = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    code = 0 if args.gather_only else run_sweep(args.out, overrides)
    rows = gather(args.out) if args.out.is_dir() else []
    if not rows:
        print(f"no runs to gather under {args.out}", file=sys.stderr)
        return code or 2
    print(write_tables(args.out, rows), end="")
    return code


if __name__ == "__main__":
    sys.exit(main())
