"""Train the bundled demo model ``legal-tiny`` from the Debian legal-text corpus.

Pipeline (input: the output of ``jobs/training/build_legal_corpus.py``):

1. Train a byte-level BPE tokenizer (``tokenizers``) on ``train.jsonl``:
   vocab 4096, specials ``<pad>``=0, ``<s>``=1, ``</s>``=2, ``<|system|>``,
   ``<|user|>``, ``<|assistant|>``. ByteLevel pre-tokenizer
   (``add_prefix_space=False``) + ByteLevel decoder, no post-processor, so
   ``decode(encode(text)) == text`` and no BOS is added automatically. The
   tokenizer files are written to ``--out`` before model training starts.
2. Train a ``LlamaForCausalLM`` from scratch (~5.5 M parameters, float32) on
   random 512-token windows of the concatenated train documents (each
   followed by ``</s>``), with AdamW, linear warmup and a cosine decay driven
   by the wall clock: the loop stops after ``--minutes`` minutes.
3. Save the model in Hugging Face format (bf16 weights if float32 would be
   >= 20 MB), reload it from disk, measure held-out perplexity (token level,
   non-overlapping 512-token windows over the whole held-out split), produce a
   greedy 48-token continuation of a fixed prompt, and write ``README.md``.

Also writes a <= 300 KB subset of held-out documents to
``--eval-subset-out`` (default ``flashx_batch/assets/data/legal_heldout_eval.jsonl``).

Usage::

    python jobs/training/train_demo_model.py --minutes 40
    python jobs/training/train_demo_model.py --out build/smoke-model --minutes 1
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
VOCAB_SIZE = 4096
SEQ_LEN = 512
MAX_POSITIONS = 2048
FP32_SIZE_LIMIT = 20 * 1024 * 1024
EVAL_SUBSET_MAX_BYTES = 300 * 1024
PROMPT = "Permission is hereby granted, free of charge, to any person obtaining"
GEN_TOKENS = 48

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}<|system|>\n{{ message['content'] }}\n"
    "{% elif message['role'] == 'user' %}<|user|>\n{{ message['content'] }}\n"
    "{% elif message['role'] == 'assistant' %}<|assistant|>\n{{ message['content'] }}</s>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass
class TrainConfig:
    """Optimisation hyper-parameters."""

    minutes: float = 40.0
    batch_size: int = 16
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 40
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    log_every: int = 50
    seed: int = 1234
    threads: int = 2


@dataclass
class RunStats:
    """Numbers collected during the run, reported in the model card."""

    n_train_docs: int = 0
    n_heldout_docs: int = 0
    train_tokens: int = 0
    heldout_tokens: int = 0
    steps: int = 0
    train_minutes: float = 0.0
    total_minutes: float = 0.0
    final_train_loss: float = float("nan")
    heldout_loss_fp32: float = float("nan")
    heldout_loss_saved: float = float("nan")
    eval_subset_docs: int = 0
    eval_subset_loss: float = float("nan")
    saved_dtype: str = "float32"
    n_params: int = 0
    continuation: str = ""
    loss_log: list[tuple[int, float]] = field(default_factory=list)


# --------------------------------------------------------------------------- data


def read_jsonl(path: Path) -> list[dict[str, str]]:
    """Read a JSON-lines file into a list of dicts."""
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_eval_subset(heldout: list[dict[str, str]], path: Path) -> int:
    """Write held-out docs (sha256 order, greedily skipping ones that do not
    fit) totalling at most EVAL_SUBSET_MAX_BYTES; returns the doc count."""

    def key(doc: dict[str, str]) -> str:
        return hashlib.sha256(doc["text"].encode("utf-8")).hexdigest()

    lines: list[str] = []
    total = 0
    for doc in sorted(heldout, key=key):
        line = json.dumps({"source": doc["source"], "text": doc["text"]}, ensure_ascii=False) + "\n"
        size = len(line.encode("utf-8"))
        if total + size <= EVAL_SUBSET_MAX_BYTES:
            lines.append(line)
            total += size
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(lines), encoding="utf-8")
    return len(lines)


# ---------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str]) -> Tokenizer:
    """Train the byte-level BPE tokenizer described in the module docstring."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    for i, special in enumerate(SPECIAL_TOKENS[:3]):
        assert tok.token_to_id(special) == i, (special, tok.token_to_id(special))
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    return tok


