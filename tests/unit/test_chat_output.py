"""Reasoning and tool calls parsed back out of what each family's own chat template writes: render an
assistant turn with the template (tests/fixtures/chat_templates), take the text the assistant turn added,
parse it with the format found in the template, and get the same calls and reasoning back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashx_batch.runtime import chat_template
from flashx_batch.runtime.chat_output import OutputFormat, output_format, parse, split_reasoning

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "zip": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}, "utc": {"type": "boolean"}}}}}
USER = [{"role": "user", "content": "Weather in Zürich for 3 days, and the time?"}]
CALLS = [{"name": "get_weather", "arguments": {"city": "Zürich", "days": 3, "zip": "8001"}},
         {"name": "get_time", "arguments": {"tz": "Europe/Zurich", "utc": False}}]
FAMILIES = {"qwen3": ("hermes", True), "glm-4.6": ("glm", True), "llama-3.1-instruct": ("llama3_json", False)}
EXTRA = {"date_string": "03 Feb 2025", "bos_token": "<s>"}


def _template(name: str) -> str:
    return (FIXTURES / f"{name}.jinja").read_text()


def _assistant_text(name: str, message: dict) -> str:
    """What the template writes for one assistant turn after USER (its header and end tokens cut away)."""
    source = _template(name)
    before = chat_template.render(source, USER, tools=[WEATHER, TIME], add_generation_prompt=True, extra=EXTRA)
    whole = chat_template.render(source, [*USER, message], tools=[WEATHER, TIME], add_generation_prompt=False,
                                 extra=EXTRA)
    assert whole.startswith(before[: len(before) - 20])
    common = 0
    while common < min(len(before), len(whole)) and before[common] == whole[common]:
        common += 1
    turn = whole[common:]
    for end in ("<|im_end|>", "<|eot_id|>", "<|eom_id|>"):
        turn = turn.split(end)[0]
    return turn


@pytest.mark.parametrize("name", FAMILIES)
def test_format_found_in_each_template(name):
    calls, reasoning = FAMILIES[name]
    assert output_format(_template(name)) == OutputFormat(reasoning=reasoning, tool_calls=calls)


@pytest.mark.parametrize("name", FAMILIES)
def test_tool_calls_round_trip_through_the_template(name):
    calls = CALLS[:1] if name.startswith("llama") else CALLS  # Llama-3.1's template takes one call per turn
    message = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": c} for c in calls]}
    text = _assistant_text(name, message)
    parsed = parse(text, output_format(_template(name)), tools=[WEATHER, TIME])
    assert parsed.tool_call_error is None, text
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls] == \
        [(c["name"], c["arguments"]) for c in calls], text
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in parsed.tool_calls)
    assert parsed.content == ""


@pytest.mark.parametrize("name", ["qwen3", "glm-4.6"])
def test_reasoning_round_trip_through_the_template(name):
    message = {"role": "assistant", "reasoning_content": "The user wants a sum.\nTwo and two.", "content": "4"}
    parsed = parse(_assistant_text(name, message), output_format(_template(name)))
    assert (parsed.reasoning, parsed.content, parsed.tool_calls) == ("The user wants a sum.\nTwo and two.", "4", None)


def test_reasoning_and_a_call_with_text_around_it():
    text = '<think>\nneed weather\n</think>\n\nLet me check.\n<tool_call>\n{"name": "get_weather", ' \
           '"arguments": {"city": "Oslo"}}\n</tool_call>'
    parsed = parse(text, OutputFormat(reasoning=True, tool_calls="hermes"), tools=[WEATHER])
    assert parsed.reasoning == "need weather" and parsed.content == "Let me check."
    assert json.loads(parsed.tool_calls[0]["function"]["arguments"]) == {"city": "Oslo"}


def test_an_unparseable_call_stays_in_the_text_with_a_flag():
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>'
    parsed = parse(text, OutputFormat(tool_calls="hermes"), tools=[WEATHER])
    assert parsed.tool_calls is None and "not JSON" in parsed.tool_call_error
    assert "<tool_call>" in parsed.content and '"city"' in parsed.content
    cut = parse('<tool_call>\n{"name": "get_weather", "argu', OutputFormat(tool_calls="hermes"), tools=[WEATHER])
    assert cut.tool_calls is None and "not closed" in cut.tool_call_error and "get_weather" in cut.content
    llama = parse('{"name": "get_weather", "parameters": {"city"', OutputFormat(tool_calls="llama3_json"),
                  tools=[WEATHER])
    assert llama.tool_calls is None and llama.tool_call_error and llama.content.startswith('{"name"')


def test_thinking_opened_by_the_prompt_and_cut_by_the_budget():
    assert split_reasoning("weigh it up</think>\n\nYes.") == ("weigh it up", "\n\nYes.")
    assert split_reasoning("<think>still thinking when the budget") == ("still thinking when the budget", "")
    assert split_reasoning("No thinking here.") == (None, "No thinking here.")
    plain = parse("No thinking here.", OutputFormat(reasoning=True))
    assert (plain.reasoning, plain.content) == (None, "No thinking here.")


def test_calls_are_parsed_only_where_the_row_offered_tools():
    """A JSON answer with a "name" is an answer, not a call, unless it names a tool the row offered."""
    answer = '{"name": "Bob", "age": 3}'
    for tools in (None, [WEATHER]):
        parsed = parse(answer, OutputFormat(tool_calls="llama3_json"), tools=tools)
        assert (parsed.content, parsed.tool_calls, parsed.tool_call_error) == (answer, None, None)
    tagged = '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    assert parse(tagged, OutputFormat(tool_calls="hermes")).tool_calls is None  # no tools offered
    assert parse(tagged, OutputFormat(tool_calls="hermes"), tools=[WEATHER]).tool_calls is not None


def test_tags_a_vocabulary_marks_special_are_kept_for_parsing():
    from flashx_batch.runtime.options import bundled_model_dir
    from flashx_batch.runtime.tokenizer import Tokenizer

    tok = Tokenizer(bundled_model_dir())  # its <|assistant|> is a special token, as GLM's tags may be
    ids = [tok.token_to_id("<|assistant|>"), *tok.encode("hi", add_special_tokens=False), tok.token_to_id("</s>")]
    assert tok.special_among(("<|assistant|>", "<think>")) == {"<|assistant|>"}
    assert tok.decode(ids) == "hi"
    assert tok.decode_keeping(ids, {"<|assistant|>"}) == "<|assistant|>hi"
