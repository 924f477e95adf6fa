"""LoRA adapters (read by `models.peft_adapter`), several loaded at once, chosen per row inside one batch.

How rows of different adapters share a batch (the question Punica and S-LoRA answer with segmented
gather kernels on GPUs): every target linear holds all adapters' A matrices stacked into one
[parts x R, in] matrix and their B matrices (scaling folded in) into one [parts x R, out], where R is
the adapters' summed rank, and each adapter's own A and B besides. A pass takes one of two forms:

- masked (decode steps: a few tokens per adapter): for all tokens at once, `x A^T` (one GEMM over the
  columns of the adapters present), each token's columns of other adapters zeroed (one multiply by a
  0/1 mask built once per pass), `h B^T` added to the base output (one GEMM; one per part for a big
  fused projection, whose block-diagonal B would be mostly zeros to read). Three kernels per linear
  whatever the mix, where a per-adapter loop launches a gather, two GEMMs and a scatter per adapter.
- grouped (prefills: many tokens per adapter): each adapter's tokens gathered and run through its own
  A and B, so no token pays for another adapter's rank.

A base-model token adds nothing (its mask row is zero, or it is in no group), so its output is
exactly the base model's; a pass without adapter rows skips LoRA altogether.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flashx_batch.models.peft_adapter import TARGETS, LoraAdapter, module_shape


@dataclass(frozen=True)
class RowAdapters:
    """The adapter slot of each row of a forward pass (0: the base model), the slots present, and the device the
    pass's masks and token indices are built on (from these host values, once per distinct pass)."""

    slots: tuple[int, ...]
    present: tuple[int, ...]  # sorted, without 0, never empty
    device: torch.device


# A pass whose tokens number at least this many per adapter present runs each adapter's own rows through
# its own A and B (`LoraPass.grouped`): a prefill, where the masked form's FLOPs (every token through every
# present adapter's columns) would dominate. Fewer tokens (decode steps: one per row) take the masked form,
# whose three kernels per linear cost less than a gather, two GEMMs and a scatter per adapter.
GROUPED_TOKENS_PER_ADAPTER = 32

Runs = tuple[tuple[int, int, int], ...]  # (first token, end token, slot): consecutive tokens of one slot


def _runs(counts: Sequence[int], slots: Sequence[int]) -> Runs:
    out: list[list[int]] = []
    start = 0
    for count, slot in zip(counts, slots):
        if out and out[-1][2] == slot:
            out[-1][1] += count
        else:
            out.append([start, start + count, slot])
        start += count
    return tuple(tuple(r) for r in out)


