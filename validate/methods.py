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

Execution. A method is an artifact; the caches that run it are the kernels' cache family
(`oscar.kernels.backends.make_cache`): the fake-quant simulator (`kernels/simulate.py`: `LayerQuant`,
`SimQuantCache`, `MethodBatchCache`), the rows backend (`kernels/rowbatch.py`) and the paged
OscarCache. This module keeps what validation decides: which methods exist and how each one's
artifact is built, and the named protocols (which tokens stay exact) they are compared under.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import torch

from oscar.common import OscarError, attention_shapes, is_latent, latent_shapes
from oscar.kernels.protocol import Protocol
from oscar.stats.artifact import Artifact, QuantConfig, identity_artifact
from oscar.stats.hadamard import hadamard_tensor
from oscar.constraints import quant_problems
from oscar.kernels.memory import LatentFormat, artifact_bits_per_element, latent_per_history_token, latent_total
from oscar.stats.artifact import beyond_calibration
from oscar.stats.fit import FitConfig, fit
from oscar.stats.hadamard import HadamardUnsupported
from oscar.stats.artifact import LatentArtifact
from oscar.stats.latent import LatentFitConfig, fit_latent
from oscar.validate import codebooks
from oscar.validate.codebooks import codec_bits_per_element


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

    if art is None:
        return []
    D = attention_shapes(config)["head_dim"]
    return list(dict.fromkeys(p for l in range(art.num_layers) for p in quant_problems(D, art.quant_for(l))))


def uncalibrated_warning(art: Artifact | None, length: int) -> str | None:
    """A warning when contexts of `length` tokens reach past the positions the artifact was calibrated on."""

    why = beyond_calibration(art, length)
    return f"contexts of {length} tokens reach {why}" if why else None


def resolve_methods(methods: list[str], config, fitted: Artifact | None, *, checked: bool = True,
                    out: str | None = None, say: bool = True) -> tuple[dict[str, Artifact | None], dict[str, str]]:
    """({method: artifact} of the methods that can serve `config`, {method: reason} of those skipped).

    A method is skipped (not crashed on) when its format cannot store this head_dim: packing
    (head_dim * bits whole bytes), group size, pages, a Hadamard of that order. checked=False builds
    NEEDS_ARTIFACT methods without a model check (`fitted_for`, as the attention test does).
    Skips are printed (unless `say` is False) and, with `out`, recorded in out/skipped_methods.json (the report
    lists them).
    """
    import sys

    if is_latent(config):
        arts, skipped = latent_methods(methods, fitted)
        for m, why in skipped.items():
            if say:
                print(f"oscar validate: skipping method {m}: {why}", file=sys.stderr)
        if out and skipped:
            record_skipped(out, skipped)
        return arts, skipped
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
            if say:
                print(f"oscar validate: skipping method {m}: {skipped[m]}", file=sys.stderr)
        else:
            arts[m] = art
    if out and skipped:
        record_skipped(out, skipped)
    return arts, skipped


# An MLA model's methods: each a latent fit variant (stats/rotations.py LATENT_VARIANTS) of the store the given
# latent artifact was fitted from, in its format; hadamard-int2 and naive-int2 stay data-free (no clip search), as
# their per-head namesakes. The rest quantize per-head K/V, which an MLA model does not cache.
LATENT_METHODS = {"oscar-int2": None, "oscar-ref-int2": "reference", "hadamard-int2": "hadamard",
                  "naive-int2": "identity"}
_DATA_FREE = {"hadamard-int2", "naive-int2"}
_LATENT_REFITS: dict = {}  # (variant, store path, store fingerprint, quant) -> the latent artifact


def latent_methods(methods: list[str], fitted: LatentArtifact | None) -> tuple[dict, dict[str, str]]:
    """resolve_methods for an MLA model (the latent artifact already checked against it): bf16 (None), oscar-int2
    (`fitted`) and the latent variants refitted from its store; every other method skipped, with the reason."""
    arts, skipped = {}, {}
    for m in methods:
        if m == "bf16":
            arts[m] = None
        elif m not in LATENT_METHODS:
            skipped[m] = "quantizes per-head K/V; an MLA model caches a latent (methods for it: bf16, " + \
                         ", ".join(LATENT_METHODS) + ")"
        elif fitted is None:
            raise OscarError(f"method {m} needs --artifact (an `oscar fit` latent artifact of this model)")
        elif LATENT_METHODS[m] is None:
            arts[m] = fitted
        else:
            arts[m] = latent_refit(fitted, LATENT_METHODS[m], m, clip=m not in _DATA_FREE)
    return arts, skipped


