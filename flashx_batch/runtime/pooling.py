"""Embeddings: the final hidden state (after the final norm) of each prompt, pooled into one vector.

Pooling: `last` (the last token's state: the decoder-embedding default of Qwen3-Embedding, gte-Qwen,
e5-mistral), `mean` (over the prompt's tokens) or `cls` (the first token's). Then Matryoshka `dimensions`
(the first D components) and `normalize` (unit L2 norm), in that order, as sentence-transformers does.

A prompt is prefill only: no KV is kept. Prompts are sorted by length and cut into packs of at most
`pack_tokens` tokens, each pack one teacher-forced pass with its rows end to end and no padding
(`PackedTrees`), where the model's attention packs rows (`Scorer.packs_rows`); otherwise right-padded
rows (each row attends to its own tokens only: causal attention never looks at the padding after it).

A checkpoint's own head (sentence-transformers' `modules.json`: its pooling, Dense layers, Normalize) is
read by `runtime.checkpoint_pooling`; `Pooler.embed` applies its Dense layers after pooling.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from flashx_batch.backends.attention.meta import PackedTrees, TeacherForced
from flashx_batch.errors import ConfigError
from flashx_batch.runtime.inputs import fit_prompts

POOLINGS = ("last", "mean", "cls")


@dataclass(frozen=True)
class PoolingConfig:
    pooling: str = "last"
    normalize: bool = True
    dimensions: int | None = None  # Matryoshka: keep the first D components (None: all)

    def check(self, hidden_size: int) -> None:
        if self.pooling not in POOLINGS:
            raise ConfigError(f"pooling={self.pooling!r}: one of {', '.join(POOLINGS)}.")
        if self.dimensions is not None and not 0 < self.dimensions <= hidden_size:
            raise ConfigError(f"dimensions={self.dimensions}: the model's vectors have {hidden_size} components; "
                              f"give 1..{hidden_size} (or null for all).")


def pooled_prompts(ids: list[list[int]], options, vocab_size: int) -> list[list[int]]:
    """Prompts for a pooled pass, checked as `inputs.fit_prompts` checks them; a long one keeps its head under
    long_input=truncate (its instruction prefix and first token: what `cls` pooling reads), not its tail as
    generation does."""
    if options.long_input != "error":
        ids = [p[: options.max_input_len] for p in ids]
    return fit_prompts(ids, options, vocab_size)[0]


@dataclass
class Classification:
    """One prompt through a sequence classifier: the score head's logits at its last token, their
    probabilities (softmax; a one-label head, a reward model's, gets the sigmoid) and the top label."""

    logits: list[float]
    probs: list[float]
    label: str
    index: int


def classifications(logits: torch.Tensor, labels: tuple[str, ...], multi_label: bool = False) -> list[Classification]:
    """`multi_label` (config.json `problem_type: multi_label_classification`): each label's own sigmoid."""
    probs = logits.sigmoid() if logits.shape[-1] == 1 or multi_label else logits.softmax(dim=-1)
    top = logits.argmax(dim=-1).tolist()
    return [Classification(lg, pr, labels[i], i) for lg, pr, i in zip(logits.tolist(), probs.tolist(), top)]


PAIR_FORMATS = ("separator", "chat")


def pair_text(query: str, document: str, fmt: str, separator: str, tokenizer, template_kwargs: dict | None = None
              ) -> str:
    """The text a cross-encoder (a reranker, a reward model) reads for a (query, document) pair: `separator`
    between the two, or (`chat`) the model's chat template rendering the query as the user's turn and the
    document as the assistant's, without a generation prompt (how reward models read a prompt and an answer).
    Raises ValueError (`ChatTemplateError`) when the template refuses the turns; `template_kwargs`: extra
    template variables (data.chat_template_kwargs)."""
    if fmt == "chat":
        return tokenizer.apply_chat_template([{"role": "user", "content": query},
                                              {"role": "assistant", "content": document}],
                                             add_generation_prompt=False, **(template_kwargs or {}))
    if fmt != "separator":
        raise ConfigError(f"pair format {fmt!r}: one of {', '.join(PAIR_FORMATS)}.")
    return query + separator + document


class Pooler:
    """Embeds token lists through a `Scorer`'s model (its passes, rotary table and packing ability)."""

    def __init__(self, scorer, pack_tokens: int) -> None:
        self.scorer, self.pack_tokens = scorer, max(1, pack_tokens)

    @torch.inference_mode()
    def classify(self, prompts: list[list[int]]) -> torch.Tensor:
        """[len(prompts), num_labels] float32 logits of the score head at each prompt's last token."""
        model = self.scorer.model
        return model.logits(self._pooled(prompts, "last").to(model.embed.dtype)).float().cpu()

    @torch.inference_mode()
    def embed(self, prompts: list[list[int]], config: PoolingConfig, dense: Sequence[Callable] = ()) -> torch.Tensor:
        """[len(prompts), D] float32 vectors on the host, in the prompts' order; `dense`: the checkpoint's Dense
        layers, applied after pooling (before the Matryoshka cut and normalising, as sentence-transformers)."""
        vectors = self._pooled(prompts, config.pooling)
        for layer in dense:
            vectors = layer(vectors)
        if config.dimensions is not None:
            vectors = vectors[:, : config.dimensions]
        if config.normalize:
            vectors = torch.nn.functional.normalize(vectors, dim=-1)
        return vectors.cpu()

    def _pooled(self, prompts: list[list[int]], pooling: str) -> torch.Tensor:
        """[len(prompts), hidden] float32 pooled final hidden states on the model's device, in the prompts'
        order: packs of rows sorted by length."""
        if any(not p for p in prompts):
            raise ConfigError(f"embed: prompt {next(i for i, p in enumerate(prompts) if not p)} has no tokens.")
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        out: list[torch.Tensor | None] = [None] * len(prompts)
        start = 0
        padded = not self.scorer.packs_rows  # a padded pack costs rows x its longest row (the last, sorted)
        while start < len(order):
            end, tokens = start, 0
            while end < len(order):
                n = len(prompts[order[end]])
                cost = (end - start + 1) * n if padded else tokens + n
                if end > start and cost > self.pack_tokens:
                    break
                tokens += n
                end += 1
            rows = [prompts[i] for i in order[start:end]]
            for i, vector in zip(order[start:end], self._pool(rows, pooling)):
                out[i] = vector
            start = end
        return torch.stack(out)

    def _pool(self, rows: list[list[int]], pooling: str) -> torch.Tensor:
        s = self.scorer
        lengths = [len(r) for r in rows]
        if s.packs_rows:
            ids = torch.tensor([t for r in rows for t in r], dtype=torch.long, device=s.device)
            positions = torch.cat([torch.arange(n) for n in lengths]).to(s.device)[None]
            cos, sin = s._rotary(positions, max(lengths))
            hidden = s.model.hidden_states(ids[None], PackedTrees(cos, sin, tuple(lengths), (None,) * len(rows)))[0]
            starts = torch.tensor([0, *lengths[:-1]]).cumsum(0).tolist()
            spans = [hidden[a : a + n] for a, n in zip(starts, lengths)]
        else:
            width = max(lengths)
            ids = torch.full((len(rows), width), s.pad_id, dtype=torch.long)
            for i, r in enumerate(rows):
                ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            cos, sin = s._rotary(s.passes.arange(width)[None, :], width)
            hidden = s.model.hidden_states(ids.to(s.device), TeacherForced(cos, sin))
            spans = [hidden[i, :n] for i, n in enumerate(lengths)]
        pick = {"last": lambda h: h[-1], "mean": lambda h: h.float().mean(0), "cls": lambda h: h[0]}[pooling]
        return torch.stack([pick(h).float() for h in spans])
