"""The zarr block store: layout, exactly-once writes, refusal of mismatched stores, locks, reduce, inspect."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import zarr

from oscar.common import OscarError
from oscar.pipeline.calibrate import run_blocks
from oscar.pipeline.store import CalibStore, StoreMeta, WriterLock, reduce, summarize
from helpers import capture_reference as ref
from helpers.stores import block_data, meta_for


@pytest.fixture(scope="module")
def model():
    return ref.make_model("llama")


def test_run_blocks_store_equals_bruteforce(tmp_path, model):
    """Every stored array of every block equals the float64 brute force; zarr reads what we wrote."""
    tokens, mask = block_data()
    meta = meta_for(model)
    path = tmp_path / "s.zarr"
    with WriterLock(path, range(3)):
        st = CalibStore.open_or_create(path, meta, tokens, mask)
        r = run_blocks(model, st, batch_size=2, progress=False)
    assert r.blocks_run == 3 and r.blocks_skipped == 0 and r.tokens_run == int(mask.sum())
    g = zarr.open_group(str(path), mode="r")   # plain zarr, not our reader
    assert g.attrs["format"] == "oscar-calib/2" and g["done"][:].all()
    assert np.array_equal(g["tokens"][:], tokens) and np.array_equal(g["mask"][:], mask)
    for b in range(3):
        want = ref.block_reference(model, torch.from_numpy(tokens[b]).long(), torch.from_numpy(mask[b]).long(),
                                   layers=range(3), sink=2, reservoir=5, seed=3, block=b, check_identity=(b == 0))
        for l, w in want.items():
            got = {name: g[f"layers/{l}/{name}"][b] for name in st.spec}
            assert not ref.compare(got, w), (b, l, ref.compare(got, w))
    # reduce: float64 sums over done blocks in block order; max for absmax; concatenated reservoirs
    qg = reduce(path, "q_gram")
    for l in range(3):
        acc = np.zeros_like(qg[l])
        for b in range(3):
            acc = acc + g[f"layers/{l}/q_gram"][b]
        assert np.array_equal(qg[l], acc)
        assert reduce(path, "kv_count", [l])[l] == sum(g[f"layers/{l}/kv_count"][b] for b in range(3))
        assert np.array_equal(reduce(path, "k_absmax", [l])[l], g[f"layers/{l}/k_absmax"][:].max(0))
        res = reduce(path, "q_res", [l])[l]
        assert res.shape == (2, int(g[f"layers/{l}/qo_res_count"][:].sum()), 10)


def test_resume_skips_done_and_redoes_half_written(tmp_path, model, capsys):
    tokens, mask = block_data()
    meta = meta_for(model)
    full = tmp_path / "full.zarr"
    with WriterLock(full, range(3)):
        run_blocks(model, CalibStore.open_or_create(full, meta, tokens, mask), batch_size=2, progress=False)

    path = tmp_path / "s.zarr"
    with WriterLock(path, range(3)):
        st = CalibStore.open_or_create(path, meta, tokens, mask)
        good = CalibStore(full)
        # block 0 complete; block 1: layer 0 done, layer 1 half-written (chunks but no marker), layer 2 untouched
        for l in range(3):
            st.write_layer(0, l, {n: good.array(f"layers/{l}/{n}")[0] for n in st.spec})
        st.write_layer(1, 0, {n: good.array(f"layers/{l}/{n}")[1] for n in st.spec for l in [0]})
        for n in list(st.spec)[:7]:
            st.put(f"layers/1/{n}", 1, np.full(st.array(f"layers/1/{n}").shape[1:], 7))  # garbage
        assert st.partial(1, 1) and not st.partial(1, 0) and not st.partial(1, 2) and not st.partial(2, 1)
        assert st.todo_blocks() == [1, 2]
        r = run_blocks(model, CalibStore(path, mode="r+"), batch_size=2, progress=False)
    assert r.blocks_run == 2 and r.blocks_skipped == 1 and r.blocks_redone == [1]
    assert "block 1 was half-written" in capsys.readouterr().err
    for stat in ("q_gram", "o_gram", "vw_gram", "k_m4", "v_absmax", "kv_count", "nonfinite", "k_res"):
        a, b = reduce(path, stat), reduce(full, stat)
        for l in range(3):
            assert np.array_equal(a[l], b[l]), (stat, l)   # bit-identical


def test_refuses_other_model_corpus_config(tmp_path, model):
    tokens, mask = block_data()
    path = tmp_path / "s.zarr"
    CalibStore.open_or_create(path, meta_for(model), tokens, mask)
    other = ref.make_model("qwen3")
    with pytest.raises(OscarError, match="was made for model"):
        CalibStore.open_or_create(path, meta_for(other), tokens, mask)
    with pytest.raises(OscarError, match="was made from corpus 'c1'"):
        CalibStore.open_or_create(path, meta_for(model, corpus="c2"), tokens, mask)
    with pytest.raises(OscarError, match=r"different job config \(config.seed: 3 -> 4"):
        CalibStore.open_or_create(path, meta_for(model, seed=4), tokens, mask)
    with pytest.raises(OscarError, match=r"sink: 2 -> 3"):
        CalibStore.open_or_create(path, meta_for(model, sink=3), tokens, mask)
    with pytest.raises(OscarError, match="other token ids"):
        CalibStore.open_or_create(path, meta_for(model), tokens[::-1].copy(), mask)
    # --overwrite starts over
    st = CalibStore.open_or_create(path, meta_for(model, seed=4), tokens, mask, overwrite=True)
    assert st.meta.config["seed"] == 4 and not st.done().any()
    # never delete something that is not a store
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "precious.txt").write_text("x")
    with pytest.raises(OscarError, match="not an oscar-calib/2 store"):
        CalibStore.open_or_create(junk, meta_for(model), tokens, mask, overwrite=True)
    assert (junk / "precious.txt").exists()
    with pytest.raises(OscarError, match="not a zarr store"):
        CalibStore(junk)


def test_half_created_store_is_recreated(tmp_path, model):
    tokens, mask = block_data()
    path = tmp_path / "s.zarr"
    zarr.create_group(store=str(path), zarr_format=3, attributes={"format": "oscar-calib/1", "creating": True})
    with pytest.raises(OscarError, match="never fully created"):
        CalibStore(path)
    st = CalibStore.open_or_create(path, meta_for(model), tokens, mask)
    assert st.meta.num_blocks == 3


def test_writer_lock(tmp_path, capsys):
    path = tmp_path / "s.zarr"
    # a live writer in another process holds layers 0..3
    code = ("import sys,time; from oscar.pipeline.store import WriterLock; "
            f"l = WriterLock({str(path)!r}, range(4)).acquire(); print('held', flush=True); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        with pytest.raises(OscarError, match=f"being written by pid {p.pid}"):
            WriterLock(path, range(2, 6)).acquire()
        assert not (tmp_path / "s.zarr.lock" / "layer-00005.json").exists()  # nothing half-acquired
        with WriterLock(path, range(4, 6)):  # disjoint layers: another stage may write them
            pass
        # same job id (a Ray driver and its stage actors): shared
        held = json.loads((tmp_path / "s.zarr.lock" / "layer-00000.json").read_text())
        with WriterLock(path, range(2), job=held["job"]):
            pass
        assert (tmp_path / "s.zarr.lock" / "layer-00000.json").exists()  # not released by the guest
    finally:
        p.kill()
        p.wait()
    # the holder died (kill -9): its locks are stale and taken over, loudly
    with WriterLock(path, range(4)) as lk:
        assert len(lk.owned) == 4
    assert "taking over stale lock" in capsys.readouterr().err
    assert not (tmp_path / "s.zarr.lock").exists()


def test_summary_and_cli_inspect(tmp_path, model, capsys):
    tokens, mask = block_data()
    path = tmp_path / "s.zarr"
    with WriterLock(path, range(3)):
        st = CalibStore.open_or_create(path, meta_for(model), tokens, mask)
        run_blocks(model, st, batch_size=3, progress=False, layers=(0, 1, 2))
    s = summarize(path)
    assert s["blocks_done"] == 3 and s["tokens_done"] == int(mask.sum())
    l1 = s["layers"][1]
    cq = reduce(path, "q_gram", [1])[1] / reduce(path, "q_count", [1])[1]
    assert np.allclose(l1["cq_top_eig"][0], np.sort(np.linalg.eigvalsh(cq[0]))[::-1][:3])
    # key kurtosis against a direct computation on the exact (reference) rows of block 0..2
    from scipy.stats import kurtosis

    rows = np.concatenate([ref.block_reference(model, torch.from_numpy(tokens[b]).long(),
                                               torch.from_numpy(mask[b]).long(), layers=[1], sink=2, reservoir=0,
                                               seed=3, block=b, check_identity=False)[1]["rows_k"]
                           for b in range(3)], axis=1)                  # (Hkv, N, D)
    ku = kurtosis(rows, axis=1, fisher=False)                            # (Hkv, D)
    assert np.isclose(l1["k_kurtosis_max"], ku.max(), rtol=1e-8)
    assert np.isclose(l1["k_kurtosis_median"], np.median(ku), rtol=1e-8)
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-m", "oscar", "inspect", str(path), "--json"], capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    j = json.loads(out.stdout)
    assert j["format"] == "oscar-calib/2" and j["layers"][2]["kv_rows"] == s["layers"][2]["kv_rows"]
    assert "layers/{l}/q_gram" in j["schema"]
    from oscar.__main__ import main

    capsys.readouterr()
    assert main(["inspect", str(path)]) == 0
    txt = capsys.readouterr().out
    assert "C_Q top eigenvalues" in txt and "3/3 done" in txt and "layers/{l}/vw_gram" in txt
    assert main(["inspect", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_inspect_artifact(tmp_path, model, capsys):
    from oscar.__main__ import main
    from oscar.stats.artifact import identity_artifact, save_artifact

    p = tmp_path / "a.safetensors"
    save_artifact(identity_artifact(model.config), str(p))
    assert main(["inspect", str(p)]) == 0
    assert "oscar-artifact" in capsys.readouterr().out


# --------------------------------------------------------------------------- the one reader

def _tiny_meta(L=2, H=2, D=4, R=3, B=3):
    return StoreMeta(model={"name": "t", "fingerprint": "t", "num_layers": L, "num_q_heads": 2 * H, "num_kv_heads": H,
                            "head_dim": D}, corpus={"name": "c", "fingerprint": "c", "split": "all"}, seq_len=4,
                     sink=0, num_blocks=B, seqs_per_block=1, reservoir=R, config={})


def _tiny_store(path, arrays=None, counts=(3, 1, 2)):
    from oscar.pipeline.store import layer_arrays

    meta = _tiny_meta()
    st = CalibStore.create(path, meta, np.zeros((3, 1, 4), np.int32), np.ones((3, 1, 4), np.uint8), arrays=arrays)
    shapes = layer_arrays(2, 4, 3)
    for b in range(3):
        layers = {}
        for l in range(2):
            a = {n: np.full(shapes[n][1], 10 * b + l, shapes[n][0]) for n in st.spec}
            for x in ("q", "k"):
                if f"{x}_res" in a:
                    a[f"{x}_res"] = np.arange(2 * 3 * 4, dtype="float32").reshape(2, 3, 4) + 100 * b
            a["res_count"] = np.int64(counts[b])
            if "qo_res_count" in a:
                a["qo_res_count"] = np.int64(3)
            layers[l] = a
        st.write_block(b, layers)
    return st


def test_reader_read_and_reservoir(tmp_path):
    from oscar.pipeline.store import open_verified

    _tiny_store(tmp_path / "s.zarr")
    st = open_verified(tmp_path / "s.zarr")
    assert st.read("layers/1/q_count").tolist() == [1, 11, 21]
    assert st.read("layers/1/q_count", [0, 2]).tolist() == [1, 21]        # orthogonal selection
    assert st.read("layers/1/q_count", [1, 2]).tolist() == [11, 21]       # contiguous slice
    k = st.reservoir(0, "k", 1)  # res_count rows per block, head 1
    assert [r.shape for r in k] == [(3, 4), (1, 4), (2, 4)] and k[2][0, 0] == 200 + 12
    assert [r.shape[0] for r in st.reservoir(0, "q", 0)] == [3, 3, 3]     # q rows: qo_res_count
    with pytest.raises(OscarError, match="layer 2 out of range"):
        st.reservoir(2, "k", 0)
    with pytest.raises(OscarError, match="head 5 out of range"):
        st.reservoir(0, "k", 5)
    with pytest.raises(OscarError, match="store has no array 'layers/0/nope'"):
        st.read("layers/0/nope")


def test_reader_refuses_missing_damaged_and_incomplete(tmp_path):
    from oscar.pipeline.store import open_verified

    with pytest.raises(OscarError, match="calibration store .* does not exist"):
        open_verified(tmp_path / "missing.zarr")
    st = _tiny_store(tmp_path / "s.zarr")
    chunk = st._chunk_path("layers/1/k_sum", 2)
    data = bytearray(chunk.read_bytes())
    data[0] ^= 1
    chunk.write_bytes(bytes(data))
    with pytest.raises(OscarError, match=r"block 2, layer 1, layers/1/k_sum: checksum mismatch"):
        open_verified(tmp_path / "s.zarr")
    g = zarr.open_group(str(tmp_path / "s.zarr"), mode="r+")
    del g.attrs["reservoir"]
    with pytest.raises(OscarError, match=r"root attributes incomplete \(missing reservoir\)"):
        CalibStore(tmp_path / "s.zarr")
    g.attrs["reservoir"] = 3
    g.attrs["model"] = {"name": "t"}
    with pytest.raises(OscarError, match="missing model.num_layers, model.num_kv_heads, model.head_dim"):
        CalibStore(tmp_path / "s.zarr")
    g.attrs["model"] = _tiny_meta().model
    g.attrs["num_blocks"] = 4
    with pytest.raises(OscarError, match=r"'done' has shape \(3, 2\), expected"):
        CalibStore(tmp_path / "s.zarr")


def test_subset_store(tmp_path):
    """A store holding a subset of the arrays (synthetic bench stores) is written and verified like any other."""
    from oscar.pipeline.store import open_verified

    keep = ("q_gram", "q_count", "kv_count", "res_count", "k_res", "nonfinite")
    _tiny_store(tmp_path / "s.zarr", arrays=keep)
    st = open_verified(tmp_path / "s.zarr")
    assert list(st.spec) == [n for n in st.spec if n in keep] and set(st.spec) == set(keep)
    assert not os.path.exists(tmp_path / "s.zarr" / "layers" / "0" / "v_gram")
    assert st.verify() == [] and st.done().all()
    with pytest.raises(OscarError, match="unknown store arrays"):
        CalibStore.create(tmp_path / "t.zarr", _tiny_meta(), np.zeros((3, 1, 4), np.int32),
                          np.ones((3, 1, 4), np.uint8), arrays=["q_gram", "z_gram"])


def test_synthetic_store_is_a_verified_store(tmp_path):
    from helpers import synthetic_store as syn

    from oscar.pipeline.store import FORMAT, open_verified

    for fast in (False, True):
        p = tmp_path / f"s{fast}.zarr"
        syn.write_synthetic_store(str(p), syn.SynthSpec(num_layers=2, num_kv_heads=1, head_dim=8, num_blocks=2,
                                                        rows=32, reservoir=16, only_fit_arrays=fast))
        st = open_verified(p)
        assert st.meta.format == FORMAT and st.checksummed and st.done().all()
        assert ("k_gram" in st.spec) is not fast
        # the sums are those of the reservoir's source rows: count and reservoir as written
        assert st.read("layers/1/q_count").tolist() == [32, 32] and st.reservoir(1, "k", 0)[0].shape == (16, 8)
