"""Benchmark models: the bundled demo model, and random Llamas of a named size built on the fly."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

# ~27 M parameters: the "small real model" shape the issues ask for, random weights.
LLAMA_27M = dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                 num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                 tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                 # wider than the 0.02 default: greedy continuations vary instead of repeating one token,
                 # and top-2 logit margins are large enough that a parity check compares real sequences
                 initializer_range=0.1)


def random_llama(shape: dict, seed: int = 0, out_dir: Path | None = None, dtype: torch.dtype = torch.float32) -> Path:
    """Save a random-weight `LlamaForCausalLM` of `shape` and return its directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir or tempfile.mkdtemp(prefix="flashx-bench-"))
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**shape)).to(dtype)
    model.save_pretrained(out)
    return out


def parameter_count(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            count = 1
            for dim in f.get_slice(name).get_shape():
                count *= dim
            total += count
    return total
