"""Decode steps at CUDA-graph shapes (`runtime.decode_graphs`), checked on CPU without capturing:
the padding rows, the padded slots and the mask must leave every row's tokens as the eager steps
give them. Capture and replay themselves run in tests/device (a GPU)."""

import logging

import pytest
import torch

from flashx_batch import Engine, SamplingParams
from flashx_batch.backends.cpu import CpuBackend
from flashx_batch.config import JobConfig
from flashx_batch.errors import ConfigError
from flashx_batch.runtime import decode_graphs
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
    runner.passes.graphs = DecodeGraphs(runner.passes, capture=False)
    shapes = []
    step = runner.passes.step_hidden

    def recording(tokens, positions, write_flat, mask, runs, *rest, **kw):
        shapes.append((len(tokens), mask.shape[-1], runs, int(positions.max()) + 1))
        return step(tokens, positions, write_flat, mask, runs, *rest, **kw)

    runner.passes.step_hidden = recording
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
    assert graphed.scheduler.allocator.is_whole()


def test_buckets():
    assert [rows_bucket(n, 64) for n in (1, 2, 3, 5, 8, 9, 16, 17, 33, 64)] == [1, 2, 4, 8, 8, 16, 16, 32, 48, 64]
    assert rows_bucket(5, 6) == 6 and rows_bucket(20, 24) == 24  # never past the stripes there are
    assert slots_bucket(1, 640) == SLOT_BUCKET and slots_bucket(SLOT_BUCKET + 1, 640) == 2 * SLOT_BUCKET
    assert slots_bucket(600, 624) == 624  # never past the stripe
    # past 1024: an eighth of the next power of two, so padding stays under a quarter of the reads
    assert [slots_bucket(n, 8192) for n in (1024, 1025, 2049, 4000)] == [1024, 1280, 2560, 4096]
    assert all(slots_bucket(n, 8192) < 1.25 * n for n in range(SLOT_BUCKET * 4 + 1, 8192, 7))
    with pytest.raises(ValueError, match="do not fit"):
        rows_bucket(9, 8)
    with pytest.raises(ValueError, match="do not fit"):
        slots_bucket(641, 640)


def test_cuda_graphs_option(tiny_models):
    model_dir, _ = tiny_models["llama"]
    assert _engine(model_dir).runner.graphs is None  # auto: the CPU backend captures no graphs
    with pytest.raises(ConfigError, match=r"runtime.cuda_graphs=on: decode graphs need a backend .* runs on cpu"):
        _engine(model_dir, cuda_graphs="on")
    with pytest.raises(ConfigError, match="runtime.cuda_graphs='always' is not one of auto, on, off"):
        _engine(model_dir, cuda_graphs="always")
    job = JobConfig()
    job.runtime.cuda_graphs = "off"
    assert job.engine_options().cuda_graphs == "off"


class _StandInGraph:
    """What a captured graph does, on CPU: replay reruns the captured step (its static inputs, its
    shape and the RoPE table fixed at capture) into the output returned at capture."""

    def __init__(self, runner, fn):
        self.runner, self.fn, self.rotary = runner, fn, runner.model.rotary
        self.output = fn().clone()

    def replay(self):
        assert self.runner.model.rotary is self.rotary, "a graph replayed after its RoPE table was replaced"
        self.output.copy_(self.fn())


class _StandInBackend(CpuBackend):
    """A backend that captures `_StandInGraph`s (or raises RuntimeError once `fail_after` graphs exist),
    so `DecodeGraphs` runs its capture and replay path — keys, static inputs copied in, the output read
    back, one pool handed from capture to capture — as on a GPU."""

    supports_graphs = True

    def __init__(self, runner, fail_after: int | None = None):
        self.runner, self.fail_after, self.captures, self.pools = runner, fail_after, 0, []

    def capture_graph(self, fn, pool=None):
        if self.fail_after is not None and self.captures >= self.fail_after:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.captures += 1
        self.pools.append(pool)
        fn()  # the warm-up
        graph = _StandInGraph(self.runner, fn)
        return graph, graph.output, pool if pool is not None else object()


def _with_stand_in_graphs(engine, fail_after: int | None = None):
    """Give `engine` capturing DecodeGraphs whose backend captures stand-in graphs."""
    backend = _StandInBackend(engine.runner, fail_after)
    graphs = engine.runner.passes.graphs = DecodeGraphs(engine.runner.passes, capture=True, backend=backend)
    return graphs


LONG = dict(max_input_len=200, max_output_len=120)  # stripes of 320 slots: real slot buckets below them


