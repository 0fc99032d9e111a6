"""The per-layer widths' gradient on the pipeline stages (cluster/scoring.py) equals one process
(`oscar.recipe.widths.layer_copy_gradients`): on a real local Ray cluster with 2 stages, the (L, Hkv, O) table and the
chosen widths; `oscar fit --ray ADDR --stages 2` (default widths) writes the single-process recipe's artifact; a
log that lost its last windows is completed on the stages by computing exactly those.

Tolerance: 1e-5 relative to the table's largest entry (the stages run the same float32 forward and backward in the
same order, each summing its own layers' float64 products as one process does; only a GEMM's reduction order may
differ between processes, as for perplexity on the stages). Measured: equal to the last bit on both models."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from oscar.cluster.pipeline import ClusterConfig
from oscar.cluster.scoring import StagedScorer
from oscar.common import set_threads
from oscar.stats.fit import FitConfig, fit
from oscar.recipe.tune import TuneConfig
from oscar.recipe.widths import COPY_OPTIONS, copy_widths_artifact, layer_copy_gradients


pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.timeout(900)]
REL = 1e-5
CFG = TuneConfig(copy_windows=3, copy_length=512, copy_span=16)  # the widths' windows, shortened


def assert_close_tables(one: np.ndarray, two: np.ndarray) -> None:
    assert one.shape == two.shape and np.abs(one).max() > 0
    assert np.abs(one - two).max() <= REL * np.abs(one).max(), np.abs(one - two).max()


def staged(model: str, head, stages: int = 2) -> StagedScorer:
    """The stages as `oscar fit --ray` starts them: float64 (the tune's), the widths cast to their float32."""
    return StagedScorer(model, ClusterConfig(stages=stages, cpus_per_stage=1, dtype=TuneConfig().dtype),
                        address=head.address)


class Counting(StagedScorer):
    """The stages, counting the windows differentiated on them."""
    sent: list = []

    def copy_gradients(self, arts, options, cfg, windows):
        type(self).sent += [i for i, *_ in windows]
        return super().copy_gradients(arts, options, cfg, windows)


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-glm4-moe",
                                   pytest.param("smollm2-135m", marks=pytest.mark.full)])
def test_gradient_on_two_stages_equals_one_process(model, ray_head, stores, tmp_path):
    """Per layer, KV head and option the same window sums, so the same widths by the DP."""
    from oscar.validate.env import load_model

    fitted = fit(stores(model), FitConfig(variant="scaled", progress=False, threads=1))
    m, tok, _ = load_model(model)
    set_threads(1)  # each stage actor runs one thread
    one = layer_copy_gradients(m, tok, fitted, COPY_OPTIONS, CFG, progress=False, heads=True)  # (L, Hkv, O)
    art_one, err_one = copy_widths_artifact(m, tok, fitted, CFG, progress=False, estimate="gradient")
    with staged(model, ray_head) as sc:
        two = layer_copy_gradients(None, None, fitted, COPY_OPTIONS, CFG, progress=False, heads=True, scorer=sc)
        assert len(sc.ranges) == 2
        art_two, err_two = copy_widths_artifact(None, None, fitted, CFG, progress=False, estimate="gradient", scorer=sc)
        with pytest.raises(Exception, match="--widths copy measures each layer's probe in one process"):
            copy_widths_artifact(None, None, fitted, CFG, progress=False, estimate="probe", scorer=sc)
    assert_close_tables(one, two)
    assert_close_tables(err_one, err_two)
    assert art_one.meta["layer_widths"]["widths"] == art_two.meta["layer_widths"]["widths"]


def test_one_stage_holds_the_whole_model(ray_head, stores):
    """`--stages 1` (the default with --ray): the one stage embeds, differentiates and sums every layer."""
    from oscar.validate.env import load_model

    fitted = fit(stores("tiny-llama"), FitConfig(variant="scaled", progress=False, threads=1))
    m, tok, _ = load_model("tiny-llama")
    set_threads(1)
    cfg = TuneConfig(copy_windows=1, copy_length=512, copy_span=16)
    one = layer_copy_gradients(m, tok, fitted, COPY_OPTIONS, cfg, progress=False, heads=True)
    with staged("tiny-llama", ray_head, stages=1) as sc:
        assert [tuple(r) for r in sc.ranges] == [(0, fitted.num_layers)]
        assert_close_tables(one, layer_copy_gradients(None, None, fitted, COPY_OPTIONS, cfg, progress=False,
                                                      heads=True, scorer=sc))


