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
