"""The attention seam: what an attention backend is, and the registry that picks one per
(layout, device, attention kind).

A *layout* is one metadata type of `backends.attention.meta` (a decode step over stripes or extents,
a packed prefill, a paged batch, ...); the runner builds one per forward pass. An attention *kind* is
what the model's attention layers compute: `dense` (multi-head, grouped-query, multi-query, sliding
windows: `models.decoder.Attention`) or `latent` (multi-head latent attention with the DSA indexer:
`models.mla.MLAttention`). A backend serves one layout of one kind on one device type:

    out = backend.forward(q, k, v, layer, meta, cache, last_only)

It writes the new keys and values into `cache` (the layer's plain views of the KV arena, never the
arena itself) where the layout keeps a cache, and returns the attention output; the layer keeps its
projections, norms, RoPE and output projection. What `q`, `k`, `v` and the output are is the kind's
contract (see `DenseBackend` and `LatentBackend`); `layer` is the calling module, read for its head
geometry (`AttentionLayer`).

Who fills the registry: `backends.attention.dense` and `backends.attention.latent` register the
torch SDPA backends for every device (`device_type="any"`); a device's own module registers what it
runs faster (`backends.attention.cpu`: the numba decode kernels). `select(device, kind)` returns an
`AttentionSet`, resolved at a model's first forward pass on its device
(`models.decoder.DecoderModel.attention`), that maps every layout to its backend. A new kernel is
a new file with a registered class; `registered(...)` swaps one in for a block of code (tests add a
reference backend this way).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, ClassVar, Protocol

import torch

KINDS = ("dense", "latent")


class AttentionLayer(Protocol):
    """What a backend reads from the attention module that calls it."""

    layer: int  # the layer's index (a decode step's read views hold every layer)
    num_heads: int
    scale: float


class AttentionBackend:
    """One layout's attention for one kind. Subclasses set `layout` (a metadata class of
    `backends.attention.meta`) and `kind`, and implement `forward`. Stateless: one instance serves
    every layer and every forward pass of a model."""

    layout: ClassVar[type]
    kind: ClassVar[str]
    supports_last_only: ClassVar[bool] = False  # a final layer may compute each row's last query only

    def forward(self, q: Any, k: Any, v: Any, layer: AttentionLayer, meta: Any, cache: tuple[torch.Tensor, ...] | None,
                last_only: bool = False) -> torch.Tensor:
        raise NotImplementedError

    def check_last_only(self, last_only: bool) -> None:
        if last_only and not self.supports_last_only:
            raise ValueError(f"last_only serves packed and extend forwards, not {self.layout.__name__}")


_REGISTRY: dict[tuple[str, type, str], type[AttentionBackend]] = {}


def register(device_type: str = "any"):
    """Class decorator: serve `cls.layout` / `cls.kind` on `device_type` ("any": every device without a
    backend of its own for that layout and kind). A later registration replaces an earlier one."""

    def add(cls: type[AttentionBackend]) -> type[AttentionBackend]:
        if cls.kind not in KINDS:
            raise ValueError(f"attention kind {cls.kind!r} is unknown; choose one of {', '.join(KINDS)}")
        _REGISTRY[(device_type, cls.layout, cls.kind)] = cls
        return cls

    return add


@contextlib.contextmanager
def registered(*classes: type[AttentionBackend], device_type: str = "any") -> Iterator[None]:
    """`classes` registered for `device_type` inside the block (and for "any": also replacing the
    device's own backends of those layouts), the registry as it was afterwards. A model that first
    ran inside the block keeps what it selected there."""
    _load_defaults()  # the shipped backends first, so that the block's classes replace them
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
    _load_defaults()
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


def _load_defaults() -> None:
    """Import the modules that register the shipped backends (once; imports are cached)."""
    from flashx_batch.backends.attention import cpu, dense, latent  # noqa: F401
