"""Budget-fitted JSON schemas: only open ends are bounded, so every answer the tightened schema allows is an
answer of the schema as given (checked by random walks through the grammar library's masks, validated with
`jsonschema` against the original), the longest answer fits the budget where bounds can make it, and the
bounds that could exclude every answer are never added."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch

from flashx_batch.runtime.constraints import Constraint
from flashx_batch.runtime.grammar import GrammarBook
from flashx_batch.runtime.json_budget import _cost, fit_schema
from flashx_batch.runtime.options import bundled_model_dir

OPEN_SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                      "tags": {"type": "array", "items": {"type": "string"}}}},
    {"type": "object", "properties": {"price": {"type": "number", "minimum": 0}}, "required": ["price"]},
    {"type": "object", "properties": {"party": {"type": "object", "properties": {
        "name": {"type": "string", "minLength": 2}, "role": {"enum": ["a", "b"]}}, "required": ["name", "role"]}},
     "required": ["party"]},
    {"type": "object", "properties": {"court": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                                      "when": {"type": "string", "format": "date"}}, "required": ["court"]},
    {"type": "object", "$defs": {"p": {"type": "object", "properties": {"n": {"type": "string"}}, "required": ["n"]}},
     "properties": {"a": {"$ref": "#/$defs/p"}, "b": {"type": "array", "minItems": 2, "items": {"$ref": "#/$defs/p"}}},
     "required": ["a", "b"]},
    {"type": "array", "items": {"type": ["integer", "null"]}},
]


@pytest.fixture(scope="module")
def book():
    return GrammarBook(bundled_model_dir() / "tokenizer.json", 4096, (2,))


def _walk(book: GrammarBook, schema_text: str, rng: random.Random, budget: int) -> str | None:
    """A random walk through the tokens the fitted grammar allows (the end token whenever allowed, with
    probability 1/2) -> the text, or None when the budget ran out first."""
    grammar = book.matcher(Constraint("json_schema", schema_text))
    tokens: list[int] = []
    for _ in range(budget):
        masks = book.masks([grammar]).fill()[0]
        bits = ((masks[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:4096]
        allowed = bits.nonzero().flatten().tolist()
        token = 2 if 2 in allowed and rng.random() < 0.5 else rng.choice([a for a in allowed if a != 2] or allowed)
        grammar.accept(token)
        if token != 2:
            tokens.append(token)
        if grammar.finished:
            return book_decode(tokens)
    return None


def book_decode(tokens: list[int]) -> str:
    from flashx_batch.runtime.tokenizer import Tokenizer

    return Tokenizer(bundled_model_dir()).decode(tokens)


@pytest.mark.parametrize("schema", OPEN_SCHEMAS, ids=range(len(OPEN_SCHEMAS)))
def test_every_answer_of_the_fitted_schema_is_an_answer_of_the_original(book, schema):
    budget = 64
    fitted = fit_schema(json.dumps(schema, sort_keys=True), budget)
    assert fitted != json.dumps(schema, sort_keys=True, separators=(",", ":"))  # something was open
    rng, finished = random.Random(0), 0
    for _ in range(12):
        text = _walk(book, fitted, rng, budget)
        if text is not None:
            finished += 1
            jsonschema.validate(json.loads(text), schema)
    assert finished >= 10  # random tokens, not a model: the walks still end within the budget


def _floors(node, out):
    """Every string bound and array bound of a fitted schema: (bound, its floor)."""
    if isinstance(node, dict):
        if "maxLength" in node:
            out.append((node["maxLength"], max(4, node.get("minLength", 0))))
        if "maxItems" in node:
            out.append((node["maxItems"], node.get("minItems", 0)))
        for value in node.values():
            _floors(value, out)
    elif isinstance(node, list):
        for value in node:
            _floors(value, out)
    return out


@pytest.mark.parametrize("schema", OPEN_SCHEMAS[:5], ids=range(5))
def test_the_longest_fitted_answer_fits_the_budget(schema):
    for budget in (32, 64, 256):
        fitted = json.loads(fit_schema(json.dumps(schema), budget))
        # it fits, or every bound it could shrink is at its floor already
        assert _cost(fitted, fitted, 0) <= budget or all(b == f for b, f in _floors(fitted, [])), (budget, fitted)


def test_bounded_closed_schemas_are_left_as_given():
    closed = {"type": "object", "properties": {"k": {"enum": ["a", "b"]}, "n": {"type": "integer", "minimum": 0,
                                                                                "maximum": 9}},
              "required": ["k", "n"], "additionalProperties": False}
    text = json.dumps(closed, sort_keys=True, separators=(",", ":"))
    assert fit_schema(text, 64) == text


def test_bounds_that_could_exclude_every_answer_are_not_added():
    # a required key no property lists, an allOf whose branches list the keys, a minimum above the cap
    required_elsewhere = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a", "b"]}
    assert "additionalProperties" not in json.loads(fit_schema(json.dumps(required_elsewhere), 64))
    split = {"allOf": [{"type": "object", "properties": {"a": {"type": "boolean"}}},
                       {"type": "object", "properties": {"b": {"type": "boolean"}}}]}
    assert '"additionalProperties"' not in fit_schema(json.dumps(split), 64)
    big = {"type": "integer", "minimum": 10**12}
    assert "maximum" not in json.loads(fit_schema(json.dumps(big), 64))
    long_min = {"type": "string", "minLength": 100}
    assert json.loads(fit_schema(json.dumps(long_min), 16))["maxLength"] >= 100
    few = {"type": "array", "minItems": 6, "items": {"type": "string"}}
    assert json.loads(fit_schema(json.dumps(few), 16))["maxItems"] >= 6
    # keys another applicator may admit or require: the object stays open
    branches = {"type": "object", "properties": {"kind": {"enum": ["a", "b"]}}, "required": ["kind"],
                "anyOf": [{"properties": {"x": {"type": "boolean"}}, "required": ["x"]}, {"required": ["kind"]}]}
    assert "additionalProperties" not in json.loads(fit_schema(json.dumps(branches), 64))
    # inside `not` a tighter schema would loosen the whole; inside `if` it would change the branch taken
    negated = {"type": "object", "properties": {"a": {"not": {"type": "string"}}},
               "if": {"properties": {"a": {"type": "string"}}}, "then": {"required": ["a"]}}
    fitted = json.loads(fit_schema(json.dumps(negated), 64))
    assert fitted["properties"]["a"]["not"] == {"type": "string"} and fitted["if"] == negated["if"]
    narrow = {"type": "number", "minimum": 1e-5, "maximum": 5e-5}
    assert "multipleOf" not in json.loads(fit_schema(json.dumps(narrow), 64))
    fixed = {"type": "array", "const": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]}
    assert "maxItems" not in json.loads(fit_schema(json.dumps(fixed), 16))


def test_an_answer_at_an_added_bound_is_flagged():
    from flashx_batch.runtime.json_budget import bound_reached

    schema = json.dumps({"type": "object", "properties": {"who": {"type": "string"}, "code": {
        "type": "string", "maxLength": 3}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
        "required": ["who", "code", "tags"]})
    fitted = fit_schema(schema, 48)
    fitted_props = json.loads(fitted)["properties"]
    cap, items = fitted_props["who"]["maxLength"], fitted_props["tags"]["maxItems"]
    assert bound_reached(schema, 48, json.dumps({"who": "x" * cap, "code": "abc", "tags": []}))
    assert bound_reached(schema, 48, json.dumps({"who": "x", "code": "abc", "tags": ["a"] * items}))
    # the user's own bound (code: 3) is the user's: reaching it is no news; short values are not flagged
    assert not bound_reached(schema, 48, json.dumps({"who": "x" * (cap - 1), "code": "abc", "tags": ["a"]}))
    closed = json.dumps({"type": "object", "properties": {"k": {"enum": ["a"]}}, "required": ["k"],
                         "additionalProperties": False}, separators=(",", ":"))
    assert fit_schema(closed, 48) == closed and not bound_reached(closed, 48, '{"k": "a"}')
