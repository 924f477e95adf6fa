"""Load Hugging Face safetensors into a `DecoderModel`, fusing projections on the way.

Weight loading is data, not code (nano-vllm's `packed_modules_mapping`): `RENAMES` maps a Hugging
Face parameter suffix to ours, `PACKED` says which suffixes land in one fused tensor and in what
order. One loader serves every family.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from flashx_batch.errors import ModelLoadError
from flashx_batch.models.config import ModelConfig
from flashx_batch.models.decoder import DecoderModel
from flashx_batch.models.layers import Linear
from flashx_batch.models.parallel import Cut, TensorShard, checkpoint_cut
from flashx_batch.models.quantized import Scheme, checkpoint_scheme
from flashx_batch.models.quantized_rows import QuantizedRead, RowLayout, concat_rows
from flashx_batch.models.safetensors_file import (
    _FLOAT_DTYPES,
    _TORCH_DTYPES,
    WholeTensors,
    release_freed_memory,
    safetensors_header,
)

log = logging.getLogger(__name__)

# HF suffix (after `model.layers.N.`) -> our parameter path (after `layers.N.`)
RENAMES = {
    "input_layernorm.weight": "input_norm.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight",
    "post_self_attn_layernorm.weight": "post_attn_norm.weight",
    "post_mlp_layernorm.weight": "post_mlp_norm.weight",
    "self_attn.o_proj.weight": "attn.o_proj.weight",
    "self_attn.q_norm.weight": "attn.q_norm.weight",
    "self_attn.k_norm.weight": "attn.k_norm.weight",
    "mlp.down_proj.weight": "mlp.down.weight",
    "mlp.gate_up_proj.weight": "mlp.gate_up.weight",
    # mixture of experts: the router, and Qwen2-MoE's shared expert and its gate
    "mlp.gate.weight": "mlp.router",
    "block_sparse_moe.gate.weight": "mlp.router",
    "mlp.shared_expert.down_proj.weight": "mlp.shared.down.weight",
    "mlp.shared_expert_gate.weight": "mlp.shared_gate.weight",
    "mlp.gate.e_score_correction_bias": "mlp.router_bias",  # sigmoid routing (GLM-4.5, DeepSeek-V3)
    "mlp.shared_experts.down_proj.weight": "mlp.shared.down.weight",
    # latent attention (DeepSeek-V3, GLM-5) and GLM-5's sparse-attention indexer
    "self_attn.q_a_proj.weight": "attn.q_a.weight",
    "self_attn.q_a_proj.bias": "attn.q_a.bias",
    "self_attn.q_a_layernorm.weight": "attn.q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn.q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn.kv_a.weight",
    "self_attn.kv_a_proj_with_mqa.bias": "attn.kv_a.bias",
    "self_attn.kv_a_layernorm.weight": "attn.kv_a_norm.weight",
    "self_attn.kv_b_proj.weight": "attn.kv_b.weight",
    "self_attn.o_proj.bias": "attn.o_proj.bias",
    "self_attn.indexer.wq_b.weight": "attn.indexer.wq_b.weight",
    "self_attn.indexer.wk.weight": "attn.indexer.wk.weight",
    "self_attn.indexer.k_norm.weight": "attn.indexer.k_norm.weight",
    "self_attn.indexer.k_norm.bias": "attn.indexer.k_norm.bias",
    "self_attn.indexer.weights_proj.weight": "attn.indexer.weights_proj.weight",
}
# HF suffix -> (our fused parameter, position among its parts)
PACKED = {
    "self_attn.q_proj.weight": ("attn.qkv.weight", 0),
    "self_attn.k_proj.weight": ("attn.qkv.weight", 1),
    "self_attn.v_proj.weight": ("attn.qkv.weight", 2),
    "self_attn.q_proj.bias": ("attn.qkv.bias", 0),
    "self_attn.k_proj.bias": ("attn.qkv.bias", 1),
    "self_attn.v_proj.bias": ("attn.qkv.bias", 2),
    "mlp.gate_proj.weight": ("mlp.gate_up.weight", 0),
    "mlp.up_proj.weight": ("mlp.gate_up.weight", 1),
    "mlp.shared_expert.gate_proj.weight": ("mlp.shared.gate_up.weight", 0),
    "mlp.shared_expert.up_proj.weight": ("mlp.shared.gate_up.weight", 1),
    "mlp.shared_experts.gate_proj.weight": ("mlp.shared.gate_up.weight", 0),
    "mlp.shared_experts.up_proj.weight": ("mlp.shared.gate_up.weight", 1),
}
# mixture-of-experts: per-expert checkpoint tensors stacked into one parameter per layer. (pattern, our
# parameter, part of expert e: stacked in part order, gate and up of one expert next to each other)
EXPERTS = (
    (re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(?:gate_proj|w1)\.weight$"), "mlp.experts_gate_up", 2, 0),
    (re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(?:up_proj|w3)\.weight$"), "mlp.experts_gate_up", 2, 1),
    (re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(?:down_proj|w2)\.weight$"), "mlp.experts_down", 1, 0),
)
TOP_LEVEL = {"model.embed_tokens.weight": "embed", "model.norm.weight": "norm.weight",
             "lm_head.weight": "lm_head.weight", "score.weight": "lm_head.weight"}  # score: a classifier's head
IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint, single-file or sharded by an index."""
    single = model_dir / "model.safetensors"
    index = model_dir / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelLoadError(f"{index}: not a safetensors index with a weight_map ({type(exc).__name__}); "
                                 "save the checkpoint again.") from None
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise ModelLoadError(f"{index}: lists shard files that do not exist: {missing}.")
        return [model_dir / s for s in shards]
    raise ModelLoadError(
        f"{model_dir}: no model.safetensors or model.safetensors.index.json; "
        "convert the checkpoint with `save_pretrained(..., safe_serialization=True)`."
    )


