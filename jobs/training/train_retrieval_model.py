"""Continue training the bundled ``legal-tiny`` model so that it can retrieve from its context.

The licence-only demo model (trained by ``jobs/training/train_demo_model.py``) does not copy a passage of
random tokens that appeared earlier in its prompt. This job continues training from its weights
(same tokenizer and architecture; the bundled ``legal-tiny`` is its result, phase by phase as
``jobs/training/train_retrieval_recipe.sh`` runs it) on a mixture of

* ``lm``: random ``--seq-len``-token windows of the licence training corpus (loss on every token),
* ``repeat``: a span of random tokens repeated back to back (every token after the first copy a
  target): the densest copy signal,
* ``copy``: ``[licence prefix] <|user|> SPAN [licence filler] <|assistant|> SPAN [licence suffix]``
  where SPAN is a run of random vocabulary tokens; loss only on the repeated SPAN,
* ``mqar`` (multi-query associative recall): ``[licence prefix] <|user|> k1 v1 ... kN vN [licence
  filler] <|assistant|> k_p1 v_p1 ... k_pN v_pN [licence suffix]`` with distinct random keys,
  random values and the queries in a random order; loss only on the queried values.

``--markers-share`` of the copy / MQAR rows carry the marker tokens; the rest use 1-3 licence
tokens as the cue. Every training sequence of a step has the same length (``--seq-len``, or
``--long-factor`` times it every ``--long-every`` steps). The step loss is the mean token loss of the
``lm`` rows plus ``--retrieval-weight`` times the mean loss over the retrieval targets of the
synthetic rows (so the few target tokens are not drowned by the licence tokens), plus
``--attn-supervision`` times the attention-supervision loss (``attention_loss``: a previous-token
head and induction heads taught directly).
AdamW, linear warmup then cosine decay driven by the wall clock (``lr_at`` of the demo script);
the clock covers training and the periodic evaluations.

Evaluation (every ``--eval-every-min`` minutes, at the end, and with ``--eval-only MODEL_DIR``),
float32, on held-out material with a fixed seed (filler text from the held-out split):

* ``copy_tf``: 32 copy sequences (span 32, filler 256 tokens): fraction of the repeated span
  tokens that are the argmax given the true prefix (greedy next-token exact match),
* ``copy_greedy``: the same sequences, the span generated greedily after the marker (full,
  lossless cache: the static cache's result) and compared position by position,
* ``mqar``: 32 MQAR sequences (32 pairs, filler 64 tokens): fraction of queried values that are
  the argmax (single-token values after a given key: greedy exact match),
* ``ppl_subset``: perplexity on the first ``--ppl-windows`` non-overlapping windows of the held-out
  split; ``ppl_heldout`` (whole held-out split, the model card's figure) at the end and with
  ``--eval-only``.

Evaluations are appended as JSON lines to ``<out>/eval.jsonl``; at each evaluation the model is
saved in Hugging Face format to ``--out`` (bf16 weights, as ``save_model`` decides, plus the
bundled tokenizer files) with ``train_state.pt`` (float32 weights, optimizer, step, clock, RNG
states) so that ``--resume`` continues with the remaining budget.

Usage::

    python jobs/training/build_legal_corpus.py --out build/corpus
    python jobs/training/train_retrieval_model.py --eval-only flashx_batch/assets/models/legal-tiny
    python jobs/training/train_retrieval_model.py --minutes 40 --out build/retrieval-model
    python jobs/training/train_retrieval_model.py --minutes 40 --out build/retrieval-model --resume
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_demo_model import (  # noqa: E402
    SEQ_LEN,
    TrainConfig,
    encode_docs,
    heldout_loss,
    lr_at,
    read_jsonl,
    save_model,
)

BUNDLED = Path("flashx_batch/assets/models/legal-tiny")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
MARK_SPAN = 4  # <|user|>: never seen in the licence corpus
MARK_QUERY = 5  # <|assistant|>
FIRST_RANDOM_ID = 6  # random tokens are drawn from the non-special ids
IGNORE = -100

EVAL_SEED = 20261202
EVAL_COPY = {"n": 32, "span": 32, "filler": 256}
EVAL_MQAR = {"n": 32, "pairs": 32, "filler": 64}


# ------------------------------------------------------------------ synthetic sequences


@dataclass
class Example:
    """One sequence and the positions whose token is a retrieval target (loss / accuracy)."""

    ids: list[int]
    targets: list[int]

    def labels(self) -> list[int]:
        """HF-style labels: the token at target positions, IGNORE elsewhere."""
        keep = set(self.targets)
        return [t if i in keep else IGNORE for i, t in enumerate(self.ids)]


def random_tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_RANDOM_ID, vocab_size) for _ in range(n)]


def text_slice(rng: random.Random, text: torch.Tensor | list[int], n: int) -> list[int]:
    """``n`` consecutive tokens of the licence text at a random offset."""
    if n <= 0:
        return []
    start = rng.randrange(0, len(text) - n)
    return [int(t) for t in text[start : start + n]]


def separator(rng: random.Random, text: torch.Tensor | list[int], marker: int, markers: bool) -> list[int]:
    """The marker token, or without markers 1-3 licence tokens: a cue of no fixed form."""
    return [marker] if markers else text_slice(rng, text, rng.randint(1, 3))


def copy_example(rng: random.Random, text: torch.Tensor | list[int], span: int, filler: int,
                 prefix: int = 0, length: int | None = None, vocab_size: int = 4096,
                 markers: bool = True) -> Example:
    """``prefix`` licence tokens, MARK_SPAN, ``span`` random tokens, ``filler`` licence tokens,
    MARK_QUERY, the same span again (the targets), then licence tokens up to ``length``.

    Without ``markers`` nothing announces the span and a few licence tokens stand for MARK_QUERY,
    so copying cannot hinge on the markers; the repeat's first token is then unpredictable and the
    targets start at its second."""
    tokens = random_tokens(rng, span, vocab_size)
    ids = text_slice(rng, text, prefix) + ([MARK_SPAN] if markers else []) + tokens
    ids += text_slice(rng, text, filler) + separator(rng, text, MARK_QUERY, markers)
    first = 0 if markers else 1
    targets = list(range(len(ids) + first, len(ids) + span))
    ids += tokens
    if length is not None:
        if len(ids) > length:
            raise ValueError(f"copy example of {len(ids)} tokens > length {length}")
        ids += text_slice(rng, text, length - len(ids))
    return Example(ids, targets)


def mqar_example(rng: random.Random, text: torch.Tensor | list[int], pairs: int, filler: int,
                 prefix: int = 0, length: int | None = None, vocab_size: int = 4096,
                 markers: bool = True) -> Example:
    """``prefix`` licence tokens, MARK_SPAN, ``pairs`` (key, value) pairs (distinct random keys,
    random values), ``filler`` licence tokens, MARK_QUERY, every key again in a random order each
    followed by its value (the values are the targets), then licence tokens up to ``length``.
    Without ``markers``: no MARK_SPAN, and 1-3 licence tokens instead of MARK_QUERY."""
    keys = rng.sample(range(FIRST_RANDOM_ID, vocab_size), pairs)
    values = random_tokens(rng, pairs, vocab_size)
    ids = text_slice(rng, text, prefix) + ([MARK_SPAN] if markers else [])
    for k, v in zip(keys, values):
        ids += [k, v]
    ids += text_slice(rng, text, filler) + separator(rng, text, MARK_QUERY, markers)
    order = list(range(pairs))
    rng.shuffle(order)
    targets = []
    for i in order:
        ids.append(keys[i])
        targets.append(len(ids))
        ids.append(values[i])
    if length is not None:
        if len(ids) > length:
            raise ValueError(f"mqar example of {len(ids)} tokens > length {length}")
        ids += text_slice(rng, text, length - len(ids))
    return Example(ids, targets)


def repeat_example(rng: random.Random, length: int, vocab_size: int = 4096) -> Example:
    """MARK_SPAN then a span of 4-64 random tokens repeated back to back up to ``length``; every
    token after the first copy is a target. The densest copy signal: it teaches the "find the
    earlier occurrence of the current token and emit its successor" circuit before the distances
    grow."""
    span = rng.randint(4, 64)
    tokens = random_tokens(rng, span, vocab_size)
    ids = [MARK_SPAN] + (tokens * (length // span + 1))[: length - 1]
    return Example(ids, list(range(1 + span, length)))


def random_copy(rng: random.Random, text: torch.Tensor, length: int = SEQ_LEN, max_filler: int = 384,
                markers_share: float = 1.0) -> Example:
    """A training copy sequence: span 8-64 tokens, filler 0-``max_filler``, prefix 0-64, padded to
    length; with the markers in ``markers_share`` of the rows."""
    markers = rng.random() < markers_share
    span = rng.randint(8, 64)
    filler = rng.randint(0, max(0, min(max_filler, length - 2 * span - 4)))
    prefix = rng.randint(0, min(64, length - 2 * span - 4 - filler))
    return copy_example(rng, text, span, filler, prefix, length, markers=markers)


def random_mqar(rng: random.Random, text: torch.Tensor, length: int = SEQ_LEN, max_filler: int = 384,
                markers_share: float = 1.0) -> Example:
    """A training MQAR sequence: 4-64 pairs, filler 0-``max_filler`` (as far as the length allows),
    prefix 0-64, padded to length; with the markers in ``markers_share`` of the rows."""
    markers = rng.random() < markers_share
    pairs = rng.randint(4, min(64, (length - 8) // 4))
    filler = rng.randint(0, max(0, min(max_filler, length - 4 * pairs - 4)))
    prefix = rng.randint(0, min(64, length - 4 * pairs - 4 - filler))
    return mqar_example(rng, text, pairs, filler, prefix, length, markers=markers)


# ---------------------------------------------------------------------------- evaluation


def eval_sets(heldout: torch.Tensor) -> tuple[list[Example], list[Example]]:
    """The fixed held-out copy and MQAR sequences (same for every model and every run)."""
    rng = random.Random(EVAL_SEED)
    copies = [copy_example(rng, heldout, EVAL_COPY["span"], EVAL_COPY["filler"]) for _ in range(EVAL_COPY["n"])]
    mqars = [mqar_example(rng, heldout, EVAL_MQAR["pairs"], EVAL_MQAR["filler"]) for _ in range(EVAL_MQAR["n"])]
    return copies, mqars


def plain_eval_sets(heldout: torch.Tensor) -> tuple[list[Example], list[Example]]:
    """The same sizes without the marker tokens (cues of 1-3 licence tokens), span and pairs at the
    very start of the sequence: retrieval that does not lean on the training format."""
    rng = random.Random(EVAL_SEED + 1)
    copies = [copy_example(rng, heldout, EVAL_COPY["span"], EVAL_COPY["filler"], markers=False)
              for _ in range(EVAL_COPY["n"])]
    mqars = [mqar_example(rng, heldout, EVAL_MQAR["pairs"], EVAL_MQAR["filler"], markers=False)
             for _ in range(EVAL_MQAR["n"])]
    return copies, mqars


@torch.no_grad()
def target_accuracy(model: torch.nn.Module, examples: list[Example], batch_size: int = 16) -> float:
    """Fraction of target tokens that are the argmax of the logits at the previous position."""
    hit = total = 0
    for i in range(0, len(examples), batch_size):
        chunk = examples[i : i + batch_size]
        width = max(len(e.ids) for e in chunk)
        ids = torch.tensor([e.ids + [0] * (width - len(e.ids)) for e in chunk])  # right padding: causal, harmless
        pred = model(input_ids=ids).logits.argmax(-1)
        for row, e in enumerate(chunk):
            pos = torch.tensor(e.targets)
            hit += int((pred[row, pos - 1] == ids[row, pos]).sum())
            total += len(e.targets)
    return hit / max(1, total)


@torch.no_grad()
def greedy_copy_accuracy(model: torch.nn.Module, examples: list[Example], batch_size: int = 16) -> float:
    """Generate each span greedily after its marker; fraction of positions equal to the span."""
    hit = total = 0
    for i in range(0, len(examples), batch_size):
        chunk = examples[i : i + batch_size]
        start, span = chunk[0].targets[0], len(chunk[0].targets)
        prompt = torch.tensor([e.ids[:start] for e in chunk])
        out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=span,
                             min_new_tokens=span, do_sample=False, pad_token_id=0)
        gen = out[:, start : start + span]
        want = torch.tensor([e.ids[start : start + span] for e in chunk])
        hit += int((gen == want).sum())
        total += want.numel()
    return hit / max(1, total)


def evaluate(model: torch.nn.Module, copies: list[Example], mqars: list[Example], ppl_ids: torch.Tensor,
             full_ids: torch.Tensor | None = None, greedy: bool = True,
             plain: tuple[list[Example], list[Example]] | None = None) -> dict[str, float]:
    model.eval()
    t0 = time.monotonic()
    res = {
        "copy_tf": target_accuracy(model, copies),
        "mqar": target_accuracy(model, mqars),
        "ppl_subset": math.exp(heldout_loss(model, ppl_ids)),
    }
    if plain is not None:
        res["copy_plain_tf"] = target_accuracy(model, plain[0])
        res["mqar_plain"] = target_accuracy(model, plain[1])
    if greedy:
        res["copy_greedy"] = greedy_copy_accuracy(model, copies)
    if full_ids is not None:
        res["ppl_heldout"] = math.exp(heldout_loss(model, full_ids))
    res["eval_s"] = round(time.monotonic() - t0, 1)
    return res


def load_model(path: Path) -> torch.nn.Module:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model


def load_corpus(corpus: Path, tokenizer_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    train = encode_docs(tok, [d["text"] for d in read_jsonl(corpus / "train.jsonl")])
    heldout = encode_docs(tok, [d["text"] for d in read_jsonl(corpus / "heldout.jsonl")])
    return train, heldout


# ------------------------------------------------------------------------------ training


def make_batch(rng: random.Random, gen: torch.Generator, train_ids: torch.Tensor,
               counts: dict[str, int], length: int = SEQ_LEN,
               reach: float = 1.0, markers_share: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Rows: counts['lm'] licence windows, then repeat, copy and MQAR rows, each ``length`` tokens.
    ``reach`` (0-1) scales the longest filler between a span and its copy (the distance
    curriculum). Returns (ids, labels for the retrieval rows, number of lm rows)."""
    starts = torch.randint(0, train_ids.numel() - length, (counts["lm"],), generator=gen).tolist()
    rows = [train_ids[s : s + length].tolist() for s in starts]
    synth = [repeat_example(rng, length) for _ in range(counts.get("repeat", 0))]
    scale = max(1.0, length / SEQ_LEN)  # rows longer than SEQ_LEN reach further back
    synth += [random_copy(rng, train_ids, length, round((32 + 352 * reach) * scale), markers_share)
              for _ in range(counts["copy"])]
    synth += [random_mqar(rng, train_ids, length, round((16 + 368 * reach) * scale), markers_share)
              for _ in range(counts["mqar"])]
    rows += [e.ids for e in synth]
    labels = torch.tensor([e.labels() for e in synth], dtype=torch.long).reshape(len(synth), length)
    return torch.tensor(rows, dtype=torch.long), labels, counts["lm"]


