"""Progress of a run: a one-line bar on a TTY, rate-limited log lines otherwise.

Who calls it: the executors, once per committed shard (`advance`) and while waiting (`tick`). Off a TTY
(a log file, a scheduler's capture) a line is written every `interval_s` or each 5 % of the rows,
whichever comes first, and once at the end: a 20,000-row job logs tens of lines, not one per shard.
Written here (a dozen lines) rather than pulled from tqdm so the line shows what we care about:
rows done, output tokens/s and the ETA, computed from rows because that is what the job counts.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

from flashx_batch.runner.metrics import JobMetrics

log = logging.getLogger(__name__)


class Progress:
    def __init__(self, total_rows: int, done_rows: int = 0, interval_s: float = 10.0,
                 stream: TextIO | None = None, metrics: JobMetrics | None = None, tokens: bool = True) -> None:
        """`metrics`: the job's live metrics (`runner.metrics`), fed by the executors through this object.
        `tokens`: the task writes tokens (a line shows out tok/s; a scoring task's shows rows/s)."""
        self.tokens = tokens
        self.metrics = metrics or JobMetrics(None)
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.total, self.done, self.start_done = total_rows, done_rows, done_rows
        self.output_tokens = 0
        self.interval_s = interval_s
        self.started = time.monotonic()
        self._last_log = self.started
        self._logged_step = self._step()  # the last 5 % step a line was written at

    def restart_clock(self) -> None:
        """Rates count from the first dispatch, not from before the workers loaded their models."""
        self.started = self._last_log = time.monotonic()

    def advance(self, rows: int, output_tokens: int) -> None:
        self.done += rows
        self.output_tokens += output_tokens
        self.tick(force=self._step() > self._logged_step)

    def _step(self) -> int:
        return int(20 * self.done / self.total) if self.total else 20

    def tick(self, force: bool = False) -> None:
        now = time.monotonic()
        self.metrics.tokens_per_s(self.output_tokens / max(now - self.started, 1e-9))
        if self.tty:
            self.stream.write("\r" + self.line(now))
            self.stream.flush()
        elif force or now - self._last_log >= self.interval_s:
            log.info("progress: %s", self.line(now))
            self._last_log, self._logged_step = now, self._step()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\r" + self.line(time.monotonic()) + "\n")
            self.stream.flush()

    def line(self, now: float) -> str:
        elapsed = max(now - self.started, 1e-9)
        rate_rows = (self.done - self.start_done) / elapsed
        left = self.total - self.done
        eta = _clock(left / rate_rows) if rate_rows > 0 else "--:--"
        frac = self.done / self.total if self.total else 1.0
        bar = "#" * int(frac * 24)
        rate = f"{self.output_tokens / elapsed:7.1f} out tok/s" if self.tokens else f"{rate_rows:7.1f} rows/s"
        return f"[{bar:<24}] {self.done}/{self.total} rows  {rate}  ETA {eta}"


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
