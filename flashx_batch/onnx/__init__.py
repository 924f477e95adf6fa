"""The ONNX Runtime path (`runtime.backend=onnx`): the decoder exported once, run by onnxruntime.

`export.export_decoder` writes the prefill and decode graphs; `sessions` caches exports and opens
them; `runtime.onnx_runner.OnnxRunner` drives them under the one `Engine`.
"""

from flashx_batch.onnx.export import export_decoder
from flashx_batch.onnx.sessions import OnnxSessions, ensure_export, read_export_info

__all__ = ["OnnxSessions", "ensure_export", "export_decoder", "read_export_info"]
