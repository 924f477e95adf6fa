"""OpenAI Batch input (`data.format=openai_batch`): the JSONL that OpenAI's and other hosted batch APIs and
vLLM's `run-batch` take, one request per line:

    {"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "m", "messages": [{"role": "user", "content": "..."}], "max_tokens": 64, "temperature": 0.7}}

Each line becomes a row (`flat_columns`): its `custom_id` the row id, `body.messages` (chat) or
`body.prompt` (completions) its text, the sampling fields per-row sampling columns (`sampling.from_columns`,
so they are validated like the job-wide `sampling.*` and a bad one is a `bad_sampling_param` error row).
A line that is not a request this runner serves — unknown fields, another method or endpoint, `n` other
than 1, logprobs the job was not asked for — is a `bad_request` error row with the reason; a line that
is not JSON at all stops the job (the file is corrupt). One endpoint per job, as OpenAI's batches have:
the `url` of the first line that names an endpoint (`endpoint_of`); lines for the other endpoint are
`bad_request` rows. Every value a line's body gives is read by `data.row_values`: none ends the job.

The output side (`output.format=openai_batch`) is `runner.openai_output`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator, Mapping
from typing import Any

from flashx_batch.config_schema import JobConfig
from flashx_batch.data.jsonl import json_lines
from flashx_batch.data.row_values import INT64, as_int, describe
from flashx_batch.data.validate import RowProblem
from flashx_batch.errors import ConfigError

log = logging.getLogger(__name__)
CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
ENDPOINTS = (CHAT, COMPLETIONS, EMBEDDINGS)
BAD_REQUEST = "bad_request"
# body field -> the row column it becomes (a per-row sampling column where it is a sampling knob)
SAMPLING_FIELDS = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens",
                   "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed", "stop": "stop"}
# fields accepted and not acted on: identification, and knobs whose value here is their default
INERT = {"model", "user", "stream", "n", "logprobs", "top_logprobs", "metadata", "store"}
BODY_FIELDS = {CHAT: {"messages", "tools", "response_format", *SAMPLING_FIELDS, *INERT},
               COMPLETIONS: {"prompt", "response_format", *SAMPLING_FIELDS, *INERT},
               # task=embed: one text per line; `dimensions` must be the job's embed.dimensions (the vectors of
               # a job share one width); vectors are written as floats
               EMBEDDINGS: {"input", "model", "user", "encoding_format", "dimensions"}}
LINE_FIELDS = {"custom_id", "method", "url", "body"}
# the columns every openai_batch file reads as (the job's data.* keys are pointed at them: `derive`)
COLUMNS = ("custom_id", "url", "prompt", "messages", "tools", "model", "request_error", "logprobs", "json_schema",
           "dimensions", *dict.fromkeys(SAMPLING_FIELDS.values()))


def derive(job: JobConfig, endpoint: str) -> JobConfig:
    """The job as an openai_batch file runs it: a copy whose data and sampling keys point at the columns
    the file reads as, for the batch's `endpoint` (CHAT: messages through the chat template; COMPLETIONS:
    the prompt as is). `job` itself is not changed. A request line carries no column but `model`: a
    passthrough column the user asked for is refused; a preset's `data.passthrough_if_present` finds none."""
    if job.task not in ("generate", "embed") or (endpoint == EMBEDDINGS) != (job.task == "embed"):
        raise ConfigError(f"the batch's requests are for {endpoint} and task={job.task}: an embeddings batch runs as "
                          "task=embed, a chat or completions batch as task=generate; set task accordingly.")
    asked = [c for c in job.data.passthrough_columns if c != "model"]
    if asked:
        raise ConfigError(f"data.passthrough_columns={asked}: OpenAI Batch request lines have no such column (a "
                          "line carries custom_id, method, url and body; `model` is kept). Drop it: "
                          "data.passthrough_columns=[].")
    data = dataclasses.replace(job.data, id_column="custom_id", prompt_column="prompt",
                               messages_column="messages" if endpoint == CHAT else None,
                               tools_column="tools" if endpoint == CHAT else None, passthrough_columns=["model"],
                               passthrough_if_present=[])
    if endpoint == EMBEDDINGS:  # no sampling: the lines' own checks (dimensions) are `row_problem`'s
        return dataclasses.replace(job, data=data)
    sampling = dataclasses.replace(job.sampling, from_columns={
        **{c: c for c in dict.fromkeys(SAMPLING_FIELDS.values())}, "json_schema": "json_schema",
        **job.sampling.from_columns})
    return dataclasses.replace(job, data=data, sampling=sampling)


def endpoint(job: JobConfig) -> str:
    """The endpoint a configured openai_batch job serves."""
    if job.task == "embed":
        return EMBEDDINGS
    return CHAT if job.data.messages_column else COMPLETIONS


