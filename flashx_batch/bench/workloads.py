"""Seeded workloads of the throughput benchmark: token-id prompts plus a per-row output length.

Called by the harness (`flashx_batch.bench.__main__`), the GPU protocol and the tests. Prompts are
random token ids (ids 0-2 are pad/bos/eos and never drawn), so any model with a vocabulary of the
stated size can run them; EOS is ignored by every variant, so a row always yields exactly its
`max_new_tokens` — the useful tokens we count.

- W1 mixed intake: ~30 % short / 50 % medium / 20 % long prompts, output lengths varied, shuffled
  into arrival order (what a daily ETL intake looks like).
- W2 equal lengths: every prompt and output the same length (the control: bucketing cannot help).
- W3 few-shot: groups of >= 16 rows sharing a prefix of >= 75 % of each prompt, short outputs,
  arriving group by group (an evaluation sweep of one prompt over many questions).
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

FIRST_TOKEN = 3  # 0 pad, 1 bos, 2 eos: never part of a random prompt
MIX = (("short", 0.3), ("medium", 0.5), ("long", 0.2))
MIN_GROUP_ROWS = 16
MIN_SHARED_FRACTION = 0.75
MIN_SHARED_PREFIX = 16  # tokens rows must share to count as one prefix group (`Workload.shared_prefixes`)


@dataclass(frozen=True)
class Workload:
    """Rows in arrival order: prompt token ids, how many tokens to generate, and a label per row
    (the length class in W1, `equal` in W2, the group in W3)."""

    name: str
    description: str
    prompts: list[list[int]]
    max_new_tokens: list[int]
    labels: list[str]

    @property
    def rows(self) -> int:
        return len(self.prompts)

    @property
    def input_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def output_tokens(self) -> int:
        """Useful output tokens: each row's own length, never the batch maximum."""
        return sum(self.max_new_tokens)

    @property
    def max_prompt_len(self) -> int:
        return max(map(len, self.prompts))

    @property
    def max_output_len(self) -> int:
        return max(self.max_new_tokens)

    def subset(self, indices: list[int]) -> Workload:
        """The rows at `indices`, in that order (the correctness gate runs a sample this way)."""
        return Workload(f"{self.name}[sample]", self.description, [self.prompts[i] for i in indices],
                        [self.max_new_tokens[i] for i in indices], [self.labels[i] for i in indices])

    def shared_prefixes(self) -> list[tuple[int, list[int]]]:
        """(prefix length, rows) for each label whose rows (two or more) all begin with the same
        MIN_SHARED_PREFIX or more tokens: the longest prefix they share. What an engine with a prefix
        cache or a static prompt can compute once; W3's groups, never W1's or W2's random prompts. Groups
        in order of first arrival, rows in arrival order. Found once per workload (the peers ask inside
        their timed runs)."""
        return self._prefix_groups

    @functools.cached_property
    def _prefix_groups(self) -> list[tuple[int, list[int]]]:
        groups: dict[str, list[int]] = {}
        for i, label in enumerate(self.labels):
            groups.setdefault(label, []).append(i)
        out = []
        for rows in groups.values():
            if len(rows) < 2:
                continue
            first = self.prompts[rows[0]]
            shared = min(shared_prefix_len(first, self.prompts[i]) for i in rows[1:])
            if shared >= MIN_SHARED_PREFIX:
                out.append((shared, rows))
        return out

    def with_fresh_prefixes(self, seed: int) -> Workload:
        """The same rows with each shared prefix (`shared_prefixes`) redrawn from `seed`: output and
        suffix lengths unchanged, so repeats of a timed run each meet prefixes no engine has cached."""
        rng = random.Random(f"{self.name}:fresh:{seed}")
        vocab = max(t for p in self.prompts for t in p) + 1
        prompts = [list(p) for p in self.prompts]
        for length, rows in self.shared_prefixes():
            prefix = _tokens(rng, vocab, length)
            for i in rows:
                prompts[i][:length] = prefix
        return Workload(self.name, self.description, prompts, list(self.max_new_tokens), list(self.labels))


