"""Layer-range loading: build and run only the decoder layers one stage owns.

A stage reads `model.safetensors.index.json`, opens **only** the shards that hold
its keys (`safetensors.safe_open`) and places each tensor itself into a skeleton
built with accelerate's `init_empty_weights` (parameters on the meta device cost
nothing). accelerate's `load_checkpoint_in_model` is not used: it reads every
shard even when the model holds a few layers.

Ownership: stage [start, stop) holds `layers[start:stop]` (MoE experts included);
the first stage also holds the token embeddings; every stage builds the rotary
module (it has no parameters, only buffers derived from the config); the last stage
loads the final norm and the LM head only when it scores (validation, `head=True`):
calibration stops at the last attention.

Every checkpoint key of the stage's layers (and, for the first stage, of the embeddings) is accounted for
before any tensor is read: it is placed into a parameter or buffer, consumed as the scale of a block-FP8
weight (`<name>.weight_scale_inv`, dequantized with its weight by
`oscar.pipeline.models.dequantize_block_fp8`, the one rule every loader follows), or ignored by a named
rule (`IGNORED_KEYS`; the MTP layers past the last decoder layer, which the last stage accounts for, by
`oscar.modelconfig.MTP_RULE`); any other key is an error naming it, so a tensor can never be dropped silently.
A checkpoint quantized any other way is refused by `checkpoint_quantization` before a weight is read.
Block-FP8 weights are dequantized at load, on CPU, tensor by tensor as their shard is read, to the
stage's compute dtype: on CUDA too FP8 is not kept (transformers' fine-grained FP8 layers are not used).

Ray-free: importable and testable in one process.
"""

from __future__ import annotations

import copy
from collections import Counter
import json
import os
import re
from dataclasses import dataclass, field

import safetensors
import torch
from accelerate import init_empty_weights
from accelerate.utils import set_module_tensor_to_device
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.masking_utils import create_causal_mask

from oscar.cluster.balance import balance_layers
from oscar.cluster.placement import num_experts as _num_experts  # the name the cluster modules import
from oscar.common import OscarError
from oscar.modelconfig import MTP_RULE, check_layer_keys, layer_of, read_config
from oscar.pipeline.models import (SCALE_SUFFIX, checkpoint_quantization, dequantize_block_fp8, is_float8,
                                   scale_key)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

# Fused expert parameters (transformers >= 5 layout) and the per-expert
# checkpoint keys they are stacked from (Hugging Face checkpoint layout).
# Each entry: fused suffix -> list of per-expert suffixes concatenated on dim 0
# of every expert's matrix (gate then up), then stacked over experts.
_FUSED_EXPERTS = {
    "experts.gate_up_proj": [("gate_proj.weight", "w1.weight"), ("up_proj.weight", "w3.weight")],
    "experts.down_proj": [("down_proj.weight", "w2.weight")],
}


# Checkpoint keys a stage reads nothing from, each by a named rule: (rule, pattern on the key).
IGNORED_KEYS: tuple[tuple[str, re.Pattern], ...] = (
    # older checkpoints saved the rotary module's inverse frequencies; every stage rebuilds them from the config
    ("rotary inv_freq buffer (rebuilt from the config)", re.compile(r"(^|\.)rotary_emb\.inv_freq$")),
)


def ignored_by(key: str) -> str | None:
    """The name of the rule that ignores checkpoint key `key`, or None."""
    return next((rule for rule, pat in IGNORED_KEYS if pat.search(key)), None)


@dataclass
class StageSpec:
    """Decoder layers [start, stop) of a model with `num_layers` layers."""

    start: int
    stop: int
    num_layers: int

    def __post_init__(self):
        if not 0 <= self.start < self.stop <= self.num_layers:
            raise OscarError(f"bad layer range [{self.start}, {self.stop}) for a {self.num_layers}-layer model")

    @property
    def first(self) -> bool:
        return self.start == 0

    @property
    def last(self) -> bool:
        return self.stop == self.num_layers

    @property
    def layers(self) -> range:
        return range(self.start, self.stop)


@dataclass
class LoadReport:
    """What a stage read: tests assert a stage never holds anything outside its range."""

    keys: list[str] = field(default_factory=list)     # checkpoint keys read
    shards: list[str] = field(default_factory=list)   # shard files opened (basenames)
    bytes: int = 0                                     # bytes of the tensors read (checkpoint dtype)
    params: list[str] = field(default_factory=list)   # module parameters/buffers materialised (full names)
    dequantized: list[str] = field(default_factory=list)  # block-FP8 weight keys dequantized (scales consumed)
    ignored: dict[str, str] = field(default_factory=dict)  # checkpoint key -> the rule that ignores it (not read)


