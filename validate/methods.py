"""KV-cache methods compared by validation: each is an artifact (rotations, clips, quant config) or none.

    bf16           the unquantized cache (DynamicCache, model dtype: fp32 on CPU)
    naive-int2     identity rotation, per-token min/max groups of head_dim (fp16 scale+zero)
    kivi2          the published KIVI recipe (Liu et al. 2024): keys per channel over groups of 64 tokens,
                   values per token, min/max fp16 scale+zero, the protocol's recent window exact (KIVI's
                   full-precision residual); data-free: no clip search, and key-mean centering is a no-op
                   for per-channel groups (their zero point absorbs any per-channel shift)
    hadamard-int2  normalised Sylvester Hadamard rotation, per-token groups (data-free: no clips, no centering)
    kivi2-clip     kivi2's format with clips searched from the same store by oscar-int2's search
    hadamard-clip-int2  hadamard-int2 with key-mean centering and searched clips (same store, same search)
    oscar-int2     the fitted artifact (whatever its QuantConfig says)
    oscar-ref-int2 a re-implementation, from its public description and code, of the published OSCAR
                   recipe (`oscar fit --variant oscar-ref`) on the same store: per-layer rotation,
                   row-quantile clips K 0.96 / V 0.92, float32 scale+zero, pages of 8
    tq-int2        TurboQuant (re-implemented from the paper): random-sign Walsh–Hadamard, per-vector fp16
                   norm, Beta Lloyd–Max codes; the paper's 2.5-bit split (D/4 outlier channels at 3 bits, the
                   rest at 2), keys centred; 2.75 bits/element at head_dim 64 (validate/codebooks.py)
    sq-int2        SpectralQuant with uniform allocation (re-implemented): calibrated eigenbasis, per-dim
                   Gaussian Lloyd–Max codes scaled by the calibrated std, K and V centred, no per-token
                   metadata: 2.0 bits/element (validate/codebooks.py)
    oscar-kc-int2  oscar-int2's recipe refitted on the same store with keys grouped per channel of the
                   rotated space over head_dim tokens (KIVI style; `oscar fit --key-axis channel --group-size D`)

Other helpers add methods with `register_method(name, factory)`.

Execution. `LayerQuant` fake-quantizes one layer's K/V exactly as the INT2
cache stores them: rotate (keys centred by the artifact's key mean first),
quantize/dequantize with `oscar.quant` under the artifact's QuantSpec
and clips, rotate back. Since the rotations are orthogonal, attention over
the un-rotated dequantized K/V equals the kernel's attention in the rotated
space (q R_K)·(k̂ R_K) up to float rounding. `SimQuantCache` is a
transformers Cache built on it (sink and recent window kept exact), used for
the strict NIAH protocol; `oscar.validate.ppl` uses `LayerQuant` under a
position mask that reproduces token-by-token decoding with the same cache.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from oscar.common import OscarError, attention_shapes
from oscar.defaults import RECENT, SINK
from oscar.quant import QuantSpec, fake_quant
from oscar.stats.artifact import Artifact, QuantConfig, identity_artifact
from oscar.stats.hadamard import hadamard_tensor


@dataclass(frozen=True)
class Protocol:
    """Which tokens the cache keeps exact: the first `sink` and the last `recent` (see docs/validation.md).

    pages: per-token K/V leave the exact window in whole pages of the artifact's `page_size`, as the
    paged cache stores them (< 1 page stays exact beyond `recent`); False: one token at a time, a
    stricter reading than any cache runs (`strict-token`, a diagnostic). Per-channel key groups are
    always released whole (an incomplete group cannot be quantized).
    """

    name: str
    sink: int = SINK
    recent: int = 0
    pages: bool = True


# Bumped whenever a protocol's meaning changes, so stored results of the old meaning are not resumed
# into new tables (NIAH/perplexity identities, `oscar run` stage fingerprints). 2: per-token K/V leave
# the exact window in whole pages (was: one token at a time).
PROTOCOL_VERSION = 2
STRICT = Protocol("strict", sink=SINK, recent=0)
SERVING = Protocol("serving", sink=SINK, recent=RECENT)
STRICT_TOKEN = Protocol("strict-token", sink=SINK, recent=0, pages=False)
PROTOCOLS = {p.name: p for p in (STRICT, SERVING, STRICT_TOKEN)}


def _acc(x: torch.Tensor) -> torch.dtype:
    """The simulator's arithmetic for activations x: float32, or float64 when the model computes in float64."""
    return torch.promote_types(x.dtype, torch.float32)


