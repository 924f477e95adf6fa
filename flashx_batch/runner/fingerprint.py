"""The job fingerprint: everything that changes a job's results, recorded in job.json.

Who calls it: `runner.job.run`, before touching an existing output directory. Same fingerprint →
resume (skip committed shards); any difference → exit 2 naming the differing fields, because
mixing results of two configurations in one output would be silently wrong.
Throughput-only knobs (max_batch_size, executor.*, num_threads) are left out on purpose: a
resumed run may use a bigger machine. Lossless runtime paths give identical tokens for any batch.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict
from pathlib import Path
from typing import Any

import flashx_batch
from flashx_batch.config import JobConfig, resolve_model_dir
from flashx_batch.data.plan import Plan, bucket_edges
from flashx_batch.job_errors import ModelChangedError
from flashx_batch.models.quantized import checkpoint_scheme
from flashx_batch.runtime.constraints import canonical_schema

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def file_hashes(model_dir: Path, names: list[str], cache: dict[str, Any] | None) -> dict[str, list]:
    """name -> [size, mtime_ns, sha256]; a cached entry with the same size and mtime is reused.

    Hashing multi-GB weights on every resume would cost minutes; the cache lives in job.json.
    """
    out = {}
    for name in names:
        path = model_dir / name
        st = path.stat()
        hit = (cache or {}).get(name)
        if hit and hit[0] == st.st_size and hit[1] == st.st_mtime_ns:
            out[name] = hit
            continue
        with open(path, "rb") as fh:
            out[name] = [st.st_size, st.st_mtime_ns, hashlib.file_digest(fh, "sha256").hexdigest()]
    return out


def check_model_unchanged(model_dir: Path, stats: dict[str, list]) -> None:
    """The model files still have the size and mtime they were fingerprinted with (workers, before and
    after loading the weights; the driver, before `_SUCCESS`): a checkpoint replaced mid-job would
    otherwise mix two models' outputs under one fingerprint. ModelChangedError names the file."""
    for name, (size, mtime_ns, _) in stats.items():
        path = Path(model_dir) / name
        try:
            st = path.stat()
        except FileNotFoundError:
            raise ModelChangedError(f"{path} was removed while the job ran; restore it, or run the job into a new "
                                    "output.dir.") from None
        if (st.st_size, st.st_mtime_ns) != (size, mtime_ns):
            raise ModelChangedError(f"{path} changed while the job ran (size {size} -> {st.st_size} bytes, mtime "
                                    "changed); the rows committed so far came from the model as planned. Leave the "
                                    "model directory unchanged while a job runs; for the new model, use a new "
                                    "output.dir.")


def model_file_stats(model_dir: Path, cache: dict[str, Any] | None) -> dict[str, list]:
    names = sorted(p.name for p in model_dir.iterdir() if p.is_file() and not p.name.startswith(".")
                   and p.suffix in (".json", ".safetensors", ".bin", ".jinja", ".model", ".txt"))
    return file_hashes(model_dir, names, cache)


# The version of the per-row checks and ids the plan applies (which rows are error rows, what a line without
# an id is called): a plan of the same input under other checks may hold other ids, so a job planned under
# other rules never resumes (a finished one stays finished: `runner.job`). Raise it with any such change.
ROW_RULES = 3  # 3: OpenAI Batch lines with response_format are rows (they were bad_request)
ROW_RULES_KEY = "plan.row_rules"
# keys compared only when both records hold them: jobs written before they existed, and a finished job
# rerun without a cluster to resolve `auto` on, still resume
RESOLVED_KEYS = ("runtime.resolved",)


