"""Parity over a grid of shapes, not one. The other parity tests share one tiny shape (hidden 64, 4 heads, 2 KV
heads, vocabulary 256): here each dense family gets shapes drawn with a fixed seed from what real checkpoints
vary — head counts and GQA ratios from multi-query (1 KV head) to multi-head, head widths that are not powers
of two, vocabularies that are not, 1 to 3 layers — and prompts that end just before, on and just after a KV
segment boundary, batched together.

- float32: greedy tokens equal `transformers`' `generate` on the same weights; one case runs 200 new tokens.
- bfloat16 end to end against `transformers` in bfloat16: teacher-forced top-1 agreement (bf16 rounding
  differs between the two implementations' kernels, so identity is not the claim; the figure is).
"""

from __future__ import annotations

import random

import pytest
import torch
from model_factory import ARCHS, build
from parity_support import cpu_engine, hf_greedy, prompts

from flashx_batch.runtime.params import SamplingParams

GRID_SEED = 20261205
SHAPES_PER_FAMILY = 2
SEGMENT = 16  # the parity engine's KV segment: prompts end on both sides of it
LENGTHS = (SEGMENT - 1, SEGMENT, SEGMENT + 1, 2 * SEGMENT + 1, 3)


def draw_shapes(family: str) -> list[dict]:
    """`SHAPES_PER_FAMILY` configs for `family`, the same on every run (seeded by the family's name)."""
    rng = random.Random(f"{GRID_SEED}-{family}")
    shapes = []
    for i in range(SHAPES_PER_FAMILY):
        # the attention kind rotates over the grid (multi-query, grouped, multi-head); the sizes are drawn
        kind = ("mqa", "gqa", "mha")[(ARCHS.index(family) * SHAPES_PER_FAMILY + i) % 3]
        heads = rng.choice((4, 6, 8) if kind == "gqa" else (2, 3, 4, 6, 8))
        grouped = [d for d in range(2, heads) if heads % d == 0]
        kv_heads = {"mqa": 1, "mha": heads}.get(kind) or rng.choice(grouped)
        head_dim = rng.choice((12, 20, 24, 40))  # a multiple of 4: GLM rotates half of each head in pairs
        # the hidden width apart from heads x head width on every other shape (Qwen3, Gemma and GLM ship such)
        # (still a multiple of the head count: transformers' configs require it)
        hidden = heads * (head_dim if i % 2 == 0 else rng.choice([w for w in (8, 16, 28, 32) if w != head_dim]))
        shapes.append(dict(num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                           hidden_size=hidden, intermediate_size=8 * rng.randint(8, 24),
                           num_hidden_layers=rng.randint(1, 3), vocab_size=rng.choice((250, 301, 383, 509)),
                           max_position_embeddings=512))
    return shapes


GRID = [(family, i, shape) for family in ARCHS for i, shape in enumerate(draw_shapes(family))]


def _ids(case) -> str:
    family, i, s = case
    return (f"{family}-{i}-h{s['num_attention_heads']}kv{s['num_key_value_heads']}d{s['head_dim']}"
            f"-L{s['num_hidden_layers']}-V{s['vocab_size']}")


def test_the_grid_covers_what_real_checkpoints_vary():
    shapes = [s for _, _, s in GRID]
    assert any(s["num_key_value_heads"] == 1 for s in shapes)  # multi-query
    assert any(s["num_key_value_heads"] == s["num_attention_heads"] > 1 for s in shapes)  # multi-head
    assert any(1 < s["num_key_value_heads"] < s["num_attention_heads"] for s in shapes)  # grouped
    assert any(s["head_dim"] & (s["head_dim"] - 1) for s in shapes)  # not a power of two
    assert all(s["vocab_size"] & (s["vocab_size"] - 1) for s in shapes)
    assert len({s["num_hidden_layers"] for s in shapes}) > 1
    assert any(s["hidden_size"] != s["num_attention_heads"] * s["head_dim"] for s in shapes)


@pytest.mark.parametrize("case", GRID, ids=[_ids(c) for c in GRID])
def test_greedy_tokens_equal_transformers_across_shapes(tmp_path, one_thread, case):
    family, index, shape = case
    hf = build(family, tmp_path, seed=index, **shape)
    vocab = shape["vocab_size"]
    long_case = family == ARCHS[0] and index == 0  # one case runs 200 new tokens
    new = 200 if long_case else 24
    engine = cpu_engine(tmp_path, max_input_len=48, max_output_len=new, segment_size=SEGMENT)
    batch = prompts(index + 11, LENGTHS[:2] if long_case else LENGTHS, vocab)
    got = [o.token_ids for o in engine.generate(batch, SamplingParams(max_new_tokens=new, ignore_eos=True))]
    assert got == [hf_greedy(hf, p, new) for p in batch]


@pytest.mark.parametrize("family", ["llama", "qwen3", "glm4"])
def test_bfloat16_end_to_end_agrees_with_transformers_in_bfloat16(tmp_path, one_thread, family):
    """Teacher-forced over 4 sequences of 40 tokens: our bfloat16 engine's next-token choice against
    `transformers` run in bfloat16 on the same weights; and both against float32, for scale."""
    shape = draw_shapes(family)[0]
    hf = build(family, tmp_path, seed=3, **shape)
    rows = prompts(23, (40,) * 4, shape["vocab_size"])
    ours = cpu_engine(tmp_path, dtype="bfloat16").score(rows)
    with torch.no_grad():
        ref32 = [hf(torch.tensor([r])).logits[0] for r in rows]
        hf16 = hf.to(torch.bfloat16)
        ref16 = [hf16(torch.tensor([r])).logits[0].float() for r in rows]
    agree = sum((a.argmax(-1) == b.argmax(-1)).sum().item() for a, b in zip(ours, ref16, strict=True))
    agree32 = sum((a.argmax(-1) == b.argmax(-1)).sum().item() for a, b in zip(ref16, ref32, strict=True))
    total = sum(len(r) for r in rows)
    print(f"bfloat16 top-1 agreement {family}: ours vs transformers {agree / total:.4f}, transformers bf16 vs fp32 "
          f"{agree32 / total:.4f}")
    assert agree / total >= 0.95, (agree / total, agree32 / total)
    # ours agrees with transformers' bfloat16 at least as well as that agrees with its own float32, less a margin
    assert agree / total >= agree32 / total - 0.03, (agree / total, agree32 / total)