class LoraPass:
    """The adapters of one forward pass: per token, its adapter. Two forms: `grouped` (each adapter's tokens
    gathered, `groups`) or masked (every token through every present adapter's columns, `mask` zeroing the
    columns of other adapters). A pass's linears may run on all its tokens, on the tokens a last_only
    pass keeps after its final attention, or on a chunk of either (`window`): each variant is told apart
    by its token count and built once."""

    def __init__(self, lora: LoraSet, runs: dict[int, Runs], present: tuple[int, ...], grouped: bool,
                 device: torch.device) -> None:
        """`runs`: per token count of a variant (all tokens; the kept ones), its runs of slots."""
        self.lora, self.present, self.grouped, self.device = lora, present, grouped, device
        self._runs = runs
        self._cache: dict[tuple, object] = {}
        self.window: tuple[int, int, int] | None = None  # (first, end, of rows): a chunk of the pass's rows

    def _variant(self, rows: int) -> tuple[int, Runs, tuple[int, int] | None]:
        """(tokens of the variant, its runs, the window of it the linear runs on)."""
        window = self.window
        total = window[2] if window is not None else rows
        runs = self._runs.get(total)
        if runs is None:
            raise RuntimeError(f"LoRA: a linear ran on {total} tokens; this pass's adapters are set for "
                               f"{sorted(self._runs)} (a forward layout that does not pass its rows' adapters)")
        return total, runs, (window[0], window[1]) if window is not None else None

    def groups(self, rows: int) -> list[tuple[int, torch.Tensor | None]]:
        """(slot, the token indices of its rows, None: all of them) for each adapter present among `rows`."""
        total, runs, window = self._variant(rows)
        key = ("groups", total, window)
        found = self._cache.get(key)
        if found is None:
            first, end = window if window is not None else (0, total)
            by_slot: dict[int, list[tuple[int, int]]] = {}
            for a, b, slot in runs:
                a, b = max(a, first), min(b, end)
                if slot and a < b:
                    by_slot.setdefault(slot, []).append((a - first, b - first))
            found = []
            for slot, spans in by_slot.items():
                if spans == [(0, end - first)]:
                    found.append((slot, None))
                else:
                    index = torch.cat([torch.arange(a, b) for a, b in spans])
                    found.append((slot, index.to(self.device, non_blocking=True)))
            self._cache[key] = found
        return found

    def mask(self, parts: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
        """[rows, parts x R'] 0/1 in `dtype` for a linear with `parts` blocks of columns run on `rows` tokens."""
        total, runs, window = self._variant(rows)
        key = ("mask", total, parts, dtype)
        mask = self._cache.get(key)
        if mask is None:
            slots = torch.tensor([slot for a, b, slot in runs for _ in range(b - a)], device=self.device)
            columns = self.lora.columns(self.present)
            owner = self.lora.owner[columns] if columns is not None else self.lora.owner
            mask = self._cache[key] = (slots[:, None] == owner[None, :]).repeat(1, parts).to(dtype)
        return mask if window is None else mask[window[0] : window[1]]


# A masked-form expand whose block-diagonal B^T (every part's columns against every part's outputs) would
# hold more than this many elements runs one GEMM per part instead: a decode step is bound by the bytes it
# reads, and the zeros of a big fused projection's block-diagonal B would be most of the adapters' bytes;
# below it (small models) one GEMM costs less than a launch per part.
SPLIT_EXPAND_ELEMENTS = 1 << 18

Expand = tuple[tuple[int, int, torch.Tensor], ...]  # per part: (first output, end output, B^T of the part)


class LoraLinear:
    """The adapters' weights for one of our linears: all of them stacked, A [parts x R, in] and B^T (block-
    diagonal [parts x R, out], or per part [R, out_p]: `expand`) for the masked form, and each adapter's own A
    [parts x r, in] and B^T (block-diagonal, and per part) for the grouped form (`own`)."""

    def __init__(self, owner: LoraSet, a: torch.Tensor, bt: torch.Tensor, out_sizes: list[int],
                 own: dict[int, tuple[torch.Tensor, torch.Tensor, Expand]]) -> None:
        self.owner, self.a, self.parts, self.own = owner, a, len(out_sizes), own
        self.bt: torch.Tensor | None = bt
        self.expand: Expand | None = None
        if self.parts > 1 and bt.numel() > SPLIT_EXPAND_ELEMENTS:
            self.expand, self.bt = _split(bt, out_sizes, owner.width), None
        self._subset: tuple[tuple[int, ...], torch.Tensor, torch.Tensor | None, Expand | None] | None = None

    def add_(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y += each token's own adapter's delta for input x (y: the base linear's output)."""
        run = self.owner.current
        if run is None:
            return y
        x2 = x.reshape(-1, x.shape[-1])
        out = y if y.is_contiguous() else y.contiguous()
        y2 = out.view(-1, out.shape[-1])
        if run.grouped:
            for slot, index in run.groups(x2.shape[0]):
                weights = self.own.get(slot)
                if weights is None:  # this adapter leaves this linear alone
                    continue
                a, bt, expand = weights
                if index is None:  # every token: straight into each part's output columns
                    h = F.linear(x2, a)
                    width = a.shape[0] // self.parts
                    for p, (first, end, part_bt) in enumerate(expand):
                        y2[:, first:end].addmm_(h[:, p * width : (p + 1) * width], part_bt)
                else:  # whole output rows scattered (a scatter into a column slice is several times slower)
                    y2.index_add_(0, index, torch.mm(F.linear(x2.index_select(0, index), a), bt))
            return out
        a, bt, expand = self._weights(run.present)
        h = F.linear(x2, a).mul_(run.mask(self.parts, x2.shape[0], y.dtype))
        if expand is None:
            y2.addmm_(h, bt)
        else:
            width = a.shape[0] // self.parts
            for p, (first, end, part_bt) in enumerate(expand):
                y2[:, first:end].addmm_(h[:, p * width : (p + 1) * width], part_bt)
        return out

    def _weights(self, present: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None, Expand | None]:
        """The stacked weights of the adapters `present` only (all adapters' as they are when all are)."""
        columns = self.owner.columns(present)
        if columns is None:
            return self.a, self.bt, self.expand
        cached = self._subset
        if cached is None or cached[0] != present:
            rows = torch.cat([columns + p * self.owner.width for p in range(self.parts)])
            cached = self._subset = (
                present, self.a.index_select(0, rows), None if self.bt is None else self.bt.index_select(0, rows),
                None if self.expand is None else tuple((f, e, bt.index_select(0, columns)) for f, e, bt in self.expand))
        return cached[1], cached[2], cached[3]


def _split(bt: torch.Tensor, out_sizes: list[int], width: int) -> Expand:
    """A block-diagonal B^T [parts x width, out] as its parts' own blocks."""
    out, first = [], 0
    for p, size in enumerate(out_sizes):
        out.append((first, first + size, bt[p * width : (p + 1) * width, first : first + size].contiguous()))
        first += size
    return tuple(out)


class LoraSet:
    """Every adapter an engine loaded, stacked into the model's target linears (`Linear.lora`).

    Slot 0 is the base model; adapter i of `adapters` is slot i + 1. `begin` sets a pass's tokens'
    slots, `end` clears them (a pass without `begin` runs the base model)."""

    def __init__(self, model, adapters: Sequence[LoraAdapter]) -> None:
        self.adapters = list(adapters)
        cfg, dtype, device = model.config, model.embed.dtype, model.embed.device
        offsets, owner, start = [], [], 0
        for slot, adapter in enumerate(self.adapters, start=1):
            offsets.append(start)
            owner += [slot] * adapter.rank
            start += adapter.rank
        self.width = start
        self.owner = torch.tensor(owner, dtype=torch.long, device=device)
        self.current: LoraPass | None = None
        self._offsets = offsets
        self._columns: dict[tuple[int, ...], torch.Tensor | None] = {}
        self._passes: dict[tuple, LoraPass] = {}  # the last few passes' adapters, by rows and layout
        for layer_index, layer in enumerate(model.layers):
            grouped: dict[str, list[tuple[int, str]]] = {}
            for module, (ours, _, _) in TARGETS.items():
                grouped.setdefault(ours, []).append((layer_index, module))
            for ours, modules in grouped.items():
                if any(key in a.modules for a in self.adapters for key in modules):
                    linear = layer.get_submodule(ours)
                    linear.lora = self._stack(linear, modules, [module_shape(cfg, m)[1] for _, m in modules],
                                              dtype, device)

    def _stack(self, linear, modules: list[tuple[int, str]], out_sizes: list[int], dtype: torch.dtype,
               device: torch.device) -> LoraLinear:
        parts = len(modules)
        a = torch.zeros(parts * self.width, linear.weight.shape[1])
        bt = torch.zeros(parts * self.width, linear.weight.shape[0])
        own = {}
        for slot, (adapter, offset) in enumerate(zip(self.adapters, self._offsets), start=1):
            rank = adapter.rank
            own_a, own_bt = torch.zeros(parts * rank, a.shape[1]), torch.zeros(parts * rank, bt.shape[1])
            for part, key in enumerate(modules):
                found = adapter.modules.get(key)
                if found is None:
                    continue
                out_first = sum(out_sizes[:part])
                out_last = out_first + out_sizes[part]
                for target_a, target_bt, first in ((a, bt, part * self.width + offset), (own_a, own_bt, part * rank)):
                    target_a[first : first + found.rank] = found.a
                    target_bt[first : first + found.rank, out_first:out_last] = found.b.t() * found.scale
            if any(key in adapter.modules for key in modules):
                own_bt = own_bt.to(dtype=dtype, device=device)
                own[slot] = (own_a.to(dtype=dtype, device=device), own_bt, _split(own_bt, out_sizes, rank))
        return LoraLinear(self, a.to(dtype=dtype, device=device), bt.to(dtype=dtype, device=device), out_sizes, own)

    def columns(self, present: tuple[int, ...]) -> torch.Tensor | None:
        """The stacked columns (within one part) of the adapters `present` (None: all adapters are)."""
        if len(present) == len(self.adapters):
            return None
        found = self._columns.get(present)
        if found is None:
            spans = [(self._offsets[s - 1], self.adapters[s - 1].rank) for s in present]
            found = torch.cat([torch.arange(first, first + n) for first, n in spans]).to(self.owner.device)
            if len(self._columns) >= 64:
                self._columns.pop(next(iter(self._columns)))
            self._columns[present] = found
        return found

    def begin(self, rows: RowAdapters | None, shape: torch.Size, row_lengths: tuple[int, ...] | None,
              last_only: bool) -> None:
        """Set a pass's adapters from its rows' (`rows`; None: the base model only) for token ids of
        `shape`: [B, T] with one row per line, or [1, N] packing rows of `row_lengths`. `last_only`: the
        pass's final layer keeps each row's last token after its attention."""
        if rows is None or not rows.present:
            self.current = None
            return
        if row_lengths is not None and shape[0] == 1:
            counts = row_lengths
        elif shape[0] == len(rows.slots):
            counts = (shape[1],) * shape[0]
        else:
            raise RuntimeError(f"LoRA: {len(rows.slots)} rows' adapters for a pass over token ids {tuple(shape)}")
        if len(counts) != len(rows.slots):
            raise RuntimeError(f"LoRA: {len(rows.slots)} rows' adapters for a pass packing {len(counts)} rows")
        key = (rows.slots, tuple(counts), last_only)
        found = self._passes.get(key)  # decode steps of an unchanged batch: one pass, its masks built once
        if found is None:
            runs = {sum(counts): _runs(counts, rows.slots)}
            if last_only:
                runs.setdefault(len(counts), _runs((1,) * len(counts), rows.slots))
            grouped = sum(counts) >= GROUPED_TOKENS_PER_ADAPTER * len(rows.present) or (
                len(rows.present) == 1 and 0 not in rows.slots)
            found = LoraPass(self, runs, rows.present, grouped, rows.device)
            if len(self._passes) >= 8:
                self._passes.pop(next(iter(self._passes)))
            self._passes[key] = found
        found.window = None
        self.current = found

    def end(self) -> None:
        self.current = None


def row_adapters(lora: LoraSet | None, slots: Sequence[int], device: torch.device) -> RowAdapters | None:
    """A pass's rows' adapter slots, for `DecoderModel.hidden_states` (None when the model loaded no
    adapters or every row runs the base model: no LoRA work at all)."""
    present = tuple(sorted(set(slots) - {0})) if lora is not None else ()
    if not present:
        return None
    return RowAdapters(tuple(slots), present, device)
