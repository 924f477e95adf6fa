"""Per-row scores and job-level means with a bootstrap 95 % interval.

Metrics (`eval.metric`), each a score in [0, 1] per row, None when the row cannot be scored (no
reference, or an error row) — such rows are counted as unscored, never dropped:

- `exact_match`: the normalised generation equals the normalised reference;
- `contains`: the normalised reference occurs in the normalised generation;
- `regex`: `eval.regex`'s first group (the whole match if it has none) extracted from the generation,
  then compared to the reference as `exact_match`; no match scores 0;
- `choice_accuracy`: multiple-choice rows, the predicted choice index equals the answer index.

Normalisation (`normalise`): Unicode NFKC, case-folded, runs of whitespace collapsed to one space,
then leading and trailing whitespace and the punctuation `.,;:!?"'`()[]` stripped. Nothing else (no
article removal: references are whatever the dataset says).
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from typing import Any

import numpy as np

METRICS = ("exact_match", "contains", "regex", "choice_accuracy")
_EDGE = " \t\n.,;:!?\"'`()[]"


def normalise(text: str) -> str:
    text = unicodedata.normalize("NFKC", text).casefold()
    return " ".join(text.split()).strip(_EDGE)


def check_metric(metric: str, pattern: str | None) -> re.Pattern | None:
    """The compiled `eval.regex` for `metric` (None for the others); ValueError naming the problem."""
    if metric not in METRICS:
        raise ValueError(f"eval.metric={metric!r} is not a metric; choose one of {', '.join(METRICS)}.")
    if metric != "regex":
        if pattern:
            raise ValueError(f"eval.regex is set but eval.metric={metric}; it applies to metric=regex only.")
        return None
    if not pattern:
        raise ValueError("eval.metric=regex needs eval.regex, a pattern whose first group is the answer.")
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"eval.regex={pattern!r} is not a valid regular expression: {exc}.") from None


def score_row(metric: str, prediction: Any, reference: Any, pattern: re.Pattern | None = None) -> float | None:
    """One row's score, or None when it cannot be scored (missing prediction or reference)."""
    if prediction is None or reference is None:
        return None
    if metric == "choice_accuracy":
        return float(int(prediction) == int(reference))
    prediction, reference = str(prediction), str(reference)
    if metric == "regex":
        found = pattern.search(prediction)
        if found is None:
            return 0.0
        prediction = found.group(1) if found.groups() else found.group(0)
        return float(normalise(prediction) == normalise(reference))
    if metric == "exact_match":
        return float(normalise(prediction) == normalise(reference))
    if metric == "contains":
        return float(normalise(reference) in normalise(prediction))
    raise ValueError(f"unknown metric {metric!r}")


@dataclass(frozen=True)
class MetricSummary:
    metric: str
    mean: float | None  # over scored rows; None when no row could be scored
    ci_low: float | None
    ci_high: float | None
    scored: int
    unscored: int  # rows with no score (no reference, error rows): reported, not dropped
    resamples: int

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def describe(self) -> str:
        if self.mean is None:
            return f"{self.metric}: no scored rows ({self.unscored} unscored)"
        return (f"{self.metric} = {self.mean:.4f} (95 % CI {self.ci_low:.4f}–{self.ci_high:.4f}; "
                f"{self.scored} scored, {self.unscored} unscored)")


def summarise(metric: str, scores: list[float | None], resamples: int = 1000, seed: int = 0) -> MetricSummary:
    """Mean of the scored rows with a percentile-bootstrap 95 % interval (`resamples` resamples of the
    scored rows with replacement, seeded: the same scores give the same interval)."""
    scored = [s for s in scores if s is not None]
    unscored = len(scores) - len(scored)
    if not scored:
        return MetricSummary(metric, None, None, None, 0, unscored, resamples)
    low, high = bootstrap_interval(scored, resamples, seed)
    return MetricSummary(metric, sum(scored) / len(scored), low, high, len(scored), unscored, resamples)


def bootstrap_interval(values: list[float], resamples: int = 1000, seed: int = 0,
                       confidence: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `values` (resampled in chunks of ~5 M draws, so a
    million-row job needs no more than ~40 MB at a time)."""
    data = np.asarray(values, dtype=np.float64)
    rng = np.random.default_rng(seed)
    n, means = len(data), []
    chunk = max(1, 5_000_000 // n)
    for start in range(0, resamples, chunk):
        draws = rng.integers(0, n, size=(min(chunk, resamples - start), n))
        means.append(data[draws].mean(axis=1))
    ordered = np.sort(np.concatenate(means))
    tail = (1 - confidence) / 2
    return float(ordered[int(tail * (resamples - 1))]), float(ordered[int(round((1 - tail) * (resamples - 1)))])