def hadamard(n: int) -> torch.Tensor:
    """Normalised Sylvester Hadamard matrix (n a power of two: the hadamard-int2 baseline), float32;
    oscar.stats.hadamard's construction, orthogonal and symmetric."""
    return hadamard_tensor(n, torch.float32, sylvester_for="Hadamard rotation")


# ----------------------------------------------------------------- registry

# factory(model_config, fitted_artifact_or_None) -> Artifact (or None for the exact cache)
MethodFactory = Callable[[Any, "Artifact | None"], "Artifact | None"]
METHODS: dict[str, MethodFactory] = {}
NEEDS_ARTIFACT: set[str] = set()


def register_method(name: str, factory: MethodFactory, needs_artifact: bool = False) -> None:
    METHODS[name] = factory
    if needs_artifact:
        NEEDS_ARTIFACT.add(name)


def _bf16(config, art):
    return None


def _naive(config, art):
    return identity_artifact(config, QuantConfig(bits=2), clip=1.0, variant="naive-int2")


def _kivi(config, art):
    a = identity_artifact(config, QuantConfig(bits=2, key_axis="channel", group_size=64), clip=1.0, variant="kivi2")
    return a


def _hadamard(config, art):
    a = identity_artifact(config, QuantConfig(bits=2), clip=1.0, variant="hadamard-int2")
    try:
        H = hadamard(a.head_dim)
    except OscarError as e:
        raise MethodUnsupported(str(e)) from None
    a.rot_k = [H.expand_as(r).clone() for r in a.rot_k]
    a.rot_v = [H.expand_as(r).clone() for r in a.rot_v]
    return a


def _oscar(config, art):
    if art is None:
        raise OscarError("method oscar-int2 needs --artifact (the output of `oscar fit`)")
    art.check_model(config)
    return art


_REFITS: dict = {}  # (method, store path, store fingerprint, recipe) -> the artifact refitted from that store


def _refit(art: Artifact, method: str, how: str, cfg_kw: dict) -> Artifact:
    """Fit `cfg_kw`'s recipe from the calibration store `art` was fitted from (its provenance), so
    that both methods see the same calibration data; cached per store."""
    import os

    prov = art.meta.get("provenance") or {}
    store = prov.get("store")
    if not store or not os.path.isdir(store):
        raise OscarError(f"method {method} refits {how} from the calibration store of --artifact, but "
                         f"{'it records none' if not store else f'{store!r} does not exist'}; keep the store, "
                         f"or pass an artifact fitted that way as --artifact")
    key = (method, os.path.abspath(store), prov.get("store_fingerprint"), repr(sorted(cfg_kw.items())))
    if key not in _REFITS:
        from oscar.stats.fit import FitConfig, fit

        _REFITS[key] = fit(store, FitConfig(partial=bool(prov.get("partial")), progress=False, **cfg_kw))
    return _REFITS[key]


def reference_artifact(art: Artifact) -> Artifact:
    """The published recipe's artifact for the same data as `art` (no model check): `art` itself
    when it is an `oscar fit --variant oscar-ref` artifact, else refitted (no clip search)."""
    if art.meta.get("variant") == "oscar-ref":
        return art
    return _refit(art, "oscar-ref-int2", "the published recipe", {"variant": "oscar-ref"})


def channel_keys_artifact(art: Artifact) -> Artifact:
    """`art`'s recipe (same variant, rotations from the same store) with KIVI-style keys: per channel
    of the rotated space over groups of head_dim tokens (64 on SmolLM2), clips searched for that
    grouping; values stay per token. Same bits per element as per-token groups of head_dim."""
    if art.quant.key_axis == "channel":
        return art
    variant, q = art.meta.get("variant", "oscar"), art.quant
    if q.key_split:  # split keys are per-token groups: the channel-key analogue is `scaled` in the default format
        variant, q = "scaled", replace(q, key_split=0, key_top=1, key_drop=0, param_dtype="float16")
    elif art.layer_quant is not None:  # per-layer widths: their base grid's e4m3 pays for the wide layers; the
        q = replace(q, param_dtype="float16")  # channel-key baseline keeps the default format's 2.5 bits
    quant = replace(q, key_axis="channel", group_size=art.head_dim)
    return _refit(art, "oscar-kc-int2", "per-channel keys", {"variant": variant, "quant": quant})


