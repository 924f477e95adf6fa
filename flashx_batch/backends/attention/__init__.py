"""Attention backends: one per (layout, device, attention kind), picked by `select` (see `base` for the
interface, `registry` for the choice)."""

from flashx_batch.backends.attention.base import KINDS, AttentionBackend, AttentionLayer, register
from flashx_batch.backends.attention.registry import AttentionSet, registered, select

__all__ = ["KINDS", "AttentionBackend", "AttentionLayer", "AttentionSet", "register", "registered", "select"]
