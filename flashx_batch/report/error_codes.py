"""What to do about each error row's `error_code` (report.md's error table; docs/reliability.md lists
which inputs give which code). A code missing here is reported with its message and no fix."""

from __future__ import annotations

FIXES = {
    "null_prompt": "give the row a prompt (the prompt / messages cell is null)",
    "empty_prompt": "give the row a non-empty prompt",
    "bad_type": "make the cell a string (prompt) or a list of {role, content} messages (chat); see the message",
    "invalid_text": "re-encode the input as UTF-8 without control characters",
    "row_too_large": "shorten the row, or raise data.max_row_bytes",
    "prompt_too_long": "shorten the prompt, raise runtime.max_input_len, or set runtime.long_input=truncate",
    "unrendered_message": "use roles the model's chat template renders (user / assistant / system; tool only "
                          "where the template has it)",
    "bad_sampling_param": "fix the per-row sampling value the message names (sampling.from_columns)",
    "bad_constraint": "fix the row's json_schema / regex / choice / grammar as the grammar library's message says",
    "bad_request": "fix the OpenAI Batch line as the message says (one endpoint per file, n = 1, known fields)",
    "null_context": "give the row a context", "empty_context": "give the row a non-empty context",
    "null_continuation": "give the row a continuation", "empty_continuation": "give the row a non-empty continuation",
    "continuation_too_long": "shorten the continuation, or raise runtime.max_input_len",
    "null_choices": "give the row a list of choices", "empty_choices": "give the row at least one choice",
    "empty_choice": "remove the empty choice", "answer_out_of_range": "make the answer an index into the choices",
    "worker_crash": "the worker process died on this row every try: run it alone (data.limit, a one-row file) "
                    "and look at the worker's log",
    "timeout": "the row ran past executor.shard_timeout_s every try: raise it, or lower sampling.max_new_tokens",
}


def fix_for(code: str) -> str:
    return FIXES.get(code, "")
