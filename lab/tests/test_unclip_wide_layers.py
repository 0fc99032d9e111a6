"""lab/unclip_wide_layers.py: key clip 1 exactly where a widths file widens keys."""

import pytest
import torch


@pytest.fixture(scope="module")
def fitted(tiny_store):
    from oscar.stats.fit import FitConfig, fit

    art = fit(tiny_store, FitConfig(variant="scaled", progress=False, threads=1))
    art.meta["clip_tuning"] = {"chosen_factor": 1.2}
    return art


def test_unclip_artifact_switches_off_the_key_clip_in_the_wide_layers_only(fitted, tmp_path):
    """lab/unclip_wide_layers.py (the clip confound of per-layer widths): key clip 1 exactly where the widths file
    widens keys; rotations, value clips and the other layers' key clips as they were; a widths file of another
    layer count is refused."""
    import importlib.util
    import json
    from pathlib import Path

    from oscar.stats.artifact import load_artifact, save_artifact

    spec = importlib.util.spec_from_file_location("_unclip", Path(__file__).parents[1] / "unclip_wide_layers.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    src, out, w = tmp_path / "a.safetensors", tmp_path / "u.safetensors", tmp_path / "w.json"
    save_artifact(fitted, str(src))
    base = load_artifact(str(src))
    L, b = base.num_layers, base.quant.bits
    wide = [L - 1]
    widths = [[b + 1 if l in wide else b, b] for l in range(L)]
    w.write_text(json.dumps({"oscar-layer-int2": {"widths": widths}}))
    assert mod.main(["--artifact", str(src), "--widths", str(w), "--out", str(out)]) == 0
    got = load_artifact(str(out))
    assert got.meta["unclipped_key_layers"] == wide
    for l in range(L):
        want = torch.ones_like(base.clip_k[l]) if l in wide else base.clip_k[l]
        assert torch.equal(got.clip_k[l], want)
        assert torch.equal(got.clip_v[l], base.clip_v[l]) and torch.equal(got.rot_k[l], base.rot_k[l])
    assert any(not torch.equal(base.clip_k[l], torch.ones_like(base.clip_k[l])) for l in wide)  # the test can fail
    w.write_text(json.dumps({"oscar-layer-int2": {"widths": widths[:-1]}}))
    with pytest.raises(SystemExit, match="layers"):
        mod.main(["--artifact", str(src), "--widths", str(w), "--out", str(out)])
