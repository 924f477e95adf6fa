"""Durable file primitives of the local output directory (`runner.layout`): fsync of a file or a
directory, an atomic replace, and an exclusive hard link (the commit point of a shard).
"""

from __future__ import annotations

import errno
import os
import uuid
from pathlib import Path


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a rename is durable only once its directory is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text` so a reader sees the old or the new file, never half of one.

    A failed write (a full disk) removes its temporary file, so the space it took is given back."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def link_exclusive(src: Path, dst: Path) -> bool:
    """Create `dst` as `src`, or False where `dst` exists already: a hard link where the filesystem has
    them, else an O_EXCL create and a copy (fsynced)."""
    try:
        os.link(src, dst)
        return True
    except FileExistsError:
        return False
    except OSError as exc:  # a filesystem without hard links: O_EXCL create, then write
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EXDEV):
            raise
    try:
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as fh:
        fh.write(src.read_bytes())
        fh.flush()
        os.fsync(fh.fileno())
    return True
