"""Sequence classifiers (`*ForSequenceClassification`: classifiers, reward models) loaded from their own
checkpoints: logits within 1e-4 of `transformers` for Llama and Qwen3 with a batch of mixed lengths, the
labels from id2label, softmax / sigmoid probabilities; what a classifier cannot do is refused."""

from __future__ import annotations

import pytest
import torch

from flashx_batch import Engine
from flashx_batch.errors import ConfigError
from flashx_batch.runtime.params import SamplingParams

LENGTHS = (7, 30, 1, 18, 11, 25)


def _classifier(kind: str, directory, num_labels: int, vocab: int = 256):
    import transformers as tf

    config_class, model_class, extra = {
        "llama": (tf.LlamaConfig, tf.LlamaForSequenceClassification, {}),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForSequenceClassification, {"head_dim": 16}),
    }[kind]
    labels = {i: name for i, name in enumerate(["negative", "neutral", "positive"][:num_labels])} \
        if num_labels > 1 else {0: "reward"}
    config = config_class(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
                          num_labels=num_labels, id2label=labels, label2id={v: k for k, v in labels.items()},
                          tie_word_embeddings=False, **extra)
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():
        model.score.weight.normal_(0, 0.5)
    model.save_pretrained(directory)
    return model


@pytest.mark.parametrize("kind, num_labels", [("llama", 3), ("qwen3", 3), ("llama", 1)])
def test_logits_equal_transformers(tmp_path, kind, num_labels):
    hf = _classifier(kind, tmp_path, num_labels)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in LENGTHS]  # no pad id inside
    engine = Engine.from_pretrained(tmp_path, max_batch_size=4, max_input_len=64, max_output_len=8)
    got = engine.classify(prompts)
    with torch.no_grad():
        want = torch.cat([hf(torch.tensor([p])).logits for p in prompts]).float()
    assert torch.allclose(torch.tensor([c.logits for c in got]), want, atol=1e-4, rtol=0)
    labels = list(hf.config.id2label.values())
    assert [c.label for c in got] == [labels[i] for i in want.argmax(-1).tolist()]
    probs = torch.tensor([c.probs for c in got])
    expect = want.sigmoid() if num_labels == 1 else want.softmax(-1)
    assert torch.allclose(probs, expect, atol=1e-5)


def test_what_a_classifier_cannot_do_is_refused(tmp_path):
    _classifier("llama", tmp_path, 3)
    engine = Engine.from_pretrained(tmp_path, max_batch_size=2, max_input_len=32, max_output_len=8)
    with pytest.raises(ConfigError, match="sequence classifier.*cannot generate"):
        engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2))
    with pytest.raises(ConfigError, match="cannot score log-likelihoods"):
        engine.loglikelihood([([5, 6], [7])])
    with pytest.raises(ConfigError, match="tensor_parallel_size=1"):
        Engine.from_pretrained(tmp_path, tensor_parallel_size=2)
    assert engine.embed([[5, 6, 7]]).shape == (1, 64)  # its hidden states still embed
    with pytest.raises(ConfigError, match="not a sequence classifier"):
        Engine.from_pretrained(None, max_batch_size=2).classify(["a"])


