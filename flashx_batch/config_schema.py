"""The job configuration's schema: one dataclass per section (`model`, `data`, `sampling`, `runtime`,
`executor`, `eval`, `output`, `storage`) and `JobConfig` over them. `flashx_batch.config` validates,
composes and re-exports them; nothing here reads Hydra or a file.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, get_type_hints

from flashx_batch.runtime.constraints import KINDS as CONSTRAINT_KINDS
from flashx_batch.runtime.options import EngineOptions
from flashx_batch.runtime.params import SamplingParams
from flashx_batch.storage import StorageSettings

BUNDLED_PREFIX = "bundled://"


@dataclass
class ModelSection:
    path: str = BUNDLED_PREFIX + "legal-tiny"  # a local HF directory, or bundled://<name>
    dtype: str = "auto"  # EngineOptions.dtype (see ENGINE_ONLY): auto | float32 | bfloat16 | float16
    # LoRA adapters (PEFT directories, local on every node) that rows name in data.adapter_column: {name: dir}
    lora_adapters: dict[str, str] = field(default_factory=dict)


@dataclass
class DataSection:
    path: str = "???"  # file, directory, glob, `datasets` save_to_disk folder, or bundled://<file>
    # auto | parquet | jsonl | csv | arrow (auto = from the suffix) | openai_batch (OpenAI Batch request lines:
    # data/openai_batch.py sets the id, text and per-row sampling keys from them)
    format: str = "auto"
    id_column: str = "id"
    prompt_column: str = "prompt"
    messages_column: str | None = None  # chat rows; the model's chat template renders them
    tools_column: str | None = None  # per-row tool specs (a list of JSON-schema functions, or its JSON text)
    tools: list[Any] = field(default_factory=list)  # one tool list for every row (instead of tools_column)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # extra template variables
    passthrough_columns: list[str] = field(default_factory=list)  # copied to the output; a file without one: exit 2
    adapter_column: str | None = None  # task=generate: per row, a name from model.lora_adapters (null: the base model)
    # copied when every input file has them, skipped (one log line) when not: what presets name, so a preset
    # runs on any file with an id and a prompt (or messages) column
    passthrough_if_present: list[str] = field(default_factory=list)
    prompt_prefix: str = ""  # prepended to every prompt (a shared few-shot prefix)
    limit: int | None = None  # first N rows in input order (files sorted by path)
    max_row_bytes: int = 1_000_000  # larger prompts become `row_too_large` error rows untokenized
    # scoring tasks (task: loglikelihood | multiple_choice; perplexity reads prompt_column)
    context_column: str = "context"
    continuation_column: str = "continuation"  # task: loglikelihood
    choices_column: str = "choices"  # task: multiple_choice: a list of strings (or its JSON text)
    answer_column: str | None = "answer"  # task: multiple_choice: the right choice's index; null = no answers
    target_delimiter: str = " "  # task: multiple_choice: put between the context and each choice (lm-eval's)
    query_column: str = "query"  # task: score: the first text of each scored pair (a query, a prompt)
    document_column: str = "document"  # task: score: the second (a passage to rank, an answer to reward)


# `sampling.*` = SamplingParams' fields (declared once, in runtime/params.py) except SAMPLING_ENGINE_ONLY, tuples
# as lists (what a config file holds), plus the job-only `from_columns`.
SAMPLING_ENGINE_ONLY = {"stop_token_ids"}  # token ids are the engine's: a job stops on strings
# constraint fields whose Python type a config file cannot declare: a JSON schema is a mapping or its JSON
# text (Any); a choice list is a list of strings (SamplingParams checks both)
SAMPLING_FREE_FORM = {"json_schema": Any, "choice": list[str] | None}


def _sampling_fields() -> list[tuple[str, Any, Any]]:
    hints = get_type_hints(SamplingParams)
    out: list[tuple[str, Any, Any]] = []
    for f in dataclasses.fields(SamplingParams):
        if f.name in SAMPLING_ENGINE_ONLY:
            continue
        kind = hints[f.name]
        if f.name in SAMPLING_FREE_FORM:
            out.append((f.name, SAMPLING_FREE_FORM[f.name], field(default=None)))
        elif typing.get_origin(kind) is tuple:  # stop: a list in a config file
            out.append((f.name, list[typing.get_args(kind)[0]], field(default_factory=list)))
        else:
            out.append((f.name, kind, field(default=f.default)))
    # per-row values: sampling key -> input column (a null cell keeps the job-wide value); data/row_sampling.py
    return out + [("from_columns", dict[str, str], field(default_factory=dict))]


SamplingSection = dataclasses.make_dataclass(
    "SamplingSection", _sampling_fields(),
    namespace={"__module__": __name__, "__doc__": "The sampling.* group of a job: SamplingParams' fields (n: samples "
               "per row, each an output row with its sample_index; seed: the job seed, each row's derived from it "
               "and the row id; logprobs K: per generated token its logprob and the top-K alternatives) + "
               "from_columns."})


# sampling keys a column may set per row (sampling.from_columns), and the kind of value each takes; n and
# logprobs stay job-wide: they shape the output (rows per id, columns)
SAMPLING_COLUMN_KEYS = {"max_new_tokens": "int", "temperature": "float", "top_k": "int", "top_p": "float",
                        "seed": "seed", "stop": "stop", "ignore_eos": "bool",
                        # a row's constraint (runtime/constraints.py): a schema as JSON text or a struct cell
                        # (its null fields dropped), a choice list as a list or its JSON text; a bad one is a
                        # bad_constraint row
                        "json_schema": "json_schema", "regex": "text", "choice": "choice", "grammar": "text"}
CONSTRAINT_KEYS = CONSTRAINT_KINDS  # the SamplingParams fields that hold a constraint


# `runtime.*` = every EngineOptions knob (declared once, with its meaning, in runtime/options.py) except
# ENGINE_ONLY, plus the job-only keys in JOB_ONLY_RUNTIME. The schema defaults are EngineOptions' defaults;
# the presets in conf/ set the job values (legal_docs: max_output_len 64, shard_size 16).
ENGINE_ONLY = {  # knob -> the job key that sets it instead (None: no job key; engine_options pins it)
    # The job calls it model.dtype: how the model's weights are loaded, next to model.path.
    "dtype": "model.dtype",
    # Not a job key, as before: a job always sorts a shard's rows by length (True); the plan has already
    # bucketed rows by length into shards, and there is no job-level reason to turn it off.
    "sort_by_length": None,
    # A research switch of the Python API (the fused int8 decode step's A / B): a job always fuses where it can.
    "fused_int8_decode": None,
}

JOB_ONLY_RUNTIME: list[tuple[str, Any, Any]] = [
    ("shard_size", int, field(default=64, metadata={"help": "rows per shard (the unit of commit and retry)"})),
    ("bucket_edges", list[int], field(default_factory=list, metadata={
        "help": "token-length bucket upper bounds; [] = powers of 2 up to max_input_len"})),
]


def _runtime_fields() -> list[tuple[str, Any, Any]]:
    """RuntimeSection's fields: the job-visible EngineOptions knobs (same name, type, default, help), then JOB_ONLY."""
    hints = get_type_hints(EngineOptions)  # evaluated annotations (int, str, bool, float, X | None): OmegaConf's types
    engine = [(f.name, hints[f.name], field(default=f.default, default_factory=f.default_factory, metadata=f.metadata))
              for f in dataclasses.fields(EngineOptions) if f.name not in ENGINE_ONLY]
    return engine + JOB_ONLY_RUNTIME


