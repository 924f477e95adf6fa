"""Which output directory a job writes: `runner.layout.OutputDir` for a local path,
`runner.object_layout.ObjectOutputDir` for an object-store URI — the two share one interface
(commit, committed, read_part, finish, ...), so the driver, the workers and `read_output` never ask."""

from __future__ import annotations

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
