"""Held-out token windows from the bundled legal corpus split (never seen in training)."""

from __future__ import annotations

import json
from pathlib import Path

from flashx_batch.runtime.tokenizer import Tokenizer

HELDOUT = Path(__file__).resolve().parent.parent / "assets" / "data" / "legal_heldout_eval.jsonl"


def token_windows(tokenizer: Tokenizer, length: int, limit: int, path: Path = HELDOUT,
                  stride: int | None = None) -> list[list[int]]:
    """Up to `limit` windows of `length` tokens, each starting `stride` tokens after the last (default
    `length`: non-overlapping; a smaller stride gives more, overlapping windows from the same text).

    Documents are joined with the EOS token into one stream (licence files are often shorter than
    a 640-token window), in file order, so the windows are the same on every run.
    """
    stride = length if stride is None else stride
    if not 0 < stride <= length:
        raise ValueError(f"token_windows: stride must be in 1..{length} (the window length), got {stride}")
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    stream: list[int] = []
    windows: list[list[int]] = []
    with path.open() as f:
        for line in f:
            stream += tokenizer.encode(json.loads(line)["text"]) + eos
            while len(stream) >= length and len(windows) < limit:
                windows.append(stream[:length])
                stream = stream[stride:]
            if len(windows) >= limit:
                break
    return windows
