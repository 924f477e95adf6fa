"""The Triton decode kernel for rows in extents, run on the CPU by Triton's interpreter (`TRITON_INTERPRET=1`,
which must be set before the kernel is defined: each check runs in a fresh process): the kernel against
torch's attention, and a CPU engine decoding through it against the same engine decoding through its own
kernels (tokens equal). The GPU run of the same kernel is `tests/device`'s."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

KERNEL_CASES = """
import torch
from flashx_batch.backends.attention import triton_decode as td
g = torch.Generator().manual_seed(0)
cases = [(2, 2, 64, torch.float32), (1, 4, 32, torch.float32), (2, 3, 48, torch.float32), (4, 1, 64, torch.bfloat16)]
for heads, group, dim, dtype in cases:
    slots = 400
    keys = torch.randn(slots, heads, dim, generator=g).to(dtype)
    values = torch.randn(slots, heads, dim, generator=g).to(dtype)
    # a row of one slot, rows longer than a block, rows starting mid-block, the cache's last slot
    starts, lengths = torch.tensor([0, 100, 37, 250, 399]), torch.tensor([1, 150, 63, 149, 1])
    q = torch.randn(5, heads, group, dim, generator=g).to(dtype)
    got = td.attend_extents(q, keys, values, starts, lengths, 0.125)
    want = td.reference(q, keys, values, starts, lengths, 0.125)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert got.dtype == dtype and got.shape == q.shape
    assert torch.allclose(got.float(), want.float(), atol=tolerance, rtol=tolerance), (heads, group, dim, dtype)
    # a slot outside every row's extent changes nothing
    keys[20] = 1e4  # slots 1-36 lie in no extent
    assert torch.equal(td.attend_extents(q, keys, values, starts, lengths, 0.125), got)
print("ok")
"""

ENGINE_TOKENS = """
import sys
from flashx_batch import Engine, SamplingParams
from flashx_batch.backends.attention import triton_decode
from flashx_batch.backends.attention.registry import registered

prompts = [[5 + (i * 7 + j) % 50 for j in range(6 + 9 * i)] for i in range(4)]
params = [SamplingParams(max_new_tokens=6 + 3 * i, ignore_eos=True) for i in range(4)]

def tokens():
    engine = Engine.from_pretrained(sys.argv[1], backend="cpu", dtype="float32", max_batch_size=2, max_input_len=64,
                                    max_output_len=24, segment_size=16, kv_layout="extents")
    assert engine.uses_extents
    return [out.token_ids for out in engine.generate(prompts, params)]

own = tokens()
calls = []
kernel = triton_decode.attend_extents
triton_decode.attend_extents = lambda *a: calls.append(1) or kernel(*a)
with registered(triton_decode.DecodeTriton, device_type="cpu"):
    through_triton = tokens()
assert len(calls) >= 4, "the decode steps did not read through the Triton kernel"  # the probe is one call
assert through_triton == own, (through_triton, own)
print("ok")
"""


def _run(code: str, *args: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0 and done.stdout.split()[-1:] == ["ok"], done.stderr[-3000:]


def test_the_kernel_reads_each_row_to_its_own_length_as_torch_does():
    _run(KERNEL_CASES)


def test_an_engine_decoding_through_the_kernel_generates_its_own_tokens(tiny_models):
    _run(ENGINE_TOKENS, str(tiny_models["llama"][0]))
