"""LoRA adapters in PEFT's format, several loaded at once, chosen per row inside one batch.

Format: a directory with `adapter_config.json` and `adapter_model.safetensors`, as PEFT's
`save_pretrained` writes it (PEFT is the format nearly every LoRA fine-tune ships in, so that is
the one read here; PEFT itself is not needed at run time). Supported: LoRA on the attention and
dense-MLP projections (`q_proj k_proj v_proj o_proj gate_proj up_proj down_proj`), any rank per
module (`rank_pattern`), `lora_alpha` / `alpha_pattern`, rsLoRA scaling, `layers_to_transform`
(the tensors say which layers). Everything else a PEFT config can ask for (DoRA, trained biases,
`modules_to_save`, embeddings or the LM head as targets, expert weights, latent-attention
projections) is refused by `check_adapter`, with the names, rather than run as something else.

How rows of different adapters share a batch (the question Punica and S-LoRA answer with segmented
gather kernels): every target linear holds all adapters' A matrices stacked into one [parts x R, in]
matrix and their B matrices (scaling folded in) into one [R x parts, out], where R is the adapters'
summed rank. A forward pass computes, for all of its tokens at once, `x A^T` (one GEMM), zeroes each
token's columns that belong to other adapters (one multiply by a 0/1 mask built once per pass from
the tokens' adapter slots), and adds `h B^T` into the base output (one GEMM). Three kernels per
linear whatever the mix of adapters, where a per-adapter loop would launch a gather, two GEMMs and
a scatter per adapter; the price is FLOPs proportional to the total rank of the adapters present
in the pass (only their columns are used: `LoraSet.begin` picks them), small next to the base
GEMM for the handful of adapters a batch mixes. A base-model token's mask row is zero, so its output
is exactly the base model's. Fused projections (`qkv`, `gate_up`) hold one block of columns per
part, each writing into its part's output columns.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from flashx_batch.errors import ModelLoadError
from flashx_batch.models.config import ModelConfig
from flashx_batch.models.safetensors_file import safetensors_header

# PEFT module name -> (our linear inside a decoder layer, part of it, parts it has)
TARGETS = {
    "q_proj": ("attn.qkv", 0, 3), "k_proj": ("attn.qkv", 1, 3), "v_proj": ("attn.qkv", 2, 3),
    "o_proj": ("attn.o_proj", 0, 1),
    "gate_proj": ("mlp.gate_up", 0, 2), "up_proj": ("mlp.gate_up", 1, 2), "down_proj": ("mlp.down", 0, 1),
}
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.([A-Za-z0-9_]+)"
                  r"\.lora_([AB])(?:\.[A-Za-z0-9_-]+)?\.weight$")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


def module_shape(cfg: ModelConfig, module: str) -> tuple[int, int]:
    """(in, out) features of a target projection in this model."""
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}[module]


@dataclass
class AdapterModule:
    """One target projection of one layer: A [r, in], B [out, r] (None until read), its scaling."""

    rank: int
    scale: float
    a_name: str
    b_name: str
    a: torch.Tensor | None = None
    b: torch.Tensor | None = None


@dataclass
class LoraAdapter:
    name: str
    path: Path
    digest: str  # sha256 of the config and the weights: what a job's fingerprint records
    modules: dict[tuple[int, str], AdapterModule] = field(default_factory=dict)  # (layer, PEFT module name)

    @property
    def rank(self) -> int:
        """Columns this adapter takes in a stacked linear: its widest module's rank."""
        return max(m.rank for m in self.modules.values())