@dataclass(frozen=True)
class WorkloadSizes:
    """How big each workload is; `QUICK` keeps `--quick` within a few minutes on 2 shared CPU cores.

    Length ranges are inclusive (lo, hi). The sizes shrink the work, never the mix or the spread."""

    rows: int
    short: tuple[int, int]
    medium: tuple[int, int]
    long: tuple[int, int]
    output: tuple[int, int]
    equal_prompt: int
    equal_output: int
    group_rows: int
    groups: int
    prefix: int
    suffix: tuple[int, int]
    fewshot_output: tuple[int, int]

    def __post_init__(self) -> None:
        if self.group_rows < MIN_GROUP_ROWS:
            raise ValueError(f"few-shot groups need >= {MIN_GROUP_ROWS} rows, got {self.group_rows}")
        if self.prefix / (self.prefix + self.suffix[1]) < MIN_SHARED_FRACTION:
            raise ValueError(f"a {self.prefix}-token prefix is under {MIN_SHARED_FRACTION:.0%} of a prompt "
                             f"with a {self.suffix[1]}-token suffix")

    @property
    def max_prompt_len(self) -> int:
        return max(self.long[1], self.equal_prompt, self.prefix + self.suffix[1])

    @property
    def max_output_len(self) -> int:
        return max(self.output[1], self.equal_output, self.fewshot_output[1])


QUICK = WorkloadSizes(rows=16, short=(8, 32), medium=(48, 112), long=(160, 224), output=(8, 24),
                      equal_prompt=64, equal_output=16, group_rows=16, groups=1, prefix=96, suffix=(8, 32),
                      fewshot_output=(4, 8))
FULL = WorkloadSizes(rows=48, short=(16, 64), medium=(128, 256), long=(384, 512), output=(16, 96),
                     equal_prompt=192, equal_output=48, group_rows=16, groups=3, prefix=192, suffix=(16, 64),
                     fewshot_output=(4, 16))


def _tokens(rng: random.Random, vocab_size: int, n: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN, vocab_size) for _ in range(n)]


def class_counts(rows: int) -> dict[str, int]:
    """Rows per W1 length class: short and long rounded from the mix, medium takes the rest."""
    short, long = round(rows * MIX[0][1]), round(rows * MIX[2][1])
    return {"short": short, "medium": rows - short - long, "long": long}


def mixed_intake(sizes: WorkloadSizes, vocab_size: int, seed: int = 0) -> Workload:
    rng = random.Random(f"W1:{seed}")
    ranges = {"short": sizes.short, "medium": sizes.medium, "long": sizes.long}
    labels = [name for name, count in class_counts(sizes.rows).items() for _ in range(count)]
    rng.shuffle(labels)  # arrival order: classes interleave at random
    prompts = [_tokens(rng, vocab_size, rng.randint(*ranges[label])) for label in labels]
    outputs = [rng.randint(*sizes.output) for _ in labels]
    return Workload("W1", "mixed intake: ~30/50/20 % short/medium/long prompts, varied outputs",
                    prompts, outputs, labels)


def equal_lengths(sizes: WorkloadSizes, vocab_size: int, seed: int = 0) -> Workload:
    rng = random.Random(f"W2:{seed}")
    prompts = [_tokens(rng, vocab_size, sizes.equal_prompt) for _ in range(sizes.rows)]
    return Workload("W2", f"equal lengths: {sizes.equal_prompt}-token prompts, {sizes.equal_output} new tokens",
                    prompts, [sizes.equal_output] * sizes.rows, ["equal"] * sizes.rows)


def few_shot(sizes: WorkloadSizes, vocab_size: int, seed: int = 0) -> Workload:
    rng = random.Random(f"W3:{seed}")
    prompts, outputs, labels = [], [], []
    for group in range(sizes.groups):
        prefix = _tokens(rng, vocab_size, sizes.prefix)
        for _ in range(sizes.group_rows):
            prompts.append(prefix + _tokens(rng, vocab_size, rng.randint(*sizes.suffix)))
            outputs.append(rng.randint(*sizes.fewshot_output))
            labels.append(f"group{group}")
    return Workload("W3", f"few-shot: {sizes.groups} group(s) of {sizes.group_rows} rows sharing a "
                    f"{sizes.prefix}-token prefix, short outputs", prompts, outputs, labels)


def build_all(sizes: WorkloadSizes, vocab_size: int, seed: int = 0) -> dict[str, Workload]:
    """W1, W2, W3 for one model's vocabulary."""
    return {w.name: w for w in (mixed_intake(sizes, vocab_size, seed), equal_lengths(sizes, vocab_size, seed),
                                few_shot(sizes, vocab_size, seed))}


def shared_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
