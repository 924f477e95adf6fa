"""Per-row LoRA adapters in PEFT's format: two adapters and the base model mixed in one `generate` call give
the greedy tokens of each adapter merged into the base by `peft` (`merge_and_unload`), through every KV layout
a generation can take; prefix reuse keeps each adapter's prefixes apart; bad adapters and the settings adapters
do not run with are refused, naming what is wrong."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from flashx_batch import Engine
from flashx_batch.errors import ConfigError, ModelLoadError
from flashx_batch.runtime.params import SamplingParams

PROMPT_LENGTHS = (5, 23, 9, 31, 14, 2, 17, 11, 27)
NEW_TOKENS = 10


def make_adapter(base, out_dir, seed: int, **lora):
    """Save a random (non-zero) PEFT LoRA adapter for `base`; returns the merged model (peft's merge_and_unload)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(init_lora_weights=False, **lora))
    with torch.no_grad():  # a visible change to the output, not a rounding-level one
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(4.0)
    peft_model.save_pretrained(out_dir)
    return peft_model.merge_and_unload()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """arch -> (base dir, {adapter name: (adapter dir, merged model dir)})."""
    from model_factory import build

    root = tmp_path_factory.mktemp("lora")
    out = {}
    for arch in ("llama", "qwen3"):
        base_dir = root / arch
        base = build(arch, base_dir)
        made = {}
        specs = {
            "alpha": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
            # every projection, rsLoRA scaling, a smaller rank for down_proj and another alpha for o_proj
            "beta": dict(r=8, lora_alpha=16, use_rslora=True, rank_pattern={"down_proj": 4},
                         alpha_pattern={"o_proj": 4}, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                     "gate_proj", "up_proj", "down_proj"]),
        }
        for seed, (name, spec) in enumerate(specs.items(), start=1):
            merged = make_adapter(base, root / f"{arch}-{name}", seed, **spec)
            merged.save_pretrained(root / f"{arch}-{name}-merged")
            made[name] = (root / f"{arch}-{name}", root / f"{arch}-{name}-merged")
        out[arch] = (base_dir, made)
    return out


def _prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
OPTIONS = dict(max_batch_size=4, max_input_len=48, max_output_len=16)


def _reference(model_dir, prompts):
    return [o.token_ids for o in Engine.from_pretrained(model_dir, **OPTIONS).generate(prompts, GREEDY)]


def _merged_tokens(base_dir, made, prompts, names) -> list[list[int]]:
    """Each prompt's greedy tokens from the base model (name None) or from its adapter merged into the base by
    peft (`merge_and_unload`, saved by the `adapters` fixture)."""
    models = {None: base_dir, **{name: merged for name, (_, merged) in made.items()}}
    by_model = {name: _reference(directory, prompts) for name, directory in models.items() if name in names}
    return [by_model[name][i] for i, name in enumerate(names)]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("layout", [dict(), dict(kv_layout="extents"), dict(kv_layout="stripes", refill=False)])
def test_mixed_adapters_match_peft_merged_models(adapters, one_thread, arch, layout):
    base_dir, made = adapters[arch]
    prompts = _prompts()
    names = [None, "alpha", "beta"] * 3
    engine = Engine.from_pretrained(base_dir, lora_adapters={n: d for n, (d, _) in made.items()}, **OPTIONS, **layout)
    got = [o.token_ids for o in engine.generate(prompts, GREEDY, adapters=names)]
    expected = {None: _reference(base_dir, prompts)}
    for name, (_, merged_dir) in made.items():
        expected[name] = _reference(merged_dir, prompts)
    for i, name in enumerate(names):
        assert got[i] == expected[name][i], f"prompt {i} (adapter {name}) differs from peft's merged model"
    # the adapters change the answers (the check above compares something)
    assert sum(expected["alpha"][i] != expected[None][i] for i in range(len(prompts))) >= 5
    assert sum(expected["beta"][i] != expected[None][i] for i in range(len(prompts))) >= 5
    # the same engine without adapters is the base model, bit for bit
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == expected[None]


@pytest.mark.parametrize("tokens_per_adapter, split_above", [(0, None), (10**9, None), (10**9, 0)],
                         ids=["always-grouped", "always-masked", "masked-per-part-expand"])
def test_grouped_and_masked_forms_agree_with_peft(adapters, one_thread, monkeypatch, tokens_per_adapter, split_above):
    """Each pass takes the grouped form (each adapter's rows through its own A, B) or the masked one (every row
    through every present adapter's columns, masked; a fused projection's expand in one block-diagonal GEMM or
    one per part): forced each way, the tokens are peft's."""
    import flashx_batch.models.lora as lora

    base_dir, made = adapters["qwen3"]
    monkeypatch.setattr(lora, "GROUPED_TOKENS_PER_ADAPTER", tokens_per_adapter)
    if split_above is not None:
        monkeypatch.setattr(lora, "SPLIT_EXPAND_ELEMENTS", split_above)
    prompts, names = _prompts(7), ["alpha", "beta", None, "beta", "beta", "alpha", None, None, "alpha"]
    engine = Engine.from_pretrained(base_dir, lora_adapters={n: d for n, (d, _) in made.items()}, **OPTIONS)
    got = [o.token_ids for o in engine.generate(prompts, GREEDY, adapters=names)]
    monkeypatch.undo()
    assert got == _merged_tokens(base_dir, made, prompts, names)


