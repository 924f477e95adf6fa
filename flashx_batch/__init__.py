"""flashx-batch: offline batch LLM inference for heterogeneous accelerators.

Public API (DESIGN.md): `Engine`, `SamplingParams`, `RequestOutput`.
"""

from flashx_batch.runtime.engine import Engine, GenerateStats, RequestOutput
from flashx_batch.runtime.sampling import SamplingParams

__version__ = "0.1.0"
__all__ = ["Engine", "SamplingParams", "RequestOutput", "GenerateStats", "__version__"]
