"""Tensor-parallel replicas of the torch engine: rank 0 drives, the other ranks follow.

Every rank builds the same `Engine` around its own share of the weights (`models.parallel`) and a KV
arena of the same slots for its own KV heads. Only rank 0's scheduler plans: rank 0's runner is a
`ReplicaRunner`, which sends each call that runs the model (`MIRRORED`: the step plans, teacher-forced
scoring, resets) to the other ranks before running it; they `follow`, replaying it on their runners,
so every rank enters the same forward passes in the same order and meets the others in the same
collectives. Merge decisions need no extra messages: the attention scores they rank are all-reduced
and the surprisal comes from all-gathered logits, so every rank computes the same plan. Sampled
tokens are rank 0's, broadcast (`TorchRunner._sample`).

Ranks come from one of two places: `LocalRanks` (the Python API and the local executor: N - 1
processes spawned on this machine, rank r on device r), or a Ray placement group whose actors each
join with a `RankSpec` (`runner.replicas`). Either way a rank that dies breaks its replica's
collectives (`ReplicaBroken` on the others), and the replica is rebuilt as a whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import subprocess
import sys
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from flashx_batch.backends import Backend
from flashx_batch.backends.distributed import Communicator, RankSpec, Rendezvous, ReplicaBroken
from flashx_batch.runtime.options import EngineOptions

log = logging.getLogger(__name__)

# the runner calls that run the model: sent to every rank
MIRRORED = frozenset({"run", "reset", "score", "target_logprobs", "packed_target_logprobs", "prompt_surprisal"})
# what else may be read through a ReplicaRunner: rank 0's own state (sizes, traits, settings, the modules for
# inspection); anything else (the compression helper, direct forward methods) would run collectives on rank 0
# alone
READABLE = frozenset({"kv_bytes", "kv_bytes_per_slot", "traits", "packs_rows", "merge", "graphs", "policy",
                      "device", "model", "arena", "synchronize"})
_STOP = "stop"


class ReplicaRunner:
    """Rank 0's runner of a tensor-parallel replica: the real `TorchRunner`, with every `MIRRORED` call
    sent to the other ranks first. Anything not `MIRRORED` or `READABLE` is refused (the research tools'
    direct `extend`, `compress`): the other ranks would not take part in its collectives.

    A mirrored call that raises breaks the replica: the ranks may have stopped in different collectives,
    so none of them can be trusted to be in step again. The error is raised as ReplicaBroken (naming
    the original), `on_broken` ends the other ranks, and every later call is refused."""

    def __init__(self, runner: Any, comm: Communicator, on_broken: Callable[[], None] = lambda: None) -> None:
        self._runner, self._comm, self._on_broken = runner, comm, on_broken

    def __getattr__(self, name: str) -> Any:
        if name in MIRRORED:
            return lambda *args, **kwargs: self._mirrored(name, args, kwargs)
        if name not in READABLE:
            raise TypeError(f"runner.{name} is not available on a tensor-parallel replica (only the engine's own "
                            "calls reach every rank); use tensor_parallel_size=1 for it")
        return getattr(self._runner, name)

    def _mirrored(self, name: str, args: tuple, kwargs: dict) -> Any:
        method = getattr(self._runner, name)
        if name == "reset" and self._comm.broken is not None:
            return method()  # cleaning up after the failure that broke the replica: that error stands
        try:
            # a step's grammar masks stay on rank 0, which samples for every rank
            self._comm.send_object((name, args, {k: v for k, v in kwargs.items() if k != "masks"}))
            return method(*args, **kwargs)
        except ReplicaBroken:
            self._on_broken()
            raise
        except Exception as exc:
            self._comm.broken = f"runner.{name} raised {type(exc).__name__}: {exc}"
            self._on_broken()
            raise ReplicaBroken(f"rank 0 of {self._comm.size}: {self._comm.broken}; the replica's ranks may be out "
                                "of step, so it is stopped (start a new engine)") from exc

    def stop_followers(self) -> None:
        """Tell the other ranks to leave `follow` (they return; their processes or actors end)."""
        self._comm.send_object((_STOP, (), {}))


def follow(runner: Any, comm: Communicator) -> None:
    """A follower rank's life: replay each call rank 0 sends until it says stop. Any error ends it as
    ReplicaBroken: this rank may have stopped in another collective than the others (rank 0 learns of
    it when this rank's connections close, and the replica is rebuilt)."""
    while True:
        name, args, kwargs = comm.receive_object()
        if name == _STOP:
            return
        try:
            getattr(runner, name)(*args, **kwargs)
        except ReplicaBroken:
            raise
        except Exception as exc:
            comm.broken = f"runner.{name} raised {type(exc).__name__}: {exc}"
            raise ReplicaBroken(f"rank {comm.rank} of {comm.size}: {comm.broken}") from exc


class ReplicaRank:
    """One rank's membership of a tensor-parallel replica: its rendezvous, its communicator, and on
    rank 0 of a local replica the processes of the other ranks."""

    def __init__(self, rendezvous: Rendezvous, local: LocalRanks | None) -> None:
        self.rendezvous, self.local = rendezvous, local
        self.comm: Communicator | None = None
        self.closed = False

    @property
    def rank(self) -> int:
        return self.rendezvous.spec.rank

    @property
    def size(self) -> int:
        return self.rendezvous.spec.size

    @classmethod
    def start(cls, model_dir: Path, options: EngineOptions, onnx_cache_dir: Path | None,
              rendezvous: Rendezvous | None) -> ReplicaRank:
        """Join the replica `rendezvous` belongs to; None: this process is rank 0 of a new local replica,
        whose other ranks are spawned here."""
        if rendezvous is not None:
            return cls(rendezvous, None)
        rendezvous = Rendezvous.host(options.tensor_parallel_size)
        return cls(rendezvous, LocalRanks(model_dir, options, onnx_cache_dir, rendezvous.spec))

    def device_index(self, assigned: Callable[[], int]) -> int:
        """The device this rank drives: the spec's (local ranks: rank r on device r), else `assigned()`."""
        index = self.rendezvous.spec.device_index
        return assigned() if index is None else index

    def connect(self, backend: Backend, device: torch.device) -> Communicator:
        """Meet the other ranks and form the collective group (blocks until all have come)."""
        if self.rank == 0:
            self.rendezvous.wait_for_ranks(self.local.alive if self.local is not None else lambda: None)
        else:
            self.rendezvous.announce()
        self.comm = Communicator(self.rendezvous, backend.collective, device)
        return self.comm

    def fail_before_connecting(self, reason: str) -> None:
        """A follower that cannot get as far as `connect`: rank 0 reports `reason` instead of waiting."""
        if self.rank:
            self.rendezvous.announce(reason)

    def close(self, runner: Any = None) -> None:
        """Rank 0: stop the followers (through `runner`, a ReplicaRunner, when the replica still works)
        and end the local processes."""
        if self.closed:
            return
        self.closed = True
        healthy = self.comm is not None and self.comm.broken is None
        if isinstance(runner, ReplicaRunner) and healthy:
            try:
                runner.stop_followers()
            except ReplicaBroken:
                healthy = False
        if self.local is not None:
            self.local.close(10.0 if healthy else 0.0)  # a broken replica's ranks may wait in a collective


class LocalRanks:
    """Ranks 1 .. N-1 of a replica as processes of this machine (rank r drives device r). Each is a fresh
    interpreter (`python -c`, not multiprocessing: no re-import of the caller's script, no CUDA state
    inherited) that builds its engine and follows rank 0 until told to stop. A rank whose rank 0
    dies sees its connections close and exits."""

    def __init__(self, model_dir: Path, options: EngineOptions, onnx_cache_dir: Path | None, spec: RankSpec) -> None:
        env = dict(os.environ)
        package_parent = str(Path(__file__).resolve().parents[2])  # this source tree, installed or not
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join([package_parent, *paths])
        self.processes: list[subprocess.Popen] = []
        self._finalizer = weakref.finalize(self, _terminate, self.processes)  # also those started before a failure
        for r in range(1, spec.size):
            args = (str(model_dir), options, onnx_cache_dir, dataclasses.replace(spec, rank=r, device_index=r))
            p = subprocess.Popen([sys.executable, "-c", _RANK_ENTRY], stdin=subprocess.PIPE, env=env)
            self.processes.append(p)
            p.stdin.write(pickle.dumps(args))
            p.stdin.close()

    def alive(self) -> str | None:
        """Why a rank can no longer come (its process exited), or None."""
        gone = [f"rank {r} exited with code {p.returncode}" for r, p in enumerate(self.processes, 1)
                if p.poll() is not None]
        return "; ".join(gone) if gone else None

    def close(self, timeout_s: float = 10.0) -> None:
        """Wait up to `timeout_s` (in all) for the ranks to exit by themselves, then end the rest."""
        deadline = time.monotonic() + timeout_s
        for p in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.0, deadline - time.monotonic()))
        self._finalizer()


_RANK_ENTRY = "from flashx_batch.runtime.rank_process import main; main()"


def _terminate(processes: list[subprocess.Popen]) -> None:
    for p in processes:
        if p.poll() is None:
            p.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5)


def local_thread_share(options: EngineOptions) -> EngineOptions:
    """The options each rank of a local CPU replica runs with: this process's cores shared out."""
    if options.num_threads is not None:
        return options
    share = max(1, options.cpu_threads() // options.tensor_parallel_size)
    return dataclasses.replace(options, num_threads=share)