def save_tokenizer(tok: Tokenizer, out: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    extra = SPECIAL_TOKENS[3:]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "additional_special_tokens": extra,
        "model_max_length": MAX_POSITIONS,
        "padding_side": "left",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    special_map = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "additional_special_tokens": extra,
    }
    for name, obj in (("tokenizer_config.json", config), ("special_tokens_map.json", special_map)):
        (out / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def encode_docs(tok: Tokenizer, texts: list[str]) -> torch.Tensor:
    """Tokenise each doc, append </s>, concatenate into one int64 tensor."""
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(EOS_ID)
    return torch.tensor(ids, dtype=torch.long)


# -------------------------------------------------------------------------- model


def build_model() -> torch.nn.Module:
    """A freshly initialised LlamaForCausalLM with the demo architecture."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=704,
        max_position_embeddings=MAX_POSITIONS,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    return LlamaForCausalLM(config)


def lr_at(step: int, progress: float, cfg: TrainConfig) -> float:
    """Linear warmup over warmup_steps, then cosine decay in wall-clock
    progress (0..1) down to min_lr_ratio * lr."""
    warm = min(1.0, (step + 1) / cfg.warmup_steps)
    cos = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * warm * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cos)


def train(model: torch.nn.Module, data: torch.Tensor, cfg: TrainConfig, stats: RunStats) -> None:
    """Time-budgeted training loop on random SEQ_LEN windows of ``data``."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=cfg.betas,
    )
    gen = torch.Generator().manual_seed(cfg.seed)
    budget = cfg.minutes * 60.0
    start = time.monotonic()
    model.train()
    step = 0
    running = 0.0
    n_running = 0
    while True:
        elapsed = time.monotonic() - start
        if elapsed >= budget:
            break
        lr = lr_at(step, elapsed / budget, cfg)
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, data.numel() - SEQ_LEN, (cfg.batch_size,), generator=gen)
        batch = torch.stack([data[s : s + SEQ_LEN] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        running += loss.item()
        n_running += 1
        if step % cfg.log_every == 0 or step == 1:
            avg = running / n_running
            stats.loss_log.append((step, avg))
            print(
                f"step {step:5d}  train_loss {avg:.4f}  lr {lr:.2e}  "
                f"elapsed {(time.monotonic() - start) / 60:.1f} min",
                flush=True,
            )
            running, n_running = 0.0, 0
    stats.steps = step
    stats.train_minutes = (time.monotonic() - start) / 60.0
    if n_running:
        stats.loss_log.append((step, running / n_running))
    stats.final_train_loss = stats.loss_log[-1][1] if stats.loss_log else float("nan")
    model.eval()


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, data: torch.Tensor, batch_size: int = 8) -> float:
    """Mean token NLL over non-overlapping SEQ_LEN windows of ``data`` (the
    first token of each window is context only; a trailing partial window is
    included). Computed in float32."""
    model.eval()
    windows = list(torch.split(data, SEQ_LEN))
    total_nll = 0.0
    total_tokens = 0
    full = [w for w in windows if w.numel() == SEQ_LEN]
    partial = [w for w in windows if 1 < w.numel() < SEQ_LEN]
    groups = [torch.stack(full[i : i + batch_size]) for i in range(0, len(full), batch_size)]
    groups += [w.unsqueeze(0) for w in partial]
    for batch in groups:
        logits = model(input_ids=batch).logits.float()
        nll = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1), reduction="sum"
        )
        total_nll += nll.item()
        total_tokens += batch[:, 1:].numel()
    return total_nll / max(1, total_tokens)


# ------------------------------------------------------------------------- saving


def save_model(model: torch.nn.Module, out: Path) -> str:
    """Save config, weights and generation config; returns the saved dtype."""
    from transformers import GenerationConfig

    n_bytes = sum(p.numel() * 4 for p in {id(p): p for p in model.parameters()}.values())
    dtype = torch.float32 if n_bytes < FP32_SIZE_LIMIT else torch.bfloat16
    to_save = model if dtype == torch.float32 else _bf16_copy(model)
    to_save.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID
    )
    to_save.save_pretrained(out, safe_serialization=True)
    os.chmod(out / "model.safetensors", 0o644)
    return str(dtype).removeprefix("torch.")


