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
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from flashx_batch.backends import Backend
from flashx_batch.backends.distributed import Communicator, RankSpec, Rendezvous, ReplicaBroken
from flashx_batch.runtime.options import EngineOptions

log = logging.getLogger(__name__)

# the runner calls that run the model: sent to every rank (anything else read through a ReplicaRunner
# is rank 0's own state: sizes, traits, the tokenizer's view)
MIRRORED = frozenset({"run", "reset", "score", "target_logprobs", "packed_target_logprobs", "prompt_surprisal"})
LOCAL_ONLY = frozenset({"synchronize"})
_STOP = "stop"


class ReplicaRunner:
    """Rank 0's runner of a tensor-parallel replica: the real `TorchRunner`, with every `MIRRORED` call
    sent to the other ranks first. Calling any other runner method (the research tools' direct
    `extend`, ...) is refused: the other ranks would not take part in its collectives."""

    def __init__(self, runner: Any, comm: Communicator) -> None:
        self._runner, self._comm = runner, comm

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._runner, name)
        if name in MIRRORED:
            def mirrored(*args: Any, **kwargs: Any) -> Any:
                if name == "reset" and self._comm.broken is not None:
                    return value()  # cleaning up after the failure that broke the replica: that error stands
                self._comm.send_object((name, args, kwargs))
                return value(*args, **kwargs)

            return mirrored
        if callable(value) and hasattr(value, "__self__") and name not in LOCAL_ONLY:
            raise TypeError(f"runner.{name}() is not available on a tensor-parallel replica (only the engine's own "
                            "calls reach every rank); run it with tensor_parallel_size=1")
        return value

    def stop_followers(self) -> None:
        """Tell the other ranks to leave `follow` (they return; their processes or actors end)."""
        self._comm.send_object((_STOP, (), {}))


def follow(runner: Any, comm: Communicator) -> None:
    """A follower rank's life: replay each call rank 0 sends until it says stop. An error a call raises
    here is raised on rank 0 too (the same call on the same inputs: rank 0 reports it), so the rank
    stays in step and waits for the next call; a broken replica (ReplicaBroken) ends the loop."""
    while True:
        name, args, kwargs = comm.receive_object()
        if name == _STOP:
            return
        try:
            getattr(runner, name)(*args, **kwargs)
        except ReplicaBroken:
            raise
        except Exception as exc:
            log.debug("rank %d: %s raised %s (rank 0 reports it)", comm.rank, name, type(exc).__name__)


class Replica:
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
              rendezvous: Rendezvous | None) -> Replica:
        """Join the replica `rendezvous` belongs to; None: this process is rank 0 of a new local replica,
        whose other ranks are spawned here."""
        if rendezvous is not None:
            return cls(rendezvous, None)
        rendezvous = Rendezvous.host(options.tensor_parallel_size)
        return cls(rendezvous, LocalRanks(model_dir, options, onnx_cache_dir, rendezvous.spec))

    def device_index(self, backend: Backend, assigned: Callable[[], int]) -> int:
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
        if isinstance(runner, ReplicaRunner) and self.comm is not None and self.comm.broken is None:
            try:
                runner.stop_followers()
            except ReplicaBroken:
                pass
        if self.local is not None:
            self.local.close()


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
        for r in range(1, spec.size):
            args = (str(model_dir), options, onnx_cache_dir, dataclasses.replace(spec, rank=r, device_index=r))
            p = subprocess.Popen([sys.executable, "-c", _RANK_ENTRY], stdin=subprocess.PIPE, env=env)
            p.stdin.write(pickle.dumps(args))
            p.stdin.close()
            self.processes.append(p)
        self._finalizer = weakref.finalize(self, _terminate, list(self.processes))

    def alive(self) -> str | None:
        """Why a rank can no longer come (its process exited), or None."""
        gone = [f"rank {r} exited with code {p.returncode}" for r, p in enumerate(self.processes, 1)
                if p.poll() is not None]
        return "; ".join(gone) if gone else None

    def close(self, timeout_s: float = 10.0) -> None:
        for p in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout_s)
        self._finalizer()


_RANK_ENTRY = "from flashx_batch.runtime.tensor_parallel import local_rank_main; local_rank_main()"


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


def local_rank_main() -> None:
    """A spawned rank (`LocalRanks`): its arguments pickled on stdin; join rank 0's rendezvous, build the
    engine, follow until stopped."""
    from flashx_batch.runtime.engine import Engine

    model_dir, options, onnx_cache_dir, spec = pickle.loads(sys.stdin.buffer.read())
    logging.basicConfig(level=logging.WARNING, format=f"rank {spec.rank}: %(levelname)s %(name)s: %(message)s")
    try:
        rendezvous = Rendezvous.join(spec)
        engine = Engine(Path(model_dir), options, onnx_cache_dir, rendezvous=rendezvous)
        follow(engine.runner, engine.replica.comm)
    except ReplicaBroken as exc:
        print(f"flashx-batch tensor-parallel rank {spec.rank}: {exc}", file=sys.stderr, flush=True)
        os._exit(1)
    except BaseException as exc:  # rank 0 has been told (Engine.__init__) and reports it
        print(f"flashx-batch tensor-parallel rank {spec.rank}: {type(exc).__name__}: {exc}", file=sys.stderr,
              flush=True)
        os._exit(1)
    # no interpreter teardown: the collective library's threads are still attached to the group
    os._exit(0)
