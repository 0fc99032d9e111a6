"""Fixtures shared by several test modules."""

import os

import pytest
import torch

# The native kernels run wherever they build, measured faster than torch on this host or not: their results are
# under test everywhere (a test of the host's measured choice sets OSCAR_NATIVE itself; tests/test_native.py).
os.environ.setdefault("OSCAR_NATIVE", "force")
# Triton runs under its interpreter where there is no GPU, as scripts/test.sh sets it: here, before any test module
# imports a kernel module (Triton reads it when a kernel is defined), so `pytest tests/x.py` runs as the suite does.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory) -> str:
    """A real calibration store of the tiny-llama preset (4 sequences of 96 pydoc tokens, reservoirs of 32 rows):
    what the codebook, split-key and per-layer width tests fit their artifacts from. Treat it as read-only."""
    from oscar.pipeline.calibrate import CalibConfig, calibrate

    store = str(tmp_path_factory.mktemp("tiny_store") / "s.zarr")
    calibrate(CalibConfig(model="tiny-llama", corpus="pydoc", store=store, seq_len=96, sink=4, seqs_per_block=2,
                          tokens=4 * 96, reservoir=32, seed=1, threads=1), progress=False)
    return store


@pytest.fixture(scope="session")
def stores(tiny_store, tmp_path_factory):
    """A small calibration store per model (tiny-llama: the shared one): what the tests of the pipeline stages
    fit from."""
    from oscar.pipeline.calibrate import CalibConfig, calibrate

    made = {"tiny-llama": tiny_store}

    def get(model: str) -> str:
        if model not in made:
            made[model] = str(tmp_path_factory.mktemp("store") / "s.zarr")
            calibrate(CalibConfig(model=model, corpus="pydoc", store=made[model], seq_len=96, sink=4, seqs_per_block=2,
                                  tokens=4 * 96, reservoir=32, seed=1, threads=1), progress=False)
        return made[model]
    return get


@pytest.fixture(scope="module")
def ray_head():
    """A private loopback-only Ray head for one test module (tests/helpers/cluster.py), this process its driver."""
    from helpers.cluster import attached_head

    with attached_head(num_cpus=4) as h:
        yield h


@pytest.fixture(scope="session")
def scaled_artifact(tiny_store, tmp_path_factory) -> str:
    """The `scaled` fit of `tiny_store`, saved: the oscar-int2 artifact of the pipeline stages' tests."""
    from oscar.stats.artifact import save_artifact
    from oscar.stats.fit import FitConfig, fit

    path = str(tmp_path_factory.mktemp("art") / "a.safetensors")
    save_artifact(fit(tiny_store, FitConfig(variant="scaled", progress=False, threads=1)), path)
    return path


@pytest.fixture(scope="session")
def synthetic_store():
    """tests/helpers/synthetic_store.py as a module."""
    from helpers import synthetic_store

    return synthetic_store