def _bf16_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A bfloat16 copy of ``model`` (the original stays float32)."""
    import copy

    return copy.deepcopy(model).to(torch.bfloat16)


def load_and_check(out: Path, prompt: str) -> tuple[torch.nn.Module, str]:
    """Reload model + tokenizer from ``out`` offline, check the tokenizer
    round trip and chat template, return the fp32 model and the greedy
    continuation of ``prompt``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    model.eval()
    sample = "Copyright (c) 2024  Jane Doe <jane@example.org>\n\tÄ → ✓ \r\n  end  "
    ids = tok(sample)["input_ids"]
    assert ids[0] != BOS_ID and tok.decode(ids) == sample, "tokenizer round trip failed"
    chat = tok.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert chat == "<|system|>\nS\n<|user|>\nU\n<|assistant|>\nA</s>\n<|assistant|>\n", repr(chat)
    enc = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        gen = model.generate(
            **enc, max_new_tokens=GEN_TOKENS, do_sample=False, pad_token_id=PAD_ID
        )
    continuation = tok.decode(gen[0, enc["input_ids"].shape[1] :], skip_special_tokens=False)
    return model, continuation


# --------------------------------------------------------------------- model card


def write_card(out: Path, args: argparse.Namespace, cfg: TrainConfig, stats: RunStats) -> None:
    """Write README.md (the model card) into ``out``."""
    ppl_saved = math.exp(stats.heldout_loss_saved)
    ppl_fp32 = math.exp(stats.heldout_loss_fp32)
    ppl_subset = math.exp(stats.eval_subset_loss)
    loss_rows = "\n".join(f"| {s} | {loss:.4f} |" for s, loss in stats.loss_log)
    threads = torch.get_num_threads()
    card = f"""---
license: other
library_name: transformers
pipeline_tag: text-generation
tags: [llama, demo, tiny]
---

# legal-tiny

A tiny (~{stats.n_params / 1e6:.2f} M parameter) Llama-architecture causal language
model trained from scratch on Debian legal text (package `copyright` files
and `/usr/share/common-licenses`). It exists as the bundled demo model for
`flashx_batch` tests and examples: it loads fast, runs anywhere and produces
licence-flavoured text. It is **not** a useful assistant.

## How it was built

```bash
python jobs/training/build_legal_corpus.py --out build/corpus
python jobs/training/train_demo_model.py --corpus build/corpus --out {args.out} --minutes {args.minutes:g}
```

**Corpus.** All `/usr/share/doc/*/copyright` and `/usr/share/common-licenses/*`
files, decoded as UTF-8 (errors replaced) and stripped, exact duplicates
(by sha256 of the text) dropped. Split rule: a document is held out iff
`int(sha256(text), 16) % 10 == 0`, otherwise it is used for training.

| split | documents | tokens (incl. one `</s>` per doc) |
|---|---|---|
| train | {stats.n_train_docs} | {stats.train_tokens:,} |
| held-out | {stats.n_heldout_docs} | {stats.heldout_tokens:,} |

**Tokenizer.** Byte-level BPE (`tokenizers`), vocabulary {VOCAB_SIZE}, trained on
the train split. Special tokens: `<pad>`=0, `<s>`=1, `</s>`=2, `<|system|>`,
`<|user|>`, `<|assistant|>`. ByteLevel pre-tokenizer (no prefix space) and
decoder, no post-processor: encoding adds no BOS/EOS and decoding
round-trips text exactly.

**Training.** Documents tokenised, each followed by `</s>`, concatenated;
random {SEQ_LEN}-token windows, batch {cfg.batch_size}, AdamW (lr {cfg.lr:g},
betas {cfg.betas}, weight decay {cfg.weight_decay}, grad clip {cfg.grad_clip}),
{cfg.warmup_steps}-step linear warmup then cosine decay to {cfg.min_lr_ratio:g}x
over the wall-clock budget, float32, seed {cfg.seed}.
{stats.steps} steps ({stats.steps * cfg.batch_size * SEQ_LEN:,} training tokens) in
{stats.train_minutes:.1f} minutes of training ({stats.total_minutes:.1f} minutes
end to end) on {threads} CPU threads / {os.cpu_count()} CPU cores
({platform.processor() or platform.machine()}), torch {torch.__version__}. Because the
budget is wall-clock time, the step count depends on the machine.

| step | train loss (mean since previous row) |
|---|---|
{loss_rows}

## Architecture

`LlamaForCausalLM`: hidden size 256, 6 layers, 8 attention heads, 4 key/value
heads (head dim 32), MLP intermediate size 704 (SiLU), RMSNorm, RoPE
(theta 10000), max positions {MAX_POSITIONS}, tied input/output embeddings,
vocabulary {VOCAB_SIZE}; {stats.n_params:,} parameters. Weights stored as
`{stats.saved_dtype}` in `model.safetensors`.

## Evaluation

Token-level perplexity on the whole held-out split ({stats.n_heldout_docs} docs,
{stats.heldout_tokens:,} tokens), non-overlapping {SEQ_LEN}-token windows (the first
token of each window is context only), computed in float32:

| weights | held-out loss | held-out perplexity |
|---|---|---|
| saved ({stats.saved_dtype}, as loaded from this folder) | {stats.heldout_loss_saved:.4f} | **{ppl_saved:.2f}** |
| float32 at end of training | {stats.heldout_loss_fp32:.4f} | {ppl_fp32:.2f} |

On `flashx_batch/assets/data/legal_heldout_eval.jsonl` ({stats.eval_subset_docs} held-out
docs, same procedure, saved weights): loss {stats.eval_subset_loss:.4f}, perplexity {ppl_subset:.2f}.

Greedy continuation (`model.generate`, `do_sample=False`, {GEN_TOKENS} new tokens) of
`{PROMPT}`:

```text
{stats.continuation}
```

## Usage

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained("{args.out}")
model = AutoModelForCausalLM.from_pretrained("{args.out}")
```

The chat template renders `<|system|>\\n{{content}}\\n`, `<|user|>\\n{{content}}\\n`,
`<|assistant|>\\n{{content}}</s>\\n` and, with `add_generation_prompt`,
`<|assistant|>\\n`. The model was never trained on chat data.
"""
    (out / "README.md").write_text(card, encoding="utf-8")