def _needs(name: str, art):
    if art is None:
        raise OscarError(f"method {name} needs --artifact (an `oscar fit` artifact whose calibration store still exists)")


def _oscar_ref(config, art):
    _needs("oscar-ref-int2", art)
    ref = reference_artifact(art)
    ref.check_model(config)
    return ref


def _oscar_kc(config, art):
    _needs("oscar-kc-int2", art)
    kc = channel_keys_artifact(art)
    kc.check_model(config)
    return kc


def searched_baseline(name: str, art: Artifact) -> Artifact:
    """A data-free baseline given the knobs its format allows, from `art`'s store and oscar-int2's clip
    search (same rows, grid and objective), same page size, sink and recent window:
    kivi2-clip = kivi2's format (identity rotation, keys per channel over 64 tokens) with searched clips;
    hadamard-clip-int2 = hadamard-int2's format with key-mean centering and searched clips."""
    q = replace(art.quant, key_split=0, key_top=1, key_drop=0, param_dtype="float16")  # the baselines' own format: one group, fp16 params
    if name == "kivi2-clip":
        g = 64 if art.head_dim % 64 == 0 else art.head_dim  # kivi2's 64-token groups (values: per token, same G)
        quant = replace(q, key_axis="channel", group_size=g, clip_rule="ratio", param_dtype="float16", mode="minmax")
        return _refit(art, name, "KIVI with searched clips", {"variant": "identity", "quant": quant})
    quant = replace(q, key_axis="token", group_size=None, clip_rule="ratio", param_dtype="float16", mode="minmax")
    return _refit(art, name, "Hadamard with centering and searched clips", {"variant": "hadamard-centered", "quant": quant})


def _searched(name: str):
    def factory(config, art):
        _needs(name, art)
        a = searched_baseline(name, art)
        a.check_model(config)
        return a
    return factory


_CODEBOOK_ARTS: dict = {}  # (method, store path, store fingerprint) -> tq-int2 / sq-int2 artifact of that store


def codebook_artifact(name: str, art: Artifact) -> Artifact:
    """tq-int2 / sq-int2 built from the calibration store `art` was fitted from (validate/codebooks.py); cached
    per store."""
    import os

    from oscar.validate import codebooks

    prov = art.meta.get("provenance") or {}
    key = (name, os.path.abspath(prov.get("store") or ""), prov.get("store_fingerprint"))
    if key not in _CODEBOOK_ARTS:
        build = getattr(codebooks, {"tq-int2": "tq_artifact", "sq-int2": "sq_artifact"}[name])
        _CODEBOOK_ARTS[key] = build(art)
    return _CODEBOOK_ARTS[key]


def _tq(config, art):
    _needs("tq-int2", art)
    a = codebook_artifact("tq-int2", art)
    a.check_model(config)
    return a


def _sq(config, art):
    _needs("sq-int2", art)
    a = codebook_artifact("sq-int2", art)
    a.check_model(config)
    return a


def fitted_for(name: str, fitted: Artifact) -> Artifact:
    """A NEEDS_ARTIFACT method's artifact from the fitted one, without a model check (callers check shapes)."""
    return {"oscar-ref-int2": reference_artifact, "oscar-kc-int2": channel_keys_artifact,
            "tq-int2": lambda a: codebook_artifact("tq-int2", a),
            "sq-int2": lambda a: codebook_artifact("sq-int2", a),
            "kivi2-clip": lambda a: searched_baseline("kivi2-clip", a),
            "hadamard-clip-int2": lambda a: searched_baseline("hadamard-clip-int2", a)}.get(name, lambda a: a)(fitted)


register_method("bf16", _bf16)
register_method("naive-int2", _naive)
register_method("kivi2", _kivi)
register_method("hadamard-int2", _hadamard)
register_method("oscar-int2", _oscar, needs_artifact=True)
register_method("oscar-ref-int2", _oscar_ref, needs_artifact=True)  # the published recipe (stats/reference_recipe.py)
register_method("oscar-kc-int2", _oscar_kc, needs_artifact=True)   # oscar-int2's rotations, KIVI-style key groups
register_method("tq-int2", _tq, needs_artifact=True)  # TurboQuant, the paper's 2.5-bit 3/2-bit split (validate/codebooks.py)
register_method("sq-int2", _sq, needs_artifact=True)  # SpectralQuant, uniform allocation (validate/codebooks.py)
register_method("kivi2-clip", _searched("kivi2-clip"), needs_artifact=True)  # kivi2's format, searched clips
register_method("hadamard-clip-int2", _searched("hadamard-clip-int2"), needs_artifact=True)  # + centering, searched clips


