"""task=embed as a job: the bundled sample embedded, every id once with a vector of the model's width; the
vectors are `Engine.embed`'s; a driver killed between a shard's publish and its manifest resumes to every
id exactly once; settings a vector job cannot use are refused."""

from __future__ import annotations

import signal

import pyarrow.parquet as pq
import pytest
import torch
from batch_support import cli, faults_override

from flashx_batch import Engine, run_job
from flashx_batch.config import compose_job
from flashx_batch.errors import ConfigError
from flashx_batch.runner.job import plan_job

BASE = ["conf=legal_docs", "task=embed", "runtime.long_input=truncate", "runtime.shard_size=32"]


def _ids_once(out) -> list:
    ids = pq.read_table(out / "generations").column("id").to_pylist()
    assert len(ids) == len(set(ids))
    return ids


def test_the_bundled_sample_embedded_once_each(tmp_path):
    out = tmp_path / "out"
    assert run_job([*BASE, f"output.dir={out}", "executor.kind=local", "embed.pooling=mean",
                    "embed.dimensions=64"]) == 0
    table = pq.read_table(out / "generations")
    assert sorted(_ids_once(out)) == sorted(pq.read_table(
        "flashx_batch/assets/data/legal_docs.parquet").column("id").to_pylist())
    assert str(table.schema.field("embedding").type) == "fixed_size_list<element: float>[64]"
    stats = pq.read_table(out / "stats").to_pylist()
    assert {s["embedding_dim"] for s in stats} == {64}
    # the vectors are the engine's own for the same texts
    rows = {r["id"]: r for r in table.to_pylist()}
    source = pq.read_table("flashx_batch/assets/data/legal_docs.parquet").to_pylist()[:5]
    engine = Engine.from_pretrained(None, long_input="truncate")
    want = engine.embed([r["prompt"] for r in source], pooling="mean", dimensions=64)
    got = torch.tensor([rows[r["id"]]["embedding"] for r in source])
    assert torch.allclose(got, want, atol=1e-4)
    assert all(rows[r["id"]]["source"] == r["source"] for r in source)  # the preset's passthrough column


def test_killed_between_publish_and_manifest_then_resumed(tmp_path):
    out = tmp_path / "out"
    args = [*BASE, f"output.dir={out}", "executor.kind=local"]
    victim = plan_job(compose_job(args)).plan.shards[1].shard_id
    crashed = cli([*args, faults_override([f"crash:at=after_publish:shard={victim}"])], cwd=tmp_path)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    resumed = cli(args, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert len(_ids_once(out)) == 120


@pytest.mark.parametrize("extra, message", [
    (["data.messages_column=messages"], "task=embed reads text"),
    (["sampling.n=2", "sampling.temperature=1"], "generates none"),
    (["embed.pooling=max"], "embed.pooling='max'"),
    (["embed.dimensions=0"], "embed.dimensions=0"),
    (["runtime.backend=onnx"], "torch backend"),
    (["runtime.long_input=rolling_merge", "runtime.cache_policy=segment_sparse"], "long_input=error or truncate"),
    (["embed.dimensions=9999"], "components"),
    (["runtime.tensor_parallel_size=2"], "tensor_parallel_size=1"),
])
def test_settings_a_vector_job_cannot_use_are_refused(tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        plan_job(compose_job([*BASE, f"output.dir={tmp_path}", *extra]))


def test_an_openai_embeddings_batch(tmp_path):
    """/v1/embeddings request lines in, OpenAI's embedding responses out; lines this runner cannot serve are
    bad_request error lines saying why; a chat batch under task=embed is refused."""
    import json

    lines = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": "m", "input": f"clause {i} of the licence" if i % 2 else [f"clause {i}"],
                       **({"dimensions": 32} if i == 2 else {})}} for i in range(5)]
    lines += [{"custom_id": "several", "method": "POST", "url": "/v1/embeddings", "body": {"input": ["a", "b"]}},
              {"custom_id": "base64", "method": "POST", "url": "/v1/embeddings",
               "body": {"input": "a", "encoding_format": "base64"}},
              {"custom_id": "width", "method": "POST", "url": "/v1/embeddings",
               "body": {"input": "a", "dimensions": 8}},
              {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
               "body": {"messages": [{"role": "user", "content": "hi"}]}}]
    src = tmp_path / "requests.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out"
    args = ["conf=legal_docs", "task=embed", "embed.dimensions=32", f"data.path={src}", "data.format=openai_batch",
            "output.format=openai_batch", "executor.kind=local"]
    assert run_job([*args, f"output.dir={out}"]) == 0
    got = {x["custom_id"]: x for x in map(json.loads, (out / "openai_batch_output.jsonl").read_text().splitlines())}
    assert set(got) == {x["custom_id"] for x in lines}
    engine = Engine.from_pretrained(None)
    want = engine.embed([f"clause {i} of the licence" if i % 2 else f"clause {i}" for i in range(5)], dimensions=32)
    for i in range(5):
        body = got[f"e{i}"]["response"]["body"]
        assert body["object"] == "list" and body["data"][0]["object"] == "embedding"
        assert torch.allclose(torch.tensor(body["data"][0]["embedding"]), want[i], atol=1e-4)
        assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    errors = {k: v["error"]["message"] for k, v in got.items() if v["error"]}
    assert set(errors) == {"several", "base64", "width", "chat"}
    assert "one non-empty string" in errors["several"] and "floats" in errors["base64"]
    assert "embed.dimensions=8" in errors["width"] and "/v1/embeddings" in errors["chat"]
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps(lines[-1]) + "\n")
    with pytest.raises(ConfigError, match="task=embed"):
        plan_job(compose_job([*args, f"data.path={chat}", f"output.dir={tmp_path / 'o2'}"]))


def test_the_fingerprint_holds_each_tasks_own_settings(tmp_path):
    from flashx_batch.runner import fingerprint

    embed = compose_job([*BASE, f"output.dir={tmp_path}", "embed.dimensions=32"])
    fp = fingerprint.compute(embed, plan_job(embed).plan, {})
    assert fp["task"] == "embed" and fp["embed.dimensions"] == 32 and fp["embed.pooling"] is None
    scored = compose_job(["conf=legal_docs", "task=perplexity", f"output.dir={tmp_path}", "runtime.long_input=truncate",
                          "data.context_column=ctx"])
    fp = fingerprint.compute(scored, plan_job(scored).plan, {})
    assert fp["data.context_column"] == "ctx" and "embed.dimensions" not in fp


def test_an_openai_chat_batch_under_task_classify_is_refused(tmp_path):
    import json

    src = tmp_path / "chat.jsonl"
    src.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                               "body": {"messages": [{"role": "user", "content": "hi"}]}}) + "\n")
    with pytest.raises(ConfigError, match="task=generate"):
        plan_job(compose_job(["conf=legal_docs", "task=classify", f"data.path={src}", "data.format=openai_batch",
                              f"output.dir={tmp_path / 'out'}"]))
