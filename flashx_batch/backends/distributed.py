"""Collectives between the ranks of one tensor-parallel replica, over the backend's own library.

A replica of N ranks meets at a rendezvous (a `torch.distributed.TCPStore` hosted by rank 0 on a free
port); each rank then builds one `Communicator`: a process group of the backend's collective library
(`Backend.collective`: gloo on CPU, NCCL on CUDA / ROCm, HCCL on Ascend) made directly from that
store, so no process-global default group exists and two replicas in one process never collide.

The model calls three collectives (all-reduce after each row-parallel projection, all-gather of the
vocabulary-parallel logits, broadcast of rank 0's sampled tokens); the replica's driver sends its
calls to the other ranks with `send_object` / `receive_object`. A collective that fails (a rank died,
the connection dropped, the timeout passed) leaves the group unusable: the communicator raises
`ReplicaBroken` from then on, and the replica is torn down and rebuilt by whoever owns it.
"""

from __future__ import annotations

import datetime
import os
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

# a collective waits this long for the other ranks (a rank that died is usually seen at once: its
# connections close; this bounds a rank that hangs)
COLLECTIVE_TIMEOUT_S = 300.0


class ReplicaBroken(RuntimeError):
    """A collective of this replica failed: a rank died or stopped answering. The replica's ranks must
    be stopped and started again; no further call on this communicator can succeed."""


@dataclass(frozen=True)
class RankSpec:
    """Where one rank of a replica meets the others: rank `rank` of `size`, rendezvous at host:port
    (rank 0 hosts it). `device_index`: the local device this rank drives (None: the backend's
    assignment, e.g. the one Ray gave the actor)."""

    rank: int
    size: int
    host: str
    port: int
    device_index: int | None = None


