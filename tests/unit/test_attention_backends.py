"""The attention seam: a backend added from this file alone serves every layout.

`Reference*` below is plain masked SDPA written against the layouts' metadata only (each row's keys
gathered into a dense [B, Hkv, L, D] copy, one explicit boolean-or-additive mask, the query heads not
folded): no code shared with the shipped backends but the metadata types. Registered for the CPU, it
must give the shipped backends' greedy tokens on every layout the engine runs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flashx_batch.backends.attention import AttentionBackend, registered, select
from flashx_batch.backends.attention.meta import Decode, Extend, Packed, Paged, TeacherForced

CALLS: dict[str, int] = {}


def _sdpa(q, keys, values, mask, layer):
    """q [B, H, T, D], keys / values [B, Hkv, L, D], mask bool or additive [B or 1, 1, T, L] (None: all)."""
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=layer.scale, enable_gqa=True)


def _causal(t: int, length: int, device) -> torch.Tensor:
    """[t, length] bool: the last t of `length` positions, each seeing itself and everything before."""
    return torch.arange(length, device=device)[None, :] <= torch.arange(length - t, length, device=device)[:, None]


def _band(mask: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    if window is None:
        return mask
    return mask & (key_pos[None, :] > query_pos[:, None] - window)


def _observe(layer, queries, keys, mask, observe: int) -> torch.Tensor:
    """Mean softmax weight the last `observe` queries [1, H, C, D] pay each key [1, Hkv, L, D] under
    `mask` (bool or additive, [.., C, L]) -> [L]: what segment-sparse ranks keys by."""
    w = min(observe, queries.shape[2])
    group = layer.num_heads // layer.num_kv_heads
    logits = queries[:, :, -w:].float() @ keys.float().repeat_interleave(group, 1).transpose(-1, -2) * layer.scale
    extra = mask[..., -w:, :]
    logits = logits.masked_fill(~extra, float("-inf")) if extra.dtype == torch.bool else logits + extra.float()
    return logits.softmax(-1).mean(dim=(1, 2))[0]


class _Reference(AttentionBackend):
    kind = "dense"
    supports_last_only = True

    def forward(self, q, k, v, layer, meta, cache, last_only=False):
        CALLS[type(meta).__name__] = CALLS.get(type(meta).__name__, 0) + 1
        return self.attend(q, k, v, layer, meta, cache, last_only)


class ReferenceTeacherForced(_Reference):
    layout = TeacherForced

    def attend(self, q, k, v, layer, meta, cache, last_only):
        n = q.shape[1]
        pos = torch.arange(n)
        mask = _band(_causal(n, n, q.device), pos, pos, layer.window) if meta.visible is None else (
            meta.visible if layer.window is None else meta.window_visible)
        mask = mask[None, None] if mask.dim() == 2 else mask[:, None]
        return _sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, layer)


class ReferencePacked(_Reference):
    layout = Packed

    def attend(self, q, k, v, layer, meta, cache, last_only):
        cache[0][meta.write_flat], cache[1][meta.write_flat] = k[0], v[0]
        if last_only and meta.final is not None:
            meta.final.q, meta.final.k, meta.final.v = q, k, v
        outs, first, scores = [], 0, []
        for n in meta.row_lengths:
            qr, kr, vr = (t[:, first : first + n].transpose(1, 2) for t in (q, k, v))
            pos = torch.arange(n)
            mask = _band(_causal(n, n, q.device), pos, pos, layer.window)
            if meta.observe:
                scores.append(_observe(layer, qr, kr, mask[None, None], meta.observe))
            if last_only:
                qr, mask = qr[:, :, -1:], mask[-1:]
            outs.append(_sdpa(qr, kr, vr, mask[None, None], layer))
            first += n
        if meta.observe:
            meta.scores += torch.cat(scores)
        return torch.cat(outs, dim=2)  # [1, H, N or rows, D]

    def attend_positions(self, layer, final, row_lengths, index) -> torch.Tensor:
        """Each picked packed position's query over its own row's keys up to itself -> [n, H * D]."""
        ends = torch.tensor(row_lengths).cumsum(0)
        outs = []
        for at in index.tolist():
            row = int(torch.searchsorted(ends, at, right=True))
            first = int(ends[row]) - row_lengths[row]
            q = final.q[:, at : at + 1].transpose(1, 2)
            keys, values = (t[:, first : at + 1].transpose(1, 2) for t in (final.k, final.v))
            outs.append(_sdpa(q, keys, values, None, layer).transpose(1, 2).reshape(1, -1))
        return torch.cat(outs)


class ReferenceDecode(_Reference):
    layout = Decode

    def attend(self, q, k, v, layer, meta, cache, last_only):
        cache[0][meta.write_flat], cache[1][meta.write_flat] = k[:, 0], v[:, 0]
        outs = []
        for a, b, kv, masked in meta.runs:
            keys, values = kv[layer.layer]  # [rows, Hkv, slots, D]
            slots = keys.shape[2]
            mask = meta.attn_mask if layer.window is None else meta.window_mask
            mask = None if mask is None or (masked is None and layer.window is None) else mask[a:b, ..., :slots]
            outs.append(_sdpa(q[a:b].transpose(1, 2), keys.contiguous(), values.contiguous(), mask, layer))
        return torch.cat(outs)


class ReferencePaged(_Reference):
    layout = Paged

    def attend(self, q, k, v, layer, meta, cache, last_only):
        batch, seq = q.shape[:2]
        slots = meta.write_slots.reshape(-1)
        cache[0][slots] = k.reshape(batch * seq, *k.shape[2:])
        cache[1][slots] = v.reshape(batch * seq, *v.shape[2:])
        keys, values = (c[meta.slot_table].transpose(1, 2) for c in cache)
        mask = meta.attn_mask if layer.window is None else meta.window_mask
        return _sdpa(q.transpose(1, 2), keys, values, mask, layer)


class ReferenceExtend(_Reference):
    layout = Extend

    def attend(self, q, k, v, layer, meta, cache, last_only):
        seq, begin = q.shape[1], meta.start + meta.cached
        cache[0][begin : begin + seq], cache[1][begin : begin + seq] = k[0], v[0]
        keys, values = (c[meta.start : begin + seq][None].transpose(1, 2) for c in cache)
        mask = meta.mask if layer.window is None else meta.window_mask
        if mask is None:
            mask = _causal(seq, meta.cached + seq, q.device)[None, None]
        queries = q.transpose(1, 2)
        if meta.observe:
            meta.scores += _observe(layer, queries, keys, mask, meta.observe)
        if last_only:
            queries, mask = queries[:, :, -1:], mask[:, :, -1:]
        return _sdpa(queries, keys, values, mask, layer)


REFERENCE = (ReferenceTeacherForced, ReferencePacked, ReferenceDecode, ReferencePaged, ReferenceExtend)

SETTINGS = {
    "extents": {},
    "stripes": {"kv_layout": "stripes"},
    "static_batches": {"refill": False},
    "paged": {"prefix_cache_tokens": 64},
    "segment_sparse": {"cache_policy": "segment_sparse"},
    "rolling_merge": {"cache_policy": "segment_sparse", "long_input": "rolling_merge", "max_input_len": 96},
}


def _prompts(vocab: int, shared: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(3, vocab, (shared,), generator=g).tolist()
    return [prefix + torch.randint(3, vocab, (n,), generator=g).tolist() for n in (9, 30, 4, 22, 17, 40)]


def _tokens(path, options, prompts, rolled: bool):
    from flashx_batch import Engine, SamplingParams

    options = {"backend": "cpu", "dtype": "float32", "max_batch_size": 3, "max_input_len": 64, "max_output_len": 12,
               "segment_size": 16, **options}
    engine = Engine.from_pretrained(path, **options)
    if rolled:
        prompts = prompts[:2] + [(prompts[1] * 5)[:150]] + prompts[3:]  # one prompt past max_input_len
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))
    scores = [s.argmax(-1).tolist() for s in engine.score(prompts[:2])]
    return [o.token_ids for o in outs], scores


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_reference_backend_from_this_file_gives_the_same_greedy_tokens_on_every_layout(tiny_models, arch):
    path = tiny_models[arch][0]
    for name, options in SETTINGS.items():
        prompts = _prompts(256, 20 if "prefix_cache_tokens" in options else 0)
        rolled = "long_input" in options
        shipped = _tokens(path, options, prompts, rolled)
        CALLS.clear()
        with registered(*REFERENCE, device_type="cpu"):
            reference = _tokens(path, options, prompts, rolled)
        assert CALLS, f"{name}: the reference backend was never called"
        assert reference == shipped, f"{name}: the reference backend's tokens differ ({CALLS})"


def test_every_layout_reaches_the_reference(tiny_models):
    path = tiny_models["llama"][0]
    seen: set[str] = set()
    for name in ("extents", "paged", "rolling_merge"):
        options = SETTINGS[name]
        CALLS.clear()
        with registered(*REFERENCE, device_type="cpu"):
            _tokens(path, options, _prompts(256, 20 if name == "paged" else 0), "long_input" in options)
        seen |= set(CALLS)
    assert seen == {"TeacherForced", "Packed", "Decode", "Paged", "Extend"}, seen


def test_select_picks_the_device_s_own_backend_and_falls_back_to_any():
    cpu, cuda = select("cpu", "dense").names(), select("cuda", "dense").names()
    assert cpu["Decode"] == "DecodeCpu" and cuda["Decode"] == "DecodeTriton"  # the device's own
    assert cuda["Packed"] == "PackedSdpa"  # no CUDA backend of its own: the one for every device
    assert select("cpu", "latent").names()["Decode"] == "DecodeLatent"
    with registered(ReferenceDecode, device_type="any"):  # "any" replaces the CPU's own too
        assert select("cpu", "dense").names()["Decode"] == "ReferenceDecode"
    assert select("cpu", "dense").names()["Decode"] == "DecodeCpu"  # the registry as it was
    with pytest.raises(ValueError, match="attention kind 'sparse' is unknown"):
        select("cpu", "sparse")


def test_a_layout_without_a_backend_is_named():
    from flashx_batch.backends.attention.meta import PackedTrees

    backends = select("cpu", "latent")
    meta = PackedTrees(torch.zeros(1), torch.zeros(1), (1,), (None,))
    with pytest.raises(ValueError, match="no latent attention backend serves PackedTrees on cpu"):
        backends.for_meta(meta)
