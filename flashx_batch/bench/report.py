"""Summaries, ratios and the written outputs: `results.json`, `results.md`, two PNG plots.

Called by the harness after every measurement is taken. `VariantRuns` collects one variant's
repeats on one workload; `summary()` gives the results-file schema fields (medians) plus their min / max.
Ratios pair repeat i of one variant with repeat i of the other — they ran back to back, so the pair
shares whatever the machine was doing at the time.
"""

from __future__ import annotations

import json
import logging
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from flashx_batch.bench.timing import percentile, spread
from flashx_batch.bench.variants import RunResult

log = logging.getLogger(__name__)

# (workload, numerator, denominator, target low, target high): the acceptance ratios
TARGETS = (
    ("W1", "ours_bucketed", "transformers_arrival", 3.0, None),
    ("W1", "ours_bucketed", "ours_unbucketed", 1.5, None),
    ("W2", "ours_bucketed", "ours_unbucketed", 0.9, 1.1),
)
# the mixture-of-experts model's (W1 only, the baseline against ours)
MOE_TARGETS = (("W1", "ours_bucketed", "transformers_arrival", 2.5, None),)
# further ratios reported for every workload (no target)
INFORMATIVE = (
    ("ours_bucketed", "transformers_sorted"),
    ("ours_bucketed", "transformers_arrival"),
    ("ours_bucketed", "ours_static"),
    ("ours_static", "transformers_arrival"),
    ("transformers_sorted", "transformers_arrival"),
    ("ours_segment_sparse", "ours_bucketed"),
    ("ours_prefix_reuse", "ours_bucketed"),
)


@dataclass
class VariantRuns:
    """One variant's timed repeats on one workload."""

    name: str
    batch_size: int
    gated: bool
    walls: list[float] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)
    total_tokens: list[int] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)  # every batch of every repeat
    padding_efficiency: float = 1.0
    batches: int = 0
    peak_rows: int = 0  # the most rows decoding at once, over every batch and repeat
    roofline: dict | None = None

    def add(self, result: RunResult) -> None:
        self.walls.append(result.wall_s)
        self.output_tokens.append(result.output_tokens)
        self.total_tokens.append(result.total_tokens)
        self.latencies += result.latencies
        self.padding_efficiency = result.padding_efficiency  # same batches every repeat
        self.batches = len(result.batches)
        self.peak_rows = max([self.peak_rows] + [b.peak_rows for b in result.batches])

    def output_rates(self) -> list[float]:
        return [n / s for n, s in zip(self.output_tokens, self.walls)]

    def total_rates(self) -> list[float]:
        return [n / s for n, s in zip(self.total_tokens, self.walls)]

    def summary(self) -> dict:
        out, total, wall = spread(self.output_rates()), spread(self.total_rates()), spread(self.walls)
        entry = {
            "output_tok_per_s": out["median"], "total_tok_per_s": total["median"],
            "p50_batch_latency_s": percentile(self.latencies, 50),
            "p95_batch_latency_s": percentile(self.latencies, 95),
            "padding_efficiency": self.padding_efficiency,
            "output_tok_per_s_min": out["min"], "output_tok_per_s_max": out["max"],
            "total_tok_per_s_min": total["min"], "total_tok_per_s_max": total["max"],
            "wall_s": wall, "repeats": len(self.walls), "batch_size": self.batch_size, "batches": self.batches,
            "peak_rows": self.peak_rows, "gated": self.gated,
        }
        if self.roofline is not None:
            entry["roofline_floor_s"] = self.roofline["floor_s"]
            entry["roofline_fraction"] = self.roofline["floor_s"] / wall["median"]
        return entry


def paired_ratio(num: VariantRuns, den: VariantRuns) -> dict[str, float]:
    """Output tok/s of `num` ÷ `den`, repeat by repeat -> median / min / max."""
    return spread([a / b for a, b in zip(num.output_rates(), den.output_rates())])


def ratios(model: str, runs: dict[str, dict[str, VariantRuns]], targets: tuple = TARGETS) -> dict[str, dict]:
    """Target and informative ratios for one model; keys `model/W/num_over_den`."""
    out: dict[str, dict] = {}
    for workload, num, den, low, high in targets:
        pair = runs.get(workload, {})
        if num in pair and den in pair:
            r = paired_ratio(pair[num], pair[den])
            target = f">= {low}" if high is None else f"{low}..{high}"
            met = r["median"] >= low and (high is None or r["median"] <= high)
            out[f"{model}/{workload}/{num}_over_{den}"] = {**r, "target": target, "met": met}
    for workload, pair in runs.items():
        for num, den in INFORMATIVE:
            key = f"{model}/{workload}/{num}_over_{den}"
            if num in pair and den in pair and key not in out:
                out[key] = paired_ratio(pair[num], pair[den])
    return out


