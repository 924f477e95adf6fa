"""The default job (`conf=legal_docs`: the bundled legal sample, local Ray) with `model.path` pointing at
a tiny random GLM-5 checkpoint (latent attention, the sparse-attention indexer, sigmoid-routed experts)
instead of the bundled model: it finishes, every input row is in exactly one of generations/ and
errors/, once, and a rerun changes nothing."""

from __future__ import annotations

import shutil

import pyarrow.parquet as pq
from batch_support import output_ids, tree_snapshot
from model_factory import build

from flashx_batch.config import compose_job
from flashx_batch.runner import run
from flashx_batch.runtime.options import bundled_model_dir

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def test_default_job_runs_a_tiny_glm5_checkpoint_exactly_once(tmp_path):
    model = tmp_path / "glm5"
    bundled = bundled_model_dir()
    # the bundled tokenizer's 4096 ids, so the legal sample's text prompts tokenize for it; an index_topk
    # below the prompts' lengths, so the indexer picks keys on every row
    build("glm_moe_dsa", model, vocab_size=4096, index_topk=64, max_position_embeddings=1024)
    for name in TOKENIZER_FILES:
        shutil.copy(bundled / name, model / name)
    out = tmp_path / "out"
    job = compose_job(["conf=legal_docs", f"model.path={model}", f"output.dir={out}", "sampling.max_new_tokens=16",
                       "executor.num_actors=1", "executor.progress_interval_s=1000"])
    assert run(job) == 0
    rows = pq.read_table(bundled.parent.parent / "data" / "legal_docs.parquet", columns=["id"]).column("id")
    generated, errors = output_ids(out)
    assert max((generated + errors).values()) == 1  # nothing written twice
    assert set(generated) | set(errors) == set(rows.to_pylist()) and not set(generated) & set(errors)
    gen = pq.read_table(out / "generations")
    assert len(generated) > 100 and min(gen.column("num_generated_tokens").to_pylist()) >= 1
    before = tree_snapshot(out)
    assert run(job) == 0  # a rerun of the finished job: every shard already committed
    after = tree_snapshot(out)
    assert {k: v for k, v in before.items() if k.startswith(("generations", "errors", "_manifest"))} == \
        {k: v for k, v in after.items() if k.startswith(("generations", "errors", "_manifest"))}
