"""Choose a format per unit: fewest weight bytes under a relative perplexity budget, then prove it.

1. Search (`solve`): a multiple-choice knapsack over units. Each unit's risk at a format is
   max(ΔNLL, KL) of that unit alone. KL(float || quantized) is the ΔNLL to expect when the text
   follows the float model's own distribution, without the noise of which tokens the calibration text
   happens to contain; ΔNLL guards the case where the real text is worse than that expectation. A
   unit whose quantization lowered calibration NLL by chance is thus not treated as free. Risks are
   assumed to add. Solved exactly by dynamic programming over
   the risk budget cut into `bins` steps, each risk rounded *up* to a step. The budget the search
   spends is `plan_fraction` x ln(1 + max_ppl_increase): additivity is an approximation and the
   calibration windows are few, so the search keeps a margin for the held-out check.
2. Validate (`plan`): the whole map on held-out windows; relative ΔPPL with a paired bootstrap 95 %
   interval. While the interval's upper end exceeds the budget, upgrade the worst unit (highest risk
   at its current format) one step up the precision ladder and validate again.

Called by the `python -m flashx_batch.quantize` entry; pure of I/O.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from flashx_batch.quant import formats as fm
from flashx_batch.quant.sensitivity import Score, Validation
from flashx_batch.quant.units import Unit

log = logging.getLogger(__name__)


def risk(score: Score) -> float:
    """Expected ΔNLL (nats per token) a unit adds at a format; >= 0."""
    return max(score.delta_nll, score.kl, 0.0)


def solve(units: list[Unit], sensitivity: dict[str, dict[str, Score]], cost: dict[str, dict[str, int]],
          budget_nll: float, bins: int = 2000) -> dict[str, str]:
    """Min total `cost` (bytes) subject to sum of risks <= `budget_nll`; unit -> format.

    `cost[unit][fmt]` must exist for every format in `sensitivity[unit]`. The model's own float format
    (risk 0) is always among them, so a solution always exists."""
    inf = float("inf")

    def steps(score: Score) -> int:  # budget steps a risk uses, rounded up; over budget = bins + 1
        r = risk(score)
        if r == 0.0:
            return 0
        return math.ceil(r / budget_nll * bins - 1e-9) if budget_nll > 0 else bins + 1

    best = torch.zeros(bins + 1, dtype=torch.float64)  # best[b]: min bytes with total risk <= b steps
    choices: list[tuple[list[str], torch.Tensor]] = []
    for unit in units:
        options = list(sensitivity[unit.name])
        new = torch.full((bins + 1,), inf, dtype=torch.float64)
        pick = torch.zeros(bins + 1, dtype=torch.long)
        for i, fmt in enumerate(options):
            need = steps(sensitivity[unit.name][fmt])
            if need > bins:
                continue
            shifted = torch.full((bins + 1,), inf, dtype=torch.float64)
            shifted[need:] = best[: bins + 1 - need] + cost[unit.name][fmt]
            better = shifted < new
            new = torch.where(better, shifted, new)
            pick = torch.where(better, torch.full_like(pick, i), pick)
        best = new
        choices.append((options, pick))
    assignment: dict[str, str] = {}
    b = bins
    for unit, (options, pick) in zip(reversed(units), reversed(choices)):
        fmt = options[int(pick[b])]
        assignment[unit.name] = fmt
        b -= steps(sensitivity[unit.name][fmt])
    return {u.name: assignment[u.name] for u in units}


def upgrade_step(current: str, allowed: list[str]) -> str | None:
    """The next more precise format in `allowed` above `current`; None at the top."""
    ladder = [f for f in fm.PRECISION_ORDER if f in allowed]
    index = ladder.index(current)
    return ladder[index - 1] if index > 0 else None


@dataclass
class PlanResult:
    assignment: dict[str, str]
    validation: Validation
    searched: dict[str, str]  # what the search chose before any upgrade
    upgrades: list[dict] = field(default_factory=list)  # {"unit", "from", "to", "delta_ppl_ci95_hi"}
    passed: bool = False


def plan(units: list[Unit], sensitivity: dict[str, dict[str, Score]], cost: dict[str, dict[str, int]],
         max_ppl_increase: float, validate: Callable[[dict[str, str]], Validation], plan_fraction: float = 0.5,
         max_upgrades: int = 50) -> PlanResult:
    """Search, then validate and upgrade until the held-out interval fits the budget.

    `validate(assignment)` scores a whole assignment on held-out text (the caller binds the scorer)."""
    budget_nll = plan_fraction * math.log1p(max_ppl_increase)
    searched = solve(units, sensitivity, cost, budget_nll)
    assignment = dict(searched)
    result = PlanResult(assignment, validate(assignment), searched)
    log.info("searched plan: %s; held-out ΔPPL %+.4f [%+.4f, %+.4f]", _counts(assignment),
             result.validation.delta_ppl, *result.validation.ci95)
    while not result.validation.passes(max_ppl_increase) and len(result.upgrades) < max_upgrades:
        candidates = [u for u in units if upgrade_step(assignment[u.name], list(sensitivity[u.name]))]
        if not candidates:
            break
        worst = max(candidates, key=lambda u: risk(sensitivity[u.name][assignment[u.name]]))
        before = assignment[worst.name]
        assignment[worst.name] = upgrade_step(before, list(sensitivity[worst.name]))
        result.validation = validate(assignment)
        result.upgrades.append({"unit": worst.name, "from": before, "to": assignment[worst.name],
                                "delta_ppl_ci95_hi": result.validation.ci95[1]})
        log.info("upgraded %s %s -> %s: held-out ΔPPL %+.4f [%+.4f, %+.4f]", worst.name, before,
                 assignment[worst.name], result.validation.delta_ppl, *result.validation.ci95)
    result.passed = result.validation.passes(max_ppl_increase)
    return result


def _counts(assignment: dict[str, str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for fmt in assignment.values():
        counts[fmt] = counts.get(fmt, 0) + 1
    return counts
