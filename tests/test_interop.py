"""Export -> import round trips for the serving-engine formats (bit for bit)."""

import os

import numpy as np
import pytest
import torch

from oscar.__main__ import main as oscar_main
from oscar.common import OscarError
from oscar.stats.artifact import Artifact, QuantConfig, load_artifact, save_artifact
from oscar.stats.interop import embedded_gguf, export_gguf, export_sglang, import_gguf, import_sglang, unsupported_parts

from helpers.synthetic_store import SynthSpec, write_synthetic_store


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


def _scaled(art: Artifact) -> Artifact:
    d = torch.linspace(0.5, 2.0, art.head_dim)
    art.rot_q = [r / d for r in art.rot_k]  # rot_k = Q diag(d) -> dual Q diag(1/d)
    art.rot_k = [r * d for r in art.rot_k]
    art.validate()
    return art


def test_scaled_key_transform_refused_by_rotation_only_formats(tmp_path):
    """Those consumers rotate q and k by one matrix: a scaled rot_k (with its dual rot_q) would change q·k. The
    refusal names what the format is missing and where it is carried."""
    art = _scaled(_random_artifact())
    assert any("rot_q" in s for s in unsupported_parts(art))
    for fv in (1, 2):
        with pytest.raises(OscarError, match=r"cannot be exported in format_version %d \(missing: the query "
                                             r"transform rot_q\).*--format-version 3" % fv):
            export_sglang(art, str(tmp_path), format_version=fv)
    with pytest.raises(OscarError, match=r"cannot be exported in version 1 \(missing: the query transform rot_q\)"
                                         r".*--format-version 2"):
        export_gguf(art, "unused.gguf", str(tmp_path / "x.gguf"), format_version=1)
    assert not os.path.exists(tmp_path / "k_rotation_oscar.pt") and not os.path.exists(tmp_path / "x.gguf")


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


# --- the oscar extension: every recipe `oscar run` can ship, bit for bit -------------------------------------------

def _tiny_gguf(path: str, num_layers: int) -> str:
    """A real GGUF 'model' file with `num_layers` blocks and one tensor (the copy keeps it byte for byte)."""
    import gguf

    w = gguf.GGUFWriter(path, arch="llama")
    w.add_block_count(num_layers)
    w.add_tensor("token_embd.weight", np.arange(32, dtype=np.float32).reshape(4, 8))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


RECIPE = ("rot_k", "rot_v", "rot_q", "k_mean", "clip_k", "clip_v")


def assert_same_recipe(a: Artifact, b: Artifact) -> None:
    for name in RECIPE:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        for l, (s, t) in enumerate(zip(x or [], y or [])):
            assert s.dtype == t.dtype == torch.float32 and torch.equal(s, t), f"layers.{l}.{name}"
    assert a.quant == b.quant and a.layer_quant == b.layer_quant
    assert a.meta["variant"] == b.meta["variant"] and a.meta.get("model") == b.meta.get("model")


@pytest.fixture(scope="module")
def shipped_recipes(tmp_path_factory):
    """Artifacts of every recipe `oscar run --variant V` (tuned or `--no-tune`) can ship, plus the fit options
    behind oscar-kc-int2 (per-channel keys) and 8-bit parameters, fitted on a real (synthetic) calibration store."""
    from oscar.stats.artifact import QuantConfig
    from oscar.stats.fit import FitConfig, fit
    from oscar.stats.rotations import VARIANTS
    from oscar.recipe.tune import scale_key_clips

    store = str(tmp_path_factory.mktemp("ext") / "store")
    write_synthetic_store(store, SynthSpec(num_layers=2, num_kv_heads=2, head_dim=16, num_q_heads=4, num_blocks=2,
                                           rows=64, reservoir=32, k_mean=2.0))
    out = {}
    for v in sorted(VARIANTS):
        art = fit(store, FitConfig(variant=v, progress=False, threads=1))
        out[v] = art
        out[f"{v}+tuned"] = scale_key_clips(art, 1.2)  # what `oscar run`'s tune stage writes
    out["scaled/channel-keys"] = fit(store, FitConfig(variant="scaled", quant=QuantConfig(key_axis="channel", group_size=16),
                                                      progress=False, threads=1))
    out["scaled/fp8-params"] = fit(store, FitConfig(variant="scaled", quant=QuantConfig(param_dtype="float8_e4m3fn"),
                                                    progress=False, threads=1))
    assert out["scaled"].rot_q is not None and out["scaled"].k_mean is not None  # the main job's recipe
    from oscar.recipe.widths import native_layer_artifact, widths_artifact

    # per-layer widths (oscar-artifact/3): layer 1's keys at 4 bits
    out["scaled/layer-widths"] = native_layer_artifact(widths_artifact(out["scaled"], [[2, 2], [4, 2]]))
    assert out["scaled/layer-widths"].quant_for(1).key_top == 2
    return out


