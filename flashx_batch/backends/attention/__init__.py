"""Attention backends: one per (layout, device, attention kind), picked by `select` (see `base`)."""

from flashx_batch.backends.attention.base import (
    KINDS,
    AttentionBackend,
    AttentionLayer,
    AttentionSet,
    register,
    registered,
    select,
)

__all__ = ["KINDS", "AttentionBackend", "AttentionLayer", "AttentionSet", "register", "registered", "select"]