def test_prefill_mlp_in_row_chunks_keeps_each_rows_adapter(adapters, one_thread, monkeypatch):
    """A long CPU prefill runs its MLP in row chunks (`GatedMLP`): each chunk must take its own rows' adapters."""
    import flashx_batch.models.layers as layers

    base_dir, made = adapters["llama"]
    prompts, names = _prompts(5), ["beta", None, "alpha"] * 3
    engine = Engine.from_pretrained(base_dir, lora_adapters={n: d for n, (d, _) in made.items()}, **OPTIONS)
    monkeypatch.setattr(layers, "MLP_CHUNK_BYTES", 1)  # 64-row chunks: a prefill of four prompts spans several
    got = [o.token_ids for o in engine.generate(prompts, GREEDY, adapters=names)]
    monkeypatch.undo()
    assert got == _merged_tokens(base_dir, made, prompts, names)


def test_prefix_reuse_keeps_each_adapter_apart(adapters, one_thread):
    """Rows with the same long prompt under different adapters share no cached prefix (the KV differs), rows of
    one adapter do; every row still matches its merged model."""
    base_dir, made = adapters["llama"]
    shared = _prompts(3)[3][:29]
    prompts = [shared + [5 + i] for i in range(6)]
    names = ["alpha", None, "beta", "alpha", "beta", None]
    engine = Engine.from_pretrained(base_dir, lora_adapters={n: d for n, (d, _) in made.items()},
                                    prefix_cache_tokens=128, segment_size=8, **OPTIONS)
    got = [o.token_ids for o in engine.generate(prompts, GREEDY, adapters=names)]
    assert got == _merged_tokens(base_dir, made, prompts, names)
    # each row reads its 3 shared blocks (24 tokens) from the cache; they were computed once per adapter, not
    # once for all six rows (which is what prefixes keyed by tokens alone would do)
    stats = engine.last_stats
    assert stats.cached_prompt_tokens == 6 * 24
    assert stats.prefix_tokens_computed == 3 * 24


def test_unknown_adapter_and_wrong_count_are_refused(adapters):
    base_dir, made = adapters["llama"]
    engine = Engine.from_pretrained(base_dir, lora_adapters={"alpha": made["alpha"][0]}, **OPTIONS)
    with pytest.raises(ConfigError, match=r"\['gamma'\] were not loaded \(loaded: alpha\)"):
        engine.generate([[5, 6, 7]], GREEDY, adapters=["gamma"])
    with pytest.raises(ConfigError, match="2 adapters for 1 prompts"):
        engine.generate([[5, 6, 7]], GREEDY, adapters=["alpha", None])


def _copy_adapter(src, dst, config_change=None, weights=None):
    import shutil

    shutil.copytree(src, dst)
    if config_change:
        raw = json.loads((dst / "adapter_config.json").read_text())
        raw.update(config_change)
        (dst / "adapter_config.json").write_text(json.dumps(raw))
    if weights is not None:
        from safetensors.torch import save_file

        save_file(weights, str(dst / "adapter_model.safetensors"))
    return dst


@pytest.mark.parametrize("case, pattern", [
    ("missing", r"is not a directory"),
    ("no_config", r"adapter_config.json is missing"),
    ("dora", r"use_dora=true \(DoRA not supported\)"),
    ("modules_to_save", r"modules_to_save=\['lm_head'\]"),
    ("lm_head", r"targets this runtime cannot apply to LlamaForCausalLM: \['base_model.model.lm_head.lora_A.weight'"),
    ("shape", r"layer 0 q_proj has A \[4, 32\] .* needs A \[r, 64\]"),
    ("layers", r"layer 7 q_proj, but LlamaForCausalLM has 2 layers"),
    ("half", r"layer 0 q_proj has lora_A only"),
])
def test_bad_adapters_are_refused_with_the_file(adapters, tmp_path, case, pattern):
    from safetensors.torch import load_file

    base_dir, made = adapters["llama"]
    src = made["alpha"][0]
    tensors = load_file(str(src / "adapter_model.safetensors"))
    q_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    bad = tmp_path / case
    if case == "missing":
        bad = tmp_path / "nowhere"
    elif case == "no_config":
        _copy_adapter(src, bad)
        (bad / "adapter_config.json").unlink()
    elif case == "dora":
        _copy_adapter(src, bad, {"use_dora": True})
    elif case == "modules_to_save":
        _copy_adapter(src, bad, {"modules_to_save": ["lm_head"]})
    elif case == "lm_head":
        _copy_adapter(src, bad, weights={**tensors, "base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64),
                                         "base_model.model.lm_head.lora_B.weight": torch.zeros(256, 4)})
    elif case == "shape":
        _copy_adapter(src, bad, weights={**tensors, q_a: torch.zeros(4, 32)})
    elif case == "layers":
        extra = {k.replace("layers.0.", "layers.7."): v.clone() for k, v in tensors.items() if "layers.0." in k}
        _copy_adapter(src, bad, weights={**tensors, **extra})
    elif case == "half":
        _copy_adapter(src, bad, weights={k: v for k, v in tensors.items()
                                         if k != q_a.replace("lora_A", "lora_B")})
    with pytest.raises(ModelLoadError, match=pattern):
        Engine.from_pretrained(base_dir, lora_adapters={"bad": bad}, **OPTIONS)


@pytest.mark.parametrize("setting, name", [
    (dict(cache_policy="segment_sparse"), "cache_policy=segment_sparse"),
    (dict(long_input="rolling_merge"), "long_input=rolling_merge"),
    (dict(backend="onnx"), "backend=onnx"),
])
def test_settings_adapters_do_not_run_with_are_refused(adapters, setting, name):
    base_dir, made = adapters["llama"]
    with pytest.raises(ConfigError, match=rf"model.lora_adapters does not combine with runtime.{name}"):
        Engine.from_pretrained(base_dir, lora_adapters={"alpha": made["alpha"][0]}, **{**OPTIONS, **setting})
