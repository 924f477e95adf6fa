"""`TorchRunner`: the `ModelRunner` for torch devices (CPU, CUDA, ROCm, NPU) — plan dispatch, the live
rows and sampling, over three parts it owns: `ForwardPasses` (the model's passes over the KV arena),
`Scorer` (teacher-forced log-likelihoods, surprisal) and `CompressedPrefill` (segment-sparse rows and
rolling merges, which need the prefill's attention scores).

It never decides which rows run or when they stop (the scheduler does); it carries out one
`StepPlan` at a time and keeps the device-side state of the live rows in the scheduler's batch order:
each row's last sampled token (the next step's input), its step count and sampling knobs, and for
paged batches the slot tables. The scheduler asks for rows in stripes; the runner reports the slots
each kept.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from flashx_batch.backends import Backend, cpu_decode
from flashx_batch.kvcache.arena import KVArena
from flashx_batch.models.decoder import DecoderModel
from flashx_batch.models.lora import LoraSet, RowAdapters, row_adapters
from flashx_batch.runtime.compressed_prefill import CompressedPrefill, PrefillPolicy
from flashx_batch.runtime.forward_passes import ForwardPasses
from flashx_batch.runtime.grammar import StepMasks
from flashx_batch.runtime.kv_merge import MergeSettings
from flashx_batch.runtime.plan import (
    ExtentDecode,
    ExtentPrefill,
    NewRow,
    PagedDecode,
    PagedPrefill,
    SlotMove,
    StepOutput,
    StepPlan,
    StripeDecode,
    StripePrefill,
)
from flashx_batch.runtime.runner import ModelRunner
from flashx_batch.runtime.sampling import SamplingBatch, StepTokens, host_tokens, sample
from flashx_batch.runtime.scorer import Scorer


class _LiveRows:
    """Device-side state of the live rows, in batch order: the last sampled token (the next step's
    input), tokens generated so far, sampling knobs, and (paged batches) slot tables."""

    def __init__(self, device: torch.device) -> None:
        none = torch.zeros(0, dtype=torch.long, device=device)
        self.tokens, self.steps = none, none.clone()
        self.sampling: SamplingBatch | None = None
        self.table: torch.Tensor | None = None
        self.adapters: list[int] = []  # each row's LoRA adapter slot (0: the base model)
        # `adapters` on the device (None: every row on the base model), built once per batch change (stale: unbuilt)
        self._adapter_rows: RowAdapters | None = None
        self._adapters_stale = True

    def join(self, tokens: torch.Tensor, steps: torch.Tensor, sampling: SamplingBatch, adapters: list[int]) -> None:
        self.tokens, self.steps = torch.cat((self.tokens, tokens)), torch.cat((self.steps, steps))
        self.sampling = sampling if self.sampling is None else self.sampling.extend(sampling)
        self.adapters += adapters
        self._adapters_stale = True

    def adapter_rows(self, lora: LoraSet | None) -> RowAdapters | None:
        if self._adapters_stale:
            self._adapter_rows, self._adapters_stale = row_adapters(lora, self.adapters, self.tokens.device), False
        return self._adapter_rows

    def keep(self, positions: tuple[int, ...]) -> None:
        self._adapters_stale = True
        if not positions:  # the batch is over: nothing of it (a paged batch's slot tables) outlives it
            self.tokens, self.steps, self.sampling, self.table = self.tokens[:0], self.steps[:0], None, None
            self.adapters = []
            return
        self.adapters = [self.adapters[p] for p in positions]
        index = torch.tensor(positions, dtype=torch.long, device=self.tokens.device)
        self.tokens, self.steps = self.tokens[index], self.steps[index]
        self.sampling = self.sampling.select(index) if self.sampling is not None else None
        if self.table is not None:
            self.table = self.table[index]


class TorchRunner(ModelRunner):
    def __init__(self, model: DecoderModel, arena: KVArena, backend: Backend, policy: PrefillPolicy,
                 merge: MergeSettings, pad_id: int = 0, fuse_int8_decode: bool = True,
                 graphs: Callable[[ForwardPasses], Any] | None = None, packed_scoring: bool = False) -> None:
        """`fuse_int8_decode` and `graphs`: see `ForwardPasses` (the A / B of `jobs/experiments/fused_int8_decode_ab.py`
        builds one engine each way). `packed_scoring`: see `Scorer` (the engine passes its capabilities
        record's rows for all three)."""
        self.model, self.arena, self.backend, self.policy, self.merge = model, arena, backend, policy, merge
        self.device = model.embed.device
        self.passes = ForwardPasses(model, arena, backend, policy.row_capacity, fuse_int8_decode, graphs)
        self.scorer = Scorer(self.passes, pad_id, packed_scoring)
        self.compress = CompressedPrefill(self.passes, self.scorer, policy, merge)
        self.live = _LiveRows(self.device)
        self._mask_pool: ThreadPoolExecutor | None = None  # started by the first constrained step
        self._masks: Future | None = None  # this step's masks, being filled
        # a tensor-parallel rank: every rank samples from the same gathered logits, and takes rank 0's tokens
        self.comm = model.shard.comm if model.shard is not None else None

    @property
    def graphs(self):
        """The decode graphs striped steps replay from (None: every step eager)."""
        return self.passes.graphs

    @property
    def kv_bytes(self) -> int:
        return self.arena.nbytes

    @property
    def kv_bytes_per_slot(self) -> int:
        return self.arena.bytes_per_token()

    @torch.inference_mode()
    def run(self, plan: StepPlan, masks: StepMasks | None = None) -> StepOutput:
        """`masks` are filled on the host (llguidance's threads, without the GIL) while this thread runs
        the step's forward pass, and wait only at sampling."""
        live = self.live
        self._masks = self._mask_thread().submit(masks.fill) if masks is not None else None
        if plan.keep is not None:
            live.keep(plan.keep)
        for op in plan.kv_ops:
            if isinstance(op, SlotMove):
                self.arena.move_slots(((op.src, op.dst, op.n),))
            else:
                self.arena.clear_bias(op.start, op.end)
        if plan.prefill is not None:
            match plan.prefill:
                case StripePrefill() as p:
                    logits, slots, computed = self._fill_stripes(p)
                case ExtentPrefill() as p:
                    adapters = row_adapters(self.model.lora, [r.adapter for r in p.rows], self.device)
                    logits = self.passes.prefill_packed_at([r.prompt for r in p.rows], list(p.starts),
                                                           adapters=adapters)[0]
                    slots = None
                    computed = sum(len(r.prompt) for r in p.rows)
                case PagedPrefill() as p:
                    (logits, computed), slots = self._paged_prefill(p), None
            tokens, logprobs, top = self._join(plan.prefill.rows, logits)
            return StepOutput(tokens, slots, computed, logprobs, top)
        if plan.decode is not None:
            match plan.decode:
                case StripeDecode() as d:
                    logits = self._stripe_step(d)
                case ExtentDecode() as d:
                    logits = self._extent_step(d)
                case PagedDecode() as d:
                    logits = self._paged_step(d)
            live.steps += 1
            live.tokens = self._sample(logits, live.sampling, live.steps)
            tokens, logprobs, top = host_tokens(logits, live.tokens, live.sampling)
            return StepOutput(tokens, None, len(tokens), logprobs, top)
        return StepOutput([])

    def _mask_thread(self) -> ThreadPoolExecutor:
        if self._mask_pool is None:
            self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="flashx-masks")
        return self._mask_pool

    def reset(self) -> None:
        self.live = _LiveRows(self.device)
        self._masks = None
        self.passes.forget_fused()  # built again at the next decode step (the setting `fuse_int8_decode` stays)

    def synchronize(self) -> None:
        self.backend.synchronize()

    # ---- scoring: the Scorer's (named here for the ModelRunner interface and tensor-parallel mirroring)
    def score(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        return self.scorer.score(prompts)

    def prompt_surprisal(self, prompt: list[int]) -> torch.Tensor:
        return self.scorer.prompt_surprisal(prompt)

    def target_logprobs(self, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        return self.scorer.target_logprobs(*args, **kwargs)

    def packed_target_logprobs(self, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        return self.scorer.packed_target_logprobs(*args, **kwargs)

    @property
    def packs_rows(self) -> bool:
        return self.scorer.packs_rows

    # ---- prefill ----------------------------------------------------------------------------
    def _join(self, rows: tuple[NewRow, ...], logits: torch.Tensor) -> StepTokens:
        """Sample the first tokens of rows just prefilled and join them to the live rows."""
        sampling = SamplingBatch.build([r.params for r in rows], logits.shape[-1], self.device)
        steps = torch.zeros(len(rows), dtype=torch.long, device=self.device)
        tokens = self._sample(logits, sampling, steps)
        self.live.join(tokens, steps, sampling, [r.adapter for r in rows])
        return host_tokens(logits, tokens, sampling)

    def _sample(self, logits: torch.Tensor, sampling: SamplingBatch, steps: torch.Tensor) -> torch.Tensor:
        """The next token of each row; on a tensor-parallel replica, rank 0's choice on every rank (the
        ranks hold the same logits, but one choice per replica is the rule: outputs never depend on
        how many ranks there are, nor on a rank's random state; only rank 0 holds grammar masks)."""
        pending, self._masks = self._masks, None
        allowed = pending.result().to(self.device, non_blocking=True) if pending is not None else None
        tokens = sample(logits, sampling, steps, allowed)
        if self.comm is not None:
            self.comm.broadcast_(tokens)
        return tokens

    def _fill_stripes(self, p: StripePrefill) -> tuple[torch.Tensor, list[int], int]:
        """Prompts into stripes p.first, p.first + 1, ... -> (last-token logits [B, V], cache slots per
        row, token positions computed).

        Plain rows: one prefill, packed end to end without padding. Segment-sparse rows: packed
        prefills into free space, each row then merged down into its stripe (`CompressedPrefill`). A row
        longer than max_input_len (rolling merge) is prefilled alone, between the runs of rows that
        fit (`CompressedPrefill.rolling_prefill`)."""
        prompts, cap, limit = [r.prompt for r in p.rows], p.capacity, self.policy.max_input_len
        adapters = [r.adapter for r in p.rows]
        if any(adapters) and (self.policy.sparse or any(len(q) > limit for q in prompts)):  # the engine refuses these
            raise RuntimeError("LoRA adapters do not run through segment-sparse or rolling-merge prefills")
        last_logits, slots, computed, i = [], [], 0, 0
        while i < len(prompts):  # runs of rows that fit, packed; an over-long row alone (rolling merge)
            if len(prompts[i]) > limit:
                computed += len(prompts[i])
                logits, used = self.compress.rolling_prefill(prompts[i], (p.first + i) * cap, self.policy.prompt_slots)
                last_logits.append(logits[-1][None])
                slots.append(used)
                i += 1
                continue
            run = 1
            while i + run < len(prompts) and len(prompts[i + run]) <= limit:
                run += 1
            rows = prompts[i : i + run]
            computed += sum(map(len, rows))
            if self.policy.sparse:
                logits, used_slots = self.compress.fill_merged(p.first + i, cap, rows)
            else:
                run_adapters = row_adapters(self.model.lora, adapters[i : i + run], self.device)
                logits = self.passes.prefill_packed(rows, p.first + i, cap, run_adapters)
                used_slots = [len(r) for r in rows]
            last_logits.append(logits)
            slots += used_slots
            i += run
        return torch.cat(last_logits), slots, computed

    def _paged_prefill(self, p: PagedPrefill) -> tuple[torch.Tensor, int]:
        """Shared blocks computed into the cache first, then each row's own suffix through its table
        -> (last-token logits [B, V], token positions computed)."""
        device, trash = self.device, p.trash
        computed = 0
        for block in p.blocks:
            table = torch.tensor(block.table, device=device)[None]
            end = block.first_position + len(block.tokens)
            self.passes.paged(torch.tensor([list(block.tokens)], device=device),
                       torch.arange(block.first_position, end, device=device)[None],
                       table[:, block.first_position :], table, torch.tensor([len(block.tokens) - 1], device=device),
                       row_adapters(self.model.lora, [block.adapter], device))
            computed += len(block.tokens)
        size = len(p.rows)
        width = max(len(t) for t in p.tables)
        table = torch.full((size, width), trash, dtype=torch.long)
        for i, flat in enumerate(p.tables):
            table[i, : len(flat)] = torch.tensor(flat)
        suffixes = [r.prompt[c:] for r, c in zip(p.rows, p.cached)]
        span = max(map(len, suffixes))
        tokens = torch.zeros(size, span, dtype=torch.long)
        positions = torch.zeros(size, span, dtype=torch.long)
        writes = torch.full((size, span), trash, dtype=torch.long)
        for i, (suffix, start) in enumerate(zip(suffixes, p.cached)):
            tokens[i, : len(suffix)] = torch.tensor(suffix)
            positions[i] = torch.arange(start, start + span)
            writes[i, : len(suffix)] = table[i, start : start + len(suffix)]
        positions = positions.clamp_max(width - 1)  # padding columns: any in-range position will do
        kv_len = max(len(r.prompt) for r in p.rows)
        self.live.table = table.to(device)
        last = torch.tensor([len(s) - 1 for s in suffixes], device=device)
        adapters = row_adapters(self.model.lora, [r.adapter for r in p.rows], device)
        logits = self.passes.paged(tokens.to(device), positions.to(device), writes.to(device),
                                   self.live.table[:, :kv_len], last, adapters)
        return logits, computed + size * span

    # ---- decode -----------------------------------------------------------------------------
    def _stripe_step(self, d: StripeDecode) -> torch.Tensor:
        positions = torch.tensor(d.positions, dtype=torch.long, device=self.device)
        write_slots = None if d.write_slots is None else torch.tensor(d.write_slots, dtype=torch.long,
                                                                      device=self.device)
        return self.passes.decode(self.live.tokens, positions, d.kv_len, d.capacity, d.stripes, write_slots=write_slots,
                           aligned=d.aligned, groups=d.groups, adapters=self.live.adapter_rows(self.model.lora))

    def _extent_step(self, d: ExtentDecode) -> torch.Tensor:
        positions = torch.tensor(d.positions, dtype=torch.long, device=self.device)
        starts = torch.tensor(d.starts, dtype=torch.long, device=self.device)
        # each row's first slot and slots read, from the plan (host data): one call per step for every row
        extents = cpu_decode.row_extents(torch.tensor(d.starts), torch.tensor(d.positions) + 1)
        return self.passes.decode_runs(self.live.tokens, positions, starts, d.runs, extents,
                                       self.live.adapter_rows(self.model.lora))

    def _paged_step(self, d: PagedDecode) -> torch.Tensor:
        positions = torch.tensor(d.positions, dtype=torch.long, device=self.device)[:, None]
        return self.passes.paged_decode(self.live.tokens, positions, self.live.table, max(d.positions) + 1,
                                        self.live.adapter_rows(self.model.lora))
