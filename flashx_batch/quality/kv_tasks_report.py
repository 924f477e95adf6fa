"""The report of `python -m flashx_batch.quality.kv_tasks`: each policy's scores as fractions of the
static cache's (`relative_scores`), a Markdown table (`markdown`) and a plot (`plot`), from the
result dictionary the harness writes as JSON.
"""

from __future__ import annotations

from pathlib import Path

from flashx_batch.runtime.options import KV_PRESETS

PRESETS = tuple(f"preset:{name}" for name in KV_PRESETS)  # the engine's own settings, at what they save
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


def markdown(result: dict) -> str:
    tasks = list(result["tasks"])
    heads = {"copy": "copy (fraction)", "mqar": "MQAR recall", "ppl": "ppl ÷ static (lower better)",
             "mc": "MC accuracy"}
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
        target = "(its own)" if row[0]["policy"] in PRESETS else f"{row[0]['target_saved']:.0%}"
        average = f" {relative[cell]['average']:.3f} |" if cell in relative else " |"
        lines.append(f"| {row[0]['policy']} | {target} | "
                     + " | ".join(f"{r['score']:.3f} ({r['kv_saved']:.0%})" for r in row) + " |" + gold + average)
    lines.append("")
    for t in tasks:
        lines.append(f"- {t}: {result['tasks'][t]['examples']} examples, {result['tasks'][t]['describe']}")
    return "\n".join(lines) + "\n"


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
            if policy in PRESETS:
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
