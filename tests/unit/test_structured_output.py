"""Constrained decoding on the bundled model (never trained to write JSON): every row that finishes matches
its own constraint, whatever the batch around it does (refill, n > 1 with seeds, logprobs, prefix reuse,
segment-sparse KV); a row cut by its budget says its constraint is unmet; a constraint the library cannot
compile is refused with the library's message; each distinct constraint is compiled once per engine."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from flashx_batch import Engine, SamplingParams
from flashx_batch.errors import ConfigError
from flashx_batch.runtime.grammar import BadConstraint

SCHEMAS = [
    {"type": "object", "properties": {"kind": {"enum": ["licence", "lease", "loan"]},
                                      "year": {"type": "integer", "minimum": 1990, "maximum": 2030}},
     "required": ["kind", "year"], "additionalProperties": False},
    {"type": "object", "properties": {"parties": {"type": "array", "minItems": 1, "maxItems": 3,
                                                  "items": {"type": "string", "maxLength": 12}}},
     "required": ["parties"], "additionalProperties": False},
    {"type": "object", "properties": {"term": {"type": "object", "properties": {
        "months": {"type": "integer", "minimum": 1, "maximum": 120}, "renews": {"type": "boolean"}},
        "required": ["months", "renews"], "additionalProperties": False}},
     "required": ["term"], "additionalProperties": False},
    {"type": "object", "properties": {"court": {"anyOf": [{"type": "string", "maxLength": 10}, {"type": "null"}]},
                                      "ref": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"}},
     "required": ["court", "ref"], "additionalProperties": False},
    {"type": "object", "properties": {"rate": {"type": "number", "minimum": 0, "maximum": 1},
                                      "signed": {"type": "string", "format": "date"}},
     "required": ["rate", "signed"], "additionalProperties": False},
]
REGEX = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])"
CHOICES = ["licence", "lease", "loan agreement"]
PROMPTS = [f"Clause {i}: the licensee shall not sublicense the software without written consent, {i} months."
           for i in range(10)]


@pytest.fixture(scope="module")
def engine():
    return Engine.from_pretrained(None, max_batch_size=4, max_output_len=96)


def _check(out, params: SamplingParams) -> bool:
    """Whether the row finished; a finished row must match its constraint."""
    c = params.constraint
    if out.finish_reason != "stop":
        assert out.finish_reason == "length" and out.num_generated_tokens == params.max_new_tokens
        return False
    assert out.constraint_met is True
    if c.kind == "json_schema":  # against the schema as given (the engine compiled it fitted to the budget)
        jsonschema.validate(json.loads(out.text), json.loads(params.json_schema),
                            format_checker=jsonschema.FormatChecker())
    elif c.kind == "regex":
        assert re.fullmatch(c.source, out.text), out.text
    elif c.kind == "choice":
        assert out.text in json.loads(c.source)
    return True


def _mixed(n_rows: int, **common) -> list[SamplingParams]:
    kinds = [dict(json_schema=s) for s in SCHEMAS] + [dict(regex=REGEX), dict(choice=CHOICES)]
    return [SamplingParams(max_new_tokens=80, **kinds[i % len(kinds)], **common) for i in range(n_rows)]


def test_every_finished_row_matches_its_own_constraint(engine):
    params = _mixed(14)
    outs = engine.generate(PROMPTS + PROMPTS[:4], params)  # 14 rows through batches of 4: refilled
    finished = sum(_check(o, p) for o, p in zip(outs, params))
    assert finished >= 0.9 * len(params)


def test_sampled_rows_and_n_samples_match_and_repeat(engine):
    params = _mixed(7, temperature=1.0, seed=11, n=2)
    first = engine.generate(PROMPTS[:7], params)
    assert len(first) == 14
    for o in first:
        _check(o, params[o.index])
    again = engine.generate(PROMPTS[:7], params)
    assert [o.text for o in again] == [o.text for o in first]  # seeded: the same samples again
    assert any(a.text != b.text for a, b in zip(first[::2], first[1::2]))  # the two samples differ


def test_free_rows_are_untouched_by_constrained_batch_mates(engine):
    free = SamplingParams(max_new_tokens=12)
    alone = engine.generate(PROMPTS[:3], free)
    mixed = engine.generate(PROMPTS[:3] + PROMPTS[3:6], [free] * 3 + _mixed(3))
    assert [o.token_ids for o in mixed[:3]] == [o.token_ids for o in alone]
    assert all(o.constraint_met is None for o in mixed[:3])


def test_logprobs_are_the_models_own_before_the_mask(engine):
    params = SamplingParams(max_new_tokens=40, choice=CHOICES, logprobs=3)
    out = engine.generate(PROMPTS[:1], params)[0]
    assert _check(out, params) and len(out.logprobs) == out.num_generated_tokens
    # the first token's logprob and top 3 are the raw model's at the prompt's last position (teacher-forced),
    # not the distribution renormalised over the few tokens the choices allow
    raw = engine.score([engine.encode(PROMPTS[0])])[0][-1].log_softmax(-1)
    assert out.logprobs[0] == pytest.approx(raw[out.token_ids[0]].item(), abs=1e-4)
    top = raw.topk(3)
    assert [t for t, _ in out.top_logprobs[0]] == top.indices.tolist()
    firsts = sorted({engine.tokenizer.encode(c, add_special_tokens=False)[0] for c in CHOICES})
    assert raw.exp()[firsts].sum() < 0.99  # so the masked distribution would have said otherwise


def test_a_row_cut_by_its_budget_says_its_constraint_is_unmet(engine):
    params = SamplingParams(max_new_tokens=3, json_schema=SCHEMAS[2])
    out = engine.generate(PROMPTS[:1], params)[0]
    assert (out.finish_reason, out.constraint_met, out.num_generated_tokens) == ("length", False, 3)


@pytest.mark.parametrize("options", [dict(prefix_cache_tokens=64), dict(cache_policy="segment_sparse")],
                         ids=["prefix_reuse", "segment_sparse"])
def test_other_kv_layouts(options):
    engine = Engine.from_pretrained(None, max_batch_size=4, max_output_len=96, **options)
    prompts = ["A shared preamble about software licences and their many terms. " + p for p in PROMPTS[:7]]
    params = _mixed(7)
    finished = sum(_check(o, p) for o, p in zip(engine.generate(prompts, params), params))
    assert finished >= 6


def test_grammars_lark_and_gbnf(engine):
    lark = SamplingParams(max_new_tokens=20, grammar='start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"')
    gbnf = SamplingParams(max_new_tokens=20, grammar='root ::= "Term: " [0-9] [0-9]? " months"')
    a, b = engine.generate(PROMPTS[:2], [lark, gbnf])
    assert a.finish_reason == "stop" and a.text in ("The answer is yes.", "The answer is no.")
    assert b.finish_reason == "stop" and re.fullmatch(r"Term: [0-9]{1,2} months", b.text), b.text


def test_each_distinct_constraint_compiles_once_per_engine():
    engine = Engine.from_pretrained(None, max_batch_size=4, max_output_len=96)
    params = _mixed(14)
    engine.generate(PROMPTS + PROMPTS[:4], params)
    distinct = len({p.constraint for p in params})
    assert engine.last_stats.grammar_compiles == engine.grammar_compiles == distinct
    engine.generate(PROMPTS[:4], params[:4])
    assert engine.last_stats.grammar_compiles == 0 and engine.grammar_compiles == distinct


def test_bad_constraints_are_refused_with_the_reason(engine):
    with pytest.raises(BadConstraint, match=r"prompt 1: .*uniqueItems"):
        engine.generate(PROMPTS[:2], [SamplingParams(choice=["a"]),
                                      SamplingParams(json_schema={"type": "array", "uniqueItems": True})])
    with pytest.raises(BadConstraint, match="regex"):
        engine.generate(PROMPTS[:1], SamplingParams(regex="(unclosed"))
    with pytest.raises(ConfigError, match="set at once"):
        SamplingParams(regex="a", choice=["a"])
    with pytest.raises(ConfigError, match="not valid JSON"):
        SamplingParams(json_schema="{nope")
    with pytest.raises(ConfigError, match="non-empty"):
        SamplingParams(choice=[])


def test_open_schemas_finish_within_their_budget(engine):
    """Strings without maxLength, numbers without bounds, objects without additionalProperties: a model that
    never learnt to close them still finishes, each answer valid against the schema as given."""
    open_schemas = [
        {"type": "object", "properties": {"licensor": {"type": "string"}, "year": {"type": "integer"}},
         "required": ["licensor", "year"]},
        {"type": "object", "properties": {"holders": {"type": "array", "items": {"type": "string"}}},
         "required": ["holders"]},
        {"type": "object", "properties": {"fee": {"type": "number"}, "payee": {"anyOf": [{"type": "string"},
                                                                                        {"type": "null"}]}},
         "required": ["fee", "payee"]},
    ]
    params = [SamplingParams(max_new_tokens=48, json_schema=open_schemas[i % 3]) for i in range(9)]
    outs = engine.generate(PROMPTS[:9], params)
    finished = sum(_check(o, p) for o, p in zip(outs, params))
    assert finished >= 8
    # a value that stopped at a bound the fitting added is flagged, never silently cut
    for o, p in zip(outs, params):
        fitted = json.loads(p.constraint.source)
        caps = {fitted["properties"][k].get("maxLength") for k in ("licensor", "payee") if k in fitted["properties"]}
        hit = o.finish_reason == "stop" and any(len(v) in caps for v in json.loads(o.text).values()
                                                if isinstance(v, str))
        assert o.json_bound_reached is not None and (not hit or o.json_bound_reached)
    exact = SamplingParams(max_new_tokens=48, json_schema=open_schemas[0], json_fit_budget=False)
    assert exact.constraint.source == exact.json_schema != params[0].constraint.source


def test_params_keep_a_canonical_constraint_in_the_order_given():
    a = SamplingParams(json_schema={"type": "object", "properties": {"why": {"type": "string"}}})
    b = SamplingParams(json_schema='{"type": "object",  "properties": {"why": {"type": "string"}}}')
    assert a.json_schema == b.json_schema and a.constraint == b.constraint and hash(a) == hash(b)
    assert SamplingParams(**a.__dict__) == a
    # the grammar writes properties in the schema's order: "reasoning" before "answer" stays first
    ordered = {"type": "object", "properties": {"reasoning": {"type": "string", "maxLength": 6},
                                                "answer": {"enum": ["yes", "no"]}},
               "required": ["reasoning", "answer"], "additionalProperties": False}
    assert list(json.loads(SamplingParams(json_schema=ordered).constraint.source)["properties"]) == \
        ["reasoning", "answer"]


def test_properties_are_written_in_the_order_the_schema_lists_them(engine):
    schema = {"type": "object", "properties": {"z_reasoning": {"type": "string", "maxLength": 8},
                                               "a_answer": {"enum": ["yes", "no"]}},
              "required": ["z_reasoning", "a_answer"], "additionalProperties": False}
    out = engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=40, json_schema=schema))[0]
    assert out.finish_reason == "stop" and out.text.index('"z_reasoning"') < out.text.index('"a_answer"')
