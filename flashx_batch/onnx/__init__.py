"""The ONNX Runtime path (`runtime.backend=onnx`): export the decoder, generate with onnxruntime.

`export.export_decoder` writes the prefill and decode graphs; `engine.OnnxEngine` runs them.
"""

from flashx_batch.onnx.engine import OnnxEngine
from flashx_batch.onnx.export import export_decoder

__all__ = ["OnnxEngine", "export_decoder"]