@pytest.mark.parametrize(("arch", "policy"), [("llama", "static"), ("qwen3", "segment_sparse")])
def test_replayed_graphs_give_the_eager_tokens(arch, policy, tiny_models, one_thread):
    """Graphs captured once per (rows, capacity, slots) and replayed with each step's inputs copied
    in: tokens equal the eager steps', several shapes share the steps, slot buckets fall below the
    stripe, and every step came from a graph."""
    model_dir, _ = tiny_models[arch]
    prompts, params = _workload()
    # a long row last in arrival order keeps the stripes long (cut for the longest row still queued)
    prompts.append(list(range(3, 153)))
    params.append(SamplingParams(max_new_tokens=60, ignore_eos=True))
    expected = [o.token_ids for o in _engine(model_dir, cache_policy=policy, **LONG).generate(prompts, params)]
    engine = _engine(model_dir, cache_policy=policy, **LONG)
    graphs = _with_stand_in_graphs(engine)
    assert [o.token_ids for o in engine.generate(prompts, params)] == expected
    assert graphs.replays == graphs.steps == engine.last_stats.decode_steps
    assert 2 <= len(graphs.graphs) < graphs.replays  # graphs were replayed, not only captured
    assert any(slots < cap for _, cap, slots in graphs.graphs)
    pools = graphs.backend.pools  # the first capture makes the pool, every later one shares it
    assert pools[0] is None and pools[1:] == [graphs.pool] * (len(pools) - 1)
    assert engine.scheduler.allocator.is_whole()


def test_a_failed_capture_leaves_every_step_to_the_eager_path(tiny_models, caplog, one_thread):
    model_dir, _ = tiny_models["llama"]
    prompts, params = _workload()
    expected = [o.token_ids for o in _engine(model_dir, **LONG).generate(prompts, params)]
    engine = _engine(model_dir, **LONG)
    graphs = _with_stand_in_graphs(engine, fail_after=1)
    with caplog.at_level(logging.WARNING, logger=decode_graphs.__name__):
        assert [o.token_ids for o in engine.generate(prompts, params)] == expected
    assert graphs.failed and not graphs.graphs
    assert 1 <= graphs.replays == graphs.steps < engine.last_stats.decode_steps  # the rest: eager, own shape
    assert "decode steps run eagerly from now on" in caplog.text and "stream is capturing" in caplog.text


def test_past_max_graphs_new_shapes_run_eagerly(tiny_models, monkeypatch, one_thread):
    model_dir, _ = tiny_models["llama"]
    prompts, params = _workload()
    expected = [o.token_ids for o in _engine(model_dir, **LONG).generate(prompts, params)]
    monkeypatch.setattr(decode_graphs, "MAX_GRAPHS", 2)
    engine = _engine(model_dir, **LONG)
    graphs = _with_stand_in_graphs(engine)
    assert [o.token_ids for o in engine.generate(prompts, params)] == expected
    assert len(graphs.graphs) == 2 and graphs.steps == graphs.replays < engine.last_stats.decode_steps


def test_graphs_are_dropped_when_a_rolling_merge_grows_the_rope_table(tiny_models, one_thread):
    """A long prompt rolled in segments grows the RoPE table; graphs captured before read the old
    one, so they must be dropped (the stand-in asserts no stale graph replays); tokens equal eager."""
    model_dir, _ = tiny_models["llama"]
    # fixed stripes (batch_growth=1): both batches step at the same shapes, so stale graphs would be found
    opts = dict(long_input="rolling_merge", kv_observe_window=8, max_input_len=96, max_output_len=16, batch_growth=1)
    g = torch.Generator().manual_seed(5)
    long_prompt = torch.randint(3, 256, (3 * 96,), generator=g).tolist()
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    batches = ([long_prompt[:50], long_prompt[:20]], [long_prompt, long_prompt[:50]])
    eager = _engine(model_dir, **opts)
    expected = [[o.token_ids for o in eager.generate(b, params)] for b in batches]
    engine = _engine(model_dir, **opts)
    graphs = _with_stand_in_graphs(engine)
    first = engine.runner.model.rotary
    got = [[o.token_ids for o in engine.generate(b, params)] for b in batches]
    assert got == expected
    assert engine.runner.model.rotary is not first and graphs.rotary is engine.runner.model.rotary
    assert graphs.replays == graphs.steps > 0 and len(graphs.graphs) == 1  # (2 rows, 112, 112): dropped, captured again


def test_a_backend_without_graphs_leaves_steps_to_the_eager_path(tiny_models, one_thread):
    """The CPU backend captures no graphs: its refusal is a failed capture, not a failed step."""
    model_dir, _ = tiny_models["llama"]
    prompts, params = _workload()
    expected = [o.token_ids for o in _engine(model_dir).generate(prompts, params)]
    engine = _engine(model_dir)
    graphs = engine.runner.passes.graphs = DecodeGraphs(engine.runner.passes, backend=CpuBackend())
    assert [o.token_ids for o in engine.generate(prompts, params)] == expected
    assert graphs.failed and graphs.replays == graphs.steps == 0
