"""Build the bundled evaluation set from the held-out licence corpus: which continuation comes next?

    python jobs/training/build_eval_set.py [--out flashx_batch/assets/data/legal_eval.parquet] [--items 240]

Source: `flashx_batch/assets/data/legal_heldout_eval.jsonl`, the copyright files the bundled model was
not trained on (held out by file, `jobs/training/build_legal_corpus.py`). Licence boilerplate repeats across
files, so a held-out file still holds text the model saw in other, training files: each item says so in
`seen_in_training` — its continuation, after the last 8 words of its context, occurs (whitespace-
normalised) in a training file of this machine's corpus (which may differ slightly from the corpus the
model was trained on); without a Debian corpus the script refuses unless `--no-check` is given (the flag
is then null). Report accuracy on all items and on the unseen ones.

Each item (a row): a `context` (8 to 60 words of a paragraph, cut at a word boundary; a long paragraph gives
several items), the true
`continuation` (the next 4–10 words, with the whitespace before them), and `choices`: the true
continuation and three continuations cut the same way from other files, of similar length, in a
seeded random order, with `answer` the true one's index. Columns: id, source, context, continuation,
choices, answer, seen_in_training. The same rows serve `task=multiple_choice` (context, choices, answer) and
`task=loglikelihood` (context, continuation). Chance is 25 %.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HELDOUT = REPO / "flashx_batch" / "assets" / "data" / "legal_heldout_eval.jsonl"
WORD = re.compile(r"\S+")


def paragraphs(text: str) -> list[str]:
    return [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]


def squash(text: str) -> str:
    return " ".join(text.split())


def training_text() -> str:
    """The training split rebuilt from this machine's corpus, whitespace-normalised, files joined by a
    separator no item contains."""
    sys.path.insert(0, str(REPO / "jobs" / "training"))
    from build_legal_corpus import build, list_sources

    train, _, _ = build(list_sources())
    return "\x00".join(squash(row["text"]) for row in train)


def seen(context: str, continuation: str, corpus: str) -> bool:
    """Whether the continuation, after the last 8 words of its context, occurs in the training text."""
    return bool(corpus) and squash(" ".join(context.split()[-8:]) + continuation) in corpus


def cuts(paragraph: str, rng: random.Random) -> list[tuple[str, str]]:
    """(context, continuation) pairs cut from one paragraph at random word boundaries: one per ~70 words,
    each continuation 4–10 words after a context of 8–60 words, no two sharing a continuation word."""
    words = list(WORD.finditer(paragraph))
    out, first = [], 8
    while first + 4 <= len(words):
        n_cont = rng.randint(4, 10)
        first = rng.randint(first, first + 50)
        last = min(first + n_cont, len(words)) - 1
        if last - first + 1 < 4:
            break
        start = max(0, first - 60)
        out.append((paragraph[words[start].start() : words[first - 1].end()],
                    paragraph[words[first - 1].end() : words[last].end()]))
        first = last + 9
    return out


def build_items(docs: list[dict], corpus: str | None, count: int, seed: int) -> list[dict]:
    """Up to `count` items, each flagged `seen_in_training` (None without a corpus to check)."""
    rng = random.Random(seed)
    pool = []  # (source, context, continuation)
    for doc in docs:
        for para in paragraphs(doc["text"]):
            pool += [(doc["source"], *piece) for piece in cuts(para, rng)]
    rng.shuffle(pool)
    items = []
    for source, context, continuation in pool:
        if len(items) == count:
            break
        size = len(continuation)
        others = [c for s, _, c in pool if s != source and 0.5 * size <= len(c) <= 2 * size and c != continuation]
        distractors = []
        for c in rng.sample(others, len(others)):
            if c not in distractors:
                distractors.append(c)
            if len(distractors) == 3:
                break
        if len(distractors) < 3:
            continue
        choices = [continuation, *distractors]
        rng.shuffle(choices)
        items.append({"id": len(items), "source": source, "context": context, "continuation": continuation,
                      "choices": choices, "answer": choices.index(continuation),
                      "seen_in_training": None if corpus is None else seen(context, continuation, corpus)})
    return items


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "flashx_batch" / "assets" / "data" / "legal_eval.parquet")
    ap.add_argument("--items", type=int, default=240)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-check", action="store_true", help="leave seen_in_training null (no Debian corpus here)")
    args = ap.parse_args(argv)
    docs = [json.loads(line) for line in HELDOUT.read_text().splitlines() if line.strip()]
    corpus = None if args.no_check else training_text()
    if corpus == "":
        sys.exit("no training corpus on this machine (/usr/share/doc/*/copyright) to flag items seen in training; "
                 "pass --no-check to build without the seen_in_training flags")
    items = build_items(docs, corpus, args.items, args.seed)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(items), args.out)
    flagged = [i["seen_in_training"] for i in items]
    print(json.dumps({"seen_in_training": sum(bool(f) for f in flagged), "items": len(items),
                      "sources": len({i["source"] for i in items}), "out": str(args.out)}))


if __name__ == "__main__":
    main()
