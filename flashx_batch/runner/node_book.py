"""The Ray executor's view of the cluster's nodes: which are alive, how many actors each holds and may
hold, how their attempts went, and which are excluded. Plain Python (no Ray), so the policy is tested
on its own (`tests/unit/test_node_book.py`).

Policy:
- **Placement.** Each actor is placed on a chosen node (the one with the most room left, never an
  excluded one); the pool grows when a node with room joins (up to `executor.num_actors`) and shrinks
  when one leaves.
- **Failure domains.** A shard whose attempt failed on a node is retried on another node while one
  has actors (`may_run`); it waits for one rather than go back to the node that failed it.
- **Exclusion.** A node where `limit` different shards failed in a row (errors, dead actors, timeouts,
  engines that would not load there; not bad jobs) is excluded for the rest of the job: its actors go,
  none is placed there again. One shard failing again and again counts once (that is the shard's
  problem, which max_attempts and splitting handle), and the last usable node is never excluded (a
  single-device job keeps its device).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class NodeRecord:
    node_id: str
    capacity: int = 0  # actors it can hold (its resources // one actor's)
    alive: bool = True
    actors: set[str] = field(default_factory=set)  # actor names placed on it (booting or ready)
    shards: int = 0  # attempts committed on it
    failures: int = 0  # attempts failed on it
    streak: set[str] = field(default_factory=set)  # the shards (base ids) failed there since its last success
    excluded: str | None = None  # why, once excluded
    placed: int = 0  # actors ever placed on it

    def summary(self) -> dict[str, Any]:
        return {"alive": self.alive, "capacity": self.capacity, "actors_placed": self.placed, "shards": self.shards,
                "failed_attempts": self.failures, "excluded": self.excluded}


class NodeBook:
    def __init__(self, bundle: dict[str, float], limit: int, ceiling: int | None) -> None:
        """`bundle`: one actor's resources; `limit`: consecutive failures that exclude a node; `ceiling`:
        the most actors at once (None: as many as the nodes hold)."""
        self.bundle, self.limit, self.ceiling = bundle, limit, ceiling
        self.nodes: dict[str, NodeRecord] = {}
        self.node_of: dict[str, str] = {}  # actor name -> node id, while the actor is in the pool
        self.placed_on: dict[str, str] = {}  # actor name -> node id, kept after it leaves (its late results)
        self.ready: set[str] = set()  # actors whose engine has loaded
        self.avoid: dict[str, set[str]] = {}  # shard id -> nodes where an attempt of it failed

    # ---- the cluster ---------------------------------------------------------------------------
    def refresh(self, ray_nodes: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
        """Take `ray.nodes()`; returns (node ids that joined, actor names on nodes that left)."""
        joined, lost = [], []
        seen = set()
        for node in ray_nodes:
            node_id = node.get("NodeID")
            if not node_id:
                continue
            seen.add(node_id)
            have = node.get("Resources", {}) or {}
            capacity = min((int(have.get(k, 0) // v) for k, v in self.bundle.items()), default=0)
            record = self.nodes.get(node_id)
            alive = bool(node.get("Alive"))
            if record is None:
                record = self.nodes[node_id] = NodeRecord(node_id, capacity, alive)
                if alive and capacity > 0:
                    joined.append(node_id)
            elif record.alive and not alive:
                lost.extend(sorted(record.actors))
            record.alive, record.capacity = alive, capacity if alive else record.capacity
        for node_id, record in self.nodes.items():
            if node_id not in seen and record.alive:  # gone from the list altogether
                record.alive = False
                lost.extend(sorted(record.actors))
        return joined, lost

    def room(self) -> int:
        """Actors that could be added now (within the ceiling)."""
        free = sum(max(0, r.capacity - len(r.actors)) for r in self._usable())
        if self.ceiling is not None:
            free = min(free, self.ceiling - len(self.node_of))
        return max(0, free)

    def place(self, actor: str) -> str | None:
        """The node to put a new actor on (the most room left), recorded; None when none has room."""
        if self.ceiling is not None and len(self.node_of) >= self.ceiling:
            return None
        options = [r for r in self._usable() if r.capacity > len(r.actors)]
        if not options:
            return None
        best = min(options, key=lambda r: (len(r.actors) - r.capacity, r.placed, r.node_id))
        best.actors.add(actor)
        best.placed += 1
        self.node_of[actor] = self.placed_on[actor] = best.node_id
        return best.node_id

    def remove(self, actor: str) -> None:
        node_id = self.node_of.pop(actor, None)
        self.ready.discard(actor)
        if node_id is not None:
            self.nodes[node_id].actors.discard(actor)

    def usable(self, actor: str) -> bool:
        """Whether `actor`'s node is alive and not excluded (an actor elsewhere gets no more work)."""
        record = self.nodes.get(self.node_of.get(actor, ""))
        return record is not None and record.alive and record.excluded is None

    def _usable(self) -> list[NodeRecord]:
        return [r for r in self.nodes.values() if r.alive and r.excluded is None]

    # ---- attempts ------------------------------------------------------------------------------
    def succeeded(self, actor: str) -> None:
        record = self.nodes.get(self.placed_on.get(actor, ""))
        if record is not None:
            record.shards += 1
            record.streak.clear()

    def failed(self, actor: str, shard_id: str, line: str) -> str | None:
        """An attempt of `shard_id` failed on the node `actor` was placed on (whether or not the actor is
        still there): the shard avoids that node from now on; returns the node id if this failure
        excludes it."""
        record = self.nodes.get(self.placed_on.get(actor, ""))
        if record is None:
            return None
        self.avoid.setdefault(_base(shard_id), set()).add(record.node_id)
        record.failures += 1
        record.streak.add(_base(shard_id))
        others = [r for r in self._usable() if r is not record and r.capacity > 0]
        if record.excluded is None and len(record.streak) >= self.limit and others:
            record.excluded = f"{len(record.streak)} different shards failed in a row (last: {line})"
            return record.node_id
        return None

    def may_run(self, shard_id: str, actor: str) -> bool:
        """Whether `actor` should take `shard_id`: not on a node the shard failed on, unless no other
        usable node holds an actor of ours (then waiting would wait forever)."""
        avoid = self.avoid.get(_base(shard_id))
        node_id = self.node_of.get(actor)
        if not avoid or node_id not in avoid:
            return True
        return not any(r.node_id not in avoid and r.actors & self.ready for r in self._usable())

    def actors_on(self, node_id: str) -> list[str]:
        return sorted(self.nodes[node_id].actors) if node_id in self.nodes else []

    def all_excluded(self) -> bool:
        """Every node that ever could hold an actor is excluded (nodes that only left may come back: the
        pool waits for them)."""
        able = [r for r in self.nodes.values() if r.capacity > 0]
        return bool(able) and all(r.excluded is not None for r in able)

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per node, for job.json: capacity, actors placed, shards committed, failed attempts, exclusion."""
        return {node_id: r.summary() for node_id, r in sorted(self.nodes.items())}


def _base(shard_id: str) -> str:
    """A split piece (`<shard>~0~1`) avoids what its shard avoided."""
    return shard_id.split("~", 1)[0]