class Rendezvous:
    """The store the ranks of one replica meet at: hosted by rank 0 (`host`), joined by the others."""

    def __init__(self, store: torch.distributed.Store, spec: RankSpec) -> None:
        self.store, self.spec = store, spec

    @classmethod
    def host(cls, size: int, bind: str | None = None, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> Rendezvous:
        """Rank 0: open the store on a free port of this machine (`bind`: the address others reach it at;
        default 127.0.0.1 for local ranks)."""
        from torch.distributed import TCPStore

        address = bind or "127.0.0.1"
        store = TCPStore(address, 0, size, True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)
        return cls(store, RankSpec(0, size, address, store.port))

    @classmethod
    def join(cls, spec: RankSpec, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> Rendezvous:
        from torch.distributed import TCPStore

        try:
            store = TCPStore(spec.host, spec.port, spec.size, False, timeout=datetime.timedelta(seconds=timeout_s))
        except (RuntimeError, ValueError) as exc:
            raise ReplicaBroken(f"rank {spec.rank}: cannot reach rank 0's rendezvous at {spec.host}:{spec.port} "
                                f"({_first_line(exc)})") from None
        return cls(store, spec)

    def announce(self, failure: str | None = None) -> None:
        """This rank has joined (or, with `failure`, could not start: rank 0 reports the reason)."""
        key = f"failed/{self.spec.rank}" if failure else f"joined/{self.spec.rank}"
        self.store.set(f"pid/{self.spec.rank}", str(os.getpid()))
        self.store.set(key, failure or "1")

    def peer_pids(self) -> tuple[int, ...]:
        """Rank 0: the process ids of the other ranks, as they announced them (fault injection's)."""
        return tuple(int(self.store.get(f"pid/{r}").decode()) for r in range(1, self.spec.size))

    def wait_for_ranks(self, alive: Callable[[], str | None] = lambda: None,
                       timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
        """Rank 0: wait until every other rank has announced itself. `alive()` returns why a rank
        cannot come any more (its process exited), or None; a failure either way is ReplicaBroken."""
        deadline = time.monotonic() + timeout_s
        waiting = set(range(1, self.spec.size))
        while waiting:
            for rank in sorted(waiting):
                if self.store.check([f"failed/{rank}"]):
                    raise ReplicaBroken(f"rank {rank} of {self.spec.size} could not start: "
                                        f"{self.store.get(f'failed/{rank}').decode()}")
                if self.store.check([f"joined/{rank}"]):
                    waiting.discard(rank)
            gone = alive()
            if gone is not None and waiting:
                raise ReplicaBroken(f"rank(s) {sorted(waiting)} of {self.spec.size} did not start: {gone}")
            if waiting and time.monotonic() > deadline:
                raise ReplicaBroken(f"rank(s) {sorted(waiting)} of {self.spec.size} did not reach the rendezvous at "
                                    f"{self.spec.host}:{self.spec.port} within {timeout_s:.0f}s")
            if waiting:
                time.sleep(0.05)


class Communicator:
    """One rank's collectives within its replica. Tensors live on `device`."""

    def __init__(self, rendezvous: Rendezvous, collective: str, device: torch.device,
                 timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
        self.rendezvous = rendezvous
        self.rank, self.size, self.device = rendezvous.spec.rank, rendezvous.spec.size, device
        self.broken: str | None = None
        self.group = _process_group(collective, rendezvous.store, self.rank, self.size, timeout_s)

    def _wait(self, work_fn: Callable[[], object], what: str) -> None:
        if self.broken is not None:
            raise ReplicaBroken(f"rank {self.rank}: the replica broke earlier ({self.broken})")
        try:
            work_fn().wait()  # type: ignore[attr-defined]
        except (RuntimeError, ValueError) as exc:
            self.broken = f"{what}: {_first_line(exc)}"
            raise ReplicaBroken(f"rank {self.rank} of {self.size}: {self.broken}; another rank of this replica "
                                "died or stopped answering") from None

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place (every rank ends with the same bits)."""
        self._wait(lambda: self.group.allreduce([tensor]), "all-reduce")
        return tensor

    def all_gather_last(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` (equal shapes) concatenated along the last dimension, in rank order."""
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        self._wait(lambda: self.group.allgather([parts], [tensor]), "all-gather")
        return torch.cat(parts, dim=-1)

    def broadcast_(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        """Rank `root`'s `tensor` into every rank's, in place."""
        self._wait(lambda: self.group.broadcast(tensor, root), "broadcast")
        return tensor

    def send_object(self, obj: object) -> None:
        """Rank 0: one picklable object to every other rank (they call `receive_object`)."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self.broadcast_(torch.tensor([len(data)], dtype=torch.int64, device=self.device))
        self.broadcast_(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device))

    def receive_object(self) -> object:
        size = self.broadcast_(torch.zeros(1, dtype=torch.int64, device=self.device))
        data = self.broadcast_(torch.empty(int(size.item()), dtype=torch.uint8, device=self.device))
        return pickle.loads(data.cpu().numpy().tobytes())

    def agree(self, failure: str | None) -> None:
        """Every rank says whether it got this far; if any did not, every rank raises ReplicaBroken
        naming the first that failed and why (so rank 0 reports a follower's load error)."""
        if failure is not None:
            self.rendezvous.store.set(f"error/{self.rank}", failure)
        flags = torch.zeros(self.size, dtype=torch.int32, device=self.device)
        flags[self.rank] = 1 if failure is not None else 0
        self.all_reduce_(flags)
        bad = [r for r, f in enumerate(flags.tolist()) if f]
        if bad:
            reason = self.rendezvous.store.get(f"error/{bad[0]}").decode()
            raise ReplicaBroken(f"rank {bad[0]} of {self.size} failed: {reason}")


def _process_group(collective: str, store, rank: int, size: int, timeout_s: float):
    """The backend library's process group over `store`, or ReplicaBroken saying why there is none."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        if collective == "gloo":
            return dist.ProcessGroupGloo(store, rank, size, timeout)
        if collective == "nccl":
            # a blocking wait raises on a failed or timed-out collective, as gloo's does, instead of leaving
            # it to NCCL's watchdog to abort the whole process
            os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            return dist.ProcessGroupNCCL(store, rank, size, options)
        if collective == "hccl":
            from torch_npu._C._distributed_c10d import ProcessGroupHCCL  # the Ascend adapter's own group

            options = ProcessGroupHCCL.Options()
            options._timeout = timeout
            return ProcessGroupHCCL(store, rank, size, options)
    except (ImportError, AttributeError) as exc:
        raise ReplicaBroken(f"the {collective} collective library is not usable here ({_first_line(exc)})") from None
    except RuntimeError as exc:
        raise ReplicaBroken(f"rank {rank} of {size}: the {collective} process group did not form "
                            f"({_first_line(exc)})") from None
    raise ReplicaBroken(f"no collective library named {collective!r} (gloo, nccl, hccl)")


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    # gloo appends generic advice to its socket errors; the first sentence says what happened
    return lines[0].split(". This is typically")[0][:300] if lines else type(exc).__name__
