"""Structured output as a job: per-row constraints from columns (good ones validate when they finish, bad
ones are bad_constraint error rows with the library's message), a job-wide constraint the library refuses
(exit 2 before any output), a constraint on a scoring task (refused), and OpenAI Batch `response_format`
through the bundled model, in process (`run_job`)."""

from __future__ import annotations

import json
import re

import jsonschema
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flashx_batch import run_job
from flashx_batch.config import compose_job
from flashx_batch.errors import ConfigError
from flashx_batch.runner.job import plan_job

ENUM = {"type": "object", "properties": {"kind": {"enum": ["licence", "lease"]},
                                         "months": {"type": "integer", "minimum": 1, "maximum": 60}},
        "required": ["kind", "months"], "additionalProperties": False}
NESTED = {"type": "object", "properties": {"who": {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8}, "agent": {"anyOf": [{"type": "string", "maxLength": 6},
                                                                     {"type": "null"}]}},
    "required": ["name", "agent"], "additionalProperties": False}}, "required": ["who"],
    "additionalProperties": False}
UNIQUE = {"type": "array", "uniqueItems": True}  # a keyword the library refuses rather than ignores
BASE = ["conf=legal_docs", "executor.kind=local", "runtime.long_input=truncate", "sampling.max_new_tokens=48"]


def _table(n: int = 24) -> pa.Table:
    cols: dict[str, list] = {"id": [], "prompt": [], "schema": [], "pattern": [], "options": []}
    for i in range(n):
        k = i % 6
        cols["id"].append(i)
        cols["prompt"].append(f"Clause {i}: the licensee may not sublicense the work for {i + 3} months.")
        cols["schema"].append(json.dumps([ENUM, NESTED, UNIQUE][k]) if k < 3 else "{broken" if k == 3 else None)
        cols["pattern"].append(r"[0-9]{2}/[0-9]{2}" if k == 4 else None)
        cols["options"].append(["yes", "no"] if k == 5 else None)
    return pa.table(cols)


COLUMNS = "+sampling.from_columns={json_schema: schema, regex: pattern, choice: options}"


def test_per_row_constraints_in_a_job(tmp_path):
    table = _table()
    assert run_job([*BASE, f"output.dir={tmp_path / 'out'}", COLUMNS], data=table) == 0
    gens = {g["id"]: g for g in pq.read_table(tmp_path / "out" / "generations").to_pylist()}
    errors = {e["id"]: e for e in pq.read_table(tmp_path / "out" / "errors").to_pylist()}
    rows = table.to_pylist()
    assert set(errors) == {r["id"] for r in rows if r["id"] % 6 in (2, 3)}
    assert all(e["error_code"] == "bad_constraint" for e in errors.values())
    assert "uniqueItems" in errors[2]["error_message"] and "not valid JSON" in errors[3]["error_message"]
    finished = 0
    for r in rows:
        g = gens.get(r["id"])
        if g is None:
            continue
        assert g["constraint_met"] is (g["finish_reason"] == "stop") or g["finish_reason"] == "length"
        if g["finish_reason"] != "stop":
            continue
        finished += 1
        if r["schema"]:
            jsonschema.validate(json.loads(g["generated_text"]), json.loads(r["schema"]))
        elif r["pattern"]:
            assert re.fullmatch(r["pattern"], g["generated_text"])
        else:
            assert g["generated_text"] in r["options"]
    assert finished >= 0.9 * len(gens) and len(gens) == 16
    assert all(isinstance(g["json_bound_reached"], bool) for g in gens.values() if rows[g["id"]]["schema"])
    assert all(g["json_bound_reached"] is None for g in gens.values() if not rows[g["id"]]["schema"])
    stats = pq.read_table(tmp_path / "out" / "stats").to_pylist()
    assert 1 <= sum(s["grammar_compiles"] for s in stats) <= 4  # 4 distinct good constraints, one engine


def test_a_job_wide_constraint_the_library_refuses_stops_the_job(tmp_path):
    out = tmp_path / "out"
    code = run_job([*BASE, f"output.dir={out}", "sampling.json_schema={type: array, uniqueItems: true}"],
                   data=_table(4).select(["id", "prompt"]))
    assert code == 2 and not out.exists()
    with pytest.raises(ConfigError, match="uniqueItems"):
        plan_job(compose_job([*BASE, f"output.dir={out}", "sampling.json_schema={type: array, uniqueItems: true}"]))
    with pytest.raises(ConfigError, match="set at once"):
        plan_job(compose_job([*BASE, f"output.dir={out}", "sampling.regex=a", "sampling.choice=[a]"]))


def test_a_constraint_on_a_scoring_task_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="task=perplexity"):
        plan_job(compose_job([*BASE, "task=perplexity", f"output.dir={tmp_path}", 'sampling.regex="[a-z]+"']))


