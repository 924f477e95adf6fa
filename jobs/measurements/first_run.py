"""A new user's first job, cold and warm: their own 40-row JSONL (columns id, prompt) under the default
preset with no other override but the paths, first with an empty kernel cache (a new machine or Ray node:
`NUMBA_CACHE_DIR` pointed at a fresh directory), then again with the cache the first run left, into a new
output directory each time; then the same file under a Hive-style `day=1/` path. Wall time of the whole
command, exit codes, and first ÷ warm.

    python jobs/measurements/first_run.py --out docs/results/first_run [--pairs 2] [--extra executor.kind=local]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def own_file(path: Path, rows: int = 40) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": i, "prompt": f"Summarise clause {i}: the licensee shall not "
                                        "sublicense the software without written consent."}) + "\n"
                            for i in range(rows)))
    return path


def timed(args: list[str], cache: Path, cwd: Path) -> dict:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache), "PYTHONPATH": str(REPO)}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "flashx_batch", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, check=False)
    wall = time.perf_counter() - started
    compiled = [line.split("flashx_batch.backends.cpu_decode: ")[-1][:120] for line in done.stderr.splitlines()
                if "compiled the CPU decode kernel" in line]
    return {"args": args, "exit_code": done.returncode, "wall_s": round(wall, 2), "compiled": compiled,
            "stderr_tail": done.stderr[-400:] if done.returncode else ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--pairs", type=int, default=2, help="cold + warm pairs, each with a fresh cache")
    parser.add_argument("--extra", nargs="*", default=[], help="more overrides (e.g. executor.kind=local)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fx-first-run-"))
    data = own_file(work / "mine.jsonl")
    runs = []
    for pair in range(args.pairs):
        cache = work / f"numba-cache-{pair}"
        for kind in ("cold", "warm"):
            out = work / f"out-{pair}-{kind}"
            runs.append({"pair": pair, "kind": kind, **timed(["conf=legal_docs", f"data.path={data}",
                                                               f"output.dir={out}", *args.extra], cache, work)})
            print(json.dumps(runs[-1]), flush=True)
    hive = own_file(work / "lake" / "day=1" / "part-0.jsonl")
    partition = timed(["conf=legal_docs", f"data.path={hive.parent}/", f"output.dir={work}/out/dt=2026-12-05",
                       *args.extra], work / "numba-cache-0", work)
    print(json.dumps(partition), flush=True)
    cold = [r["wall_s"] for r in runs if r["kind"] == "cold"]
    warm = [r["wall_s"] for r in runs if r["kind"] == "warm"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    result = {"date": time.strftime("%Y-%m-%d"), "commit": commit.strip(), "extra": args.extra, "runs": runs,
              "hive_partition_run": partition,
              "first_over_warm": [round(c / w, 2) for c, w in zip(cold, warm, strict=True)],
              "command": "python jobs/measurements/first_run.py " + " ".join(sys.argv[1:])}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "first_run.json").write_text(json.dumps(result, indent=2) + "\n")
    print("first ÷ warm per pair:", result["first_over_warm"])


if __name__ == "__main__":
    main()
