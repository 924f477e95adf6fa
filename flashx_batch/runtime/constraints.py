"""`Constraint`: what a row's output must match (a JSON schema, a regex, one of a list of choices, or a
grammar), as plain data — the scheduler and the job layer import no grammar library. `runtime.grammar`
compiles it with llguidance; `SamplingParams` builds one from its `json_schema` / `regex` / `choice` /
`grammar` fields.

`source` is canonical text, so two rows asking for the same thing share one compiled grammar: a schema
is its compact JSON, keys in the order given (the grammar writes an object's properties in the order its
schema lists them: a "reasoning" listed before an "answer" is written first), a choice list its JSON array.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from flashx_batch.errors import ConfigError

KINDS = ("json_schema", "regex", "choice", "grammar")


@dataclass(frozen=True)
class Constraint:
    kind: str  # one of KINDS
    source: str  # canonical text (see the module doc)


def canonical_schema(value: Any, where: str = "sampling.json_schema") -> str:
    """A JSON schema (a dict, or its JSON text) as canonical JSON text; a schema must be a JSON object
    (or true, OpenAI's 'any JSON')."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ConfigError(f"{where} is not valid JSON ({exc}); give a JSON schema object, e.g. "
                              '{"type": "object", "properties": {"name": {"type": "string"}}}.') from None
    if not isinstance(value, dict) and value is not True:
        raise ConfigError(f"{where} must be a JSON schema object, got {type(value).__name__}.")
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where} cannot be written as JSON: {exc}.") from None


def canonical_choice(value: Any, where: str = "sampling.choice") -> str:
    """A choice list (strings, or its JSON text) as a JSON array; at least one choice, none empty."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ConfigError(f"{where} must be a list of strings (or its JSON text), got {value!r}.") from None
    if (not isinstance(value, list | tuple) or not value
            or not all(isinstance(c, str) and c for c in value)):
        raise ConfigError(f"{where} must be a non-empty list of non-empty strings, got {value!r}.")
    return json.dumps(list(value), ensure_ascii=False)


def constraint_of(json_schema: Any = None, regex: str | None = None, choice: Any = None,
                  grammar: str | None = None, where: str = "sampling") -> Constraint | None:
    """The one constraint these fields ask for (None: unconstrained); two at once is an error."""
    given = {k: v for k, v in (("json_schema", json_schema), ("regex", regex), ("choice", choice),
                               ("grammar", grammar)) if v is not None}
    if not given:
        return None
    if len(given) > 1:
        raise ConfigError(f"{where}: {', '.join(given)} are set at once; a row takes one constraint "
                          "(json_schema, regex, choice or grammar).")
    kind, value = next(iter(given.items()))
    if kind == "json_schema":
        return Constraint(kind, canonical_schema(value, f"{where}.json_schema"))
    if kind == "choice":
        return Constraint(kind, canonical_choice(value, f"{where}.choice"))
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}.{kind} must be a non-empty string, got {value!r}.")
    return Constraint(kind, value)
