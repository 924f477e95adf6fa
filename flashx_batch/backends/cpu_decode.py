"""Decode attention on CPU: one new query per row against that row's cached keys, read slot by slot.

The arena stores a row's cache as [slot, kv_head, dim]. torch's CPU attention kernel walks it one
(row, head) pair at a time: every decode step pays a fixed cost per pair (small GEMMs, buffers) and
strides through each row's memory once per head, so the step costs what the rows times heads cost,
not what the bytes do. This kernel reads each slot of a row once, all its heads together (one
contiguous run of memory), in two passes (scores, then the softmax-weighted values), one row per
thread (with fewer rows than threads, each row's heads shared out among them). The gain per shape:
`python -m flashx_batch.bench.cpu_decode` (docs/benchmarks.md, "CPU decode attention").

Compiled with numba (a dependency of the package) for each read layout and cache dtype the first time a
job reads that way (`_ready`: a job compiles only what it runs, and the log says when it does), and
cached on disk next to this file or in numba's user cache (neither writable: compiled in each process).
`usable` says whether a call takes this path: CPU tensors; a float32 cache, or
bfloat16 (widened to float32 as it is read) with head_dim >= 64, below which torch's bfloat16 kernel
is as fast; a layout whose rows are evenly spaced whole slots with contiguous heads, at least a row's
slots apart (the arena's stripes and extents). A paged batch (shared prefixes) hands the layer's flat
cache and its slot table instead (`usable_paged`, `attend_paged`): its pages are read where they lie,
not gathered into a copy first. Anything else, or numba failing to
import or compile, goes to `F.scaled_dot_product_attention` as before. The kernel runs on numba's
OpenMP pool: a process forked after it ran must not call it (GNU OpenMP aborts such a child).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

log = logging.getLogger(__name__)

_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def _kernel():
    """The compiled kernel, or None where numba is missing or broken (then SDPA serves every call)."""
    numba = load_numba("CPU decode attention falls back to torch's kernel")
    if numba is None:
        return None
    from numba import prange
    from numba.extending import overload

    def widen(src, buf):  # pragma: no cover - replaced by the overload inside compiled code
        raise NotImplementedError

    @overload(widen)
    def _widen(src, buf):
        """One slot's [Hkv, D] as float32: float32 as it is, bfloat16 bits (the upper half of a
        float32) shifted into `buf`."""
        if src.dtype == numba.types.uint16:
            def impl(src, buf):
                bits = buf.view(np.uint32)
                for h in range(src.shape[0]):
                    for d in range(src.shape[1]):
                        bits[h, d] = np.uint32(src[h, d]) << np.uint32(16)
                return buf
            return impl
        return lambda src, buf: src

    def slot(cache, table, r, s, first, last):  # pragma: no cover - replaced by the overload when compiled
        raise NotImplementedError

    @overload(slot)
    def _slot(cache, table, r, s, first, last):
        """Row r's slot s, KV heads [first, last): rows laid out slot after slot ([B, row slots, Hkv,
        D], the table unused), or a flat cache [N, Hkv, D] with a paged batch's slot table [B, L] or
        each row's first slot [B]. Chosen by the dimensions when the kernel compiles: no branch per slot."""
        if cache.ndim == 4:
            return lambda cache, table, r, s, first, last: cache[r, s, first:last]
        if table.ndim == 1:  # each row's slots one after another from its own first slot (extents)
            return lambda cache, table, r, s, first, last: cache[table[r] + s, first:last]
        return lambda cache, table, r, s, first, last: cache[table[r, s], first:last]

    def attend(q, keys, values, table, slots, lengths, bias, scale, parts, out):  # pragma: no cover - compiled
        rows, kv_heads, group, dim = q.shape
        span = (kv_heads + parts - 1) // parts
        for job in prange(rows * parts):  # one row's KV heads [first, last) per job
            r, first = job // parts, (job % parts) * span
            last = min(kv_heads, first + span)
            heads = max(0, last - first)
            count = lengths[r] if lengths.shape[0] else slots  # this row's slots: all `slots`, or its own
            buf = np.empty((heads, dim), np.float32)
            scores = np.empty((count, heads, group), np.float32)
            peak = np.full((heads, group), -np.inf, np.float32)
            for s in range(count):
                k = widen(slot(keys, table, r, s, first, last), buf)
                add = bias[r, s] if bias.shape[0] else np.float32(0.0)
                for h in range(heads):
                    for g in range(group):
                        acc = np.float32(0.0)
                        for d in range(dim):
                            acc += q[r, first + h, g, d] * k[h, d]
                        x = acc * scale + add
                        scores[s, h, g] = x
                        peak[h, g] = max(peak[h, g], x)
            total = np.zeros((heads, group), np.float32)
            acc_out = np.zeros((heads, group, dim), np.float32)
            for s in range(count):
                v = widen(slot(values, table, r, s, first, last), buf)
                for h in range(heads):
                    for g in range(group):
                        p = np.exp(scores[s, h, g] - peak[h, g])
                        total[h, g] += p
                        for d in range(dim):
                            acc_out[h, g, d] += p * v[h, d]
            for h in range(heads):
                for g in range(group):
                    for d in range(dim):
                        out[r, first + h, g, d] = acc_out[h, g, d] / total[h, g]

    try:
        kernel = _compile(numba, attend)
    except Exception as exc:  # a compiler error on this platform: never fatal, only slower
        log.warning("CPU decode kernel failed to compile (%s): torch's kernel serves decode attention", exc)
        return None
    return numba, kernel


