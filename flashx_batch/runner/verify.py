"""The job's closing check (`verify_output`): every planned row's id committed exactly once, as a
generation or an error row, no piece outside the plan, then the totals `_SUCCESS` and the report
carry. `runner.job` calls it once every shard has committed.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from flashx_batch.data.plan import Plan
from flashx_batch.errors import FlashxError
from flashx_batch.runner import pieces
from flashx_batch.runner.outputs import Output


class InvariantError(FlashxError):
    """ids(generations) ⊎ ids(errors) != ids(input) after every shard committed: a bug, never expected."""


def verify_output(plan: Plan, output: Output, samples: int = 1) -> tuple[dict[str, Any], dict[str, dict]]:
    """Check the invariant shard by shard; remove orphans; returns the job totals for _SUCCESS and the
    report, and the committed pieces checked (what the finish writes out).

    For every planned shard: its committed pieces do not overlap and cover it, and the ids they hold
    (generations + errors) are exactly the shard's ids, once each. Nothing else may be committed.
    With `samples` (sampling.n) > 1 a generated id holds the rows (id, 0) .. (id, n - 1), each once.
    """

    committed = output.committed()
    gen: Counter = Counter()
    err: Counter = Counter()
    codes: Counter = Counter()
    claimed: set[str] = set()
    for spec in plan.shards + plan.error_shards:
        mine = pieces.pieces_of(spec.shard_id, committed)
        clash = [(a, b) for i, a in enumerate(mine) for b in mine[i + 1:] if pieces.overlaps(a, b)]
        if clash or pieces.uncovered(spec, mine):
            raise InvariantError(f"shard {spec.shard_id}: committed pieces {mine} overlap {clash[:3]} or leave rows "
                                 "uncovered")
        seen: Counter = Counter()
        for pid in mine:
            for kind, counter in (("generations", gen), ("errors", err)):
                if kind in committed[pid]["files"]:
                    cols = ["id", "error_code"] if kind == "errors" else ["id"]
                    if kind == "generations" and samples > 1:
                        cols.append("sample_index")
                    table = output.read_part(kind, pid, cols, committed)
                    ids = table.column("id").to_pylist()
                    if "sample_index" in cols:
                        ids = _sampled_ids(spec.shard_id, ids, table.column("sample_index").to_pylist(), samples)
                    counter.update(ids)
                    seen.update(ids)
                    if kind == "errors":
                        codes.update(table.column("error_code").to_pylist())
        want = Counter(plan.ref_ids[r] for r in spec.refs)
        if seen != want:
            raise InvariantError(f"shard {spec.shard_id}: {sum(seen.values())} ids committed for {spec.num_rows} "
                                 f"rows in (duplicated {[i for i, n in seen.items() if n > 1][:5]}, missing "
                                 f"{[i for i in want if i not in seen][:5]})")
        claimed.update(mine)
    if set(committed) - claimed:
        raise InvariantError(f"committed pieces outside the plan: {sorted(set(committed) - claimed)[:5]}")
    if gen + err != Counter(plan.ids):
        raise InvariantError("output ids differ from input ids")  # unreachable when every shard checks out
    output.clean_orphans(committed)  # a half-published piece of a shard that was later split
    output.drop_attempts_dir()
    stats = output.read_stats(committed)
    sums = {c: (sum(stats.column(c).to_pylist()) if stats is not None else 0)
            for c in ("input_tokens", "output_tokens", "wall_s")}
    totals = {"input_rows": plan.num_rows, "generated_rows": sum(gen.values()), "error_rows": sum(err.values()),
            "error_counts": dict(codes), "shards": len(plan.shards), "error_shards": len(plan.error_shards),
            "pieces": len(committed), "input_tokens": sums["input_tokens"], "output_tokens": sums["output_tokens"],
            "shard_wall_s": sums["wall_s"], "padding_efficiency_bucketed": plan.padding_bucketed,
            "padding_efficiency_unbucketed": plan.padding_unbucketed, "finished_at": time.time()}
    return totals, committed


def _sampled_ids(shard_id: str, ids: list[Any], sample_index: list[int], samples: int) -> list[Any]:
    """The ids of a generations piece with n samples per row, once each, after checking that every id
    holds each sample 0 .. n - 1 exactly once."""
    pairs = Counter(zip(ids, sample_index))
    per_id = Counter(ids)
    bad = [p for p, k in pairs.items() if k > 1 or not 0 <= p[1] < samples] + \
        [i for i, k in per_id.items() if k != samples]
    if bad:
        raise InvariantError(f"shard {shard_id}: (id, sample_index) rows are not each of 0..{samples - 1} once: "
                             f"{bad[:5]}")
    return list(per_id)
