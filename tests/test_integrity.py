"""Integrity of the block store: fault injection (deleted / truncated / altered chunk of a done block).

Each fault is detected by block, layer and array (verify, inspect, fit, `oscar verify`), a resumed
run redoes exactly that block, and the final store equals an uninterrupted one chunk for chunk.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import zarr

from oscar.__main__ import main
from oscar.common import OscarError
from oscar.pipeline.calibrate import run_blocks
from oscar.pipeline.store import FORMAT_V1, CalibStore, WriterLock, summarize

from helpers.capture_reference import make_model
from helpers.stores import block_data, meta_for


@pytest.fixture(scope="module")
def model():
    return make_model("llama")


@pytest.fixture(scope="module")
def full(tmp_path_factory, model):
    """An uninterrupted store of 3 blocks x 3 layers."""
    tokens, mask = block_data()
    path = tmp_path_factory.mktemp("full") / "full.zarr"
    with WriterLock(path, range(3)):
        run_blocks(model, CalibStore.open_or_create(path, meta_for(model), tokens, mask), batch_size=2,
                   progress=False)
    return path


def _chunk(st: CalibStore, name: str, block: int) -> Path:
    return st._chunk_path(name, block)


def _damage(path: Path, kind: str) -> tuple[int, int, str, str]:
    """Damage one chunk of a done block; returns (block, layer, array, expected problem)."""
    st = CalibStore(path)
    if kind == "deleted":
        b, l, name = 1, 1, "layers/1/q_gram"
        _chunk(st, name, b).unlink()
        return b, l, name, "missing chunk"
    if kind == "truncated":
        b, l, name = 0, 2, "layers/2/k_res"
        p = _chunk(st, name, b)
        data = p.read_bytes()
        p.write_bytes(data[: len(data) // 2])
        return b, l, name, f"truncated chunk ({len(data) // 2} of {len(data)} bytes)"
    b, l, name = 2, 0, "layers/0/o_gram"  # one byte flipped inside the chunk
    p = _chunk(st, name, b)
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))
    return b, l, name, "checksum mismatch"


def _same_store(a: Path, b: Path) -> None:
    """Every array of every block equal, byte for byte (done markers and checksums included)."""
    ga, gb = zarr.open_group(str(a), mode="r"), zarr.open_group(str(b), mode="r")
    names = ["tokens", "mask", "done", "checksums"] + [f"layers/{l}/{n}" for l in range(3) for n in CalibStore(a).spec]
    for n in names:
        assert np.array_equal(ga[n][:], gb[n][:]), n


@pytest.mark.parametrize("kind", ["deleted", "truncated", "flipped"])
def test_damaged_done_block_detected_refused_and_redone(tmp_path, model, full, kind, capsys):
    path = tmp_path / "s.zarr"
    shutil.copytree(full, path)
    b, l, name, problem = _damage(path, kind)

    damage = CalibStore(path).verify()
    assert [(d.block, d.layer, d.array) for d in damage] == [(b, l, name)]
    assert damage[0].problem.startswith(problem)
    want = f"block {b}, layer {l}, {name}: {problem}"
    with pytest.raises(OscarError, match=re.escape(want)):  # inspect refuses
        summarize(path)
    from oscar.stats.fit import FitConfig, fit  # fit refuses (before any fitting work)

    with pytest.raises(OscarError, match=re.escape(want)):
        fit(str(path), FitConfig(progress=False))
    capsys.readouterr()
    assert main(["verify", str(path)]) == 1  # exits non-zero, names the chunk
    assert want in capsys.readouterr().out
    assert main(["inspect", str(path)]) == 2 and want in capsys.readouterr().err

    with WriterLock(path, range(3)):  # resume: the damaged block is redone, nothing else
        r = run_blocks(model, CalibStore(path, mode="r+"), batch_size=2, progress=False)
    assert r.blocks_damaged == [b] and r.blocks_run == 1 and r.blocks_skipped == 2
    assert f"damaged done block: {want}" in capsys.readouterr().err
    assert CalibStore(path).verify() == []
    assert main(["verify", str(path)]) == 0
    _same_store(path, full)


def test_old_format_store_read_with_warning(tmp_path, full, capsys):
    path = tmp_path / "v1.zarr"
    shutil.copytree(full, path)
    g = zarr.open_group(str(path), mode="r+")
    g.attrs["format"] = FORMAT_V1
    del g.attrs["checksums"]
    shutil.rmtree(path / "checksums")
    (path / "zarr.json").write_text((path / "zarr.json").read_text())  # attrs rewritten by zarr already
    capsys.readouterr()
    st = CalibStore(path)
    assert not st.checksummed and st.verify() == []
    assert "cannot be verified" in capsys.readouterr().err
    s = summarize(path)
    assert s["blocks_done"] == 3 and s["verified"] is False
    assert main(["verify", str(path)]) == 0
    assert "NOT verified" in capsys.readouterr().out


def test_missing_checksum_record_is_damage(tmp_path, full):
    path = tmp_path / "s.zarr"
    shutil.copytree(full, path)
    st = CalibStore(path)
    (path / "checksums" / st.array("checksums").metadata.encode_chunk_key((1, 2, 0))).unlink()
    assert [str(d) for d in CalibStore(path).verify()] == ["block 1, layer 2, checksums: checksum record missing"]


# ------------------------------------------------------------------ artifacts and model identity
def test_flipped_byte_in_artifact_tensor_detected(tmp_path, capsys):
    import torch
    from transformers import LlamaConfig

    from oscar.stats.artifact import identity_artifact, load_artifact, save_artifact

    cfg = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2)
    art = identity_artifact(cfg)
    art.rot_k[1] = torch.linalg.qr(torch.randn(2, 16, 16))[0]
    path = tmp_path / "a.safetensors"
    save_artifact(art, str(path))
    assert torch.equal(load_artifact(str(path)).rot_k[1], art.rot_k[1])  # intact: loads
    data = bytearray(path.read_bytes())
    hdr = 8 + int.from_bytes(data[:8], "little")
    import json as _json

    off = _json.loads(data[8:hdr])["layers.1.rot_k"]["data_offsets"][0]
    data[hdr + off + 21] ^= 0x04  # one bit of one float of layers.1.rot_k: still finite, still loads in safetensors
    path.write_bytes(bytes(data))
    with pytest.raises(OscarError, match=r"layers\.1\.rot_k.*fail their checksum"):
        load_artifact(str(path))
    assert main(["inspect", str(path)]) == 2
    assert "fail their checksum" in capsys.readouterr().err


def _perturbed_copy(src: str, dst: Path, layer: int) -> None:
    """A checkpoint with the same config.json and tokenizer, one layer's q_proj weights changed."""
    import json as _json

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    idx = _json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    key = f"model.layers.{layer}.self_attn.q_proj.weight"
    shard = dst / idx[key]
    t = load_file(str(shard))
    t[key] = t[key] * 1.01
    save_file(t, str(shard), metadata={"format": "pt"})


