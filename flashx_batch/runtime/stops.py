"""Per-row stop bookkeeping: EOS, stop token ids, stop strings, max_new_tokens.

Runs on the host once per decode step with the B sampled ids the engine already fetched. Stop
strings need text, so only rows that have stop strings pay for detokenising, and only the tail
that could contain a new match.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flashx_batch.runtime.params import SamplingParams


@dataclass
class RowState:
    params: SamplingParams
    stop_ids: frozenset[int]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_text_at: int | None = None  # character offset where a stop string begins
    # params.logprobs on: per generated token, its logprob and its top-K (id, logprob) alternatives
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # a constrained row's `runtime.grammar.RowGrammar`: it decides where the row ends (module doc of
    # `runtime.params`): stop strings and stop ids do not apply, the grammar's end is "stop"
    grammar: Any = None

    @classmethod
    def start(cls, params: SamplingParams, eos_ids: tuple[int, ...], grammar: Any = None) -> RowState:
        ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            ids.update(eos_ids)
        state = cls(params=params, stop_ids=frozenset(ids), grammar=grammar)
        if params.wants_logprobs:
            state.logprobs, state.top_logprobs = [], []
        return state

    def record_logprobs(self, logprob: float, top: list[tuple[int, float]]) -> None:
        """The logprobs of the token about to be appended (a no-op for a row that did not ask)."""
        if self.logprobs is not None:
            self.logprobs.append(logprob)
            self.top_logprobs.append(top[: self.params.wants_logprobs])

    def append(self, token: int, decode: Callable[[list[int]], str]) -> bool:
        """Record one generated token; returns True when the row has just finished."""
        self.token_ids.append(token)
        if self.grammar is not None:
            self.grammar.accept(token)
            if self.grammar.finished:
                self.finish_reason = "stop"
            elif len(self.token_ids) >= self.params.max_new_tokens:
                self.finish_reason = "length"
            return self.finish_reason is not None
        if token in self.stop_ids:
            self.finish_reason = "stop"
        elif self.params.stop and self._hit_stop_string(decode):
            self.finish_reason = "stop"
        elif len(self.token_ids) >= self.params.max_new_tokens:
            self.finish_reason = "length"
        return self.finish_reason is not None

    def _hit_stop_string(self, decode: Callable[[list[int]], str]) -> bool:
        text = decode(self.token_ids)
        longest = max(len(s) for s in self.params.stop)
        # A match must end in the text the newest token added; look a stop-length back from there.
        # Byte-level tokens can end mid-character: the earlier text's trailing U+FFFD placeholders
        # are not stable text, so the window starts before them.
        stable = decode(self.token_ids[:-1]).rstrip("\ufffd") if len(self.token_ids) > 1 else ""
        window_start = max(0, len(stable) - longest + 1)
        hits = [i for s in self.params.stop if (i := text.find(s, window_start)) >= 0]
        if hits:
            self.stop_text_at = min(hits)
            return True
        return False

    def final_text(self, decode: Callable[[list[int]], str]) -> str:
        text = decode(self.token_ids)
        return text if self.stop_text_at is None else text[: self.stop_text_at]