def latent_refit(fitted: LatentArtifact, variant: str, method: str, clip: bool = True) -> LatentArtifact:
    """The latent `variant` fitted from the store `fitted` came from, in its format (`clip`: with the clip search);
    cached per store."""
    import os

    prov = fitted.meta.get("provenance") or {}
    store = prov.get("store")
    if not store or not os.path.isdir(store):
        raise OscarError(f"method {method} refits the latent {variant} variant from the calibration store of "
                         f"--artifact, but {'it records none' if not store else f'{store!r} does not exist'}")
    key = (variant, clip, os.path.abspath(store), prov.get("store_fingerprint"), repr(fitted.quant))
    if key not in _LATENT_REFITS:
        _LATENT_REFITS[key] = fit_latent(store, LatentFitConfig(variant=variant, quant=fitted.quant, clip=clip),
                                         partial=bool(prov.get("partial")))
    return _LATENT_REFITS[key]


def record_skipped(out: str, skipped: dict[str, str]) -> None:
    """Add `skipped` ({method: reason}) to out/skipped_methods.json (the report's header and table list them)."""
    import json
    import os

    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "skipped_methods.json")
    old = json.load(open(path)) if os.path.exists(path) else {}
    with open(path, "w") as f:
        json.dump({**old, **skipped}, f, indent=1, sort_keys=True)


def choose_methods(methods: list[str], config, fitted: Artifact | None, *, default: bool,
                   model: str) -> tuple[dict[str, Artifact | None], dict[str, str]]:
    """resolve_methods under the rule of every validation command: each method the user named runs, or the command
    refuses in one line naming each that cannot and why; from a `default` list a method whose format cannot serve
    this model's head_dim (a property of the model: the artifact was checked against it first) is dropped, said on
    stderr, and at least one method reading the artifact must remain. Nothing is written here (the caller records
    the drops once it owns its directory: `record_skipped`)."""
    import sys

    arts, skipped = resolve_methods(methods, config, fitted, say=False)
    why = "; ".join(f"{m}: {r}" for m, r in skipped.items())
    if skipped and not default:
        raise OscarError(f"method(s) {', '.join(skipped)} cannot run on model {model} ({why}); leave "
                         f"{'it' if len(skipped) == 1 else 'them'} out of --methods")
    needs = [m for m in methods if m in NEEDS_ARTIFACT]
    if skipped and (not arts or (needs and not set(needs) & set(arts))):
        raise OscarError(f"no method reading the artifact can run on model {model}: every one of the default list "
                         f"is left out ({why}); nothing would measure the artifact")
    for m, r in skipped.items():
        print(f"oscar validate: leaving method {m} out of the default list: {r}", file=sys.stderr)
    return arts, skipped


def bits_per_element(art: Artifact | None, head_dim: int) -> float:
    """Stored bits per K/V element of the quantized history (metadata included); 16 for the exact cache."""
    if art is None:
        return 16.0
    if isinstance(art, LatentArtifact):  # c_kv's codes and scales per latent value (the RoPE key stays 16-bit)
        q = art.quant
        return q.bits + 2 * 8 * getattr(torch, q.param_dtype).itemsize / q.group

    cb = codec_bits_per_element(art)
    if cb is not None:
        return cb
    if art.layer_quant is not None:  # per-layer widths: layer by layer, by the cache's memory accounting

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
    "oscar-int2": "OSCAR rotation, key-mean centering, scaled keys, searched and tuned clips",
    "tq-int2": "TurboQuant re-implemented from its paper: random-sign Walsh-Hadamard, fp16 norms, Beta Lloyd-Max codes, "
               "D/4 outlier channels at 3 bits; keys centred; no clip search (a Lloyd-Max codebook has none)",
    "sq-int2": "SpectralQuant (uniform allocation) re-implemented: calibrated eigenbasis, Gaussian Lloyd-Max codes "
               "scaled by the calibrated std, K and V centred, no per-token metadata; no clip search",
}


