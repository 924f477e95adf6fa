"""Task families for choosing and reporting lossy KV settings: a tuning split the presets are chosen on, and a
held-out split of other formats every reported retention figure comes from (`python -m flashx_batch.quality.kv_tasks
--split tuning|held_out`).

Choosing a lossy setting on the tasks it is then reported on overstates what it keeps: a setting tuned to one
copy format can hold there and fail on a copy with a longer cue. So the families differ in format, not in seed:

- **tuning**: `copy` (64-token span, 8-token cue), `mqar` (single-token keys), `ppl` (held-out perplexity).
- **held_out**:
  - `copy_long`: a 128-token span whose first half is the cue, the second half the answer;
  - `kv_multikey`: recall with keys of 3 tokens;
  - `multihop`: chains a→b, b→c stored as separate pairs among distractors, asked a, scored on b then c
    generated greedily (the second hop reads the model's own first answer);
  - `needle`: a random 16-token span at a random depth of licence text, asked for with its first 6 tokens
    (the bundled model cannot answer a question in prose: it was trained to copy and recall, not to chat);
  - `mc`: the bundled multiple-choice set.

A family's retention is the policy's mean score over the static cache's on the same examples, with a
percentile bootstrap interval over examples (paired: each resample takes the same examples for both).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

SPLITS = {"tuning": ("copy", "mqar", "ppl"),
          "held_out": ("copy_long", "kv_multikey", "multihop", "needle", "mc")}
KEY_TOKENS = 3  # kv_multikey's key length
NEEDLE_TOKENS = 16  # the needle: a random span of this many tokens, its first NEEDLE_CUE given back as the cue
NEEDLE_CUE = 6
CHAINS = 8  # multihop: chains stored per example (one asked)


@dataclass
class Example:
    """`context` is compressed; `query` (at least the prompt's last token) and what follows run
    through the compressed cache. `answer`: tokens to generate (copy), values to recall (mqar),
    targets (ppl); `choices` / `label` for mc."""

    context: list[int]
    query: list[int]
    answer: list[int] = field(default_factory=list)
    feed: list[int] = field(default_factory=list)  # teacher-forced tokens after the query (mqar, ppl)
    choices: list[list[int]] = field(default_factory=list)
    label: int = -1
    positions: list[int] = field(default_factory=list)  # recall: where each answer is predicted (default k v k v)


def random_tokens(rng: random.Random, count: int, vocab: int, avoid: set[int], distinct: bool = False) -> list[int]:
    pool = [t for t in range(vocab) if t not in avoid]
    return rng.sample(pool, count) if distinct else [rng.choice(pool) for _ in range(count)]


def multikey_pairs(rng: random.Random, pairs: int, vocab: int, avoid: set[int]) -> tuple[list[list[int]], list[int]]:
    """`pairs` distinct keys of KEY_TOKENS tokens (no two share a first token) and one value token each."""
    firsts = random_tokens(rng, pairs, vocab, avoid, distinct=True)
    keys = [[first, *random_tokens(rng, KEY_TOKENS - 1, vocab, avoid)] for first in firsts]
    return keys, random_tokens(rng, pairs, vocab, avoid)


def multikey_feed(keys: list[list[int]], values: list[int], asked: list[int], query_len: int
                  ) -> tuple[list[int], list[int]]:
    """(teacher-forced feed: each asked key then its value, the indices among the logits of query + feed
    where each value is predicted: after its key's last token)."""
    feed, positions = [], []
    for j in asked:
        positions.append(query_len + len(feed) + len(keys[j]) - 1)
        feed += keys[j] + [values[j]]
    return feed, positions


def multihop_chains(rng: random.Random, vocab: int, avoid: set[int]) -> tuple[list[tuple[int, int]], list[int]]:
    """CHAINS chains a -> b -> c of distinct tokens as 2 x CHAINS pairs in random order, and one chain asked."""
    tokens = random_tokens(rng, 3 * CHAINS, vocab, avoid, distinct=True)
    chains = [tokens[3 * i : 3 * i + 3] for i in range(CHAINS)]
    pairs = [(a, b) for a, b, _ in chains] + [(b, c) for _, b, c in chains]
    rng.shuffle(pairs)
    return pairs, rng.choice(chains)


def paired_bootstrap(policy: list[float], static: list[float], resamples: int = 2000, seed: int = 0,
                     lower_is_better: bool = False) -> tuple[float, float, float]:
    """(retention, low, high): sum(policy) / sum(static) over the examples (static ÷ policy where lower is
    better, as for summed NLL of equal token counts: then the per-example values are NLLs and retention is
    exp(mean static NLL - mean policy NLL)), with its 95 % percentile interval over example resamples (a
    resample whose static scores sum to 0 has no ratio and is left out)."""
    p, s = torch.tensor(policy, dtype=torch.float64), torch.tensor(static, dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, len(p), (resamples, len(p)), generator=gen)

    def ratio(ps: torch.Tensor, ss: torch.Tensor) -> torch.Tensor:
        if lower_is_better:
            return torch.exp((ss - ps).sum(-1) / ss.shape[-1])
        total = ss.sum(-1)
        return torch.where(total > 0, ps.sum(-1) / total.clamp(min=1e-300), torch.nan)  # no ratio: left out

    spread = ratio(p[picks], s[picks])
    lo, hi = torch.nanquantile(spread, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return float(ratio(p, s)), lo, hi


def multikey_examples(filler: list[list[int]], marker: list[int], vocab: int, avoid: set[int], count: int,
                      pairs: int, queries: int, seed: int) -> list[Example]:
    """kv_multikey: mqar with keys of `kv_families.KEY_TOKENS` tokens; each asked key teacher-forced, its value
    scored after the key's last token."""
    out = []
    for i in range(count):
        rng = random.Random(f"kv_multikey/{seed}/{i}")
        keys, values = multikey_pairs(rng, pairs, vocab, avoid)
        asked = rng.sample(range(pairs), min(queries, pairs))
        prompt = [t for k, v in zip(keys, values) for t in (*k, v)] + filler[i % len(filler)] + marker
        feed, positions = multikey_feed(keys, values, asked, 1)
        out.append(Example(prompt[:-1], prompt[-1:], answer=[values[j] for j in asked], feed=feed,
                           positions=positions))
    return out


def multihop_examples(filler: list[list[int]], marker: list[int], vocab: int, avoid: set[int], count: int,
                      seed: int) -> list[Example]:
    """multihop: pairs of `kv_families.multihop_chains`, half before the filler and half after, then marker + a;
    the answer b c is generated greedily."""
    out = []
    for i in range(count):
        rng = random.Random(f"multihop/{seed}/{i}")
        pairs, (a, b, c) = multihop_chains(rng, vocab, avoid)
        flat = [t for pair in pairs for t in pair]
        half = len(flat) // 2
        prompt = flat[:half] + filler[i % len(filler)] + flat[half:] + marker + [a]
        out.append(Example(prompt[:-1], prompt[-1:], answer=[b, c]))
    return out


def needle_examples(filler: list[list[int]], cue: list[int], vocab: int, avoid: set[int], count: int,
                    seed: int) -> list[Example]:
    """needle: a random NEEDLE_TOKENS-token span at a random depth (10-90 %) of licence text, then the cue and the
    span's first NEEDLE_CUE tokens; the rest of the span is generated greedily."""
    out = []
    for i in range(count):
        rng = random.Random(f"needle/{seed}/{i}")
        span = random_tokens(rng, NEEDLE_TOKENS, vocab, avoid)
        text = filler[i % len(filler)]
        depth = rng.randint(len(text) // 10, 9 * len(text) // 10)
        prompt = text[:depth] + span + text[depth:] + cue + span[:NEEDLE_CUE]
        out.append(Example(prompt[:-1], prompt[-1:], answer=span[NEEDLE_CUE:]))
    return out