def _our_name(hf_name: str) -> tuple[str, int | None] | None:
    """Map one HF tensor name to (our parameter path, part index or None); None = not ours."""
    if hf_name in TOP_LEVEL:
        return TOP_LEVEL[hf_name], None
    match = LAYER.match(hf_name)
    if not match:
        return None
    layer, suffix = match.groups()
    if suffix in PACKED:
        target, part = PACKED[suffix]
        return f"layers.{layer}.{target}", part
    if suffix in RENAMES:
        return f"layers.{layer}.{RENAMES[suffix]}", None
    for pattern, target, per_expert, offset in EXPERTS:
        expert = pattern.match(suffix)
        if expert:
            return f"layers.{layer}.{target}", int(expert.group(1)) * per_expert + offset
    return None


Source = tuple[Path, str]  # (safetensors file, HF tensor name)
_READ_CHUNK = 16 << 20  # bytes read from a file per call: the only host buffer loading adds to the weights


# builds the module a quantized linear runs as from its row layout (one, or a fused projection's parts where they
# cannot share one), its bias, the compute dtype and device: `quant.checkpoint_linear.quantized_linear`
QuantizedLinearFactory = Callable[[RowLayout | list[RowLayout], torch.Tensor | None, torch.dtype, torch.device],
                                  nn.Module]
# linears whose weight the model reads itself (latent attention's absorbed `kv_b`), dequantized at load
_READ_AS_WEIGHTS = ("attn.kv_b",)
Scanned = tuple[dict[str, list[Source]], dict[str, QuantizedRead], dict[Path, dict]]


class _QuantizedSlot(nn.Module):
    """Where a quantized linear goes until its weight is read: holds only its bias (routed like any parameter)."""

    def __init__(self, linear: Linear) -> None:
        super().__init__()
        self.bias = linear.bias


