"""`oscar calibrate` end to end: real presets and SmolLM2 against the brute force, kill -9 + resume, bad input."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from oscar.common import OscarError
from oscar.pipeline.calibrate import CalibConfig, calibrate, store_offsets, window_offsets
from oscar.pipeline.store import XS, CalibStore, reduce
from helpers import capture_reference as ref


def check_store_against_reference(path, model_spec, *, softmax_dtype=torch.float64, blocks=None):
    """Every array of every done block equals the brute force on the store's own tokens."""
    from oscar.pipeline.models import load_model

    st = CalibStore(path)
    m = st.meta
    model, _, _ = load_model(model_spec, attn_implementation="sdpa", dtype=torch.float64)
    tokens, mask = st.array("tokens")[:], st.array("mask")[:]
    offsets = store_offsets(m)
    assert st.done().all()
    for b in (range(m.num_blocks) if blocks is None else blocks):
        keep = mask[b].any(1)                      # trailing all-padding sequences are never run
        want = ref.block_reference(model, torch.from_numpy(tokens[b][keep]).long(),
                                   torch.from_numpy(mask[b][keep]).long(), layers=range(st.num_layers), sink=m.sink,
                                   reservoir=m.reservoir, seed=m.config["seed"], block=b,
                                   softmax_dtype=softmax_dtype, check_identity=(b == 0),
                                   seqs_per_block=m.seqs_per_block, offsets=offsets[b][keep])
        for l, w in want.items():
            got = {n: st.array(f"layers/{l}/{n}")[b] for n in st.spec}
            bad = ref.compare(got, w)
            assert not bad, f"{model_spec} block {b} layer {l}: {bad}"
    return st


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3", "tiny-glm4-moe"])
def test_presets_match_bruteforce(tmp_path, preset):
    cfg = CalibConfig(model=preset, corpus="pydoc", store=str(tmp_path / "s.zarr"), seq_len=20, sink=3,
                      seqs_per_block=3, tokens=100, batch_size=2, reservoir=4, seed=5, dtype="float64", threads=1)
    r = calibrate(cfg, progress=False)
    assert r.blocks_run == 2 and r.tokens_run == 100 and r.blocks_redone == []
    st = check_store_against_reference(cfg.store, preset)
    assert st.meta.corpus["name"] == "pydoc" and "sha256" in st.meta.corpus["split"]
    # q/o rows pool the GQA group; padding and sink excluded: 100 tokens = 5 seqs of 20 (sink 3 each)
    total = sum(int(v) for v in reduce(st, "kv_count", [0]).values())
    assert total == 5 * (20 - 3)
    assert int(reduce(st, "q_count", [0])[0]) == total * st.meta.model["num_q_heads"] // st.H


def test_window_offsets():
    assert window_offsets(None, 2048, 3).tolist() == [0, 0, 0]
    assert window_offsets(2048, 2048, 2).tolist() == [0, 0]
    assert window_offsets(8192, 2048, 6).tolist() == [0, 2048, 4096, 6144, 0, 2048]
    assert window_offsets(5000, 2048, 4).tolist() == [0, 2048, 2952, 0]  # the last slot ends at `positions`
    with pytest.raises(OscarError, match="--positions 100 must be at least --seq-len 128"):
        CalibConfig(seq_len=128, positions=100)


def test_positions_past_the_model_are_refused(tmp_path):
    cfg = CalibConfig(model="smollm2-135m", store=str(tmp_path / "s.zarr"), seq_len=128, positions=8193, tokens=128)
    with pytest.raises(OscarError, match=r"--positions 8193 is past model 'smollm2-135m'.s max_position_embeddings \(8192\)"):
        calibrate(cfg, progress=False)
    assert not (tmp_path / "s.zarr").exists()  # refused before anything is written


