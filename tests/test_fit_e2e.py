"""End to end: a real (tiny, random-init) model calibrated by the pipeline, then fitted."""

import pytest


@pytest.mark.slow
def test_calibrate_tiny_preset_then_fit(tmp_path):
    from oscar.pipeline.calibrate import CalibConfig, calibrate
    from oscar.pipeline.models import load_config
    from oscar.stats.artifact import load_artifact, save_artifact
    from oscar.stats.fit import FitConfig, fit

    store = str(tmp_path / "s.zarr")
    r = calibrate(CalibConfig(model="tiny-llama", corpus="pydoc", store=store, seq_len=48, sink=4, seqs_per_block=2,
                              tokens=4 * 48, reservoir=32, seed=1, threads=1), progress=False)
    assert r.blocks_total == 2
    art = fit(store, FitConfig(variant="centered", progress=False, threads=1))
    out = str(tmp_path / "a.safetensors")
    save_artifact(art, out)
    back = load_artifact(out)
    back.check_model(load_config("tiny-llama"))  # shapes and fingerprint recorded from the store
    assert back.meta["provenance"]["blocks"] == [0, 1] and back.meta["provenance"]["tokens"] == 4 * 48
    assert back.k_mean is not None and back.num_layers == 4
