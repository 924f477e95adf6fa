"""The Ray executor's unit of work: a replica — one `ShardWorker` actor, or with
`runtime.tensor_parallel_size` = N a Ray placement group of N bundles on one node (`STRICT_PACK`)
holding N rank actors, started together and torn down together.

Shards go to rank 0 (`leader`), which drives the others through the engine (`runtime.tensor_parallel`).
Start-up is three calls that Ray chains without the driver waiting: rank 0 opens a rendezvous on its
node (`host_rendezvous`); every rank loads its engine meeting there (`join_replica`, the followers
receiving rank 0's spec as an object reference); each follower then enters `follow`, whose reference
the executor watches: it ends only when the follower dies or its replica broke, and then the whole
replica goes (`kill`), its shard in flight failing and being retried like any other.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Replica:
    name: str
    leader: Any  # the actor handle shards are sent to (rank 0)
    followers: list[Any] = field(default_factory=list)  # ranks 1 .. N-1
    group: Any = None  # the placement group (tensor-parallel replicas only)
    watch: dict[Any, int] = field(default_factory=dict)  # follow() reference -> the rank it watches

    def kill(self, ray: Any) -> None:
        """Every rank ends and the placement group's resources go back to the cluster."""
        for handle in (self.leader, *self.followers):
            with contextlib.suppress(Exception):
                ray.kill(handle, no_restart=True)
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(self.group)
            self.group = None


def bundle_of(options: dict[str, Any]) -> dict[str, float]:
    """The resources one rank's actor asks for, as a placement-group bundle."""
    bundle = {"CPU": float(options.get("num_cpus", 1)), "GPU": float(options.get("num_gpus", 0)),
              **{k: float(v) for k, v in options.get("resources", {}).items()}}
    return {k: v for k, v in bundle.items() if v}


def start_replica(ray: Any, remote_cls: Any, options: dict[str, Any], size: int, name: str,
                  args: tuple) -> tuple[Replica, Any]:
    """Start one replica of `size` ranks whose actors take `options` each and are built with `args`
    (job, context); returns it and the reference that resolves to rank 0's `ready()` answer once every
    rank has loaded (or to why one did not)."""
    if size == 1:
        handle = remote_cls.options(name=name, max_restarts=0, **options).remote(*args, name, True)
        return Replica(name, handle), handle.ready.remote()
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = placement_group([bundle_of(options)] * size, strategy="STRICT_PACK", name=f"{name}-ranks")
    handles = []
    for rank in range(size):
        strategy = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=rank)
        actor = f"{name}-rank{rank}"
        handles.append(remote_cls.options(name=actor, max_restarts=0, scheduling_strategy=strategy, **options)
                       .remote(*args, actor, True, rank))
    leader, followers = handles[0], handles[1:]
    spec = leader.host_rendezvous.remote(size)
    for handle in followers:
        handle.join_replica.remote(spec)  # the spec reference resolves before the call runs
    boot = leader.join_replica.remote(None)
    watch = {handle.follow.remote(): rank for rank, handle in enumerate(followers, 1)}
    return Replica(name, leader, followers, group, watch), boot