def artifact_format(art: Artifact) -> str:
    """The stored format of an artifact's keys and values, in words (the report's method notes)."""
    codec = art.meta.get("codec")
    if codec:  # a codebook format of validate/codebooks.py, read through the simulator
        return f"the {codec.get('kind')} codebook format of {art.meta.get('variant')}"
    q = art.quant
    word = {"float8_e4m3fn": "8-bit", "float16": "fp16", "float32": "float32"}
    params = f"{word.get(q.param_dtype, q.param_dtype)} scale/zero"
    if art.layer_quant is not None:
        wide = [lq for lq in art.layer_quant if lq.key_split]
        bits = " or ".join(str(b) for b in sorted({q.bits + lq.key_top for lq in wide}))
        keys = f"per-layer key widths: {len(wide)} of {len(art.layer_quant)} layers' keys at {bits} bits, the rest at {q.bits}"
        kp = {lq.key_param_dtype for lq in wide} - {None, q.param_dtype}
        if kp:
            params += f" ({', '.join(word.get(d, d) for d in sorted(kp))} for the wider keys)"
    elif q.key_split:
        keys = f"split keys: {q.key_split} channels placed by C_Q at {q.bits + q.key_top} bits, the rest at {q.bits}"
    else:
        keys = f"keys in one {q.bits}-bit group per token"
    return f"{keys}; values at {q.bits} bits; {params}"


def memory_row(name: str, art: Artifact | None, config, context: int, protocol: Protocol) -> dict:
    """Bytes per token of K+V over all layers: history (quantized), and the average at `context` with exact sink/recent.
    An MLA model's: of its latent cache (c_kv and the RoPE key; kernels/memory.py `latent_total`)."""
    if is_latent(config):
        return latent_memory_row(name, art, config, context, protocol)
    s = attention_shapes(config)
    elems = 2 * s["num_layers"] * s["num_kv_heads"] * s["head_dim"]  # K and V, per token
    bpe = bits_per_element(art, s["head_dim"])
    exact = min(context, protocol.sink + protocol.recent) if art is not None else context
    avg_bits = (exact * 16 + (context - exact) * bpe) / context
    return {
        "method": name, "bits_per_element": bpe, "bytes_per_token_history": elems * bpe / 8,
        "bytes_per_token_bf16": elems * 2, "context": context, "protocol": protocol.name,
        "sink": protocol.sink, "recent": protocol.recent, "bytes_per_token_avg": elems * avg_bits / 8,
        "ratio_vs_bf16": avg_bits / 16,
        "note": METHOD_NOTES.get(name, "") + (f" ({artifact_format(art)})" if name == "oscar-int2" and art is not None else ""),
    }


def latent_memory_row(name: str, art: LatentArtifact | None, config, context: int, protocol: Protocol) -> dict:
    """memory_row of an MLA model: its latent cache's bytes (c_kv in INT2 groups + scales, the RoPE key, sinks and
    the recent window 16-bit) by kernels/memory.py's accounting."""
    shapes = latent_shapes(config)
    bf16 = LatentFormat("bf16", bits=16)
    f = bf16 if art is None else LatentFormat(
        name, bits=art.quant.bits, group=art.quant.group, param_bytes=getattr(torch, art.quant.param_dtype).itemsize,
        page_size=art.quant.page_size, sink=protocol.sink, recent=protocol.recent)
    per_tok = sum(latent_per_history_token(shapes, f).values())
    base = sum(latent_per_history_token(shapes, bf16).values())
    avg = sum(latent_total(shapes, f, context).values()) / context
    return {"method": name, "bits_per_element": bits_per_element(art, shapes["kv_lora_rank"]),
            "bytes_per_token_history": per_tok, "bytes_per_token_bf16": base, "context": context,
            "protocol": protocol.name, "sink": protocol.sink, "recent": protocol.recent, "bytes_per_token_avg": avg,
            "ratio_vs_bf16": avg / base, "cache": "latent", "note": LATENT_NOTES.get(name, "")}


LATENT_NOTES: dict[str, str] = {  # an MLA model's methods (`latent_methods`), for memory.json and the report
    "bf16": "the unquantized latent cache",
    "oscar-int2": "the latent artifact given: attention-aware rotation from the absorbed queries (or the variant it "
                  "was fitted with), mean subtracted, searched and tuned group clips",
    "oscar-ref-int2": "the public OSCAR MLA recipe refitted from the same store: covariance basis, bit-reversal "
                      "permutation, block Hadamard, searched group clips",
    "hadamard-int2": "block Hadamard alone; data-free: no clip search",
    "naive-int2": "identity rotation; data-free: no clip search",
}