def load_weights(model: DecoderModel, model_dir: Path, scanned: Scanned | None = None,
                 quantized_linears: QuantizedLinearFactory | None = None, scheme: Scheme | None = None) -> None:
    """Fill every parameter of `model` from the checkpoint. Everything that can be wrong with it is
    found by `route_checkpoint` from the headers first; this only reads and copies.

    Host memory stays at the model's own bytes plus one `_READ_CHUNK` buffer: each checkpoint tensor
    is read straight from its file (file by file, in file order; plain reads, no memory map whose
    pages would count as resident) in chunks, and each chunk copied into the tensor's place in its
    parameter (its rows of a fused or stacked one), converting to the parameter's dtype and device
    on the way. No tensor is materialised whole, no parts are concatenated.

    A pre-quantized checkpoint's linears that `load_model` left as `_QuantizedSlot`s are read one at a time
    into their row layout and replaced by `quantized_linears`' module; its other quantized tensors (stacked
    experts, `kv_b`) are dequantized into their float parameters, one linear at a time.

    A rank of a tensor-parallel replica (`model.shard`) reads only its slice of each tensor
    (`parallel.checkpoint_cut`): its rows, or its columns of every row, chunk by chunk."""
    if sys.byteorder != "little":  # safetensors data is little-endian and read here as raw bytes
        raise ModelLoadError(f"{model_dir}: loading safetensors needs a little-endian host.")
    params = dict(model.named_parameters(remove_duplicate=False))
    shard, cfg = model.shard, model.config
    scheme = scheme if scanned is not None else checkpoint_scheme(model_dir)  # `scanned` came with its scheme
    if scheme is not None and shard is not None:
        raise ModelLoadError(f"{model_dir}: a pre-quantized checkpoint ({scheme.describe()}) loads on one rank; "
                             "tensor parallelism over it is not supported yet (runtime.tensor_parallel_size=1).")
    # the checkpoint holds the whole model: a rank checks it against the whole model's shapes
    full_shapes = {n: tuple(p.shape) for n, p in params.items()} if shard is None else parameter_shapes(cfg)
    routes, special, headers = scanned or _scan(model_dir, cfg, full_shapes, scheme)
    # file -> its tensors' pieces as (byte offset in the data section, HF name, header entry, where it lands: a
    # view of the parameter, the rank's piece of it or None for all of it)
    reads: dict[Path, list[tuple[int, str, dict, torch.Tensor, Cut | None]]] = {}
    kept: dict[str, list[Source]] = {}
    for name, sources in routes.items():
        if name not in params:  # a `_QuantizedSlot`'s weight
            kept[name.rsplit(".", 1)[0]] = sources
            continue
        param = params[name].detach()
        rows = param.view(_as_rows(tuple(param.shape)))  # fused parts and stacked experts: consecutive rows
        start = 0
        for part, (path, hf_name) in enumerate(sources):
            info = headers[path][hf_name]
            offset = int(info["data_offsets"][0])
            cuts = None if shard is None else checkpoint_cut(name, part, len(sources), _as_rows(full_shapes[name]),
                                                             tuple(rows.shape), cfg, shard)
            for cut in [None] if cuts is None else cuts:  # no pieces (RANK_ZERO_ONLY): left at zero
                shape = special[hf_name].shape if hf_name in special else info["shape"]
                count = cut[2] - cut[1] if cut is not None and cut[0] == 0 else (int(shape[0]) if shape else 1)
                dest = rows[start : start + count] if rows.dim() else rows
                reads.setdefault(path, []).append((offset, hf_name, info, dest, cut))
                start += count
    scratch = bytearray(_READ_CHUNK)
    with torch.no_grad(), WholeTensors(headers) as whole:
        for path in sorted(reads):
            with open(path, "rb", buffering=0) as fh:
                data_start = 8 + int.from_bytes(fh.read(8), "little")
                for offset, hf_name, info, dest, cut in sorted(reads[path], key=lambda r: (r[0], r[4] or ())):
                    read = special.get(hf_name)
                    if read is not None:  # one quantized linear dequantized at a time
                        dest.reshape(read.shape).copy_(_layout(scheme, read, whole).to_float())
                    else:
                        _read_tensor(fh, path, hf_name, info, data_start + offset, dest, scratch, cut)
        del scratch  # the float reads' buffer: not needed by the quantized linears
        for path, sources in kept.items():
            layouts = [_layout(scheme, special[hf_name], whole) for _, hf_name in sources]
            fused = concat_rows(layouts)
            slot = model.get_submodule(path)
            module = quantized_linears(layouts if fused is None else fused, slot.bias, model.embed.dtype,
                                       model.embed.device)
            parent, _, child = path.rpartition(".")
            setattr(model.get_submodule(parent), child, module)
            del layouts, fused, module
            release_freed_memory()
        if kept:
            log.info("%d linears kept as stored (%s); runtime.quantized_weights=dequantize holds them in %s instead "
                     "(more memory, faster where no kernel fits: docs/benchmarks.md)", len(kept), scheme.describe(),
                     str(model.embed.dtype).removeprefix("torch."))


def _layout(scheme: Scheme, read: QuantizedRead, whole: WholeTensors) -> RowLayout:
    return scheme.layout(read, {part: whole.read(*source) for part, source in read.parts.items()})


def keep_quantized(model: DecoderModel, scanned: Scanned) -> None:
    """Replace each of the meta-built `model`'s linears whose weight the checkpoint holds quantized (every part of
    it) by a `_QuantizedSlot`, so that `to_empty` allocates no float weight for it."""
    routes, special, _ = scanned
    for name, sources in routes.items():
        path, _, leaf = name.rpartition(".")
        if leaf != "weight" or not all(h in special for _, h in sources) or path.endswith(_READ_AS_WEIGHTS):
            continue
        parent, _, child = path.rpartition(".")
        module = model.get_submodule(path) if parent else None
        if isinstance(module, Linear) and module.lora is None:
            setattr(model.get_submodule(parent), child, _QuantizedSlot(module))