def induction_targets(ids: torch.Tensor) -> torch.Tensor:
    """For each position t, the position right after the most recent earlier occurrence of the token
    at t (where an induction head should look to predict t + 1), or -1 where the token is new or its
    previous occurrence is at t - 1."""
    out = torch.full(ids.shape, -1, dtype=torch.long)
    for row, tokens in enumerate(ids.tolist()):
        last: dict[int, int] = {}
        for t, token in enumerate(tokens):
            j = last.get(token)
            if j is not None and j + 1 < t:
                out[row, t] = j + 1
            last[token] = t
    return out


def supervise_attention(model: torch.nn.Module) -> None:
    """Every layer on eager attention, so that `output_attentions` returns the weights. All of them:
    the causal mask is built for the model's implementation, and an eager layer inside an SDPA model
    gets none (it would see the future)."""
    model.set_attn_implementation("eager")


def attention_loss(attentions: tuple[torch.Tensor, ...], ids: torch.Tensor, n_lm: int,
                   layers: tuple[int, int], prev_heads: tuple[int, ...] = (0,),
                   induction_heads: tuple[int, ...] = (0,)) -> torch.Tensor:
    """Attention supervision: `prev_heads` of layer `layers[0]` attend to the previous token (every
    row), `induction_heads` of layer `layers[1]` to the token after the current token's previous
    occurrence (synthetic rows, where that is the answer). Mean -log of the weight on the target key,
    summed over the two kinds. Several induction heads, because one head's value path is only
    head_dim wide: too narrow to carry which of 4,096 tokens to copy."""
    prev = attentions[layers[0]][:, list(prev_heads)].float()  # [B, h, T, T]
    induction = attentions[layers[1]][:, list(induction_heads)].float()
    t = torch.arange(1, ids.shape[1])
    loss = -torch.log(prev[:, :, t, t - 1] + 1e-6).mean()
    target = induction_targets(ids[n_lm:])
    rows, cols = (target >= 0).nonzero(as_tuple=True)
    if len(rows):
        loss = loss - torch.log(induction[n_lm + rows, :, cols, target[rows, cols]] + 1e-6).mean()
    return loss


