"""What the parity tests share: seeded prompts, the engine they compare, `transformers`' greedy
continuation, and the check that a row's tokens do not depend on its batch or position."""

from __future__ import annotations

import contextlib

import torch

from flashx_batch import Engine, SamplingParams


def prompts(seed: int, lengths: tuple[int, ...], vocab: int = 256) -> list[list[int]]:
    """Random token-id prompts (ids 0-2 are pad / bos / eos and never drawn)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def cpu_engine(model_dir, **kw) -> Engine:
    """The float32 CPU engine the parity tests run: batch 4, rows of up to 64 + 48 tokens."""
    opts = dict(backend="cpu", dtype="float32", max_batch_size=4, max_input_len=64, max_output_len=48, segment_size=16)
    return Engine.from_pretrained(model_dir, **{**opts, **kw})


@contextlib.contextmanager
def stable_topk():
    """`torch.Tensor.topk` with ties taken in index order (the earliest first) inside the block: the tie
    rule of our DSA indexer (`models.mla.top_keys`), for `transformers`' GLM-5 as a reference. Plain
    `topk` leaves ties to the kernel, whose CPU choice depends on the row's width, so `transformers`'
    cached and uncached forwards pick different keys at the indexer's ReLU zeros; with this rule they
    agree (docs/architecture.md, "DSA: the indexer's semantics")."""
    plain = torch.Tensor.topk

    def topk(self, k, dim=-1, largest=True, sorted=True):
        values, indices = self.sort(dim=dim, descending=largest, stable=True)
        return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))

    torch.Tensor.topk = topk
    try:
        yield
    finally:
        torch.Tensor.topk = plain


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """`transformers`' greedy continuation of `prompt`, `n` tokens, EOS ignored."""
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def assert_batch_and_position_independent(engine: Engine, target: list[int], others: list[list[int]]) -> list[int]:
    """`target`'s tokens alone equal its tokens at every position of a batch with `others`; returns them."""
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    alone = engine.generate([target], params)[0].token_ids
    for pos in range(4):
        batch = others[:pos] + [target] + others[pos : pos + 3 - pos]
        assert engine.generate(batch, params)[pos].token_ids == alone
    return alone
