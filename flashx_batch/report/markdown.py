"""report.md: totals, a per-bucket table and three plots, written from the committed stats.

Who calls it: `runner.job_run` after the invariant check, before `_SUCCESS`, with the committed stats
table and the plan, so it can be re-run on any finished job. It imports nothing of the runner.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flashx_batch.data.plan import Plan
from flashx_batch.report.error_codes import fix_for
from flashx_batch.report.plots import bar_plot, histogram, interval_plot

log = logging.getLogger(__name__)
PLOTS = {"tok_s": "report_tok_per_s.png", "pad": "report_padding.png", "wall": "report_shard_wall.png",
         "metric": "report_metric.png", "rows_s": "report_rows_per_s.png"}


def bucket_rows(stats: Any) -> list[dict[str, Any]]:
    """Stats table → one aggregate per bucket (token-weighted, so small shards do not skew it)."""
    agg: dict[tuple[int, int], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for r in stats.to_pylist():
        a = agg[(r["bucket_min_len"], r["bucket_max_len"])]
        for k in ("rows", "input_tokens", "output_tokens", "wall_s"):
            a[k] += r[k]
        a["shards"] += 1
        # padding efficiency is useful/computed; recover computed slots to weight it properly
        a["slots"] += (r["input_tokens"] + r["output_tokens"]) / max(r["padding_efficiency"], 1e-9)
    out = []
    for (lo, hi), a in sorted(agg.items()):
        out.append({"bucket": f"{lo}-{hi}", "shards": int(a["shards"]), "rows": int(a["rows"]),
                    "input_tokens": int(a["input_tokens"]), "output_tokens": int(a["output_tokens"]),
                    "output_tok_per_s": a["output_tokens"] / a["wall_s"] if a["wall_s"] else 0.0,
                    "rows_per_s": a["rows"] / a["wall_s"] if a["wall_s"] else 0.0,
                    "padding_efficiency": (a["input_tokens"] + a["output_tokens"]) / a["slots"] if a["slots"] else 1.0})
    return out


def write_report(root: Path, totals: dict[str, Any], plan: Plan, stats: Any,
                 write_text: Callable[[Path, str], None], evaluation: dict[str, Any] | None = None,
                 task: Any = None, error_examples: dict[str, str] | None = None) -> Path:
    """report.md and its plots in `root`, from the job's totals, plan and stats table (None: no shard
    ran); `write_text` writes report.md (the runner's atomic write). `evaluation`: the job's metric
    (`runner.eval_summary.evaluate`), reported first with its interval and a per-bucket plot. `task`:
    the job's (`tasks.Task`; None: generate): a task that writes no text gets no token-rate plot or
    columns. `error_examples`: one message per error code, shown with the code's fix."""
    generates = task is None or task.generates
    lines = ["# flashx-batch job report", "", f"Task: {getattr(task, 'name', 'generate')}.", ""]
    if evaluation is not None:
        lines += _evaluation_section(evaluation, root)
    lines += ["## Totals", "", "| metric | value |", "|---|---|"]
    for k, v in totals.items():
        if k not in ("finished_at", "eval"):
            lines.append(f"| {k} | {_fmt(v)} |")
    lines += ["", f"Planned prefill padding efficiency of right-padded static batches: {plan.padding_bucketed:.3f} "
              f"with length bucketing, {plan.padding_unbucketed:.3f} without (input order). The engine packs "
              "prompts without padding, so its measured efficiency (stats) is higher still.", ""]
    if stats is not None and stats.num_rows:
        lines += _bucket_section(stats, root, generates)
    if totals.get("error_counts"):
        examples = error_examples or {}
        lines += ["## Error rows", "", "| code | rows | example message | what to do |", "|---|---|---|---|"]
        lines += [f"| {k} | {v} | {_cell(examples.get(k, ''))} | {_cell(fix_for(k))} |"
                  for k, v in sorted(totals["error_counts"].items())]
        lines += ["", "Every error row is in errors/ with its id, code, message and stage.", ""]
    path = root / "report.md"
    write_text(path, "\n".join(lines) + "\n")
    return path


def _bucket_section(stats: Any, root: Path, generates: bool) -> list[str]:
    """Per-bucket table and plots: output tok/s and padding for a task that writes text; rows and rows/s
    for one that scores (nothing generated: a token-rate plot would be empty)."""
    buckets = bucket_rows(stats)
    labels = [b["bucket"] for b in buckets]
    walls = stats.column("wall_s").to_pylist()
    histogram(walls, "Shard wall time", "seconds", root / PLOTS["wall"])
    if generates:
        bar_plot(labels, [b["output_tok_per_s"] for b in buckets], "Output tokens/s per bucket",
                 "output tok/s", root / PLOTS["tok_s"])
        bar_plot(labels, [b["padding_efficiency"] for b in buckets], "Measured padding efficiency per bucket",
                 "useful / computed slots", root / PLOTS["pad"])
        lines = ["## Per bucket (measured)", "",
                 "| bucket | shards | rows | input tokens | output tokens | output tok/s | padding eff. |",
                 "|---|---|---|---|---|---|---|"]
        lines += [f"| {b['bucket']} | {b['shards']} | {b['rows']} | {b['input_tokens']} | {b['output_tokens']} "
                  f"| {b['output_tok_per_s']:.1f} | {b['padding_efficiency']:.3f} |" for b in buckets]
        plots = [f"![output tok/s per bucket]({PLOTS['tok_s']})", "",
                 f"![padding efficiency per bucket]({PLOTS['pad']})", ""]
    else:
        bar_plot(labels, [b["rows_per_s"] for b in buckets], "Rows scored per second per bucket", "rows/s",
                 root / PLOTS["rows_s"])
        lines = ["## Per bucket (measured)", "", "| bucket | shards | rows | tokens read | rows/s |",
                 "|---|---|---|---|---|"]
        lines += [f"| {b['bucket']} | {b['shards']} | {b['rows']} | {b['input_tokens']} | {b['rows_per_s']:.1f} |"
                  for b in buckets]
        plots = [f"![rows/s per bucket]({PLOTS['rows_s']})", ""]
    devices = sorted(set(stats.column("device").to_pylist()))
    retried = sum(1 for a in stats.column("attempt").to_pylist() if a > 1)
    return lines + ["", f"Devices: {', '.join(devices)}. Shards that needed a retry: {retried}. "
                    "Rates are per shard wall time (read + tokenize + compute), summed over shards.", "",
                    *plots, f"![shard wall time]({PLOTS['wall']})", ""]


def _cell(text: str) -> str:
    """Text as one Markdown table cell: no pipes or line breaks, at most 200 characters."""
    text = " ".join(str(text).replace("|", "\\|").split())
    return text if len(text) <= 200 else text[:197] + "..."


def _evaluation_section(evaluation: dict[str, Any], root: Path) -> list[str]:
    overall = evaluation["overall"]
    lines = ["## Evaluation", "", evaluation["describe"] + ".", "",
             f"Interval: percentile bootstrap over the scored rows ({overall['resamples']} resamples, seeded). "
             "Unscored rows (no reference, or an error row) are counted, not dropped.", ""]
    buckets = [b for b in evaluation["buckets"] if b["mean"] is not None]
    if buckets and overall["mean"] is not None:
        lines += ["| bucket | scored | mean | 95 % interval |", "|---|---|---|---|"]
        lines += [f"| {b['bucket']} | {b['scored']} | {b['mean']:.4f} | {b['ci_low']:.4f}–{b['ci_high']:.4f} |"
                  for b in buckets]
        interval_plot([b["bucket"] for b in buckets], [b["mean"] for b in buckets], [b["ci_low"] for b in buckets],
                      [b["ci_high"] for b in buckets], overall["mean"], f"{overall['metric']} per bucket (95 % CI)",
                      overall["metric"], root / PLOTS["metric"])
        lines += ["", f"![{overall['metric']} per bucket]({PLOTS['metric']})", ""]
    return lines


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    if isinstance(v, dict):
        return ", ".join(f"{k}={x}" for k, x in sorted(v.items())) or "-"
    return str(v)