def parse_methods(s: str | list[str]) -> list[str]:
    names = [m.strip() for m in (s.split(",") if isinstance(s, str) else s) if m.strip()]
    bad = [m for m in names if m not in METHODS]
    if bad:
        raise OscarError(f"unknown method(s) {', '.join(bad)}; known: {', '.join(METHODS)}")
    if not names:
        raise OscarError("no methods given")
    return names


def method_artifact(name: str, config, fitted: Artifact | None) -> Artifact | None:
    return METHODS[name](config, fitted)


class MethodUnsupported(OscarError):
    """A method whose cache format cannot serve this model (validation skips it, with this reason)."""


def method_problems(name: str, config, art: Artifact | None) -> list[str]:
    """Why method `name`'s artifact (its QuantConfig, its rotation) cannot serve `config`'s head_dim."""
    from oscar.constraints import quant_problems

    if art is None:
        return []
    D = attention_shapes(config)["head_dim"]
    return list(dict.fromkeys(p for l in range(art.num_layers) for p in quant_problems(D, art.quant_for(l))))


def uncalibrated_warning(art: Artifact | None, length: int) -> str | None:
    """A warning when contexts of `length` tokens reach past the positions the artifact was calibrated on."""
    from oscar.stats.artifact import beyond_calibration

    why = beyond_calibration(art, length)
    return f"contexts of {length} tokens reach {why}" if why else None


def resolve_methods(methods: list[str], config, fitted: Artifact | None, *, checked: bool = True,
                    out: str | None = None) -> tuple[dict[str, Artifact | None], dict[str, str]]:
    """({method: artifact} of the methods that can serve `config`, {method: reason} of those skipped).

    A method is skipped (not crashed on) when its format cannot store this head_dim: packing
    (head_dim * bits whole bytes), group size, pages, a Hadamard of that order. checked=False builds
    NEEDS_ARTIFACT methods without a model check (`fitted_for`, as the attention test does).
    Skips are printed and, with `out`, recorded in out/skipped_methods.json (the report lists them).
    """
    import sys

    from oscar.stats.hadamard import HadamardUnsupported

    D = attention_shapes(config)["head_dim"]
    arts, skipped = {}, {}
    for m in methods:
        if fitted is None or m not in NEEDS_ARTIFACT:
            pre = []
        else:  # judge the fitted artifact's format before any refit from its store
            pre = method_problems(m, config, fitted)
        try:
            art = None if pre else (method_artifact(m, config, fitted) if checked or m not in NEEDS_ARTIFACT
                                    else fitted_for(m, fitted))
        except (MethodUnsupported, HadamardUnsupported) as e:  # e.g. a refit whose variant needs a Hadamard of order D
            pre = [str(e)]
        probs = pre or method_problems(m, config, art)
        if probs:
            skipped[m] = f"cannot serve head_dim {D}: " + "; ".join(probs)
            print(f"oscar validate: skipping method {m}: {skipped[m]}", file=sys.stderr)
        else:
            arts[m] = art
    if out and skipped:
        import json
        import os

        os.makedirs(out, exist_ok=True)
        path = os.path.join(out, "skipped_methods.json")
        old = json.load(open(path)) if os.path.exists(path) else {}
        with open(path, "w") as f:
            json.dump({**old, **skipped}, f, indent=1, sort_keys=True)
    return arts, skipped


def bits_per_element(art: Artifact | None, head_dim: int) -> float:
    """Stored bits per K/V element of the quantized history (metadata included); 16 for the exact cache."""
    if art is None:
        return 16.0
    from oscar.validate.codebooks import codec_bits_per_element

    cb = codec_bits_per_element(art)
    if cb is not None:
        return cb
    if art.layer_quant is not None:  # per-layer widths: layer by layer, by the cache's memory accounting
        from oscar.kernels.memory import artifact_bits_per_element

        return artifact_bits_per_element(art)
    return art.quant.bits_per_element(head_dim)


