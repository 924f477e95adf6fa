"""Open JSON schemas on the bundled model, which never learnt to close a string: strings, numbers and arrays
without bounds, objects without `additionalProperties`. For each schema, how many of 16 prompts finish within
the token budget with budget fitting on; every finished answer is validated against the schema as given.
`{"type": "object"}` with no properties keeps its keys open (the case fitting leaves alone).

    python jobs/measurements/open_schemas.py [--budget 64]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jsonschema
import pyarrow.parquet as pq

from flashx_batch import Engine, SamplingParams

REPO = Path(__file__).resolve().parents[2]
STRING, INTEGER = {"type": "string"}, {"type": "integer"}
SCHEMAS = [
    {"type": "object", "properties": {"name": STRING, "age": INTEGER, "tags": {"type": "array", "items": STRING}}},
    {"type": "object", "properties": {"price": {"type": "number"}}, "required": ["price"]},
    {"type": "object", "properties": {"party": {"type": "object", "properties": {
        "name": STRING, "role": {"enum": ["a", "b"]}}, "required": ["name", "role"]}}, "required": ["party"]},
    {"type": "object", "properties": {"court": {"anyOf": [STRING, {"type": "null"}]}}, "required": ["court"]},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[A-Z]{3}[0-9]+$"}}, "required": ["id"]},
    {"type": "object"},
    {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 5, "items": {
        "type": "object", "properties": {"sku": STRING, "qty": {"type": "integer", "minimum": 1}},
        "required": ["sku", "qty"]}}}, "required": ["items"]},
    {"type": "array", "items": INTEGER},
    {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": ["string", "null"]}, "c": {"const": "x"}},
     "required": ["a", "b", "c"]},
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=int, default=64, help="new tokens per row")
    args = parser.parse_args()
    engine = Engine.from_pretrained(None, max_batch_size=8, max_output_len=max(128, args.budget),
                                    long_input="truncate")
    sample = pq.read_table(REPO / "flashx_batch" / "assets" / "data" / "legal_docs.parquet").to_pylist()
    prompts = [r["prompt"] for r in sample[:16]]
    total = finished = 0
    for schema in SCHEMAS:
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=args.budget, json_schema=schema))
        done = [o for o in outs if o.finish_reason == "stop"]
        for o in done:
            jsonschema.validate(json.loads(o.text), schema)
        total, finished = total + len(outs), finished + len(done)
        print(f"{len(done)}/{len(outs)} finished, all valid: {json.dumps(schema)[:100]}")
    print(f"finished share {finished / total:.3f}")


if __name__ == "__main__":
    main()
