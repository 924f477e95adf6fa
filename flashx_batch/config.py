"""Typed job configuration: the schema behind every `python -m flashx_batch` run.

Who uses it: `cli.py` registers the schema with Hydra (`register_configs`) and converts the composed
DictConfig with `to_job_config`; everything below the CLI (data, runner, report, jobs/) receives a
frozen-in-spirit `JobConfig` dataclass and never sees OmegaConf. Tests and `jobs/` compose presets
with `compose_job` (Hydra's compose API), the same path the CLI takes.

Presets live in the top-level `conf/` directory; `flashx_batch/conf` is a symlink to it so that an
installed wheel (setuptools copies through the link) and a source checkout read the same files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

# re-exported: the schema's public names (callers import them from here)
from flashx_batch.config_schema import (  # noqa: F401
    BUNDLED_PREFIX,
    CONSTRAINT_KEYS,
    ENGINE_ONLY,
    JOB_ONLY_RUNTIME,
    SAMPLING_COLUMN_KEYS,
    DataSection,
    EvalSection,
    ExecutorSection,
    JobConfig,
    ModelSection,
    OutputSection,
    RuntimeSection,
    SamplingSection,
    StorageSection,
)
from flashx_batch.errors import ConfigError
from flashx_batch.runtime.options import bundled_model_dir
from flashx_batch.storage import is_remote, normalize

PRIMARY_CONFIG = "flashx_job"
SCHEMA_NAME = "flashx_job_schema"
DEFAULT_PRESET = "legal_docs"


def resolve_model_dir(path: str) -> Path:
    """`model.path` → a directory (bundled://legal-tiny = the demo model inside the package)."""
    if path.startswith(BUNDLED_PREFIX):
        return bundled_model_dir().parent / path[len(BUNDLED_PREFIX):]
    if is_remote(path):  # weights are memory-mapped from a local file on every node
        raise ConfigError(f"model.path={path}: models are read from a local directory on every node; copy it there "
                          "first (e.g. `aws s3 sync` / `gsutil rsync` into the same path on each node) and pass that "
                          "path.")
    return Path(path).expanduser()


def resolve_data_path(path: str) -> str:
    """`data.path` → a filesystem path or glob, or an object-store URI as given (bundled://x =
    flashx_batch/assets/data/x)."""
    if path.startswith(BUNDLED_PREFIX):
        return str(bundled_model_dir().parent.parent / "data" / path[len(BUNDLED_PREFIX):])
    if is_remote(path):
        return path
    return str(Path(path).expanduser())


def validate(job: JobConfig) -> None:
    """Semantic checks the types cannot express; raises ConfigError naming the key. Also puts the
    object-store URIs of `data.path` and `output.dir` in their one spelling (`storage.normalize`), so
    every reader, writer and lock the job builds from them names each object one way."""
    out = normalize(job.output.dir)
    # a directory: `s3://b/out/` and `s3://b/out` are one output (one lease, one set of manifests)
    job.data.path, job.output.dir = normalize(job.data.path), (out.rstrip("/") if out.count("/") > 2 else out)
    for key, value in _float_settings(job):
        if not math.isfinite(value):  # nan passes every `>=` check by failing none of the `<`s we forgot
            raise ConfigError(f"{key}={value} is not a finite number; give a real value.")
    checks = [
        (job.executor.kind in ("ray", "local"), f"executor.kind={job.executor.kind!r} is not one of ray, local"),
        (job.executor.max_attempts >= 1, f"executor.max_attempts must be >= 1, got {job.executor.max_attempts}"),
        (job.executor.num_actors is None or job.executor.num_actors >= 1,
         f"executor.num_actors must be >= 1 or null, got {job.executor.num_actors}"),
        (job.executor.node_failure_limit >= 1,
         f"executor.node_failure_limit must be >= 1, got {job.executor.node_failure_limit}"),
        (job.executor.cpus_per_actor >= 1, f"executor.cpus_per_actor must be >= 1, got {job.executor.cpus_per_actor}"),
        (job.executor.shard_timeout_s is None or job.executor.shard_timeout_s > 0,
         f"executor.shard_timeout_s must be > 0 or null, got {job.executor.shard_timeout_s}"),
        (job.executor.grace_period_s >= 0,
         f"executor.grace_period_s must be >= 0 (0 = stop at once), got {job.executor.grace_period_s}"),
        (job.executor.progress_interval_s > 0,
         f"executor.progress_interval_s must be > 0, got {job.executor.progress_interval_s}"),
        (job.runtime.shard_size >= 1, f"runtime.shard_size must be >= 1, got {job.runtime.shard_size}"),
        (job.data.format in ("auto", "parquet", "jsonl", "csv", "arrow", "openai_batch"),
         f"data.format={job.data.format!r} is not one of auto, parquet, jsonl, csv, arrow, openai_batch"),
        (job.output.format in ("parquet", "openai_batch"),
         f"output.format={job.output.format!r} is not one of parquet, openai_batch"),
        (job.output.format != "openai_batch" or job.task in ("generate", "embed"),
         f"output.format=openai_batch writes completions or embeddings: it needs task=generate or task=embed, not "
         f"{job.task}"),
        # an OpenAI response carries the choices its request asked for: one (lines asking n > 1 are refused)
        ("openai_batch" not in (job.data.format, job.output.format) or job.sampling.n == 1,
         f"sampling.n={job.sampling.n} with OpenAI Batch files would give every response {job.sampling.n} choices "
         "where each request asked for one; keep sampling.n=1 (a request's own n is read from its line: "
         "lines asking for n > 1 are bad_request rows, send one line per sample with its own seed)"),
        (job.data.limit is None or job.data.limit >= 1, f"data.limit must be >= 1 or null, got {job.data.limit}"),
        (job.data.max_row_bytes >= 1, f"data.max_row_bytes must be >= 1, got {job.data.max_row_bytes}"),
        (all(e >= 1 for e in job.runtime.bucket_edges), "runtime.bucket_edges must be positive token counts"),
        (bool(job.output.dir), "output.dir must be set"),
        (job.storage.lease_ttl_s >= 5, f"storage.lease_ttl_s must be >= 5 s, got {job.storage.lease_ttl_s}"),
        (job.sampling.max_new_tokens <= job.runtime.max_output_len,
         f"sampling.max_new_tokens={job.sampling.max_new_tokens} exceeds runtime.max_output_len="
         f"{job.runtime.max_output_len}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message + ".")
    _validate_chat_settings(job.data)
    _validate_adapters(job)
    _validate_task(job)
    validate_eval(job)
    job.engine_options()  # EngineOptions checks the runtime.* values
    from flashx_batch.runtime.sampling import SamplingParams  # deferred: keeps torch off the schema import

    s = job.sampling
    SamplingParams(max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                   seed=s.seed, stop=tuple(s.stop), ignore_eos=s.ignore_eos, logprobs=s.logprobs,
                   n=1 if "temperature" in s.from_columns else s.n,  # per-row temperatures: checked per row
                   json_fit_budget=s.json_fit_budget,
                   **{key: getattr(s, key) for key in CONSTRAINT_KEYS})  # compiled against the model: plan_job
    if s.n < 1:
        raise ConfigError(f"sampling.n must be >= 1, got {s.n}.")
    _validate_from_columns(s)




def _validate_from_columns(sampling: SamplingSection) -> None:
    """The shape of sampling.from_columns: known keys, each naming a column (its values are checked per row)."""
    for key, column in sampling.from_columns.items():
        if key not in SAMPLING_COLUMN_KEYS:
            raise ConfigError(f"sampling.from_columns.{key}: not a per-row sampling key; one of "
                              f"{', '.join(SAMPLING_COLUMN_KEYS)}.")
        if not column:
            raise ConfigError(f"sampling.from_columns.{key} must name an input column.")


def adapter_dirs(job: JobConfig) -> dict[str, Path]:
    """model.lora_adapters: name -> the adapter's directory (local on every node, as model.path is)."""
    out = {}
    for name, path in job.model.lora_adapters.items():
        if is_remote(str(path)):
            raise ConfigError(f"model.lora_adapters.{name}={path}: adapters are read from a local directory on every "
                              "node, as model.path is; copy it there first and pass that path.")
        out[name] = resolve_model_dir(str(path))
    return out


def _validate_adapters(job: JobConfig) -> None:
    """model.lora_adapters and data.adapter_column come together, on task=generate (the adapters' files are
    checked against the model at the job's preflight: runner/job.py)."""
    data, adapters = job.data, job.model.lora_adapters
    if data.adapter_column and not adapters:
        raise ConfigError(f"data.adapter_column={data.adapter_column} is set but model.lora_adapters is empty; name "
                          "the adapters rows may pick: model.lora_adapters={name: PEFT adapter directory}.")
    if adapters and not data.adapter_column:
        raise ConfigError("model.lora_adapters is set but data.adapter_column is not; rows pick their adapter by name "
                          "from that column (null: the base model).")
    if not adapters:
        return
    if job.task != "generate":
        raise ConfigError(f"model.lora_adapters applies to task=generate, not task={job.task}.")
    if data.adapter_column in (data.id_column, data.prompt_column, data.messages_column):
        raise ConfigError(f"data.adapter_column={data.adapter_column} is also the id or prompt column; name the "
                          "column that holds each row's adapter name.")
    bad = [name for name in adapters if not name or not isinstance(name, str)]
    if bad:
        raise ConfigError(f"model.lora_adapters: adapter names must be non-empty strings, got {bad}.")
    adapter_dirs(job)
    if data.adapter_column not in data.passthrough_columns:  # each output row says which adapter answered it
        data.passthrough_columns = [*data.passthrough_columns, data.adapter_column]


def _validate_chat_settings(data: DataSection) -> None:
    """data.tools_column / tools / chat_template_kwargs: chat settings, so they need data.messages_column."""
    from flashx_batch.runtime.chat_template import RESERVED_NAMES

    chat_keys = [k for k in ("tools_column", "tools", "chat_template_kwargs") if getattr(data, k)]
    if chat_keys and not data.messages_column:
        raise ConfigError(f"data.{chat_keys[0]} is set but data.messages_column is not; tools and template "
                          "arguments apply to chat rows only.")
    if data.tools_column and data.tools:
        raise ConfigError("data.tools_column and data.tools are both set; give tools per row (tools_column) or "
                          "one list for the job (tools), not both.")
    if data.tools_column and data.tools_column in (data.id_column, data.messages_column):
        raise ConfigError(f"data.tools_column={data.tools_column} is also the id or messages column; name the "
                          "column that holds the tool specs.")
    reserved = sorted(set(data.chat_template_kwargs) & set(RESERVED_NAMES))
    if reserved:
        raise ConfigError(f"data.chat_template_kwargs sets {reserved[0]!r}, which the job sets itself (from the "
                          "row and data.tools); remove it.")
    # data.tools' contents are checked with the row checks, at the job's preflight (runner/job.py).


def _validate_task(job: JobConfig) -> None:
    """`task` names a task (`flashx_batch.tasks`), and the task's own checks of the data.* keys pass."""
    from flashx_batch.tasks import get_task

    get_task(job.task).validate(job)


def validate_eval(job: JobConfig) -> None:
    """`eval.*`: a metric that fits the task, the columns and pattern it needs."""
    from flashx_batch.evaluation.metrics import check_metric

    e = job.eval
    if e.metric is None:
        if e.reference_column or e.regex:
            raise ConfigError("eval.reference_column / eval.regex are set but eval.metric is not; set eval.metric "
                              "(exact_match, contains, regex or choice_accuracy).")
        return
    try:
        check_metric(e.metric, e.regex)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if e.resamples < 100:
        raise ConfigError(f"eval.resamples={e.resamples}: use at least 100 bootstrap resamples for the interval.")
    if e.metric == "choice_accuracy":
        if job.task != "multiple_choice" or not job.data.answer_column:
            raise ConfigError("eval.metric=choice_accuracy scores task=multiple_choice rows against "
                              "data.answer_column; set both (or pick exact_match / contains / regex for generate).")
        if e.reference_column:
            raise ConfigError("eval.reference_column is for task=generate; multiple choice reads data.answer_column.")
        return
    if job.task != "generate":
        raise ConfigError(f"eval.metric={e.metric} scores generated text; task={job.task} generates none "
                          "(multiple_choice: eval.metric=choice_accuracy).")
    if not e.reference_column:
        raise ConfigError(f"eval.metric={e.metric} needs eval.reference_column, the input column with each row's "
                          "reference answer.")
    if e.reference_column in (job.data.id_column, job.data.prompt_column, job.data.messages_column):
        raise ConfigError(f"eval.reference_column={e.reference_column!r} is the id or prompt column; name the "
                          "column that holds the reference answers.")


def _float_settings(job: JobConfig) -> list[tuple[str, float]]:
    """(dotted key, value) of every float-valued setting, so non-finite values are refused by key."""
    out = []
    for section in dataclasses.fields(job):
        value = getattr(job, section.name)
        if dataclasses.is_dataclass(value):
            for f in dataclasses.fields(value):
                v = getattr(value, f.name)
                if isinstance(v, float):
                    out.append((f"{section.name}.{f.name}", v))
                elif isinstance(v, dict):
                    out += [(f"{section.name}.{f.name}.{k}", x) for k, x in v.items() if isinstance(x, float)]
    return out


def to_job_config(cfg: DictConfig | dict[str, Any]) -> JobConfig:
    """Convert a composed config (or a plain dict) to `JobConfig`.

    Unknown keys and values of the wrong type raise ConfigError naming the full key; the caller
    (the CLI) maps that to exit code 2. The `hydra` node, if present, is ignored.
    """
    data = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    data.pop("hydra", None)
    data.pop("conf", None)  # the preset group's name, when a caller composed without `_global_` packaging
    try:
        merged = OmegaConf.merge(OmegaConf.structured(JobConfig), data)
        job = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        first = str(exc).splitlines()[0]
        unknown = unknown_key_message(key) if key != "?" else None
        raise ConfigError(f"bad config key {key!r}: {first}" + (f" ({unknown})" if unknown else "")) from None
    assert isinstance(job, JobConfig)
    if job.data.path == "???":
        raise ConfigError("data.path is not set; pass data.path=... or pick a preset with conf=NAME.")
    validate(job)
    return job


@functools.cache
def schema_keys() -> tuple[frozenset[str], frozenset[str]]:
    """(every dotted key of the schema, the dict-valued ones: any key below those is the user's own)."""
    keys, open_ = set(), set()

    def walk(cls: Any, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            key = prefix + f.name
            keys.add(key)
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if dataclasses.is_dataclass(default):
                walk(type(default), key + ".")
            elif isinstance(default, dict):
                open_.add(key)

    walk(JobConfig, "")
    return frozenset(keys), frozenset(open_)


def unknown_key_message(key: str) -> str | None:
    """Why a dotted override key is not a setting, with the closest settings, or None when it is one."""
    import difflib

    keys, open_ = schema_keys()
    if key in keys or any(key.startswith(k + ".") for k in open_):
        return None
    close = difflib.get_close_matches(key, sorted(keys), n=3, cutoff=0.75)
    if not close:  # a misspelled last part: compare with the keys of the same section
        section, _, last = key.rpartition(".")
        siblings = sorted(k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == section)
        close = [f"{section}.{m}" if section else m for m in difflib.get_close_matches(last, siblings, n=3)]
    hint = f"; did you mean {' or '.join(close)}?" if close else \
        "; `python -m flashx_batch --cfg job` lists every setting."
    return f"{key} is not a setting{hint}"


def quote_overrides(args: list[str]) -> list[str]:
    """Command-line overrides as Hydra's grammar takes them: a `key=value` whose value Hydra cannot parse
    as typed (a path or URI with `=` in it, as Hive-style partitions have: `data.path=s3://lake/day=1/`)
    is passed quoted, as the user meant it. Anything else is left as typed (sweeps `a,b` included)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser, out = OverridesParser.create(), []
    for arg in args:
        key, eq, value = arg.partition("=")
        if not eq or arg.startswith("-") or not value or value[0] in "'\"":
            out.append(arg)
            continue
        try:
            parser.parse_overrides([arg])
        except Exception:
            quote = "'" if "'" not in value else '"'
            if quote not in value:
                candidate = f"{key}={quote}{value}{quote}"
                with contextlib.suppress(Exception):
                    parser.parse_overrides([candidate])
                    arg = candidate
        out.append(arg)
    return out


def check_override_keys(args: list[str]) -> None:
    """Every `key=value` override names a setting (ConfigError with "did you mean" otherwise). Hydra's own
    keys (`hydra.*`), the preset group (`conf=`), and `+` / `~` forms are left to Hydra."""
    for arg in args:
        key, eq, _ = arg.partition("=")
        if not eq or arg.startswith(("-", "+", "~")) or key == "conf" or key.startswith("hydra") or "/" in key \
                or "@" in key:  # Hydra's own settings and config groups (`hydra/job_logging=...`)
            continue
        why = unknown_key_message(key)
        if why:
            raise ConfigError(why)


def register_configs() -> None:
    """Register the schema and the primary config with Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name=SCHEMA_NAME, node=JobConfig)
    # The primary config: schema first, then the chosen preset (`conf=NAME`, `@package _global_`)
    # overrides it. Hydra settings keep Hydra out of the user's output directory: no chdir, no
    # `.hydra/` copy, log to stderr only — so `dry_run` writes nothing and `output.dir` holds only
    # our layout. A multirun puts each run in `<output.dir>/<swept key=value,...>` (see cli.py).
    cs.store(name=PRIMARY_CONFIG, node={
        "defaults": [SCHEMA_NAME, "_self_", {"conf": DEFAULT_PRESET},
                     {"override hydra/job_logging": "none"}, {"override hydra/hydra_logging": "default"}],
        "hydra": {
            "run": {"dir": "."},
            "sweep": {"dir": "${output.dir}", "subdir": "${fx_sweep_subdir:}"},  # resolver: cli.py
            "output_subdir": None,
            "job": {"chdir": False},
        },
    })


def config_dir() -> Path:
    """The directory whose `conf/` subdirectory holds the presets (the package dir; see module doc)."""
    return Path(__file__).resolve().parent


def compose_job(overrides: list[str] | None = None) -> JobConfig:
    """Compose a preset with Hydra's compose API and convert it (tests, jobs/; no Hydra app state left)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    register_configs()
    overrides = quote_overrides(list(overrides or []))
    check_override_keys(overrides)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            cfg = compose(config_name=PRIMARY_CONFIG, overrides=list(overrides or []))
    except (HydraException, OmegaConfBaseException) as exc:
        cause = exc.__cause__ or exc
        raise ConfigError(f"{str(exc).splitlines()[0]} ({str(cause).splitlines()[0]})") from None
    finally:
        GlobalHydra.instance().clear()
    return to_job_config(cfg)


def preset_names() -> list[str]:
    """Every preset file under conf/ (tests compose each one)."""
    return sorted(p.stem for p in (config_dir() / "conf").glob("*.yaml"))
