"""OpenAI Batch output (`output.format=openai_batch`): `<output.dir>/openai_batch_output.jsonl`, one line per
request in the shape OpenAI's batch API and vLLM's `run-batch` write:

    {"id": "batch_req_...", "custom_id": "req-1", "error": null,
     "response": {"status_code": 200, "request_id": "...", "body": {"object": "chat.completion", "choices": [...],
                  "usage": {...}, ...}}}

and for a row that became an error row, `"response": null, "error": {"code": "<error_code>", "message": ...}`.
Written by the driver from the committed pieces just before `_SUCCESS` (so a finished job always has it,
and a resumed one writes it from exactly the committed rows: every custom_id once), piece by piece — the
order of the lines is not the input's, as in OpenAI's own output; match them by `custom_id`.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from flashx_batch.config import JobConfig

FILE_NAME = "openai_batch_output.jsonl"
FINISH = {"stop": "stop", "eos": "stop", "length": "length"}  # ours -> OpenAI's finish_reason


def write(output: Any, job: JobConfig, committed: dict[str, dict[str, Any]], model_name: str, created: int,
          decode: Any = None) -> int:
    """Write the file from the `committed` pieces; returns its line count. `decode(ids) -> str` renders
    token ids for logprobs (None: logprobs are written without token strings)."""
    chat = bool(job.data.messages_column)
    count = 0
    with output.report_dir() as where:
        final = Path(where) / FILE_NAME
        partial = final.with_name(f".{FILE_NAME}.{os.getpid()}.partial")
        with open(partial, "w", encoding="utf-8") as fh:
            for piece in sorted(committed):
                for line in _piece_lines(output, piece, committed, job, chat, model_name, created, decode):
                    fh.write(json.dumps(line, ensure_ascii=False) + "\n")
                    count += 1
        os.replace(partial, final)  # whole or absent (on an object store, uploaded when the block ends)
    return count


def _piece_lines(output: Any, piece: str, committed: dict, job: JobConfig, chat: bool, model_name: str,
                 created: int, decode: Any) -> Iterator[dict[str, Any]]:
    gens = output.read_part("generations", piece, None, committed)
    if gens is not None and gens.num_rows:
        rows = gens.to_pylist()
        by_id: dict[Any, list[dict]] = {}
        for r in rows:
            by_id.setdefault(r["id"], []).append(r)
        for custom_id, samples in by_id.items():
            if job.task == "embed":
                yield _embedding(str(custom_id), samples[0], model_name)
                continue
            samples.sort(key=lambda r: r.get("sample_index") or 0)
            yield _success(str(custom_id), samples, chat, model_name, created, decode, job.sampling.logprobs)
    errs = output.read_part("errors", piece, ["id", "error_code", "error_message"], committed)
    if errs is not None:
        for r in errs.to_pylist():
            yield {"id": _batch_id("batch_req", r["id"]), "custom_id": str(r["id"]), "response": None,
                   "error": {"code": r["error_code"], "message": r["error_message"]}}


def _success(custom_id: str, samples: list[dict], chat: bool, model_name: str, created: int, decode: Any,
             logprobs: int | None) -> dict[str, Any]:
    choices = []
    for i, r in enumerate(samples):
        choice: dict[str, Any] = {"index": i, "finish_reason": FINISH.get(r["finish_reason"], r["finish_reason"]),
                                  "logprobs": _logprobs(r, chat, decode) if logprobs else None}
        if chat:  # a parsed answer's reasoning and tool calls (their columns exist where the template has them)
            message = choice["message"] = {"role": "assistant", "content": r["generated_text"]}
            if r.get("reasoning_content") is not None:
                message["reasoning_content"] = r["reasoning_content"]
            if r.get("tool_calls"):
                message["tool_calls"] = r["tool_calls"]
                message["content"] = r["generated_text"] or None
                if choice["finish_reason"] == "stop":
                    choice["finish_reason"] = "tool_calls"
        else:
            choice["text"] = r["generated_text"]
        choices.append(choice)
    prompt_tokens = int(samples[0]["num_input_tokens"])
    completion_tokens = sum(int(r["num_generated_tokens"]) for r in samples)
    body = {"id": _batch_id("chatcmpl" if chat else "cmpl", custom_id, "-"),
            "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": samples[0].get("model") or model_name, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}
    return {"id": _batch_id("batch_req", custom_id), "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": _batch_id("req", custom_id), "body": body}, "error": None}


def _embedding(custom_id: str, r: dict, model_name: str) -> dict[str, Any]:
    """A task=embed row as the /v1/embeddings response OpenAI's batch output holds."""
    tokens = int(r["num_input_tokens"])
    body = {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": r["embedding"]}],
            "model": r.get("model") or model_name, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
    return {"id": _batch_id("batch_req", custom_id), "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": _batch_id("req", custom_id), "body": body}, "error": None}


def _logprobs(r: dict, chat: bool, decode: Any) -> dict[str, Any] | None:
    ids, lps, tops = r.get("token_ids"), r.get("token_logprobs"), r.get("top_logprobs")
    if ids is None or lps is None:
        return None
    token = (lambda t: decode([t])) if decode is not None else (lambda t: str(t))
    if chat:
        return {"content": [{"token": token(t), "logprob": lp, "bytes": list(token(t).encode("utf-8")),
                             "top_logprobs": [{"token": token(a["token_id"]), "logprob": a["logprob"],
                                               "bytes": list(token(a["token_id"]).encode("utf-8"))}
                                              for a in (tops[k] if tops else [])]}
                            for k, (t, lp) in enumerate(zip(ids, lps, strict=True))]}
    return {"tokens": [token(t) for t in ids], "token_logprobs": lps,
            "top_logprobs": [{token(a["token_id"]): a["logprob"] for a in step} for step in (tops or [])],
            "text_offset": []}


def _batch_id(prefix: str, custom_id: Any, sep: str = "_") -> str:
    """A stable id for a line (the same custom_id, the same id, whatever run wrote it), in OpenAI's
    spelling: `batch_req_...`, `req_...`, `chatcmpl-...`, `cmpl-...`."""
    return f"{prefix}{sep}{hashlib.sha256(str(custom_id).encode('utf-8', 'surrogatepass')).hexdigest()[:24]}"
