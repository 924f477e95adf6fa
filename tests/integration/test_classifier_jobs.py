"""task=classify and task=score as whole jobs through a kill: a driver killed between a shard's publish and its
manifest resumes to every id exactly once (generations + errors), the values those of an uninterrupted run."""

from __future__ import annotations

import signal

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from batch_support import cli, faults_override

from flashx_batch.config import compose_job
from flashx_batch.runner.job import plan_job
from flashx_batch.runtime.options import bundled_model_dir

ROWS = 40


def _classifier(directory, num_labels: int):
    """A random Qwen3 sequence classifier with the bundled tokenizer (and its chat template)."""
    import transformers as tf

    labels = {i: f"label{i}" for i in range(num_labels)}
    config = tf.Qwen3Config(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                            pad_token_id=0, num_labels=num_labels, id2label=labels,
                            label2id={v: k for k, v in labels.items()}, tie_word_embeddings=False)
    torch.manual_seed(num_labels)
    tf.Qwen3ForSequenceClassification(config).eval().save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (directory / name).write_bytes((bundled_model_dir() / name).read_bytes())


@pytest.mark.parametrize("task", ["classify", "score"])
def test_killed_between_publish_and_manifest_then_resumed(tmp_path, task):
    model = tmp_path / "model"
    _classifier(model, 3 if task == "classify" else 1)
    sample = pq.read_table("flashx_batch/assets/data/legal_docs.parquet").slice(0, ROWS)
    prompts = sample.column("prompt").to_pylist()
    table = pa.table({"id": sample.column("id"), "prompt": prompts,
                      "query": [f"is clause {i} enforceable?" for i in range(ROWS)],
                      "document": [p if i % 9 else None for i, p in enumerate(prompts)]})  # some pairs lack one
    pq.write_table(table, tmp_path / "in.parquet")
    args = ["conf=legal_docs", f"task={task}", f"model.path={model}", f"data.path={tmp_path / 'in.parquet'}",
            "runtime.long_input=truncate", "runtime.shard_size=8", "executor.kind=local"]
    if task == "score":
        args.append("score.format=chat")
    clean = tmp_path / "clean"
    assert cli([*args, f"output.dir={clean}"], cwd=tmp_path).returncode == 0
    out = tmp_path / "out"
    victim = plan_job(compose_job([*args, f"output.dir={out}"])).plan.shards[1].shard_id
    crashed = cli([*args, f"output.dir={out}", faults_override([f"crash:at=after_publish:shard={victim}"])],
                  cwd=tmp_path)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    resumed = cli([*args, f"output.dir={out}"], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = pq.read_table(out / "generations").to_pylist()
    errors = pq.read_table(out / "errors").to_pylist() if (out / "errors").exists() else []
    ids = [r["id"] for r in rows] + [r["id"] for r in errors]
    assert sorted(ids) == sorted(table.column("id").to_pylist())  # every id exactly once
    value = "logits" if task == "classify" else "score"  # the head's own numbers, not just the argmax
    clean_rows = pq.read_table(clean / "generations").to_pylist()
    want = {r["id"]: r[value] for r in clean_rows}
    got = {r["id"]: r[value] for r in rows}
    assert set(got) == set(want)
    for i, values in got.items():
        assert values == pytest.approx(want[i], abs=1e-5), i
    if task == "classify":
        assert {r["id"]: r["label"] for r in rows} == {r["id"]: r["label"] for r in clean_rows}
    else:
        assert {r["error_code"] for r in errors} == {"null_prompt"} and len(errors) == len(range(0, ROWS, 9))