def _pattern_value(patterns: dict, key: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: a pattern matches a module whose name ends with it."""
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


def check_adapter(name: str, path: str | Path, cfg: ModelConfig) -> LoraAdapter:
    """Everything that can be wrong with an adapter directory for this model, found from its config
    and the safetensors header (no tensor read) -> the adapter with its modules still unread.
    ModelLoadError naming the file and what to do."""
    where = Path(path)
    config_path, weights_path = where / CONFIG_FILE, where / WEIGHTS_FILE
    if not where.is_dir():
        raise ModelLoadError(f"LoRA adapter {name!r}: {where} is not a directory (PEFT's save_pretrained writes "
                             f"{CONFIG_FILE} and {WEIGHTS_FILE} into one).")
    try:
        raw = json.loads(config_path.read_text())
        if not isinstance(raw, dict):
            raise ValueError("not an object")
    except FileNotFoundError:
        raise ModelLoadError(f"LoRA adapter {name!r}: {config_path} is missing; is {where} a PEFT adapter "
                             "directory?") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"LoRA adapter {name!r}: {config_path} is not valid JSON ({exc}).") from None
    problems = []
    if str(raw.get("peft_type", "LORA")).upper() != "LORA":
        problems.append(f"peft_type={raw.get('peft_type')} (only LORA is supported)")
    for key, why in (("use_dora", "DoRA"), ("lora_bias", "trained LoRA biases"), ("fan_in_fan_out", "Conv1D layouts")):
        if raw.get(key):
            problems.append(f"{key}=true ({why} not supported)")
    if raw.get("bias", "none") != "none":
        problems.append(f"bias={raw['bias']!r} (trained biases not supported; only 'none')")
    for key in ("modules_to_save", "target_parameters", "trainable_token_indices"):
        if raw.get(key):
            problems.append(f"{key}={raw[key]!r} (fully trained modules / parameters not supported)")
    if problems:
        raise ModelLoadError(f"LoRA adapter {name!r} ({config_path}): " + "; ".join(problems) + ".")
    if not weights_path.is_file():
        hint = (" (adapter_model.bin: save it again with safe_serialization=True)"
                if (where / "adapter_model.bin").is_file() else "")
        raise ModelLoadError(f"LoRA adapter {name!r}: {weights_path} is missing{hint}.")
    header = safetensors_header(weights_path)
    alpha = raw.get("lora_alpha", 8)
    rslora = bool(raw.get("use_rslora"))
    pairs: dict[tuple[int, str], dict[str, tuple[str, list[int]]]] = {}
    unsupported = []
    for key, info in header.items():
        match = _KEY.match(key)
        if match is None or match.group(2) not in TARGETS:
            unsupported.append(key)
            continue
        layer, module, which = int(match.group(1)), match.group(2), match.group(3)
        pairs.setdefault((layer, module), {})[which] = (key, [int(d) for d in info["shape"]])
    if unsupported:
        raise ModelLoadError(f"LoRA adapter {name!r} ({weights_path.name}): targets this runtime cannot apply to "
                             f"{cfg.architecture}: {sorted(unsupported)[:6]}{' …' if len(unsupported) > 6 else ''}; "
                             f"supported are {', '.join(TARGETS)} of standard-attention layers and dense MLPs.")
    if not pairs:
        raise ModelLoadError(f"LoRA adapter {name!r}: {weights_path} holds no LoRA weights.")
    adapter = LoraAdapter(name, where, _digest(config_path, weights_path))
    for (layer, module), parts in sorted(pairs.items()):
        label = f"layer {layer} {module}"
        if set(parts) != {"A", "B"}:
            raise ModelLoadError(f"LoRA adapter {name!r} ({weights_path.name}): {label} has lora_{''.join(parts)} "
                                 "only; the file is incomplete.")
        if layer >= cfg.num_layers:
            raise ModelLoadError(f"LoRA adapter {name!r}: {label}, but {cfg.architecture} has {cfg.num_layers} "
                                 "layers; was it trained on another base model?")
        if cfg.mla is not None and module in ("q_proj", "k_proj", "v_proj", "o_proj"):
            raise ModelLoadError(f"LoRA adapter {name!r}: {label}: latent-attention projections are not supported.")
        if module in ("gate_proj", "up_proj", "down_proj") and cfg.moe is not None and cfg.moe.sparse_layers[layer]:
            raise ModelLoadError(f"LoRA adapter {name!r}: {label}: layer {layer}'s MLP is a mixture of experts; "
                                 "LoRA on experts is not supported.")
        (a_name, a_shape), (b_name, b_shape) = parts["A"], parts["B"]
        fan_in, fan_out = module_shape(cfg, module)
        rank = a_shape[0] if len(a_shape) == 2 else -1
        if a_shape != [rank, fan_in] or b_shape != [fan_out, rank] or rank < 1:
            raise ModelLoadError(f"LoRA adapter {name!r} ({weights_path.name}): {label} has A {a_shape} and B "
                                 f"{b_shape}; {cfg.architecture} needs A [r, {fan_in}] and B [{fan_out}, r]. Was it "
                                 "trained on another base model?")
        block = "mlp" if TARGETS[module][0].startswith("mlp") else "self_attn"
        peft_key = f"model.layers.{layer}.{block}.{module}"
        module_alpha = float(_pattern_value(raw.get("alpha_pattern"), peft_key, alpha))
        scale = module_alpha / math.sqrt(rank) if rslora else module_alpha / rank
        adapter.modules[(layer, module)] = AdapterModule(rank, scale, a_name, b_name)
    return adapter


def _digest(*files: Path) -> str:
    h = hashlib.sha256()
    for path in files:
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
        h.update(b"\0")
    return h.hexdigest()


def read_adapter(name: str, path: str | Path, cfg: ModelConfig) -> LoraAdapter:
    """`check_adapter`, then the A / B tensors read (float32, host)."""
    from safetensors import safe_open

    adapter = check_adapter(name, path, cfg)
    with safe_open(str(adapter.path / WEIGHTS_FILE), framework="pt") as fh:
        for module in adapter.modules.values():
            module.a = fh.get_tensor(module.a_name).float()
            module.b = fh.get_tensor(module.b_name).float()
    return adapter


@dataclass(frozen=True)
class RowAdapters:
    """The adapter slot of each row of a forward pass (0: the base model) and the slots present."""

    slots: torch.Tensor  # [B] long, on the model's device
    present: tuple[int, ...]  # sorted, without 0, never empty


class LoraPass:
    """The adapters of one forward pass: per token, which adapter's columns count (`mask`)."""

    def __init__(self, owner: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor | None,
                 columns: torch.Tensor | None) -> None:
        """`owner` [R'] the adapter slot of each column in use, `slots` [N] each token's slot (0: the
        base model), `keep` the tokens a last_only pass keeps after its final attention, `columns` the
        stacked columns in use (None: all)."""
        self.columns = columns
        full = (slots[:, None] == owner[None, :])
        self._base = {len(slots): full}
        if keep is not None:
            self._base.setdefault(len(keep), full[keep])
        self._masks: dict[tuple[int, int], torch.Tensor] = {}
        self.window: tuple[int, int, int] | None = None  # (first, end, of rows): a chunk of the pass's rows

    def mask(self, parts: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
        """[rows, parts x R'] 0/1 in `dtype` for a linear with `parts` blocks of columns run on `rows` tokens."""
        window = self.window
        total = window[2] if window is not None else rows
        key = (parts, total)
        mask = self._masks.get(key)
        if mask is None:
            base = self._base.get(total)
            if base is None:
                raise RuntimeError(f"LoRA: a linear ran on {total} tokens; this pass's adapters are set for "
                                   f"{sorted(self._base)} (a forward layout that does not pass its rows' adapters)")
            mask = self._masks[key] = base.repeat(1, parts).to(dtype)
        return mask if window is None else mask[window[0] : window[1]]


class LoraLinear:
    """The adapters' stacked weights for one of our linears: A [parts x R, in], B^T [parts x R, out]."""

    def __init__(self, owner: LoraSet, a: torch.Tensor, bt: torch.Tensor, parts: int) -> None:
        self.owner, self.a, self.bt, self.parts = owner, a, bt, parts
        self._subset: tuple[object, torch.Tensor, torch.Tensor] | None = None  # (columns key, A, B^T)

    def add_(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y += each token's own adapter's delta for input x (y: the base linear's output)."""
        run = self.owner.current
        if run is None:
            return y
        x2 = x.reshape(-1, x.shape[-1])
        mask = run.mask(self.parts, x2.shape[0], y.dtype)
        a, bt = self._weights(run)
        h = F.linear(x2, a).mul_(mask)
        if y.is_contiguous():
            y.view(-1, y.shape[-1]).addmm_(h, bt)
            return y
        return y + (h @ bt).view(y.shape)

    def _weights(self, run: LoraPass) -> tuple[torch.Tensor, torch.Tensor]:
        if run.columns is None:
            return self.a, self.bt
        cached = self._subset
        if cached is None or cached[0] is not self.owner.columns_key:
            rows = self.owner.part_columns(run.columns, self.parts)
            cached = (self.owner.columns_key, self.a.index_select(0, rows), self.bt.index_select(0, rows))
            self._subset = cached
        return cached[1], cached[2]


class LoraSet:
    """Every adapter an engine loaded, stacked into the model's target linears (`Linear.lora`).

    Slot 0 is the base model; adapter i of `adapters` is slot i + 1. `begin` sets a pass's tokens'
    slots, `end` clears them (a pass without `begin` runs the base model)."""

    def __init__(self, model, adapters: Sequence[LoraAdapter]) -> None:
        self.adapters = list(adapters)
        self.names = {a.name: i + 1 for i, a in enumerate(self.adapters)}
        cfg, dtype, device = model.config, model.embed.dtype, model.embed.device
        offsets, owner, start = [], [], 0
        for slot, adapter in enumerate(self.adapters, start=1):
            offsets.append(start)
            owner += [slot] * adapter.rank
            start += adapter.rank
        self.width = start
        self.owner = torch.tensor(owner, dtype=torch.long, device=device)
        self.current: LoraPass | None = None
        self.columns_key: object = None
        self._column_sets: dict[tuple[int, ...], tuple[object, torch.Tensor, torch.Tensor]] = {}
        self._offsets = offsets
        for layer_index, layer in enumerate(model.layers):
            grouped: dict[str, list[tuple[int, str]]] = {}
            for module, (ours, _, _) in TARGETS.items():
                grouped.setdefault(ours, []).append((layer_index, module))
            for ours, modules in grouped.items():
                if not any(key in a.modules for a in self.adapters for key in modules):
                    continue
                linear = layer.get_submodule(ours)
                parts = TARGETS[modules[0][1]][2]
                a = torch.zeros(parts * self.width, linear.weight.shape[1])
                bt = torch.zeros(parts * self.width, linear.weight.shape[0])
                out_sizes = [module_shape(cfg, m)[1] for _, m in modules]
                for adapter, offset in zip(self.adapters, offsets):
                    for key in modules:
                        found = adapter.modules.get(key)
                        if found is None:
                            continue
                        part = TARGETS[key[1]][1]
                        first = part * self.width + offset
                        out_first = sum(out_sizes[:part])
                        a[first : first + found.rank] = found.a
                        out_last = out_first + out_sizes[part]
                        bt[first : first + found.rank, out_first:out_last] = found.b.t() * found.scale
                linear.lora = LoraLinear(self, a.to(dtype=dtype, device=device), bt.to(dtype=dtype, device=device),
                                         parts)

    def slot(self, name: str | None) -> int:
        """The slot of adapter `name` (None: the base model, 0); KeyError for a name not loaded."""
        return 0 if name is None else self.names[name]

    def part_columns(self, columns: torch.Tensor, parts: int) -> torch.Tensor:
        return torch.cat([columns + p * self.width for p in range(parts)])

    def begin(self, rows: RowAdapters | None, shape: torch.Size, row_lengths: tuple[int, ...] | None,
              keep: torch.Tensor | None) -> None:
        """Set a pass's adapters from its rows' (`rows`; None: the base model only) for token ids of
        `shape`: [B, T] with one row per line, or [1, N] packing rows of `row_lengths`. `keep`: the
        (flattened) tokens a last_only pass keeps after its final attention."""
        if rows is None or not rows.present:
            self.current = None
            return
        slots = rows.slots
        if row_lengths is not None and shape[0] == 1:
            if len(row_lengths) != len(slots):
                raise RuntimeError(f"LoRA: {len(slots)} rows' adapters for a pass packing {len(row_lengths)} rows")
            slots = torch.repeat_interleave(slots, torch.tensor(row_lengths, device=slots.device))
        elif shape[0] == len(slots):
            slots = slots[:, None].expand(shape[0], shape[1]).reshape(-1)
        else:
            raise RuntimeError(f"LoRA: {len(slots)} rows' adapters for a pass over token ids {tuple(shape)}")
        if len(rows.present) == len(self.adapters):
            columns, owner = None, self.owner
            self.columns_key = None
        else:
            cached = self._column_sets.get(rows.present)
            if cached is None:
                spans = [(self._offsets[s - 1], self.adapters[s - 1].rank) for s in rows.present]
                columns = torch.cat([torch.arange(first, first + n) for first, n in spans]).to(self.owner.device)
                cached = self._column_sets[rows.present] = (object(), columns, self.owner[columns])
                if len(self._column_sets) > 16:
                    self._column_sets.pop(next(iter(self._column_sets)))
            self.columns_key, columns, owner = cached
        self.current = LoraPass(owner, slots, keep, columns)

    def end(self) -> None:
        self.current = None


def row_adapters(lora: LoraSet | None, slots: Sequence[int], device: torch.device) -> RowAdapters | None:
    """A pass's rows' adapter slots, for `DecoderModel.hidden_states` (None when the model loaded no
    adapters or every row runs the base model: no LoRA work at all)."""
    present = tuple(sorted(set(slots) - {0})) if lora is not None else ()
    if not present:
        return None
    return RowAdapters(torch.tensor(list(slots), dtype=torch.long, device=device), present)