def endpoint_of(paths: list[str]) -> str:
    """A batch's endpoint: the `url` of its first request line (over `paths` in order) that names one of
    the two endpoints; CHAT when none does. Lines before it that are not JSON objects or name another url
    decide nothing (they are `bad_request` rows, or a corrupt file the parse refuses), so one bad first
    line cannot turn every good line away. Reads only as far as that line."""
    for path in paths:
        for line in _lines(path):
            try:
                record = json.loads(line.decode("utf-8", errors="surrogateescape").lstrip("\ufeff"))
            except (ValueError, RecursionError):
                continue
            url = record.get("url") if isinstance(record, dict) else None
            if url in ENDPOINTS:
                return url
    return CHAT


def _lines(path: str) -> Iterator[bytes]:
    """The non-blank lines of a file, streamed (a batch file may be gigabytes)."""
    from flashx_batch import storage

    fs, inner = storage.filesystem(path)
    rest = b""
    with fs.open_input_stream(inner) as fh:
        while chunk := fh.read(1 << 20):
            *whole, rest = (rest + chunk).split(b"\n")
            yield from (line for line in whole if line.strip())
    if rest.strip():
        yield rest


def parse(path: str, data: bytes) -> dict[str, list[Any]]:
    """Every line of an openai_batch file as row columns (`COLUMNS`); `request_error` says why a line is
    not a request this runner serves (None: it is)."""
    columns: dict[str, list[Any]] = {c: [] for c in COLUMNS}
    for lineno, record in json_lines(path, data):
        row = _row(record, lineno, path)
        for c in COLUMNS:
            columns[c].append(row.get(c))
    return columns


def _row(record: Any, lineno: int, file: str) -> dict[str, Any]:
    # the id of a line without a usable custom_id: the file's path as given, which no other file shares
    # (two directories' requests.jsonl), and no custom_id can take (ids are checked for duplicates)
    where = f"({file} line {lineno})"
    if not isinstance(record, dict):
        return {"custom_id": where, "request_error": f"line {lineno} is a JSON {type(record).__name__}, not a "
                                                     "request object"}
    custom_id = record.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return {"custom_id": where, "request_error": f"line {lineno} has no custom_id (a non-empty string)"}
    row: dict[str, Any] = {"custom_id": custom_id, "url": record.get("url")}
    body = record.get("body")
    endpoint = record.get("url")
    problem = _line_problem(record, body)
    if problem is None:
        problem = _body_problem(body, endpoint)
    if problem is not None:
        return {**row, "request_error": problem}
    row["model"] = body.get("model") if isinstance(body.get("model"), str) else None
    if endpoint == EMBEDDINGS:
        text = body["input"]
        row["prompt"], row["dimensions"] = text if isinstance(text, str) else text[0], body.get("dimensions")
        return row
    row["messages" if endpoint == CHAT else "prompt"] = body.get("messages" if endpoint == CHAT else "prompt")
    row["tools"] = body.get("tools")
    for field, column in SAMPLING_FIELDS.items():
        if body.get(field) is not None:
            row[column] = body[field]
    row["logprobs"] = _logprobs_asked(body, endpoint)
    row["json_schema"] = _response_schema(body.get("response_format"))
    return row


def _line_problem(record: Mapping[str, Any], body: Any) -> str | None:
    unknown = sorted(set(record) - LINE_FIELDS)
    if unknown:
        return f"unknown field(s) {unknown}; a request line has {sorted(LINE_FIELDS)}"
    if record.get("method", "POST") != "POST":
        return f"method {record.get('method')!r}: batch requests are POST"
    url = record.get("url")
    if url not in ENDPOINTS:
        return f"url {url!r}: this runner serves {', '.join(ENDPOINTS)}"
    if not isinstance(body, dict):
        return "body is missing or not an object"
    return None


def _body_problem(body: Mapping[str, Any], endpoint: str) -> str | None:
    unknown = sorted(set(body) - BODY_FIELDS[endpoint])
    if unknown:
        return f"body field(s) {unknown} are not supported for {endpoint} (supported: {sorted(BODY_FIELDS[endpoint])})"
    if endpoint == EMBEDDINGS:
        return _embeddings_problem(body)
    if body.get("stream"):
        return "stream=true: batch responses are written whole"
    n = body.get("n", 1)
    if n != 1:
        return f"n={n!r}: one choice per request line here; send a line per sample (with its own seed)"
    both = (body.get("max_tokens"), body.get("max_completion_tokens"))
    if None not in both and both[0] != both[1]:
        return (f"max_tokens={describe(both[0])} and max_completion_tokens={describe(both[1])} disagree; give one "
                "(they are one setting here)")
    problem = _logprobs_problem(body, endpoint) or _response_format_problem(body.get("response_format"))
    if problem is not None:
        return problem
    if endpoint == CHAT and "messages" not in body:
        return "body.messages is missing"
    if endpoint == COMPLETIONS and not isinstance(body.get("prompt"), str):
        return "body.prompt must be one string (lists of prompts: one request line each)"
    return None


