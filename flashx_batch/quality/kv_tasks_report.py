"""The report of `python -m flashx_batch.quality.kv_tasks`: each policy's scores as fractions of the
static cache's (`relative_scores`), a Markdown table (`markdown`) and a plot (`plot`), from the
result dictionary the harness writes as JSON.
"""

from __future__ import annotations

from pathlib import Path

from flashx_batch.quality.kv_families import paired_bootstrap
from flashx_batch.runtime.options import KV_PRESETS

PRESETS = tuple(f"preset:{name}" for name in KV_PRESETS)  # the engine's own settings, at what they save


def fixed_dials(policy: str) -> tuple[float, float] | None:
    """(kv_merge_fraction, kv_evict_share) of a policy that runs fixed dials, whatever they save: a preset
    (`preset:balanced`), or a candidate fraction for choosing one (`fraction:0.75`, the balanced evict share);
    None for the policies that aim at a target saving."""
    if policy in PRESETS:
        return KV_PRESETS[policy.split(":", 1)[1]]
    if policy.startswith("fraction:"):
        try:
            fraction = float(policy.split(":", 1)[1])
        except ValueError:
            return None
        return (fraction, KV_PRESETS["balanced"][1]) if 0 < fraction <= 1.25 else None
    return None
LOWER_IS_BETTER = {"ppl"}


def relative_scores(result: dict) -> dict[str, dict[str, float]]:
    """{cell: {task: score as a fraction of static's, ..., "average": their mean}}. Higher is better
    everywhere: perplexity enters as static ÷ policy. A task whose static score is 0 has no ratio
    (left out). Needs the static cell."""
    out: dict[str, dict[str, float]] = {}
    for task, t in result["tasks"].items():
        static = t["cells"]["static"]["score"]
        for cell, r in t["cells"].items():
            if task in LOWER_IS_BETTER:
                out.setdefault(cell, {})[task] = 1.0 / r["score"]  # score is already policy ÷ static
            elif static > 0:
                out.setdefault(cell, {})[task] = r["score"] / static
    for values in out.values():
        values["average"] = sum(values.values()) / len(values)
    return out


def retention(result: dict, resamples: int = 2000) -> dict[str, dict[str, dict[str, float]]]:
    """{cell: {task: {retention, low, high, kv_saved}}}: each family's score as a fraction of static's on the same
    examples with a paired 95 % bootstrap interval (`kv_families.paired_bootstrap`); perplexity as static ÷
    policy. A family whose static score is 0 has none."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for task, t in result["tasks"].items():
        static = t["cells"]["static"]["per_example"]
        if task not in LOWER_IS_BETTER and sum(static) <= 0:
            continue
        for cell, r in t["cells"].items():
            kept, low, high = paired_bootstrap(r["per_example"], static, resamples,
                                               lower_is_better=task in LOWER_IS_BETTER)
            out.setdefault(cell, {})[task] = {"retention": kept, "low": low, "high": high, "kv_saved": r["kv_saved"]}
    return out


def retention_markdown(result: dict) -> str:
    """The retention table: a row per cell, each family's retention [95 % interval] and the KV it saved."""
    kept = result.get("retention") or {}
    if not kept:
        return ""
    tasks = [t for t in result["tasks"] if t in next(iter(kept.values()))]
    lines = [f"## Retention ({result.get('split') or 'chosen tasks'}): score ÷ static on the same examples, "
             "[95 % bootstrap interval] (KV saved)", "",
             "| policy | " + " | ".join(tasks) + " | lowest |", "|---|" + "---|" * (len(tasks) + 1)]
    for cell, row in kept.items():
        if cell == "static":
            continue
        cells = [f"{row[t]['retention']:.3f} [{row[t]['low']:.3f}, {row[t]['high']:.3f}] ({row[t]['kv_saved']:.0%})"
                 for t in tasks]
        lines.append(f"| {cell} | " + " | ".join(cells) + f" | {min(row[t]['retention'] for t in tasks):.3f} |")
    return "\n".join(lines) + "\n"


def markdown(result: dict) -> str:
    tasks = list(result["tasks"])
    heads = {"copy": "copy (fraction)", "mqar": "MQAR recall", "ppl": "ppl ÷ static (lower better)",
             "mc": "MC accuracy", "copy_long": "long-cue copy", "kv_multikey": "3-token-key recall",
             "multihop": "two-hop recall", "needle": "needle"}
    relative = result.get("relative", {})
    lines = [f"# KV compression on tasks that can fail ({result['model_name']})", "",
             "Each cell: score (KV saved measured). " + result["command"], "",
             "| policy | target KV saved | " + " | ".join(heads[t] for t in tasks)
             + " | MC right choice's log-likelihood |" * ("mc" in tasks) + " ÷ static, average of tasks |",
             "|---|---|" + "---|" * (len(tasks) + ("mc" in tasks) + 1)]
    cells = list(next(iter(result["tasks"].values()))["cells"])
    for cell in cells:
        row = [result["tasks"][t]["cells"][cell] for t in tasks]
        gold = f" {result['tasks']['mc']['cells'][cell]['gold_logprob']:.3f} |" if "mc" in tasks else ""
        target = "(its own)" if fixed_dials(row[0]["policy"]) else f"{row[0]['target_saved']:.0%}"
        average = f" {relative[cell]['average']:.3f} |" if cell in relative else " |"
        lines.append(f"| {row[0]['policy']} | {target} | "
                     + " | ".join(f"{r['score']:.3f} ({r['kv_saved']:.0%})" for r in row) + " |" + gold + average)
    lines.append("")
    for t in tasks:
        lines.append(f"- {t}: {result['tasks'][t]['examples']} examples, {result['tasks'][t]['describe']}")
    table = retention_markdown(result)
    return "\n".join(lines) + "\n" + ("\n" + table if table else "")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(result["tasks"])
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.6), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        cells = result["tasks"][task]["cells"].values()
        for policy in dict.fromkeys(r["policy"] for r in cells):
            rows = sorted((r for r in cells if r["policy"] == policy), key=lambda r: r["kv_saved"])
            if policy == "static":
                ax.axhline(rows[0]["score"], color="black", linestyle="--", label="static")
                continue
            if fixed_dials(policy):
                ax.plot([100 * rows[0]["kv_saved"]], [rows[0]["score"]], marker="*", markersize=12, linestyle="",
                        label=policy)
                continue
            ax.plot([100 * r["kv_saved"] for r in rows], [r["score"] for r in rows], marker="o", label=policy)
        ax.set_title(task + (" (÷ static, lower better)" if task in LOWER_IS_BETTER else ""))
        ax.set_xlabel("KV saved (%)")
        ax.set_ylabel("score")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(result["model_name"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
