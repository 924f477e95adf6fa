"""Correctness gate: before any speed is reported, our lossless variants must reproduce
`transformers` greedy tokens exactly.

Called by the harness twice per workload: `GateCheck.before` runs every lossless variant on a sample
of rows (this doubles as their warm-up) and compares with `transformers` run one row at a time, with
no padding at all (the least ambiguous reference); `GateCheck.after` compares the same rows' tokens
from the timed runs, so the batches we time are the batches we checked. Any mismatch raises
`GateFailure`, and the harness exits non-zero without writing results.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field

import torch

from flashx_batch.bench.variants import RunResult, Variant, hf_greedy
from flashx_batch.bench.workloads import Workload

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Mismatch:
    variant: str
    workload: str
    row: int
    first_diff: int  # index of the first differing token (or the shorter length)
    ours: list[int]
    reference: list[int]

    def describe(self) -> str:
        lo = max(0, self.first_diff - 2)
        hi = self.first_diff + 3
        return (f"{self.variant} on {self.workload} row {self.row}: first difference at token {self.first_diff}; "
                f"ours {self.ours[lo:hi]} vs transformers {self.reference[lo:hi]}")


class GateFailure(RuntimeError):
    """Our tokens differ from `transformers` greedy: no speed figure from this run may be trusted."""

    def __init__(self, mismatches: list[Mismatch]) -> None:
        self.mismatches = mismatches
        head = "; ".join(m.describe() for m in mismatches[:3])
        more = f" (+{len(mismatches) - 3} more)" if len(mismatches) > 3 else ""
        super().__init__(f"correctness gate failed: {len(mismatches)} row(s) differ from transformers greedy: "
                         f"{head}{more}")


def sample_rows(workload: Workload, count: int, seed: int = 0) -> list[int]:
    """The shortest and the longest prompt (padding extremes) plus random rows, `count` in all."""
    by_length = sorted(range(workload.rows), key=lambda i: len(workload.prompts[i]))
    chosen = list(dict.fromkeys([by_length[0], by_length[-1]]))
    rest = [i for i in range(workload.rows) if i not in chosen]
    random.Random(f"gate:{workload.name}:{seed}").shuffle(rest)
    return sorted(chosen + rest[: max(0, count - len(chosen))])


def reference_tokens(model, workload: Workload, rows: list[int], pad_id: int = 0) -> dict[int, list[int]]:
    """`transformers` greedy tokens for each row alone (batch of one, no padding)."""
    out = {}
    for i in rows:
        ids = torch.tensor([workload.prompts[i]], dtype=torch.long)
        tokens = hf_greedy(model, ids, torch.ones_like(ids), workload.max_new_tokens[i], pad_id)
        out[i] = tokens[0, ids.shape[1] :].tolist()
    return out


def compare(variant: str, workload: str, outputs: dict[int, list[int]],
            reference: dict[int, list[int]]) -> list[Mismatch]:
    """Rows whose tokens differ from the reference (length included)."""
    found = []
    for row, ref in reference.items():
        ours = outputs[row]
        if ours != ref:
            diff = next((k for k, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
            found.append(Mismatch(variant, workload, row, diff, ours, ref))
    return found


@dataclass
class GateCheck:
    """The gate for one workload: the sampled rows, their reference tokens, what was checked."""

    workload: Workload
    rows: list[int]
    reference: dict[int, list[int]]
    checked: dict[str, int] = field(default_factory=dict)  # variant -> rows compared

    @classmethod
    def prepare(cls, hf_model, workload: Workload, count: int, pad_id: int = 0, seed: int = 0) -> GateCheck:
        rows = sample_rows(workload, count, seed)
        return cls(workload, rows, reference_tokens(hf_model, workload, rows, pad_id))

    def before(self, variants: list[Variant]) -> dict[str, RunResult]:
        """Run every variant on the sampled rows (warm-up for all); raise if a lossless one differs."""
        sample = self.workload.subset(self.rows)
        results, mismatches = {}, []
        for variant in variants:
            results[variant.name] = result = variant.run(sample)
            outputs = {row: result.outputs[k] for k, row in enumerate(self.rows)}
            mismatches += self._judge(variant, outputs)
        if mismatches:
            raise GateFailure(mismatches)
        return results

    def after(self, variant: Variant, result: RunResult) -> None:
        """Check a timed run's tokens on the sampled rows; raise if a gated variant differs."""
        mismatches = self._judge(variant, {row: result.outputs[row] for row in self.rows})
        if mismatches:
            raise GateFailure(mismatches)

    def _judge(self, variant: Variant, outputs: dict[int, list[int]]) -> list[Mismatch]:
        """Mismatches that fail the gate. The baseline is compared too, but only warned about: padded
        `transformers` batches may flip a near-tie in float32, which says nothing about our engine."""
        if not variant.lossless:
            return []
        found = compare(variant.name, self.workload.name, outputs, self.reference)
        if not variant.gated:
            for m in found:
                log.warning("baseline differs from unpadded transformers (not gated): %s", m.describe())
            return []
        self.checked[variant.name] = self.checked.get(variant.name, 0) + len(outputs)
        return found
