"""One writer per output directory (oscar/dirlock.py): a second writer is refused in one line naming the holder,
before any work and writing nothing; a holder killed with -9 (flock dropped by the kernel) or on a lost node (its
lease expired) is taken over, said on stderr; the commands that write a directory take it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from oscar import dirlock
from oscar.common import OscarError
from oscar.dirlock import LOCK_NAME, DirLock, lock_file

HOLD = ("import sys, time; from oscar.dirlock import DirLock; "
        "DirLock(sys.argv[1], store=sys.argv[2] == 'store').acquire(); print('held', flush=True); time.sleep(120)")


@pytest.fixture()
def holder():
    """Start a live writer of a directory in another process (this host); killed at the end."""
    procs = []

    def start(d, store: bool = False) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", HOLD, str(d), "store" if store else "dir"], stdout=subprocess.PIPE,
                             text=True)
        procs.append(p)
        assert p.stdout.readline().strip() == "held"
        return p

    yield start
    for p in procs:
        p.kill()
        p.wait()


def _tree(d) -> dict:
    """Every file under d with its bytes (what a refused command must leave unchanged)."""
    out = {}
    for root, _, files in os.walk(d):
        for f in files:
            p = os.path.join(root, f)
            out[os.path.relpath(p, d)] = open(p, "rb").read()
    return out


def test_second_writer_refused_naming_the_holder(tmp_path, holder):
    d = tmp_path / "run"
    p = holder(d)
    before = _tree(d)
    for attempt in (lambda: DirLock(d).check_free(), lambda: DirLock(d).acquire()):
        t0 = time.time()
        with pytest.raises(OscarError) as e:
            attempt()
        assert time.time() - t0 < 1.0
        msg = str(e.value)
        assert "\n" not in msg and f"pid {p.pid} on {socket.gethostname()} since " in msg and f"(python -c {d} dir)" in msg
    assert _tree(d) == before  # the holder's record untouched, nothing added


def test_kill9_then_the_lock_is_taken_over(tmp_path, holder, capsys):
    d = tmp_path / "run"
    p = holder(d)
    p.kill()  # SIGKILL: the kernel drops the flock; the record stays behind
    p.wait()
    assert (d / LOCK_NAME).exists()
    with DirLock(d) as lk:
        assert json.loads((d / LOCK_NAME).read_text())["pid"] == os.getpid() == lk.rec["pid"]
    err = capsys.readouterr().err
    assert f"taking over the stale lock of directory {d} (its process is gone): pid {p.pid}" in err
    assert not (d / LOCK_NAME).exists()  # released: the directory holds what the command wrote, no lock


def _foreign(d, lease_in: float) -> dict:
    rec = {"host": "lost-node-7", "pid": 4242, "start": "1", "since": "2026-01-01T00:00:00Z",
           "command": "oscar run --out D", "lease_until": time.time() + lease_in}
    os.makedirs(d, exist_ok=True)
    (d / LOCK_NAME).write_text(json.dumps(rec))
    return rec


def test_other_host_holds_until_its_lease_expires(tmp_path, capsys):
    """Across hosts (a shared filesystem, where flock may not reach) the holder's lease decides: renewed, it holds;
    expired (its node was lost), it is taken over."""
    d = tmp_path / "run"
    _foreign(d, lease_in=30)
    with pytest.raises(OscarError, match=r"being written by pid 4242 on lost-node-7 since 2026-01-01T00:00:00Z "
                                         r"\(oscar run --out D\)"):
        DirLock(d).acquire()
    _foreign(d, lease_in=-1)
    with DirLock(d):
        pass
    assert "(its lease expired): pid 4242 on lost-node-7" in capsys.readouterr().err


def test_the_store_layer_locks_follow_the_lease(tmp_path, capsys):
    """The calibration store's per-layer lock of a driver on a lost node is taken over once its lease expired (a
    live one still refuses)."""
    from oscar.pipeline.store import WriterLock

    lk = tmp_path / "s.zarr.lock"
    lk.mkdir()
    rec = {"job": "old", "host": "lost-node-7", "pid": 4242, "since": "2026-01-01T00:00:00Z"}
    (lk / "layer-00000.json").write_text(json.dumps({**rec, "lease_until": time.time() + 30}))
    with pytest.raises(OscarError, match="being written by pid 4242 on lost-node-7"):
        WriterLock(tmp_path / "s.zarr", range(1)).acquire()
    (lk / "layer-00000.json").write_text(json.dumps({**rec, "lease_until": time.time() - 1}))
    with WriterLock(tmp_path / "s.zarr", range(1)) as w:
        assert len(w.owned) == 1
    assert "expired lease of pid 4242 on lost-node-7" in capsys.readouterr().err


def test_the_heartbeat_renews_the_lease(tmp_path):
    code = ("import sys, time; from oscar import dirlock; dirlock.LEASE_S = 0.4; "
            "dirlock.DirLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(30)")
    p = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        first = dirlock.read_record(tmp_path / LOCK_NAME)["lease_until"]
        time.sleep(0.6)
        assert dirlock.read_record(tmp_path / LOCK_NAME)["lease_until"] > first
    finally:
        p.kill()
        p.wait()


def test_same_process_shares_and_a_refusal_leaves_no_directory(tmp_path):
    d = tmp_path / "a" / "b"
    with DirLock(d):
        with DirLock(d):  # the main job's stages take the lock their job holds
            pass
        assert (d / LOCK_NAME).exists()  # still held by the outer one
    assert not (tmp_path / "a").exists()  # made by the lock, nothing written: removed with it
    assert lock_file(tmp_path / "s.zarr", store=True) == str(tmp_path / "s.zarr.lock" / "writer.lock")


def _main(capsys, *args):
    from oscar.__main__ import main

    t0 = time.time()
    rc = main(list(args))
    out = capsys.readouterr()
    return rc, out.err, time.time() - t0


@pytest.mark.parametrize("argv", [
    ["run", "--model", "tiny-llama", "--samples", "1", "--no-ray", "--out", "{d}"],
    ["validate", "niah", "--model", "tiny-llama", "--methods", "bf16", "--out", "{d}"],
    ["validate", "ppl", "--model", "tiny-llama", "--methods", "bf16", "--out", "{d}"],
])
def test_cli_second_writer_refused_first(tmp_path, holder, capsys, argv):
    d = tmp_path / "run"
    p = holder(d)
    before = _tree(d)
    rc, err, secs = _main(capsys, *[a.format(d=d) for a in argv])
    line = err.strip()
    assert rc == 2 and "\n" not in line and "Traceback" not in err, err
    assert f"is being written by pid {p.pid} on {socket.gethostname()}" in line and f"(python -c {d} dir)" in line
    assert secs < 1.0, secs  # refused before anything loads
    assert _tree(d) == before


def test_cli_calibrate_second_writer_refused(tmp_path, holder, capsys):
    store = tmp_path / "s.zarr"
    p = holder(store, store=True)
    rc, err, secs = _main(capsys, "calibrate", "--model", "tiny-llama", "--store", str(store), "--no-progress")
    assert rc == 2 and err.strip().startswith(f"oscar calibrate: error: calibration store {store} is being written "
                                              f"by pid {p.pid}") and "\n" not in err.strip(), err
    assert not store.exists() and secs < 1.0
    # the library call (a Ray job's driver, `oscar run`'s calibrate stage) refuses the same way
    from oscar.pipeline.calibrate import CalibConfig, calibrate

    with pytest.raises(OscarError, match=f"being written by pid {p.pid}"):
        calibrate(CalibConfig(model="tiny-llama", store=str(store), seq_len=64, sink=4, tokens=128), progress=False)
    assert not store.exists()


@pytest.mark.ray
@pytest.mark.slow
def test_second_writer_on_a_local_ray_cluster(tmp_path, holder, ray_head):
    """The Ray driver's calibration and the staged validation refuse a directory another process writes, before
    the store is made or any stage actor starts."""
    from oscar.cluster.pipeline import ClusterConfig, calibrate_on_ray
    from oscar.cluster.scoring import StagedScorer
    from oscar.pipeline.calibrate import CalibConfig
    from oscar.validate.ppl import PplConfig, run_ppl

    store = tmp_path / "s.zarr"
    p = holder(store, store=True)
    with pytest.raises(OscarError, match=f"calibration store {store} is being written by pid {p.pid}"):
        calibrate_on_ray(CalibConfig(model="tiny-llama", store=str(store), seq_len=48, sink=4, seqs_per_block=2,
                                     tokens=96, reservoir=8), ClusterConfig(stages=2), address=ray_head.address,
                         progress=False)
    assert not store.exists()

    out = tmp_path / "ppl"
    q = holder(out)
    before = _tree(out)
    with StagedScorer("tiny-llama", ClusterConfig(stages=2), address=ray_head.address) as sc:
        with pytest.raises(OscarError, match=f"output directory {out} is being written by pid {q.pid}"):
            run_ppl(PplConfig(out=str(out), model="tiny-llama", methods=["bf16"], contexts=[128], tokens=128),
                    progress=False, scorer=sc)
        assert not sc.actors  # refused before any stage actor started
    assert _tree(out) == before
