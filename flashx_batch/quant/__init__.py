"""Weight-only quantization: formats, load-time modules, sensitivity, planner, precision maps.

Three layers, as in gpt-fast: `formats` (pure tensor functions), the offline step
(`sensitivity` + `planner` + `pipeline`, run by `python -m flashx_batch.quantize`), and the load-time
swap (`apply_precision_map`, called by the engine for `runtime.precision_map=PATH`).
"""

from flashx_batch.quant.precision_map import (
    PrecisionMap,
    PrecisionMapError,
    apply_precision_map,
    load_precision_map,
)

__all__ = ["PrecisionMap", "PrecisionMapError", "apply_precision_map", "load_precision_map"]
