"""`TorchRunner`: the `ModelRunner` for torch devices (CPU, CUDA, ROCm, NPU) — weights, KV arena,
RoPE tables, the forward passes and sampling.

It never decides which rows run or when they stop (the scheduler does); it carries out one
`StepPlan` at a time and keeps the device-side state of the live rows in the scheduler's batch order:
each row's last sampled token (the next step's input), its step count and sampling knobs, and for
paged batches the slot tables. Segment-sparse compression runs here because it needs the attention
scores of the prefill (`compressed_prefill`): the scheduler asks for rows in stripes, the runner reports
the slots each kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from flashx_batch.backends import Backend, cpu_decode
from flashx_batch.backends.attention.meta import (
    Decode,
    Extend,
    FinalLayerInputs,
    Packed,
    PackedTrees,
    Paged,
    TeacherForced,
)
from flashx_batch.kvcache.arena import KVArena
from flashx_batch.models.decoder import DecoderModel
from flashx_batch.models.layers import Linear
from flashx_batch.quant.int8_decode import MAX_ROWS as FUSED_MAX_ROWS
from flashx_batch.quant.int8_decode import Int8Decode, Reads
from flashx_batch.runtime.compressed_prefill import CompressedPrefill
from flashx_batch.runtime.decode_graphs import DecodeGraphs
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


@dataclass(frozen=True)
class PrefillPolicy:
    """How prompts go into stripes: plain, or segment-sparse (merged down after a packed prefill);
    a prompt longer than `max_input_len` is rolled into `prompt_slots` (long_input=rolling_merge)."""

    max_input_len: int
    prompt_slots: int
    sparse: bool
    segment_size: int
    max_output_len: int
    row_capacity: int  # slots of a full-length row, whole segments


class _LiveRows:
    """Device-side state of the live rows, in batch order: the last sampled token (the next step's
    input), tokens generated so far, sampling knobs, and (paged batches) slot tables."""

    def __init__(self, device: torch.device) -> None:
        none = torch.zeros(0, dtype=torch.long, device=device)
        self.tokens, self.steps = none, none.clone()
        self.sampling: SamplingBatch | None = None
        self.table: torch.Tensor | None = None

    def join(self, tokens: torch.Tensor, steps: torch.Tensor, sampling: SamplingBatch) -> None:
        self.tokens, self.steps = torch.cat((self.tokens, tokens)), torch.cat((self.steps, steps))
        self.sampling = sampling if self.sampling is None else self.sampling.extend(sampling)

    def keep(self, positions: tuple[int, ...]) -> None:
        if not positions:  # the batch is over: nothing of it (a paged batch's slot tables) outlives it
            self.tokens, self.steps, self.sampling, self.table = self.tokens[:0], self.steps[:0], None, None
            return
        index = torch.tensor(positions, dtype=torch.long, device=self.tokens.device)
        self.tokens, self.steps = self.tokens[index], self.steps[index]
        self.sampling = self.sampling.select(index) if self.sampling is not None else None
        if self.table is not None:
            self.table = self.table[index]


class TorchRunner(ModelRunner):
    def __init__(self, model: DecoderModel, arena: KVArena, backend: Backend, policy: PrefillPolicy,
                 merge: MergeSettings, pad_id: int = 0) -> None:
        self.model, self.arena, self.backend, self.policy, self.merge = model, arena, backend, policy, merge
        self.device = model.embed.device
        self.pad_id = pad_id
        self.caches = arena.layer_views()
        self.window = model.config.sliding_window  # sliding layers' window (None: every layer attends in full)
        self._slot_range = torch.arange(policy.row_capacity, device=self.device)
        self._starts: dict[int, torch.Tensor] = {}  # stripe capacity -> flat slot where each stripe begins
        self.graphs: DecodeGraphs | None = None  # striped decode steps from CUDA graphs (the engine sets it)
        self.live = _LiveRows(self.device)
        # an all-int8 model's CPU decode steps in a few compiled calls a layer (`quant.int8_decode`); False
        # runs them module by module (the A / B of `jobs/fused_int8_decode_ab.py`)
        self.fuse_int8_decode = True
        self._fused: tuple[tuple, Int8Decode | None] | None = None  # (what it was built over, the step)
        self.compress = CompressedPrefill(self)
        self._bf16_head: torch.Tensor | None = None  # `_surprisal_head`, made on first use
        # a tensor-parallel rank: every rank samples from the same gathered logits, and takes rank 0's tokens
        self.comm = model.shard.comm if model.shard is not None else None
        if self.device.type == "cpu":  # compiled (or loaded from numba's cache) now, not in the first decode step
            cpu_decode.warm_up()

    # ---- the ModelRunner interface ----------------------------------------------------------
    @property
    def kv_bytes(self) -> int:
        return self.arena.nbytes

    @property
    def kv_bytes_per_slot(self) -> int:
        return self.arena.bytes_per_token()

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> StepOutput:
        live = self.live
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
                    logits, slots = self.prefill_packed_at([r.prompt for r in p.rows], list(p.starts))[0], None
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

    def reset(self) -> None:
        self.live = _LiveRows(self.device)
        self._fused = None  # built again at the next decode step (the setting `fuse_int8_decode` stays)

    def synchronize(self) -> None:
        self.backend.synchronize()

    @torch.inference_mode()
    def score(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """Teacher-forced logits for every position of every prompt: list of [T_i, V] float32."""
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        cos, sin = self.model.rotary.lookup(self._range(width)[None, :])  # [1, T], broadcast over rows
        hidden = self.model.hidden_states(ids.to(self.device), TeacherForced(cos, sin))
        return [self.model.logits(hidden[i, : len(p)]) for i, p in enumerate(prompts)]

    @torch.inference_mode()
    def prompt_surprisal(self, prompt: list[int]) -> torch.Tensor:
        """`token_surprisal` of one prompt from a plain teacher-forced pass (no cache): what the
        packed segment-sparse prefill computes for it (the quality harness's entry point)."""
        ids = torch.tensor([prompt], dtype=torch.long, device=self.device)
        cos, sin = self.model.rotary.lookup(self._range(len(prompt))[None, :])
        hidden = self.model.hidden_states(ids, TeacherForced(cos, sin))
        return self.token_surprisal(hidden[0], ids[0], [len(prompt)])

    @torch.inference_mode()
    def target_logprobs(self, ids: torch.Tensor, pick: torch.Tensor, targets: torch.Tensor,
                        positions: torch.Tensor | None = None, visible: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """One teacher-forced pass over right-padded rows `ids` [B, T] (no cache) -> for each picked
        position (`pick` [N], flat index row * T + t) the float32 log-probability of `targets` [N] there,
        and whether it is the argmax. Logits are computed for the picked positions only, log_softmax in
        float32 in chunks (a 150k vocabulary never makes an [N, V] tensor of every position).
        `positions` [B, T] and `visible` [B, T, T] (bool) describe token trees (`TeacherForced`);
        None: plain causal rows at positions 0..T-1."""
        ids = ids.to(self.device)
        width = ids.shape[1]
        pos = self._range(width)[None, :] if positions is None else positions.to(self.device)
        needed = width if positions is None else int(pos.max()) + 1
        if needed > self.model.rotary.max_positions:
            raise ValueError(f"positions up to {needed} exceed the rotary table ({self.model.rotary.max_positions}); "
                             "lower max_length or raise max_input_len + max_output_len")
        cos, sin = self.model.rotary.lookup(pos)
        window = None
        if visible is not None:
            visible = visible.to(self.device)
            if self.window:  # sliding layers: keys within the window of the query's position only
                offset = pos[:, :, None] - pos[:, None, :]
                window = visible & (offset < self.window)
        hidden = self.model.hidden_states(ids, TeacherForced(cos, sin, visible=visible, window_visible=window))
        return self._picked_logprobs(hidden, pick, targets)

    @property
    def packs_rows(self) -> bool:
        """Whether `packed_target_logprobs` serves this model: attention of our own (not MLA), no
        sliding-window layers."""
        return self.model.config.mla is None and not self.window

    @torch.inference_mode()
    def packed_target_logprobs(self, ids: torch.Tensor, row_lengths: tuple[int, ...], pick: torch.Tensor,
                               targets: torch.Tensor, positions: torch.Tensor,
                               trees: tuple[tuple[torch.Tensor, torch.Tensor] | None, ...]
                               ) -> tuple[torch.Tensor, torch.Tensor]:
        """`target_logprobs` over rows packed end to end without padding: `ids` and `positions` [N],
        row r the next `row_lengths[r]` tokens, `pick` flat indices into N, `trees[r]` the row's
        non-causal queries (`PackedTrees`). Only where `packs_rows`."""
        pos = positions.to(self.device)[None]
        if int(pos.max()) + 1 > self.model.rotary.max_positions:
            raise ValueError(f"positions up to {int(pos.max()) + 1} exceed the rotary table "
                             f"({self.model.rotary.max_positions}); lower max_length or raise max_input_len + "
                             "max_output_len")
        cos, sin = self.model.rotary.lookup(pos)
        trees = tuple(None if t is None else (t[0].to(self.device), t[1].to(self.device)) for t in trees)
        hidden = self.model.hidden_states(ids.to(self.device)[None], PackedTrees(cos, sin, row_lengths, trees))
        return self._picked_logprobs(hidden, pick, targets)

    def _picked_logprobs(self, hidden: torch.Tensor, pick: torch.Tensor, targets: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states [..., hidden] at flat indices `pick` -> float32 log-probabilities of `targets`
        and whether each is the argmax (the LM head on the picked positions only, in chunks)."""
        picked = hidden.reshape(-1, hidden.shape[-1])[pick.to(self.device)]
        targets = targets.to(self.device)
        chunk = self._logit_rows
        values, greedy = [], []
        for a in range(0, len(picked), chunk):
            logprobs = self.model.logits(picked[a : a + chunk]).log_softmax(dim=-1)
            t = targets[a : a + chunk, None]
            values.append(logprobs.gather(1, t)[:, 0])
            greedy.append(logprobs.argmax(dim=-1) == t[:, 0])
        if not values:
            return torch.zeros(0), torch.zeros(0, dtype=torch.bool)
        return torch.cat(values).cpu(), torch.cat(greedy).cpu()

    # ---- prefill ----------------------------------------------------------------------------
    def _join(self, rows: tuple[NewRow, ...], logits: torch.Tensor) -> StepTokens:
        """Sample the first tokens of rows just prefilled and join them to the live rows."""
        sampling = SamplingBatch.build([r.params for r in rows], logits.shape[-1], self.device)
        steps = torch.zeros(len(rows), dtype=torch.long, device=self.device)
        tokens = self._sample(logits, sampling, steps)
        self.live.join(tokens, steps, sampling)
        return host_tokens(logits, tokens, sampling)

    def _sample(self, logits: torch.Tensor, sampling: SamplingBatch, steps: torch.Tensor) -> torch.Tensor:
        """The next token of each row; on a tensor-parallel replica, rank 0's choice on every rank (the
        ranks hold the same logits, but one choice per replica is the rule: outputs never depend on
        how many ranks there are, nor on a rank's random state)."""
        tokens = sample(logits, sampling, steps)
        if self.comm is not None:
            self.comm.broadcast_(tokens)
        return tokens

    def prefill_packed(self, prompts: list[list[int]], first_row: int = 0, capacity: int | None = None
                       ) -> torch.Tensor:
        """Prompts packed end to end, no padding, into stripes first_row, first_row + 1, ... of
        `capacity` slots (default: a full-length row's, whole segments) -> last-token logits [B, V]."""
        cap = capacity or self.policy.row_capacity
        starts = [(first_row + r) * cap for r in range(len(prompts))]
        return self.prefill_packed_at(prompts, starts)[0]

    @torch.inference_mode()
    def prefill_packed_at(self, prompts: list[list[int]], starts: list[int], observe: int = 0,
                          surprisal: bool = False
                          ) -> tuple[torch.Tensor, list[torch.Tensor] | None, SurprisalProbe | None]:
        """Packed prefill with row r's KV written to flat slots starts[r], starts[r] + 1, ...
        -> (last-token logits [B, V], with `observe` each row's pooled window scores [len_r], with
        `surprisal` a `SurprisalProbe`: any of the prompts' tokens' surprisal, on demand)."""
        lengths = [len(p) for p in prompts]
        ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=self.device)[None]
        positions = torch.cat([self._range(n) for n in lengths])
        first_slots = torch.repeat_interleave(torch.tensor(starts, device=self.device),
                                              torch.tensor(lengths, device=self.device))
        cos, sin = self.model.rotary.lookup(positions[None])
        scores = torch.zeros(len(positions), device=self.device) if observe else None
        meta = Packed(cos, sin, write_flat=first_slots + positions, row_lengths=tuple(lengths),
                      last_only=True, observe=observe, scores=scores,
                      final=FinalLayerInputs() if surprisal else None)
        hidden = self.model.hidden_states(ids, meta, self.caches)[0]  # [B, hidden]: each row's last token
        logits = self.model.logits(hidden)  # [B, V]
        probe = SurprisalProbe(self, meta, ids[0]) if surprisal else None
        return logits, (list(scores.split(lengths)) if observe else None), probe

    def token_surprisal(self, hidden: torch.Tensor, ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """-log p(token | the tokens before it in its row), in nats, for packed rows: hidden [N, H] and
        ids [N] of rows `lengths` end to end -> [N] float32 on the host. A row's first token has no
        prediction: 0. How much a token tells that its context did not: segment-sparse protects the
        surprising tokens (random strings, ids, keys) and compresses the predictable ones."""
        ends = torch.tensor(lengths).cumsum(0)
        predicted = torch.ones(len(ids), dtype=torch.bool)
        predicted[ends - torch.tensor(lengths)] = False  # a row's first token
        at = predicted.nonzero().squeeze(1)
        out = torch.zeros(len(ids), dtype=torch.float32)
        if len(at):
            out[at] = self.next_token_loss(hidden[(at - 1).to(self.device)], ids[at.to(ids.device)])
        return out

    def next_token_loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """-log p(targets[i]) under the logits of final-norm hidden states [n, H] -> [n] float32 on the host.

        Only a ranking signal, so on a float32 CPU model the LM head runs in bfloat16 (a cached
        bfloat16 copy of its weight), and on any model the cross-entropy reads the logits in the dtype
        the head made them (bfloat16 / float16 there: the result rounded to that dtype, ~0.03 nats in
        bfloat16 at the values a protection threshold compares): the LM head and the pass over its
        [n, vocab] logits are most of what this costs, and an upcast copy of the logits would add a
        third. `targets` must be int64 (cross-entropy's requirement)."""
        head = self._surprisal_head()
        chunk = self._logit_rows
        values = []
        for a in range(0, len(hidden), chunk):
            logits = self.model.logits(hidden[a : a + chunk], head, upcast=False)
            t = targets[a : a + chunk].to(logits.device)
            values.append(F.cross_entropy(logits, t, reduction="none").float())
        return torch.cat(values).cpu() if values else torch.zeros(0)

    @property
    def _logit_rows(self) -> int:
        """Positions whose full-vocabulary logits are computed at once: about 4 MiB of float32 logits,
        so a chunk is still in cache when the softmax reads it back (on a CPU, chunks of 64 MiB took
        several times longer per position); never fewer than 64 positions (each chunk reads the whole
        LM head) nor more than 64 MiB of logits (a 150k vocabulary never makes an [N, V] tensor of
        every position). On an accelerator the 64 MiB bound alone: no cache to stay in, and each chunk
        is a few kernel launches more."""
        vocab = max(1, self.model.config.vocab_size)
        if self.device.type != "cpu":
            return max(1, (1 << 24) // vocab)
        return max(1, min(max(64, (1 << 20) // vocab), (1 << 24) // vocab))

    def _surprisal_head(self) -> torch.Tensor | None:
        """The bfloat16 LM-head weight surprisal uses on a float32 CPU model (plain `Linear` heads
        only: a quantized head keeps its own forward); None elsewhere."""
        head = self.model.lm_head
        if self.device.type != "cpu" or type(head) is not Linear or head.weight.dtype != torch.float32:
            return None
        if self._bf16_head is None:
            self._bf16_head = head.weight.detach().to(torch.bfloat16)
        return self._bf16_head

    def _fill_stripes(self, p: StripePrefill) -> tuple[torch.Tensor, list[int], int]:
        """Prompts into stripes p.first, p.first + 1, ... -> (last-token logits [B, V], cache slots per
        row, token positions computed).

        Plain rows: one prefill, packed end to end without padding. Segment-sparse rows: packed
        prefills into free space, each row then merged down into its stripe (`CompressedPrefill`). A row
        longer than max_input_len (rolling merge) is prefilled alone, between the runs of rows that
        fit (`CompressedPrefill.rolling_prefill`)."""
        prompts, cap, limit = [r.prompt for r in p.rows], p.capacity, self.policy.max_input_len
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
                logits, used_slots = self.prefill_packed(rows, p.first + i, cap), [len(r) for r in rows]
            last_logits.append(logits)
            slots += used_slots
            i += run
        return torch.cat(last_logits), slots, computed

    @torch.inference_mode()
    def extend(self, tokens: list[int], start: int, cached: int, first_position: int, observe: int = 0,
               all_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append `tokens` to one row's flat region at `start`, after `cached` slots already there.

        Cached slots are all visible, with their log-count bias; the new tokens attend causally.
        Returns logits (last position, or every position with `all_logits`) and, when `observe` > 0,
        the pooled attention the last `observe` queries paid to each slot.
        """
        count = len(tokens)
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        positions = torch.arange(first_position, first_position + count, device=self.device)[None, :]
        cos, sin = self.model.rotary.lookup(positions)
        mask = None
        if cached:
            dtype = self.arena.storage.dtype
            causal = torch.full((count, count), float("-inf"), device=self.device).triu(1)
            bias = self.arena.bias[start : start + cached][None, :].expand(count, cached)
            mask = torch.cat((bias, causal), dim=1)[None, None].to(dtype)  # [1, 1, C, cached + C]
        scores = torch.zeros(cached + count, device=self.device) if observe else None
        window = None
        if self.window:  # sliding layers: query t (position cached + t) sees slots (cached + t - window, cached + t]
            keys, queries = self._range(cached + count), self._range(count) + cached
            outside = (keys[None, :] > queries[:, None]) | (keys[None, :] <= queries[:, None] - self.window)
            base = mask if mask is not None else torch.zeros(1, 1, count, cached + count, device=self.device,
                                                               dtype=self.arena.storage.dtype)
            window = base.masked_fill(outside[None, None], float("-inf"))
        meta = Extend(cos, sin, start=start, cached=cached, mask=mask, window_mask=window, observe=observe,
                      scores=scores,
                      last_only=not all_logits)
        hidden = self.model.hidden_states(ids, meta, self.caches)[0]  # [C, hidden], or [1, hidden] for the last
        self.arena.clear_bias(start + cached, start + cached + count)
        return self.model.logits(hidden), meta.scores

    def _paged_prefill(self, p: PagedPrefill) -> tuple[torch.Tensor, int]:
        """Shared blocks computed into the cache first, then each row's own suffix through its table
        -> (last-token logits [B, V], token positions computed)."""
        device, trash = self.device, p.trash
        computed = 0
        for block in p.blocks:
            table = torch.tensor(block.table, device=device)[None]
            end = block.first_position + len(block.tokens)
            self.paged(torch.tensor([list(block.tokens)], device=device),
                       torch.arange(block.first_position, end, device=device)[None],
                       table[:, block.first_position :], table, torch.tensor([len(block.tokens) - 1], device=device))
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
        logits = self.paged(tokens.to(device), positions.to(device), writes.to(device),
                            self.live.table[:, :kv_len], last)
        return logits, computed + size * span

    # ---- decode -----------------------------------------------------------------------------
    def _stripe_step(self, d: StripeDecode) -> torch.Tensor:
        positions = torch.tensor(d.positions, dtype=torch.long, device=self.device)
        write_slots = None if d.write_slots is None else torch.tensor(d.write_slots, dtype=torch.long,
                                                                      device=self.device)
        return self.decode(self.live.tokens, positions, d.kv_len, d.capacity, d.stripes, write_slots=write_slots,
                           aligned=d.aligned, groups=d.groups)

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, kv_len: int, capacity: int, stripes: int,
               write_slots: torch.Tensor | None = None, aligned: bool = False,
               groups: tuple[tuple[int, int, int], ...] | None = None) -> torch.Tensor:
        """One step: tokens [B] at RoPE positions [B], row i in stripe i of `stripes` stripes of
        `capacity` slots -> logits [B, V].

        `write_slots` (default = positions) differ from positions once a row's KV is merged; then
        the mask also carries each slot's log-count bias from the arena. `aligned`: every row writes
        slot kv_len - 1 (rows of one length stepping together), so every slot is visible: no mask (for
        merged rows too while the arena holds no merge bias: `KVArena.has_merge_bias`).
        `groups` (see `layouts.stripes.attention_groups`): attend in runs of rows (start, end, slots
        read); only rows of mixed lengths are split, so `aligned` (no mask) never comes with groups.
        With `graphs` set, the step runs from a CUDA graph at padded shapes (groups are not needed
        there) unless the graphs hand it back (see `DecodeGraphs.decode`).
        """
        if self.graphs is not None:
            logits = self.graphs.decode(tokens, positions, kv_len, write_slots, capacity, stripes)
            if logits is not None:
                return logits
        # aligned rows see every slot: no mask, unless merged slots carry a bias (evicting leaves none)
        plain = aligned and (write_slots is None or not self.arena.has_merge_bias)
        mask = None if plain else self.stripe_mask(positions, write_slots, kv_len, capacity)
        runs = tuple((a, b, a * capacity, capacity, n, mask is None)
                     for a, b, n in groups or ((0, len(tokens), kv_len),))
        write_flat = self.stripe_starts(capacity, stripes)[: len(tokens)]
        write_flat = write_flat + (positions if write_slots is None else write_slots)
        return self.model.logits(self.step_hidden(tokens, positions, write_flat, mask, runs))

    def stripe_starts(self, capacity: int, stripes: int) -> torch.Tensor:
        """[stripes] flat slot where each stripe of `capacity` slots begins (built once per capacity)."""
        starts = self._starts.get(capacity)
        if starts is None:
            fits = self.arena.num_slots // capacity
            starts = self._starts[capacity] = torch.arange(fits, device=self.device) * capacity
        return starts[:stripes]

    def stripe_mask(self, positions: torch.Tensor, write_slots: torch.Tensor | None, kv_len: int,
                    capacity: int) -> torch.Tensor:
        """Additive mask [B, 1, 1, kv_len] for rows 0..B-1 of the stripes: slots past each row's new one
        hidden; once rows are merged (`write_slots`), visible slots also carry the arena's log-count bias."""
        if write_slots is None:
            return self._visible(kv_len, positions)
        bias = self.arena.stripe_bias(len(positions), capacity)[:, :kv_len]
        mask = bias.masked_fill(self._range(kv_len)[None, :] > write_slots[:, None], float("-inf"))
        return mask.to(self.arena.storage.dtype)[:, None, None, :]

    def _extent_step(self, d: ExtentDecode) -> torch.Tensor:
        positions = torch.tensor(d.positions, dtype=torch.long, device=self.device)
        starts = torch.tensor(d.starts, dtype=torch.long, device=self.device)
        return self.decode_runs(self.live.tokens, positions, starts, d.runs)

    @torch.inference_mode()
    def decode_runs(self, tokens: torch.Tensor, positions: torch.Tensor, starts: torch.Tensor,
                    runs: tuple[tuple[int, int, int, int, int, bool], ...]) -> torch.Tensor:
        """One step for rows in extents of their own: row i's cache begins at flat slot starts[i] and its
        new token goes to slot positions[i] of it; attention reads the `runs`
        (`layouts.extents.extent_runs`) -> logits [B, V]."""
        mask = None
        if not all(run[-1] for run in runs):  # some run holds rows of different lengths
            mask = self._visible(max(run[4] for run in runs), positions)
        extents = cpu_decode.row_extents(starts, positions + 1) if self.device.type == "cpu" else None
        return self.model.logits(self.step_hidden(tokens, positions, starts + positions, mask, runs, extents))

    def step_hidden(self, tokens: torch.Tensor, positions: torch.Tensor, write_flat: torch.Tensor,
                    mask: torch.Tensor | None, runs: tuple[tuple[int, int, int, int, int, bool], ...],
                    extents: cpu_decode.RowExtents | None = None) -> torch.Tensor:
        """The decode forward up to the final norm -> hidden [B, hidden]: each run of rows (first row,
        end row, first flat slot, stride, slots read, aligned) attends through one strided view of the
        cache; `mask` [B, 1, 1, L] hides the slots past each row of a run that is not aligned.
        `extents` (each row's first flat slot and its slots read): where the attention can, it reads
        all rows in one call from these instead (`Decode.row_extents`), and an all-int8 model runs the
        step fused (`quant.int8_decode`) where it can."""
        if extents is not None and len(tokens) <= FUSED_MAX_ROWS and (fused := self._int8_decode()) is not None:
            return fused.hidden(tokens, positions, write_flat, Reads.extents(extents))
        cos, sin = self.model.rotary.lookup(positions[:, None])
        # each run's cache of every layer as one view [layers, parts, rows, heads, slots, D] (parts: keys
        # and values, or one latent), built once per step (not per layer: a few microseconds per view,
        # rows x layers of them)
        storage = self.arena.storage
        layers, parts, _, heads, dim = storage.shape
        views = []
        for a, b, first, stride, slots, aligned in runs:
            kv = storage[:, :, first : first + (b - a) * stride].view(layers, parts, b - a, stride, heads, dim)
            views.append((a, b, kv[:, :, :, :slots].transpose(3, 4), None if aligned else slots))
        # sliding layers: each row's last `window` slots (slots are positions: such models keep every token)
        window = self._visible(max(run[4] for run in runs), positions, self.window) if self.window else None
        meta = Decode(cos, sin, write_flat=write_flat, attn_mask=mask, runs=tuple(views), window_mask=window,
                      row_extents=extents)
        return self.model.hidden_states(tokens[:, None], meta, self.caches)[:, 0]

    def _int8_decode(self) -> Int8Decode | None:
        """The fused int8 decode step for the model as it is now (built again once a module or cache was
        swapped, e.g. by a precision change), or None where it does not serve it."""
        if not self.fuse_int8_decode:
            return None
        key = Int8Decode.fingerprint(self.model, self.caches)
        if self._fused is None or self._fused[0] != key:
            self._fused = (key, Int8Decode.build(self.model, self.caches))
        return self._fused[1]

    def _paged_step(self, d: PagedDecode) -> torch.Tensor:
        positions = torch.tensor(d.positions, dtype=torch.long, device=self.device)[:, None]
        table = self.live.table
        writes = table.gather(1, positions)
        kv_len = max(d.positions) + 1
        if self.device.type == "cpu" and len(writes) <= FUSED_MAX_ROWS and (fused := self._int8_decode()) is not None:
            reads = Reads.paged(table[:, :kv_len], positions[:, 0])
            return self.model.logits(fused.hidden(self.live.tokens, positions[:, 0], writes[:, 0], reads))
        last = torch.zeros(len(d.positions), dtype=torch.long, device=self.device)
        return self.paged(self.live.tokens[:, None], positions, writes, table[:, :kv_len], last)

    @torch.inference_mode()
    def paged(self, tokens: torch.Tensor, positions: torch.Tensor, write_slots: torch.Tensor,
              slot_table: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """Rows reading through slot tables (shared prefix segments): tokens / positions / write_slots
        [B, T], slot_table [B, L] with L > every position; returns logits at column `last` [B] -> [B, V]."""
        cos, sin = self.model.rotary.lookup(positions)
        kv_len = slot_table.shape[1]
        mask = (self._range(kv_len)[None, None, :] <= positions[:, :, None])[:, None]  # [B, 1, T, L]
        window = None
        if self.window:  # sliding layers: only each query's last `window` positions
            window = mask & (self._range(kv_len)[None, None, :] > positions[:, :, None] - self.window)[:, None]
        meta = Paged(cos, sin, write_slots=write_slots, slot_table=slot_table, attn_mask=mask, window_mask=window)
        hidden = self.model.hidden_states(tokens, meta, self.caches)
        return self.model.logits(hidden[torch.arange(len(tokens), device=self.device), last])

    def _visible(self, kv_len: int, last: torch.Tensor, window: int | None = None) -> torch.Tensor:
        """Additive mask [B, 1, 1, kv_len]: 0 up to each row's `last` slot (and, with `window`, from
        `last - window + 1` on), -inf elsewhere (built once per step, so no layer converts a boolean
        mask again)."""
        slots = self._range(kv_len)[None, :]
        hidden = slots > last[:, None]
        if window is not None:
            hidden |= slots <= last[:, None] - window
        zeros = torch.zeros(hidden.shape, dtype=self.arena.storage.dtype, device=self.device)
        return zeros.masked_fill_(hidden, float("-inf"))[:, None, None, :]

    def _range(self, n: int) -> torch.Tensor:
        if n > len(self._slot_range):
            self._slot_range = torch.arange(n, device=self.device)
        return self._slot_range[:n]


class SurprisalProbe:
    """The surprisal of a packed prefill's prompt tokens, computed when asked: the prefill ran its
    final layer for each row's last token only (as a plain prefill does) and kept that layer's
    inputs, so asking for some tokens runs the final layer and the LM head for their predecessors
    only. Segment-sparse asks for the groups it would compress (`kv_merge.ProtectionSearch`) —
    about half a prompt at the balanced preset — instead of paying for every token."""

    def __init__(self, runner: TorchRunner, meta: Packed, ids: torch.Tensor) -> None:
        self.runner, self.meta, self.ids = runner, meta, ids
        self.offsets = [0, *torch.tensor(meta.row_lengths).cumsum(0).tolist()]

    @torch.inference_mode()
    def tokens(self, positions: list[torch.Tensor]) -> list[torch.Tensor]:
        """positions[r]: row-local token positions of row r (any order, may be empty) -> the
        surprisal of each, in nats, float32 on the host (a row's first token: 0). The bookkeeping is
        numpy on the host: it runs for every row of a pack in every round."""
        wanted = [pos.cpu().numpy().astype(np.int64, copy=False) for pos in positions]
        packed = [pos[pos > 0] + self.offsets[r] for r, pos in enumerate(wanted)]
        at, inverse = np.unique(np.concatenate(packed) if packed else np.zeros(0, np.int64), return_inverse=True)
        values = np.zeros(0, dtype=np.float32)
        if len(at):
            hidden = self.runner.model.final_hidden_at(self.meta, torch.from_numpy(at - 1))
            values = self.runner.next_token_loss(hidden, self.ids[torch.from_numpy(at).to(self.ids.device)]).numpy()
        out, used = [], 0
        for pos in wanted:
            row = np.zeros(len(pos), dtype=np.float32)
            inside = pos > 0
            count = int(inside.sum())
            row[inside] = values[inverse[used : used + count]]
            used += count
            out.append(torch.from_numpy(row))
        return out