def _fill(fh, view: memoryview, path: Path, hf_name: str) -> None:
    """Fill `view` from `fh` (a read may return less than asked: network file systems)."""
    got = 0
    while got < len(view):
        more = fh.readinto(view[got:])
        if not more:
            raise ModelLoadError(f"{path.name}:{hf_name}: the file ended inside this tensor; was it changed "
                                 "while loading? Copy the checkpoint again.")
        got += more


def parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our parameter name -> shape for the whole model of `cfg` (built on the meta device: no memory)."""
    with torch.device("meta"):
        model = DecoderModel(cfg, torch.float32, torch.device("meta"))
    return {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}


def _read_tensor(fh, path: Path, hf_name: str, info: dict, position: int, dest: torch.Tensor,
                 scratch: bytearray, cut: Cut | None = None) -> None:
    """Read one checkpoint tensor at `position` of the open file `fh` into `dest`, `len(scratch)` bytes at
    a time: all of it (`dest` has as many elements), or the `cut` (axis, first, stop) of it: rows
    first..stop (one run of bytes), or columns first..stop of every row (whole rows read, the columns
    kept)."""
    dtype = _TORCH_DTYPES[info["dtype"]]
    size = dtype.itemsize  # the header's byte count checked against it (safetensors_header)
    shape = [int(d) for d in info["shape"]]
    if cut is not None and cut[0] == 0:  # rows: skip to the first, read the run
        row_elems = 1
        for d in shape[1:]:
            row_elems *= d
        position += cut[1] * row_elems * size
    width = shape[1] if cut is not None and cut[0] == 1 else None
    flat = dest.reshape(dest.shape[0], -1) if width is not None else dest.view(-1)
    numel = flat.shape[0] * width if width is not None else flat.numel()
    step = len(scratch) // size
    if width is not None:
        step = max(1, step // width) * width  # whole rows per read
    fh.seek(position)
    for first in range(0, numel, step):
        n = min(step, numel - first)
        _fill(fh, memoryview(scratch)[: n * size], path, hf_name)
        chunk = torch.frombuffer(scratch, dtype=dtype, count=n)
        if width is None:
            flat[first : first + n].copy_(chunk)
        else:
            row = first // width
            flat[row : row + n // width].copy_(chunk.view(-1, width)[:, cut[1] : cut[2]])


def route_checkpoint(model_dir: Path, cfg: ModelConfig, shapes: dict[str, tuple[int, ...]],
                     scheme: Scheme | None = None) -> dict[str, list[Source]]:
    """our parameter -> the checkpoint tensors it is made of (one, or the parts fused into it, in
    order), from the safetensors headers alone. ModelLoadError, naming the file and tensor, for a
    missing / truncated / corrupt file, a non-float tensor (FP8 weights under an FP8 `scheme` aside,
    each with scales of its blocks' shape), a shape that does not match config.json (fused parts
    included) or a parameter the checkpoint lacks."""
    return _scan(model_dir, cfg, shapes, scheme)[0]


def _scan(model_dir: Path, cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], scheme: Scheme | None
          ) -> tuple[dict[str, list[Source]], dict[str, QuantizedRead], dict[Path, dict]]:
    """`route_checkpoint`'s routes, how each quantized tensor is read (its HF name -> the read), and every
    file's header (read once: the loader reads the tensors at their offsets)."""
    found: dict[str, dict[int | None, tuple[Path, str, tuple[int, ...]]]] = {}
    unexpected: list[str] = []
    headers = {path: safetensors_header(path) for path in weight_files(model_dir)}
    located = {hf_name: path for path, header in headers.items() for hf_name in header}
    auxiliary = scheme.auxiliaries(located) if scheme else set()  # scales, zero points: read with their weights
    special: dict[str, QuantizedRead] = {}
    for path, header in headers.items():
        for hf_name, info in header.items():
            if hf_name in auxiliary:
                continue
            weight_name = scheme.weight_name(hf_name) if scheme else None  # GPTQ's qweight: routed as the weight
            mapped = _our_name(weight_name or hf_name)
            if mapped is None or mapped[0] not in shapes:
                if not IGNORED.match(hf_name):
                    unexpected.append(hf_name)
                continue
            shape = tuple(int(d) for d in info["shape"])
            read = scheme.read(path, hf_name, info, located, headers) if scheme else None
            if read is not None:  # routed as the float weight it stands for
                special[hf_name] = read
                shape = read.shape
            elif info.get("dtype") not in _FLOAT_DTYPES:
                raise ModelLoadError(f"{path.name}:{hf_name}: dtype {info.get('dtype')} is not a float format this "
                                     f"runtime loads ({', '.join(sorted(_FLOAT_DTYPES))})"
                                     f"{'' if scheme else ', and config.json declares no quantization scheme'}.")
            name, part = mapped
            found.setdefault(name, {})[part] = (path, hf_name, shape)
    routes: dict[str, list[Source]] = {}
    for name, pieces in found.items():
        ordered = [pieces[k] for k in sorted(pieces, key=lambda k: -1 if k is None else k)]
        if None in pieces:
            path, hf_name, shape = ordered[0]
            where = f"{path.name}:{hf_name}"
        else:
            gaps = sorted(set(range(max(pieces) + 1)) - set(pieces))
            if gaps:  # experts: part 2e / 2e + 1 is expert e's gate / up (down: part e)
                raise ModelLoadError(f"{model_dir}: {name} is fused from parts {sorted(pieces)[:8]}…, missing part(s) "
                                     f"{gaps[:8]} (for stacked experts: part k is expert k // 2 of gate_up, expert k "
                                     "of down); is every expert in the checkpoint?")
            part_shapes = [p[2] for p in ordered]
            if any(s[1:] != part_shapes[0][1:] for s in part_shapes):
                raise ModelLoadError(f"{model_dir}: the parts fused into {name} have shapes {part_shapes} that do "
                                     "not concatenate; is config.json from the same model as the weights?")
            shape = (sum(s[0] for s in part_shapes), *part_shapes[0][1:])
            where = f"{ordered[0][0].name}:{name} (fused from {len(ordered)} parts)"
        if _as_rows(shapes[name]) != shape:
            raise ModelLoadError(f"{where}: shape {shape} does not match {shapes[name]} expected for {name} from "
                                 "config.json.")
        routes[name] = [(p, h) for p, h, _ in ordered]
    missing = sorted(set(shapes) - set(routes) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set()))
    if missing:
        raise ModelLoadError(
            f"{model_dir}: checkpoint lacks tensors for {missing[:6]}{' …' if len(missing) > 6 else ''} "
            f"({cfg.architecture}); is config.json from the same model as the weights?"
        )
    if unexpected:
        log.warning("ignored %d checkpoint tensors the model does not use, e.g. %s", len(unexpected), unexpected[:3])
    return routes, special, headers


