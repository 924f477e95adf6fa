"""Helpers for the batch-job tests: a tiny text model, input files, output readers.

The tiny model is a random 2-layer Llama from `model_factory` with a word-level BPE tokenizer
trained here on a few sentences (vocab ~200), plus a chat template: enough to exercise every
path of the job runner in well under a second per shard.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
WORDS = ("the licence permits copying modification and distribution of this software provided that notice "
         "warranty liability copyright holder source code binary form conditions").split()
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}<|user|> {{ m['content'] }} "
                 "{% elif m['role'] == 'assistant' %}<|assistant|> {{ m['content'] }} </s> {% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@contextlib.contextmanager
def local_ray(num_cpus: int):
    """A local Ray for one test module; actors import flashx_batch from this checkout, like the
    executor's own local start does."""
    import ray

    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()


def build_tiny_model(out_dir: Path) -> Path:
    """A random Llama whose vocabulary matches a tokenizer trained on WORDS; returns the directory."""
    from model_factory import build
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    rng = random.Random(0)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(30)) for _ in range(200)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=200, special_tokens=SPECIALS, show_progress=False))
    build("llama", out_dir, vocab_size=tok.get_vocab_size(), max_position_embeddings=1024)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE}))
    return out_dir


def prompt_of(n_words: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def sample_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """`n` rows with mixed prompt lengths (id, source, prompt)."""
    rng = random.Random(seed)
    return [{"id": i, "source": f"doc-{i}", "prompt": prompt_of(rng.choice([3, 8, 20, 40, 90]), rng)}
            for i in range(n)]


def write_parquet(path: Path, rows: list[dict[str, Any]], schema: pa.Schema | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


def overrides(model_dir: Path, data_path: Path | str, out_dir: Path | None, *extra: str) -> list[str]:
    """Hydra overrides: the smoke preset pointed at a test model, input and output."""
    base = ["conf=smoke", f"model.path={model_dir}", f"data.path={data_path}", "data.limit=null",
            "data.passthrough_columns=[]", "data.passthrough_if_present=[]", "executor.progress_interval_s=1000"]
    if out_dir is not None:
        base.append(f"output.dir={out_dir}")
    return base + list(extra)


def output_ids(out_dir: Path) -> tuple[Counter, Counter]:
    """(id counts in generations/, id counts in errors/) over every part file present."""
    def ids(kind: str) -> Counter:
        parts = sorted((out_dir / kind).glob("part-*.parquet"))
        return Counter(v for p in parts for v in pq.read_table(p, columns=["id"]).column("id").to_pylist())

    return ids("generations"), ids("errors")


def generations(out_dir: Path) -> dict[Any, str]:
    table = pq.read_table(out_dir / "generations")
    return dict(zip(table.column("id").to_pylist(), table.column("generated_text").to_pylist(), strict=True))


def tree_snapshot(root: Path) -> dict[str, bytes]:
    """Every file under `root` with its bytes (to prove a run left a directory untouched)."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def cli(args: list[str], cwd: Path, timeout: float = 180, **kwargs: Any) -> Any:
    """Run `python -m flashx_batch ARGS` (the real entry point) with this checkout importable.

    background=True returns the Popen (stdout+stderr piped together); otherwise the CompletedProcess.
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "HYDRA_FULL_ERROR": "0"}
    cmd = [sys.executable, "-m", "flashx_batch", *args]
    if kwargs.pop("background", False):
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, **kwargs)


_TINY: dict[str, Path] = {}


def tiny_model_dir() -> Path:
    """The tiny model, built once per test process into a temporary directory."""
    if "dir" not in _TINY:
        import tempfile

        _TINY["dir"] = build_tiny_model(Path(tempfile.mkdtemp(prefix="fx-tiny-model-")))
    return _TINY["dir"]


def faults_override(specs: list[str]) -> str:
    """`executor.faults=[...]` as a Hydra override (each spec quoted: `:` and `=` are Hydra syntax)."""
    return "executor.faults=[" + ",".join(f"'{s}'" for s in specs) + "]"


def assert_finished_layout(out_dir: Path) -> None:
    """A finished job's directory holds, per kind, exactly the consolidated files `_SUCCESS` lists (no
    orphan, no per-piece part left), and every committed manifest points into them."""
    success = json.loads((out_dir / "_SUCCESS").read_text())
    for kind in ("generations", "errors", "stats"):
        present = sorted(f"{kind}/{p.name}" for p in (out_dir / kind).iterdir())
        assert present == sorted(success["files"][kind]), (kind, present)
    for m in (out_dir / "_manifest").glob("*.json"):
        record = json.loads(m.read_text())
        assert sorted(record["slices"]) == sorted(record["files"]), m.name
        assert all(where[0] in success["files"][kind] for kind, where in record["slices"].items()), m.name
