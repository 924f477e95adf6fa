"""JSON Lines parsing shared by the JSONL and OpenAI Batch readers."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from flashx_batch.job_errors import InputError


def json_lines(path: str, data: bytes) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) of every non-blank line of a JSONL file; InputError naming the line
    for one that is not JSON (the file is corrupt)."""
    if data.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark (editors on Windows write one)
        data = data[3:]
    for lineno, raw in enumerate(data.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            # surrogateescape keeps invalid UTF-8 bytes visible, so validation can flag the row
            yield lineno, json.loads(raw.decode("utf-8", errors="surrogateescape"))
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}:{lineno}: not valid JSON ({exc.msg}); the file is corrupt.") from None
        except (ValueError, RecursionError) as exc:  # a number past Python's digit limit, nesting too deep
            raise InputError(f"{path}:{lineno}: cannot be read as JSON ({type(exc).__name__}: "
                             f"{str(exc)[:120]}).") from None
