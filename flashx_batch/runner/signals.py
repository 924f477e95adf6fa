"""SIGINT / SIGTERM → a stop request the executors poll, so in-flight shards can still commit.

Who calls it: `runner.job.run` installs one `StopFlag` for the whole run, so a scheduler sees 130 /
143 whatever the moment. While nothing is written yet (planning, preflight, Ray start-up) the flag
is `immediate`: the first signal raises `Interrupted` at once. Once the output directory is open,
executors check `stop.requested` before dispatching each shard, and the driver checks it again
before the report and `_SUCCESS`. A second signal, or the grace period running out, ends the
process at once with the same exit code: the commit protocol makes that safe (a resumed run
cleans the half-written attempt), it only costs the work in flight.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


class Interrupted(BaseException):  # noqa: N818 - like KeyboardInterrupt: not an error, a stop
    """A signal arrived while nothing was written yet: the run ends at once with `code` (130 / 143)."""

    def __init__(self, code: int) -> None:
        super().__init__(f"interrupted (exit {code})")
        self.code = code


class StopFlag:
    def __init__(self, grace_period_s: float, on_force: Callable[[int], None] | None = None,
                 immediate: bool = False) -> None:
        self.grace_period_s = grace_period_s
        self.immediate = immediate  # nothing written yet: the first signal stops at once
        self.signum: int | None = None
        self._on_force = on_force  # last words before a forced exit (job.json status)
        self._previous: dict[int, object] = {}
        self._timer: threading.Timer | None = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.signum, 1) if self.signum is not None else 0

    def install(self) -> StopFlag:
        # Signal handlers can only be set from the main thread; elsewhere (a test calling run()
        # from a thread) stopping is the caller's business.
        if threading.current_thread() is threading.main_thread():
            for sig in EXIT_CODES:
                previous = signal.signal(sig, self._handle)
                self._previous.setdefault(sig, previous)  # re-installing keeps the original to restore
        return self

    def set_on_force(self, on_force: Callable[[int], None] | None) -> None:
        self._on_force = on_force

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self._timer is not None:
            self._timer.cancel()

    def request(self, signum: int) -> None:
        """Ask for a stop as if `signum` had arrived (tests, and the handler itself)."""
        if self.immediate:
            self.signum = signum
            log.warning("%s received before any output was written: stopping", signal.Signals(signum).name)
            raise Interrupted(self.exit_code)
        if self.signum is not None:
            log.warning("second signal: stopping now; in-flight shards will be redone on resume")
            self._force()
            return
        self.signum = signum
        log.warning("%s received: no new shards; waiting up to %.0fs for in-flight shards to commit "
                    "(send it again to stop now)", signal.Signals(signum).name, self.grace_period_s)
        self._timer = threading.Timer(self.grace_period_s, self._force)
        self._timer.daemon = True
        self._timer.start()

    def _handle(self, signum: int, frame: object) -> None:
        self.request(signum)

    def _force(self) -> None:
        code = self.exit_code
        if self._on_force is not None:
            try:
                self._on_force(code)
            except Exception:  # a failing status write must not block the exit
                log.exception("could not record the interruption")
        logging.shutdown()
        os._exit(code)

    def __enter__(self) -> StopFlag:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()
