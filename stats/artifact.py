"""The rotation artifact: producer side (fit) and the one reader kernels use (header: oscar.artifact_header).

Format ``oscar-artifact/1`` (docs/artifact-format.md): a safetensors file with,
per layer l,

    layers.{l}.rot_k   float32 (Hkv, D, D)   x_rot = x @ R (row vectors)
    layers.{l}.rot_v   float32 (Hkv, D, D)
    layers.{l}.rot_q   float32 (Hkv, D, D)   only when rot_k is not orthogonal: q_rot = q @ rot_q,
                                            rot_q = rot_k^{-T} (format oscar-artifact/2)
    layers.{l}.k_mean  float32 (Hkv, D)      only when key-mean centering is on
    layers.{l}.clip_k  float32 (Hkv,) or (Hkv, D)   see QuantConfig.mode
    layers.{l}.clip_v  float32 (Hkv,) or (Hkv, D)

and JSON metadata under the safetensors header key ``oscar``.
"""

from __future__ import annotations

import json
import os
import sys
import zlib
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

import safetensors
import torch
from safetensors.torch import load_file, save_file

from oscar.artifact_header import (ARTIFACT_FORMAT, ARTIFACT_FORMAT_L, ARTIFACT_FORMAT_LATENT, ARTIFACT_FORMAT_Q,
                                   read_latent_metadata, read_metadata)
from oscar.common import (OscarError, attention_shapes, config_fingerprint, latent_shapes, model_mismatch,
                          weights_fingerprint)
from oscar.common import allow_weights_mismatch as allow_weights_mismatch_env
from oscar.constraints import quant_problems
from oscar.defaults import LATENT_GROUP, PAGE_SIZE, RECENT, SINK  # the deployed layout's defaults, shared with kernels
from oscar.quant import QuantSpec, parts_bits_per_element

# fields older artifacts may carry that no longer mean anything: `flush_pages` chose whether validation's
# simulator released tokens to INT2 in whole pages; the validation protocol decides that now
_RETIRED_QUANT_FIELDS = ("flush_pages",)
# static mode's channel group: thresholds may differ per channel, so each channel is its own group
STATIC_GROUP_SIZE = 1