@pytest.mark.slow
def test_positions_store_matches_bruteforce(tmp_path):
    """Windows read at offsets (`--positions`): every array equals the brute force with explicit RoPE at those
    positions; the attention outputs equal those of the unshifted store (RoPE is relative, the model computes
    the same) while the post-RoPE keys do not; the artifact records the positions covered."""
    from oscar.stats.artifact import beyond_calibration, calibrated_length, describe, save_artifact
    from oscar.stats.fit import FitConfig, fit

    kw = dict(model="tiny-llama", corpus="pydoc", seq_len=20, sink=3, seqs_per_block=3, tokens=120, batch_size=2,
              reservoir=4, seed=5, dtype="float64", threads=1)
    shifted = CalibConfig(store=str(tmp_path / "p.zarr"), positions=50, **kw)
    plain = CalibConfig(store=str(tmp_path / "s.zarr"), **kw)
    assert calibrate(shifted, progress=False).tokens_run == 120
    calibrate(plain, progress=False)
    st = check_store_against_reference(shifted.store, "tiny-llama")
    assert st.meta.config["positions"] == 50 and "positions" not in CalibStore(plain.store).meta.config
    a, b = CalibStore(shifted.store), CalibStore(plain.store)
    for l in range(st.num_layers):
        o1, o0 = a.array(f"layers/{l}/o_gram")[:], b.array(f"layers/{l}/o_gram")[:]
        k1, k0 = a.array(f"layers/{l}/k_gram")[:], b.array(f"layers/{l}/k_gram")[:]
        assert ref.rel_err(o1, o0) < 1e-6, l  # the model's RoPE angles are float32: ~3e-8 measured
        assert ref.rel_err(k1, k0) > 1e-3, l
    art = fit(shifted.store, FitConfig(variant="oscar", progress=False))
    assert art.meta["provenance"]["seq_len"] == 20 and calibrated_length(art) == 50
    assert beyond_calibration(art, 50) is None and "--positions 51" in beyond_calibration(art, 51)
    save_artifact(art, str(tmp_path / "a.safetensors"))
    assert "in sequences of 20 read at positions up to 50 (serve contexts up to 50)" in describe(str(tmp_path / "a.safetensors"))


@pytest.mark.slow
def test_smollm2_matches_bruteforce(tmp_path):
    cfg = CalibConfig(model="smollm2-135m", corpus="pydoc", store=str(tmp_path / "s.zarr"), seq_len=16, sink=4,
                      seqs_per_block=2, tokens=32, batch_size=1, reservoir=3, dtype="float64", threads=1)
    r = calibrate(cfg, progress=False)
    assert r.blocks_run == 1 and r.tokens_run == 32
    check_store_against_reference(cfg.store, "smollm2-135m")


