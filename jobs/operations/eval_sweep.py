#!/usr/bin/env python
"""Evaluation sweep: run a Hydra multirun over a grid, then gather every run into one leaderboard.

    python jobs/operations/eval_sweep.py --out outputs/eval_sweep [key=v1,v2 ...]   # run the grid, then gather
    python jobs/operations/eval_sweep.py --out outputs/eval_sweep --gather-only     # gather an existing sweep
    python jobs/operations/eval_sweep.py --out DIR --split-by seen_in_training      # + the metric per value of a column

Without grid overrides the grid is the one in conf/eval_sweep.yaml (hydra.sweeper.params): the bundled
model on the bundled evaluation set, by choice accuracy. Each point runs in `<out>/<override_dirname>/`
(see flashx_batch/cli.py). The leaderboard — one row per point, best metric first: the metric with its
bootstrap 95 % interval, scored / unscored / error rows, throughput — lands in `<out>/leaderboard.md`,
`<out>/leaderboard.csv` and `<out>/leaderboard.png` (metric against tokens/s). Points without
`eval.metric`, and runs that did not finish, are listed with an empty metric, never dropped.
Throughput is tokens per summed shard wall time: output tokens for generate jobs, scored (input) tokens
for the scoring tasks. Exit code: the sweep's (0 only if every point finished), or 2 if there is nothing
to gather.
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

COLUMNS = ("point", "status", "task", "metric", "mean", "ci_low", "ci_high", "scored", "unscored", "rows",
           "error_rows", "tokens", "shard_wall_s", "tok_per_s", "dtype", "max_batch_size", "max_input_len",
           "retried_shards")


def run_sweep(out: Path, overrides: list[str]) -> int:
    cmd = [sys.executable, "-m", "flashx_batch", "-m", "conf=eval_sweep", f"output.dir={out}", *overrides]
    print("+", " ".join(cmd), flush=True)
    return subprocess.call(cmd)


def gather(out: Path, split_by: str | None = None) -> list[dict[str, Any]]:
    """One leaderboard row per run directory under `out` (a directory with a job.json), best metric first."""
    rows = []
    for job_json in sorted(out.glob("*/job.json")):
        run_dir = job_json.parent
        record = json.loads(job_json.read_text())
        config = record["config"]
        parts = sorted((run_dir / "stats").glob("part-*.parquet"))
        stats = pa.concat_tables([pq.read_table(p) for p in parts]).to_pylist() if parts else []
        task = config.get("task", "generate")
        key = "output_tokens" if task == "generate" else "input_tokens"
        tokens = sum(r[key] for r in stats)
        wall = sum(r["wall_s"] for r in stats)
        totals = record.get("totals") or {}
        ev = totals.get("eval") or {}
        row = {
            "point": run_dir.name, "status": record.get("status"), "task": task, "metric": ev.get("metric", ""),
            "mean": _round(ev.get("mean")), "ci_low": _round(ev.get("ci_low")), "ci_high": _round(ev.get("ci_high")),
            "scored": ev.get("scored", ""), "unscored": ev.get("unscored", ""), "rows": totals.get("input_rows", ""),
            "error_rows": totals.get("error_rows", ""), "tokens": tokens, "shard_wall_s": round(wall, 3),
            "tok_per_s": round(tokens / wall, 1) if wall else 0.0, "dtype": config["model"]["dtype"],
            "max_batch_size": config["runtime"]["max_batch_size"], "max_input_len": config["runtime"]["max_input_len"],
            "retried_shards": sum(1 for r in stats if r["attempt"] > 1),
        }
        if split_by and ev and record.get("status") == "succeeded":
            row.update(_split(run_dir, split_by, ev["metric"], config.get("eval", {}).get("resamples", 1000)))
        rows.append(row)
    return sorted(rows, key=lambda r: (r["mean"] == "", -(r["mean"] or 0.0), r["point"]))


def _split(run_dir: Path, column: str, metric: str, resamples: int) -> dict[str, str]:
    """The metric per value of a passthrough column (scored rows only; error rows have no value)."""
    from flashx_batch.evaluation.metrics import summarise

    table = pq.read_table(run_dir / "generations", columns=[column, "score"]).to_pylist()
    out = {}
    for value in sorted({r[column] for r in table}, key=str):
        s = summarise(metric, [r["score"] for r in table if r[column] == value], resamples)
        if s.mean is not None:
            out[f"{column}={value}"] = f"{s.mean:.3f} [{s.ci_low:.3f}, {s.ci_high:.3f}] (n={s.scored})"
    return out


def _round(v: float | None) -> float | str:
    return "" if v is None else round(v, 4)


def write_leaderboard(out: Path, rows: list[dict[str, Any]]) -> str:
    columns = list(COLUMNS) + sorted({k for r in rows for k in r if k not in COLUMNS})
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in columns) + " |" for r in rows]
    text = "\n".join(lines) + "\n"
    (out / "leaderboard.md").write_text(
        "# Evaluation leaderboard\n\nBest metric first; interval: percentile bootstrap 95 % over the scored rows. "
        "Unscored rows (no reference, error rows) are counted, not dropped. Throughput: tokens per summed shard "
        "wall time (output tokens for generate, scored tokens for the scoring tasks).\n\n" + text
        + "\n![metric against tokens/s](leaderboard.png)\n")
    with open(out / "leaderboard.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    _plot(out / "leaderboard.png", [r for r in rows if r["mean"] != ""])
    return text


def _plot(path: Path, rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8), dpi=100)
    for r in rows:
        ax.errorbar(r["tok_per_s"], r["mean"], yerr=[[r["mean"] - r["ci_low"]], [r["ci_high"] - r["mean"]]],
                    fmt="o", capsize=4)
        ax.annotate(r["point"], (r["tok_per_s"], r["mean"]), fontsize=7, xytext=(4, 4), textcoords="offset points")
    metric = rows[0]["metric"] if rows else "metric"
    ax.set_xlabel("tokens/s (per summed shard wall time)")
    ax.set_ylabel(f"{metric} (95 % CI)")
    ax.set_title("Evaluation sweep: metric against throughput", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("outputs/eval_sweep"))
    p.add_argument("--gather-only", action="store_true")
    p.add_argument("--split-by", help="a passthrough column: also report the metric per value of it")
    args, overrides = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    code = 0 if args.gather_only else run_sweep(args.out, overrides)
    rows = gather(args.out, args.split_by) if args.out.is_dir() else []
    if not rows:
        print(f"no runs to gather under {args.out}", file=sys.stderr)
        return code or 2
    print(write_leaderboard(args.out, rows), end="")
    return code


if __name__ == "__main__":
    sys.exit(main())