def split_width(head_dim: int) -> int:
    """Wide key channels of the split format (QuantConfig.key_split, `oscar fit --variant split`): D/4 (TurboQuant's
    32 of 128) rounded down to whole bytes of top bits, at least one byte's worth (8: head_dim 16 splits 8 + 8)."""
    return max(8, head_dim // 4 // 8 * 8)


def calibrated_length(art: "Artifact") -> int | None:
    """The calibrated length: the fit saw queries and keys at positions [0, n) only — the windows' length, or
    the positions they were read at (`oscar calibrate --positions`) — None: an artifact fitted before it was
    recorded, or imported. Past it RoPE's slow pairs have turned further than any calibrated row, and the key
    error grows (docs/decisions/0065-calibrate-at-the-serving-length-oscar-run.md, "Calibrate at the serving length")."""
    n = _covered(art.meta.get("provenance", {}))
    return int(n) if n else None


def _covered(prov: dict) -> int | None:
    """The positions a provenance record's statistics cover (`calibrated_length`, `describe`)."""
    return prov.get("positions") or prov.get("seq_len")


def beyond_calibration(art: "Artifact | None", length: int) -> str | None:
    """Why a context of `length` tokens is read outside the calibrated positions (None: it is not, or unknown);
    the end of a sentence the validation commands and `OscarCache` begin with what reaches that length."""
    n = calibrated_length(art) if art is not None else None
    if n is None or length <= n:
        return None
    return (f"past the artifact's calibration length ({n} tokens): queries and keys beyond position {n} were never "
            f"calibrated, and the INT2 key error grows there; calibrate with --positions {length} (docs/calibrate.md, "
            "\"Choosing --seq-len and --positions\")")


@dataclass
class QuantConfig:
    """How the serving cache stores K and V (recorded in the artifact).

    mode="minmax": per-group min/max with fp16 scale+zero; clip_* are ratios in (0, 1].
    mode="static": symmetric grid [-clip, clip] with clip_* absolute thresholds in
    the rotated space; exactly ``bits`` bits per element.
    key_axis="channel": KIVI-style per-channel keys over token groups of ``group_size``.
    clip_rule / param_dtype: how minmax mode applies the clip ratio and the dtype of the
    stored scale/zero (see `oscar.quant`; "float8_e4m3fn": 8-bit, 2 + 16/G bits per
    element, directed rounding); the published OSCAR recipe
    (`oscar.stats.reference_recipe`) uses "row-quantile" and "float32". Defaults keep the
    original format, so artifacts written before these fields existed load unchanged.
    """

    bits: int = 2
    group_size: int | None = None  # None: head_dim (token axis)
    key_axis: Literal["token", "channel"] = "token"
    value_axis: Literal["token"] = "token"
    mode: Literal["minmax", "static"] = "minmax"
    sink: int = SINK
    recent: int = RECENT
    page_size: int = PAGE_SIZE
    clip_rule: Literal["ratio", "row-quantile"] = "ratio"
    param_dtype: Literal["float16", "float32", "float8_e4m3fn"] = "float16"  # float8_e4m3fn: 8-bit scale/zero
    # split keys: the first key_split rotated key channels at bits + key_top and the next
    # D - key_split - key_drop at bits, each part its own per-token (scale, zero); the last key_drop channels are
    # not stored (they read as the key mean); key_split 0: one group (the original format)
    key_split: int = 0
    key_top: int = 1
    key_drop: int = 0
    # the keys' scale/zero dtype where it differs from the values' (None: param_dtype). Per-layer widths:
    # a layer whose keys are 3 or 4 bits (key_split = D, every key channel wide) keeps fp16 key params while the
    # 2-bit layers and every value store e4m3 ones
    key_param_dtype: Literal["float16", "float32", "float8_e4m3fn"] | None = None

    def __post_init__(self):
        if self.clip_rule not in ("ratio", "row-quantile"):
            raise OscarError(f"quant.clip_rule must be 'ratio' or 'row-quantile', got {self.clip_rule!r}")
        if self.param_dtype not in ("float16", "float32", "float8_e4m3fn"):
            raise OscarError(f"quant.param_dtype must be 'float16', 'float32' or 'float8_e4m3fn', "
                             f"got {self.param_dtype!r}")
        if self.key_param_dtype not in (None, "float16", "float32", "float8_e4m3fn"):
            raise OscarError(f"quant.key_param_dtype must be None, 'float16', 'float32' or 'float8_e4m3fn', "
                             f"got {self.key_param_dtype!r}")
        if self.key_param_dtype and self.mode == "static":
            raise OscarError("quant.key_param_dtype: static mode stores no per-token key parameters")
        if self.clip_rule == "row-quantile" and (self.mode != "minmax" or self.key_axis != "token"):
            raise OscarError("quant.clip_rule='row-quantile' clamps token rows: needs mode='minmax' and key_axis='token'")
        if self.key_split < 0 or (self.key_split and (self.mode != "minmax" or self.key_axis != "token"
                                                       or self.group_size or self.clip_rule != "ratio")):
            raise OscarError(f"quant.key_split={self.key_split}: split keys are per-token min/max groups with ratio clips "
                             "(mode='minmax', key_axis='token', group_size=None, clip_rule='ratio')")
        if self.key_top < 1 or self.key_drop < 0 or (not self.key_split and (self.key_top != 1 or self.key_drop)):
            raise OscarError(f"quant.key_top={self.key_top} / key_drop={self.key_drop} shape split keys: key_top >= 1, "
                             f"key_drop >= 0, and both need key_split > 0 (got key_split={self.key_split})")

    @property
    def torch_param_dtype(self) -> torch.dtype:
        """The values' scale/zero dtype (and the keys' unless key_param_dtype says otherwise)."""
        return getattr(torch, self.param_dtype)

    @property
    def torch_key_param_dtype(self) -> torch.dtype:
        return getattr(torch, self.key_param_dtype or self.param_dtype)

    def key_spec(self, head_dim: int) -> QuantSpec:
        """The one derivation of the keys' quantizer (fit's clip search, the paged cache, validation)."""
        if self.key_axis == "channel":  # KIVI: per channel over token groups (the cache's page)
            return QuantSpec(bits=self.bits, axis="channel", group_size=self.group_size or self.page_size,
                             param_dtype=self.torch_key_param_dtype)
        vs = self.value_spec(head_dim)
        return replace(vs, param_dtype=self.torch_key_param_dtype) if self.key_param_dtype else vs

    def key_parts(self, head_dim: int) -> list[tuple[int, int, QuantSpec]] | None:
        """Split keys: [(0, key_split, wide spec), (key_split, D - key_drop, spec)], channels [a, b) of the rotated
        key each a per-token group (the channels after the last part are not stored); None for one group (key_spec).
        key_split = D - key_drop: one part, every stored channel wide (a layer's keys at bits + key_top)."""
        if not self.key_split:
            return None
        sp = lambda b: QuantSpec(bits=b, param_dtype=self.torch_key_param_dtype)  # noqa: E731
        parts = [(0, self.key_split, sp(self.bits + self.key_top)), (self.key_split, head_dim - self.key_drop, sp(self.bits))]
        return [p for p in parts if p[1] > p[0]]

    def key_bits(self, head_dim: int) -> float:
        """Stored bits per key element of the history (codes and every scale/zero)."""
        parts = self.key_parts(head_dim)
        if parts is None:
            return self.key_spec(head_dim).bits_per_element(head_dim)
        return parts_bits_per_element(parts, head_dim)

    def value_bits(self, head_dim: int) -> float:
        return self.value_spec(head_dim).bits_per_element(head_dim)

    def bits_per_element(self, head_dim: int) -> float:
        """K and V averaged: what the history costs per element (the 2.5-bit budget reads this)."""
        return 0.5 * (self.key_bits(head_dim) + self.value_bits(head_dim))

    def value_spec(self, head_dim: int) -> QuantSpec:
        if self.mode == "static":
            # thresholds per head or per (head, channel): one channel per group; layer constants, no
            # per-token params, so they stay fp16 whatever param_dtype says (the cache stores fp16)
            return QuantSpec(bits=self.bits, group_size=STATIC_GROUP_SIZE, mode="static")
        return QuantSpec(bits=self.bits, group_size=self.group_size, mode="minmax",
                         param_dtype=self.torch_param_dtype, clip_rule=self.clip_rule)


@dataclass
class Artifact:
    rot_k: list[torch.Tensor]  # per layer (Hkv, D, D)
    rot_v: list[torch.Tensor]  # per layer (Hkv, D, D)
    clip_k: list[torch.Tensor]  # per layer (Hkv,) or (Hkv, D)
    clip_v: list[torch.Tensor]
    k_mean: list[torch.Tensor] | None = None  # per layer (Hkv, D) when centering is on
    quant: QuantConfig = field(default_factory=QuantConfig)
    meta: dict[str, Any] = field(default_factory=dict)  # model, variant, d_eff, fallbacks, provenance...
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # other named tensors, saved verbatim
    rot_q: list[torch.Tensor] | None = None  # per layer (Hkv, D, D) = rot_k^{-T}; None: rot_k is orthogonal
    # per-layer formats (key widths across layers; format oscar-artifact/3): layer l stores its K/V as
    # layer_quant[l], which may differ from `quant` in LAYER_QUANT_FIELDS only (the layout is the model's); None: `quant`
    layer_quant: list[QuantConfig] | None = None

    def quant_for(self, layer: int) -> QuantConfig:
        """The format layer `layer` stores its K/V in (the one place per-layer widths are read)."""
        return self.layer_quant[layer] if self.layer_quant is not None else self.quant

    @property
    def num_layers(self) -> int:
        return len(self.rot_k)

    @property
    def num_kv_heads(self) -> int:
        return self.rot_k[0].shape[0]

    @property
    def head_dim(self) -> int:
        return self.rot_k[0].shape[-1]

    def validate(self) -> None:
        L, H, D = self.num_layers, self.num_kv_heads, self.head_dim
        if self.layer_quant is not None:
            check_layer_quant(self.quant, self.layer_quant, L, D)
        names = ("rot_k", "rot_v", "clip_k", "clip_v") + (("k_mean",) if self.k_mean is not None else ()) \
            + (("rot_q",) if self.rot_q is not None else ())
        for name in names:
            ts = getattr(self, name)
            if len(ts) != L:
                raise OscarError(f"artifact: {name} has {len(ts)} layers, rot_k has {L}")
            for l, t in enumerate(ts):
                want = {"rot_k": (H, D, D), "rot_v": (H, D, D), "rot_q": (H, D, D), "k_mean": (H, D)}.get(name)
                parts = self.quant_for(l).key_parts(D) if name == "clip_k" else None
                if parts and len(parts) > 1:
                    want = (H, len(parts))  # one ratio per head and key part
                ok = tuple(t.shape) == want if want else tuple(t.shape) in ((H,), (H, D))
                if parts and len(parts) == 1 and tuple(t.shape) != (H,):  # one part: one ratio per head
                    raise OscarError(f"artifact: layers.{l}.clip_k has shape {tuple(t.shape)}, expected ({H},) (keys of "
                                     f"one part, key_split={self.quant_for(l).key_split})")
                if not ok:
                    raise OscarError(f"artifact: layers.{l}.{name} has shape {tuple(t.shape)}, expected {want or f'({H},) or ({H}, {D})'}")
                if not torch.isfinite(t).all():
                    raise OscarError(f"artifact: layers.{l}.{name} contains NaN/Inf")
        for l in range(L) if self.rot_q is not None else ():  # q_rot · k_rot = q · k needs rot_qᵀ rot_k = I
            err = (self.rot_q[l].double().transpose(-1, -2) @ self.rot_k[l].double() - torch.eye(D, dtype=torch.float64)).abs().max()
            if err > 1e-3:
                raise OscarError(f"artifact: layers.{l}.rot_q is not rot_k^(-T) (max |rot_qᵀ rot_k - I| = {err:.2e}); "
                                 "queries and keys would be read in different spaces")

    def check_model(self, config: Any, *, allow_weights_mismatch: bool | None = None) -> None:
        """Refuse a model whose attention shapes, config fingerprint or attention weights differ.

        The weights are compared when the artifact records them (fitted from a store that hashed its
        model's checkpoint) and the model was loaded from a checkpoint directory
        (`config._name_or_path`). allow_weights_mismatch (default: `oscar --allow-weights-mismatch`,
        $OSCAR_ALLOW_WEIGHTS_MISMATCH): accept other weights of the same config, with a warning.
        """
        shapes = attention_shapes(config)
        mine = {"num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim}
        bad = {k: (v, shapes[k]) for k, v in mine.items() if shapes[k] != v}
        if bad:
            desc = ", ".join(f"{k}: artifact {a} vs model {b}" for k, (a, b) in bad.items())
            raise OscarError(f"artifact does not match the model ({desc}); fit an artifact for this model")
        rec = self.meta.get("model", {})
        if not rec.get("fingerprint"):
            return
        src = getattr(config, "_name_or_path", None) or getattr(config, "name_or_path", None)
        w = weights_fingerprint(src) if rec.get("weights_fingerprint") and src and os.path.isdir(str(src)) else None
        want = {"name": str(src or "this model"), "config_fingerprint": config_fingerprint(config), **(w or {})}
        why = model_mismatch(rec, want, "artifact")
        if why is None:
            return
        allow = allow_weights_mismatch_env() if allow_weights_mismatch is None else allow_weights_mismatch
        if "different weights" in why and allow:
            print(f"oscar: WARNING: {why}; accepted (--allow-weights-mismatch)", file=sys.stderr)
            return
        hint = ("; pass --allow-weights-mismatch (oscar --allow-weights-mismatch COMMAND ...) for a deliberate "
                "transfer" if "different weights" in why else "")
        raise OscarError(f"{why}{hint}")


def check_pairing(art: Artifact, config: Any, artifact: str, model: str) -> None:
    """`Artifact.check_model` as a command's first refusal: one line naming both sides (the artifact file and the
    model it was fitted for; the model the command was given), from the model's config alone, before any method
    is judged, any weight is loaded or any output is made."""
    try:
        art.check_model(config)
    except OscarError as e:
        made = (art.meta.get("model") or {}).get("name")
        raise OscarError(f"--artifact {artifact}{f' (fitted for {made})' if made else ''} cannot serve model "
                         f"{model}: {e}") from None


LAYER_QUANT_FIELDS = ("key_split", "key_top", "key_drop", "param_dtype", "key_param_dtype")


def layout_differences(base: QuantConfig, q: QuantConfig) -> list[str]:
    """The fields outside LAYER_QUANT_FIELDS where a layer's format `q` differs from the model's `base` ("field q vs
    base"): what every layer must share (sink, window, pages, grid kind)."""
    return [f"{f} {getattr(q, f)!r} vs {getattr(base, f)!r}" for f in asdict(base)
            if f not in LAYER_QUANT_FIELDS and getattr(q, f) != getattr(base, f)]


def check_layer_quant(base: QuantConfig, layers: list[QuantConfig], num_layers: int, head_dim: int) -> None:
    """Refuse per-layer formats that do not share the model's layout (sink, window, page, grid kind): only the
    key format and the scale/zero dtypes (LAYER_QUANT_FIELDS) may differ between layers."""
    if len(layers) != num_layers:
        raise OscarError(f"artifact: layer_quant has {len(layers)} entries for {num_layers} layers")
    for l, q in enumerate(layers):
        if not isinstance(q, QuantConfig):
            raise OscarError(f"artifact: layer_quant[{l}] is a {type(q).__name__}, not a QuantConfig")
        bad = layout_differences(base, q)
        if bad:
            raise OscarError(f"artifact: layer {l}'s format differs from the model's in {', '.join(bad)}; layers may "
                             f"differ only in {', '.join(LAYER_QUANT_FIELDS)}")
        probs = [p for p in quant_problems(head_dim, q) if "key_split" in p or "key_drop" in p]
        if probs:
            raise OscarError(f"artifact: layer {l}'s format: {'; '.join(probs)}")


def save_artifact(art: Artifact, path: str) -> None:
    art.validate()
    tensors: dict[str, torch.Tensor] = {}
    for l in range(art.num_layers):
        tensors[f"layers.{l}.rot_k"] = art.rot_k[l].float().contiguous()
        tensors[f"layers.{l}.rot_v"] = art.rot_v[l].float().contiguous()
        tensors[f"layers.{l}.clip_k"] = art.clip_k[l].float().contiguous()
        tensors[f"layers.{l}.clip_v"] = art.clip_v[l].float().contiguous()
        if art.k_mean is not None:
            tensors[f"layers.{l}.k_mean"] = art.k_mean[l].float().contiguous()
        if art.rot_q is not None:
            tensors[f"layers.{l}.rot_q"] = art.rot_q[l].float().contiguous()
    for k, t in art.extra.items():
        tensors[k] = t.contiguous()
    fmt = ARTIFACT_FORMAT_L if art.layer_quant is not None else ARTIFACT_FORMAT_Q if art.rot_q is not None else ARTIFACT_FORMAT
    extra = {"layer_quant": [asdict(q) for q in art.layer_quant]} if art.layer_quant is not None else {}
    _write(path, tensors, dict(art.meta, format=fmt, quant=asdict(art.quant), centering=art.k_mean is not None,
                               **extra))


def _write(path: str, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """An artifact file of either kind: its tensors, and its metadata with their checksums."""
    meta = dict(meta, checksums={"algorithm": "crc32",
                                 "tensors": {k: tensor_checksum(t) for k, t in sorted(tensors.items())}})
    _check_writable(path)
    save_file(tensors, path, metadata={"oscar": json.dumps(meta, sort_keys=True, default=str)})


def tensor_checksum(t: torch.Tensor) -> int:
    """CRC-32 of a tensor's bytes as safetensors stores them (C order, little endian)."""
    return zlib.crc32(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())


def check_checksums(path: str, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Refuse an artifact whose tensor data differs from the checksums in its metadata (naming the tensors)."""
    rec = (meta.get("checksums") or {}).get("tensors")
    if rec is None:
        _warn_once(path, f"oscar: WARNING: {path} has no tensor checksums (written by an older version); "
                         "its tensor data cannot be verified")
        return
    missing = sorted(set(rec) - set(tensors))
    bad = [k for k in sorted(rec) if k in tensors and tensor_checksum(tensors[k]) != int(rec[k])]
    if missing or bad:
        raise OscarError(f"{path}: artifact tensor data is damaged: "
                         + "; ".join(([f"tensor(s) {bad[:8]}{'...' if len(bad) > 8 else ''} fail their checksum "
                                       f"(bytes altered)"] if bad else [])
                                     + ([f"tensor(s) {missing[:8]} missing"] if missing else []))
                         + "; re-fit (or copy) the artifact")


_WARNED: set[str] = set()


def _warn_once(key: str, msg: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        print(msg, file=sys.stderr)


def _check_writable(path: str) -> None:
    """An output path the artifact can be written to (checked before work by the CLIs, again here)."""
    d = os.path.dirname(os.path.abspath(path)) or "."
    if os.path.isdir(path):
        raise OscarError(f"--out {path} is a directory; give a .safetensors file path")
    if not os.path.isdir(d):
        raise OscarError(f"--out {path}: directory {d} does not exist")
    if not os.access(d, os.W_OK):
        raise OscarError(f"--out {path}: directory {d} is not writable")


def load_artifact(path: str, device: str | torch.device = "cpu") -> Artifact:
    meta = read_metadata(path)
    try:
        t = load_file(path, device="cpu")
    except Exception as e:  # safetensors raises its own error types on a truncated / corrupt file
        raise OscarError(f"{path}: artifact tensor data is unreadable ({e})") from e
    check_checksums(path, meta, t)
    t = {k: v.to(device) for k, v in t.items()} if str(device) != "cpu" else t
    L = int(meta["model"]["num_layers"]) if "model" in meta else 1 + max(int(k.split(".")[1]) for k in t if k.startswith("layers."))
    known = {f"layers.{l}.{n}" for l in range(L) for n in ("rot_k", "rot_v", "rot_q", "clip_k", "clip_v", "k_mean")}
    try:
        art = Artifact(
            rot_k=[t[f"layers.{l}.rot_k"] for l in range(L)],
            rot_v=[t[f"layers.{l}.rot_v"] for l in range(L)],
            clip_k=[t[f"layers.{l}.clip_k"] for l in range(L)],
            clip_v=[t[f"layers.{l}.clip_v"] for l in range(L)],
            k_mean=[t[f"layers.{l}.k_mean"] for l in range(L)] if meta.get("centering") else None,
            rot_q=[t[f"layers.{l}.rot_q"] for l in range(L)] if "layers.0.rot_q" in t and meta["format"] != ARTIFACT_FORMAT else None,
            quant=_quant(meta["quant"]),
            layer_quant=[_quant(q) for q in meta["layer_quant"]] if meta.get("layer_quant") is not None else None,
            meta={k: v for k, v in meta.items() if k not in ("quant", "centering", "checksums", "layer_quant")},
            extra={k: v for k, v in t.items() if k not in known},
        )
    except KeyError as e:
        raise OscarError(f"{path}: artifact is missing tensor {e.args[0]}") from e
    art.validate()
    return art


def describe_layer_quant(layers: list[dict]) -> str:
    """One line for `oscar inspect`: which layers store wider keys, grouped by key bits (and their params' dtype)."""
    groups: dict[str, list[int]] = {}
    for l, q in enumerate(layers):
        if q.get("key_split"):
            what = f"{q['bits'] + q.get('key_top', 1)}-bit keys on {q['key_split']} channels" + (
                f", {q['key_param_dtype']} params" if q.get("key_param_dtype") else "")
            groups.setdefault(what, []).append(l)
    wide = "; ".join(f"layers {', '.join(map(str, ls))}: {what}" for what, ls in groups.items())
    return f"{len(layers)} layers; {wide or 'no layer with wider keys'}; values and the rest " \
           f"{layers[0]['bits']}-bit, {layers[0]['param_dtype']} params" if layers else "none"


def _quant(d: dict) -> QuantConfig:
    return QuantConfig(**{k: v for k, v in d.items() if k not in _RETIRED_QUANT_FIELDS})


def identity_artifact(config: Any, quant: QuantConfig | None = None, clip: float = 1.0, variant: str = "identity") -> Artifact:
    """Identity rotations, no clipping: the baseline 'naive' INT2 path and a test fixture."""
    s = attention_shapes(config)
    L, H, D = s["num_layers"], s["num_kv_heads"], s["head_dim"]
    eye = torch.eye(D).expand(H, D, D).clone()
    return Artifact(
        rot_k=[eye.clone() for _ in range(L)],
        rot_v=[eye.clone() for _ in range(L)],
        clip_k=[torch.full((H,), clip) for _ in range(L)],
        clip_v=[torch.full((H,), clip) for _ in range(L)],
        quant=quant or QuantConfig(),
        meta={"variant": variant, "model": dict(s, fingerprint=config_fingerprint(config))},
    )


def describe(path: str) -> str:
    """Human-readable summary of an artifact (`oscar inspect ARTIFACT`): metadata and tensors."""
    if artifact_format(path) == ARTIFACT_FORMAT_LATENT:
        return describe_latent(path)
    meta = read_metadata(path)
    with safetensors.safe_open(path, "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        check_checksums(path, meta, {k: f.get_tensor(k) for k in f.keys()})  # refuse damaged tensor data
    m = meta.get("model", {})
    q = meta.get("quant", {})
    prov = meta.get("provenance", {})
    lines = [
        f"{path}: {meta['format']}, variant {meta.get('variant', '?')}",
        f"  model: {m.get('name', '?')} fingerprint {m.get('fingerprint', '?')}: {m.get('num_layers')} layers, "
        f"{m.get('num_q_heads')} q heads, {m.get('num_kv_heads')} KV heads, head_dim {m.get('head_dim')}",
        f"  quant: {q.get('bits')} bits, mode {q.get('mode')}, group {q.get('group_size') or 'head_dim'}, "
        f"keys per {q.get('key_axis')}, sink {q.get('sink')}, recent {q.get('recent')}, "
        f"key-mean centering {'on' if meta.get('centering') else 'off'}",
        *([f"  per-layer formats: {describe_layer_quant(meta['layer_quant'])}"] if meta.get("layer_quant") else []),
        f"  checksums: {len(meta['checksums']['tensors'])} tensors verified" if meta.get("checksums")
        else "  checksums: none (older artifact: not verified)",
    ]
    if prov:
        lines.append(f"  provenance: store {prov.get('store_fingerprint')} ({prov.get('store')}), "
                     f"{len(prov.get('blocks', []))}/{prov.get('num_blocks')} blocks"
                     f"{' PARTIAL' if prov.get('partial') else ''}, {prov.get('tokens')} tokens"
                     + (f" in sequences of {prov['seq_len']}" if prov.get("seq_len") else "")
                     + (f" read at positions up to {prov['positions']}" if (prov.get("positions") or 0) > (prov.get("seq_len") or 0) else "")
                     + (f" (serve contexts up to {_covered(prov)})" if _covered(prov) else ""))
    d = meta.get("d_eff")
    if d:
        for side in ("k", "v"):
            flat = [x for layer in d.get(side, []) for x in layer]
            if flat:
                lines.append(f"  d_eff {side}: min {min(flat)} median {sorted(flat)[len(flat) // 2]} max {max(flat)}")
    layers = meta.get("layers") or []
    if layers:
        def flat(xs):  # split keys record a (wide, narrow) pair per head
            return [y for x in xs for y in (flat(x) if isinstance(x, list) else [x])]

        ck = flat([lm.get("clip_k", []) for lm in layers])
        cv = flat([lm.get("clip_v", []) for lm in layers])
        if ck and cv:
            lines.append(f"  clip k: {min(ck):.4g}..{max(ck):.4g}  clip v: {min(cv):.4g}..{max(cv):.4g}")
        heavy = sum(any(h) for lm in layers for h in lm.get("heavy", {}).values())
        lines.append(f"  layers with heavy-tailed heads: {heavy}/{len(layers)}")
    fb = meta.get("fallbacks") or []
    lines.append(f"  fallbacks: {len(fb)}")
    for r in fb[:10]:
        lines.append(f"    layer {r['layer']} head {r['head']} {r['side']}: -> {r['to']} ({r['reason']})")
    if len(fb) > 10:
        lines.append(f"    ... {len(fb) - 10} more")
    names = sorted({k.split(".", 2)[-1] if k.startswith("layers.") else k for k in shapes})
    lines.append(f"  tensors: {len(shapes)} ({', '.join(names)}); layers.0: "
                 + ", ".join(f"{k.split('.', 2)[-1]} {v}" for k, v in shapes.items() if k.startswith("layers.0.")))
    return "\n".join(lines)


# --------------------------------------------------------------------------- the latent (MLA) artifact

@dataclass
class LatentQuant:
    """How an MLA model's INT2 latent cache stores c_kv: per token, groups of `group` values with a `param_dtype`
    scale and zero (minmax, each group's range scaled by its clip); k_pe, the sinks and the recent window 16-bit."""

    bits: int = 2
    group: int = LATENT_GROUP
    param_dtype: str = "float32"
    sink: int = SINK
    recent: int = RECENT
    page_size: int = PAGE_SIZE

    def spec(self) -> QuantSpec:
        """The quantizer of one latent group (oscar.quant; axis token, group = `group`)."""
        return QuantSpec(bits=self.bits, axis="token", group_size=self.group, mode="minmax",
                         param_dtype=getattr(torch, self.param_dtype))


@dataclass
class LatentArtifact:
    """Per layer: rot (r, r) orthogonal, c_rot = (c - mean) @ rot; mean (r,) (zeros when the variant does not
    centre); clip (r / group,) minmax ratios per group of the rotated latent. Format oscar-latent-artifact/1."""

    rot: list[torch.Tensor]
    mean: list[torch.Tensor]
    clip: list[torch.Tensor]
    quant: LatentQuant = field(default_factory=LatentQuant)
    meta: dict[str, Any] = field(default_factory=dict)  # model (name, fingerprint, latent shapes), variant, layers

    @property
    def num_layers(self) -> int:
        return len(self.rot)

    def validate(self) -> None:
        r = int(self.rot[0].shape[-1])
        if r % self.quant.group:
            raise OscarError(f"latent artifact: kv_lora_rank {r} is not a whole number of {self.quant.group}-value groups")
        for l in range(self.num_layers):
            shapes = (tuple(self.rot[l].shape), tuple(self.mean[l].shape), tuple(self.clip[l].shape))
            if shapes != ((r, r), (r,), (r // self.quant.group,)):
                raise OscarError(f"latent artifact: layer {l} has rot/mean/clip {shapes}, expected "
                                 f"{((r, r), (r,), (r // self.quant.group,))}")

    def check_model(self, config: Any) -> None:
        """Refuse a model of other latent shapes or another config (one line naming both sides)."""
        have = self.meta.get("model", {})
        want = latent_shapes(config)
        diffs = [f"{k}: artifact {have.get('latent', {}).get(k)} vs model {v}" for k, v in want.items()
                 if k in ("num_layers", "num_heads", "kv_lora_rank", "rope_dim") and have.get("latent", {}).get(k) != v]
        if not diffs and have.get("config_fingerprint") not in (None, config_fingerprint(config)):
            diffs.append(f"config fingerprint: artifact {have.get('config_fingerprint')} vs model "
                         f"{config_fingerprint(config)}")
        if diffs:
            raise OscarError(f"latent artifact does not match the model ({'; '.join(diffs)})")


def save_latent_artifact(art: LatentArtifact, path: str) -> None:
    art.validate()
    tensors: dict[str, torch.Tensor] = {}
    for l in range(art.num_layers):
        tensors[f"layers.{l}.rot"] = art.rot[l].float().contiguous()
        tensors[f"layers.{l}.mean"] = art.mean[l].float().contiguous()
        tensors[f"layers.{l}.clip"] = art.clip[l].float().contiguous()
    _write(path, tensors, dict(art.meta, format=ARTIFACT_FORMAT_LATENT, quant=asdict(art.quant)))


def load_latent_artifact(path: str) -> LatentArtifact:
    meta = read_latent_metadata(path)
    try:
        t = load_file(path, device="cpu")
    except Exception as e:  # safetensors raises its own error types on a truncated / corrupt file
        raise OscarError(f"{path}: artifact tensor data is unreadable ({e})") from e
    check_checksums(path, meta, t)
    L = int(meta["model"]["num_layers"])
    try:
        art = LatentArtifact(rot=[t[f"layers.{l}.rot"] for l in range(L)], mean=[t[f"layers.{l}.mean"] for l in range(L)],
                             clip=[t[f"layers.{l}.clip"] for l in range(L)], quant=LatentQuant(**meta["quant"]),
                             meta={k: v for k, v in meta.items() if k not in ("quant", "checksums")})
    except KeyError as e:
        raise OscarError(f"{path}: latent artifact is missing tensor {e.args[0]}") from e
    art.validate()
    return art


def describe_latent(path: str) -> str:
    """`oscar inspect` of a latent artifact: model, format, variant, provenance, per-layer clips and diagnostics."""
    art = load_latent_artifact(path)
    m, q, prov = art.meta.get("model", {}), art.quant, art.meta.get("provenance", {})
    lat = m.get("latent") or {}
    lines = [f"{path}: {ARTIFACT_FORMAT_LATENT}, variant {art.meta.get('variant')}",
             f"  model: {m.get('name')} fingerprint {m.get('fingerprint')}: {art.num_layers} layers, latent "
             f"{lat.get('kv_lora_rank')} + RoPE key {lat.get('rope_dim')}, {lat.get('num_heads')} heads",
             f"  quant: c_kv at {q.bits} bits in groups of {q.group} ({q.param_dtype} scale + zero), RoPE key, sink "
             f"{q.sink} and recent {q.recent} in 16 bits; mean subtracted {'yes' if art.meta.get('centering') else 'no'}",
             f"  provenance: store {prov.get('store_fingerprint')} ({prov.get('store')}), {len(prov.get('blocks', []))} "
             f"blocks{' PARTIAL' if prov.get('partial') else ''}, sequences of {prov.get('seq_len')}",
             "  layer  d_eff  stability  clips per group"]
    for l, d in enumerate(art.meta.get("layers", [])):
        st = d.get("stability")
        lines.append(f"  {l:>5}  {d.get('d_eff', '-')!s:>5}  {'-' if st is None or st != st else f'{st:.3f}':>9}  "
                     + " ".join(f"{c:.3f}" for c in d.get("clip", [])))
    return "\n".join(lines)


def artifact_format(path: str) -> str | None:
    """The format an artifact file records (None: no oscar metadata); the header only."""
    try:
        with safetensors.safe_open(path, "pt") as f:
            raw = (f.metadata() or {}).get("oscar")
    except Exception:  # safetensors raises its own error types; read_metadata names the problem
        return None
    return json.loads(raw).get("format") if raw else None
