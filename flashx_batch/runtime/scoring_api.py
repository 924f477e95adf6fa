"""`ScoringApi`: the engine's methods that score or pool instead of generating — `loglikelihood`,
`loglikelihood_rolling`, `choice_logprobs`, `multiple_choice`, `embed`, `classify`, `score` — kept
apart from `runtime.engine`, whose `Engine` inherits them, so that each file stays one subject.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from flashx_batch.errors import ConfigError
from flashx_batch.kvcache.geometry import ArenaGeometry
from flashx_batch.models.config import ModelConfig
from flashx_batch.runtime import pooling
from flashx_batch.runtime.checkpoint_pooling import CheckpointPooling, UnsupportedPooling
from flashx_batch.runtime.loglikelihood import ChoiceScores, LogLikelihood
from flashx_batch.runtime.options import EngineOptions
from flashx_batch.runtime.pooling import Classification, Pooler, PoolingConfig, classifications
from flashx_batch.runtime.runner import ModelRunner
from flashx_batch.runtime.tokenizer import Tokenizer


class ScoringApi:
    """Mixed into `Engine`, which sets these attributes."""

    model_dir: Path
    config: ModelConfig
    run_options: EngineOptions
    runner: ModelRunner
    tokenizer: Tokenizer | None
    geometry: ArenaGeometry
    _lm: LogLikelihood | None
    _own_pooling: CheckpointPooling | UnsupportedPooling | None  # the checkpoint's own head, or why not
    encode: Callable[[str | list[int]], list[int]]

    # ---- log-likelihoods (runtime/loglikelihood.py; encoding rules: runtime/lm_requests.py) -----
    def _need_lm_head(self, what: str) -> None:
        if self.config.classifier is not None:
            raise ConfigError(f"{self.model_dir.name} is a sequence classifier (a score head over "
                              f"{self.config.classifier.num_labels} labels, no LM head): it cannot {what}; use "
                              "classify (task=classify) or embed.")

    @property
    def lm(self) -> LogLikelihood:
        """The log-likelihood scorer (built on first use)."""
        self._need_lm_head("score log-likelihoods")
        if self._lm is None:
            self._lm = LogLikelihood(self.runner, self.config, self.tokenizer, str(self.model_dir),
                                     self.run_options.max_input_len)
        return self._lm

    def loglikelihood(self, pairs: Sequence[tuple[str | Sequence[int], str | Sequence[int]]],
                      max_length: int | None = None) -> list[tuple[float, bool]]:
        """(logprob, is_greedy) of each continuation given its context, as lm-evaluation-harness's
        Hugging Face backend (`HFLM.loglikelihood`) computes them.

        A pair is two strings or two token-id lists. Text is encoded by HFLM's rules: the context's
        trailing whitespace moves onto the continuation; `context + continuation` is encoded whole
        (the tokenizer's default special tokens, none when the text starts with the prefix token) and
        the continuation's tokens are what follows `encode(context)`'s length; an empty context is the
        prefix token (BOS, else EOS) and the continuation is then encoded without special tokens (if
        its first token is the prefix token, that token is the context). The model sees the last
        `max_length` tokens of `(context + continuation)[:-1]` (left-truncated); the logits at the last
        len(continuation) positions score the continuation, log_softmax in float32; `is_greedy` is
        True when every continuation token is the argmax there. `max_length` defaults to the engine's
        max_input_len (lm-eval's defaults to the model's context length: pass `max_length` to both to
        compare). Details: runtime/lm_requests.py."""
        return list(zip(*self.lm.score_pairs(self.lm.encode_pairs(pairs), max_length), strict=True))

    def loglikelihood_rolling(self, texts: Sequence[str | Sequence[int]], max_length: int | None = None
                              ) -> list[float]:
        """Each text's log-likelihood in windows of `max_length` tokens (default: max_input_len), as
        `HFLM.loglikelihood_rolling` computes it: the text encoded whole, the prefix token before its
        first window, each later window conditioned on the tokens just before it
        (`get_rolling_token_windows(context_len=1)` + `make_disjoint_window`); the sum over windows.
        Token-id lists are scored as given."""
        lists = [list(t) if not isinstance(t, str) else None for t in texts]
        strings = [i for i, t in enumerate(texts) if isinstance(t, str)]
        if strings:
            for i, ids in zip(strings, self.lm.encoder.encode([texts[i] for i in strings]), strict=True):
                lists[i] = ids
        return self.lm.score_rolling(lists, max_length)

    def choice_logprobs(self, items: Sequence[tuple[str | Sequence[int], Sequence[str | Sequence[int]]]],
                        delimiter: str = "", max_length: int | None = None) -> list[ChoiceScores]:
        """Multiple choice: for each (context, choices) item, every choice's `loglikelihood(context,
        delimiter + choice)`, raw and divided by len(choice) in characters (lm-eval's `acc_norm`;
        `delimiter` is its `target_delimiter`, " " in most tasks). The context is computed once per
        item: one forward pass holds the context followed by every choice as a token tree (see
        runtime/loglikelihood.py)."""
        flat_pairs, sizes = [], []
        for context, choices in items:
            sizes.append(len(choices))
            for choice in choices:
                flat_pairs.append((context, delimiter + choice if isinstance(choice, str) else choice))
        encoded = self.lm.encode_pairs(flat_pairs)
        grouped, o = [], 0
        for n in sizes:
            grouped.append(encoded[o : o + n])
            o += n
        out = []
        for (_, choices), pairs, (logprobs, greedy) in zip(items, grouped, self.lm.score_choices(grouped, max_length),
                                                           strict=True):
            lengths = [len(c) if isinstance(c, str) else len(p[1]) for c, p in zip(choices, pairs, strict=True)]
            out.append(ChoiceScores(logprobs, greedy, [len(p[1]) for p in pairs],
                                    [lp / n if n else float("-inf") for lp, n in zip(logprobs, lengths, strict=True)]))
        return out

    def multiple_choice(self, context: str | Sequence[int], choices: Sequence[str | Sequence[int]],
                        delimiter: str = "", max_length: int | None = None) -> ChoiceScores:
        """`choice_logprobs` for one item."""
        return self.choice_logprobs([(context, choices)], delimiter, max_length)[0]

    def embed(self, prompts: list[str] | list[list[int]], pooling: str | None = None, normalize: bool | None = None,
              dimensions: int | None = None) -> torch.Tensor:
        """[len(prompts), D] float32 embeddings: the final hidden state pooled (`last`, `mean` or `cls`), the
        first `dimensions` components, unit length when `normalize` (`runtime/pooling.py`). None: the
        checkpoint's own sentence-transformers pooling where it ships one, else `last`, normalized."""
        own = self._own_pooling
        if isinstance(own, UnsupportedPooling):
            raise own
        config = PoolingConfig(pooling or (own.pooling if own else "last"),
                               normalize if normalize is not None else (own.normalize if own else True), dimensions)
        config.check(own.width(self.config.hidden_size) if own else self.config.hidden_size)
        return self._pooler().embed(self._fitted(prompts), config, own.dense if own else ())

    def classify(self, prompts: list[str] | list[list[int]]) -> list[Classification]:
        """A sequence classifier's (`*ForSequenceClassification`: reward models, classifiers) logits at each
        prompt's last token, with probabilities and the top label (`runtime/pooling.py`)."""
        if self.config.classifier is None:
            raise ConfigError(f"{self.model_dir.name} is not a sequence classifier (config.json names "
                              f"{self.config.architecture}); classify needs a *ForSequenceClassification checkpoint.")
        c = self.config.classifier
        return classifications(self._pooler().classify(self._scored(prompts)), c.labels, c.multi_label)

    def score_pairs(self, pairs: Sequence[tuple[str, str]], format: str = "separator", separator: str = "\n",
                    template_kwargs: dict | None = None) -> list[float]:
        """A cross-encoder's score of each (query, document) pair: a one-label sequence classifier (a reranker,
        a reward model) reading the pair as `pooling.pair_text` writes it (`format="chat"`: the chat template,
        query as the user's turn, document as the assistant's), its logit at the last token."""
        self._one_label_head()
        if self.tokenizer is None:
            raise ConfigError(f"{self.model_dir}/tokenizer.json is missing; score_pairs reads text pairs.")
        texts = [pooling.pair_text(q, d, format, separator, self.tokenizer, template_kwargs) for q, d in pairs]
        return self.scores(self.tokenizer.encode_batch(texts, add_special_tokens=format != "chat"))  # templates: BOS

    def scores(self, prompts: list[str] | list[list[int]]) -> list[float]:
        """A one-label sequence classifier's (a reranker's, a reward model's) logit for each prompt (token ids, or
        text encoded with the tokenizer's BOS): what `score_pairs` and task=score compute for written pairs."""
        self._one_label_head()
        return self._pooler().classify(self._scored(prompts))[:, 0].tolist()

    def _one_label_head(self) -> None:
        c = self.config.classifier
        if c is None or c.num_labels != 1:
            what = f"{c.num_labels} labels" if c is not None else self.config.architecture
            raise ConfigError(f"scores need a one-label sequence classifier (a reranker or reward model); "
                              f"{self.model_dir.name} is {what}: use classify for its labels.")

    def _scored(self, prompts: list[str] | list[list[int]]) -> list[list[int]]:
        """Prompts as a classifier's score head reads them: `transformers` scores the last token that is not
        the pad id (a template ending in the pad token, e.g. pad = eos, is scored one token earlier); causal
        attention makes trailing pad tokens irrelevant to the positions before them, so they are dropped."""
        fitted, pad = self._fitted(prompts), self.config.pad_token_id
        if pad is None:
            return fitted
        out = []
        for ids in fitted:
            end = len(ids)
            while end > 1 and ids[end - 1] == pad:
                end -= 1
            out.append(ids[:end])
        return out

    def _fitted(self, prompts: list[str] | list[list[int]]) -> list[list[int]]:
        return pooling.pooled_prompts([self.encode(p) for p in prompts], self.run_options, self.config.vocab_size)

    def _pooler(self) -> Pooler:
        scorer = getattr(self.runner, "scorer", None)
        if scorer is None:
            raise ConfigError(f"embed and classify need every position's hidden states, which "
                              f"{type(self.runner).__name__} does not expose; use a torch backend with "
                              "tensor_parallel_size=1.")
        return Pooler(scorer, self.geometry.base_rows * self.run_options.max_input_len)

    @torch.inference_mode()
    def score(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """Teacher-forced float32 logits [T_i, V] for each whole sequence (quality measurements, parity
        tests). Sequences are never truncated or merged: each must fit a row of the arena."""
        capacity = self.geometry.row_capacity
        too_long = [i for i, p in enumerate(prompts) if not 0 < len(p) <= capacity]
        if too_long:
            raise ConfigError(f"score: sequences {too_long[:5]} are empty or longer than a row of the KV arena "
                              f"({capacity} tokens); raise max_input_len + max_output_len.")
        out: list[torch.Tensor] = []
        size = self.geometry.base_rows
        for start in range(0, len(prompts), size):
            out.extend(self.runner.score(prompts[start : start + size]))
        return out