def step_loss(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor, n_lm: int,
              weight: float, attn_weight: float = 0.0, layers: tuple[int, int] = (0, 1),
              heads: tuple[tuple[int, ...], tuple[int, ...]] = ((0,), (0,))
              ) -> tuple[torch.Tensor, float, float, float]:
    out = model(input_ids=ids, output_attentions=attn_weight > 0)
    logits = out.logits.float()
    vocab = logits.size(-1)
    lm = torch.zeros(())
    if n_lm:
        lm = F.cross_entropy(logits[:n_lm, :-1].reshape(-1, vocab), ids[:n_lm, 1:].reshape(-1))
    ret = torch.zeros(())
    if labels.numel():
        ret = F.cross_entropy(logits[n_lm:, :-1].reshape(-1, vocab), labels[:, 1:].reshape(-1),
                              ignore_index=IGNORE)
    att = attention_loss(out.attentions, ids, n_lm, layers, *heads) if attn_weight > 0 else torch.zeros(())
    return lm + weight * ret + attn_weight * att, lm.item(), ret.item(), att.item()


def mix_counts(batch_size: int, mix: tuple[float, ...]) -> dict[str, int]:
    """Rows per kind from the shares (lm, copy, mqar[, repeat]); lm takes the rounding."""
    total = sum(mix)
    counts = {kind: round(batch_size * share / total)
              for kind, share in zip(("copy", "mqar", "repeat"), mix[1:])}
    return {"lm": batch_size - sum(counts.values()), **counts}