@pytest.mark.slow
def test_same_config_different_weights_refused(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from oscar.kernels.cache import OscarCache
    from oscar.pipeline.calibrate import CalibConfig, calibrate
    from oscar.pipeline.models import load_info, resolve_model
    from oscar.stats.artifact import load_artifact, save_artifact
    from oscar.stats.fit import FitConfig, fit

    a, b = tmp_path / "model-a", tmp_path / "model-b"
    shutil.copytree(resolve_model("tiny-llama"), a)
    _perturbed_copy(str(a), b, layer=2)
    ia, ib = load_info(str(a)), load_info(str(b))
    assert ia.config_fingerprint == ib.config_fingerprint and ia.fingerprint != ib.fingerprint
    assert [x == y for x, y in zip(ia.weights_layers, ib.weights_layers)] == [True, True, False, True]

    store = str(tmp_path / "s.zarr")
    cal = dict(corpus="pydoc", store=store, seq_len=48, sink=4, seqs_per_block=2, tokens=4 * 48, reservoir=16,
               threads=1)
    calibrate(CalibConfig(model=str(a), **cal), progress=False)
    with pytest.raises(OscarError, match=r"layers \[2\] differ\): same config, different weights"):  # resume with B refused
        calibrate(CalibConfig(model=str(b), **cal), progress=False)
    out = str(tmp_path / "a.safetensors")
    save_artifact(fit(store, FitConfig(variant="centered", progress=False, threads=1)), out)
    art = load_artifact(out)
    assert art.meta["model"]["weights_fingerprint"] == ia.weights_fingerprint

    ma = AutoModelForCausalLM.from_pretrained(str(a))
    mb = AutoModelForCausalLM.from_pretrained(str(b))
    OscarCache.from_artifact(ma, art)  # its own model: accepted
    with pytest.raises(OscarError, match=r"layers \[2\] differ\): same config, different weights.*--allow-weights-mismatch"):
        OscarCache.from_artifact(mb, art)
    capsys.readouterr()
    OscarCache.from_artifact(mb, art, allow_weights_mismatch=True)  # a deliberate transfer
    assert "accepted (--allow-weights-mismatch)" in capsys.readouterr().err
