"""`Scorer`: teacher-forced log-likelihoods and token surprisal over the model's forward passes —
`Engine.score`, log-likelihood tasks (`runtime.loglikelihood`), the segment-sparse protection probe
(`SurprisalProbe`, asked by `runtime.compressed_prefill`) and the quality harnesses (`quality/`).

Scoring passes keep no cache (`TeacherForced`, `PackedTrees`), except the probe, which reads what a
packed prefill's final layer kept. The LM head runs on the positions asked for only, in chunks
(`logit_rows`): a 150k vocabulary never makes an [N, V] tensor of every position.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from flashx_batch.backends.attention.meta import Packed, PackedTrees, TeacherForced
from flashx_batch.models.layers import Linear
from flashx_batch.runtime.forward_passes import ForwardPasses


class Scorer:
    def __init__(self, passes: ForwardPasses, pad_id: int = 0, packed_scoring: bool = False) -> None:
        """`packed_scoring`: whether `packed_target_logprobs` serves this model (the capabilities
        record's `packed_scoring` row: our dense attention, no sliding windows)."""
        self.passes, self.pad_id, self.packs_rows = passes, pad_id, packed_scoring
        self.model, self.device, self.window = passes.model, passes.device, passes.window
        self._bf16_head: torch.Tensor | None = None  # `_surprisal_head`, made on first use

    def probe(self, kept: tuple[Packed, torch.Tensor]) -> SurprisalProbe:
        """The surprisal of a packed prefill's tokens on demand, from what `ForwardPasses.prefill_packed_at`
        kept with `keep_final`."""
        return SurprisalProbe(self, *kept)

    @torch.inference_mode()
    def score(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """Teacher-forced logits for every position of every prompt: list of [T_i, V] float32."""
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        cos, sin = self.model.rotary.lookup(self.passes.arange(width)[None, :])  # [1, T], broadcast over rows
        hidden = self.model.hidden_states(ids.to(self.device), TeacherForced(cos, sin))
        return [self.model.logits(hidden[i, : len(p)]) for i, p in enumerate(prompts)]

    @torch.inference_mode()
    def prompt_surprisal(self, prompt: list[int]) -> torch.Tensor:
        """`token_surprisal` of one prompt from a plain teacher-forced pass (no cache): what the
        packed segment-sparse prefill computes for it (the quality harness's entry point)."""
        ids = torch.tensor([prompt], dtype=torch.long, device=self.device)
        cos, sin = self.model.rotary.lookup(self.passes.arange(len(prompt))[None, :])
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
        pos = self.passes.arange(width)[None, :] if positions is None else positions.to(self.device)
        cos, sin = self._rotary(pos, width if positions is None else int(pos.max()) + 1)
        window = None
        if visible is not None:
            visible = visible.to(self.device)
            if self.window:  # sliding layers: keys within the window of the query's position only
                offset = pos[:, :, None] - pos[:, None, :]
                window = visible & (offset < self.window)
        hidden = self.model.hidden_states(ids, TeacherForced(cos, sin, visible=visible, window_visible=window))
        return self._picked_logprobs(hidden, pick, targets)

    @torch.inference_mode()
    def packed_target_logprobs(self, ids: torch.Tensor, row_lengths: tuple[int, ...], pick: torch.Tensor,
                               targets: torch.Tensor, positions: torch.Tensor,
                               trees: tuple[tuple[torch.Tensor, torch.Tensor] | None, ...]
                               ) -> tuple[torch.Tensor, torch.Tensor]:
        """`target_logprobs` over rows packed end to end without padding: `ids` and `positions` [N],
        row r the next `row_lengths[r]` tokens, `pick` flat indices into N, `trees[r]` the row's
        non-causal queries (`PackedTrees`). Only where `packs_rows`."""
        pos = positions.to(self.device)[None]
        cos, sin = self._rotary(pos, int(pos.max()) + 1)
        trees = tuple(None if t is None else (t[0].to(self.device), t[1].to(self.device)) for t in trees)
        hidden = self.model.hidden_states(ids.to(self.device)[None], PackedTrees(cos, sin, row_lengths, trees))
        return self._picked_logprobs(hidden, pick, targets)

    def _rotary(self, positions: torch.Tensor, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary tables at `positions`, refused where they reach past the table (`needed`: one past the
        largest position): scoring requests are sized by the caller, not by the engine's limits."""
        if needed > self.model.rotary.max_positions:
            raise ValueError(f"positions up to {needed} exceed the rotary table ({self.model.rotary.max_positions}); "
                             "lower max_length or raise max_input_len + max_output_len")
        return self.model.rotary.lookup(positions)

    def _picked_logprobs(self, hidden: torch.Tensor, pick: torch.Tensor, targets: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states [..., hidden] at flat indices `pick` -> float32 log-probabilities of `targets`
        and whether each is the argmax (the LM head on the picked positions only, in chunks)."""
        picked = hidden.reshape(-1, hidden.shape[-1])[pick.to(self.device)]
        targets = targets.to(self.device)
        chunk = self.logit_rows
        values, greedy = [], []
        for a in range(0, len(picked), chunk):
            logprobs = self.model.logits(picked[a : a + chunk]).log_softmax(dim=-1)
            t = targets[a : a + chunk, None]
            values.append(logprobs.gather(1, t)[:, 0])
            greedy.append(logprobs.argmax(dim=-1) == t[:, 0])
        if not values:
            return torch.zeros(0), torch.zeros(0, dtype=torch.bool)
        return torch.cat(values).cpu(), torch.cat(greedy).cpu()

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
        chunk = self.logit_rows
        values = []
        for a in range(0, len(hidden), chunk):
            logits = self.model.logits(hidden[a : a + chunk], head, upcast=False)
            t = targets[a : a + chunk].to(logits.device)
            values.append(F.cross_entropy(logits, t, reduction="none").float())
        return torch.cat(values).cpu() if values else torch.zeros(0)

    @property
    def logit_rows(self) -> int:
        """Positions whose full-vocabulary logits are computed at once: about 4 MiB of float32 logits,
        so a chunk is still in cache when the softmax reads it back (on a CPU, chunks of 64 MiB took
        several times longer per position); never fewer than 64 positions (each chunk reads the whole
        LM head) nor more than 64 MiB of logits (a 150k vocabulary never makes an [N, V] tensor of
        every position). On an accelerator the 64 MiB bound alone: no cache to stay in, and each chunk
        is a few kernel launches more."""
        vocab = max(1, self.model.config.vocab_size)
        if not self.passes.backend.host_kernels:
            return max(1, (1 << 24) // vocab)
        return max(1, min(max(64, (1 << 20) // vocab), (1 << 24) // vocab))

    def _surprisal_head(self) -> torch.Tensor | None:
        """The bfloat16 LM-head weight surprisal uses on a float32 CPU model (plain `Linear` heads
        only: a quantized head keeps its own forward); None elsewhere."""
        head = self.model.lm_head
        if not self.passes.backend.host_kernels or type(head) is not Linear or head.weight.dtype != torch.float32:
            return None
        if self._bf16_head is None:
            self._bf16_head = head.weight.detach().to(torch.bfloat16)
        return self._bf16_head


class SurprisalProbe:
    """The surprisal of a packed prefill's prompt tokens, computed when asked: the prefill ran its
    final layer for each row's last token only (as a plain prefill does) and kept that layer's
    inputs, so asking for some tokens runs the final layer and the LM head for their predecessors
    only. Segment-sparse asks for the groups it would compress (`kv_merge.ProtectionSearch`) —
    about half a prompt at the balanced preset — instead of paying for every token."""

    def __init__(self, scorer: Scorer, meta: Packed, ids: torch.Tensor) -> None:
        self.scorer, self.meta, self.ids = scorer, meta, ids
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
            hidden = self.scorer.model.final_hidden_at(self.meta, torch.from_numpy(at - 1))
            values = self.scorer.next_token_loss(hidden, self.ids[torch.from_numpy(at).to(self.ids.device)]).numpy()
        out, used = [], 0
        for pos in wanted:
            row = np.zeros(len(pos), dtype=np.float32)
            inside = pos > 0
            count = int(inside.sum())
            row[inside] = values[inverse[used : used + count]]
            used += count
            out.append(torch.from_numpy(row))
        return out
