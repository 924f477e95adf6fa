"""`SamplingParams`: per-request generation settings, plain data (the scheduler imports no torch)."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

from flashx_batch.errors import ConfigError
from flashx_batch.runtime.constraints import KINDS, Constraint, constraint_of
from flashx_batch.runtime.json_budget import fit_schema


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings (the job config's `sampling.*`). temperature 0 = greedy."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    seed: int = 0
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None  # None / 0 = off; K: each generated token's logprob and its top-K alternatives
    n: int = 1  # samples per prompt (each its own output, seeded by `sample_seed`)
    # at most one constraint on the output (`runtime.constraints`; compiled by `runtime.grammar`): a JSON
    # schema (a dict or its JSON text; kept as canonical JSON text), a regex the whole output matches, one
    # of a list of strings, or a grammar (Lark, or GBNF / EBNF with `::=`). A constrained row ends when its
    # grammar is complete ("stop"; its text matches) or at max_new_tokens ("length"; `constraint_met` says
    # whether the text matches anyway); stop strings and stop_token_ids do not end it early, since a cut
    # inside a JSON value would leave text that matches nothing.
    json_schema: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    # a json_schema's open ends (strings without maxLength, arrays without maxItems, objects without
    # additionalProperties) bounded so that an answer fits max_new_tokens; every answer still validates
    # against the schema as given (`runtime.json_budget`). False: the schema exactly as given
    json_fit_budget: bool = True

    def __post_init__(self) -> None:
        constraint = constraint_of(self.json_schema, self.regex, self.choice, self.grammar)
        if constraint is not None and constraint.kind == "json_schema":
            object.__setattr__(self, "json_schema", constraint.source)
        if constraint is not None and constraint.kind == "choice":
            object.__setattr__(self, "choice", tuple(json.loads(constraint.source)))
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.max_new_tokens < 1:
            raise ConfigError(f"sampling.max_new_tokens must be >= 1, got {self.max_new_tokens}.")
        for name in ("temperature", "top_p"):
            if not math.isfinite(getattr(self, name)):  # nan empties every text, inf samples noise
                raise ConfigError(f"sampling.{name}={getattr(self, name)} is not a finite number.")
        if self.temperature < 0:
            raise ConfigError(f"sampling.temperature must be >= 0, got {self.temperature}.")
        if self.top_k < 0:
            raise ConfigError(f"sampling.top_k must be >= 0 (0 = off), got {self.top_k}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"sampling.top_p must be in (0, 1], got {self.top_p}.")
        if any(not s for s in self.stop):
            raise ConfigError("sampling.stop must not contain an empty string.")
        if self.logprobs is not None and self.logprobs < 0:
            raise ConfigError(f"sampling.logprobs must be >= 0 (0 or null = off), got {self.logprobs}.")
        if self.n < 1:
            raise ConfigError(f"sampling.n must be >= 1, got {self.n}.")
        if self.n > 1 and self.greedy:
            raise ConfigError(f"sampling.n={self.n} with temperature 0 (greedy) would give {self.n} identical "
                              "samples; set a temperature > 0, or n=1.")

    @property
    def constraint(self) -> Constraint | None:
        """What the output is held to (None: unconstrained); the fields are canonical already. A JSON schema
        with its open ends bounded for max_new_tokens unless json_fit_budget is off (the json_schema field
        keeps the schema as given: what the output validates against)."""
        if self.json_schema is not None:
            fitted = fit_schema(self.json_schema, self.max_new_tokens) if self.json_fit_budget else self.json_schema
            return Constraint("json_schema", fitted)
        if self.choice is not None:
            return Constraint("choice", json.dumps(list(self.choice), ensure_ascii=False))
        if self.regex is not None:
            return Constraint("regex", self.regex)
        return Constraint("grammar", self.grammar) if self.grammar is not None else None

    def describe_constraint(self, limit: int = 80) -> str:
        """The constraint as the caller gave it (a schema before budget fitting), cut to `limit` characters."""
        kind = next(k for k in KINDS if getattr(self, k) is not None)
        value = getattr(self, kind)
        text = value if isinstance(value, str) else json.dumps(list(value), ensure_ascii=False)
        return f"{kind} {text if len(text) <= limit else text[: limit - 3] + '...'}"

    @property
    def wants_logprobs(self) -> int:
        """K alternatives per token (0 = logprobs off)."""
        return self.logprobs or 0

    def sample_seed(self, sample: int) -> int:
        """The seed of sample `sample` (0..n-1): sample 0 keeps `seed`, so n=1 samples as before; the
        others hash (seed, sample), so each sample is reproducible on its own and differs from the rest."""
        if sample == 0:
            return self.seed
        digest = hashlib.sha256(f"{self.seed}\x1fsample\x1f{sample}".encode()).digest()
        return int.from_bytes(digest[:8], "little") & (2**63 - 1)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
