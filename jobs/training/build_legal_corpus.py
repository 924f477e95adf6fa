"""Build the Debian legal-text corpus used for the bundled demo model and data.

Sources are every ``/usr/share/doc/*/copyright`` file and every file in
``/usr/share/common-licenses/``. Each file is decoded as UTF-8 with
``errors='replace'`` and stripped of surrounding whitespace; empty documents
are dropped, as are exact duplicates (same sha256 of the normalised text; the
first path in sorted order is kept as ``source``).

Split rule (deterministic, independent of file order and machine):
    sha = sha256(text.encode("utf-8")).hexdigest()
    held-out  if int(sha, 16) % 10 == 0
    train     otherwise

Output: ``<out>/train.jsonl`` and ``<out>/heldout.jsonl``, one JSON object per
line with fields ``source`` (the file path) and ``text``.

Usage::

    python jobs/training/build_legal_corpus.py --out build/corpus
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
from pathlib import Path

DEFAULT_PATTERNS = ("/usr/share/doc/*/copyright", "/usr/share/common-licenses/*")


def list_sources(patterns: tuple[str, ...] = DEFAULT_PATTERNS) -> list[str]:
    """Return the sorted list of regular files matching ``patterns``."""
    paths: set[str] = set()
    for pattern in patterns:
        paths.update(p for p in glob.glob(pattern) if Path(p).is_file())
    return sorted(paths)


def normalise(raw: bytes) -> str:
    """Decode bytes as UTF-8 (replacing invalid sequences) and strip."""
    return raw.decode("utf-8", errors="replace").strip()


def text_sha256(text: str) -> str:
    """Hex sha256 of the UTF-8 encoded text."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def is_heldout(sha: str) -> bool:
    """The split rule: held-out iff int(sha256, 16) % 10 == 0."""
    return int(sha, 16) % 10 == 0


def build(paths: list[str]) -> tuple[list[dict[str, str]], list[dict[str, str]], int]:
    """Deduplicate and split; returns (train, heldout, n_duplicates_or_empty)."""
    seen: set[str] = set()
    train: list[dict[str, str]] = []
    heldout: list[dict[str, str]] = []
    dropped = 0
    for path in paths:
        text = normalise(Path(path).read_bytes())
        sha = text_sha256(text)
        if not text or sha in seen:
            dropped += 1
            continue
        seen.add(sha)
        (heldout if is_heldout(sha) else train).append({"source": path, "text": text})
    return train, heldout, dropped


def write_jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    """Write rows as UTF-8 JSON lines."""
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("build/corpus"))
    args = parser.parse_args(argv)

    paths = list_sources()
    train, heldout, dropped = build(paths)
    args.out.mkdir(parents=True, exist_ok=True)
    write_jsonl(args.out / "train.jsonl", train)
    write_jsonl(args.out / "heldout.jsonl", heldout)

    def chars(rows: list[dict[str, str]]) -> int:
        return sum(len(r["text"]) for r in rows)

    print(f"files read: {len(paths)}  dropped (duplicate/empty): {dropped}")
    print(f"train:   {len(train)} docs, {chars(train)} chars -> {args.out / 'train.jsonl'}")
    print(f"heldout: {len(heldout)} docs, {chars(heldout)} chars -> {args.out / 'heldout.jsonl'}")


if __name__ == "__main__":
    main()
