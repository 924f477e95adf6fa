"""AMD ROCm / Hygon DCU backend: torch built for HIP exposes devices through the `cuda` API.

Visible devices: Ray narrows `HIP_VISIBLE_DEVICES` per actor and refuses to start when only
`ROCR_VISIBLE_DEVICES` is set (doctor names that trap). Hygon DCUs are HIP devices too; Ray may
not detect them, in which case either start Ray with `--num-gpus=N` (Ray then narrows
`CUDA_VISIBLE_DEVICES`, which HIP also honours) or give the actors a custom resource through
`executor.resources` (then each node should run one actor per resource unit it declares).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from flashx_batch.backends.base import Backend, parse_visible_devices
from flashx_batch.backends.cuda import CudaBackend

# Substrings of `torch.cuda.get_device_name()` / gcnArchName that identify a Hygon DCU.
_DCU_MARKERS = ("dcu", "hygon", "z100", "k100")


def is_hygon_dcu(device_name: str, environ: Mapping[str, str] | None = None) -> bool:
    """True for a Hygon DCU: by its device name, or by the DTK toolkit that only DCU hosts carry."""
    env = os.environ if environ is None else environ
    name = device_name.lower()
    # DTK (the DCU toolkit) installs under /opt/dtk and points ROCM_PATH there.
    return any(marker in name for marker in _DCU_MARKERS) or "dtk" in env.get("ROCM_PATH", "").lower()


class RocmBackend(CudaBackend):
    name = "rocm"
    # Ray rejects ROCR_VISIBLE_DEVICES; HIP_VISIBLE_DEVICES is the variable it sets and honours.
    visible_devices_env = "HIP_VISIBLE_DEVICES"
    ray_noset_env = "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES"
    supports_graphs = False
    capture_graph = Backend.capture_graph  # not the CUDA one it would inherit: HIP graphs are not wired in

    @classmethod
    def is_available(cls) -> bool:
        try:
            return torch.version.hip is not None and torch.cuda.is_available()
        except Exception:
            return False

    def is_dcu(self, index: int = 0) -> bool:
        try:
            return is_hygon_dcu(self.device_name(index))
        except Exception:
            return False

    @property
    def default_dtype(self) -> torch.dtype:  # type: ignore[override]
        # Hygon DCUs (gfx906-class) have no fast bfloat16; MI200 / MI300 do.
        if self.is_dcu():
            return torch.float16
        return super().default_dtype

    @property
    def supported_dtypes(self) -> tuple[torch.dtype, ...]:  # type: ignore[override]
        if self.is_dcu():
            return (torch.float32, torch.float16)
        return (torch.float32, torch.bfloat16, torch.float16)

    def device_name(self, index: int = 0) -> str:
        name = torch.cuda.get_device_name(index)
        arch = getattr(torch.cuda.get_device_properties(index), "gcnArchName", "")
        label = f"{name} ({arch})" if arch else name
        return f"Hygon DCU {label}" if is_hygon_dcu(label) and "hygon" not in label.lower() else label

    def visible_devices(self, environ: Mapping[str, str] | None = None) -> list[str] | None:
        # HIP honours CUDA_VISIBLE_DEVICES as well; it matters when Ray, not detecting a DCU, was
        # started with --num-gpus and narrows CUDA_VISIBLE_DEVICES instead.
        hip = super().visible_devices(environ)
        if hip is not None:
            return hip
        env = os.environ if environ is None else environ
        return parse_visible_devices(env.get("CUDA_VISIBLE_DEVICES"))

    def ray_options(self, extra_resources: Mapping[str, float] | None = None) -> dict[str, Any]:
        """`num_gpus=1`, or, when `executor.resources` names a custom resource (a DCU Ray did not
        detect as a GPU), that resource alone: asking for a GPU Ray does not have would never schedule."""
        if extra_resources:
            return {"resources": dict(extra_resources)}
        return super().ray_options()
