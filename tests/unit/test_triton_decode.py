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
# paged rows: positions looked up in a slot table, a mask as a bias (a first block wholly hidden, a hole, a tilt)
keys, values = torch.randn(300, 2, 64, generator=g), torch.randn(300, 2, 64, generator=g)
table = torch.stack([torch.randperm(300, generator=g)[:150] for _ in range(4)])
lengths, starts = torch.tensor([150, 1, 80, 130]), torch.zeros(4, dtype=torch.long)
bias = torch.zeros(4, 150)
bias[0, :70] = float("-inf")
bias[2, 5:9] = float("-inf")
bias[3, 100:] = -2.5
q = torch.randn(4, 2, 2, 64, generator=g)
got = td.attend_extents(q, keys, values, starts, lengths, 0.125, table=table, bias=bias)
want = td.reference(q, keys, values, starts, lengths, 0.125, table=table, bias=bias)
assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
mask = bias[:, None, None, :] > float("-inf")  # a boolean mask reads as the bias it keeps
from flashx_batch.backends import cpu_decode
assert torch.equal(cpu_decode.bias_rows(mask, 4, 150)[0, :70], torch.full((70,), float("-inf")))
print("ok")
"""

ENGINE_TOKENS = """
import sys
from flashx_batch import Engine, SamplingParams
from flashx_batch.backends.attention import triton_decode
from flashx_batch.backends.attention.registry import registered

layout = sys.argv[2]
prompts = [[5 + (i * 7 + j) % 50 for j in range(6 + 9 * i)] for i in range(4)]
prompts += [prompts[3][:18] + [7, 9, 11]]  # shares whole segments with a batch-mate: a paged batch
params = [SamplingParams(max_new_tokens=6 + 3 * i, ignore_eos=True) for i in range(5)]
options = dict(kv_layout="extents") if layout == "extents" else dict(prefix_cache_tokens=64)

def tokens():
    engine = Engine.from_pretrained(sys.argv[1], backend="cpu", dtype="float32", max_batch_size=2, max_input_len=64,
                                    max_output_len=24, segment_size=8, **options)
    assert engine.uses_extents == (layout == "extents")
    return [out.token_ids for out in engine.generate(prompts, params)]

own = tokens()
calls = []
kernel = triton_decode.attend_extents
triton_decode.attend_extents = lambda *a, **k: calls.append(k.get("table") is not None) or kernel(*a, **k)
with registered(triton_decode.DecodeTriton, triton_decode.PagedTriton, device_type="cpu"):
    through_triton = tokens()
assert calls.count(layout == "pages") >= 4, f"the decode steps did not read through the Triton kernel: {calls}"
assert through_triton == own, (through_triton, own)
print("ok")
"""


def _run(code: str, *args: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0 and done.stdout.split()[-1:] == ["ok"], done.stderr[-3000:]


def test_the_kernel_reads_each_row_to_its_own_length_as_torch_does():
    _run(KERNEL_CASES)


@pytest.mark.parametrize("layout", ["extents", "pages"])
def test_an_engine_decoding_through_the_kernel_generates_its_own_tokens(tiny_models, layout):
    """Rows in extents, and a paged batch (shared prefix segments read through slot tables, masks as biases)."""
    _run(ENGINE_TOKENS, str(tiny_models["llama"][0]), layout)