def compute(job: JobConfig, plan: Plan, model_stats: dict[str, list], resolved_as: str | None = None,
            answer_format: str | None = None, adapter_digests: dict[str, str] | None = None) -> dict[str, Any]:
    """The fingerprint as a flat dict of dotted keys (so a diff names fields directly). `resolved_as`:
    `backend/dtype` as the job's engines run, `auto` resolved (`backends.resolved_run`, on this host or
    on a Ray worker by the cluster probe), where known. A job started where `auto` meant the CPU
    (float32) and resumed where it means a GPU (bfloat16) would mix two precisions in one output: the
    fingerprint holds what they resolved to, so such a resume is refused (exit 2), and every worker
    checks its engine against it (`runner.worker`)."""
    weights = {n: v[2] for n, v in model_stats.items() if n not in TOKENIZER_FILES}
    tokenizer = {n: v[2] for n, v in model_stats.items() if n in TOKENIZER_FILES}
    r, d = job.runtime, job.data
    sparse = r.cache_policy == "segment_sparse"
    engine = job.engine_options() if sparse else None  # the resolved dials (a preset, or values spelled out)
    fp: dict[str, Any] = {
        "code_version": flashx_batch.__version__,
        ROW_RULES_KEY: ROW_RULES,
        "model.files": _digest(weights),
        "model.tokenizer": _digest(tokenizer),
        "model.dtype": job.model.dtype,
        "runtime.backend": r.backend,
        "runtime.max_input_len": r.max_input_len,
        "runtime.long_input": r.long_input,
        "runtime.cache_policy": r.cache_policy,
        "runtime.segment_size": r.segment_size,
        # the resolved dials, not the preset's name: a preset and the same values spelled out resume each other
        "runtime.kv_merge_fraction": engine.merge_fraction if engine else None,
        "runtime.kv_observe_window": r.kv_observe_window if sparse else None,
        "runtime.prefix_reuse": bool(r.prefix_cache_tokens),  # regroups rows into shards: new shard ids
        "runtime.precision_map": _file_digest(r.precision_map) if r.precision_map else None,
        "runtime.shard_size": r.shard_size,
        "runtime.bucket_edges": bucket_edges(job),
        "input.files": _digest([f.manifest() for f in plan.files]),
        "input.num_files": len(plan.files),
    }
    if engine:  # only here: static jobs written before this key existed still resume
        fp["runtime.kv_evict_share"] = engine.evict_share
    if resolved_as is not None:
        fp["runtime.resolved"] = resolved_as
    if answer_format is not None:  # chat answers split (reasoning, tool calls): pieces written before never mix in
        fp["output.answer_format"] = answer_format
    # logprobs / n / from_columns / constraints only when set: jobs written before these keys existed still resume
    optional = {"logprobs": (None, 0), "n": (1,), "from_columns": ({},), "json_schema": (None,), "regex": (None,),
                "choice": (None,), "grammar": (None,), "json_fit_budget": (True,)}
    fp.update({f"sampling.{k}": v for k, v in asdict(job.sampling).items() if v not in optional.get(k, ())})
    if job.sampling.json_schema is not None:  # as text: the order of its keys is the order answers are written in
        fp["sampling.json_schema"] = canonical_schema(job.sampling.json_schema)
    if d.format == "openai_batch":  # the column a request's response_format is read into: not the user's setting
        fp["sampling.from_columns"] = {k: v for k, v in job.sampling.from_columns.items() if k != "json_schema"}
    for k in ("id_column", "prompt_column", "messages_column", "passthrough_columns", "prompt_prefix", "limit",
              "max_row_bytes"):
        fp[f"data.{k}"] = getattr(d, k)
    scheme = checkpoint_scheme(resolve_model_dir(job.model.path))
    if scheme is not None:  # a pre-quantized checkpoint's scheme (only when set: float jobs still resume)
        # format, scheme, group size; and whether its weights are kept (W8A8: int8 activations) or dequantized
        fp["model.quantization"] = {**scheme.record(), "weights": r.quantized_weights}
    if adapter_digests:  # LoRA adapters by content (a retrained adapter under the same name is another job)
        fp["model.lora_adapters"] = dict(sorted(adapter_digests.items()))
    for k in ("tools_column", "tools", "chat_template_kwargs", "adapter_column"):  # only when set: older jobs resume
        if getattr(d, k):
            fp[f"data.{k}"] = getattr(d, k)
    if job.task != "generate":  # only for the scoring tasks: generate jobs written before `task` still resume
        fp["task"] = job.task
        for k in ("context_column", "continuation_column", "choices_column", "answer_column", "target_delimiter"):
            fp[f"data.{k}"] = getattr(d, k)
    if job.task == "embed":
        fp.update({f"embed.{k}": v for k, v in asdict(job.embed).items()})
    if job.task == "score":
        fp.update({f"score.{k}": v for k, v in asdict(job.score).items()})
        fp.update({f"data.{k}": getattr(d, k) for k in ("query_column", "document_column")})
    if job.eval.metric:  # the score column depends on them; only when set, so older jobs still resume
        for k in ("metric", "reference_column", "regex"):
            fp[f"eval.{k}"] = getattr(job.eval, k)
    return fp


def diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Fields that differ, each as `key: old -> new` (digests shortened)."""
    out = []
    for key in sorted(set(old) | set(new)):
        if key in RESOLVED_KEYS and (key not in old or key not in new):
            continue
        a, b = old.get(key, "<absent>"), new.get(key, "<absent>")
        if a != b:
            why = (" (this version checks rows as the job's did not: finish it with the version that started it, "
                   "or run it into a new output.dir)") if key == ROW_RULES_KEY else ""
            out.append(f"{key}: {_short(a)} -> {_short(b)}{why}")
    return out


def digest(fp: dict[str, Any]) -> str:
    """A short digest of a whole fingerprint (its `RESOLVED_KEYS` aside: a rerun that could not resolve them
    is the same job): stamped on each manifest, so pieces of another job are told apart."""
    return _digest(sorted((kv for kv in fp.items() if kv[0] not in RESOLVED_KEYS), key=lambda kv: kv[0]))


def _digest(value: Any) -> str:
    return hashlib.sha256(repr(value).encode()).hexdigest()[:16]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _file_digest(path: str) -> str:
    """sha256 of a small file (a precision map): a different map is a different job."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def input_changes(previous: dict[str, Any], plan: Plan) -> list[str]:
    """What changed in the input files since the job in job.json was planned, one line per file, so a
    refused resume names the file and the change (job.json records each file's manifest)."""
    before = {f["name"]: f for f in previous.get("input_files", [])}
    if not before:
        return []
    now = {f.manifest()["name"]: f.manifest() for f in plan.files}
    out = [f"input file {name}: removed since the job was planned" for name in sorted(set(before) - set(now))]
    out += [f"input file {name}: new since the job was planned" for name in sorted(set(now) - set(before))]
    for name in sorted(set(now) & set(before)):
        a, b = before[name], now[name]
        if a != b:
            out.append(f"input file {name}: changed (size {a.get('size')} -> {b['size']} bytes, sha256 "
                       f"{str(a.get('sha256'))[:12]} -> {b['sha256'][:12]})")
    return out
