"""Decode steps at CUDA-graph shapes (`runtime.decode_graphs`), checked on CPU without capturing:
the padding rows, the padded slots and the mask must leave every row's tokens as the eager steps
give them. Capture and replay themselves run in tests/device (a GPU)."""

import pytest
import torch

from flashx_batch import Engine, SamplingParams
from flashx_batch.config import JobConfig
from flashx_batch.errors import ConfigError
from flashx_batch.runtime.decode_graphs import SLOT_BUCKET, DecodeGraphs, rows_bucket, slots_bucket


def _engine(model_dir, **kw):
    opts = dict(backend="cpu", dtype="float32", max_batch_size=4, max_input_len=64, max_output_len=48,
                segment_size=16, kv_layout="stripes", sort_by_length=False)
    opts.update(kw)
    return Engine.from_pretrained(model_dir, **opts)


def _workload():
    g = torch.Generator().manual_seed(11)
    lengths = (12, 40, 5, 33, 64, 9, 21, 50, 3, 17, 28)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (30, 1, 12, 40, 6, 25, 2, 18, 33, 9, 14)]
    params[3] = SamplingParams(max_new_tokens=40, temperature=0.8, top_k=20, seed=5, ignore_eos=True)
    return prompts, params


@pytest.mark.parametrize(("arch", "policy"), [("llama", "static"), ("glm4", "static"), ("qwen3", "segment_sparse")])
def test_padded_static_steps_give_the_eager_tokens(arch, policy, tiny_models, one_thread):
    """Rows padded to a bucket (padding rows decode in free stripes), slots padded past the longest
    row and always masked, merged rows' bias carried (segment_sparse): tokens equal the eager steps'."""
    model_dir, _ = tiny_models[arch]
    prompts, params = _workload()
    eager = _engine(model_dir, cache_policy=policy)
    expected = [(o.token_ids, o.finish_reason) for o in eager.generate(prompts, params)]
    graphed = _engine(model_dir, cache_policy=policy)
    runner = graphed.runner
    runner.graphs = DecodeGraphs(runner, capture=False)
    shapes = []
    step = runner._step

    def recording(tokens, positions, write_flat, mask, runs):
        shapes.append((len(tokens), mask.shape[-1], runs, int(positions.max()) + 1))
        return step(tokens, positions, write_flat, mask, runs)

    runner._step = recording
    got = [(o.token_ids, o.finish_reason) for o in graphed.generate(prompts, params)]
    assert got == expected
    assert graphed.last_stats.decode_steps == eager.last_stats.decode_steps == len(shapes)
    assert runner.graphs.steps == len(shapes) and runner.graphs.padding_rows > 0
    # every step ran at a bucketed shape (`test_buckets`): one run over all its rows, slots a multiple of SLOT_BUCKET or
    # the whole stripe, read past the longest row's position (unmerged rows: masked padding slots)
    for rows, slots, runs, longest in shapes:
        assert runs == ((0, rows, 0, runs[0][3], slots, False),)
        assert slots % SLOT_BUCKET == 0 or slots == runs[0][3]
        assert slots >= longest or policy == "segment_sparse"  # merged rows hold fewer slots than positions
    if policy == "static":
        assert any(slots > longest for _, slots, _, longest in shapes)
    assert graphed.runner.arena.allocator.is_whole()


def test_buckets():
    assert [rows_bucket(n, 64) for n in (1, 2, 3, 5, 8, 9, 16, 17, 33, 64)] == [1, 2, 4, 8, 8, 16, 16, 32, 48, 64]
    assert rows_bucket(5, 6) == 6 and rows_bucket(20, 24) == 24  # never past the stripes there are
    assert slots_bucket(1, 640) == SLOT_BUCKET and slots_bucket(SLOT_BUCKET + 1, 640) == 2 * SLOT_BUCKET
    assert slots_bucket(600, 624) == 624  # never past the stripe
    with pytest.raises(ValueError, match="do not fit"):
        rows_bucket(9, 8)
    with pytest.raises(ValueError, match="do not fit"):
        slots_bucket(641, 640)


def test_cuda_graphs_option(tiny_models):
    model_dir, _ = tiny_models["llama"]
    assert _engine(model_dir).runner.graphs is None  # auto: the CPU backend captures no graphs
    with pytest.raises(ConfigError, match=r"runtime.cuda_graphs=on needs a backend .* runs on cpu"):
        _engine(model_dir, cuda_graphs="on")
    with pytest.raises(ConfigError, match="runtime.cuda_graphs='always' is not one of auto, on, off"):
        _engine(model_dir, cuda_graphs="always")
    job = JobConfig()
    job.runtime.cuda_graphs = "off"
    assert job.engine_options().cuda_graphs == "off"
