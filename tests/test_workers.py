"""NIAH batches and perplexity windows on worker processes (validate/workers.py) compute what the
in-process path computes: real SmolLM2 in float32, real spawned workers, one intra-op thread on both sides."""

import json
import os

import pytest
import torch

from oscar.common import OscarError
from oscar.validate.niah import NiahConfig, run_niah
from oscar.validate.ppl import PplConfig, run_ppl
from oscar.validate.workers import Workers, default_workers

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    from oscar.validate.env import load_model

    torch.set_num_threads(1)  # the in-process reference runs one thread, as each worker does
    return load_model("smollm2-135m")


def _lines(path):
    return [json.loads(l) for l in open(path)]


def test_niah_workers_equal_in_process(smollm2, tmp_path):
    """Two tasks (noise haystack: prefix reuse in each worker's pool; corpus haystack), 3 samples each, one
    sample per batch, three methods: every prediction identical (float32; only the prefill pools' split
    points differ, i.e. summation order)."""
    kw = dict(methods=["bf16", "naive-int2", "kivi2"], tasks=["niah_single_1", "niah_single_2"], lengths=[400],
              samples=3, batch_tokens=400)
    a = run_niah(NiahConfig(out=str(tmp_path / "a"), **kw), loaded=smollm2, progress=False, workers=1)
    b = run_niah(NiahConfig(out=str(tmp_path / "b"), **kw), loaded=smollm2, progress=False, workers=2)
    key = lambda r: (r["task"], r["length"], r["index"], r["method"])  # noqa: E731
    ra = {key(r): r["pred"] for r in _lines(tmp_path / "a" / "niah_samples.jsonl")}
    rb = {key(r): r["pred"] for r in _lines(tmp_path / "b" / "niah_samples.jsonl")}
    assert len(ra) == 18 and ra == rb
    assert a.sort_values(["task", "method"]).score.tolist() == b.sort_values(["task", "method"]).score.tolist()


@pytest.mark.full
def test_ppl_workers_bit_identical(smollm2, tmp_path):
    """Windows are independent: the NLL of every window (and of its 256-token prefix window) is the same
    float whether a worker or this process scored it."""
    kw = dict(methods=["bf16", "naive-int2", "kivi2"], contexts=[256, 512], tokens=1024, protocols=["strict", "serving"])
    run_ppl(PplConfig(out=str(tmp_path / "a"), **kw), loaded=smollm2, progress=False, workers=1)
    run_ppl(PplConfig(out=str(tmp_path / "b"), **kw), loaded=smollm2, progress=False, workers=2)
    key = lambda r: (r["method"], r["protocol"], r["context"], r["window"])  # noqa: E731
    ra = {key(r): (r["nll"], r["seg"]) for r in _lines(tmp_path / "a" / "ppl_windows.jsonl")}
    rb = {key(r): (r["nll"], r["seg"]) for r in _lines(tmp_path / "b" / "ppl_windows.jsonl")}
    assert len(ra) == 5 * (4 + 2) and ra == rb  # bf16 once + 2 methods x 2 protocols; 4 + 2 windows each


def test_worker_error_is_reported():
    """The model file goes once every worker holds its copy; a unit that raises in a worker surfaces as an
    OscarError carrying the worker's traceback."""
    from oscar.validate.ppl import _ppl_unit

    with Workers(1, torch.nn.Linear(2, 2)) as W:  # no init: the state holds only the model
        model_file = os.path.join(W._dir.name, "model.pt")
        assert os.path.exists(model_file)
        assert [r for _, r in W.map(dict.get, ["absent"])] == [None]  # state.get("absent")
        assert not os.path.exists(model_file)  # every worker holds its copy: the file is gone before close
        with pytest.raises(OscarError, match="validation worker failed(.|\n)*KeyError: 'arts'"):
            list(W.map(_ppl_unit, [(("bf16", "-", 4, 0), ())]))
    with pytest.raises(OscarError, match="workers must be >= 1"):
        Workers(0, torch.nn.Linear(2, 2))


def test_default_workers(monkeypatch):
    monkeypatch.delenv("OSCAR_WORKERS", raising=False)
    assert default_workers(1) == 1  # one unit: no process to start
    assert 1 <= default_workers(100) <= 4
    monkeypatch.setenv("OSCAR_WORKERS", "1")
    assert default_workers(100) == 1


def test_workers_die_with_a_killed_parent(tmp_path):
    """A parent killed by SIGKILL inside a long unit leaves no worker behind (PR_SET_PDEATHSIG)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    if not sys.platform.startswith("linux"):
        pytest.skip("parent-death signal is Linux-only")
    pids = tmp_path / "pids"
    (tmp_path / "slow_unit.py").write_text(  # a module: spawned workers unpickle the unit by name
        f"import os, time\ndef unit(st, arg):\n    open({str(pids)!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
        "    time.sleep(120)\n")
    script = ("import sys, torch; sys.path.insert(0, sys.argv[1]); from slow_unit import unit\n"
              "from oscar.validate.workers import Workers\n"
              "with Workers(2, torch.nn.Linear(2, 2)) as W:\n    list(W.map(unit, [0, 1]))\n")
    p = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)])
    deadline = time.time() + 120
    while time.time() < deadline and (not pids.exists() or len(pids.read_text().split()) < 2):
        time.sleep(0.5)
    workers = [int(x) for x in pids.read_text().split()]
    assert len(workers) == 2
    p.send_signal(signal.SIGKILL)
    p.wait()

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        try:  # a zombie (already dead, not yet reaped by init) counts as gone
            return open(f"/proc/{pid}/stat").read().split()[2] != "Z"
        except OSError:
            return False

    deadline = time.time() + 30
    while time.time() < deadline and any(alive(w) for w in workers):
        time.sleep(0.5)
    assert not any(alive(w) for w in workers), "workers outlived their killed parent"