def test_staged_run_completes_a_log(ray_head, stores, tmp_path):
    """A one-process log that lost its last windows: the stages compute exactly those and append them, and the
    table is the uninterrupted one; a staged log resumed on the stages is equal to the last bit. The stages score
    windows in their own dtype afterwards (the widths cast them to theirs and back)."""
    from oscar.validate.env import load_model

    fitted = fit(stores("tiny-llama"), FitConfig(variant="scaled", progress=False, threads=1))
    m, tok, _ = load_model("tiny-llama")
    set_threads(1)
    log = tmp_path / "gradients.jsonl"
    full = layer_copy_gradients(m, tok, fitted, COPY_OPTIONS, CFG, log=str(log), progress=False)
    lines = log.read_text().splitlines(True)
    log.write_text(lines[0])  # as if killed after the first window
    Counting.sent = []
    ids = torch.tensor([list(range(3, 259))])  # (1, 256)
    cc = ClusterConfig(stages=2, cpus_per_stage=1, dtype="float64")
    with Counting("tiny-llama", cc, address=ray_head.address) as sc:
        sc.load({"a": fitted})
        before = list(sc.score([("a", "strict", ids, ())]))
        got = layer_copy_gradients(None, None, fitted, COPY_OPTIONS, CFG, log=str(log), progress=False, scorer=sc)
        assert Counting.sent == [1, 2]
        again = log.read_text().splitlines(True)
        assert len(again) == 3 and again[0] == lines[0]
        assert [json.loads(x)["window"] for x in again] == [0, 1, 2]
        assert_close_tables(full, got)
        log.write_text("".join(again[:2]))
        Counting.sent = []
        assert np.array_equal(layer_copy_gradients(None, None, fitted, COPY_OPTIONS, CFG, log=str(log),
                                                   progress=False, scorer=sc), got)
        assert Counting.sent == [2] and log.read_text().splitlines(True) == again
        Counting.sent = []
        assert np.array_equal(layer_copy_gradients(None, None, fitted, COPY_OPTIONS, CFG, log=str(log),
                                                   progress=False, scorer=sc), got)
        assert Counting.sent == []  # nothing left to compute: the stages run no window
        sc.load({"a": fitted})
        assert list(sc.score([("a", "strict", ids, ())])) == before


def test_fit_on_two_stages_writes_the_one_process_artifact(ray_head, stores, tmp_path):
    """`oscar fit STORE --ray ADDR --stages 2` with the default widths: the same tuned clips, widths and tensors as
    `oscar fit STORE` in one process."""
    from oscar.__main__ import main
    from oscar.stats.artifact import load_artifact

    store = stores("tiny-llama")
    one, two = str(tmp_path / "one.safetensors"), str(tmp_path / "two.safetensors")
    set_threads(1)
    assert main(["fit", store, "--out", one, "--threads", "1", "--quiet", "--no-progress"]) == 0
    assert main(["fit", store, "--out", two, "--ray", ray_head.address, "--stages", "2", "--threads", "1", "--quiet",
                 "--no-progress"]) == 0
    a, b = load_artifact(one), load_artifact(two)
    assert a.meta["layer_widths"]["widths"] == b.meta["layer_widths"]["widths"]
    assert b.meta["clip_tuning"]["stages"] == 2 and a.meta["clip_tuning"]["chosen_factor"] == b.meta["clip_tuning"][
        "chosen_factor"]
    assert_close_tables(np.asarray(a.meta["layer_widths"]["copy_err"]), np.asarray(b.meta["layer_widths"]["copy_err"]))
    assert [a.quant_for(l) for l in range(a.num_layers)] == [b.quant_for(l) for l in range(b.num_layers)]
    for name in ("rot_k", "rot_v", "clip_k", "clip_v", "k_mean"):
        for x, y in zip(getattr(a, name), getattr(b, name)):
            assert torch.allclose(x.double(), y.double(), rtol=REL, atol=0), name
