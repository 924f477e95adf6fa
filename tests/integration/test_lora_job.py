"""Per-row LoRA adapters as a job: rows of two adapters and the base model (and rows naming an adapter the job did
not load) in one input; every id once, each generation the engine's own for its row's adapter, the adapter named
in the output, unknown names as error rows; a driver killed between a shard's publish and its manifest resumes
to every id exactly once; an adapter replaced under its name is another job; bad adapters stop the job before
any output."""

from __future__ import annotations

import json
import signal

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from batch_support import cli, faults_override

from flashx_batch import Engine, run_job
from flashx_batch.config import compose_job
from flashx_batch.errors import ConfigError
from flashx_batch.runner.job import plan_job
from flashx_batch.runtime.options import bundled_model_dir
from flashx_batch.runtime.params import SamplingParams

SAMPLE = "flashx_batch/assets/data/legal_docs.parquet"
CYCLE = [None, "contracts", "summaries", "contracts", "typo"]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """Two PEFT adapters for the bundled model and the bundled sample with an `adapter` column."""
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("lora_job")
    base = tf.AutoModelForCausalLM.from_pretrained(bundled_model_dir(), dtype=torch.float32)
    for seed, (name, targets) in enumerate({"contracts": ["q_proj", "v_proj"],
                                            "summaries": ["o_proj", "gate_proj", "down_proj"]}.items(), start=1):
        torch.manual_seed(seed)
        model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False),
                               adapter_name=name)
        model.save_pretrained(root / "adapters", selected_adapters=[name])
        base = model.unload()
    table = pq.read_table(SAMPLE)
    adapters = [CYCLE[i % len(CYCLE)] for i in range(table.num_rows)]
    pq.write_table(table.append_column("adapter", pa.array(adapters, pa.string())), root / "input.parquet")
    return root


def _args(root, out, *extra):
    return ["conf=legal_docs", f"data.path={root / 'input.parquet'}", "data.adapter_column=adapter",
            f"+model.lora_adapters={{contracts:{root / 'adapters' / 'contracts'},"
            f"summaries:{root / 'adapters' / 'summaries'}}}",
            "sampling.max_new_tokens=8", "runtime.shard_size=24", f"output.dir={out}", "executor.kind=local", *extra]


def test_rows_of_mixed_adapters_once_each(workspace, caplog):
    out = workspace / "out"
    assert run_job(_args(workspace, out)) == 0
    generations = pq.read_table(out / "generations").to_pylist()
    errors = pq.read_table(out / "errors").to_pylist()
    source = pq.read_table(workspace / "input.parquet").to_pylist()
    ids = [r["id"] for r in generations] + [r["id"] for r in errors]
    assert sorted(ids) == sorted(r["id"] for r in source)  # every id once
    unknown = [r for r in errors if r["error_code"] == "unknown_adapter"]
    assert {r["id"] for r in unknown} == {r["id"] for r in source if r["adapter"] == "typo"}
    assert "'typo', not an adapter of model.lora_adapters (contracts, summaries)" in unknown[0]["error_message"]
    by_id = {r["id"]: r for r in generations}
    assert all(by_id[r["id"]]["adapter"] == r["adapter"] for r in source if r["id"] in by_id)
    assert {r["adapter"] for r in generations} == {None, "contracts", "summaries"}
    # each answer is the engine's for its row's adapter (the first rows of each kind)
    picked = [next(r for r in source if r["adapter"] == name and r["id"] in by_id)
              for name in (None, "contracts", "summaries")]
    engine = Engine.from_pretrained(None, lora_adapters={n: workspace / "adapters" / n
                                                         for n in ("contracts", "summaries")})
    want = engine.generate([r["prompt"] for r in picked], SamplingParams(max_new_tokens=8),
                           adapters=[r["adapter"] for r in picked])
    assert [by_id[r["id"]]["generated_text"] for r in picked] == [w.text for w in want]
    assert len({w.text for w in want}) == 3  # the adapters answer differently
    # an adapter retrained under the same name is another job: refused, naming the key
    changed = workspace / "adapters_changed"
    import shutil

    shutil.copytree(workspace / "adapters", changed)
    config = json.loads((changed / "contracts" / "adapter_config.json").read_text())
    (changed / "contracts" / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 32}))
    rerun = [a.replace(str(workspace / "adapters"), str(changed)) for a in _args(workspace, out)]
    assert run_job(rerun) == 2
    assert "model.lora_adapters: {'contracts'" in caplog.text


def test_killed_between_publish_and_manifest_then_resumed(workspace, tmp_path):
    out = tmp_path / "out"
    args = _args(workspace, out)
    victim = plan_job(compose_job(args)).plan.shards[1].shard_id
    crashed = cli([*args, faults_override([f"crash:at=after_publish:shard={victim}"])], cwd=tmp_path)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    resumed = cli(args, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ids = pq.read_table(out / "generations").column("id").to_pylist() + \
        pq.read_table(out / "errors").column("id").to_pylist()
    assert len(ids) == len(set(ids)) == 120


def test_bad_adapter_stops_the_job_before_output(workspace, tmp_path):
    import shutil

    root = tmp_path / "ws"
    shutil.copytree(workspace / "adapters", root / "adapters")
    shutil.copy(workspace / "input.parquet", root / "input.parquet")
    (root / "adapters" / "contracts" / "adapter_model.safetensors").write_bytes(b"\x00" * 4)
    message = "adapter_model.safetensors: not a complete safetensors file"
    with pytest.raises(ConfigError, match=message):
        plan_job(compose_job(_args(root, tmp_path / "out")))
    assert run_job(_args(root, tmp_path / "out")) == 2
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("extra, message", [
    (["+model.lora_adapters={a:/tmp/nowhere}"], "data.adapter_column is not"),
    (["data.adapter_column=adapter"], "model.lora_adapters is empty"),
    (["data.adapter_column=adapter", "+model.lora_adapters={a:/tmp/nowhere}", "task=perplexity"],
     "applies to task=generate"),
    (["data.adapter_column=adapter", "+model.lora_adapters={a:/tmp/nowhere}", "runtime.cache_policy=segment_sparse"],
     "does not combine with runtime.cache_policy=segment_sparse"),
])
def test_adapter_settings_checked(extra, message):
    with pytest.raises(ConfigError, match=message):
        plan_job(compose_job(["conf=legal_docs", "output.dir=/tmp/never", *extra]))
