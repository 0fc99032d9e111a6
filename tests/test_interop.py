"""Export -> import round trips for the serving-engine formats (bit for bit)."""

import os

import numpy as np
import pytest
import torch

from oscar.__main__ import main as oscar_main
from oscar.common import OscarError
from oscar.stats.artifact import Artifact, QuantConfig, load_artifact, save_artifact
from oscar.stats.interop import embedded_gguf, export_gguf, export_sglang, import_gguf, import_sglang, unsupported_parts


def _random_artifact(L=3, H=2, D=16, shared=False, seed=0) -> Artifact:
    g = torch.Generator().manual_seed(seed)

    def rot():
        q, _ = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))
        return q.float()

    def per_layer():
        if shared:
            r = rot()
            return r.expand(H, D, D).clone()
        return torch.stack([rot() for _ in range(H)])

    return Artifact(
        rot_k=[per_layer() for _ in range(L)], rot_v=[per_layer() for _ in range(L)],
        clip_k=[torch.full((H,), 0.9) for _ in range(L)], clip_v=[torch.ones(H) for _ in range(L)],
        k_mean=[torch.randn(H, D, generator=g) for _ in range(L)],
        extra={f"layers.{l}.eig_{k}": torch.rand(H, D, generator=g).sort(-1, descending=True).values for l in range(L) for k in "kv"},
        meta={"variant": "test"},
    )


@pytest.mark.parametrize("shared", [False, True])
def test_sglang_roundtrip_bit_exact_and_schema(tmp_path, shared):
    art = _random_artifact(shared=shared)
    paths = export_sglang(art, str(tmp_path))
    assert sorted(os.path.basename(p) for p in paths) == ["k_rotation_oscar.pt", "v_rotation_oscar.pt"]
    o = torch.load(paths[0], weights_only=True)  # loads with the safe unpickler
    assert set(o) == {"format_version", "objective", "source_grouping", "layers"}
    assert o["format_version"] == (1 if shared else 2)
    assert o["source_grouping"] == ("per_layer" if shared else "per_kv_head")
    lay = o["layers"][1]
    assert set(lay) == {"layer_id", "rotation", "eigenvalues"} and lay["layer_id"] == 1
    assert lay["rotation"].dtype == torch.float32
    assert lay["rotation"].shape == ((16, 16) if shared else (2, 16, 16))
    back = import_sglang(str(tmp_path), num_kv_heads=2)
    for a, b in zip(art.rot_k + art.rot_v, back.rot_k + back.rot_v):
        assert torch.equal(a, b)
    for k, t in art.extra.items():
        want = t[:1].expand_as(t) if shared else t
        assert torch.equal(back.extra[k], want)


def test_sglang_v1_refuses_per_head(tmp_path):
    with pytest.raises(OscarError, match="per-head"):
        export_sglang(_random_artifact(), str(tmp_path), format_version=1)


def test_unsupported_parts_named():
    lost = unsupported_parts(_random_artifact())
    assert any("centering" in s for s in lost) and any("clip" in s for s in lost)


def test_scaled_key_transform_refused_by_rotation_only_formats(tmp_path):
    """Those consumers rotate q and k by one matrix: a scaled rot_k (with its dual rot_q) would change q·k."""
    art = _random_artifact()
    d = torch.linspace(0.5, 2.0, 16)
    art.rot_q = [r / d for r in art.rot_k]  # rot_k = Q diag(d) -> dual Q diag(1/d)
    art.rot_k = [r * d for r in art.rot_k]
    art.validate()
    assert any("rot_q" in s for s in unsupported_parts(art))
    with pytest.raises(OscarError, match="cannot be exported"):
        export_sglang(art, str(tmp_path))
    with pytest.raises(OscarError, match="cannot be exported"):
        export_gguf(art, "unused.gguf", str(tmp_path / "x.gguf"))


@pytest.mark.slow
def test_gguf_copy_keeps_every_tensor_and_roundtrips(tmp_path):
    import gguf

    src = embedded_gguf()
    r0 = gguf.GGUFReader(src, "r")
    L = r0.get_field("llama.block_count").contents()
    art = _random_artifact(L=L, H=3, D=64)
    out = export_gguf(art, src, str(tmp_path / "m.gguf"))
    r1 = gguf.GGUFReader(out, "r")
    t0 = {t.name: t for t in r0.tensors}
    t1 = {t.name: t for t in r1.tensors}
    for name, t in t0.items():  # every original tensor, byte for byte
        assert name in t1 and t1[name].tensor_type == t.tensor_type
        assert np.array_equal(np.asarray(t1[name].data), np.asarray(t.data))
    added = set(t1) - set(t0)
    assert added == {f"blk.{l}.attn_{k}_rot.weight" for l in range(L) for k in "kv"}
    assert t1["blk.0.attn_k_rot.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert np.asarray(t1["blk.0.attn_k_rot.weight"].data).shape == (3, 64, 64)
    # stored as R^T per head
    assert np.array_equal(np.asarray(t1["blk.2.attn_v_rot.weight"].data)[1], art.rot_v[2][1].T.numpy())
    for f in r0.fields:  # metadata copied
        assert f in r1.fields
    back = import_gguf(out)
    for a, b in zip(art.rot_k + art.rot_v, back.rot_k + back.rot_v):
        assert torch.equal(a, b)


def test_cli_export_import(tmp_path):
    art = _random_artifact()
    p = str(tmp_path / "a.safetensors")
    save_artifact(art, p)
    assert oscar_main(["export", p, "--format", "sglang-oscar", "--out", str(tmp_path / "sg")]) == 0
    assert oscar_main(["import", str(tmp_path / "sg"), "--format", "sglang-oscar", "--out", str(tmp_path / "b.safetensors")]) == 0
    back = load_artifact(str(tmp_path / "b.safetensors"))
    assert all(torch.equal(a, b) for a, b in zip(art.rot_k, back.rot_k))


def test_import_rejects_bad_files(tmp_path):
    torch.save({"layers": {}}, tmp_path / "k_rotation_x.pt")
    torch.save({"layers": {}}, tmp_path / "v_rotation_x.pt")
    with pytest.raises(OscarError, match="missing key"):
        import_sglang(str(tmp_path))
    with pytest.raises(OscarError, match="exactly one"):
        import_sglang(str(tmp_path / "nothing"))