def _oscar(*args, timeout=300, **kw):
    return subprocess.run([sys.executable, "-m", "oscar", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OSCAR_THREADS": "1"}, **kw)


CAL = ["calibrate", "--model", "tiny-llama", "--corpus", "pydoc", "--seq-len", "64", "--sink", "4",
       "--seqs-per-block", "2", "--tokens", "2560", "--reservoir", "8", "--no-progress"]


@pytest.mark.slow
def test_kill9_then_resume_is_bit_identical(tmp_path):
    ref_store, store = tmp_path / "ref.zarr", tmp_path / "s.zarr"
    done = _oscar(*CAL, "--store", str(ref_store))
    assert done.returncode == 0, done.stderr
    nb, L = CalibStore(ref_store).num_blocks, CalibStore(ref_store).num_layers
    assert nb == 20

    p = subprocess.Popen([sys.executable, "-m", "oscar", *CAL, "--store", str(store)], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, env={**os.environ, "OSCAR_THREADS": "1"})
    marker = store / "done" / "c" / "0" / str(L - 1)   # block 0 committed (its last layer's marker is last)
    t0 = time.time()
    while not marker.exists():
        assert p.poll() is None, p.stderr.read().decode()
        assert time.time() - t0 < 240, "no block committed in time"
        time.sleep(0.005)
    time.sleep(0.05)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    st = CalibStore(store)
    n_done = int(st.done().all(1).sum())
    assert 1 <= n_done < nb, n_done                 # killed mid-run
    lock = Path(str(store) + ".lock")
    assert lock.exists()                            # the dead writer's locks are left behind

    again = _oscar(*CAL, "--store", str(store), "--json")
    assert again.returncode == 0, again.stderr
    assert "taking over stale lock" in again.stderr
    assert CalibStore(store).done().all()
    for stat in [f"{x}_{s}" for x in XS for s in ("gram", "sum", "m3", "m4", "absmax", "res")] + \
            ["vw_gram", "w_sum", "q_count", "kv_count", "nonfinite", "res_count", "qo_res_count"]:
        a, b = reduce(store, stat), reduce(ref_store, stat)
        for l in a:
            assert a[l].dtype == b[l].dtype and np.array_equal(a[l], b[l]), (stat, l)
    # every per-block chunk too, not only the sums
    ra, rb = CalibStore(store), CalibStore(ref_store)
    for l in range(ra.num_layers):
        for n in ra.spec:
            assert np.array_equal(ra.array(f"layers/{l}/{n}")[:], rb.array(f"layers/{l}/{n}")[:]), (l, n)
    # a third run has nothing left to do
    third = _oscar(*CAL, "--store", str(store))
    assert third.returncode == 0 and "0 this run" in third.stdout


def _main(capsys, *args) -> tuple[int, str, str]:
    """The `oscar` CLI in this process (argparse, handler, OscarError -> exit 2)."""
    from oscar.__main__ import main

    rc = main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.slow
def test_cli_refuses_mismatched_store(tmp_path, capsys):
    store = tmp_path / "s.zarr"
    small = ["--seq-len", "32", "--sink", "2", "--seqs-per-block", "2", "--tokens", "128", "--reservoir", "2",
             "--no-progress", "--threads", "1", "--store", str(store)]
    rc, _, err = _main(capsys, "calibrate", "--model", "tiny-llama", *small)
    assert rc == 0, err
    before = CalibStore(store).array("layers/0/q_gram")[:]
    r = _oscar("calibrate", "--model", "tiny-qwen3", *small)   # a real process: exit status and message
    assert r.returncode == 2 and "was made with --model tiny-llama, not --model tiny-qwen3" in r.stderr
    assert r.stderr.index(f"oscar calibrate --store {store}") < r.stderr.index("--overwrite")
    assert "Traceback" not in r.stderr
    corpus = tmp_path / "other.txt"
    corpus.write_text("Another corpus entirely. " * 200)
    rc, _, err = _main(capsys, "calibrate", "--model", "tiny-llama", "--corpus", str(corpus), *small)
    assert rc == 2 and f"was made with --corpus pydoc, not --corpus {corpus}" in err
    rc, _, err = _main(capsys, "calibrate", "--model", "tiny-llama", "--seed", "1", *small)
    assert rc == 2 and "was made with --seed 0, not --seed 1" in err
    rc, _, err = _main(capsys, "calibrate", "--model", "tiny-llama", "--seq-len", "32", "--sink", "3", *small[4:])
    assert rc == 2 and "was made with --sink 2, not --sink 3" in err
    assert np.array_equal(CalibStore(store).array("layers/0/q_gram")[:], before)   # nothing lost
    rc, _, err = _main(capsys, "calibrate", "--model", "tiny-llama", "--seed", "1", "--overwrite", *small)
    assert rc == 0 and CalibStore(store).meta.config["seed"] == 1


def test_bad_inputs(tmp_path):
    with pytest.raises(OscarError, match="must be larger than --sink"):
        CalibConfig(seq_len=64, sink=64)
    with pytest.raises(OscarError, match="must be larger than --sink"):
        CalibConfig(seq_len=8, sink=100)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n   \n")
    with pytest.raises(OscarError, match="empty"):
        calibrate(CalibConfig(model="tiny-llama", corpus=str(empty), store=str(tmp_path / "e.zarr"), seq_len=16,
                              sink=2), progress=False)
    with pytest.raises(OscarError):
        calibrate(CalibConfig(model=str(tmp_path / "no-such-model"), corpus="pydoc", store=str(tmp_path / "m.zarr"),
                              seq_len=16, sink=2), progress=False)
    assert not (tmp_path / "e.zarr").exists() and not (tmp_path / "m.zarr").exists()


def test_cli_bad_inputs(tmp_path, capsys):
    rc, _, err = _main(capsys, "calibrate", "--seq-len", "32", "--sink", "32", "--store", str(tmp_path / "a.zarr"))
    assert rc == 2 and "must be larger than --sink" in err
    for bad in (tmp_path / "no-such-model", tmp_path / "broken.gguf"):
        if bad.suffix == ".gguf":
            bad.write_bytes(b"not a gguf file at all")
        rc, _, err = _main(capsys, "calibrate", "--model", str(bad), "--seq-len", "32", "--sink", "2",
                           "--store", str(tmp_path / "b.zarr"))
        assert rc == 2 and str(bad) in err, err
    assert not (tmp_path / "a.zarr").exists() and not (tmp_path / "b.zarr").exists()
