"""Which grammar library drives constrained decoding: llguidance against xgrammar on the bundled model's
tokenizer, side by side in one process.

For each JSON-schema feature a batch extraction job uses (enums, integer ranges, arrays with item limits,
nested objects, anyOf with null, string patterns, formats, $ref, ...) and for a regex, a choice and a Lark
grammar: does the library compile it, how long does compiling take, and does a random walk through the
tokens its masks allow (a seeded random allowed token each step, the end token when allowed with
probability 0.3) end in text that `jsonschema` validates? The per-token host cost is the time of one
mask fill plus one token accepted, per row, over every walk.

    pip install xgrammar   # the comparison's other library (not a dependency of flashx-batch)
    python jobs/measurements/grammar_libraries.py --out docs/results/grammar_libraries [--walks 20]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import time
from pathlib import Path

import jsonschema
import torch

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "flashx_batch" / "assets" / "models" / "legal-tiny"

SCHEMAS: dict[str, dict] = {
    "enum": {"type": "object", "properties": {"kind": {"enum": ["licence", "lease", "loan"]}},
             "required": ["kind"], "additionalProperties": False},
    "integer_range": {"type": "object", "properties": {"year": {"type": "integer", "minimum": 1990,
                                                                "maximum": 2030}},
                      "required": ["year"], "additionalProperties": False},
    "array_items": {"type": "object", "properties": {"parties": {"type": "array", "items": {"type": "string",
                                                                                         "maxLength": 12},
                                                               "minItems": 1, "maxItems": 3}},
                    "required": ["parties"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {"term": {"type": "object", "properties": {
        "months": {"type": "integer", "minimum": 1, "maximum": 120}, "renews": {"type": "boolean"}},
        "required": ["months", "renews"], "additionalProperties": False}},
        "required": ["term"], "additionalProperties": False},
    "anyof_null": {"type": "object", "properties": {"court": {"anyOf": [{"type": "string", "maxLength": 10},
                                                                       {"type": "null"}]}},
                   "required": ["court"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {"ref": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"}},
                "required": ["ref"], "additionalProperties": False},
    "number_bounds": {"type": "object", "properties": {"rate": {"type": "number", "minimum": 0,
                                                                "exclusiveMaximum": 1}},
                      "required": ["rate"], "additionalProperties": False},
    "string_length": {"type": "object", "properties": {"code": {"type": "string", "minLength": 3,
                                                                "maxLength": 5}},
                      "required": ["code"], "additionalProperties": False},
    "format_date": {"type": "object", "properties": {"signed": {"type": "string", "format": "date"}},
                    "required": ["signed"], "additionalProperties": False},
    "const_and_optional": {"type": "object", "properties": {"v": {"const": 1}, "note": {"type": "string",
                                                                                       "maxLength": 8}},
                           "required": ["v"], "additionalProperties": False},
    "ref_defs": {"type": "object", "$defs": {"party": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 10}}, "required": ["name"], "additionalProperties": False}},
        "properties": {"buyer": {"$ref": "#/$defs/party"}, "seller": {"$ref": "#/$defs/party"}},
        "required": ["buyer", "seller"], "additionalProperties": False},
    "oneof": {"type": "object", "properties": {"amount": {"oneOf": [{"type": "integer", "minimum": 0,
                                                                     "maximum": 9},
                                                                    {"type": "string", "enum": ["n/a"]}]}},
              "required": ["amount"], "additionalProperties": False},
    "unique_items": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "uniqueItems": True, "maxItems": 3},
    "any_object": {"type": "object"},
}
REGEX = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])"
CHOICES = ["yes", "no", "unclear"]
LARK = 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"'


class LLGuidance:
    name = "llguidance"

    def __init__(self) -> None:
        import llguidance

        self.lib = llguidance
        text = (MODEL / "tokenizer.json").read_text()
        self.tokenizer = llguidance.LLTokenizer(text, eos_token=2)
        self.vocab = self.tokenizer.vocab_size

    def compile(self, kind: str, source):
        m = self.lib.LLMatcher
        grammar = {"json": lambda: m.grammar_from_json_schema(json.dumps(source)),
                   "regex": lambda: m.grammar_from_regex(source), "lark": lambda: m.grammar_from_lark(source)}[kind]()
        bad, messages = m.validate_grammar_with_warnings(grammar, self.tokenizer)
        if bad:
            raise ValueError(messages[0])
        return grammar

    def matcher(self, compiled):
        return self.lib.LLMatcher(self.tokenizer, compiled)

    def fill(self, matcher, mask: torch.Tensor) -> None:
        matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token) and not matcher.is_error()

    def done(self, matcher) -> bool:
        return matcher.is_stopped()


class XGrammar:
    name = "xgrammar"

    def __init__(self) -> None:
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        self.lib = xgrammar
        hf = PreTrainedTokenizerFast(tokenizer_file=str(MODEL / "tokenizer.json"), eos_token="</s>")
        info = xgrammar.TokenizerInfo.from_huggingface(hf, stop_token_ids=[2])
        self.compiler = xgrammar.GrammarCompiler(info)
        self.vocab = info.vocab_size

    def compile(self, kind: str, source):
        c = self.compiler
        if kind == "json":
            return c.compile_json_schema(json.dumps(source), strict_mode=True)
        if kind == "regex":
            return c.compile_regex(source)
        return c.compile_grammar(self.lib.Grammar.from_ebnf(_lark_as_ebnf(source)))

    def matcher(self, compiled):
        return self.lib.GrammarMatcher(compiled)

    def fill(self, matcher, mask: torch.Tensor) -> None:
        matcher.fill_next_token_bitmask(mask[None] if mask.dim() == 1 else mask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def done(self, matcher) -> bool:
        return matcher.is_terminated()


def _lark_as_ebnf(lark: str) -> str:
    """The one Lark grammar here in xgrammar's EBNF dialect (root ::= ...)."""
    return 'root ::= "The answer is " answer "."\nanswer ::= "yes" | "no"'


