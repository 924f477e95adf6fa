"""Build the bundled sample dataset ``flashx_batch/assets/data/legal_docs.parquet``.

Rows are made from HELD-OUT documents only (``heldout.jsonl`` written by
``jobs/training/build_legal_corpus.py``), so the demo model never saw their text in
training. Each row is ``id`` (``legal-000001`` ...), ``source`` (the document
path) and ``prompt``: one of four instructions wrapped around an excerpt of the
document that starts at a line boundary.

The 120 rows have a planned prompt length, measured in tokens of the
``legal-tiny`` tokenizer, relative to ``max_input_len = 512``:

* 36 short   (32-127 tokens)
* 60 medium  (128-383 tokens)
* 24 long    (18 rows of 384-512 tokens and 6 rows of 600-900 tokens,
  i.e. longer than ``max_input_len``, to exercise truncation/rejection)

Everything is driven by one seeded ``random.Random``, so the output is
byte-for-byte reproducible for a given corpus and tokenizer.

Usage::

    python jobs/training/build_sample_dataset.py \
        --heldout build/corpus/heldout.jsonl \
        --tokenizer flashx_batch/assets/models/legal-tiny \
        --out flashx_batch/assets/data/legal_docs.parquet
"""

from __future__ import annotations

import argparse
import json
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Tokenizer

MAX_INPUT_LEN = 512
N_ROWS = 120
# (bucket name, min tokens, max tokens inclusive, rows)
PLAN: list[tuple[str, int, int, int]] = [
    ("short", 32, 127, 36),
    ("medium", 128, 383, 60),
    ("long", 384, 512, 18),
    ("over", 600, 900, 6),
]
TEMPLATES: list[str] = [
    "Summarise the licence terms of the following document.\n\n{excerpt}\n\nSummary:",
    "List the copyright holders named in the following text.\n\n{excerpt}\n\nCopyright holders:",
    "Which licence does the following text describe? Answer with the licence name.\n\n{excerpt}\n\nLicence:",
    "Explain in plain English what the following licence text allows and forbids.\n\n{excerpt}\n\nExplanation:",
]


@dataclass
class Doc:
    """A held-out document with its token character offsets and line starts."""

    source: str
    text: str
    offsets: list[tuple[int, int]]
    line_starts: list[int]  # token indices at which a line begins


def load_tokenizer(path: Path) -> Tokenizer:
    """Load ``tokenizer.json`` from a file or a model directory."""
    return Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))


def load_docs(path: Path, tok: Tokenizer) -> list[Doc]:
    """Read held-out docs and tokenise them once (offsets for excerpting)."""
    docs: list[Doc] = []
    with path.open(encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    for row, enc in zip(rows, tok.encode_batch([r["text"] for r in rows])):
        text = row["text"]
        starts = [i for i, (a, _) in enumerate(enc.offsets) if a == 0 or text[a - 1] == "\n"]
        docs.append(Doc(row["source"], text, list(enc.offsets), starts))
    return docs


def n_tokens(tok: Tokenizer, text: str) -> int:
    """Token count of ``text`` (the tokenizer adds no special tokens)."""
    return len(tok.encode(text).ids)


def make_prompt(
    tok: Tokenizer, doc: Doc, start: int, target: int, lo: int, hi: int, template: str
) -> str | None:
    """Prompt whose excerpt starts at token ``start`` of ``doc`` and whose
    token length is in [lo, hi], as close to ``target`` as found; None if the
    document is too short from there."""
    overhead = n_tokens(tok, template.format(excerpt=""))
    n = target - overhead
    best: tuple[int, str] | None = None
    for _ in range(12):
        n = max(1, min(n, len(doc.offsets) - start))
        excerpt = doc.text[doc.offsets[start][0] : doc.offsets[start + n - 1][1]].strip()
        prompt = template.format(excerpt=excerpt)
        length = n_tokens(tok, prompt)
        if lo <= length <= hi and (best is None or abs(length - target) < abs(best[0] - target)):
            best = (length, prompt)
        if length == target or (length < target and start + n >= len(doc.offsets)):
            break
        n += target - length
    return best[1] if best else None


def build_rows(docs: list[Doc], tok: Tokenizer, seed: int) -> list[dict[str, str]]:
    """Sample N_ROWS prompts following PLAN; rows are shuffled, then numbered."""
    rng = random.Random(seed)
    plan = [(lo, hi) for _, lo, hi, count in PLAN for _ in range(count)]
    assert len(plan) == N_ROWS
    rng.shuffle(plan)
    rows: list[dict[str, str]] = []
    seen: set[str] = set()
    for i, (lo, hi) in enumerate(plan):
        template = TEMPLATES[i % len(TEMPLATES)]
        for _attempt in range(200):
            target = rng.randint(lo, hi)
            eligible = [d for d in docs if len(d.offsets) >= target]
            doc = rng.choice(eligible)
            usable = [s for s in doc.line_starts if len(doc.offsets) - s >= target] or [0]
            prompt = make_prompt(tok, doc, rng.choice(usable), target, lo, hi, template)
            if prompt is not None and prompt not in seen:
                break
        else:
            raise RuntimeError(f"could not build a {lo}-{hi} token prompt for row {i}")
        seen.add(prompt)
        rows.append({"id": f"legal-{i + 1:06d}", "source": doc.source, "prompt": prompt})
    return rows


def write_parquet(rows: list[dict[str, str]], out: Path) -> None:
    """Write rows with an all-string schema (id, source, prompt)."""
    schema = pa.schema([("id", pa.string()), ("source", pa.string()), ("prompt", pa.string())])
    table = pa.Table.from_pylist(rows, schema=schema)
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, out, compression="zstd")


def print_histogram(lengths: list[int]) -> None:
    """Print bucket counts and a 64-token-bin histogram of prompt lengths."""
    buckets = Counter()
    for n in lengths:
        for name, lo, hi, _ in PLAN:
            if lo <= n <= hi:
                buckets[name] += 1
    print(f"rows {len(lengths)}  min {min(lengths)}  max {max(lengths)}  mean {sum(lengths) / len(lengths):.1f}")
    for name, lo, hi, count in PLAN:
        print(f"  {name:7s} {lo:4d}-{hi:4d}: {buckets[name]:3d} rows (planned {count})")
    print(f"  > max_input_len ({MAX_INPUT_LEN}): {sum(n > MAX_INPUT_LEN for n in lengths)} rows")
    bins = Counter(n // 64 for n in lengths)
    for b in range(0, max(bins) + 1):
        print(f"  {b * 64:4d}-{b * 64 + 63:4d} | {'#' * bins[b]} {bins[b] or ''}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heldout", type=Path, default=Path("build/corpus/heldout.jsonl"))
    parser.add_argument("--tokenizer", type=Path, default=Path("flashx_batch/assets/models/legal-tiny"))
    parser.add_argument("--out", type=Path, default=Path("flashx_batch/assets/data/legal_docs.parquet"))
    parser.add_argument("--seed", type=int, default=20240601)
    args = parser.parse_args(argv)

    tok = load_tokenizer(args.tokenizer)
    rows = build_rows(load_docs(args.heldout, tok), tok, args.seed)
    write_parquet(rows, args.out)
    lengths = [n_tokens(tok, r["prompt"]) for r in rows]
    print(f"wrote {len(rows)} rows to {args.out} ({args.out.stat().st_size / 1024:.1f} KiB)")
    print_histogram(lengths)


if __name__ == "__main__":
    main()
