"""Every preset composes through Hydra and converts to the typed JobConfig; bad keys are named."""

from __future__ import annotations

from pathlib import Path

import pytest

from flashx_batch.config import JobConfig, compose_job, preset_names, resolve_data_path, resolve_model_dir
from flashx_batch.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def test_presets_are_the_top_level_conf_dir():
    # The package reads the presets through flashx_batch/conf -> ../conf: one copy, no drift.
    assert (REPO / "flashx_batch" / "conf").resolve() == (REPO / "conf").resolve()
    assert {"legal_docs", "smoke", "eval_sweep"} <= set(preset_names())


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_composes(name):
    job = compose_job([f"conf={name}"])
    assert isinstance(job, JobConfig)
    assert job.data.id_column == "id" and job.data.prompt_column == "prompt"
    assert job.sampling.max_new_tokens <= job.runtime.max_output_len
    assert job.output.dir
    assert resolve_model_dir(job.model.path).name == "legal-tiny"
    data = "legal_eval.parquet" if name == "eval_sweep" else "legal_docs.parquet"  # the sweep evaluates
    assert resolve_data_path(job.data.path).endswith(f"flashx_batch/assets/data/{data}")


def test_legal_docs_is_the_embedded_default():
    default, explicit = compose_job([]), compose_job(["conf=legal_docs"])
    assert default == explicit
    assert default.executor.kind == "ray" and default.executor.address is None
    assert default.runtime.max_input_len == 512


def test_smoke_is_small_and_local():
    job = compose_job(["conf=smoke"])
    assert job.executor.kind == "local" and job.data.limit is not None and job.data.limit <= 16


def test_overrides_reach_the_dataclass():
    job = compose_job(["conf=smoke", "runtime.max_batch_size=2", "sampling.stop=[END]", "+executor.resources.NPU=1",
                       "data.passthrough_columns=[source,lang]"])
    assert job.runtime.max_batch_size == 2 and job.sampling.stop == ["END"]
    assert job.executor.resources == {"NPU": 1.0} and job.data.passthrough_columns == ["source", "lang"]
    assert compose_job(["conf=smoke", "runtime.kv_layout=stripes"]).engine_options().kv_layout == "stripes"
    assert compose_job(["conf=smoke"]).engine_options().kv_layout == "auto"
    with pytest.raises(ConfigError, match="runtime.kv_layout='paged' is not one of auto, stripes, extents"):
        compose_job(["conf=smoke", "runtime.kv_layout=paged"]).engine_options()


@pytest.mark.parametrize("override, fragment", [
    ("runtime.max_batch_siz=4", "max_batch_siz"),
    ("+data.colour=red", "colour"),
    ("runtime.max_batch_size=abc", "max_batch_size"),
    ("executor.kind=spark", "executor.kind"),
    ("sampling.top_p=0", "top_p"),
    ("sampling.max_new_tokens=999", "max_output_len"),
])
def test_bad_keys_and_values_are_named(override, fragment):
    with pytest.raises(ConfigError) as info:
        compose_job(["conf=smoke", override])
    assert fragment in str(info.value)


def test_converter_rejects_unknown_keys_without_hydra():
    from flashx_batch.config import to_job_config

    with pytest.raises(ConfigError, match="bogus"):
        to_job_config({"data": {"path": "x.parquet", "bogus": 1}})
    assert to_job_config({"data": {"path": "x.parquet"}}).data.path == "x.parquet"
