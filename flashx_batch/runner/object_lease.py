"""The run lock of an object-store output directory (`runner.object_layout.ObjectOutputDir.lock`): a
lease object `_lease.json` (owner, host, pid, expiry) renewed by a thread. Another run is refused
(exit 75) while it is live; a lease whose process is gone on the same host is taken over at once.
Two drivers racing for a free lease are told apart by reading it back after `_SETTLE_S`; should
both ever run, the commit rules of `object_layout` still give every row once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from flashx_batch import storage
from flashx_batch.job_errors import LockHeldError

log = logging.getLogger(__name__)
LEASE = "_lease.json"
_SETTLE_S = 1.0  # how long a new owner waits before reading its lease back


class ObjectLease:
    """The single-writer lease of the object-store output directory at `root`, read, written and
    deleted through the directory's own calls (`read(name) -> bytes`, `write(name, bytes)`,
    `delete(name)`, names relative to `root`)."""

    def __init__(self, root: str, read: Callable[[str], bytes], write: Callable[[str, bytes], None],
                 delete: Callable[[str], None]) -> None:
        self.root, self._read, self._write, self._delete = root, read, write, delete
        self.ttl = storage.settings().lease_ttl_s
        self.owner = uuid.uuid4().hex
        self.host, self.pid = socket.gethostname(), os.getpid()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost: str | None = None  # why this run no longer holds the lease (the finish refuses then)

    def _record(self) -> bytes:
        return json.dumps({"owner": self.owner, "host": self.host, "pid": self.pid,
                           "expires_at": time.time() + self.ttl}).encode()

    def _current(self) -> dict[str, Any] | None:
        try:
            return json.loads(self._read(LEASE))
        except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
            return None

    def _held_by_other(self, lease: dict[str, Any] | None) -> bool:
        if lease is None or lease.get("owner") == self.owner:
            return False
        if float(lease.get("expires_at", 0)) < time.time():
            return False
        if lease.get("host") == self.host and not _alive(int(lease.get("pid", 0))):
            return False  # the same machine, and that process is gone: a crash, taken over at once
        return True

    def acquire(self) -> None:
        lease = self._current()
        if self._held_by_other(lease):
            raise LockHeldError(_held_message(self.root, lease))
        created = storage.put_if_absent(f"{self.root}/{LEASE}", self._record()) if lease is None else None
        if created is False:  # another driver created it between our read and our put
            raise LockHeldError(_held_message(self.root, self._current()))
        if created is None:
            self._write(LEASE, self._record())
        time.sleep(_SETTLE_S)  # a racing driver's write lands in this window; whoever wrote last owns it
        lease = self._current()
        if lease is None or lease.get("owner") != self.owner:
            raise LockHeldError(_held_message(self.root, lease))
        self._thread = threading.Thread(target=self._renew, name="flashx-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        renewed = time.time()
        while not self._stop.wait(self.ttl / 3):
            try:
                lease = self._current()
                if lease is not None and lease.get("owner") != self.owner:
                    self.lost = f"{lease.get('host')} pid {lease.get('pid')} took the lease"
                    return
                self._write(LEASE, self._record())
                renewed = time.time()
            except OSError as exc:  # a blip: the next renewal retries, until the lease would have expired
                log.warning("could not renew the lease on %s: %s", self.root, exc)
                if time.time() - renewed > self.ttl:
                    self.lost = f"not renewed for {self.ttl:.0f} s ({exc})"
                    return

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with contextlib.suppress(OSError):
            lease = self._current()
            if lease is not None and lease.get("owner") == self.owner:
                self._delete(LEASE)


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _held_message(root: str, lease: dict[str, Any] | None) -> str:
    who = f"{lease.get('host')} pid {lease.get('pid')}" if lease else "another run"
    left = max(0.0, float(lease.get("expires_at", 0)) - time.time()) if lease else 0.0
    return (f"another run is writing to {root} ({who} holds {root}/{LEASE}, valid {left:.0f} s more unless "
            "renewed); try again once it has finished.")
