"""Errors of the batch-job layer (data, runner). `ConfigError` subclasses mean "bad job": exit code 2.

Raised by `flashx_batch.data` (preflight) and `flashx_batch.runner` (output directory, resume);
`flashx_batch.runner.job.run` maps them to exit codes.
"""

from __future__ import annotations

from flashx_batch.errors import ConfigError, FlashxError


class InputError(ConfigError):
    """The input cannot be used as given: missing / empty / corrupt file, missing column, wrong type, duplicate ids."""


class OutputDirError(ConfigError):
    """`output.dir` is not ours (not empty, no job.json) or another run holds its lock."""


class FingerprintMismatchError(ConfigError):
    """`output.dir` holds a job whose results would differ from this configuration's."""

    def __init__(self, output_dir: str, fields: list[str]) -> None:
        listed = ", ".join(fields)
        super().__init__(
            f"{output_dir} holds a job with a different fingerprint (differs in: {listed}); resuming would mix "
            "results. Use a new output.dir, or restore the original settings to resume."
        )
        self.fields = fields


class ShardFailedError(FlashxError):
    """A shard failed `executor.max_attempts` times; the job stops (exit 1) and a rerun resumes it."""


class FatalEngineError(FlashxError):
    """The engine (its device) cannot run another batch: the worker holding it must be replaced, not retried."""


class InputChangedError(InputError):
    """An input file no longer holds what the job planned (size or content changed, or it was removed)."""


class LockHeldError(OutputDirError):
    """Another live run holds `output.dir`'s lock: not a bad job, try again later (exit 75)."""


class InputUnavailableError(FlashxError):
    """An input file cannot be read on this worker (missing there): retried, then the job fails (exit 1)."""


class ModelChangedError(ConfigError):
    """A model file changed (size or mtime) after the job fingerprinted it."""


class ZombieAttemptError(FlashxError):
    """An attempt started after its job finished (the driver gave up on it long ago): refused, harmless."""


class TornJobJsonError(OutputDirError):
    """job.json exists but is not a JSON object (a torn write by a tool without atomic writes, an edit)."""


class JobAborted(ConfigError):
    """A worker found the job cannot succeed as written (an input file changed, a config problem)."""