def results_document(workloads: dict[str, dict[str, VariantRuns]], ratio_table: dict, machine: dict,
                     run: dict, memory: dict[str, dict[str, dict]] | None = None) -> dict:
    """The results-file schema; workload keys are `model/W` so one file holds every model. `memory`:
    model -> variant -> peak host RSS figures on W1 (`bench.memory`, a fresh process per variant)."""
    return {
        "workloads": {key: {"variants": {name: v.summary() for name, v in variants.items()}}
                      for key, variants in workloads.items()},
        "ratios": ratio_table,
        "memory": memory or {},
        "machine": machine,
        "run": run,
    }


def _fmt_spread(median: float, low: float, high: float, digits: int = 1) -> str:
    return f"{median:.{digits}f} ({low:.{digits}f}–{high:.{digits}f})"


def _rows(v: dict) -> str:
    """The B column: the batch size, and the peak rows in flight when batch growth took more."""
    peak = v.get("peak_rows", 0)
    return f"{v['batch_size']} (peak {peak})" if peak > v["batch_size"] else str(v["batch_size"])


def markdown(doc: dict) -> str:
    """A human summary of `results_document` output."""
    run, machine = doc["run"], doc["machine"]
    lines = ["# flashx-batch benchmark", "",
             f"Mode: {'quick' if run['quick'] else 'full'}; {run['repeats']} interleaved repeats; threads "
             f"{machine['threads']}; greedy, EOS ignored; useful tokens only. Medians with (min–max).", ""]
    for key, entry in doc["workloads"].items():
        lines += [f"## {key}", "", run["workloads"].get(key.split("/")[-1], ""), "",
                  "| variant | B | output tok/s | total tok/s | P50 batch s | P95 batch s | padding eff. "
                  "| roofline frac. |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, v in entry["variants"].items():
            roof = f"{v['roofline_fraction']:.3f}" if "roofline_fraction" in v else "–"
            lines.append(
                f"| {name}{'' if v['gated'] else ' †'} | {_rows(v)} | "
                f"{_fmt_spread(v['output_tok_per_s'], v['output_tok_per_s_min'], v['output_tok_per_s_max'])} | "
                f"{_fmt_spread(v['total_tok_per_s'], v['total_tok_per_s_min'], v['total_tok_per_s_max'])} | "
                f"{v['p50_batch_latency_s']:.3f} | {v['p95_batch_latency_s']:.3f} | "
                f"{v['padding_efficiency']:.3f} | {roof} |")
        lines.append("")
    lines += ["† not gated: the baseline (logged if it differs) or a lossy path. Padding efficiency counts "
              "only token slots actually computed (prefix-cache hits are neither useful nor computed work). "
              "Latency: seconds per static batch; for our in-flight variants (one `generate` call, finished "
              "rows refilled: no batch boundaries) seconds per row, admission to last token. B: rows per batch "
              "at full length; `(peak N)`: the most rows decoding at once once batch growth re-cut the KV "
              "arena for shorter rows (same arena bytes).", "",
              "## Ratios (output tok/s, paired repeats)", "",
              "| ratio | median (min–max) | target | met |", "|---|---|---|---|"]
    for key, r in doc["ratios"].items():
        met = ("yes" if r["met"] else "**no**") if "met" in r else ""
        lines.append(f"| {key} | {_fmt_spread(r['median'], r['min'], r['max'], 2)} | {r.get('target', '')} | {met} |")
    lines += _models_md(run.get("models", {})) + _memory_md(doc.get("memory", {}))
    if doc.get("eval"):
        from flashx_batch.bench.eval_mc import markdown as eval_markdown

        lines += eval_markdown(doc["eval"])
    lines += ["", "## Machine (measured in this run)", ""]
    lines += [f"- {k}: {v}" for k, v in machine.items()]
    if run.get("skipped"):
        lines += ["", "## Not run", ""] + [f"- {k}: {v}" for k, v in run["skipped"].items()]
    lines += ["", "## Correctness gate", "", run.get("gate", ""), ""]
    return "\n".join(lines)


def _mib(m: dict, key: str) -> str:
    return f"{m[key]:.0f}" if key in m else "–"


def _models_md(models: dict) -> list[str]:
    if not models:
        return []
    lines = ["", "## Models", "",
             "| model | architecture | parameters | experts (top-k) | active per token | workloads |",
             "|---|---|---|---|---|---|"]
    for name, m in models.items():
        moe = m.get("moe")
        experts = f"{moe['experts']} (top-{moe['top_k']})" if moe else "dense"
        active = f"{moe['active_parameters']:,}" if moe else f"{m['parameters']:,}"
        lines.append(f"| {name} | {m.get('architecture', '?')} | {m['parameters']:,} | {experts} | {active} | "
                     f"{', '.join(m.get('workloads', []))} |")
    return lines


def _memory_md(memory: dict) -> list[str]:
    if not memory:
        return []
    lines = ["", "## Peak host memory on W1 (RSS, MiB; each variant in a fresh process of its own)", "",
             "| model | variant | peak during the run | over the after-import baseline | after load | process peak "
             "| baseline |", "|---|---|---|---|---|---|---|"]
    for model, by_variant in memory.items():
        for variant, m in by_variant.items():
            if "error" in m:
                lines.append(f"| {model} | {variant} | {m['error']} | | | | |")
                continue
            lines.append(f"| {model} | {variant} | {_mib(m, 'run_peak_rss_mib')} | "
                         f"{_mib(m, 'run_peak_over_baseline_mib')} | {_mib(m, 'loaded_rss_mib')} | "
                         f"{_mib(m, 'process_peak_rss_mib')} | {_mib(m, 'baseline_rss_mib')} |")
    lines += ["", "Each side imports the same libraries (torch, transformers, our engine), loads only its own "
              "model (transformers float32; ours with its KV arena), and runs W1 once as it is timed; the peak is "
              "the kernel's RSS high-water mark, reset after the load (`bench.memory`)."]
    return lines


def plot(sweep: list[dict], out_dir: Path) -> list[Path]:
    """Throughput vs batch size, and P50 / P95 batch latency vs throughput (W1), one panel per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(p["model"] for p in sweep))
    if not models:
        return []
    paths = []
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        for name, pts in _series(sweep, model).items():
            ax.plot([p["batch_size"] for p in pts], [p["output_tok_per_s"] for p in pts], marker="o", label=name)
        ax.set(title=f"{model}: W1 throughput vs batch size", xlabel="batch size B", ylabel="useful output tok/s")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    paths.append(_save(fig, out_dir / "throughput_vs_batch_size.png"))
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        for k, (name, pts) in enumerate(_series(sweep, model).items()):
            color = f"C{k}"
            xs = [p["output_tok_per_s"] for p in pts]
            ax.plot(xs, [p["p50_batch_latency_s"] for p in pts], marker="o", color=color, label=f"{name} P50")
            ax.plot(xs, [p["p95_batch_latency_s"] for p in pts], marker="^", ls="--", color=color, label=f"{name} P95")
            for p in pts:
                ax.annotate(f"B={p['batch_size']}", (p["output_tok_per_s"], p["p95_batch_latency_s"]), fontsize=7)
        ax.set(title=f"{model}: W1 batch latency vs throughput", xlabel="useful output tok/s",
               ylabel="batch latency (s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    paths.append(_save(fig, out_dir / "latency_vs_throughput.png"))
    return paths


def _series(sweep: list[dict], model: str) -> dict[str, list[dict]]:
    series: dict[str, list[dict]] = {}
    for p in sweep:
        if p["model"] == model:
            series.setdefault(p["variant"], []).append(p)
    return {k: sorted(v, key=lambda p: p["batch_size"]) for k, v in series.items()}


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def sweep_point(model: str, runs: VariantRuns) -> dict:
    """One point of the batch-size sweep (median throughput, latency percentiles)."""
    return {"model": model, "variant": runs.name, "batch_size": runs.batch_size,
            "output_tok_per_s": statistics.median(runs.output_rates()),
            "p50_batch_latency_s": percentile(runs.latencies, 50),
            "p95_batch_latency_s": percentile(runs.latencies, 95)}


def write(doc: dict, sweep: list[dict], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "results.json"
    json_path.write_text(json.dumps({**doc, "run": {**doc["run"], "sweep": sweep}}, indent=2))
    md_path = out_dir / "results.md"
    md_path.write_text(markdown(doc))
    return [json_path, md_path, *plot(sweep, out_dir)]