RuntimeSection = dataclasses.make_dataclass(
    "RuntimeSection", _runtime_fields(),
    namespace={"__module__": __name__, "__doc__": "The runtime.* group of a job: EngineOptions knobs + job-only keys."})


@dataclass
class ExecutorSection:
    kind: str = "ray"  # ray | local
    address: str | None = None  # None = start a local Ray; "auto" = join a running cluster
    num_actors: int | None = None  # None = one per accelerator (cpu: cores // cpus_per_actor)
    cpus_per_actor: int = 1
    resources: dict[str, float] = field(default_factory=dict)  # extra custom resources per actor
    max_attempts: int = 3  # tries per shard before the job fails (resumable) or its rows become error rows
    node_failure_limit: int = 3  # ray: a node where N different shards failed in a row is excluded (never the last)
    shard_timeout_s: float | None = 3600.0  # watchdog (ray): a shard running longer has its actor killed
    grace_period_s: float = 60.0  # after SIGINT/SIGTERM, how long in-flight shards may take to commit
    progress_interval_s: float = 30.0  # off a TTY: a progress line this often, or each 5 % of the rows
    # Ray runtime environment for every actor (pip / conda / env_vars / working_dir ...), passed as given;
    # {} = the nodes' own environment (docs/cluster.md, "What every node needs")
    runtime_env: dict[str, Any] = field(default_factory=dict)
    faults: list[str] = field(default_factory=list)  # fault injection for tests (runner/faults.py); [] = off


