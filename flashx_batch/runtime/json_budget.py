"""A JSON schema's open ends bounded so that a whole answer fits the row's token budget
(`SamplingParams.json_fit_budget`, on by default).

A schema that leaves a string's length, a number's digits, an array's length or an object's keys open lets
a model write on until `max_new_tokens` cuts the answer off: a row that never closes a string is a row
that never validates. This tightens only what keeps every answer of the tightened schema an answer of the
schema as given (its output validates against the original):

- an object with `properties` and no `additionalProperties` gets `additionalProperties: false` (as OpenAI's
  strict mode and xgrammar's default treat it), unless that could exclude every answer: a required key that
  is not a listed property, `minProperties` above the listed properties, a keyword beside `properties`
  that may admit or require other keys (`patternProperties`, `anyOf`, `oneOf`, `$ref`, `if`, dependencies,
  ...), or an `allOf` anywhere in the schema (where another branch may list the keys);
- an integer or number without `maximum` / `minimum` gets ±(10**9 - 1); a number without `multipleOf`
  gets `multipleOf: 0.0001` (at most four digits after the point) unless its range is narrower than 1;
- a string without `maxLength`, `enum`, `const`, `pattern` or `format` gets `maxLength` (its
  `minLength` at least); an array without `maxItems`, `enum` or `const` gets one (its `minItems` at least);
- nothing inside `not` or `if` is touched (tightening there would loosen the schema, or change which
  branch applies);
- then, while the longest answer the schema allows would not fit the budget (counting a token per
  character, which byte-level vocabularies never beat for ASCII text), those added string bounds and every
  array's `maxItems` shrink by a quarter, never below their minimums.

A schema this cannot make fit still runs (a row may then end at its budget, `constraint_met` false). An
answer that reached a bound fitting added may have been cut short of what the model would have written:
`bound_reached` says so, from the bounds the fitting itself recorded (`RequestOutput.json_bound_reached`,
the `json_bound_reached` column).
Who calls it: `SamplingParams.constraint`; the grammar cache is keyed by the tightened text, so rows with
the same schema and budget share one compiled grammar.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

MIN_STRING = 4  # the shortest bound an added string bound shrinks to (characters)
MAX_DIGITS = 9  # an integer or number without bounds: at most 9 digits before the point
FRACTION = 0.0001  # a number without multipleOf: at most four digits after the point
OPEN = 10**6  # the cost of what no bound limits
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_BOUNDED_STRING = ("maxLength", "enum", "const", "pattern", "format")
# keywords beside `properties` that may admit or require other keys: an object with one is never closed
_APPLICATORS = ("patternProperties", "unevaluatedProperties", "anyOf", "oneOf", "allOf", "$ref", "if", "then",
                "else", "dependentRequired", "dependentSchemas", "dependencies", "not", "enum", "const")
_FORMAT_LENGTH = {"date": 10, "time": 15, "date-time": 32, "uuid": 36, "ipv4": 15}


def fit_schema(schema_text: str, budget: int) -> str:
    """The schema (canonical JSON text) with its open ends bounded for `budget` new tokens, as canonical
    JSON text, keys in their order (the text as given when it is not an object schema)."""
    return _fit(schema_text, budget)[0]


def bound_reached(schema_text: str, budget: int, text: str) -> bool:
    """Whether an answer may have been cut short by a bound that fitting for `budget` added: some string of it
    is exactly as long as an added `maxLength`, or some array holds exactly an added or shrunk `maxItems`
    (compared by value, not by place in the schema: it may say yes for a value that merely has that size)."""
    _, lengths, items = _fit(schema_text, budget)
    if not lengths and not items:
        return False
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return _reaches(value, lengths, items)


@lru_cache(maxsize=4096)
def _fit(schema_text: str, budget: int) -> tuple[str, frozenset[int], frozenset[int]]:
    """(the fitted schema's text, the string bounds it added, the array bounds it added or shrank)."""
    fitted = json.loads(schema_text)
    if not isinstance(fitted, dict):
        return schema_text, frozenset(), frozenset()
    added: list[dict] = []  # string nodes whose maxLength is ours
    arrays: list[tuple[dict, Any]] = []  # array nodes (their maxItems may shrink), each with its maxItems as given
    closes_objects = '"allOf"' not in schema_text
    _walk(fitted, lambda node: _bound(node, budget, closes_objects, added, arrays))
    for _ in range(32):
        if _cost(fitted, fitted, 0) <= budget:
            break
        changed = False
        for node in added:
            low = max(MIN_STRING, _int(node.get("minLength"), 0))
            new = max(low, node["maxLength"] * 3 // 4)
            changed |= new < node["maxLength"]
            node["maxLength"] = new
        for node, _ in arrays:
            new = max(_int(node.get("minItems"), 0), node["maxItems"] * 3 // 4)
            changed |= new < node["maxItems"]
            node["maxItems"] = new
        if not changed:
            break
    text = json.dumps(fitted, separators=(",", ":"), ensure_ascii=False)  # keys in the order given: see constraints
    return (text, frozenset(node["maxLength"] for node in added),
            frozenset(node["maxItems"] for node, given in arrays if node["maxItems"] != given))


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _walk(node: Any, visit) -> None:
    if not isinstance(node, dict):
        return
    visit(node)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            for child in node[key].values():
                _walk(child, visit)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(node.get(key), list):
            for child in node[key]:
                _walk(child, visit)
    # not `not` (a tighter subschema there loosens the whole) nor `if` (it would change which branch applies)
    for key in ("items", "additionalProperties", "then", "else"):
        if isinstance(node.get(key), dict):
            _walk(node[key], visit)


def _types(node: dict) -> set[str]:
    kind = node.get("type")
    return {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else set()


def _bound(node: dict, budget: int, closes_objects: bool, added: list[dict], arrays: list[tuple[dict, Any]]
           ) -> None:
    types = _types(node)
    fixed = "enum" in node or "const" in node
    if types & {"integer", "number"} and not fixed:
        limit = 10**MAX_DIGITS - 1
        low = node.get("minimum", node.get("exclusiveMinimum"))
        high = node.get("maximum", node.get("exclusiveMaximum"))
        if high is None and not (isinstance(low, int | float) and low >= limit):
            node["maximum"] = limit
        if low is None and not (isinstance(high, int | float) and high <= -limit):
            node["minimum"] = -limit
        low, high = node.get("minimum", node.get("exclusiveMinimum")), node.get("maximum", node.get("exclusiveMaximum"))
        wide = not all(isinstance(v, int | float) and not isinstance(v, bool) for v in (low, high)) or high - low >= 1
        if "number" in types and "multipleOf" not in node and wide:  # a narrow range may hold no multiple
            node["multipleOf"] = FRACTION
    if "string" in types and not any(k in node for k in _BOUNDED_STRING):
        node["maxLength"] = max(_int(node.get("minLength"), 0), budget)
        added.append(node)
    if ("array" in types or isinstance(node.get("items"), dict)) and not fixed:
        given = node.get("maxItems")
        if given is None:
            node["maxItems"] = max(_int(node.get("minItems"), 0), max(1, budget // 8))
        if isinstance(node["maxItems"], int):
            arrays.append((node, given))
    if closes_objects and isinstance(node.get("properties"), dict) and "additionalProperties" not in node:
        listed, required = node["properties"], node.get("required", [])
        if (isinstance(required, list) and all(k in listed for k in required)
                and not any(k in node for k in _APPLICATORS) and _int(node.get("minProperties"), 0) <= len(listed)):
            node["additionalProperties"] = False


def _digits(value: Any) -> int:
    return len(str(int(abs(value)))) + 1 if isinstance(value, int | float) and abs(value) < 1e18 else 20


def _cost(node: Any, root: dict, depth: int) -> int:
    """The most characters (so at most tokens, see the module doc) an answer of `node` can take; OPEN
    where nothing bounds it."""
    if not isinstance(node, dict) or depth > 16:
        return OPEN if depth > 16 else 4  # `true` / `{}` sub-schemas: any value, counted small
    if isinstance(node.get("$ref"), str) and node["$ref"].startswith("#/"):
        target: Any = root
        for part in node["$ref"][2:].split("/"):
            target = target.get(part) if isinstance(target, dict) else None
        return _cost(target, root, depth + 1)
    if "const" in node:
        return len(json.dumps(node["const"]))
    if isinstance(node.get("enum"), list) and node["enum"]:
        return max(len(json.dumps(v)) for v in node["enum"])
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list) and node[key]:
            return max(_cost(child, root, depth + 1) for child in node[key])
    types = _types(node) or ({"object"} if "properties" in node else {"array"} if "items" in node else set())
    if not types:
        return OPEN
    return max(_type_cost(kind, node, root, depth) for kind in types)


def _type_cost(kind: str, node: dict, root: dict, depth: int) -> int:
    if kind in ("boolean", "null"):
        return 5
    if kind == "string":
        if "maxLength" in node:
            return _int(node["maxLength"], OPEN) + 2
        return _FORMAT_LENGTH.get(node.get("format"), OPEN) + 2
    if kind in ("integer", "number"):
        whole = max(_digits(node.get("maximum", node.get("exclusiveMaximum"))),
                    _digits(node.get("minimum", node.get("exclusiveMinimum"))))
        step = node.get("multipleOf")
        fraction = len(repr(float(step)).split(".")[1]) + 1 if kind == "number" and isinstance(step, float) else 0
        return whole + fraction if kind == "integer" or isinstance(step, int | float) else OPEN
    if kind == "array":
        items, count = node.get("items"), _int(node.get("maxItems"), -1)
        if count < 0:
            return OPEN
        per_item = _cost(items, root, depth + 1) if isinstance(items, dict) else 4
        fixed = sum(_cost(c, root, depth + 1) + 2 for c in node.get("prefixItems", []) if isinstance(c, dict))
        return 2 + fixed + count * (per_item + 2)
    if kind == "object":
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        if node.get("additionalProperties", True) is not False or not props:
            return OPEN
        return 2 + sum(len(json.dumps(k)) + 4 + _cost(v, root, depth + 1) for k, v in props.items())
    return OPEN


def _reaches(value: Any, lengths: set[int], items: set[int]) -> bool:
    if isinstance(value, str):
        return len(value) in lengths
    if isinstance(value, list):
        return len(value) in items or any(_reaches(v, lengths, items) for v in value)
    if isinstance(value, dict):
        return any(_reaches(v, lengths, items) for v in value.values())
    return False
