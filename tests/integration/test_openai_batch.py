"""OpenAI Batch JSONL in and out: 120 chat requests with per-line sampling (and some a runner must refuse)
run end to end; the output file passes a schema check of the OpenAI batch output format; per-line
sampling is applied; a driver killed mid-job and resumed writes every custom_id exactly once."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest
from batch_support import cli, faults_override, overrides, tiny_model_dir

from flashx_batch.config import compose_job
from flashx_batch.data import openai_batch
from flashx_batch.runner import run
from flashx_batch.runner.job import plan_job

N = 120
WORDS = "the licence shall grant any person permission to use copy modify merge publish distribute".split()
REFUSED = {6: "bad_request", 26: "bad_request", 7: "bad_sampling_param", 48: "bad_sampling_param",
           9: "bad_request", 59: "bad_request"}


def _requests() -> list[dict]:
    rng = random.Random(0)
    lines = []
    for i in range(N):
        body: dict = {"model": "tiny", "messages": [{"role": "user", "content": " ".join(rng.choices(WORDS, k=8))}]}
        kind = i % 10
        if kind in (1, 2):
            body |= {"temperature": 0.8, "seed": i}
        elif kind == 3:
            body["max_tokens"] = 3
        elif kind == 4:
            body |= {"temperature": 1.0, "top_p": 0.9, "seed": 5}
        elif kind == 5:
            body["max_completion_tokens"] = 4
        lines.append({"custom_id": f"req-{i}", "method": "POST", "url": openai_batch.CHAT, "body": body})
    lines[6]["body"]["frequency_penalty"] = 0.5  # not supported: refused, never silently ignored
    lines[26]["body"]["n"] = 3
    lines[7]["body"]["max_tokens"] = 10_000  # past runtime.max_output_len
    lines[48]["body"]["temperature"] = "hot"
    lines[9]["url"] = openai_batch.COMPLETIONS  # another endpoint than the batch's
    lines[59]["priority"] = "high"  # an unknown line field
    return lines


@pytest.fixture(scope="module")
def batch_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("batch") / "requests.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in _requests()))
    return path


def _args(batch, out, *extra):
    return overrides(tiny_model_dir(), batch, out, "data.format=openai_batch", "output.format=openai_batch",
                     "executor.kind=local", "runtime.shard_size=8", "runtime.max_output_len=16",
                     "sampling.max_new_tokens=12", *extra)


def check_output_line(line: dict) -> None:
    """The OpenAI batch output format: id, custom_id, and exactly one of response (status_code 200, a
    request_id, a chat.completion body) or error (code, message)."""
    assert set(line) == {"id", "custom_id", "response", "error"}
    assert isinstance(line["id"], str) and line["id"].startswith("batch_req_") and isinstance(line["custom_id"], str)
    if line["error"] is not None:
        assert line["response"] is None and set(line["error"]) == {"code", "message"}
        assert all(isinstance(v, str) and v for v in line["error"].values())
        return
    response = line["response"]
    assert set(response) == {"status_code", "request_id", "body"} and response["status_code"] == 200
    body = response["body"]
    assert {"id", "object", "created", "model", "choices", "usage"} <= set(body)
    assert body["object"] == "chat.completion" and isinstance(body["created"], int) and body["model"] == "tiny"
    for k, choice in enumerate(body["choices"]):
        assert choice["index"] == k and choice["finish_reason"] in ("stop", "length")
        assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
        assert "logprobs" in choice
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] and usage["prompt_tokens"] > 0


def _lines(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "openai_batch_output.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def finished(batch_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "out"
    assert run(compose_job(_args(batch_file, out))) == 0
    return out


def test_a_batch_runs_end_to_end_in_the_openai_shape(finished):
    lines = _lines(finished)
    for line in lines:
        check_output_line(line)
    assert Counter(x["custom_id"] for x in lines) == Counter(f"req-{i}" for i in range(N))
    errors = {int(x["custom_id"][4:]): x["error"]["code"] for x in lines if x["error"]}
    assert errors == REFUSED
    by_id = {x["custom_id"]: x for x in lines}
    usage = {i: by_id[f"req-{i}"]["response"]["body"]["usage"]["completion_tokens"] for i in range(N)
             if i not in REFUSED}
    assert all(usage[i] <= 3 for i in usage if i % 10 == 3)  # max_tokens per line
    assert all(usage[i] <= 4 for i in usage if i % 10 == 5)  # max_completion_tokens per line
    assert max(usage.values()) > 4  # the others ran to the job-wide 12


def test_per_line_sampling_is_each_lines_own(finished, tmp_path):
    """A line's sampling comes from its own body: the same seed and temperature give the same text under
    another custom_id and in another batch; another seed or a temperature of 0 give another one."""
    message = _requests()[11]["body"]["messages"]

    def line(custom_id, **sampling):
        return {"custom_id": custom_id, "method": "POST", "url": openai_batch.CHAT,
                "body": {"model": "tiny", "messages": message, **sampling}}

    lines = [line("a", temperature=1.0, seed=11), line("b", temperature=1.0, seed=11),
             line("c", temperature=1.0, seed=12), line("d", temperature=0.0), line("e")]
    path = tmp_path / "sampling.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out"
    assert run(compose_job(_args(path, out))) == 0
    text = {x["custom_id"]: x["response"]["body"]["choices"][0]["message"]["content"] for x in _lines(out)}
    assert text["a"] == text["b"] != text["c"]  # the line's seed, not its custom_id, seeds it
    assert text["d"] == text["e"] != text["a"]  # temperature 0 (the job's default too): greedy


def test_killed_and_resumed_every_custom_id_once(batch_file, finished, tmp_path):
    out = tmp_path / "out"
    plan = plan_job(compose_job(_args(batch_file, out))).plan
    victim = plan.shards[len(plan.shards) // 2].shard_id
    killed = cli(_args(batch_file, out, faults_override([f"crash:at=after_publish:attempt=1:shard={victim}"])),
                 cwd=tmp_path)
    assert killed.returncode != 0 and not (out / "openai_batch_output.jsonl").exists()
    resumed = cli(_args(batch_file, out), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    lines = _lines(out)
    assert Counter(x["custom_id"] for x in lines) == Counter(f"req-{i}" for i in range(N))
    for line in lines:
        check_output_line(line)
    strip = lambda x: {**x, "response": x["response"] and {**x["response"], "body": {  # noqa: E731
        **x["response"]["body"], "created": 0}}}
    want = {x["custom_id"]: strip(x) for x in _lines(finished)}
    assert {x["custom_id"]: strip(x) for x in lines} == want  # greedy and seeded: the same responses


def test_request_lines_are_checked_one_by_one():
    raw = b"\n".join([
        b'["not", "an", "object"]',
        b'{"method": "POST", "url": "/v1/chat/completions", "body": {"messages": []}}',
        b'{"custom_id": "a", "method": "GET", "url": "/v1/chat/completions", "body": {}}',
        b'{"custom_id": "b", "method": "POST", "url": "/v1/embeddings", "body": {}}',
        b'{"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": ["x", "y"]}}',
        b'{"custom_id": "d", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi", "max_tokens": 3}}',
    ])
    cols = openai_batch.parse("f.jsonl", raw)
    assert cols["custom_id"] == ["(f.jsonl line 1)", "(f.jsonl line 2)", "a", "b", "c", "d"]
    problems = cols["request_error"]
    assert "not a request object" in problems[0] and "no custom_id" in problems[1]
    assert "method 'GET'" in problems[2] and "input is None" in problems[3] and "one string" in problems[4]
    assert problems[5] is None and cols["prompt"][5] == "hi" and cols["max_new_tokens"][5] == 3


def test_a_completions_batch_with_logprobs(tmp_path):
    """/v1/completions: text_completion bodies; with sampling.logprobs set, each choice's logprobs in the
    completions shape (tokens, token_logprobs, top_logprobs), one entry per generated token."""
    lines = [{"custom_id": f"c-{i}", "method": "POST", "url": openai_batch.COMPLETIONS,
              "body": {"model": "tiny", "prompt": " ".join(WORDS[i : i + 6]), "max_tokens": 4 + i % 3,
                       **({"logprobs": 2} if i % 2 else {})}} for i in range(6)]
    path = tmp_path / "completions.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out"
    assert run(compose_job(_args(path, out, "sampling.logprobs=2"))) == 0
    got = {x["custom_id"]: x for x in _lines(out)}
    assert sorted(got) == [f"c-{i}" for i in range(6)] and all(x["error"] is None for x in got.values())
    for i in range(6):
        body = got[f"c-{i}"]["response"]["body"]
        choice = body["choices"][0]
        assert body["object"] == "text_completion" and isinstance(choice["text"], str) and "message" not in choice
        n = body["usage"]["completion_tokens"]
        assert n <= 4 + i % 3
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n
        assert all(v <= 0 for v in lp["token_logprobs"]) and all(len(t) <= 2 for t in lp["top_logprobs"])
