"""Constrained decoding with llguidance: a row's `Constraint` compiled once per engine, a matcher per row,
and each step's allowed-token bitmask.

Why llguidance (measured by `jobs/measurements/grammar_libraries.py`, figures in docs/benchmarks.md): on
the bundled tokenizer every output its masks allowed validated, in every JSON-schema feature it compiles;
a keyword it cannot enforce (`uniqueItems`) is refused with a message instead of ignored; it compiles a
schema in well under a millisecond (masks are computed lazily, per step, from the parser state); it
needs neither torch nor transformers, only the tokenizer.json text, read once per engine.

Who calls it: `Engine` builds one `GrammarBook` the first time a row carries a constraint; the scheduler
gives each admitted constrained row a `RowGrammar`, feeds it every sampled token (`RowState.append`) and
asks the book for a `StepMasks` per step; the runner fills the masks on the host while the device runs
the step's forward pass, then `sampling.sample` applies them on the device.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import torch

from flashx_batch.errors import ConfigError
from flashx_batch.runtime.constraints import Constraint

COMPILED_KEEP = 1024  # compiled grammars kept per engine (least recently used dropped first)
# JSON is written on one line with json.dumps' separators: free whitespace lets a model that was never
# trained on JSON spend its whole budget on spaces and newlines between tokens (a schema's own
# "x-guidance" options may still ask for it)
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class BadConstraint(ConfigError):
    """A constraint the grammar library cannot compile; the message is the library's, with the constraint."""


def _library():
    try:
        import llguidance
    except ImportError as exc:  # a core dependency: only a broken install lacks it
        raise ConfigError("constrained decoding needs the llguidance package (a dependency of flashx-batch): "
                          "pip install llguidance") from exc
    return llguidance


class RowGrammar:
    """One row's matcher: the tokens it has accepted so far, and what it allows next."""

    def __init__(self, matcher) -> None:
        self.matcher = matcher

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token) or self.matcher.is_error():
            raise RuntimeError(f"the grammar library refused token {token} of a constrained row: "
                               f"{self.matcher.get_error() or 'not allowed by the step mask'}")

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more (the row ends with finish_reason=stop)."""
        return self.matcher.is_stopped()

    @property
    def met(self) -> bool:
        """The tokens so far form a complete match (they may go on: a regex like [0-9]+)."""
        return self.matcher.is_stopped() or self.matcher.is_accepting()


class StepMasks:
    """One step's allowed tokens, one bitmask row per batch row (bit t of word w: token 32 w + t);
    unconstrained rows allow everything."""

    def __init__(self, executor, grammars: list[RowGrammar | None], width: int) -> None:
        self.executor, self.width = executor, width
        self.grammars = grammars

    def fill(self) -> torch.Tensor:
        """The [B, width] int32 host bitmask (computed in llguidance's threads, without the GIL)."""
        mask = torch.full((len(self.grammars), self.width), -1, dtype=torch.int32)
        pairs = [(g.matcher, i) for i, g in enumerate(self.grammars) if g is not None]
        self.executor.unsafe_compute_mask_ptr(pairs, mask.data_ptr(), self.width * 4, len(self.grammars))
        return mask


class GrammarBook:
    """An engine's grammar library state: the tokenizer read once, compiled grammars cached by constraint."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        lib = _library()
        self._lib = lib
        text = Path(tokenizer_json).read_text()
        tokenizer_vocab = len(json.loads(text).get("model", {}).get("vocab", {}))
        self.tokenizer = lib.LLTokenizer(text, n_vocab=max(vocab_size, tokenizer_vocab) or None,
                                         eos_token=list(eos_token_ids) or None)
        self.width = (self.tokenizer.vocab_size + 31) // 32
        self.executor = lib.LLExecutor()
        # per constraint, a fresh matcher: the compiled grammar (its parser built once); each row gets a copy
        self._compiled: OrderedDict[Constraint, object] = OrderedDict()
        self.compiles = 0  # grammars compiled by this engine (cache misses), for the shard stats

    def compile(self, constraint: Constraint):
        """The constraint's fresh llguidance matcher (compiled once, then cached); `BadConstraint` with the
        library's message when it cannot be compiled."""
        fresh = self._compiled.get(constraint)
        if fresh is not None:
            self._compiled.move_to_end(constraint)
            return fresh
        grammar = self._grammar_text(constraint)
        failed, messages = self._lib.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if failed:
            raise BadConstraint(messages[0])
        fresh = self._lib.LLMatcher(self.tokenizer, grammar, log_level=0)
        if fresh.is_error():
            raise BadConstraint(fresh.get_error())
        self.compiles += 1
        self._compiled[constraint] = fresh
        if len(self._compiled) > COMPILED_KEEP:
            self._compiled.popitem(last=False)
        return fresh

    def problem(self, constraint: Constraint) -> str | None:
        """The library's reason the constraint cannot be compiled, or None."""
        try:
            self.compile(constraint)
        except BadConstraint as exc:
            return str(exc)
        return None

    def matcher(self, constraint: Constraint) -> RowGrammar:
        """A row's own matcher: a copy of the constraint's compiled one."""
        return RowGrammar(self.compile(constraint).deep_copy())

    def masks(self, grammars: list[RowGrammar | None]) -> StepMasks | None:
        """The step's masks for rows in batch order (None: no row is constrained)."""
        return StepMasks(self.executor, grammars, self.width) if any(g is not None for g in grammars) else None

    def _grammar_text(self, c: Constraint) -> str:
        m = self._lib.LLMatcher
        try:
            if c.kind == "json_schema":
                return m.grammar_from_json_schema(c.source, defaults=JSON_LAYOUT)
            if c.kind == "regex":
                return m.grammar_from_regex(c.source)
            if c.kind == "choice":  # one literal per choice (JSON string escapes are Lark's)
                return m.grammar_from_lark("start: " + " | ".join(json.dumps(x) for x in json.loads(c.source)))
            if "::=" in c.source:  # GBNF (llama.cpp's EBNF) into Lark, llguidance's own converter
                from llguidance.gbnf_to_lark import gbnf_to_lark

                return m.grammar_from_lark(gbnf_to_lark(c.source))
            return m.grammar_from_lark(c.source)
        except Exception as exc:  # noqa: BLE001 — the library's parse errors are many types; all are the user's
            raise BadConstraint(str(exc)) from None


def compile_check(tokenizer) -> Callable[[Constraint], str | None]:
    """Why a constraint cannot be compiled for this `runtime.tokenizer.Tokenizer`'s vocabulary, or None:
    the planner's check of the job-wide constraint and of every row's (one book per tokenizer for the
    whole plan, built on the first constraint it meets)."""
    eos = (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
    version = Path(tokenizer.path).stat().st_mtime_ns  # a tokenizer.json rewritten in place is a new book
    return lambda constraint: _planning_book(tokenizer.path, version, tokenizer.vocab_size, eos).problem(constraint)


@lru_cache(maxsize=4)
def _planning_book(tokenizer_json: Path, version: int, vocab_size: int, eos: tuple[int, ...]) -> GrammarBook:
    return GrammarBook(tokenizer_json, vocab_size, eos)


def apply_masks(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """logits [B, V] with every token a [B, W] int32 bitmask disallows set to -inf (a new tensor: the raw
    logits stay for logprobs)."""
    bits = torch.arange(32, device=masks.device, dtype=torch.int32)
    allowed = ((masks.unsqueeze(-1) >> bits) & 1).reshape(masks.shape[0], -1)[:, : logits.shape[-1]]
    return logits.masked_fill(allowed == 0, float("-inf"))