class Checkpoint:
    """The safetensors checkpoint of a Hugging Face model directory (sharded or single file)."""

    def __init__(self, model_dir: str):
        self.dir = model_dir
        idx = os.path.join(model_dir, INDEX_NAME)
        single = os.path.join(model_dir, SINGLE_NAME)
        if os.path.isfile(idx):
            self.weight_map: dict[str, str] = read_index(idx)
        elif os.path.isfile(single):
            with safetensors.safe_open(single, framework="pt") as f:
                self.weight_map = {k: SINGLE_NAME for k in f.keys()}
        else:
            raise OscarError(f"{model_dir}: no {INDEX_NAME} or {SINGLE_NAME} (layer-range loading needs safetensors)")

    def __contains__(self, key: str) -> bool:
        return key in self.weight_map

    def shard_path(self, shard: str, key: str) -> str:
        """The file of `shard`; a one-line OscarError naming `key` when the index points at no file."""
        p = os.path.join(self.dir, shard)
        if not os.path.isfile(p):
            raise OscarError(f"{os.path.join(self.dir, INDEX_NAME)}: weight_map puts {key} in {shard}, "
                             f"but there is no file {p}")
        return p

    def shard_sizes(self) -> dict[str, int]:
        shards = {}
        for k, s in self.weight_map.items():
            shards.setdefault(s, k)
        return {s: os.path.getsize(self.shard_path(s, k)) for s, k in sorted(shards.items())}


def read_index(path: str) -> dict[str, str]:
    """The weight_map of a safetensors index (tensor name -> shard file name); OscarError when malformed."""
    try:
        with open(path) as f:
            wm = json.load(f)["weight_map"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise OscarError(f"{path}: not a readable safetensors index with a weight_map "
                         f"({type(e).__name__}: {e})") from None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise OscarError(f"{path}: weight_map must map tensor names to shard file names")
    return wm


def _checkpoint_sources(name: str, ckpt: Checkpoint, num_experts: int | None) -> list[list[str]] | None:
    """Checkpoint keys for module tensor `name`: [[key]] for a direct match, or for a
    fused expert tensor a list (one per expert) of keys to concatenate. None: absent."""
    for cand in (name, name.removeprefix("model.")):
        if cand in ckpt:
            return [[cand]]
    for fused, parts in _FUSED_EXPERTS.items():
        if not name.endswith(fused) or not num_experts:
            continue
        base = name[: -len(fused)] + "experts"
        for alt in range(len(parts[0])):  # naming family: gate/up/down or w1/w3/w2
            keys = [[f"{base}.{e}.{p[alt]}" for p in parts] for e in range(num_experts)]
            if all(k in ckpt for ks in keys for k in ks):
                return keys
    return None


class LayerRange(nn.Module):
    """The modules one stage owns; `forward` runs its decoder layers on hidden states."""

    def __init__(self, config, spec: StageSpec, embed: nn.Module | None, rotary: nn.Module, layers: list[nn.Module],
                 norm: nn.Module | None = None, lm_head: nn.Module | None = None):
        super().__init__()
        self.config = config
        self.spec = spec
        self.embed_tokens = embed
        self.rotary_emb = rotary
        self.norm, self.lm_head = norm, lm_head  # the last stage, when it scores (load_layer_range(head=True))
        # Keyed by global layer index so parameter names say which layers a stage holds.
        self.layers = nn.ModuleDict({str(spec.start + i): m for i, m in enumerate(layers)})
        self._rotary: dict[str, nn.Module] = {}  # rotary copies per device (a multi-GPU stage)

    def set_attn_implementation(self, name: str) -> None:
        """The attention function every layer of the stage calls (and the mask it builds), as on a full model."""
        self.config._attn_implementation = name

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is None:
            raise OscarError(f"stage [{self.spec.start}, {self.spec.stop}) does not own the embeddings")
        return self.embed_tokens(input_ids)  # (B, T, H)

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, cache=None, **kwargs) -> torch.Tensor:
        """Run layers [start, stop) on `hidden` (B, T, H).

        Recomputes what the full model computes once before its first layer: default
        position ids, the causal/padding mask (for the configured attention
        implementation) and the rotary embeddings. `attention_mask` is the 2D
        padding mask (B, T) of 1/0, as the full model receives it. `cache`: a transformers
        Cache indexed by global layer index, holding this stage's layers (the tokens before
        `hidden`; `position_ids` then say where `hidden` starts); the mask is sized against its
        first layer here, since the layers before the stage's are not in it.
        """
        if position_ids is None:
            position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)  # (1, T)
        dev, mask, pos_emb = None, None, None
        # DSA (GLM-5): the indexer needs the full mask (as the model builds it), and a "shared" layer reuses the
        # previous layer's top-k, which the stage carries from layer to layer (a stage never starts on one)
        indexed = bool(getattr(self.config, "indexer_types", None))
        extra: dict = {"prev_topk_indices": None} if indexed else {}
        for idx, layer in self.layers.items():
            ldev = next(layer.parameters()).device
            if ldev != dev:  # first layer, or the next GPU of a multi-GPU stage: move and rebuild inputs
                dev = ldev
                hidden, position_ids = hidden.to(dev), position_ids.to(dev)
                am = attention_mask.to(dev) if attention_mask is not None else None
                mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=am,
                                          cache=cache, position_ids=position_ids,
                                          **({"layer_idx": int(idx)} if cache is not None else {}),
                                          **({"allow_is_causal_skip": False} if indexed else {}))
                pos_emb = self._rotary_on(dev)(hidden, position_ids)  # (cos, sin), each (B|1, T, rot_dim)
                if extra.get("prev_topk_indices") is not None:
                    extra["prev_topk_indices"] = extra["prev_topk_indices"].to(dev)
            out = layer(hidden, attention_mask=mask, position_embeddings=pos_emb, position_ids=position_ids,
                        cache=cache, use_cache=cache is not None, **extra, **kwargs)
            if indexed:  # GLM-5's decoder layer returns (hidden, the top-k its attention used)
                hidden, extra["prev_topk_indices"] = out
            else:
                hidden = out
        return hidden  # (B, T, H)


    def _rotary_on(self, dev: torch.device) -> nn.Module:
        if next(iter(self.rotary_emb.buffers())).device == dev:
            return self.rotary_emb
        key = str(dev)
        if key not in self._rotary:
            self._rotary[key] = copy.deepcopy(self.rotary_emb).to(dev)
        return self._rotary[key]


