"""Reading a safetensors file's header without its tensors, with errors that name the file and say what
is wrong (a cut-short copy, a corrupt header, byte counts that do not match the shapes): shared by the
checkpoint loader and the LoRA adapter reader; and reading one tensor whole with plain reads (`WholeTensors`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from flashx_batch.errors import ModelLoadError

_FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}  # safetensors dtype names we convert exactly
# safetensors dtype name -> torch dtype, for the formats in _FLOAT_DTYPES
_TORCH_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
# every dtype whose byte counts the header check verifies (the float formats, FP8 weights, a quantized
# checkpoint's integer tensors)
_SIZED_DTYPES = {**_TORCH_DTYPES, "F8_E4M3": torch.float8_e4m3fn, "I8": torch.int8, "U8": torch.uint8,
                 "I32": torch.int32, "I64": torch.int64}


def safetensors_header(path: Path) -> dict[str, dict]:
    """tensor name -> {dtype, shape, data_offsets} from a safetensors file's header, without reading
    the tensors; ModelLoadError when the file is cut short or its header is not valid."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or 8 + n > size:
            raise ModelLoadError(f"{path}: not a complete safetensors file ({size} bytes, header length "
                                 f"{n}); copy or convert the checkpoint again.")
        try:
            header = json.loads(fh.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"{path}: the safetensors header is not valid JSON ({exc}); the file is corrupt.") \
                from None
    tensors = {k: v for k, v in header.items() if k != "__metadata__"} if isinstance(header, dict) else None
    try:
        end = max((int(v["data_offsets"][1]) for v in tensors.values()), default=0)
        for name, v in tensors.items():
            begin, stop = (int(o) for o in v["data_offsets"])
            numel = 1
            for d in v["shape"]:
                numel *= int(d)
            if v.get("dtype") in _SIZED_DTYPES and stop - begin != numel * _SIZED_DTYPES[v["dtype"]].itemsize:
                raise ModelLoadError(f"{path.name}:{name}: holds {stop - begin} bytes, its shape {v['shape']} in "
                                     f"{v['dtype']} needs {numel * _SIZED_DTYPES[v['dtype']].itemsize}; the file is "
                                     "corrupt.")
    except (AttributeError, KeyError, TypeError, ValueError, IndexError):
        raise ModelLoadError(f"{path}: the safetensors header does not describe tensors; the file is corrupt.") \
            from None
    if 8 + n + end > size:
        raise ModelLoadError(f"{path}: truncated: its header describes {8 + n + end} bytes, the file holds {size}; "
                             "copy the checkpoint again (an interrupted download or copy).")
    return tensors


class WholeTensors:
    """Reads a quantized linear's tensors whole, as stored (their bytes on disk, no more), with plain reads at
    their offsets: no memory map, whose pages would count as resident for the whole load."""

    def __init__(self, headers: dict[Path, dict]) -> None:
        self.headers = headers
        self._files: dict[Path, tuple[int, int]] = {}  # path -> (descriptor, start of its data section)

    def __enter__(self) -> WholeTensors:
        return self

    def __exit__(self, *exc) -> None:
        for fd, _ in self._files.values():
            os.close(fd)

    def read(self, path: Path, hf_name: str) -> torch.Tensor:
        if path not in self._files:
            fd = os.open(path, os.O_RDONLY)
            self._files[path] = (fd, 8 + int.from_bytes(os.pread(fd, 8, 0), "little"))
        fd, data_start = self._files[path]
        info = self.headers[path][hf_name]
        first, stop = (int(x) for x in info["data_offsets"])
        buffer = bytearray(stop - first)
        got = 0
        while got < len(buffer):
            more = os.preadv(fd, [memoryview(buffer)[got:]], data_start + first + got)
            if not more:
                raise ModelLoadError(f"{path.name}:{hf_name}: the file ended inside this tensor; was it changed "
                                     "while loading? Copy the checkpoint again.")
            got += more
        dtype = _SIZED_DTYPES[info["dtype"]]  # the header check verified its byte count
        shape = [int(d) for d in info["shape"]]
        return torch.frombuffer(buffer, dtype=dtype).view(shape) if buffer else torch.empty(shape, dtype=dtype)


_LIBC: list = []  # glibc's handle once looked up (empty list: not yet; [None]: not glibc)


def release_freed_memory() -> None:
    """Hand memory freed on the C heap back to the system (glibc's `malloc_trim`; a no-op elsewhere).

    Converting a quantized linear allocates temporaries of a few MB between the buffers it keeps; once
    glibc has raised its mmap threshold (it does after large blocks are freed), they come from the heap,
    and the freed gaps between kept buffers stay resident: a load's peak grew ~40 % over the checkpoint's
    bytes that way. Trimming after each linear returns those pages."""
    if not _LIBC:
        import ctypes
        import ctypes.util

        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.append(libc if hasattr(libc, "malloc_trim") else None)
        except OSError:
            _LIBC.append(None)
    if _LIBC[0] is not None:
        _LIBC[0].malloc_trim(0)
