"""`Row`: one request from `generate` to its last token — the one place its state lives."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flashx_batch.runtime.params import SamplingParams
from flashx_batch.runtime.stops import RowState


@dataclass(eq=False)
class Row:
    index: int  # position in the caller's prompt list
    prompt: list[int]  # token ids, fitted to max_input_len (longer only for a rolling merge)
    params: SamplingParams
    need: int  # KV slots it holds once done: its prompt (or what a rolling merge folds it into) + new tokens
    truncated: bool = False  # long_input=truncate dropped the head of the prompt
    adapter: int = 0  # its LoRA adapter's slot in the engine's `LoraSet` (0: the base model)
    state: RowState | None = None  # generated tokens and stop bookkeeping, from admission on
    grammar: Any = None  # a constrained row's `runtime.grammar.RowGrammar`, from admission on
    began: float = 0.0  # perf_counter when its prefill started
    # where its KV lives (the batch layout's bookkeeping)
    segments: list[int] = field(default_factory=list)  # its stripe's / extent's / own segments
    shared: list[int] = field(default_factory=list)  # paged: prefix-cache segments it reads (one reference each)
    slots: int = 0  # KV slots it holds now
    position: int = 0  # RoPE position of its next token (its true token count)
    static_segments: int = 0  # segments a static cache would hold for it (kv_bytes_static_peak)