def assign_devices(costs: list[int], devices: list[str]) -> list[str]:
    """Contiguous split of a stage's layers over its devices, balanced by parameter bytes."""
    n = min(len(devices), len(costs))
    out = []
    for dev, (a, b) in zip(devices, balance_layers(costs, n)):
        out += [dev] * (b - a)
    return out


def load_config(model_dir: str, attn_implementation: str | None = None, experts_implementation: str | None = "eager"):
    config = read_config(model_dir)
    if attn_implementation:
        config._attn_implementation = attn_implementation
    if experts_implementation and _num_experts(config):
        # Per-expert token counts need the eager experts path (grouped kernels bypass hooks).
        config._experts_implementation = experts_implementation
    return config


def build_skeleton(config) -> nn.Module:
    """The whole causal LM on the meta device: structure without memory."""
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config)
    return model.eval()


def load_layer_range(model_dir: str, start: int, stop: int, *, config=None, dtype: torch.dtype = torch.float32,
                     device: str | torch.device = "cpu", devices: list[str] | None = None, head: bool = False
                     ) -> tuple[LayerRange, LoadReport]:
    """Load decoder layers [start, stop) of the safetensors checkpoint in `model_dir`.

    Opens only the shards holding those layers' keys (plus the embeddings' shard for
    the first stage). `devices` (e.g. the GPUs of a multi-GPU stage) spreads the layers
    contiguously over several devices, balanced by parameter bytes; the embeddings go
    to the first. head=True: the last stage also holds the final norm and the LM head (tied
    to the embeddings where the config says so), on the last device: what validation needs
    and calibration does not. Returns the stage module (eval mode) and what was read.
    """
    config = config if config is not None else load_config(model_dir)
    text_cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    spec = StageSpec(start, stop, text_cfg.num_hidden_layers)
    shared = [i for i, t in enumerate(getattr(text_cfg, "indexer_types", None) or []) if t == "shared"]
    if start in shared:
        raise OscarError(f"stage [{start}, {stop}) starts at layer {start}, whose DSA indexer reuses layer "
                         f"{start - 1}'s top-k (indexer_types[{start}] = 'shared'): a stage boundary must fall "
                         f"before a layer with its own indexer (layers with one: "
                         f"{[i for i in range(spec.num_layers) if i not in shared][:12]})")
    # before any weight is read: another quantization method is refused by name; block FP8 gives its block size
    block = checkpoint_quantization(config, os.path.join(model_dir, "config.json"))
    ckpt = Checkpoint(model_dir)
    skeleton = build_skeleton(config)
    base = skeleton.get_decoder() if hasattr(skeleton, "get_decoder") else getattr(skeleton, skeleton.base_model_prefix)
    base_prefix = next(n for n, m in skeleton.named_modules() if m is base)  # e.g. "model"
    pre = f"{base_prefix}." if base_prefix else ""

    owned: dict[str, nn.Module] = {f"{pre}layers.{i}": base.layers[i] for i in spec.layers}
    if spec.first:
        owned[f"{pre}embed_tokens"] = base.embed_tokens
    head = head and spec.last
    lm_head = skeleton.get_output_embeddings() if head else None
    head_name = next(n for n, m in skeleton.named_modules() if m is lm_head) if head else ""  # e.g. "lm_head"
    if head:
        owned[f"{pre}norm"] = base.norm
        owned[head_name] = lm_head
    tied = head and bool(getattr(text_cfg, "tie_word_embeddings", False))

    # Plan: module tensor -> checkpoint keys, grouped by shard.
    n_exp = _num_experts(text_cfg)
    plan: list[tuple[nn.Module, str, str, list[list[str]]]] = []  # (module, local name, full name, sources)
    for mprefix, mod in owned.items():
        persistent = {n for n, _ in mod.named_parameters()} | {
            n for n, b in mod.named_buffers() if _is_persistent(mod, n)}
        for local in sorted(persistent):
            full = f"{mprefix}.{local}"
            src = _checkpoint_sources(full, ckpt, n_exp)
            if src is None and tied and mod is lm_head:  # tied: the LM head is the embedding matrix
                src = _checkpoint_sources(f"{pre}embed_tokens.{local}", ckpt, n_exp)
            if src is None:
                if local in dict(mod.named_parameters()):
                    raise OscarError(f"{model_dir}: checkpoint has no tensor for {full}")
                continue  # a buffer the checkpoint does not carry keeps its constructed value
            plan.append((mod, local, full, src))

    # Account for every checkpoint key of the owned layers (and embeddings) before reading any.
    consumed = {k for *_, src in plan for ks in src for k in ks}
    scales: dict[str, str] = {}  # weight key -> its scale key
    for k in consumed:
        sk = scale_key(k)
        if sk is not None and sk in ckpt:
            scales[k] = sk
    mine = {k for k in ckpt.weight_map if (layer_of(k) is not None and start <= layer_of(k) < stop)
            or (spec.first and layer_of(k) is None and "embed_tokens" in k)
            or (head and layer_of(k) is None and (k.removeprefix(pre) in ("norm.weight", "norm.bias")
                                                  or k.startswith(f"{head_name}.")))}
    unaccounted = sorted(mine - consumed - set(scales.values()))
    # MTP layers sit past the last decoder layer: the last stage accounts for them, ignored by their rule
    mtp = check_layer_keys(ckpt.weight_map, text_cfg, model_dir)
    report_ignored = dict.fromkeys(mtp, MTP_RULE) if spec.last else {}
    for k in unaccounted:
        rule = ignored_by(k)
        if rule is not None:
            report_ignored[k] = rule
        elif k.endswith(SCALE_SUFFIX):
            raise OscarError(f"{model_dir}: checkpoint key {k} is a scale whose weight "
                             f"{k[: -len(SCALE_SUFFIX)]} is not a tensor of layers [{start}, {stop})")
        else:
            raise OscarError(f"{model_dir}: checkpoint key {k} of layers [{start}, {stop}) is not placed into any "
                             "parameter or buffer of the model, nor ignored by a named rule")
    if scales and block is None:
        k = sorted(scales)[0]
        raise OscarError(f"{model_dir}: checkpoint holds {scales[k]} (a block-FP8 scale) but config.json has no "
                         "quantization_config")

    devices = [str(d) for d in devices] if devices else [str(device)]
    sizes = [sum(p.numel() for p in base.layers[i].parameters()) for i in spec.layers]
    layer_dev = dict(zip(spec.layers, assign_devices(sizes, devices)))
    dev_of = {f"{pre}layers.{i}": layer_dev[i] for i in spec.layers} | {f"{pre}embed_tokens": devices[0]}
    if head:
        dev_of |= {f"{pre}norm": devices[-1], head_name: devices[-1]}

    needed = sorted({ckpt.weight_map[k] for k in consumed | set(scales.values())})
    report = LoadReport(shards=needed, ignored=report_ignored)
    # One shard open at a time, closed once read: its mmap'd pages leave the resident set, so the
    # peak is the stage's weights plus one shard (plus per-expert parts waiting for their layer).
    keys_of: dict[str, list[str]] = {}
    for *_, src in plan:
        for ks in src:
            for k in ks:
                keys_of.setdefault(ckpt.weight_map[k], []).append(k)
                if k in scales:
                    keys_of.setdefault(ckpt.weight_map[scales[k]], []).append(scales[k])
    uses = Counter(k for *_, src in plan for ks in src for k in ks)  # a tied LM head reads the embeddings again
    keys_of = {sh: list(dict.fromkeys(ks)) for sh, ks in keys_of.items()}
    got: dict[str, torch.Tensor] = {}
    todo = list(plan)
    for shard in needed:
        path = ckpt.shard_path(shard, keys_of[shard][0])
        with safetensors.safe_open(path, framework="pt", device="cpu") as fh:
            held = set(fh.keys())
            for k in keys_of[shard]:
                if k not in held:
                    raise OscarError(f"{os.path.join(model_dir, INDEX_NAME)}: weight_map puts {k} in {shard}, "
                                     f"but {path} holds no such tensor")
                got[k] = fh.get_tensor(k)
                report.keys.append(k)
                report.bytes += got[k].numel() * got[k].element_size()
        ready = [it for it in todo if all(k in got and (k not in scales or scales[k] in got)
                                          for ks in it[3] for k in ks)]
        todo = [it for it in todo if it not in ready]
        for mod, local, full, src in ready:
            cur = _get(mod, local)
            keep_fp32 = cur.dtype == torch.float32 and _keep_fp32(skeleton, full)
            tdt = torch.float32 if keep_fp32 else dtype

            def tensor(k: str) -> torch.Tensor:  # checkpoint tensor k, block-FP8 dequantized (fp32 math) to tdt
                uses[k] -= 1
                t = got.pop(k) if not uses[k] else got[k]
                if k in scales:
                    if not is_float8(t):
                        raise OscarError(f"{model_dir}: {k} has a scale ({scales[k]}) but is {t.dtype}, "
                                         "not float8_e4m3fn")
                    report.dequantized.append(k)
                    return dequantize_block_fp8(t, got.pop(scales[k]), block, tdt, name=k)
                if is_float8(t):
                    raise OscarError(f"{model_dir}: {k} is {t.dtype} but the checkpoint has no "
                                     f"{scale_key(k) or k + SCALE_SUFFIX}: a float8 weight without its scale "
                                     "is a wrong model")
                return t.to(tdt)

            parts = [tensor(ks[0]) if len(ks) == 1 else torch.cat([tensor(k) for k in ks], dim=0) for ks in src]
            value = parts[0] if len(src) == 1 and len(src[0]) == 1 else torch.stack(parts, dim=0)
            if tuple(cur.shape) != tuple(value.shape):
                raise OscarError(f"{full}: checkpoint shape {tuple(value.shape)} != model shape {tuple(cur.shape)}")
            mdev = dev_of[full[: -len(local) - 1]]  # the owned module's prefix
            set_module_tensor_to_device(mod, local, mdev, value=value)
            report.params.append(full)
            del value, parts

    for mprefix, mod in owned.items():
        for n, p in list(mod.named_parameters()) + list(mod.named_buffers()):
            if p.device.type == "meta":
                raise OscarError(f"{mprefix}.{n} was not loaded (missing from the checkpoint)")
        mod.to(dev_of[mprefix])  # buffers the checkpoint does not carry follow their module
    rotary = base.rotary_emb.to(devices[0])
    stage = LayerRange(config, spec, owned.get(f"{pre}embed_tokens"), rotary,
                       [base.layers[i] for i in spec.layers], norm=owned.get(f"{pre}norm"), lm_head=lm_head).eval()
    stage.requires_grad_(False)
    return stage, report


def _is_persistent(mod: nn.Module, name: str) -> bool:
    *path, leaf = name.split(".")
    sub = mod.get_submodule(".".join(path)) if path else mod
    return leaf not in sub._non_persistent_buffers_set


def _get(mod: nn.Module, name: str) -> torch.Tensor:
    *path, leaf = name.split(".")
    sub = mod.get_submodule(".".join(path)) if path else mod
    return getattr(sub, leaf)


def _keep_fp32(model: nn.Module, full: str) -> bool:
    keep = getattr(model, "_keep_in_fp32_modules_strict", None) or []
    return any(re.search(rf"(^|\.){re.escape(k)}(\.|$)", full) for k in keep)


def stage_param_names(stage: LayerRange) -> list[str]:
    """Names of every materialised (non-meta) parameter the stage holds, relative to the stage."""
    return [n for n, p in stage.named_parameters() if p.device.type != "meta"]