# Fast-math without `nnan` / `ninf`: masked slots carry -inf, which those flags would make undefined.
_FASTMATH = {"nsz", "arcp", "contract", "afn", "reassoc"}


# numba's parallel regions are entered one thread at a time, package-wide: its `workqueue` threading layer
# (where OpenMP and TBB are missing) kills the process on concurrent entry, and the other layers would
# oversubscribe the cores anyway. Reentrant: a kernel's caller may already hold it.
_PARALLEL = threading.RLock()
_threads_started = False


def load_numba(without: str):
    """numba with its thread pool started, or None where it cannot be imported (logged with `without`: what
    serves instead). Never fatal.

    numba's OpenMP layer binds to the OpenMP runtime torch loaded (torch loads its libgomp globally), and when
    it starts its pool (on the first parallel call or thread-count change) it sets that runtime's thread count
    to every core: a job asking for one thread ran every later torch op on all of them. The pool starts here,
    once, and torch gets its count back."""
    global _threads_started
    try:
        import numba
    except Exception as exc:  # an ImportError, or numba refusing this numpy
        log.info("numba unavailable (%s): %s", exc, without)
        return None
    with _PARALLEL:
        if not _threads_started:
            # OpenMP first, as torch's CPU kernels: numba's own work queue hands each call to its threads far
            # more slowly (the benchmark reads it with NUMBA_THREADING_LAYER=workqueue). Set before the pool
            # starts, which is when numba picks its layer; an explicit setting is left alone. Through the
            # environment as well: numba re-reads it (and resets the config) when it recompiles after another
            # NUMBA_* variable changed.
            if "NUMBA_THREADING_LAYER" not in os.environ and "NUMBA_THREADING_LAYER_PRIORITY" not in os.environ:
                os.environ["NUMBA_THREADING_LAYER_PRIORITY"] = "omp tbb workqueue"
                numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]
            threads = torch.get_num_threads()
            try:
                numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))  # starts the pool
            except Exception as exc:  # no threading layer: the parallel kernels' own probes fail and say so
                log.info("numba's thread pool did not start (%s)", exc)
            _threads_started = True
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
    return numba


@contextlib.contextmanager
def parallel_region(numba):
    """Hold the package's one lock around a numba parallel call, run on torch's thread count (which it leaves
    as it found it)."""
    with _PARALLEL:
        threads = torch.get_num_threads()
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        try:
            yield
        finally:
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)


def compile_kernel(numba, source, **options):
    """`source` jitted with numba's on-disk cache (next to the package or numba's user cache), or without
    one where neither is writable (a read-only install: compiled in each process). Shared by every numba
    kernel of the package."""
    try:
        return numba.njit(cache=True, **options)(source)
    except RuntimeError as exc:  # "cannot cache function ...: no locator available"
        log.info("no writable numba cache (%s): %s compiles in every process", exc, source.__name__)
        return numba.njit(**options)(source)


def _compile(numba, source):
    """`source` as a lazily compiling dispatcher (`compile_kernel`). Nothing is compiled here: `_ready`
    compiles the layouts and dtypes a job reads, on first use."""
    return compile_kernel(numba, source, parallel=True, fastmath=_FASTMATH)


