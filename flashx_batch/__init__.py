"""flashx-batch: offline batch LLM inference for heterogeneous accelerators.

Public API (README "Python API"): `Engine`, `SamplingParams`, `RequestOutput`, `ChoiceScores`, and
`read_output(uri)` (a finished or running job's committed rows as a `pyarrow.dataset`), `run_job(config,
data=...)` (a batch job from Python, on files or an in-memory table). Names load lazily so that
`python -m flashx_batch.doctor` still runs when `import torch` itself is broken (torch_npu without
CANN), which is exactly when a user needs it.
"""

import importlib

__version__ = "0.1.0"
__all__ = ["Engine", "SamplingParams", "RequestOutput", "GenerateStats", "ChoiceScores", "read_output", "run_job",
           "__version__"]
_LAZY = {"Engine": "flashx_batch.runtime.engine", "GenerateStats": "flashx_batch.runtime.engine",
         "RequestOutput": "flashx_batch.runtime.engine", "ChoiceScores": "flashx_batch.runtime.engine",
         "SamplingParams": "flashx_batch.runtime.sampling", "read_output": "flashx_batch.runner.read_output",
         "run_job": "flashx_batch.runner.in_memory"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'flashx_batch' has no attribute {name!r}")
