"""Pieces of a shard: the halves a shard is split into to isolate a row that crashes its worker.

Who calls it: `runner.failures.decide` splits a piece whose worker died twice; `runner.job` asks
which pieces of each planned shard are still uncovered (resume) and `runner.layout` refuses a
commit that overlaps a committed piece. A piece id is `<shard id>~<path>`, `path` a string of
0/1 halvings from the planned shard, so ids stay a pure function of the plan: a resumed run
recomputes the same pieces from nothing but the manifests present.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from flashx_batch.data.plan import ShardSpec

SEP = "~"


def root_of(piece_id: str) -> str:
    """The planned shard a piece belongs to."""
    return piece_id.split(SEP, 1)[0]


def path_of(piece_id: str) -> str:
    """The halving path inside the planned shard ("" for the whole shard)."""
    return piece_id.split(SEP, 1)[1] if SEP in piece_id else ""


def overlaps(a: str, b: str) -> bool:
    """Do two pieces share rows? Same root and one path is a prefix of the other."""
    return root_of(a) == root_of(b) and (path_of(a).startswith(path_of(b)) or path_of(b).startswith(path_of(a)))


def split(spec: ShardSpec) -> tuple[ShardSpec, ShardSpec]:
    """The two halves of a piece (first half gets the extra row); refs keep their order."""
    if spec.num_rows < 2:
        raise ValueError(f"piece {spec.shard_id} has {spec.num_rows} row(s); it cannot be split")
    mid = (spec.num_rows + 1) // 2
    base = spec.shard_id if SEP in spec.shard_id else spec.shard_id + SEP
    halves = []
    for bit, refs in (("0", spec.refs[:mid]), ("1", spec.refs[mid:])):
        share = len(refs) / spec.num_rows  # token counts per ref are not kept; a proportional estimate
        halves.append(dataclasses.replace(spec, shard_id=base + bit, refs=refs,
                                          input_tokens=round(spec.input_tokens * share)))
    return halves[0], halves[1]


def uncovered(spec: ShardSpec, committed: Iterable[str]) -> list[ShardSpec]:
    """The smallest pieces of `spec` whose rows no committed piece holds (empty = the shard is done)."""
    mine = {c for c in committed if root_of(c) == root_of(spec.shard_id)}
    return _uncovered(spec, mine)


def _uncovered(spec: ShardSpec, mine: set[str]) -> list[ShardSpec]:
    if spec.shard_id in mine:
        return []
    prefix = spec.shard_id if SEP in spec.shard_id else spec.shard_id + SEP
    if not any(c.startswith(prefix) and c != spec.shard_id for c in mine) or spec.num_rows < 2:
        return [spec]
    left, right = split(spec)
    return _uncovered(left, mine) + _uncovered(right, mine)


def pieces_of(shard_id: str, committed: Iterable[str]) -> list[str]:
    """Committed piece ids of one planned shard."""
    return sorted(c for c in committed if root_of(c) == shard_id)


def coarsest(committed: Iterable[str]) -> set[str]:
    """The committed pieces not inside another committed piece: where a zombie committed a whole
    shard after its halves did (possible only where the store offers no lock to refuse it), the
    whole shard's rows are read and the halves are not — so each row counts once."""
    ids = set(committed)
    return {c for c in ids if not any(o != c and overlaps(o, c) and len(path_of(o)) < len(path_of(c)) for o in ids)}
