"""The attention seam: what an attention backend is, and how one registers for a (layout, device,
attention kind); `backends.attention.registry` picks among the registered.

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
runs faster (`backends.attention.cpu`: the numba decode kernels). `backends.attention.registry`
picks from it (`select`, `registered`). A new kernel is a new file with a registered class, named in
`registry.SHIPPED`.
"""

from __future__ import annotations

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