def save_checkpoint(model, opt, out: Path, state: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_model(model, out)
    for name in TOKENIZER_FILES:
        shutil.copy(BUNDLED / name, out / name)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), **state}, out / "train_state.pt.tmp")
    os.replace(out / "train_state.pt.tmp", out / "train_state.pt")


def log_eval(out: Path, record: dict) -> None:
    print("EVAL " + json.dumps(record), flush=True)
    with (out / "eval.jsonl").open("a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def train(args: argparse.Namespace) -> None:
    cfg = TrainConfig(minutes=args.minutes, batch_size=args.batch_size, lr=args.lr, warmup_steps=args.warmup,
                      log_every=args.log_every, seed=args.seed, threads=args.threads)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    train_ids, heldout_ids = load_corpus(args.corpus, BUNDLED)
    ppl_ids = heldout_ids[: args.ppl_windows * SEQ_LEN]
    copies, mqars = eval_sets(heldout_ids)
    plain = plain_eval_sets(heldout_ids)
    counts = mix_counts(cfg.batch_size, tuple(args.mix))
    print(f"train tokens {train_ids.numel():,}  held-out {heldout_ids.numel():,}  rows/step {counts}", flush=True)

    resume_state = None
    if args.resume:
        resume_state = torch.load(args.out / "train_state.pt", weights_only=False)
        model = load_model(BUNDLED)
        model.load_state_dict(resume_state["model"])
    else:
        model = load_model(args.init)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "eval.jsonl").unlink(missing_ok=True)
    model.generation_config.pad_token_id = 0
    if args.attn_supervision > 0:
        supervise_attention(model)
    decay = [p for _, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for _, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=cfg.betas)
    rng = random.Random(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    step, prior_s, train_s = 0, 0.0, 0.0
    if resume_state is not None:
        opt.load_state_dict(resume_state["opt"])
        step, prior_s, train_s = resume_state["step"], resume_state["elapsed_s"], resume_state["train_s"]
        rng.setstate(resume_state["py_rng"])
        gen.set_state(resume_state["torch_gen"])
        print(f"resumed at step {step}, {prior_s / 60:.1f} of {cfg.minutes:g} min used", flush=True)
    else:
        record = {"step": 0, "elapsed_min": 0.0, "train_min": 0.0,
                  **evaluate(model, copies, mqars, ppl_ids, greedy=args.greedy_eval, plain=plain)}
        log_eval(args.out, record)

    budget = cfg.minutes * 60.0
    start = time.monotonic() - prior_s
    last_eval = time.monotonic()
    run = {"loss": 0.0, "lm": 0.0, "ret": 0.0, "att": 0.0, "n": 0}

    def checkpoint(final: bool) -> None:
        elapsed = time.monotonic() - start
        record = {"step": step, "elapsed_min": round(elapsed / 60, 2), "train_min": round(train_s / 60, 2),
                  **evaluate(model, copies, mqars, ppl_ids, heldout_ids if final else None,
                             greedy=args.greedy_eval, plain=plain)}
        if final:
            record["final"] = True
        log_eval(args.out, record)
        model.train()
        save_checkpoint(model, opt, args.out, {
            "step": step, "elapsed_s": time.monotonic() - start, "train_s": train_s,
            "py_rng": rng.getstate(), "torch_gen": gen.get_state(), "config": asdict(cfg),
            "args": {k: str(v) for k, v in vars(args).items()}})

    model.train()
    while True:
        elapsed = time.monotonic() - start
        if elapsed >= min(budget, args.stop_min * 60):
            break
        t_step = time.monotonic()
        lr = lr_at(step, elapsed / budget, cfg)
        for group in opt.param_groups:
            group["lr"] = lr
        reach = min(1.0, elapsed / budget / args.reach_at) if args.reach_at > 0 else 1.0
        length, step_counts = args.seq_len, counts
        if args.long_every and step % args.long_every == args.long_every - 1:
            # a step of rows `long_factor` times as long (and as many times fewer): retrieval across
            # distances the usual rows never reach
            length = args.seq_len * args.long_factor
            step_counts = {k: -(-n // args.long_factor) for k, n in counts.items()}
        ids, labels, n_lm = make_batch(rng, gen, train_ids, step_counts, length, reach, args.markers_share)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            attn_weight = args.attn_supervision if elapsed < args.attn_supervision_min * 60 else 0.0
            loss, lm, ret, att = step_loss(model, ids, labels, n_lm, args.retrieval_weight, attn_weight,
                                           tuple(args.supervised_layers),
                                           (tuple(args.prev_heads), tuple(args.induction_heads)))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        train_s += time.monotonic() - t_step
        for key, value in (("loss", loss.item()), ("lm", lm), ("ret", ret), ("att", att)):
            run[key] += value
        run["n"] += 1
        if step % cfg.log_every == 0 or step == 1:
            n = run.pop("n")
            print(f"step {step:5d}  loss {run['loss'] / n:.4f}  lm {run['lm'] / n:.4f}  "
                  f"retrieval {run['ret'] / n:.4f}  attention {run['att'] / n:.4f}  lr {lr:.2e}  "
                  f"elapsed {(time.monotonic() - start) / 60:.1f} min",
                  flush=True)
            run = {"loss": 0.0, "lm": 0.0, "ret": 0.0, "att": 0.0, "n": 0}
        if time.monotonic() - last_eval >= args.eval_every_min * 60 and time.monotonic() - start < budget:
            checkpoint(final=False)
            last_eval = time.monotonic()
    checkpoint(final=True)
    print(f"done: {step} steps, {train_s / 60:.1f} min training, checkpoint in {args.out}", flush=True)


# ---------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", type=Path, default=Path("build/corpus"))
    p.add_argument("--init", type=Path, default=BUNDLED, help="model to continue from")
    p.add_argument("--out", type=Path, default=Path("build/retrieval-model"))
    p.add_argument("--eval-only", type=Path, metavar="MODEL_DIR", help="print copy / MQAR / perplexity and exit")
    p.add_argument("--resume", action="store_true", help="continue from <out>/train_state.pt with the remaining budget")
    p.add_argument("--minutes", type=float, default=40.0, help="wall-clock budget (training + evaluations)")
    p.add_argument("--stop-min", type=float, default=float("inf"),
                   help="stop (and checkpoint) once the clock passes this many minutes, the schedule still "
                        "set by --minutes: a phase of a longer run, continued with --resume")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--mix", type=float, nargs="+", default=(0.5, 0.25, 0.25), metavar="SHARE",
                   help="share of each row kind in a batch: LM COPY MQAR [REPEAT]")
    p.add_argument("--seq-len", type=int, default=SEQ_LEN, help="tokens per training row")
    p.add_argument("--markers-share", type=float, default=1.0,
                   help="share of copy / MQAR rows announced by the marker tokens; the rest use a few licence "
                        "tokens as the cue, so retrieval does not hinge on the markers")
    p.add_argument("--long-every", type=int, default=0,
                   help="every Nth step uses rows --long-factor times as long, that many times fewer (0 = never)")
    p.add_argument("--long-factor", type=int, default=2)
    p.add_argument("--reach-at", type=float, default=0.0,
                   help="fraction of the budget over which the longest span-to-copy filler grows to "
                        "its full length (0: full length from the start)")
    p.add_argument("--retrieval-weight", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--eval-every-min", type=float, default=5.0)
    p.add_argument("--ppl-windows", type=int, default=32)
    p.add_argument("--no-greedy-eval", dest="greedy_eval", action="store_false")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--attn-supervision", type=float, default=0.0,
                   help="weight of the attention-supervision loss (`attention_loss`): a previous-token head and "
                        "an induction head taught directly, which skips the long plateau before they form "
                        "from the next-token loss alone; 0 = off")
    p.add_argument("--attn-supervision-min", type=float, default=1e9,
                   help="minutes of the budget during which the supervision applies")
    p.add_argument("--supervised-layers", type=int, nargs=2, default=(0, 1), metavar=("PREV", "INDUCTION"),
                   help="layers of the supervised heads: previous-token, induction")
    p.add_argument("--prev-heads", type=int, nargs="+", default=(0,), help="previous-token heads (first layer)")
    p.add_argument("--induction-heads", type=int, nargs="+", default=(0,), help="induction heads (second layer)")
    p.add_argument("--bf16", action="store_true",
                   help="bfloat16 autocast for the forward and backward matmuls (float32 weights and optimizer); "
                        "about 1.7x the steps per second on a CPU with AVX-512 BF16")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    if args.eval_only is not None:
        _, heldout_ids = load_corpus(args.corpus, BUNDLED)
        copies, mqars = eval_sets(heldout_ids)
        model = load_model(args.eval_only)
        res = evaluate(model, copies, mqars, heldout_ids[: args.ppl_windows * SEQ_LEN], heldout_ids,
                       greedy=args.greedy_eval, plain=plain_eval_sets(heldout_ids))
        print(json.dumps({"model": str(args.eval_only), **res}))
        return
    train(args)


if __name__ == "__main__":
    sys.exit(main())