def test_a_classify_job_every_id_once(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from flashx_batch import run_job
    from flashx_batch.config import compose_job
    from flashx_batch.runner.job import plan_job
    from flashx_batch.runtime.options import bundled_model_dir

    _classifier("qwen3", tmp_path / "model", 3, vocab=4096)  # the bundled tokenizer's vocabulary, copied in
    rows = range(7)

    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (tmp_path / "model" / name).write_bytes((bundled_model_dir() / name).read_bytes())
    texts = [f"clause {i}: the licensee shall not sublicense" for i in rows]
    out = tmp_path / "out"
    base = ["conf=legal_docs", "executor.kind=local", f"model.path={tmp_path / 'model'}", "task=classify",
            "runtime.shard_size=3"]
    assert run_job([*base, f"output.dir={out}"], data=pa.table({"id": list(rows), "prompt": texts})) == 0
    table = pq.read_table(out / "generations").to_pylist()
    assert sorted(r["id"] for r in table) == list(rows)
    assert all(len(r["probs"]) == 3 and abs(sum(r["probs"]) - 1) < 1e-5 for r in table)
    engine = Engine.from_pretrained(tmp_path / "model")
    want = {i: c for i, c in zip(rows, engine.classify(texts))}
    for r in table:
        assert r["label"] == want[r["id"]].label and r["logits"] == pytest.approx(want[r["id"]].logits, abs=1e-5)
    with pytest.raises(ConfigError, match="needs a language model"):
        plan_job(compose_job(["conf=legal_docs", f"model.path={tmp_path / 'model'}", f"output.dir={out}2"]))
    with pytest.raises(ConfigError, match="needs a sequence classifier"):
        plan_job(compose_job(["conf=legal_docs", "task=classify", f"output.dir={out}3"]))


PAIRS = [("what may the licensee do?", "the licence permits copying and modification"),
         ("who holds the copyright?", "the copyright holder keeps every right not granted"),
         ("is there a warranty?", "the software is provided without warranty of any kind, express or implied"),
         ("q", "d")]


def _reward_model(directory):
    """A one-label classifier (a reward model / reranker head) with the bundled tokenizer and chat template."""
    from flashx_batch.runtime.options import bundled_model_dir

    hf = _classifier("qwen3", directory, 1, vocab=4096)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (directory / name).write_bytes((bundled_model_dir() / name).read_bytes())
    return hf


@pytest.mark.parametrize("fmt", ["separator", "chat"])
def test_pair_scores_equal_transformers(tmp_path, fmt):
    """Each (query, document) pair read as transformers' tokenizer writes it (a separator between the two, or the
    chat template's user and assistant turns) and scored by transformers' classifier: the same logit."""
    import transformers as tf

    hf = _reward_model(tmp_path)
    tok = tf.AutoTokenizer.from_pretrained(tmp_path)
    engine = Engine.from_pretrained(tmp_path, max_batch_size=2, max_input_len=64, max_output_len=8)
    got = engine.score_pairs(PAIRS, format=fmt, separator=" || ")
    with torch.no_grad():
        want = []
        for query, document in PAIRS:
            if fmt == "chat":
                text = tok.apply_chat_template([{"role": "user", "content": query},
                                                {"role": "assistant", "content": document}],
                                               tokenize=False, add_generation_prompt=False)
                ids = tok(text, add_special_tokens=False).input_ids
            else:
                ids = tok(query + " || " + document).input_ids
            want.append(hf(torch.tensor([ids])).logits[0, 0].item())
    assert got == pytest.approx(want, abs=1e-4)
    assert len({round(g, 4) for g in got}) == len(PAIRS)  # the pairs score differently


def test_a_score_job_every_id_once(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from flashx_batch import run_job
    from flashx_batch.config import compose_job
    from flashx_batch.runner.job import plan_job

    _reward_model(tmp_path / "model")
    queries = [q for q, _ in PAIRS] * 2
    documents = [d for _, d in PAIRS] * 2
    documents[5] = None  # a pair without its document: an error row
    out = tmp_path / "out"
    base = ["conf=legal_docs", "executor.kind=local", f"model.path={tmp_path / 'model'}", "task=score",
            "score.format=chat", "data.query_column=question", "data.document_column=answer", "runtime.shard_size=3"]
    data = pa.table({"id": list(range(8)), "question": queries, "answer": documents})
    assert run_job([*base, f"output.dir={out}"], data=data) == 0
    table = pq.read_table(out / "generations").to_pylist()
    errors = pq.read_table(out / "errors").to_pylist()
    assert sorted([r["id"] for r in table] + [r["id"] for r in errors]) == list(range(8))
    assert [(r["id"], r["error_code"]) for r in errors] == [(5, "null_prompt")]
    assert "document (answer) is null" in errors[0]["error_message"]
    engine = Engine.from_pretrained(tmp_path / "model")
    want = dict(zip(range(8), engine.score_pairs(list(zip(queries, ["x" if d is None else d for d in documents])),
                                                 format="chat")))
    assert {r["id"]: r["score"] for r in table} == pytest.approx({i: want[i] for i in range(8) if i != 5}, abs=1e-5)
    with pytest.raises(ConfigError, match="one-label sequence classifier"):
        plan_job(compose_job(["conf=legal_docs", "task=score", f"output.dir={out}2"]))
    three = tmp_path / "three"
    _classifier("llama", three, 3)
    with pytest.raises(ConfigError, match="use classify"):
        Engine.from_pretrained(three, max_batch_size=2).score_pairs([("a", "b")])


def test_trailing_pad_tokens_are_scored_as_transformers_scores_them(tmp_path):
    """transformers' classifiers score the last token that is not the pad id: a prompt ending in pad tokens (a
    template whose last token is the pad token, pad = eos) is scored where the real text ends."""
    hf = _classifier("llama", tmp_path, 3)
    prompts = [[5, 9, 33, 0], [12, 4, 0, 0], [99, 100, 101]]
    engine = Engine.from_pretrained(tmp_path, max_batch_size=2, max_input_len=32, max_output_len=8)
    got = torch.tensor([c.logits for c in engine.classify(prompts)])
    with torch.no_grad():
        want = torch.cat([hf(torch.tensor([p])).logits for p in prompts]).float()
    assert torch.allclose(got, want, atol=1e-4, rtol=0)


def test_an_adapter_cell_that_is_empty_means_the_base_model():
    from flashx_batch.config import compose_job
    from flashx_batch.data.plan import adapter_name, adapter_problem

    job = compose_job(["conf=legal_docs", "data.adapter_column=adapter", "+model.lora_adapters={legal:/tmp/x}"])
    assert adapter_name("") is None and adapter_problem(job, "") is None and adapter_problem(job, None) is None
    assert adapter_problem(job, "legal") is None
    assert adapter_problem(job, "other").code == "unknown_adapter"


def test_a_prompt_prefix_before_a_chat_rendered_pair_is_refused(tmp_path):
    from flashx_batch.config import compose_job
    from flashx_batch.runner.job import plan_job

    with pytest.raises(ConfigError, match="data.prompt_prefix with score.format=chat"):
        plan_job(compose_job(["conf=legal_docs", "task=score", "score.format=chat", "data.prompt_prefix=Judge: ",
                              f"output.dir={tmp_path}"]))
