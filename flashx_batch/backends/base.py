"""The device seam. Only this package knows which accelerator it is on.

A backend is a small class with declarative attributes (vLLM-platform style) and a few hooks.
The runtime asks it for a torch device, a default dtype, synchronisation and memory figures; the
Ray runner asks it how to pin an actor. `is_available()` must never raise: `doctor` and `auto`
call it on machines where the vendor stack is half-installed.
"""

from __future__ import annotations

import os

import torch


class Backend:
    name: str = "base"
    device_type: str = "cpu"  # torch device type
    ray_num_gpus: float = 0.0  # cuda / rocm actors ask Ray for one GPU
    ray_resource: str | None = None  # npu actors ask for a custom resource, e.g. {"NPU": 1}
    visible_devices_env: str | None = None
    default_dtype: torch.dtype = torch.bfloat16
    supported_dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
    supports_graphs: bool = False

    @classmethod
    def is_available(cls) -> bool:
        return False

    def device(self, index: int = 0) -> torch.device:
        return torch.device(self.device_type, index)

    def set_device(self, index: int = 0) -> None:
        """Make `index` the current device of this process (no-op where devices are implicit)."""

    def synchronize(self) -> None:
        """Wait for queued device work, so wall-clock timings are honest."""

    def memory_info(self) -> tuple[int, int]:
        """(free bytes, total bytes) of the current device."""
        pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        avail = os.sysconf("SC_AVPHYS_PAGES")
        return avail * page, pages * page

    def empty_cache(self) -> None:
        """Return cached allocator blocks to the device."""

    def ray_options(self) -> dict:
        """Actor options that pin one actor to one device of this kind."""
        if self.ray_resource:
            return {"resources": {self.ray_resource: 1}}
        if self.ray_num_gpus:
            return {"num_gpus": self.ray_num_gpus}
        return {}
