"""The on-device sampler (the parameters are plain data in `runtime.params`).

Randomness is *stateless*: the Gumbel noise for (row seed, generation step, token id) comes from an
integer hash computed on the device. A row's samples therefore depend only on its own seed and
logits — not on which other rows share its batch, their order, or how many batches ran before —
and no per-row `torch.Generator` loop runs on the host. Gumbel-max with exact noise samples from
the softmax it perturbs, which the frequency test checks.

Logprobs (`SamplingParams.logprobs=K`) are the *raw* model distribution: log-softmax in float32 of the
logits `sample` was given, before temperature, top-k or top-p (as vLLM returns them by default, and
as a scorer comparing against the model expects). For a constrained row that is still the model's own
distribution, before the grammar's mask: a token's logprob says how much the model wanted it, and an
allowed token the model found unlikely shows as such. `host_tokens` fetches a step's tokens, and when some
row of the batch asked for logprobs, their logprobs and the batch's top-K alternatives in the same
single transfer; with logprobs off it is the plain `tolist()` of the tokens, nothing more.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashx_batch.runtime.grammar import apply_masks
from flashx_batch.runtime.params import SamplingParams

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B] seeds, [B] steps -> [B, vocab] float32 uniforms in (0, 1), a pure function of its inputs."""
    row = _mix32((seeds & _M32) ^ _mix32(((seeds >> 32) & _M32) ^ 0x9E3779B9))
    row = _mix32(row ^ (steps & _M32))[:, None]
    tokens = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)[None, :]
    bits = _mix32(_mix32(row ^ tokens) ^ 0x6D2B79F5)
    return ((bits >> 8).float() + 0.5) * (2.0**-24)


@dataclass
class SamplingBatch:
    """Per-row sampling knobs as device tensors, built once per batch, compacted with the batch."""

    temperature: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64, vocab size when off
    top_p: torch.Tensor  # [B] float32
    seeds: torch.Tensor  # [B] int64
    greedy: torch.Tensor  # [B] bool
    all_greedy: bool
    any_filter: bool
    logprobs: int = 0  # the most top-K alternatives any row asked for (0: no row wants logprobs)

    @classmethod
    def build(cls, params: list[SamplingParams], vocab_size: int, device: torch.device) -> SamplingBatch:
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            seeds=torch.tensor([p.seed for p in params], dtype=torch.int64, device=device),
            greedy=torch.tensor([p.greedy for p in params], dtype=torch.bool, device=device),
            all_greedy=all(p.greedy for p in params),
            any_filter=any(k < vocab_size for k in top_k) or any(p.top_p < 1.0 for p in params),
            logprobs=max((p.wants_logprobs for p in params), default=0),
        )

    def select(self, rows: torch.Tensor) -> SamplingBatch:
        return SamplingBatch(self.temperature[rows], self.top_k[rows], self.top_p[rows], self.seeds[rows],
                             self.greedy[rows], self.all_greedy, self.any_filter, self.logprobs)

    def extend(self, other: SamplingBatch) -> SamplingBatch:
        """These rows followed by `other`'s (a row admitted into a running batch)."""
        return SamplingBatch(*(torch.cat((a, b)) for a, b in ((self.temperature, other.temperature),
                                                              (self.top_k, other.top_k), (self.top_p, other.top_p),
                                                              (self.seeds, other.seeds),
                                                              (self.greedy, other.greedy))),
                             all_greedy=self.all_greedy and other.all_greedy,
                             any_filter=self.any_filter or other.any_filter,
                             logprobs=max(self.logprobs, other.logprobs))


def sample(logits: torch.Tensor, batch: SamplingBatch, steps: torch.Tensor,
           masks: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] float32, steps [B] (tokens generated so far per row) -> token ids [B]. `masks`: the
    step's allowed tokens as a [B, ceil(V / 32)] int32 bitmask on the device (constrained rows,
    `runtime.grammar`); a disallowed token is never chosen, greedy or sampled."""
    if masks is not None:
        logits = apply_masks(logits, masks)
    greedy_tokens = logits.max(dim=-1).indices  # first maximum, as argmax, at a quarter of its CPU time
    if batch.all_greedy:
        return greedy_tokens
    vocab = logits.shape[-1]
    scaled = logits / batch.temperature.clamp_min(1e-6)[:, None]
    gumbel = -torch.log(-torch.log(uniform_noise(batch.seeds, steps, vocab)))
    if batch.any_filter:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        drop = ranks >= batch.top_k[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop = drop | (mass_before >= batch.top_p[:, None])
        drop[:, 0] = False  # the most likely token always survives
        perturbed = sorted_logits.masked_fill(drop, float("-inf")) + gumbel.gather(1, order)
        sampled = order.gather(1, perturbed.argmax(dim=-1, keepdim=True)).squeeze(1)
    else:
        sampled = (scaled + gumbel).argmax(dim=-1)
    return torch.where(batch.greedy, greedy_tokens, sampled)


StepTokens = tuple[list[int], list[float] | None, list[list[tuple[int, float]]] | None]


def host_tokens(logits: torch.Tensor, tokens: torch.Tensor, batch: SamplingBatch) -> StepTokens:
    """A step's sampled `tokens` [B] on the host: (token ids, chosen-token logprobs, top-K (id, logprob)
    per row, most likely first). Logprobs off for the whole batch: (ids, None, None) and no other work.
    On: one [B, 2 + 2K] float64 tensor (ids and logprobs are exact in it) crosses to the host once;
    every row gets the batch's K (the scheduler trims each row to its own)."""
    if not batch.logprobs:
        return tokens.tolist(), None, None
    k = min(batch.logprobs, logits.shape[-1])
    logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)
    top = logprobs.topk(k, dim=-1)  # sorted, most likely first
    rows = torch.cat((tokens[:, None].double(), logprobs.gather(1, tokens[:, None]).double(),
                      top.values.double(), top.indices.double()), dim=1).tolist()
    ids = [int(r[0]) for r in rows]
    return ids, [r[1] for r in rows], [list(zip(map(int, r[2 + k:]), r[2 : 2 + k])) for r in rows]
