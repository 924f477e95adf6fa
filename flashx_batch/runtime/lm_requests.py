"""Log-likelihood requests as token ids, encoded as lm-evaluation-harness's Hugging Face backend does.

Who calls it: `runtime.loglikelihood` (the engine's `loglikelihood`, `loglikelihood_rolling`,
`choice_logprobs`) and `data.plan` (token counts of scoring jobs at planning). Plain Python: no torch,
so the job planner can use it without loading a model.

The rules, as `lm_eval.models.huggingface.HFLM` (0.4.x) applies them (`TemplateLM.loglikelihood`,
`_encode_pair`, `tok_encode`, `_loglikelihood_tokens`, `utils.get_rolling_token_windows`):

- *Encoding a string* (`tok_encode`): the tokenizer's own default for special tokens
  (`add_special_tokens=True`: a BOS where the tokenizer's post-processor adds one), except that a
  string already starting with the prefix token's text is encoded without special tokens.
- *A (context, continuation) pair*: trailing whitespace of the context moves to the front of the
  continuation; then `whole = encode(context + continuation)`, `ctx = encode(context)`, and the
  continuation's tokens are `whole[len(ctx):]` (the whole string is encoded once and split, so a
  token spanning the boundary is not cut in two).
- *An empty context*: the continuation is encoded without special tokens and the context is the
  prefix token (the tokenizer's BOS id, else its EOS id); when the continuation's first token *is*
  the prefix token, that token becomes the context instead.
- *Truncation*: the model sees `(ctx + cont)[-(max_length + 1):][:-1]` (left-truncated), and the
  logits at its last `len(cont)` positions score the continuation's tokens; a continuation longer
  than `max_length` tokens cannot be scored.
- *Rolling* (`loglikelihood_rolling`): the whole text is encoded (`tok_encode`) and cut into windows
  of at most `max_length` predicted tokens; the first window is the prefix token plus the text's
  first `max_length - 1` tokens and predicts the first `max_length`; every later window predicts the
  next `max_length` (or fewer, at the end) tokens with the tokens just before them as context, up to
  `max_length` inputs in all (`context_len=1`, then `make_disjoint_window`). The text's log-likelihood
  is the sum over the windows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flashx_batch.runtime.tokenizer import Tokenizer

TokenPair = tuple[list[int], list[int]]  # (context ids, continuation ids)


@dataclass
class LMEncoder:
    """lm-eval's encoding rules over our tokenizer (see the module doc)."""

    tokenizer: Tokenizer
    prefix_token_id: int

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, prefix_token_id: int | None = None) -> LMEncoder:
        """`prefix_token_id` None: the tokenizer's BOS id, else its EOS id (HFLM's `prefix_token_id`)."""
        if prefix_token_id is None:
            bos = tokenizer.token_to_id(tokenizer.bos_token) if tokenizer.bos_token else None
            prefix_token_id = bos if bos is not None else tokenizer.eos_token_id
        if prefix_token_id is None:
            raise ValueError("the tokenizer has neither a BOS nor an EOS token to condition an empty context on; "
                             "pass prefix_token_id")
        return cls(tokenizer, int(prefix_token_id))

    @property
    def prefix_text(self) -> str:
        return self.tokenizer.decode([self.prefix_token_id], skip_special_tokens=False)

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """`tok_encode` of each text, batched (one tokenizer call per special-token setting); a text
        given more than once (a multiple-choice context, once per choice) is encoded once."""
        unique = list(dict.fromkeys(texts))
        if len(unique) < len(texts):
            ids = dict(zip(unique, self._encode(unique), strict=True))
            return [list(ids[t]) for t in texts]
        return self._encode(texts)

    def _encode(self, texts: Sequence[str]) -> list[list[int]]:
        prefix = self.prefix_text
        plain = [i for i, t in enumerate(texts) if not (prefix and t.startswith(prefix))]
        marked = [i for i, t in enumerate(texts) if prefix and t.startswith(prefix)]
        out: list[list[int]] = [[] for _ in texts]
        for idx, special in ((plain, True), (marked, False)):
            if idx:
                for i, ids in zip(idx, self.tokenizer.encode_batch([texts[i] for i in idx], special), strict=True):
                    out[i] = ids
        return out

    def pairs(self, contexts: Sequence[str], continuations: Sequence[str]) -> list[TokenPair]:
        """(context ids, continuation ids) of each text pair, by lm-eval's rules (module doc)."""
        whole_texts, ctx_texts, empty = [], [], []
        for i, (context, continuation) in enumerate(zip(contexts, continuations, strict=True)):
            if context == "":
                empty.append(i)
                continue
            stripped = context.rstrip()
            moved = context[len(stripped):]
            whole_texts.append(stripped + moved + continuation)
            ctx_texts.append(stripped)
        encoded = self.encode(whole_texts + ctx_texts)
        wholes, ctxs = encoded[: len(whole_texts)], encoded[len(whole_texts):]
        bare = self.tokenizer.encode_batch([continuations[i] for i in empty], False) if empty else []
        out: list[TokenPair] = []
        j = k = 0
        for i in range(len(contexts)):
            if k < len(empty) and empty[k] == i:
                cont = bare[k]
                k += 1
                if cont and cont[0] == self.prefix_token_id:
                    out.append((cont[:1], cont[1:]))
                else:
                    out.append(([self.prefix_token_id], cont))
                continue
            ctx = ctxs[j]
            out.append((ctx, wholes[j][len(ctx):]))
            j += 1
        return out


def fit(context: list[int], continuation: list[int], max_length: int) -> list[int]:
    """The model's input for a pair: `(ctx + cont)[-(max_length + 1):][:-1]` (its last len(cont)
    positions' logits score `cont`)."""
    return (context + continuation)[-(max_length + 1):][:-1]


def rolling_windows(tokens: list[int], prefix_token_id: int, max_length: int) -> list[TokenPair]:
    """The disjoint (context, continuation) windows of a text's tokens (module doc, *Rolling*)."""
    if not tokens:
        return []
    first = min(max_length, len(tokens))
    windows: list[TokenPair] = [([prefix_token_id], tokens[:first])]  # disjoint form of prefix + tokens[:first-1]
    done = first
    while done < len(tokens):
        n = min(len(tokens) - done, max_length)
        end = done + n
        inputs = tokens[max(0, end - max_length - 1) : end - 1]
        windows.append((inputs[: len(inputs) - (n - 1)], tokens[end - n : end]))
        done = end
    return windows