# What each method is, and which knobs of the INT2 comparison it lacks and why (written into memory.json,
# listed by the report; docs/decisions/0049-second-model-on-request-the-kivi2-bfloat16.md "Second model on request").
METHOD_NOTES: dict[str, str] = {
    "bf16": "the unquantized cache",
    "naive-int2": "identity rotation, per-token min/max groups; data-free: no clip search, no centering",
    "kivi2": "the published KIVI recipe: keys per channel (64-token groups), values per token, the recent window "
             "exact as its full-precision residual; data-free: no clip search (KIVI has none), key-mean centering "
             "a no-op for per-channel groups",
    "hadamard-int2": "Hadamard rotation, per-token groups; data-free: no clip search, no centering",
    "kivi2-clip": "kivi2's format given the knobs it allows: clips searched on the same store with oscar-int2's "
                  "search (centering is a no-op for per-channel keys)",
    "hadamard-clip-int2": "hadamard-int2's format given the knobs it allows: key-mean centering and clips searched "
                          "on the same store with oscar-int2's search",
    "oscar-ref-int2": "a re-implementation of the published OSCAR recipe from its public description and code: "
                      "fixed row-quantile clips (no search), float32 scale+zero, pages of 8",
    "oscar-kc-int2": "oscar-int2's rotations with keys per channel (64-token groups), clips searched (for a split-key "
                     "artifact: the scaled variant's rotations from the same store, fp16 params)",
    "oscar-int2": "OSCAR rotation, key-mean centering, scaled keys, searched and tuned clips (the artifact's format: "
                  "`oscar run` fits --variant split, keys in a 3-bit and a 2-bit part placed by C_Q, 8-bit scale/zero)",
    "tq-int2": "TurboQuant re-implemented from its paper: random-sign Walsh-Hadamard, fp16 norms, Beta Lloyd-Max codes, "
               "D/4 outlier channels at 3 bits; keys centred; no clip search (a Lloyd-Max codebook has none)",
    "sq-int2": "SpectralQuant (uniform allocation) re-implemented: calibrated eigenbasis, Gaussian Lloyd-Max codes "
               "scaled by the calibrated std, K and V centred, no per-token metadata; no clip search",
}


def memory_row(name: str, art: Artifact | None, config, context: int, protocol: Protocol) -> dict:
    """Bytes per token of K+V over all layers: history (quantized), and the average at `context` with exact sink/recent."""
    s = attention_shapes(config)
    elems = 2 * s["num_layers"] * s["num_kv_heads"] * s["head_dim"]  # K and V, per token
    bpe = bits_per_element(art, s["head_dim"])
    exact = min(context, protocol.sink + protocol.recent) if art is not None else context
    avg_bits = (exact * 16 + (context - exact) * bpe) / context
    return {
        "method": name, "bits_per_element": bpe, "bytes_per_token_history": elems * bpe / 8,
        "bytes_per_token_bf16": elems * 2, "context": context, "protocol": protocol.name,
        "sink": protocol.sink, "recent": protocol.recent, "bytes_per_token_avg": elems * avg_bits / 8,
        "ratio_vs_bf16": avg_bits / 16, "note": METHOD_NOTES.get(name, ""),
    }


# ----------------------------------------------------------------- fake-quant of one layer


def _clip_view(c: torch.Tensor, spec: QuantSpec, D: int) -> torch.Tensor:
    """Broadcast an artifact clip (Hkv,) or (Hkv, D) onto the grouped layout (B, Hkv, rows, groups)."""
    if c.dim() == 1:
        return c.view(-1, 1, 1)
    if spec.mode == "static" and spec.axis == "token":  # per-channel thresholds: the static spec groups one channel
        return c.view(c.shape[0], 1, D)
    raise OscarError(f"per-channel clip with {spec.mode}/{spec.axis} quantization is not supported by the simulator")


