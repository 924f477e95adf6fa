"""PNG plots for report.md (matplotlib, Agg backend: no display needed on a batch node).

Who calls it: `report.markdown.write_report`, once per finished job.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)


def bar_plot(labels: list[str], values: list[float], title: str, ylabel: str, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
    ax.bar(range(len(values)), values, color="#4c72b0")
    ax.set_xticks(range(len(values)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel)
    ax.set_xlabel("bucket (prompt tokens)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def histogram(values: list[float], title: str, xlabel: str, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
    ax.hist(values, bins=min(20, max(1, len(values))), color="#55a868")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("shards")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def interval_plot(labels: list[str], means: list[float], lows: list[float], highs: list[float], overall: float,
                  title: str, ylabel: str, path: Path) -> None:
    """Bars of a metric per bucket with their 95 % intervals, and the overall mean as a line."""
    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
    below = [m - lo for m, lo in zip(means, lows)]
    above = [hi - m for m, hi in zip(means, highs)]
    ax.bar(range(len(means)), means, yerr=[below, above], capsize=4, color="#8172b2")
    ax.axhline(overall, color="#c44e52", linestyle="--", linewidth=1, label=f"overall {overall:.3f}")
    ax.set_xticks(range(len(means)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel)
    ax.set_xlabel("bucket (prompt tokens)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