# the kernel's three read layouts, each as a tiny constant-cache call: (cache shape, slot table, lengths)
_PROBES = {"stripes": ((1, 2, 1, 4), np.zeros((0, 0), np.int64), np.zeros(0, np.int64)),
           "pages": ((2, 1, 4), np.zeros((1, 2), np.int64), np.zeros(0, np.int64)),
           "extents": ((2, 1, 4), np.zeros(1, np.int64), np.full(1, 2, np.int64))}


@contextlib.contextmanager
def _compile_lock(cache_dir: str | None):
    """One process of a machine compiles at a time (the Ray actors of one node start together): the others
    wait, then load what it cached instead of compiling the same kernel on the same cores."""
    if cache_dir is None:
        yield
        return
    try:
        os.makedirs(cache_dir, exist_ok=True)
        handle = open(os.path.join(cache_dir, ".flashx-compile.lock"), "a")  # noqa: SIM115 - held across the yield
    except OSError:  # a cache directory this process cannot write: compile unlocked
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@functools.cache
def _ready(layout: str, dtype: torch.dtype) -> bool:
    """Whether the kernel serves `layout` for a `dtype` cache: compiled (or loaded from the disk cache) and
    checked on a constant cache the first time a job reads that way, so a job compiles only what it runs
    and a compiler error means torch's kernel, never a failed step. Says once in the log when it compiles."""
    compiled = _kernel()
    if compiled is None:
        return False
    numba, kernel = compiled
    shape, table, lengths = _PROBES[layout]
    np_dtype = np.float32 if dtype == torch.float32 else np.uint16
    stats = getattr(kernel, "stats", None)  # numba's cache counters (a cached dispatcher only)
    misses = sum(stats.cache_misses.values()) if stats is not None else 0
    started = time.perf_counter()
    try:
        query, cache = np.ones((1, 1, 1, 4), np.float32), np.ones(shape, np_dtype)
        out = np.empty_like(query)
        bias = np.zeros((0, 0) if len(lengths) else (1, 2), np.float32)
        with _compile_lock(stats.cache_path if stats is not None else None), parallel_region(numba):
            kernel(query, cache, cache, table, 2, lengths, bias, np.float32(0.5), 1, out)
        if not np.allclose(out, 1.0 if np_dtype == np.float32 else 0.0):  # uint16 1 is a subnormal bfloat16
            raise RuntimeError(f"the compiled kernel returned {out.ravel()} on a constant cache")
    except Exception as exc:  # a compiler error on this platform: never fatal, only slower
        log.warning("CPU decode kernel (%s, %s) unavailable (%s): torch's kernel serves those reads", layout,
                    dtype, exc)
        return False
    if stats is None or sum(stats.cache_misses.values()) > misses:
        where = f"cached in {stats.cache_path}; later runs load it" if stats is not None else "not cached"
        log.info("compiled the CPU decode kernel for %s %s reads in %.1f s (once per machine: %s)", layout,
                 str(dtype).removeprefix("torch."), time.perf_counter() - started, where)
    return True


