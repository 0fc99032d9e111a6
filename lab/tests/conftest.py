"""Fixtures of the lab's tests (lab/ is outside the package and CI: run `python -m pytest lab/tests`)."""

import pytest


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory) -> str:
    """A real calibration store of the tiny-llama preset (4 sequences of 96 pydoc tokens, reservoirs of 32 rows),
    as tests/conftest.py builds it. Treat it as read-only."""
    from oscar.pipeline.calibrate import CalibConfig, calibrate

    store = str(tmp_path_factory.mktemp("tiny_store") / "s.zarr")
    calibrate(CalibConfig(model="tiny-llama", corpus="pydoc", store=store, seq_len=96, sink=4, seqs_per_block=2,
                          tokens=4 * 96, reservoir=32, seed=1, threads=1), progress=False)
    return store