def test_openai_batch_response_format(tmp_path):
    lines = []
    for i in range(8):
        body = {"model": "m", "messages": [{"role": "user", "content": f"Classify clause {i}."}], "max_tokens": 40}
        if i % 2 == 0:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "c", "schema": ENUM, "strict": i % 4 == 0}}
        else:
            body["response_format"] = {"type": "text"}
        lines.append({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
    lines.append({"custom_id": "xml", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}})
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out"
    assert run_job(["conf=legal_docs", "executor.kind=local", f"data.path={src}", "data.format=openai_batch",
                    "output.format=openai_batch", f"output.dir={out}"]) == 0
    got = {x["custom_id"]: x for x in map(json.loads, (out / "openai_batch_output.jsonl").read_text().splitlines())}
    assert got["xml"]["error"]["code"] == "bad_request" and "response_format" in got["xml"]["error"]["message"]
    for i in range(0, 8, 2):
        choice = got[f"r{i}"]["response"]["body"]["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), ENUM)


def _model_with_template(directory, template: str):
    """The bundled model's files with another chat template (the weights linked, not copied)."""
    from flashx_batch.runtime.options import bundled_model_dir

    source = bundled_model_dir()
    directory.mkdir()
    for f in source.iterdir():
        if f.name == "tokenizer_config.json":
            config = json.loads(f.read_text())
            config["chat_template"] = template
            (directory / f.name).write_text(json.dumps(config))
        elif f.is_file():
            (directory / f.name).symlink_to(f)
    return directory


def test_reasoning_and_tool_calls_split_from_chat_answers(tmp_path):
    """A chat job on a Qwen3-templated model: answers forced (a per-row regex) to carry thinking and a tool
    call come out split into reasoning_content, tool_calls and the answer, in the Parquet output and in the
    OpenAI output lines; a call that is not JSON stays in the text with its flag."""
    from pathlib import Path

    template = (Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates" / "qwen3.jinja").read_text()
    model = _model_with_template(tmp_path / "model", template)
    call = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Oslo"\}\}\n</tool_call>'
    forced = [r"<think>\nplan it\n</think>\n\nThe answer is 4\.", call, r"<think>\nhm\n</think>\n\nNo call\.",
              r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city" \}\n</tool_call>']
    table = pa.table({"id": list(range(4)), "messages": [[{"role": "user", "content": f"q{i}"}] for i in range(4)],
                      "force": forced, "ref": ["The answer is 4.", None, "No call.", None]})
    out = tmp_path / "out"
    assert run_job(["conf=legal_docs", "executor.kind=local", f"model.path={model}", "data.messages_column=messages",
                    f"output.dir={out}", "output.format=openai_batch", "sampling.max_new_tokens=60",
                    'data.tools=[{type: function, function: {name: get_weather, parameters: {type: object}}}]',
                    "+sampling.from_columns={regex: force}", "eval.metric=exact_match", "eval.reference_column=ref"],
                   data=table) == 0
    gens = {g["id"]: g for g in pq.read_table(out / "generations").to_pylist()}
    assert all(g["finish_reason"] == "stop" and g["constraint_met"] for g in gens.values())
    # split answers are in the fingerprint: a chat job written before they were split never resumes into them
    fingerprint = json.loads((out / "job.json").read_text())["fingerprint"]
    assert fingerprint["output.answer_format"] == "reasoning=True,tool_calls=hermes"
    assert (gens[0]["reasoning_content"], gens[0]["generated_text"], gens[0]["tool_calls"]) == \
        ("plan it", "The answer is 4.", None)
    assert gens[0]["score"] == gens[2]["score"] == 1.0  # the answer is scored, not the reasoning before it
    assert gens[1]["generated_text"] == "" and gens[1]["reasoning_content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in gens[1]["tool_calls"]] == \
        [("get_weather", {"city": "Oslo"})]
    assert gens[3]["tool_calls"] is None and "not JSON" in gens[3]["tool_call_error"]
    assert "<tool_call>" in gens[3]["generated_text"]
    lines = {x["custom_id"]: x["response"]["body"]["choices"][0]
             for x in map(json.loads, (out / "openai_batch_output.jsonl").read_text().splitlines())}
    assert lines["0"]["message"] == {"role": "assistant", "content": "The answer is 4.", "reasoning_content": "plan it"}
    assert lines["1"]["finish_reason"] == "tool_calls" and lines["1"]["message"]["content"] is None
    assert lines["1"]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_schemas_written_as_objects_in_a_jsonl_file(tmp_path):
    """A JSONL file's schema objects read as one struct column holding every row's fields, null where a row
    lacks one: each row's own schema is used, without the other rows' null fields."""
    rows = [{"id": i, "prompt": f"Clause {i} of the licence.", "schema": [ENUM, NESTED][i % 2]} for i in range(6)]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    assert run_job([*BASE, f"data.path={src}", f"output.dir={out}",
                    "+sampling.from_columns={json_schema: schema}"]) == 0
    gens = {g["id"]: g for g in pq.read_table(out / "generations").to_pylist()}
    assert len(gens) == 6
    assert not (out / "errors").exists() or pq.read_table(out / "errors").num_rows == 0
    for r in rows:
        g = gens[r["id"]]
        assert g["finish_reason"] == "stop"
        jsonschema.validate(json.loads(g["generated_text"]), r["schema"])
        assert set(json.loads(g["generated_text"])) == set(r["schema"]["properties"])