def walk(lib, compiled, rng: random.Random, budget: int, decode) -> tuple[str | None, list[float]]:
    """One seeded random walk through the allowed tokens -> (text or None when cut by the budget, seconds
    per token of mask + accept)."""
    matcher = lib.matcher(compiled)
    mask = torch.zeros((lib.vocab + 31) // 32, dtype=torch.int32)
    tokens, costs = [], []
    for _ in range(budget):
        t0 = time.perf_counter()
        lib.fill(matcher, mask)
        t1 = time.perf_counter()
        bits = ((mask[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[: lib.vocab]
        allowed = bits.nonzero().flatten().tolist()
        if 2 in allowed and rng.random() < 0.3:
            token = 2
        else:
            token = rng.choice([a for a in allowed if a != 2] or allowed)
        t2 = time.perf_counter()
        ok = lib.accept(matcher, token)
        t3 = time.perf_counter()
        costs.append((t1 - t0) + (t3 - t2))
        if not ok:
            return None, costs
        if token != 2:
            tokens.append(token)
        if token == 2 or lib.done(matcher):
            return decode(tokens), costs
    return None, costs


def validates(kind: str, source, text: str) -> bool:
    if kind == "json":
        try:
            jsonschema.validate(json.loads(text), source, format_checker=jsonschema.FormatChecker())
            return True
        except (ValueError, jsonschema.ValidationError):
            return False
    if kind == "regex":
        return re.fullmatch(source, text) is not None
    return text in ("The answer is yes.", "The answer is no.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--walks", type=int, default=20)
    parser.add_argument("--budget", type=int, default=96)
    args = parser.parse_args()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    decode = lambda ids: tok.decode(ids, skip_special_tokens=False)  # noqa: E731
    cases = [("json", name, schema) for name, schema in SCHEMAS.items()]
    cases += [("regex", "regex", REGEX), ("regex", "choice", "(" + "|".join(map(re.escape, CHOICES)) + ")"),
              ("lark", "lark", LARK)]
    report = {"model": MODEL.name, "walks": args.walks, "budget": args.budget, "libraries": {}}
    for lib in (LLGuidance(), XGrammar()):
        rows, costs = {}, []
        for kind, name, source in cases:
            t0 = time.perf_counter()
            try:
                compiled = lib.compile(kind, source)
            except Exception as exc:  # noqa: BLE001 — a library's refusal is the figure
                rows[name] = {"compiles": False, "error": str(exc)[:200]}
                continue
            compile_ms = (time.perf_counter() - t0) * 1e3
            rng = random.Random(0)
            valid = finished = 0
            invalid: list[str] = []
            for _ in range(args.walks):
                text, spent = walk(lib, compiled, rng, args.budget, decode)
                costs += spent
                if text is not None:
                    finished += 1
                    ok = validates(kind, source, text)
                    valid += ok
                    if not ok and len(invalid) < 3:
                        invalid.append(text)
            rows[name] = {"compiles": True, "compile_ms": round(compile_ms, 2), "finished": finished,
                          "valid": valid, **({"invalid_examples": invalid} if invalid else {})}
        report["libraries"][lib.name] = {
            "cases": rows, "compiled": sum(r["compiles"] for r in rows.values()),
            "all_finished_valid": sum(r.get("compiles", False) and r["valid"] == r["finished"] > 0
                                      for r in rows.values()),
            "median_token_us": round(statistics.median(costs) * 1e6, 1),
            "mean_token_us": round(statistics.fmean(costs) * 1e6, 1)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "grammar_libraries.json").write_text(json.dumps(report, indent=1) + "\n")
    for name, lib in report["libraries"].items():
        print(name, {k: v for k, v in lib.items() if k != "cases"})
        for case, row in lib["cases"].items():
            print("  ", case, row)


if __name__ == "__main__":
    main()
