"""Fault hooks: failures the reliability tests arm at named points of a shard's life.

Who calls it: `runner.job` builds a `Faults` from `executor.faults` and the `FLASHX_FAULTS`
environment variable (`;`-separated) and hands it to every worker in `WorkerContext`;
`runner.worker` fires `before_generate` / `after_generate`, `runner.layout` fires `write`,
`after_publish` and `before_manifest`. Off by default, and then `load` returns None and every call
site skips the hook behind one `is not None` test — no cost on a production run.

A spec is `ACTION[:key=value]...`:
  crash    SIGKILL the process (a Ray actor, or the driver under executor.kind=local) at `at=`
  hang     sleep forever (the watchdog's case)                       default at=before_generate
  fatal    raise FatalEngineError (a dead device)                    default at=before_generate
  enospc   fail the staged write of one file with ENOSPC             default at=write
  kill_rank SIGKILL rank 1 of this worker's tensor-parallel replica    default at=before_generate
  delay    sleep `seconds=` (default 1) and go on: a slow node          default at=before_generate
Point `job_json` is the driver writing job.json; there `shard=` matches the status being written
(`running`, `succeeded`, ...), e.g. `enospc:at=job_json:shard=succeeded` (a disk full at the end).
Filters (all optional, all must match): `at=` point, `shard=` glob on the piece id, `attempt=N`,
`row=ID` (the piece holds that row id), `kind=` generations|errors|stats (for `write`), `node=` the
Ray node id or host name of the worker (a bad node).
Examples: `crash:at=after_publish:attempt=1`, `crash:row=17` (a poison row), `hang:row=3`,
`fatal:attempt=1:shard=b05-*`, `enospc:kind=generations`.
"""

from __future__ import annotations

import errno
import fnmatch
import logging
import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from flashx_batch.errors import ConfigError
from flashx_batch.job_errors import FatalEngineError

log = logging.getLogger(__name__)
ENV_VAR = "FLASHX_FAULTS"
POINTS = ("before_generate", "after_generate", "write", "after_publish", "before_manifest", "job_json")
DEFAULT_POINT = {"hang": "before_generate", "fatal": "before_generate", "enospc": "write",
                 "kill_rank": "before_generate", "delay": "before_generate"}
_KEYS = ("at", "shard", "attempt", "row", "kind", "node", "seconds")


@dataclass(frozen=True)
class Fault:
    action: str
    at: str
    shard: str = "*"
    attempt: int | None = None
    row: str | None = None
    kind: str | None = None
    node: str | None = None  # the Ray node id (or host name) of the worker it fires on
    seconds: float = 1.0  # delay: how long

    def matches(self, point: str, shard: str, attempt: int, ids: Iterable[Any] | None, kind: str | None,
                nodes: tuple[str, ...] = ()) -> bool:
        return (self.at == point and fnmatch.fnmatchcase(shard, self.shard)
                and (self.node is None or self.node in nodes)
                and (self.attempt is None or self.attempt == attempt)
                and (self.kind is None or self.kind == kind)
                and (self.row is None or (ids is not None and self.row in {str(i) for i in ids})))


@dataclass(frozen=True)
class Faults:
    """The armed faults of one job; small and picklable (it travels to each actor)."""

    faults: tuple[Fault, ...] = field(default_factory=tuple)

    def fire(self, point: str, shard: str, attempt: int, ids: Iterable[Any] | None = None,
             kind: str | None = None, peers: tuple[int, ...] = ()) -> None:
        """Act out the first armed fault matching this point, if any; returns only if none matched.
        `peers`: the process ids of the other ranks of the worker's tensor-parallel replica."""
        ids = list(ids) if ids is not None else None
        nodes = _this_node()
        for f in self.faults:
            if f.matches(point, shard, attempt, ids, kind, nodes):
                _act(f, point, shard, attempt, kind, peers)
                return


def _this_node() -> tuple[str, ...]:
    """This process's Ray node id (inside Ray) and host name: what `node=` matches."""
    import socket
    import sys

    ray = sys.modules.get("ray")
    node_id = ray.get_runtime_context().get_node_id() if ray is not None and ray.is_initialized() else None
    return tuple(x for x in (node_id, socket.gethostname()) if x)


def _act(f: Fault, point: str, shard: str, attempt: int, kind: str | None, peers: tuple[int, ...] = ()) -> None:
    what = f"injected fault {f.action} at {point} of {shard} attempt {attempt}"
    log.warning("%s", what)
    if f.action == "crash":
        logging.shutdown()  # flush the warning: the point of a SIGKILL is that nothing else runs
        os.kill(os.getpid(), signal.SIGKILL)
    if f.action == "hang":
        while True:  # only a kill (the watchdog) or a signal handler's exit ends this
            time.sleep(0.5)
    if f.action == "fatal":
        raise FatalEngineError(what)
    if f.action == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device ({what}, {kind})")
    if f.action == "delay":
        time.sleep(f.seconds)
        return
    if f.action == "kill_rank":  # the ranks of a replica share one node: the pid is this machine's
        if not peers:
            raise RuntimeError(f"{what}: this worker has no other tensor-parallel ranks to kill")
        os.kill(peers[0], signal.SIGKILL)


def parse(spec: str) -> Fault:
    """One spec string → a Fault; ConfigError (exit 2) naming what is wrong."""
    action, *pairs = spec.strip().split(":")
    if action not in ("crash", "hang", "fatal", "enospc", "kill_rank", "delay"):
        raise ConfigError(f"fault {spec!r}: unknown action {action!r}; use crash, hang, fatal, enospc, kill_rank or "
                          "delay.")
    values: dict[str, Any] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or key not in _KEYS:
            raise ConfigError(f"fault {spec!r}: {pair!r} is not one of {', '.join(k + '=' for k in _KEYS)}.")
        values[key] = value
    # `crash:row=ID` (a poison row) kills the worker as the shard starts; other crashes name their point
    values.setdefault("at", DEFAULT_POINT.get(action) or ("before_generate" if "row" in values else None))
    if values["at"] not in POINTS:
        raise ConfigError(f"fault {spec!r}: at={values['at']} is not one of {', '.join(POINTS)}.")
    if values.get("attempt") is not None:
        if not values["attempt"].isdigit():
            raise ConfigError(f"fault {spec!r}: attempt={values['attempt']} is not a positive integer.")
        values["attempt"] = int(values["attempt"])
    if values.get("seconds") is not None:
        try:
            values["seconds"] = float(values["seconds"])
        except ValueError:
            raise ConfigError(f"fault {spec!r}: seconds={values['seconds']} is not a number.") from None
    return Fault(action, **values)


def load(specs: list[str], environ: dict[str, str] | None = None, quiet: bool = False) -> Faults | None:
    """`executor.faults` plus `$FLASHX_FAULTS`; None when nothing is armed (the production case).
    Raises ConfigError for a malformed spec; `quiet` skips the warning (a validation-only call)."""
    env = (os.environ if environ is None else environ).get(ENV_VAR, "")
    all_specs = [s for s in [*specs, *env.split(";")] if s.strip()]
    if not all_specs:
        return None
    faults = Faults(tuple(parse(s) for s in all_specs))
    if not quiet:
        log.warning("fault injection armed: %s", "; ".join(all_specs))
    return faults


def driver_faults(specs: list[str]) -> Faults | None:
    """The armed faults of the driver's own writes (point `job_json`); the others belong to workers."""
    armed = load(specs, quiet=True)
    mine = tuple(f for f in armed.faults if f.at == "job_json") if isinstance(armed, Faults) else ()
    return Faults(mine) if mine else None