def _as_rows(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A stacked expert parameter [experts, rows, cols] as its checkpoint parts concatenate: [experts x rows, cols]."""
    return (shape[0] * shape[1], *shape[2:]) if len(shape) == 3 else shape


def check_checkpoint(model_dir: Path) -> ModelConfig:
    """What `load_model` would refuse, found from config.json and the safetensors headers alone: an
    unsupported architecture or a pre-quantized checkpoint, and everything `route_checkpoint`
    checks. Reads no tensor data, allocates no weights (the model is built on the meta device)."""
    cfg = ModelConfig.from_dir(model_dir)
    route_checkpoint(model_dir, cfg, parameter_shapes(cfg), checkpoint_scheme(model_dir))
    return cfg


def load_model(model_dir: Path, dtype: torch.dtype, device: torch.device,
               max_positions: int, config: ModelConfig | None = None, shard: TensorShard | None = None,
               quantized_linears: QuantizedLinearFactory | None = None) -> DecoderModel:
    """Build the decoder for `model_dir` on `device`, weights fused, contiguous and resident (`config`:
    the directory's, as the engine runs it; default: read from config.json). With `shard`, the part of
    the model one rank of a tensor-parallel replica holds (`models.parallel`).

    A pre-quantized checkpoint's linears stay quantized where `quantized_linears` is given (the module
    each becomes: `quant.checkpoint_linear.quantized_linear`), so host memory stays near the checkpoint's
    own bytes; without it every weight is dequantized into the float model at load."""
    cfg = config or ModelConfig.from_dir(model_dir)
    with torch.device("meta"):
        model = DecoderModel(cfg, dtype, torch.device("meta"), shard)
    scanned = None
    scheme = checkpoint_scheme(model_dir) if quantized_linears is not None and shard is None else None
    if scheme is not None:
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
        scanned = _scan(model_dir, cfg, shapes, scheme)
        keep_quantized(model, scanned)
    model = model.to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed  # to_empty breaks the tie; restore it
    if shard is not None:  # vocabulary padding rows and rank-0-only biases stay zero
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
    load_weights(model, model_dir, scanned, quantized_linears, scheme)
    model.build_rotary(max_positions)
    model.eval()
    return model