def test_extension_roundtrip_every_shipped_recipe_bit_exact(tmp_path, shipped_recipes):
    import gguf

    model = _tiny_gguf(str(tmp_path / "tiny.gguf"), 2)
    for name, art in shipped_recipes.items():
        d = tmp_path / name.replace("/", "_").replace("+", "_")
        saved = str(d / "a.safetensors")
        os.makedirs(d)
        save_artifact(art, saved)
        art = load_artifact(saved)  # what `oscar export` reads
        paths = export_sglang(art, str(d / "sg"), format_version=3)
        o = torch.load(paths[0], weights_only=True)
        assert o["format_version"] == 3 and o["extension"] == "oscar-kv" and o["extension_version"] == 1
        assert ("query_rotation" in o["layers"][0]) == (art.rot_q is not None)
        assert_same_recipe(art, import_sglang(str(d / "sg")))

        g = export_gguf(art, model, str(d / "m.gguf"), format_version=2)
        r = gguf.GGUFReader(g, "r")
        assert r.get_field("oscar.gguf_rot.version").contents() == 2
        assert ("blk.1.attn_q_rot.weight" in {t.name for t in r.tensors}) == (art.rot_q is not None)
        back = import_gguf(g)
        assert_same_recipe(art, back)
        save_artifact(back, str(d / "b.safetensors"))  # and it is a loadable artifact again
        assert_same_recipe(art, load_artifact(str(d / "b.safetensors")))


def test_scaled_artifact_exports_by_default_to_the_extension(tmp_path, shipped_recipes):
    art = shipped_recipes["scaled+tuned"]
    o = torch.load(export_sglang(art, str(tmp_path / "sg"))[0], weights_only=True)
    assert o["format_version"] == 3
    lay = o["layers"][1]
    assert torch.equal(lay["query_rotation"], art.rot_q[1]) and torch.equal(lay["rotation"], art.rot_k[1])
    # the query transform is the dual of the key transform: q·k survives export
    assert (lay["query_rotation"].double().transpose(-1, -2) @ lay["rotation"].double()
            - torch.eye(16, dtype=torch.float64)).abs().max() < 1e-4
    g = export_gguf(art, _tiny_gguf(str(tmp_path / "t.gguf"), 2), str(tmp_path / "m.gguf"))
    import gguf

    ts = {t.name: t for t in gguf.GGUFReader(g, "r").tensors}
    assert np.array_equal(np.asarray(ts["blk.0.attn_q_rot.weight"].data)[1], art.rot_q[0][1].T.numpy())  # rot_qᵀ per head
    assert np.array_equal(np.asarray(ts["blk.0.attn_k_mean"].data), art.k_mean[0].numpy())


def test_cli_exports_the_main_jobs_recipe(tmp_path, shipped_recipes, capsys):
    p = str(tmp_path / "a.safetensors")
    save_artifact(shipped_recipes["scaled+tuned"], p)
    assert oscar_main(["export", p, "--format", "sglang-oscar", "--out", str(tmp_path / "sg")]) == 0
    assert "not exported" not in capsys.readouterr().err  # nothing dropped
    assert oscar_main(["import", str(tmp_path / "sg"), "--format", "sglang-oscar", "--out", str(tmp_path / "b.safetensors")]) == 0
    assert_same_recipe(load_artifact(p), load_artifact(str(tmp_path / "b.safetensors")))
    assert oscar_main(["export", p, "--format", "sglang-oscar", "--format-version", "2", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "missing: the query transform rot_q" in err and "--format-version 3" in err
    assert oscar_main(["export", p, "--format", "gguf-rot", "--format-version", "3", "--out", str(tmp_path / "x")]) == 2
    assert "gguf-rot has 1 and 2" in capsys.readouterr().err


def test_extension_import_rejects_bad_files(tmp_path, shipped_recipes):
    art = shipped_recipes["scaled"]
    export_sglang(art, str(tmp_path / "sg"))
    k = torch.load(tmp_path / "sg" / "k_rotation_oscar.pt", weights_only=True)
    k["extension_version"] = 99
    torch.save(k, tmp_path / "sg" / "k_rotation_oscar.pt")
    with pytest.raises(OscarError, match="extension 'oscar-kv' version 99"):
        import_sglang(str(tmp_path / "sg"))
    k["extension_version"] = 1
    del k["layers"][1]["query_rotation"]
    torch.save(k, tmp_path / "sg" / "k_rotation_oscar.pt")
    with pytest.raises(OscarError, match="layer 1 has no 'query_rotation'"):
        import_sglang(str(tmp_path / "sg"))
    export_sglang(art, str(tmp_path / "mix"))
    export_sglang(shipped_recipes["oscar"], str(tmp_path / "v2"), format_version=2)
    os.replace(tmp_path / "v2" / "v_rotation_oscar.pt", tmp_path / "mix" / "v_rotation_oscar.pt")
    with pytest.raises(OscarError, match="different format_version"):
        import_sglang(str(tmp_path / "mix"))
