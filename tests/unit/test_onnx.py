"""The ONNX Runtime runner under the one `Engine` generates the torch runner's greedy tokens (float32,
CPU provider)."""

import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")  # torch's dynamo ONNX exporter needs it

from model_factory import build  # noqa: E402

from flashx_batch import Engine, SamplingParams  # noqa: E402
from flashx_batch.errors import ConfigError  # noqa: E402
from flashx_batch.runtime.onnx_runner import OnnxRunner  # noqa: E402
from flashx_batch.runtime.options import bundled_model_dir  # noqa: E402

OPTS = dict(backend="onnx", dtype="float32", max_batch_size=4, max_input_len=64, max_output_len=48, segment_size=16)


def _prompts(seed: int, lengths: tuple[int, ...], vocab: int = 256) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("onnx")
    build("llama", root / "llama", seed=3)
    cache = root / "cache"
    return root / "llama", cache, Engine.from_pretrained(root / "llama", onnx_cache_dir=cache, **OPTS)


def test_graphs_take_and_return_the_kv_cache(llama):
    import onnx

    _, _, engine = llama
    assert isinstance(engine.runner, OnnxRunner)
    names = {}
    for graph in ("prefill", "decode"):
        model = onnx.load(str(engine.runner.export_dir / f"{graph}.onnx"), load_external_data=False)
        names[graph] = ([i.name for i in model.graph.input], [o.name for o in model.graph.output])
    assert names["prefill"] == (["input_ids", "last_index"], ["logits", "present"])
    assert names["decode"] == (["input_ids", "position_ids", "attn_bias", "past"], ["logits", "present"])


def test_random_llama_greedy_tokens_equal_torch_runtime(llama):
    model_dir, _, onnx_engine = llama
    torch_engine = Engine.from_pretrained(model_dir, **{**OPTS, "backend": "cpu"})
    prompts = _prompts(1, (5, 17, 9, 30, 12))  # 5 rows > max_batch_size: two static batches
    same = SamplingParams(max_new_tokens=32, ignore_eos=True)
    mixed = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (3, 24, 1, 9, 32)]  # rows leave early
    for params in (same, mixed):
        ours, ref = onnx_engine.generate(prompts, params), torch_engine.generate(prompts, params)
        assert [o.token_ids for o in ours] == [r.token_ids for r in ref]
        assert [o.finish_reason for o in ours] == [r.finish_reason for r in ref]
    assert onnx_engine.last_stats.rows == 5 and onnx_engine.last_stats.batches == 2
    edge = [[7], _prompts(2, (64,))[0]]  # a one-token prompt (T=1 prefill) and one of max_input_len
    for prompt in edge:
        assert onnx_engine.generate([prompt], same)[0].token_ids == torch_engine.generate([prompt], same)[0].token_ids
    logprobs = SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=3)  # the same sampler and logprobs
    for o, r in zip(onnx_engine.generate(prompts[:2], logprobs), torch_engine.generate(prompts[:2], logprobs)):
        assert o.token_ids == r.token_ids and o.logprobs == pytest.approx(r.logprobs, abs=1e-4)
        assert [[t for t, _ in step] for step in o.top_logprobs] == [[t for t, _ in step] for step in r.top_logprobs]


def test_export_is_cached_and_dtype_checked(llama):
    model_dir, cache, engine = llama
    stamp = (engine.runner.export_dir / "decode.onnx").stat().st_mtime_ns
    again = Engine.from_pretrained(model_dir, onnx_cache_dir=cache, **OPTS)
    assert again.runner.export_dir == engine.runner.export_dir
    assert (again.runner.export_dir / "decode.onnx").stat().st_mtime_ns == stamp
    with pytest.raises(ConfigError, match="not supported by runtime.backend=onnx"):
        Engine.from_pretrained(model_dir, onnx_cache_dir=cache, **{**OPTS, "dtype": "bfloat16"})


def test_bundled_model_greedy_tokens_equal_torch_runtime(tmp_path):
    model_dir = bundled_model_dir()
    if not (model_dir / "config.json").is_file():
        pytest.skip("the bundled legal-tiny model is not trained yet (no config.json)")
    opts = {**OPTS, "max_input_len": 128, "max_output_len": 32}
    onnx_engine = Engine.from_pretrained(model_dir, onnx_cache_dir=tmp_path, **opts)
    torch_engine = Engine.from_pretrained(model_dir, **{**opts, "backend": "cpu"})
    prompts = ["Summarise the obligations of the lessee.", "The court held that",
               "Clause 4.2: The supplier shall", "Extract the parties:"]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    ours, ref = onnx_engine.generate(prompts, params), torch_engine.generate(prompts, params)
    assert [o.token_ids for o in ours] == [r.token_ids for r in ref]
    # constrained rows: the ONNX runner applies the same grammar masks
    schema = {"type": "object", "properties": {"kind": {"enum": ["lease", "licence"]}}, "required": ["kind"]}
    constrained = [SamplingParams(max_new_tokens=24, json_schema=schema), SamplingParams(max_new_tokens=8),
                   SamplingParams(max_new_tokens=24, regex="[0-9]{3}"), SamplingParams(max_new_tokens=8, choice=["a"])]
    ours, ref = onnx_engine.generate(prompts, constrained), torch_engine.generate(prompts, constrained)
    assert [o.token_ids for o in ours] == [r.token_ids for r in ref]
    assert [o.constraint_met for o in ours] == [True, None, True, True]


def test_knobs_an_onnx_runner_cannot_use_leave_its_tokens_alone(llama):
    """The ONNX runner has no KV arena: prefix reuse and refill are not planned for it (static striped
    batches, as the exported graphs need), and its tokens stay the torch runner's."""
    model_dir, cache, _ = llama
    knobs = dict(prefix_cache_tokens=256, refill=True, batch_growth=4)
    onnx_engine = Engine.from_pretrained(model_dir, onnx_cache_dir=cache, **OPTS, **knobs)
    torch_engine = Engine.from_pretrained(model_dir, **{**OPTS, "backend": "cpu"})
    shared = _prompts(5, (20,))[0]
    prompts = [shared + p for p in _prompts(6, (3, 9, 14, 5, 11))]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (2, 12, 5, 9, 1)]
    ours, ref = onnx_engine.generate(prompts, params), torch_engine.generate(prompts, params)
    assert [o.token_ids for o in ours] == [r.token_ids for r in ref]
    assert onnx_engine.last_stats.batches == 2 and onnx_engine.last_stats.cached_prompt_tokens == 0
    with pytest.raises(ConfigError, match="score on a torch backend"):
        onnx_engine.score(prompts[:1])