def _logprobs_problem(body: Mapping[str, Any], endpoint: str) -> str | None:
    """Why a line's logprobs fields are not a request this runner can honour (None: they are). Chat:
    `logprobs` true or false, `top_logprobs` an integer >= 0 and only with `logprobs: true` (alone it
    would be served without logprobs). Completions: `logprobs` an integer >= 0 (the top K) or null."""
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if endpoint == CHAT:
        if logprobs is not None and not isinstance(logprobs, bool):
            return f"logprobs is {describe(logprobs)}; chat requests take true or false (top_logprobs: how many)"
        if top is not None and as_int(top, 0, INT64) is None:
            return f"top_logprobs is {describe(top)}; expected an integer >= 0"
        if top is not None and not logprobs:
            return "top_logprobs without logprobs: true (it would be served without logprobs); add logprobs: true"
        return None
    if logprobs is not None and as_int(logprobs, 0, INT64) is None:
        return (f"logprobs is {describe(logprobs)}; completions requests take the number of top logprobs "
                "(an integer >= 0) or null")
    if top is not None:
        return "top_logprobs is a chat field; completions requests give the number as logprobs"
    return None


def _embeddings_problem(body: Mapping[str, Any]) -> str | None:
    text = body.get("input")
    if isinstance(text, list) and len(text) == 1:
        text = text[0]
    if not isinstance(text, str) or not text:
        return (f"input is {describe(body.get('input'))}; one non-empty string per request line here (a list of "
                "several: one line each)")
    if body.get("encoding_format", "float") != "float":
        return f"encoding_format={describe(body.get('encoding_format'))}: vectors are written as floats; drop it"
    dims = body.get("dimensions")
    if dims is not None and as_int(dims, 1, INT64) is None:
        return f"dimensions is {describe(dims)}; expected a positive integer"
    return None


def _response_format_problem(fmt: Any) -> str | None:
    """Why a line's `response_format` is not one this runner serves (None: absent, or it is). The schema
    itself is checked as every row's constraint is (a bad one is a bad_constraint row)."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        return (f"response_format is {describe(fmt)}; expected {{\"type\": \"text\" | \"json_object\" | "
                f"\"json_schema\"}}")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            return ("response_format json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": {...}}}; "
                    f"got {describe(spec)}")
        if "schema" in spec and not isinstance(spec["schema"], dict):
            return f"response_format json_schema.schema is {describe(spec['schema'])}; expected a JSON schema object"
    return None


def _response_schema(fmt: Any) -> str | None:
    """The JSON schema a line's (valid) `response_format` asks for, as JSON text (None: free text).
    `json_object`: any JSON object. `json_schema`: its schema, enforced whether `strict` is true or not
    (OpenAI only promises to follow a strict one; a constrained row here follows it whenever it finishes);
    no schema: any JSON value."""
    if not isinstance(fmt, dict) or fmt.get("type") == "text":
        return None
    if fmt["type"] == "json_object":
        return json.dumps({"type": "object"})
    return json.dumps(fmt["json_schema"].get("schema", {}))


def _logprobs_asked(body: Mapping[str, Any], endpoint: str) -> int | None:
    """The top-K logprobs a line asks for (0: the chosen tokens' only), None when it asks for none (its
    fields already checked by `_logprobs_problem`)."""
    if endpoint == CHAT:
        return (body.get("top_logprobs") or 0) if body.get("logprobs") else None
    return body.get("logprobs")


def row_problem(job: JobConfig, columns: Mapping[str, list[Any]], i: int) -> RowProblem | None:
    """Row `i`'s request-level problem: its line's `request_error`, or logprobs the job does not produce
    (`sampling.logprobs` is job-wide: every response carries them, or none does)."""
    error = columns["request_error"][i]
    if error is not None:
        return RowProblem(BAD_REQUEST, error)
    if columns["url"][i] != endpoint(job):
        return RowProblem(BAD_REQUEST, f"url {columns['url'][i]!r} in a batch for {endpoint(job)} (the first "
                                       "request line's that names an endpoint): one endpoint per batch")
    if job.task == "embed":  # the vectors of a job share one width: a line may only ask for the job's
        dims = columns["dimensions"][i]
        if dims is not None and dims != job.embed.dimensions:
            width = f"{job.embed.dimensions} components" if job.embed.dimensions else "the model's full width"
            return RowProblem(BAD_REQUEST, f"asks for dimensions={dims}, and this job's vectors have {width} (one "
                                           f"width per job): run it with embed.dimensions={dims}, or drop "
                                           "dimensions from the line")
        return None
    asked, job_k = columns["logprobs"][i], job.sampling.logprobs or 0
    if asked is not None and (not job_k or asked > job_k):
        return RowProblem(BAD_REQUEST, f"asks for logprobs (top {asked}), and this job produces "
                                       f"{'none' if not job_k else f'the top {job_k}'}: run it with "
                                       f"sampling.logprobs={max(asked, 1)} or drop logprobs from the line")
    return None
