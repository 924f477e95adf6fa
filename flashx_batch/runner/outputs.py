"""Which output directory a job writes: `runner.layout.OutputDir` for a local path,
`runner.object_layout.ObjectOutputDir` for an object-store URI — the two share one interface
(commit, committed, read_part, finish, ...), so the driver, the workers and `read_output` never ask;
and whether a local one can be written (`check_output_location`, preflight)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from flashx_batch import storage
from flashx_batch.runner.layout import OutputDir
from flashx_batch.runner.object_layout import ObjectOutputDir

if TYPE_CHECKING:
    from flashx_batch.runner.faults import Faults

Output = OutputDir | ObjectOutputDir


def open_output(root: str | Path, faults: Faults | None = None, job_digest: str | None = None) -> Output:
    """The output directory at `root` (a local path or an s3:// / gs:// / hdfs:// ... URI)."""
    root = output_root(str(root))
    if isinstance(root, str):
        return ObjectOutputDir(root, faults, job_digest)
    return OutputDir(root, faults, job_digest)


def output_root(path: str) -> Path | str:
    """output.dir as the layouts take it: an absolute local path, or an object-store URI as given."""
    return path.rstrip("/") if storage.is_remote(path) else Path(path).expanduser().resolve()


def check_output_location(path: str) -> None:
    """What makes a local output.dir unusable, found in preflight (before Ray starts or anything is planned):
    a file where the directory (or one of its parents) should be, or a nearest existing parent this user
    cannot write. Raises ConfigError. Object-store outputs are checked when their lock is taken."""
    from flashx_batch.errors import ConfigError

    root = output_root(path)
    if isinstance(root, str):
        return
    for where in [root, *root.parents]:
        if not where.exists():
            continue
        if not where.is_dir():
            what = "is a file" if where == root else f"has a file in its path: {where}"
            raise ConfigError(f"output.dir={path} {what}; the output is a directory. Pick another output.dir, or "
                              "move the file away.")
        if not os.access(where, os.W_OK | os.X_OK):
            raise ConfigError(f"output.dir={path}: cannot create it, {where} is not writable by this user; pick a "
                              "directory you can write.")
        return
