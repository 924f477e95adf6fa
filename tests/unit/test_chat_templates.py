"""Chat templates: our render equals transformers' `apply_chat_template(..., tokenize=False)` to the character.

The templates are real public ones (tests/fixtures/chat_templates/SOURCES.md names each source):
Qwen3, GLM-4.6 (Glm4Moe), glm-4-9b-chat, Llama-3.1/3.3 and Llama-3.2 Instruct. For each, one model
directory holds a tiny `tokenizers` vocabulary and the template; transformers loads it with
`AutoTokenizer` (offline, from the directory) and our `Tokenizer` reads the same files.

Dates: the Llama-3.1 template falls back to a fixed "26 Jul 2024" and takes `date_string`; the Llama-3.2
one calls `strftime_now`. Every comparison passes `date_string` to both sides, except the clock test,
which freezes both clocks (transformers' `datetime` in chat_template_utils and our `_now`) at one instant.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from batch_support import overrides, tiny_model_dir, write_parquet

from flashx_batch.config import compose_job
from flashx_batch.data import load_inputs, plan_prompts
from flashx_batch.data.validate import BAD_TYPE, RowProblem, build_prompt, check_messages, check_tools
from flashx_batch.errors import ConfigError
from flashx_batch.runtime import chat_template
from flashx_batch.runtime.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
TEMPLATES = ["qwen3", "glm-4.6", "glm-4-9b-chat", "llama-3.1-instruct", "llama-3.2-instruct"]
DATE = {"date_string": "03 Feb 2025"}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city — in °C",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "e.g. Zürich"},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Local time",
                                         "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}}
TOOLS = [WEATHER, TIME]

SYSTEM_USER = [{"role": "system", "content": "You are terse.\n"}, {"role": "user", "content": "Say hi to Zoë."}]
MULTI_TURN = [
    {"role": "system", "content": "You answer in one line."},
    {"role": "user", "content": "What is a licence?"},
    {"role": "assistant", "content": "A permission to use something."},
    {"role": "user", "content": "And a warranty?"},
]
ENDS_WITH_ASSISTANT = [*MULTI_TURN, {"role": "assistant", "content": "A promise about quality."}]
TOOL_ROUND = [
    {"role": "system", "content": "Use tools when needed."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21, "sky": "clear"}'},
    {"role": "assistant", "content": "21 °C and clear."},
    {"role": "user", "content": "Thanks. And now?"},
]
TWO_CALLS_JSON_ARGS = [  # two calls in one turn, OpenAI-style JSON-text arguments, a flat call, two results
    {"role": "user", "content": "Weather and time in Oslo?"},
    {"role": "assistant", "content": "Checking both.", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}},
        {"name": "get_time", "arguments": {"tz": "Europe/Oslo"}}]},
    {"role": "tool", "content": "-3 °C"},
    {"role": "tool", "content": "14:05"},
]
REASONING = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n4"},
    {"role": "user", "content": "3+3?"},
    {"role": "assistant", "reasoning_content": "Add again.", "content": "6"},
    {"role": "user", "content": "And 4+4?"},
]
ALIASED_REASONING = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "thinking": "Sum.", "content": "4", "tool_calls": None},
    {"role": "user", "content": "5+5?"},
    {"role": "assistant", "reasoning": "Sum again.", "content": "10"},
]

# (case, messages, tools, add_generation_prompt, extra template arguments, templates it applies to)
ALL = tuple(TEMPLATES)
LLAMA = ("llama-3.1-instruct", "llama-3.2-instruct")
CASES = [
    ("system_user", SYSTEM_USER, None, True, {}, ALL),
    ("multi_turn", MULTI_TURN, None, True, {}, ALL),
    ("no_generation_prompt", ENDS_WITH_ASSISTANT, None, False, {}, ALL),
    ("tools_calls_results", TOOL_ROUND, TOOLS, True, {}, ALL),
    ("tools_in_system", TOOL_ROUND, TOOLS, True, {"tools_in_user_message": False}, LLAMA),
    ("tools_only", SYSTEM_USER, [WEATHER], True, {}, ALL),
    ("two_calls_json_arguments", TWO_CALLS_JSON_ARGS, TOOLS, True, {}, ("qwen3",)),
    ("reasoning", REASONING, None, True, {}, ("qwen3", "glm-4.6")),
    ("reasoning_aliases", ALIASED_REASONING, None, False, {}, ("qwen3", "glm-4.6")),
    ("thinking_off", MULTI_TURN, None, True, {"enable_thinking": False}, ("qwen3", "glm-4.6")),
    ("message_level_tools", [{"role": "system", "content": "Tools follow.", "tools": TOOLS},
                             {"role": "user", "content": "Weather?"}], None, True, {}, ("glm-4-9b-chat",)),
]


def _write_model(directory: Path, template: str | list | None, in_jinja_file: bool = False, **config) -> Path:
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers

    directory.mkdir(parents=True, exist_ok=True)
    raw = RawTokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.save(str(directory / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
           "pad_token": "<pad>", **config}
    if in_jinja_file:
        (directory / "chat_template.jinja").write_text(template, encoding="utf-8")
    elif template is not None:
        cfg["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    return directory


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """template name -> (transformers tokenizer, our Tokenizer) over one model directory."""
    out = {}
    for i, name in enumerate(TEMPLATES):
        source = (FIXTURES / f"{name}.jinja").read_text(encoding="utf-8")
        # half the templates as chat_template.jinja, half inside tokenizer_config.json: both are read
        d = _write_model(tmp_path_factory.mktemp(name), source, in_jinja_file=bool(i % 2))
        out[name] = (transformers.AutoTokenizer.from_pretrained(str(d)), Tokenizer(d))
    return out


def _both(pair, messages, tools=None, add_generation_prompt=True, **extra):
    hf, ours = pair
    want = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                  tokenize=False, **extra)
    got = ours.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt, **extra)
    return want, got


@pytest.mark.parametrize("name, case", [pytest.param(name, case, id=f"{name}-{case[0]}")
                                        for case in CASES for name in TEMPLATES if name in case[5]])
def test_render_equals_transformers(pairs, name, case):
    _, messages, tools, gen, extra, _ = case
    want, got = _both(pairs[name], messages, tools, gen, **DATE, **extra)
    assert got == want
    assert "Paris" not in json.dumps(messages) or "Paris" in got  # the conversation is in the prompt


def test_the_renders_show_the_features_they_test(pairs):
    """The comparisons above are not vacuous: the tool specs, calls, results and reasoning are rendered."""
    _, qwen = _both(pairs["qwen3"], TOOL_ROUND, TOOLS, **DATE)
    assert '"name": "get_weather"' in qwen and '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' \
        in qwen and "<tool_response>\n{\"temp_c\": 21" in qwen and "Zürich" in qwen  # tojson: ensure_ascii=False
    _, glm = _both(pairs["glm-4.6"], TOOL_ROUND, TOOLS, **DATE)
    assert "<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>" in glm and "<|observation|>" in glm
    _, llama = _both(pairs["llama-3.1-instruct"], TOOL_ROUND, TOOLS, **DATE)
    assert "Today Date: 03 Feb 2025" in llama and '    "type": "function",' in llama  # tojson(indent=4)
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}' in llama
    _, thinking = _both(pairs["qwen3"], REASONING, **DATE)
    assert "<think>\nAdd again.\n</think>" not in thinking.split("3+3?")[0]
    assert "Add them." not in thinking  # Qwen3 drops reasoning before the last user turn


def test_strftime_now_reads_one_frozen_clock_on_both_sides(pairs, monkeypatch):
    instant = datetime(2025, 2, 3, 12, 0, 0)

    class Frozen(datetime):
        @classmethod
        def now(cls, tz=None):
            return instant

    from transformers.utils import chat_template_utils

    monkeypatch.setattr(chat_template_utils, "datetime", Frozen)
    monkeypatch.setattr(chat_template, "_now", lambda: instant)
    want, got = _both(pairs["llama-3.2-instruct"], SYSTEM_USER)
    assert got == want and "Today Date: 03 Feb 2025" in got


def test_special_tokens_are_the_template_variables_transformers_passes(tmp_path):
    d = _write_model(tmp_path / "m", "{{ bos_token }}|{{ image_token }}|{{ unk_token is defined }}|{{ eos_token }}",
                     image_token="<img>", add_bos_token=False)
    hf, ours = transformers.AutoTokenizer.from_pretrained(str(d)), Tokenizer(d)
    assert ours.special_tokens == hf.special_tokens_map
    want, got = _both((hf, ours), SYSTEM_USER)
    assert got == want == "<s>|<img>|False|</s>"


def test_template_arguments_override_special_tokens_and_may_be_anything(pairs, tmp_path):
    d = _write_model(tmp_path / "m", "{{ bos_token }}{{ flag | tojson }}{{ items | tojson(indent=2, sort_keys=True) }}"
                                     "{% for x in items.b %}{% if x > 1 %}{% break %}{% endif %}{{ x }}{% endfor %}"
                                     "{% set ns = namespace(n=0) %}{% set ns.n = ns.n + 1 %}{{ ns.n }}"
                                     "{{ dict(a=1) | tojson(separators=(',', ':')) }}"
                                     "{% generation %}[{{ messages[-1].content }}]{% endgeneration %}")
    hf, ours = transformers.AutoTokenizer.from_pretrained(str(d)), Tokenizer(d)
    extra = {"bos_token": "BOS!", "flag": None, "items": {"b": [1, 2, 3], "a": "é"}}
    want, got = _both((hf, ours), SYSTEM_USER, **extra)
    assert got == want and got.startswith("BOS!null{")


def test_named_templates_pick_tool_use_with_tools(tmp_path):
    named = [{"name": "default", "template": "D{{ messages | length }}"},
             {"name": "tool_use", "template": "T{{ tools | length }}"}]
    d = _write_model(tmp_path / "m", named)
    hf, ours = transformers.AutoTokenizer.from_pretrained(str(d)), Tokenizer(d)
    assert _both((hf, ours), SYSTEM_USER) == ("D2", "D2")
    assert _both((hf, ours), SYSTEM_USER, [WEATHER]) == ("T1", "T1")


def test_chat_template_jinja_wins_over_the_config(tmp_path):
    d = _write_model(tmp_path / "m", "FILE", in_jinja_file=True)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": "CONFIG"}))
    hf, ours = transformers.AutoTokenizer.from_pretrained(str(d)), Tokenizer(d)
    assert _both((hf, ours), SYSTEM_USER) == ("FILE", "FILE")


def test_raise_exception_is_a_chat_template_error(pairs):
    hf, ours = pairs["llama-3.1-instruct"]
    from jinja2.exceptions import TemplateError

    with pytest.raises(TemplateError, match="single tool-calls"):  # transformers' raise_exception
        hf.apply_chat_template(TWO_CALLS_JSON_ARGS, tools=TOOLS, tokenize=False)
    with pytest.raises(chat_template.ChatTemplateError, match="single tool-calls"):
        ours.apply_chat_template(TWO_CALLS_JSON_ARGS, tools=TOOLS)


def test_the_sandbox_refuses_what_transformers_refuses(tmp_path):
    import jinja2

    with pytest.raises(jinja2.exceptions.SecurityError):
        chat_template.render("{{ messages.__class__.__mro__ }}", SYSTEM_USER)
    with pytest.raises(jinja2.exceptions.SecurityError):
        chat_template.render("{% set ns = namespace(_x=1) %}", SYSTEM_USER)
    with pytest.raises(jinja2.exceptions.SecurityError):  # immutable: no list.append
        chat_template.render("{{ messages.append(1) }}", SYSTEM_USER)


# ---- row checks -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("messages, fragment", [
    ([{"role": "user", "content": "hi", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}],
     "only assistant turns call tools"),
    ([{"role": "assistant", "content": "", "tool_calls": {"name": "f"}}], "expected a list"),
    ([{"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}], "no function name"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{not json"}}]}],
     "not JSON"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1, 2]"}}]}], "not an object"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}], "arguments is missing"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}], "arguments is a int"),
    ([{"role": "assistant", "tool_calls": ["f()"]}], "is not an object"),
    ([{"role": "tool"}], "content is missing or null"),
    ([{"role": "assistant", "content": ["a", "b"]}], "content is a list"),
    ([{"role": "assistant", "content": "x", "reasoning_content": 7}], "reasoning_content is a int"),
])
def test_bad_messages_are_named(messages, fragment):
    problem = check_messages(messages, 10_000)
    assert isinstance(problem, RowProblem) and problem.code in (BAD_TYPE, "null_prompt"), problem
    assert fragment in problem.message


def test_messages_keep_what_templates_read_and_drop_nulls():
    checked = check_messages(json.dumps([
        {"role": "user", "content": "hi", "tool_calls": [], "name": None},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "", "tool_call_id": "c1", "extra": {"k": 1}},
    ]), 10_000)
    assert checked == [{"role": "user", "content": "hi"},
                       {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
                       {"role": "tool", "content": "", "tool_call_id": "c1", "extra": {"k": 1}}]


def test_tools_cells():
    assert check_tools(None, 100) is None and check_tools("[]", 100) is None and check_tools([], 100) is None
    assert check_tools(json.dumps([WEATHER]), 10_000) == [WEATHER]
    assert check_tools([{"name": "bare", "parameters": {}}], 10_000) == [{"name": "bare", "parameters": {}}]
    for bad, fragment in [("{", "not JSON"), ({"a": 1}, "expected a list"), ([{"type": "function"}], "not a function"),
                          ([{"name": "f", "parameters": "x"}], "parameters is not"), ([WEATHER], "max_row_bytes")]:
        problem = check_tools(bad, 50 if fragment == "max_row_bytes" else 10_000)
        assert isinstance(problem, RowProblem) and fragment in problem.message, (bad, problem)


def test_build_prompt_error_rows(pairs):
    _, ours = pairs["llama-3.1-instruct"]

    def build(messages, tools=None):
        return build_prompt(None, messages, True, "", 100_000, ours, tools, DATE)

    assert build(TOOL_ROUND, TOOLS) == pairs["llama-3.1-instruct"][0].apply_chat_template(
        TOOL_ROUND, tools=TOOLS, add_generation_prompt=True, tokenize=False, **DATE)
    rejected = build(TWO_CALLS_JSON_ARGS, TOOLS)
    assert rejected.code == BAD_TYPE and "rejected the messages: This model only supports single" in rejected.message
    assert build(SYSTEM_USER, "not json").code == BAD_TYPE
    # Llama-3.1 renders a tool call without the turn's text: that text would silently vanish
    said = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Let me look that up.",
                                                 "tool_calls": [{"function": {"name": "get_time", "arguments": {}}}]}]
    assert build(said, TOOLS).code == "unrendered_message"


def test_a_template_without_tool_calls_drops_them_as_an_error_row(tmp_path):
    d = _write_model(tmp_path / "m", "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "lookup", "arguments": {}}}]}]
    problem = build_prompt(None, messages, True, "", 10_000, Tokenizer(d))
    assert problem.code == "unrendered_message" and "'lookup'" in problem.message


# ---- the job path -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen_model(tmp_path_factory):
    """The tiny test model with the Qwen3 template (chat_template.jinja wins over its own template)."""
    import shutil

    d = tmp_path_factory.mktemp("qwen-tiny") / "model"
    shutil.copytree(tiny_model_dir(), d)
    (d / "chat_template.jinja").write_text((FIXTURES / "qwen3.jinja").read_text(encoding="utf-8"), encoding="utf-8")
    return d


def test_a_messages_column_with_a_tools_column_renders_through_the_job(qwen_model, tmp_path):
    from flashx_batch.runner import run

    rows = [
        {"id": 1, "messages": json.dumps(TOOL_ROUND), "tools": json.dumps(TOOLS)},
        {"id": 2, "messages": json.dumps(SYSTEM_USER), "tools": None},
        {"id": 3, "messages": json.dumps(REASONING), "tools": "[]"},
        {"id": 4, "messages": json.dumps(SYSTEM_USER), "tools": '[{"type": "function"}]'},
        {"id": 5, "messages": json.dumps([{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]),
         "tools": None},
    ]
    data = write_parquet(tmp_path / "in" / "chat.parquet", rows)
    out = tmp_path / "out"
    job = compose_job(overrides(qwen_model, data, out, "executor.kind=local", "data.messages_column=messages",
                                "data.tools_column=tools", "sampling.max_new_tokens=2", "runtime.max_input_len=1000",
                                "+data.chat_template_kwargs.enable_thinking=false"))
    assert run(job) == 0
    errors = {r["id"]: r for r in pq.read_table(out / "errors").to_pylist()}
    assert {i: e["error_code"] for i, e in errors.items()} == {4: "bad_type", 5: "bad_type"}
    assert "tools[0] is not a function spec" in errors[4]["error_message"]
    assert "arguments is missing" in errors[5]["error_message"]
    hf = transformers.AutoTokenizer.from_pretrained(str(qwen_model))
    ours = Tokenizer(qwen_model)
    want = {}
    for r in rows[:3]:
        tools = json.loads(r["tools"]) or None if r["tools"] else None
        text = hf.apply_chat_template(json.loads(r["messages"]), tools=tools, add_generation_prompt=True,
                                      tokenize=False, enable_thinking=False)
        assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        want[r["id"]] = len(ours.encode(text, add_special_tokens=False))
    generated = pq.read_table(out / "generations").to_pylist()
    assert {g["id"]: g["num_input_tokens"] for g in generated} == want


def test_job_wide_tools_and_their_checks(qwen_model, tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"id": 1, "messages": SYSTEM_USER}) + "\n")
    base = overrides(qwen_model, path, None, "data.messages_column=messages")
    job = compose_job([*base, "data.tools=[{type: function, function: {name: get_weather, parameters: {}}}]"])
    plan = plan_prompts(job, load_inputs(job.data, str(path)), Tokenizer(qwen_model))
    assert plan.num_valid == 1
    from flashx_batch.runner.job import plan_job, run

    bad = compose_job([*base, f"output.dir={tmp_path / 'o'}", "data.tools=[{type: function}]"])
    with pytest.raises(ConfigError, match=r"data.tools\[0\] is not a function spec"):
        plan_job(bad)
    assert run(bad) == 2 and not (tmp_path / "o").exists()  # a bad job: exit 2, nothing written
    with pytest.raises(ConfigError, match="both set"):
        compose_job([*base, "data.tools_column=tools", "data.tools=[{name: x}]"])
    with pytest.raises(ConfigError, match="messages_column is not"):
        compose_job(overrides(qwen_model, path, None, "data.tools=[{name: x}]"))
    with pytest.raises(ConfigError, match="'messages'"):
        compose_job([*base, "+data.chat_template_kwargs.messages=1"])