def usable(keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether `attend` serves keys and values [B, Hkv, L, D] laid out as the arena's strided views
    are: on the CPU, float32 or bfloat16, each slot's heads side by side (head stride D, slot stride
    Hkv * D), rows a whole number of slots apart, values strided as keys. Checked before `_kernel()`,
    so other devices never import numba."""
    if keys.device.type != "cpu" or keys.dtype not in _DTYPES or keys.dim() != 4:
        return False
    if values.dtype != keys.dtype or values.shape != keys.shape or values.stride() != keys.stride():
        return False
    rows, heads, length, dim = keys.shape
    if keys.dtype == torch.bfloat16 and dim < 64:  # torch's own bfloat16 kernel is as fast there
        return False
    slot = heads * dim
    ok = keys.stride(3) == 1 and keys.stride(1) == dim and keys.stride(2) == slot and keys.stride(0) % slot == 0
    # rows apart by at least their L slots (no overlapping or broadcast rows), and the kernel views whole
    # rows (`_stripes`): the last one must lie inside each tensor's storage
    ok = ok and (rows == 1 or keys.stride(0) >= length * slot)
    ok = ok and all(t.storage_offset() + rows * keys.stride(0) <= t.untyped_storage().nbytes() // t.element_size()
                    for t in (keys, values))
    return ok and _ready("stripes", keys.dtype)


def _stripes(t: torch.Tensor) -> np.ndarray:
    """A view [B, Hkv, L, D] as the whole rows it cuts from, [B, row stride / slot stride, Hkv, D]: a
    C-contiguous numpy array over the same memory (zero copy). The kernel reads the first L slots of
    each row."""
    rows, heads, _, dim = t.shape
    return _numpy(t.as_strided((rows, t.stride(0) // t.stride(2), heads, dim), (t.stride(0), t.stride(2), dim, 1)))


def _numpy(t: torch.Tensor) -> np.ndarray:
    """The same memory as numpy: bfloat16 as its uint16 bits (numpy has no bfloat16: the kernel widens
    the bits itself)."""
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


def bias_rows(mask: torch.Tensor | None, rows: int, slots: int) -> torch.Tensor | None:
    """A decode mask [B or 1, 1, 1, L' or 1] as an additive float32 bias [rows, slots] on the mask's device (None:
    no mask), read as SDPA reads it: a boolean mask keeps the True slots, any other dtype is added to the
    scores; a longer mask is cut to `slots` (a paged batch's mask spans its widest row). Shared with the
    Triton decode kernel (`backends.attention.triton_decode`)."""
    if mask is None:
        return None
    length = mask.shape[-1]
    if length != 1 and length < slots:
        raise ValueError(f"decode attention mask covers {length} slots, the keys {slots}")
    mask = mask.expand(rows, 1, 1, slots if length == 1 else length)[:, 0, 0, :slots]
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, float("-inf"))
    return mask.to(torch.float32).contiguous()


def _bias(mask: torch.Tensor | None, rows: int, slots: int) -> np.ndarray:
    """`bias_rows` as the kernel's numpy array (empty: no mask)."""
    bias = bias_rows(mask, rows, slots)
    return _NO_BIAS if bias is None else bias.numpy()


def head_parts(rows: int, heads: int, threads: int) -> int:
    """Into how many parts each row's KV heads are cut, one part per parallel job. With fewer rows
    than threads (one long row at the end of a batch) the heads are shared out so that the other
    threads do not sit idle; otherwise a row's heads stay together (each slot read once)."""
    return min(heads, -(-threads // rows)) if rows < threads else 1


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
           scale: float) -> torch.Tensor:
    """q [B, Hkv, G, D] (the G query heads of each KV head), keys / values [B, Hkv, L, D] (`usable`),
    mask None, additive or boolean (True: attend), broadcastable to [B, 1, 1, L] -> [B, Hkv, G, D] in
    q's dtype. Softmax in float32."""
    return _run(q, _stripes(keys), _stripes(values), _NO_TABLE, keys.shape[2], mask, scale)


def usable_paged(keys: torch.Tensor, values: torch.Tensor, layout: str = "pages") -> bool:
    """Whether `attend_paged` (`layout="pages"`) or `attend_rows` (`"extents"`) serves a flat cache
    [slots, Hkv, D] (a layer's whole arena): on the CPU, contiguous, float32 or bfloat16 (bfloat16 with
    head_dim >= 64, as `usable`)."""
    if keys.device.type != "cpu" or keys.dtype not in _DTYPES or keys.dim() != 3:
        return False
    if values.dtype != keys.dtype or values.shape != keys.shape:
        return False
    if not (keys.is_contiguous() and values.is_contiguous()):
        return False
    if keys.dtype == torch.bfloat16 and keys.shape[2] < 64:
        return False
    return _ready(layout, keys.dtype)


def attend_paged(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, table: torch.Tensor,
                 mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """`attend` for a paged batch: keys / values the flat cache [slots, Hkv, D] (`usable_paged`), row r's
    L slots at table[r] ([B, L] slot indices; padding slots masked) — read where they lie instead of
    gathered into a [B, Hkv, L, D] copy first."""
    if table.dim() != 2 or table.shape[0] != q.shape[0]:
        raise ValueError(f"slot table {tuple(table.shape)} does not match {q.shape[0]} rows")
    if table.numel():  # the kernel indexes without bounds checks: one pass over the table guards it
        low, high = torch.aminmax(table)
        if int(low) < 0 or int(high) >= keys.shape[0]:
            raise ValueError(f"slot table reaches outside the cache's {keys.shape[0]} slots")
    index = table.to(torch.int64).contiguous().numpy()
    return _run(q, _numpy(keys), _numpy(values), index, table.shape[1], mask, scale)


@dataclass(frozen=True)
class RowExtents:
    """Rows in extents of their own (`row_extents`): row r reads lengths[r] slots from flat slot
    starts[r] on. Built and checked once per decode step; every layer's `attend_rows` reuses it."""

    starts: np.ndarray  # int64 [B]
    lengths: np.ndarray  # int64 [B], each at least 1
    longest: int
    end: int  # one past the last slot any row reads
    _on_device: dict = field(default_factory=dict, compare=False, repr=False)

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """starts and lengths as int64 tensors on `device` (a GPU kernel's copy), made once per step: every
        layer reads the same."""
        key = str(device)
        if key not in self._on_device:
            self._on_device[key] = (torch.from_numpy(self.starts).to(device), torch.from_numpy(self.lengths).to(device))
        return self._on_device[key]


def row_extents(starts: torch.Tensor, lengths: torch.Tensor) -> RowExtents:
    """Each row's first flat slot and its slot count, [B] each, as `attend_rows` reads them; a row that
    starts before slot 0 or reads no slot is refused."""
    if starts.dim() != 1 or starts.shape != lengths.shape:
        raise ValueError(f"starts {tuple(starts.shape)} and lengths {tuple(lengths.shape)} do not match")
    first = starts.to(device="cpu", dtype=torch.int64).contiguous().numpy()
    count = lengths.to(device="cpu", dtype=torch.int64).contiguous().numpy()
    if len(first) and (count.min() < 1 or first.min() < 0):
        raise ValueError("a row starts before the cache or reads none of it")
    return RowExtents(first, count, int(count.max(initial=0)), int((first + count).max(initial=0)))


def attend_rows(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, rows: RowExtents,
                scale: float) -> torch.Tensor:
    """`attend` for rows in extents of their own: keys / values the flat cache [slots, Hkv, D]
    (`usable_paged`), each row read exactly to its length (no mask) — every row of a decode step in
    one call, where strided views would need a call per run of evenly spaced rows."""
    if len(rows.starts) != q.shape[0]:
        raise ValueError(f"{len(rows.starts)} row extents do not match {q.shape[0]} rows")
    if rows.end > keys.shape[0]:  # the kernel indexes without bounds checks
        raise ValueError(f"rows reach outside the cache's {keys.shape[0]} slots")
    return _run(q, _numpy(keys), _numpy(values), rows.starts, rows.longest, None, scale, rows.lengths)


_NO_TABLE = np.zeros((0, 0), np.int64)
_NO_LENGTHS = np.zeros(0, np.int64)
_NO_BIAS = np.zeros((0, 0), np.float32)  # read-only to the kernel: one shared empty array, not one per call


def _run(q: torch.Tensor, keys: np.ndarray, values: np.ndarray, table: np.ndarray, slots: int,
         mask: torch.Tensor | None, scale: float, lengths: np.ndarray = _NO_LENGTHS) -> torch.Tensor:
    query = q.to(torch.float32).contiguous()
    out = torch.empty(query.shape, dtype=torch.float32)
    attend_into(query.numpy(), keys, values, table, slots, lengths, _bias(mask, len(q), slots), np.float32(scale),
                out.numpy())
    return out if q.dtype == torch.float32 else out.to(q.dtype)


def attend_into(query: np.ndarray, keys: np.ndarray, values: np.ndarray, table: np.ndarray, slots: int,
                lengths: np.ndarray, bias: np.ndarray, scale: np.float32, out: np.ndarray) -> None:
    """The kernel on arrays as it takes them (query / out float32 [B, Hkv, G, D]; the rest as `_run` makes
    them), on torch's thread count, a row's heads shared out when rows are fewer than threads: for a
    caller that keeps its own buffers (`quant.int8_decode`)."""
    numba, kernel = _kernel()
    with parallel_region(numba):
        parts = head_parts(query.shape[0], query.shape[1], numba.get_num_threads())
        kernel(query, keys, values, table, slots, lengths, bias, scale, parts, out)


def warm_up() -> bool:
    """Compile (or load from the on-disk cache) every layout for both cache dtypes now (benchmarks, which
    time steps; a job compiles what it reads, on first use); whether all are available."""
    return all([_ready(layout, dtype) for layout in _PROBES for dtype in _DTYPES])