class LayerQuant:
    """Fake-quantization of one layer's K/V (B, Hkv, T, D) as the INT2 cache stores them."""

    def __init__(self, art: Artifact, layer: int, pages: bool = True):
        D = art.head_dim
        self.rot_k = art.rot_k[layer].float()  # (Hkv, D, D)
        self.rot_v = art.rot_v[layer].float()
        # rot_k^{-1} = rot_qᵀ (= rot_kᵀ when orthogonal): the dequantized keys go back to the model's space
        self.unrot_k = (art.rot_q[layer] if art.rot_q is not None else art.rot_k[layer]).float().transpose(-1, -2)
        self.k_mean = art.k_mean[layer].float()[None, :, None, :] if art.k_mean is not None else None  # (1, Hkv, 1, D)
        q = art.quant_for(layer)  # per-layer widths (Artifact.layer_quant): this layer's own format
        self.kspec, self.vspec = q.key_spec(D), q.value_spec(D)
        flush = q.page_size if pages else 1  # whole pages leave the exact window (Protocol.pages)
        self.key_group = self.kspec.group_size if self.kspec.axis == "channel" else flush  # tokens quantized together
        # codebook formats (tq-int2, sq-int2: validate/codebooks.py) replace the uniform grid, per token
        from oscar.validate.codebooks import layer_codecs

        cb = layer_codecs(art, layer)
        self.codec_k, self.codec_v, self.v_mean = cb if cb else (None, None, None)
        self.kparts = q.key_parts(D)  # split keys (QuantConfig.key_split): a per-token group per part
        if cb:  # the codec reads its own clips
            self.key_group = flush
            self.clip_k = self.clip_v = None
        elif self.kparts:
            self.clip_k = art.clip_k[layer].float().reshape(art.num_kv_heads, -1)  # (Hkv, parts): a ratio per head and part
            self.clip_v = _clip_view(art.clip_v[layer].float(), self.vspec, D)
        else:
            self.clip_k = _clip_view(art.clip_k[layer].float(), self.kspec, D)
            self.clip_v = _clip_view(art.clip_v[layer].float(), self.vspec, D)
        # Identity rotations (naive-int2, kivi2) skip their matmuls: x @ I == x exactly in float32.
        eye = torch.eye(D)
        self.k_eye = bool((self.rot_k == eye).all() and (self.unrot_k == eye).all())
        self.v_eye = bool((self.rot_v == eye).all())
        self.device = torch.device("cpu")

    def _on(self, dev: torch.device) -> None:
        """Every tensor this layer's fake-quantization reads on `dev` (once per device: a model on a GPU)."""
        if dev == self.device:
            return
        import dataclasses

        for name in ("rot_k", "rot_v", "unrot_k", "k_mean", "clip_k", "clip_v", "v_mean"):
            t = getattr(self, name)
            if isinstance(t, torch.Tensor):
                setattr(self, name, t.to(dev))
        for name in ("codec_k", "codec_v"):
            c = getattr(self, name)
            if c is not None:
                setattr(self, name, dataclasses.replace(c, **{f.name: getattr(c, f.name).to(dev) for f in dataclasses.fields(c)
                                                             if isinstance(getattr(c, f.name), torch.Tensor)}))
        self.device = dev

    def keys(self, k: torch.Tensor) -> torch.Tensor:
        """k (B, Hkv, T, D) -> dequantized k̂, same shape; T a multiple of key_group."""
        self._on(k.device)
        x = k.to(_acc(k))  # float32; float64 for a float64 model (the tune: no float32 rounding to flip a code)
        if self.k_mean is not None:
            x = x - self.k_mean.to(x.dtype)
        xr = x if self.k_eye else x @ self.rot_k.to(x.dtype)  # (B, Hkv, T, D)
        if self.codec_k:
            xq = self.codec_k(xr)
        elif self.kparts:
            from oscar.stats.split import split_fake_quant

            xq = split_fake_quant(xr, self.kparts, self.clip_k)
        else:
            xq = fake_quant(xr, self.kspec, self.clip_k)
        xq = xq.to(x.dtype)  # the codes are float32 arithmetic on float64-exact inputs: the same on every host
        if not self.k_eye:
            xq = xq @ self.unrot_k.to(x.dtype)
        if self.k_mean is not None:
            xq = xq + self.k_mean.to(x.dtype)
        return xq.to(k.dtype)

    def values(self, v: torch.Tensor) -> torch.Tensor:
        self._on(v.device)
        x = v.to(_acc(v))
        if self.v_mean is not None:
            x = x - self.v_mean.to(x.dtype)
        vr = x if self.v_eye else x @ self.rot_v.to(x.dtype)  # (B, Hkv, T, D)
        xq = (self.codec_v(vr) if self.codec_v else fake_quant(vr, self.vspec, self.clip_v)).to(x.dtype)
        if not self.v_eye:
            xq = xq @ self.rot_v.to(x.dtype).transpose(-1, -2)
        if self.v_mean is not None:
            xq = xq + self.v_mean.to(x.dtype)
        return xq.to(v.dtype)

    def quantized_until(self, T: int, sink: int, recent: int) -> int:
        """Tokens [sink, b) are stored quantized once T tokens are written (keys quantize in whole groups)."""
        b = T - recent
        if b <= sink:
            return sink
        g = self.key_group
        return sink + (b - sink) // g * g


