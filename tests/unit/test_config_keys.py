"""Every engine knob is declared once (`EngineOptions`) and shows up, the same, in the job schema and the docs.

The job schema's `runtime.*` group is derived from `EngineOptions`; these tests pin what a job may set,
and that docs/batch_jobs.md's "Config keys" table names exactly those keys with the `legal_docs` preset's values
(README.md's table of the common ones: its defaults too).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from flashx_batch.config import ENGINE_ONLY, JOB_ONLY_RUNTIME, JobConfig, compose_job
from flashx_batch.runtime.options import EngineOptions

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# the full table of every setting; README.md keeps the common ones (both are checked for their defaults)
EVERY_KEY = (ROOT / "docs" / "batch_jobs.md", "Config keys (every setting)")
COMMON_KEYS = (README, "Config keys (the common ones)")

# EngineOptions fields that are NOT `runtime.*` job keys, with the job key that sets them instead:
ENGINE_ONLY_FIELDS = {
    "dtype": "model.dtype",  # the model section names the weights' dtype, next to model.path
    "sort_by_length": None,  # not a job key: a job always sorts a shard's rows by length (pinned True)
    "fused_int8_decode": None,  # not a job key: the fused int8 decode step's A / B switch (default True)
}
# runtime.* keys that are no EngineOptions knob: how the job cuts its input, not how an engine runs
JOB_ONLY_KEYS = {"shard_size", "bucket_edges"}

ENGINE_FIELDS = [f.name for f in dataclasses.fields(EngineOptions)]


def schema_keys() -> set[str]:
    """Every dotted key of the job schema as Hydra sees it (sections one level deep)."""
    schema = OmegaConf.structured(JobConfig)
    keys = set()
    for name, node in schema.items():
        keys |= {f"{name}.{k}" for k in node.keys()} if OmegaConf.is_dict(node) else {name}
    return keys


def runtime_keys() -> set[str]:
    return {k for k in schema_keys() if k.startswith("runtime.")}


def job_key(field_name: str) -> str | None:
    """The job key that sets EngineOptions.`field_name` (None: no job key)."""
    return ENGINE_ONLY_FIELDS[field_name] if field_name in ENGINE_ONLY_FIELDS else f"runtime.{field_name}"


def readme_rows(table: tuple[Path, str] = EVERY_KEY) -> list[tuple[list[str], str, str]]:
    """A Config keys table as (full keys, default cell, meaning cell) per row.

    A key cell may list several keys of one section: "`runtime.kv_merge_fraction`, `kv_observe_window`"
    (a key without a dot takes the section of the key before it).
    """
    path, title = table
    text = path.read_text(encoding="utf-8")
    section = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## )", text, re.S | re.M)
    assert section, f"{path.name} has no '## {title}' section"
    rows = []
    for line in section.group(1).splitlines():
        if not line.startswith("|") or line.startswith("|---") or line.startswith("| key "):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == 3, f"Config keys row without 3 cells: {line!r}"
        names, prefix, keys = re.findall(r"`([^`]+)`", cells[0]), "", []
        assert names, f"Config keys row names no `key`: {line!r}"
        for name in names:
            if "." in name:
                prefix = name.rsplit(".", 1)[0] + "."
                keys.append(name)
            else:
                keys.append(prefix + name)
        rows.append((keys, cells[1], cells[2]))
    return rows


def readme_keys() -> set[str]:
    return {k for keys, _, _ in readme_rows() for k in keys}


def test_every_engine_field_is_a_job_key_or_listed_engine_only():
    keys = schema_keys()
    for name in ENGINE_FIELDS:
        if name in ENGINE_ONLY_FIELDS:
            assert f"runtime.{name}" not in keys, f"{name} is listed engine-only but is runtime.{name} in the schema"
            if ENGINE_ONLY_FIELDS[name]:
                assert ENGINE_ONLY_FIELDS[name] in keys
        else:
            assert f"runtime.{name}" in keys, (
                f"EngineOptions.{name} is no runtime.* key of the job schema; expose it or list it engine-only")
    assert ENGINE_ONLY == ENGINE_ONLY_FIELDS  # config.py's list says the same (and why, in its comments)
    assert set(ENGINE_ONLY_FIELDS) <= set(ENGINE_FIELDS), "ENGINE_ONLY_FIELDS names a field EngineOptions lacks"


def test_runtime_keys_are_the_engine_knobs_plus_the_job_only_keys():
    runtime = {k.removeprefix("runtime.") for k in runtime_keys()}
    assert runtime - set(ENGINE_FIELDS) == JOB_ONLY_KEYS == {name for name, _, _ in JOB_ONLY_RUNTIME}
    assert runtime & set(ENGINE_FIELDS) == set(ENGINE_FIELDS) - set(ENGINE_ONLY_FIELDS)


def test_schema_defaults_and_help_come_from_engine_options():
    runtime = {f.name: f for f in dataclasses.fields(JobConfig().runtime)}
    for f in dataclasses.fields(EngineOptions):
        assert f.metadata.get("help"), f"EngineOptions.{f.name} has no help (declare it with knob())"
        if f.name in runtime:
            assert runtime[f.name].default == f.default and runtime[f.name].metadata["help"] == f.metadata["help"]


def test_engine_options_take_every_job_knob():
    overrides = ["runtime.backend=cpu", "model.dtype=float32", "runtime.max_batch_size=3", "runtime.max_input_len=200",
                 "runtime.max_output_len=90", "runtime.cache_policy=segment_sparse", "runtime.segment_size=8",
                 "runtime.long_input=truncate", "runtime.num_threads=2", "runtime.refill=false",
                 "runtime.batch_growth=2", "runtime.kv_merge_fraction=0.5", "runtime.kv_observe_window=16",
                 "runtime.kv_evict_share=0.25", "runtime.prepack_weights=false", "runtime.kv_layout=stripes",
                 "runtime.cuda_graphs=off"]
    job = compose_job(["conf=smoke", *overrides])
    options = job.engine_options()
    for name in ENGINE_FIELDS:
        if name not in ENGINE_ONLY_FIELDS:
            assert getattr(options, name) == getattr(job.runtime, name), name
    assert options.dtype == "float32" and options.sort_by_length is True
    assert job.engine_options(num_threads=5).num_threads == 2  # runtime.num_threads wins over the caller's fallback
    assert compose_job(["conf=smoke"]).engine_options(num_threads=5).num_threads == 5


def test_readme_table_names_every_job_knob_and_no_other_runtime_key():
    documented = readme_keys()
    exposed = runtime_keys() | {job_key(name) for name in ENGINE_FIELDS} - {None}
    missing = sorted(exposed - documented)
    assert not missing, f"README.md Config keys table has no row for {missing}"
    unknown = sorted(k for k in documented if k.startswith("runtime.") and k not in runtime_keys())
    assert not unknown, f"README.md Config keys table names runtime keys the schema lacks: {unknown}"
    assert not sorted(documented - schema_keys()), "README.md Config keys table names keys the schema lacks"


def test_readme_names_every_allowed_value_of_an_enum_knob():
    meaning = {k: m for keys, _, m in readme_rows() for k in keys}
    for f in dataclasses.fields(EngineOptions):
        key = job_key(f.name)
        for choice in f.metadata.get("choices", ()) if key else ():
            assert re.search(rf"\b{re.escape(choice)}\b", meaning[key]), f"README row {key} omits {choice!r}"


@pytest.fixture(scope="module")
def legal_docs() -> JobConfig:
    return compose_job(["conf=legal_docs"])


@pytest.mark.parametrize("table", [EVERY_KEY, COMMON_KEYS], ids=["every", "readme"])
def test_readme_defaults_are_the_legal_docs_values(legal_docs, table):
    checked = set()
    for keys, default_cell, _ in readme_rows(table):
        if not any(k.startswith("runtime.") or k == "model.dtype" for k in keys):
            continue
        values = [v.strip().strip("`") for v in default_cell.split(",")]
        assert len(values) == len(keys), f"README row {keys}: give one default per key, got {default_cell!r}"
        for key, text in zip(keys, values):
            section, name = key.split(".")
            actual = getattr(getattr(legal_docs, section), name)
            assert yaml.safe_load(text) == actual, f"README says {key} = {text!r}; legal_docs composes {actual!r}"
            checked.add(key)
    if table == EVERY_KEY:
        assert checked >= runtime_keys()
