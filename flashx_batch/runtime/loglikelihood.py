"""Log-likelihoods on the engine: continuations given a context, whole texts (rolling), multiple choice.

Who calls it: `Engine.loglikelihood`, `Engine.loglikelihood_rolling`, `Engine.choice_logprobs` /
`multiple_choice`, and the job workers of `task: loglikelihood | multiple_choice | perplexity`.
Requests are encoded by lm-evaluation-harness's rules (`runtime.lm_requests`) and scored by the
runner's teacher-forced pass (`Scorer.target_logprobs`: no KV cache, float32 log_softmax of the
picked positions only).

How requests become forward passes:

- Every request becomes a *row*: its model input `fit(ctx, cont)` and the positions whose logits
  score its continuation tokens. Rows with the same input are computed once (lm-eval's one-token
  multiple-choice cache is the common case: the same context, one-token continuations).
- Rows are sorted longest first and cut into batches of at most `batch_tokens` tokens (and `max_rows`
  rows). Where the runner `packs_rows`, a batch is one pass over its rows end to end, no padding
  (`PackedTrees`); otherwise one right-padded pass (padded tokens counted), padding what sorting leaves.
- Multiple choice: a row holds the context ONCE followed by every choice (its last token dropped:
  nothing reads its logits), a *token tree* — each choice attends to the context and to its own
  earlier tokens, at positions continuing from the context's end (`TeacherForced.visible`). One pass
  scores all choices of the row; a choice's first token is scored by the context's last position.
  Where the choices do not share one context (an empty context whose choices start with the prefix
  token) or one would be left-truncated, the row's choices are scored as plain rows instead.
- Rolling log-likelihoods: each text's windows (`lm_requests.rolling_windows`) are plain rows whose
  sums add into the text's total.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch

from flashx_batch.models.config import ModelConfig
from flashx_batch.runtime.lm_requests import LMEncoder, TokenPair, fit, rolling_windows
from flashx_batch.runtime.runner import ModelRunner

BATCH_TOKENS = 8192  # padded tokens per forward pass
MAX_ROWS = 256


@dataclass
class ChoiceScores:
    """One multiple-choice item: per choice, the continuation's log-probability, whether every token
    is the argmax, its token count and `logprobs_norm` = logprob / the choice's length in characters
    (lm-eval's `acc_norm`: `len(choice)` of the choice string without the target delimiter; the token
    count for choices given as token ids). `pred` / `pred_norm`: the first index of the largest."""

    logprobs: list[float]
    is_greedy: list[bool]
    num_tokens: list[int]
    logprobs_norm: list[float]

    @property
    def pred(self) -> int:
        return _argmax(self.logprobs)

    @property
    def pred_norm(self) -> int:
        return _argmax(self.logprobs_norm)


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i)) if values else -1


@dataclass
class _Row:
    tokens: list[int]
    pick: list[int] = field(default_factory=list)  # token index in the row whose logits score ...
    target: list[int] = field(default_factory=list)  # ... this token id ...
    requests: list[tuple[int, int]] = field(default_factory=list)  # (request, picks): consecutive picks per request
    positions: list[int] | None = None  # token trees: each token's position; None: 0..n-1
    segment: list[int] | None = None  # token trees: 0 the context, j + 1 choice j (attends to 0 and itself)


class LogLikelihood:
    """The scorer of one engine (built once by `Engine.lm` from its parts: this module never imports
    the engine).

    `runner` scores the rows (`target_logprobs`, and `packed_target_logprobs` where it `packs_rows`);
    `tokenizer` (None: token-id requests only) and `model_dir` (named when text needs a tokenizer);
    `max_length`: tokens the model sees per request, the engine's max_input_len (lm-eval's
    `max_length`)."""

    def __init__(self, runner: ModelRunner, config: ModelConfig, tokenizer: Any, model_dir: str, max_length: int,
                 batch_tokens: int = BATCH_TOKENS, max_rows: int = MAX_ROWS) -> None:
        self.runner, self.config, self.tokenizer, self.model_dir = runner, config, tokenizer, model_dir
        self.max_length = max_length
        self.batch_tokens, self.max_rows = batch_tokens, max_rows
        self.pad_id = config.pad_token_id or 0
        self._encoder: LMEncoder | None = None

    @property
    def encoder(self) -> LMEncoder:
        if self._encoder is None:
            if self.tokenizer is None:
                raise ValueError(f"{self.model_dir}/tokenizer.json is missing, so text cannot be tokenized; "
                                 "pass token-id lists instead.")
            self._encoder = LMEncoder.for_tokenizer(self.tokenizer)
        return self._encoder

    @property
    def prefix_token_id(self) -> int:
        if self.tokenizer is not None:
            return self.encoder.prefix_token_id
        cfg = self.config
        prefix = cfg.bos_token_id if cfg.bos_token_id is not None else (cfg.eos_token_ids or (None,))[0]
        if prefix is None:
            raise ValueError("the model names neither a BOS nor an EOS token to condition an empty context on")
        return prefix

    # ---- encoding ---------------------------------------------------------------------------
    def encode_pairs(self, pairs: Sequence[tuple[str | Sequence[int], str | Sequence[int]]]) -> list[TokenPair]:
        """Text pairs by lm-eval's rules; token-id pairs as given (an empty context: the prefix token)."""
        texts = [i for i, (c, x) in enumerate(pairs) if isinstance(c, str) or isinstance(x, str)]
        out: list[TokenPair] = [([], []) for _ in pairs]
        if texts:
            bad = [i for i in texts if not (isinstance(pairs[i][0], str) and isinstance(pairs[i][1], str))]
            if bad:
                raise TypeError(f"pair {bad[0]} mixes text and token ids; give both as text or both as token ids")
            encoded = self.encoder.pairs([pairs[i][0] for i in texts], [pairs[i][1] for i in texts])
            for i, pair in zip(texts, encoded, strict=True):
                out[i] = pair
        for i, (c, x) in enumerate(pairs):
            if not (isinstance(c, str) or isinstance(x, str)):
                ctx = [int(t) for t in c]
                out[i] = (ctx or [self.prefix_token_id], [int(t) for t in x])
        return out

    # ---- scoring ----------------------------------------------------------------------------
    def score_pairs(self, pairs: Sequence[TokenPair], max_length: int | None = None
                    ) -> tuple[list[float], list[bool]]:
        """Token pairs -> (log-probability of each continuation, is it the greedy continuation)."""
        limit = max_length or self.max_length
        rows: dict[tuple[int, ...], _Row] = {}
        for r, (ctx, cont) in enumerate(pairs):
            _check_pair(r, ctx, cont, limit)
            inp = fit(ctx, cont, limit)
            row = rows.get(key := tuple(inp))
            if row is None:
                row = rows[key] = _Row(inp)
            first = len(inp) - len(cont)
            row.pick.extend(range(first, len(inp)))
            row.target.extend(cont)
            row.requests.append((r, len(cont)))
        return self._score(list(rows.values()), len(pairs))

    def score_rolling(self, token_lists: Sequence[Sequence[int]], max_length: int | None = None) -> list[float]:
        """Each text's tokens -> its rolling log-likelihood (the sum over its windows)."""
        limit = max_length or self.max_length
        rows: list[_Row] = []
        for r, tokens in enumerate(token_lists):
            for ctx, cont in rolling_windows(list(tokens), self.prefix_token_id, limit):
                inp = fit(ctx, cont, limit)
                first = len(inp) - len(cont)
                rows.append(_Row(inp, list(range(first, len(inp))), list(cont), [(r, len(cont))]))
        return self._score(rows, len(token_lists))[0]

    def score_choices(self, items: Sequence[Sequence[TokenPair]], max_length: int | None = None
                      ) -> list[tuple[list[float], list[bool]]]:
        """Per item, its choices as (context, continuation) token pairs -> per choice (logprob, is_greedy).
        Choices sharing one context that fits untruncated are scored in one token-tree row (module doc)."""
        limit = max_length or self.max_length
        rows: list[_Row] = []
        plain: list[tuple[int, TokenPair]] = []
        offsets, n = [], 0
        for item in items:
            offsets.append(n)
            for j, (ctx, cont) in enumerate(item):
                _check_pair(n + j, ctx, cont, limit)
            shared = all(ctx == item[0][0] for ctx, _ in item)
            fits = all(len(ctx) + len(cont) <= limit + 1 for ctx, cont in item)
            ctx = item[0][0] if item else []
            size = len(ctx) + sum(len(cont) - 1 for _, cont in item)
            if item and shared and fits and size <= self.batch_tokens:
                rows.append(self._tree_row(ctx, [cont for _, cont in item], n))
            else:
                plain.extend((n + j, pair) for j, pair in enumerate(item))
            n += len(item)
        for r, (ctx, cont) in plain:
            inp = fit(ctx, cont, limit)
            first = len(inp) - len(cont)
            rows.append(_Row(inp, list(range(first, len(inp))), list(cont), [(r, len(cont))]))
        logprobs, greedy = self._score(rows, n)
        return [(logprobs[o : o + len(item)], greedy[o : o + len(item)])
                for o, item in zip(offsets, items, strict=True)]

    @staticmethod
    def _tree_row(ctx: list[int], conts: list[list[int]], first_request: int) -> _Row:
        c = len(ctx)
        row = _Row(list(ctx), positions=list(range(c)), segment=[0] * c)
        for j, cont in enumerate(conts):
            start = len(row.tokens)  # where this choice's tokens (all but its last) begin in the row
            body = cont[:-1]
            row.tokens.extend(body)
            row.positions.extend(range(c, c + len(body)))
            row.segment.extend([j + 1] * len(body))
            row.pick.append(c - 1)
            row.pick.extend(range(start, start + len(body)))
            row.target.extend(cont)
            row.requests.append((first_request + j, len(cont)))
        return row

    def _score(self, rows: list[_Row], n_requests: int) -> tuple[list[float], list[bool]]:
        """Each request's log-probability: its tokens' float32 log-probabilities summed in float32 (one
        `torch.sum` per request, as lm-eval sums them, so equal inputs give bitwise equal sums); the parts
        of one request in several rows (rolling windows) then add in float64, as lm-eval adds floats."""
        total = torch.zeros(n_requests, dtype=torch.float64)
        missed = torch.zeros(n_requests, dtype=torch.bool)
        rows = sorted(rows, key=lambda r: -len(r.tokens))
        packed = getattr(self.runner, "packs_rows", False)
        for trees in (False, True):
            group = [r for r in rows if (r.segment is not None) == trees]
            for batch in self._batches(group, packed):
                if packed:
                    logprobs, greedy = self.runner.packed_target_logprobs(*self._packed_tensors(batch))
                else:
                    ids, pick, target, positions, visible = self._tensors(batch, trees)
                    logprobs, greedy = self.runner.target_logprobs(ids, pick, target, positions, visible)
                parts = [p for r in batch for p in r.requests]
                request = torch.tensor([q for q, _ in parts], dtype=torch.long)
                counts = [n for _, n in parts]
                sums = torch.stack([part.sum() for part in logprobs.split(counts)])
                total.index_add_(0, request, sums.double())
                missed[request[~torch.stack([part.all() for part in greedy.split(counts)])]] = True
        return total.tolist(), (~missed).tolist()

    def _batches(self, rows: list[_Row], packed: bool = False) -> list[list[_Row]]:
        """Rows (longest first) cut into batches of at most `max_rows` rows and `batch_tokens` tokens:
        padded tokens (the first row sets the width), or with `packed` the rows' own tokens."""
        batches: list[list[_Row]] = []
        used = 0
        for row in rows:
            n = len(row.tokens)
            if batches and len(batches[-1]) < self.max_rows and \
                    (used + n if packed else (len(batches[-1]) + 1) * len(batches[-1][0].tokens)) <= self.batch_tokens:
                batches[-1].append(row)
                used += n
            else:
                batches.append([row])
                used = n
        return batches

    @staticmethod
    def _packed_tensors(batch: list[_Row]):
        """A batch end to end, no padding: (ids [N], row lengths, pick [M] into N, targets [M],
        positions [N], per row its non-causal queries and their mask, or None) — `PackedTrees`."""
        lengths = tuple(len(r.tokens) for r in batch)
        starts = [0]
        for n in lengths[:-1]:
            starts.append(starts[-1] + n)
        ids = torch.tensor(list(chain.from_iterable(r.tokens for r in batch)), dtype=torch.long)
        pick = torch.tensor(list(chain.from_iterable((s + p for p in r.pick) for s, r in zip(starts, batch))),
                            dtype=torch.long)
        target = torch.tensor(list(chain.from_iterable(r.target for r in batch)), dtype=torch.long)
        positions = torch.tensor(list(chain.from_iterable(range(len(r.tokens)) if r.positions is None else r.positions
                                                          for r in batch)), dtype=torch.long)
        trees = tuple(_tree_queries(r) for r in batch)
        return ids, lengths, pick, target, positions, trees

    def _tensors(self, batch: list[_Row], trees: bool):
        width = len(batch[0].tokens)
        lengths = torch.tensor([len(r.tokens) for r in batch])
        starts = lengths.cumsum(0) - lengths
        row_of = torch.repeat_interleave(torch.arange(len(batch)), lengths)
        col_of = torch.arange(int(lengths.sum())) - torch.repeat_interleave(starts, lengths)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        ids[row_of, col_of] = torch.tensor(list(chain.from_iterable(r.tokens for r in batch)), dtype=torch.long)
        pick = torch.tensor(list(chain.from_iterable((b * width + p for p in r.pick) for b, r in enumerate(batch))),
                            dtype=torch.long)
        target = torch.tensor(list(chain.from_iterable(r.target for r in batch)), dtype=torch.long)
        if not trees:
            return ids, pick, target, None, None
        positions = torch.zeros((len(batch), width), dtype=torch.long)
        positions[row_of, col_of] = torch.tensor(list(chain.from_iterable(r.positions for r in batch)))
        segment = torch.full((len(batch), width), -1, dtype=torch.long)  # padding: -1
        segment[row_of, col_of] = torch.tensor(list(chain.from_iterable(r.segment for r in batch)))
        seg_q, seg_k = segment[:, :, None], segment[:, None, :]
        # a query sees the context (segment 0) and its own segment, at positions up to its own
        visible = ((seg_k == 0) | (seg_k == seg_q)) & (positions[:, None, :] <= positions[:, :, None])
        visible &= seg_k >= 0
        visible |= torch.eye(width, dtype=torch.bool)[None]  # padding queries see themselves (no empty rows)
        return ids, pick, target, positions, visible


def _tree_queries(row: _Row) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A token-tree row's queries that a causal mask would not serve — the tokens of its second and
    later choices — with what they see: the context (segment 0) and their own choice's tokens up to
    themselves -> (row-local indices [n], visible [n, len] bool); None for a plain row or one choice."""
    if row.segment is None:
        return None
    segment = torch.tensor(row.segment)
    idx = torch.nonzero(segment >= 2).flatten()
    if not len(idx):
        return None
    keys = torch.arange(len(row.segment))
    seg_q = segment[idx, None]
    visible = (segment[None, :] == 0) | ((segment[None, :] == seg_q) & (keys[None, :] <= idx[:, None]))
    return idx, visible


def _check_pair(index: int, ctx: list[int], cont: list[int], limit: int) -> None:
    if not ctx:
        raise ValueError(f"request {index}: the context has no tokens (a whitespace-only context encodes to none); "
                         "give some context, or an empty string to condition on the prefix token")
    if not cont:
        raise ValueError(f"request {index}: the continuation has no tokens")
    if len(cont) > limit:
        raise ValueError(f"request {index}: the continuation has {len(cont)} tokens, more than max_length={limit}")
