"""Picking attention backends: `select(device, kind)` returns an `AttentionSet`, resolved at a
model's first forward pass on its device (`models.decoder.DecoderModel.attention`), that maps every
layout to its backend; `registered(...)` swaps backends in for a block of code (tests add a
reference backend this way). The backends register themselves (`base.register`) when their module
is imported; `SHIPPED` names those modules, imported here, so this module sits above them and
`base` below (no import circle).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

# the modules that register the shipped backends: a new backend file is added here
from flashx_batch.backends.attention import cpu, dense, latent, triton_decode
from flashx_batch.backends.attention.base import _REGISTRY, KINDS, AttentionBackend, register

SHIPPED = (dense, latent, cpu, triton_decode)


@contextlib.contextmanager
def registered(*classes: type[AttentionBackend], device_type: str = "any") -> Iterator[None]:
    """`classes` registered for `device_type` inside the block (and for "any": also replacing the
    device's own backends of those layouts), the registry as it was afterwards. A model that first
    ran inside the block keeps what it selected there."""
    saved = dict(_REGISTRY)
    try:
        for cls in classes:
            register(device_type)(cls)
            if device_type == "any":
                for key in [k for k in _REGISTRY if k[1:] == (cls.layout, cls.kind) and k[0] != "any"]:
                    del _REGISTRY[key]
        yield
    finally:
        _REGISTRY.clear()
        _REGISTRY.update(saved)


class AttentionSet:
    """Every layout's backend for one device type and kind (`select`)."""

    def __init__(self, device: torch.device, kind: str, backends: dict[type, AttentionBackend]) -> None:
        self.device, self.kind, self._by_layout = device, kind, backends

    def for_meta(self, meta: object) -> AttentionBackend:
        backend = self._by_layout.get(type(meta))
        if backend is None:
            raise ValueError(f"no {self.kind} attention backend serves {type(meta).__name__} on {self.device}; "
                             f"registered layouts: {', '.join(sorted(t.__name__ for t in self._by_layout))}")
        return backend

    def names(self) -> dict[str, str]:
        """layout name -> backend class name (the job log and `doctor` print it)."""
        return {layout.__name__: type(b).__name__ for layout, b in self._by_layout.items()}


def select(device: torch.device | str, kind: str) -> AttentionSet:
    """The backends a model of attention `kind` runs on `device`: for each layout, the device type's
    own registered backend, else the one registered for every device."""
    device = torch.device(device)
    device_type = device.type
    if kind not in KINDS:
        raise ValueError(f"attention kind {kind!r} is unknown; choose one of {', '.join(KINDS)}")
    chosen: dict[type, AttentionBackend] = {}
    for (where, layout, of_kind), cls in _REGISTRY.items():
        if of_kind == kind and where == "any":
            chosen.setdefault(layout, cls())
    for (where, layout, of_kind), cls in _REGISTRY.items():
        if of_kind == kind and where == device_type:
            chosen[layout] = cls()
    return AttentionSet(device, kind, chosen)
