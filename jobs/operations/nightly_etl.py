#!/usr/bin/env python
"""Nightly ETL: run one day's documents through a preset, into a dated output directory.

    python jobs/operations/nightly_etl.py --input-root /data/in --output-root /data/out [--date 2026-11-29] \
        [--preset legal_docs] [key=value ...]

reads  <input-root>/<date>/*   (any mix of .parquet / .jsonl / .csv; see data.path)
writes <output-root>/<date>/   (the output layout of README "Output"; rerunning the same day resumes it)

Exit codes, for the scheduler (cron, Airflow, Argo):
    0        done (row-level errors are in <out>/errors/): mark the day complete
    2        bad job or bad input (config, schema, corrupt file, changed settings): do NOT retry, alert a person
    75       another live run holds the day's output directory (e.g. an earlier run still going): retry later
    130, 143 interrupted (SIGINT / SIGTERM, e.g. pre-emption): retry the same command, it resumes
    1        anything else (a shard kept failing, a crash): retry with backoff, alert after a few tries
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import sys
from pathlib import Path

from flashx_batch.cli import setup_logging
from flashx_batch.config import compose_job
from flashx_batch.errors import ConfigError
from flashx_batch.runner import run

log = logging.getLogger("nightly_etl")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--input-root", required=True, type=Path)
    p.add_argument("--output-root", required=True, type=Path)
    p.add_argument("--date", default=None, help="YYYY-MM-DD (default: yesterday, the day that just closed)")
    p.add_argument("--preset", default="legal_docs")
    return p.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    setup_logging("INFO")
    try:
        day = dt.date.fromisoformat(args.date) if args.date else dt.date.today() - dt.timedelta(days=1)
    except ValueError:
        log.error("--date=%s is not YYYY-MM-DD", args.date)
        return 2
    in_dir, out_dir = args.input_root / day.isoformat(), args.output_root / day.isoformat()
    try:
        job = compose_job([f"conf={args.preset}", f"data.path={in_dir}", f"output.dir={out_dir}", *overrides])
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    log.info("nightly ETL for %s: %s -> %s", day, in_dir, out_dir)
    code = run(job)
    log.info("nightly ETL for %s finished with exit code %d", day, code)
    return code


if __name__ == "__main__":
    sys.exit(main())
