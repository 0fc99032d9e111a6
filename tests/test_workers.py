"""NIAH batches and perplexity windows on worker processes (validate/workers.py) compute what the
in-process path computes: real SmolLM2 in float32, real spawned workers, one intra-op thread on both sides."""

import json

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
    """A unit that raises in a worker surfaces as an OscarError carrying the worker's traceback."""
    from oscar.validate.ppl import _ppl_unit

    with Workers(1, torch.nn.Linear(2, 2)) as W:  # no init: the state holds only the model
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