# ----------------------------------------------------------------- the cache


class SimQuantLayer(DynamicLayer):
    """A cache layer holding K/V with [sink, T - recent) fake-quantized; a new chunk attends to itself exactly."""

    def __init__(self, lq: LayerQuant, protocol: Protocol):
        super().__init__()
        self.lq, self.sink, self.recent = lq, protocol.sink, protocol.recent
        self.n_quant = protocol.sink  # [sink, n_quant) already quantized

    def _commit(self) -> None:
        T = self.keys.shape[-2]
        b = self.lq.quantized_until(T, self.sink, self.recent)
        a = self.n_quant
        if b > a:  # new tensors, never in place: the caller still holds the returned ones
            k, v = self.keys, self.values
            self.keys = torch.cat([k[..., :a, :], self.lq.keys(k[..., a:b, :]), k[..., b:, :]], dim=-2)
            self.values = torch.cat([v[..., :a, :], self.lq.values(v[..., a:b, :]), v[..., b:, :]], dim=-2)
            self.n_quant = b

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        out = (self.keys, self.values)
        self._commit()
        return out

    def load(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Take over a prefilled exact cache: the same as that chunk passing through update()."""
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values
        self._commit()


class SimQuantCache(Cache):
    def __init__(self, art: Artifact, protocol: Protocol):
        super().__init__(layers=[SimQuantLayer(LayerQuant(art, l, protocol.pages), protocol) for l in range(art.num_layers)])

    @classmethod
    def from_prefill(cls, art: Artifact, protocol: Protocol, exact: DynamicCache) -> "SimQuantCache":
        c = cls(art, protocol)
        for layer, src in zip(c.layers, exact.layers):
            layer.load(src.keys, src.values)
        return c


class BatchQuantLayer(DynamicLayer):
    """One layer of several methods decoding the same prompt, one method per batch row.

    Row r holds exactly what `SimQuantLayer` holds for its method: [sink, n_quant[r]) fake-quantized,
    the rest exact. K/V live in preallocated buffers (R, Hkv, capacity, D) written in place, so a
    decode step costs one token, not a copy of the whole history. The flush owed by a step is
    applied at the start of the next update (the attention of that step has read the cache by
    then), which is what SimQuantLayer's commit-after-append returns to its next caller.
    """

    def __init__(self, lqs: list[LayerQuant | None], protocol: Protocol):
        super().__init__()
        self.lqs, self.sink, self.recent = lqs, protocol.sink, protocol.recent
        self.n = 0
        self.n_quant = [protocol.sink] * len(lqs)
        self.pre: list[tuple[int, torch.Tensor, torch.Tensor] | None] = [None] * len(lqs)  # (start, k̂, v̂) ahead of the flush

    def _alloc(self, like: torch.Tensor, capacity: int) -> None:
        R = len(self.lqs)
        _, H, _, D = like.shape
        self.kbuf = like.new_empty(R, H, capacity, D)  # (R, Hkv, cap, D)
        self.vbuf = like.new_empty(R, H, capacity, D)
        self.dtype, self.device, self.is_initialized = like.dtype, like.device, True

    def load(self, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> None:
        """Take over an exact prefill (1, Hkv, T, D) for every row, as that chunk passing through update().

        Each row quantizes all its complete groups now, in one call: the part the protocol already
        stores quantized is written, the rest (the recent window) is kept to be flushed later,
        token for token the values a later flush would compute (groups are independent).
        """
        T = keys.shape[-2]
        self._alloc(keys, max(capacity, T))
        self.kbuf[:, :, :T] = keys[0]
        self.vbuf[:, :, :T] = values[0]
        self.n = T
        for r, lq in enumerate(self.lqs):
            if lq is None:
                continue
            b_all = lq.quantized_until(T, self.sink, 0)
            b = lq.quantized_until(T, self.sink, self.recent)
            if b_all > self.sink:
                kq = lq.keys(keys[..., self.sink:b_all, :])[0]  # (Hkv, b_all - sink, D)
                vq = lq.values(values[..., self.sink:b_all, :])[0]
                self.kbuf[r, :, self.sink:b] = kq[:, :b - self.sink]
                self.vbuf[r, :, self.sink:b] = vq[:, :b - self.sink]
                if b_all > b:
                    self.pre[r] = (b, kq[:, b - self.sink:], vq[:, b - self.sink:])
            self.n_quant[r] = b
        self._view()

    def _view(self) -> None:
        self.keys, self.values = self.kbuf[:, :, :self.n], self.vbuf[:, :, :self.n]

    def _commit(self) -> None:
        for r, lq in enumerate(self.lqs):
            if lq is None:
                continue
            a, b = self.n_quant[r], lq.quantized_until(self.n, self.sink, self.recent)
            if b <= a:
                continue
            commit_row(lq, self.pre[r], self.kbuf, self.vbuf, r, a, b)
            self.n_quant[r] = b

    def update(self, key_states, value_states, *args, **kwargs):
        R, H, t, D = key_states.shape
        if not self.is_initialized:
            self._alloc(key_states[:1], t + 256)
        if R != len(self.lqs):
            raise OscarError(f"batch of {R} rows for a cache of {len(self.lqs)} methods")
        self._commit()
        if self.n + t > self.kbuf.shape[2]:  # grow (rare: capacity is sized by the caller)
            cap = max(2 * self.kbuf.shape[2], self.n + t)
            k, v = self.kbuf[:, :, :self.n], self.vbuf[:, :, :self.n]
            self._alloc(key_states[:1], cap)
            self.kbuf[:, :, :self.n], self.vbuf[:, :, :self.n] = k, v
        self.kbuf[:, :, self.n:self.n + t] = key_states
        self.vbuf[:, :, self.n:self.n + t] = value_states
        self.n += t
        self._view()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.n


def commit_row(lq: "LayerQuant", pre, kbuf: torch.Tensor, vbuf: torch.Tensor, r: int, a: int, b: int,
               dtype: torch.dtype | None = None) -> None:
    """Replace tokens [a, b) of row r of kbuf/vbuf (R, Hkv, S, D) by their INT2 reading: from `pre`
    (start, k̂, v̂) quantized ahead at load time where it covers them, else quantized now — from
    `dtype` (the model's) when the buffers hold wider values than the model wrote."""
    if pre is not None:
        s0, kq, vq = pre
        e = min(b, s0 + kq.shape[1])
        if e > a:
            kbuf[r, :, a:e] = kq[:, a - s0:e - s0]
            vbuf[r, :, a:e] = vq[:, a - s0:e - s0]
            a = e
    if b > a:  # tokens written after the load (strict protocol, or past the window)
        k, v = kbuf[r:r + 1, :, a:b], vbuf[r:r + 1, :, a:b]
        if dtype is not None:
            k, v = k.to(dtype), v.to(dtype)
        kbuf[r:r + 1, :, a:b] = lq.keys(k)
        vbuf[r:r + 1, :, a:b] = lq.values(v)


class MethodBatchCache(Cache):
    """Several methods' caches over one prompt, one method per batch row (None: the exact cache).

    Decoding the methods together reads the weights once per step for all of them; each row's
    attention reads only its own row, so row r computes what `make_cache(arts[r], ...)` does.
    """

    def __init__(self, arts: list[Artifact | None], protocol: Protocol, num_layers: int):
        self.arts = arts
        super().__init__(layers=[BatchQuantLayer([LayerQuant(a, l, protocol.pages) if a is not None else None for a in arts], protocol)
                                 for l in range(num_layers)])

    @classmethod
    def from_prefill(cls, arts: list[Artifact | None], protocol: Protocol, exact: DynamicCache,
                     capacity: int = 0) -> "MethodBatchCache":
        c = cls(arts, protocol, len(exact.layers))
        for layer, src in zip(c.layers, exact.layers):
            layer.load(src.keys, src.values, capacity)
        return c


def make_cache(art: Artifact | None, protocol: Protocol, prefill: DynamicCache | None = None) -> Cache:
    """The method's cache, optionally taking over an exact prefill of the first chunk."""
    if art is None:
        if prefill is None:
            return DynamicCache()
        c = DynamicCache()
        for l, src in enumerate(prefill.layers):
            c.update(src.keys, src.values, l)
        return c
    if prefill is None:
        return SimQuantCache(art, protocol)
    return SimQuantCache.from_prefill(art, protocol, prefill)
