"""A spawned rank of a local tensor-parallel replica (`runtime.tensor_parallel.LocalRanks` starts it as
`python -c "from flashx_batch.runtime.rank_process import main; main()"`): its arguments arrive pickled
on stdin; it joins rank 0's rendezvous, builds its engine and follows rank 0 until told to stop."""

from __future__ import annotations

import logging
import os
import pickle
import sys
from pathlib import Path

from flashx_batch.backends.distributed import Rendezvous, ReplicaBroken
from flashx_batch.runtime.engine import Engine
from flashx_batch.runtime.tensor_parallel import follow


def main() -> None:
    """A spawned rank (`LocalRanks`): its arguments pickled on stdin; join rank 0's rendezvous, build the
    engine, follow until stopped."""
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
