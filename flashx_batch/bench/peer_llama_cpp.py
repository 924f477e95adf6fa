"""llama.cpp as a benchmark peer: the checkpoint converted with llama.cpp's own converter, generated
through llama-cpp-python's low-level API in a continuous-batching loop.

Optional extras, never dependencies: `llama-cpp-python` (builds llama.cpp from source, ~14 minutes on
2 cores) and a llama.cpp source tree for its converter, `convert_hf_to_gguf.py` beside `gguf-py/`. The
llama-cpp-python source distribution carries the matching one:

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 && tar xzf llama_cpp_python-0.3.36.tar.gz
    export LLAMA_CPP_SOURCE=$PWD/llama_cpp_python-0.3.36/vendor/llama.cpp

The converter refuses a byte-level BPE tokenizer whose pre-tokenizer it has no fingerprint for (ours);
the benchmark feeds token ids and never asks llama.cpp to tokenize, so the conversion labels it `gpt-2`
(the byte-level pre-tokenizer it is) and is otherwise the converter's own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from flashx_batch.bench.workloads import Workload

# llama.cpp's file types for our two precision classes: float32 (with float32 K, V and attention), and int8
# weights in blocks of 32 with a scale each (q8_0: llama.cpp's CPU kernels quantize activations to int8
# on the fly; K and V stay in its default float16 there)
OUTTYPES = {"float32": "f32", "int8": "q8_0"}

_CONVERT = """
import sys
source = sys.argv[1]
sys.path[:0] = [source, source + "/gguf-py"]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"  # token ids in, never text: see the module
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
convert_hf_to_gguf.main()
"""


def converter_source() -> Path:
    """The llama.cpp source tree named by LLAMA_CPP_SOURCE, checked; a SystemExit saying how to get one."""
    source = os.environ.get("LLAMA_CPP_SOURCE")
    how = ("set LLAMA_CPP_SOURCE to a llama.cpp source tree (its convert_hf_to_gguf.py and gguf-py/); the "
           "llama-cpp-python source distribution carries one: see flashx_batch/bench/peer_llama_cpp.py")
    if not source:
        raise SystemExit(f"--peers llama_cpp needs llama.cpp's converter: {how}")
    if not (Path(source) / "convert_hf_to_gguf.py").is_file() or not (Path(source) / "gguf-py").is_dir():
        raise SystemExit(f"LLAMA_CPP_SOURCE={source} holds no convert_hf_to_gguf.py and gguf-py/: {how}")
    return Path(source)


def convert(model_dir: Path, out: Path, outtype: str) -> Path:
    if not out.exists():
        done = subprocess.run([sys.executable, "-c", _CONVERT, str(converter_source()), str(model_dir),
                               "--outtype", outtype, "--outfile", str(out)], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"llama.cpp's converter failed on {model_dir} ({outtype}):\n{done.stderr[-3000:]}")
    return out


class LlamaCpp:
    """One llama.cpp model and context: `batch` sequences at once, each up to `max_len` tokens."""

    def __init__(self, model_dir: Path, work: Path, precision: str, threads: int, batch: int, max_len: int,
                 max_prompt: int) -> None:
        import llama_cpp as lc
        from llama_cpp._logger import set_verbose

        set_verbose(False)  # llama.cpp's loading and graph notes: errors only
        self.lc = lc
        path = convert(model_dir, work / f"llama-{OUTTYPES[precision]}.gguf", OUTTYPES[precision])
        lc.llama_backend_init()
        model_params = lc.llama_model_default_params()
        # q8_0 with llama.cpp's repacked CPU weight layouts ("extra buffer types") crashes in llama_decode
        # (llama-cpp-python 0.3.36 built with GGML_NATIVE on an AVX-512 CPU): int8 runs the plain q8_0 kernels
        model_params.use_extra_bufts = precision != "int8"
        self.model = lc.llama_model_load_from_file(str(path).encode(), model_params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        params = lc.llama_context_default_params()
        # one sequence per row at once, and one more holding a shared prefix (W3) to copy from
        params.n_ctx = (batch + 1) * max_len
        params.n_seq_max = batch + 1
        params.kv_unified = False  # each sequence its own max_len cells: attention reads only its own
        # a decode call takes every live row's next token plus whole prompts of rows joining the batch;
        # llama.cpp computes it in micro-batches of its default size
        params.n_batch = batch * max_prompt + batch
        params.n_threads = params.n_threads_batch = threads
        if precision == "float32":  # float32 throughout, as ours: llama.cpp keeps K and V in float16 by
            params.type_k = params.type_v = lc.GGML_TYPE_F32  # default, and its CPU flash attention rounds
            params.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_DISABLED  # through float16 (27/48 rows identical
            # to ours on the 27 M shape with it, 48/48 without, 2026-12-02)
        params.no_perf = True
        self.ctx = lc.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.memory = lc.llama_get_memory(self.ctx)
        self.vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.capacity, self.slots, self.prefix_seq = params.n_batch, batch, batch
        self.batch = lc.llama_batch_init(self.capacity, 0, 1)

    def close(self) -> None:
        lc = self.lc
        lc.llama_batch_free(self.batch)
        lc.llama_free(self.ctx)
        lc.llama_model_free(self.model)

    def _add(self, n: int, token: int, pos: int, seq: int, logits: bool) -> None:
        b = self.batch
        b.token[n], b.pos[n], b.n_seq_id[n], b.logits[n] = token, pos, 1, logits
        b.seq_id[n][0] = seq

    def generate(self, workload: Workload, batch: int) -> list[list[int]]:
        """Each row's greedy tokens, exactly its own count, in input order: rows taken longest prompt
        first (as CTranslate2's batches), a finished row's sequence freed and the next row's prompt
        decoded in the same call as the live rows' next tokens. Rows sharing a prefix
        (`Workload.shared_prefixes`, W3) go group by group: the group's prefix is decoded once into a
        sequence of its own, copied into each row's sequence as the row joins, and only the row's
        own tokens are decoded after it."""
        import numpy as np

        lc = self.lc
        lc.llama_memory_clear(self.memory, True)
        shared = {i: (g, length) for g, (length, rows) in enumerate(workload.shared_prefixes()) for i in rows}
        # popped from the end: rows without a shared prefix first, then group after group
        queue = sorted(range(workload.rows), key=lambda i: (shared.get(i, (-1, 0))[0], -len(workload.prompts[i])))[::-1]
        out: list[list[int]] = [[] for _ in range(workload.rows)]
        live: dict[int, int] = {}  # sequence slot -> row
        free = list(range(min(batch, self.slots)))[::-1]
        loaded = None  # the group whose prefix the prefix sequence holds
        while queue or live:
            group, skip = shared.get(queue[-1], (None, 0)) if queue else (None, 0)
            if group is not None and group != loaded and free:  # the next group's prefix, a call of its own
                self._decode_prefix(workload.prompts[queue[-1]][:skip])  # (earlier rows' copies are done)
                loaded = group
            n, reading = 0, []  # batch index of each row's logits
            for seq, row in live.items():
                pos = len(workload.prompts[row]) + len(out[row]) - 1
                self._add(n, out[row][-1], pos, seq, True)
                reading.append((n, seq, row))
                n += 1
            while queue and free:
                row = queue[-1]
                group, skip = shared.get(row, (None, 0))
                prompt = workload.prompts[row]
                if n + len(prompt) - skip > self.capacity or (group is not None and group != loaded):
                    break  # the next group joins after its prefix is decoded, at the top of the next step
                queue.pop()
                seq = free.pop()
                if skip:  # the shared prefix's cells, copied (a whole sequence's buffer: streams are separate)
                    lc.llama_memory_seq_cp(self.memory, self.prefix_seq, seq, -1, -1)
                for pos in range(skip, len(prompt)):
                    self._add(n, prompt[pos], pos, seq, pos == len(prompt) - 1)
                    n += 1
                live[seq] = row
                reading.append((n - 1, seq, row))
            self.batch.n_tokens = n
            if lc.llama_decode(self.ctx, self.batch) != 0:
                raise RuntimeError("llama_decode failed (KV cache full?)")
            for index, seq, row in reading:
                logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(self.ctx, index), shape=(self.vocab,))
                out[row].append(int(logits.argmax()))
                if len(out[row]) >= workload.max_new_tokens[row]:
                    del live[seq]
                    free.append(seq)
                    lc.llama_memory_seq_rm(self.memory, seq, -1, -1)
        return out

    def _decode_prefix(self, prefix: list[int]) -> None:
        """`prefix` into the prefix sequence (its previous contents dropped), no logits."""
        lc = self.lc
        lc.llama_memory_seq_rm(self.memory, self.prefix_seq, -1, -1)
        for pos, token in enumerate(prefix):
            self._add(pos, token, pos, self.prefix_seq, False)
        self.batch.n_tokens = len(prefix)
        if lc.llama_decode(self.ctx, self.batch) != 0:
            raise RuntimeError("llama_decode failed on a shared prefix")