@dataclass
class EvalSection:
    """Scoring against references (flashx_batch/evaluation/metrics.py): a per-row `score` column and the
    job's mean with a bootstrap 95 % interval in job.json, _SUCCESS and report.md."""

    metric: str | None = None  # exact_match | contains | regex (task=generate) | choice_accuracy (multiple_choice)
    reference_column: str | None = None  # task=generate: the input column holding each row's reference answer
    regex: str | None = None  # metric=regex: its first group (or the whole match) is the answer
    resamples: int = 1000  # bootstrap resamples for the interval


@dataclass
class EmbedSection:
    """task=embed (flashx_batch/runtime/pooling.py): how a prompt's final hidden states become its vector."""

    pooling: str | None = None  # last | mean | cls; null: the checkpoint's own (sentence-transformers), else last
    normalize: bool | None = None  # unit length; null: the checkpoint's own, else true
    dimensions: int | None = None  # Matryoshka: keep the first D components (before normalising); null: all


@dataclass
class ScoreSection:
    """task=score (flashx_batch/runtime/pooling.py `pair_text`): how a (query, document) pair becomes the text
    a cross-encoder reads."""

    format: str = "separator"  # separator (query, separator, document) | chat (the model's chat template)
    separator: str = "\n"


@dataclass
class OutputSection:
    dir: str = "outputs/job"
    report: bool = True
    # parquet | openai_batch: also <dir>/openai_batch_output.jsonl, every row as an OpenAI Batch output line
    format: str = "parquet"


@dataclass
class StorageSection:
    """Object-store access (flashx_batch/storage.py): unset keys fall back to the environment
    (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_ENDPOINT_URL`, ...) and config files."""

    endpoint_url: str | None = None  # an S3-compatible store: http(s)://host:port (MinIO, OSS, Ceph)
    region: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = None  # recorded as *** in job.json, never logged
    session_token: str | None = None
    anonymous: bool = False
    conditional_put: bool = True  # If-None-Match manifests where the store honours them
    lease_ttl_s: float = 60.0  # the object-store run lock's lease

    def settings(self) -> StorageSettings:
        return StorageSettings(**dataclasses.asdict(self))


@dataclass
class JobConfig:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    sampling: SamplingSection = field(default_factory=SamplingSection)
    runtime: RuntimeSection = field(default_factory=RuntimeSection)
    executor: ExecutorSection = field(default_factory=ExecutorSection)
    output: OutputSection = field(default_factory=OutputSection)
    storage: StorageSection = field(default_factory=StorageSection)
    eval: EvalSection = field(default_factory=EvalSection)
    embed: EmbedSection = field(default_factory=EmbedSection)
    score: ScoreSection = field(default_factory=ScoreSection)
    # generate | loglikelihood | multiple_choice | perplexity | embed | classify | score
    task: str = "generate"
    dry_run: bool = False
    log_level: str = "INFO"

    def extra_columns(self) -> dict[str, str]:
        """Input columns read besides the task's own (per-row sampling columns, the eval references), each
        with the setting that names it (for a missing column's message)."""
        roles = {column: f"sampling.from_columns.{key}" for key, column in self.sampling.from_columns.items()}
        if self.eval.metric and self.eval.reference_column:
            roles.setdefault(self.eval.reference_column, "eval.reference_column")
        if self.data.adapter_column:
            roles.setdefault(self.data.adapter_column, "data.adapter_column")
        if self.data.format == "openai_batch":  # an OpenAI Batch line's own checks (data/openai_batch.py)
            roles.update({c: "data.format=openai_batch" for c in ("url", "request_error", "logprobs")})
            if self.task == "embed":
                roles["dimensions"] = "data.format=openai_batch"
        return roles

    def engine_options(self, num_threads: int | None = None) -> EngineOptions:
        """The runtime.* knobs as the engine takes them (raises ConfigError on bad values).

        `num_threads` is the caller's fallback (the actor's CPUs) when runtime.num_threads is null.
        """
        values = {f.name: getattr(self.runtime, f.name) for f in dataclasses.fields(EngineOptions)
                  if f.name not in ENGINE_ONLY}
        values["num_threads"] = self.runtime.num_threads or num_threads
        return EngineOptions(**values, dtype=self.model.dtype, sort_by_length=True)  # the ENGINE_ONLY knobs