# ---------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, default=Path("build/corpus"))
    parser.add_argument("--out", type=Path, default=Path("flashx_batch/assets/models/legal-tiny"))
    parser.add_argument(
        "--eval-subset-out", type=Path, default=Path("flashx_batch/assets/data/legal_heldout_eval.jsonl")
    )
    parser.add_argument("--minutes", type=float, default=40.0, help="wall-clock budget of the training loop")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1.5e-3)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--seed", type=int, default=1234)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    t0 = time.monotonic()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    cfg = TrainConfig(
        minutes=args.minutes, batch_size=args.batch_size, lr=args.lr, log_every=args.log_every, seed=args.seed
    )
    torch.set_num_threads(cfg.threads)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    stats = RunStats()

    train_docs = read_jsonl(args.corpus / "train.jsonl")
    heldout_docs = read_jsonl(args.corpus / "heldout.jsonl")
    stats.n_train_docs, stats.n_heldout_docs = len(train_docs), len(heldout_docs)
    stats.eval_subset_docs = write_eval_subset(heldout_docs, args.eval_subset_out)
    print(f"eval subset: {stats.eval_subset_docs} docs -> {args.eval_subset_out}", flush=True)

    tok = train_tokenizer([d["text"] for d in train_docs])
    save_tokenizer(tok, args.out)
    print(f"tokenizer saved to {args.out} ({time.monotonic() - t0:.0f} s)", flush=True)

    train_ids = encode_docs(tok, [d["text"] for d in train_docs])
    heldout_ids = encode_docs(tok, [d["text"] for d in heldout_docs])
    subset_ids = encode_docs(tok, [d["text"] for d in read_jsonl(args.eval_subset_out)])
    stats.train_tokens, stats.heldout_tokens = train_ids.numel(), heldout_ids.numel()
    print(f"train tokens {stats.train_tokens:,}  held-out tokens {stats.heldout_tokens:,}", flush=True)

    model = build_model()
    stats.n_params = sum(p.numel() for p in model.parameters())
    print(f"model parameters {stats.n_params:,}; training for {cfg.minutes:g} min", flush=True)
    train(model, train_ids, cfg, stats)
    stats.heldout_loss_fp32 = heldout_loss(model, heldout_ids)
    print(
        f"done: {stats.steps} steps in {stats.train_minutes:.1f} min; held-out loss (fp32) "
        f"{stats.heldout_loss_fp32:.4f} ppl {math.exp(stats.heldout_loss_fp32):.2f}",
        flush=True,
    )

    stats.saved_dtype = save_model(model, args.out)
    loaded, stats.continuation = load_and_check(args.out, PROMPT)
    stats.heldout_loss_saved = heldout_loss(loaded, heldout_ids)
    stats.eval_subset_loss = heldout_loss(loaded, subset_ids)
    stats.total_minutes = (time.monotonic() - t0) / 60.0
    write_card(args.out, args, cfg, stats)
    print(
        f"saved ({stats.saved_dtype}) to {args.out}; held-out loss {stats.heldout_loss_saved:.4f} "
        f"ppl {math.exp(stats.heldout_loss_saved):.2f}",
        flush=True,
    )
    print(f"continuation: {PROMPT!r} -> {stats.continuation!r}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
