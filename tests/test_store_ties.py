"""One recipe from stores of one model calibrated through different kernel paths.

Two stores of tiny-llama from the same tokens, one through the native CPU kernels (attention and moments) and one
through torch's (`OSCAR_NATIVE=0`), each made into oscar-int2's artifact as `oscar fit` makes it (the fit, the clip tune,
the per-layer widths to first order) on this host's kernels. The stores differ at float32 rounding, the INT2 codes of the tune's window flip between
their artifacts, and the objectives move: without ties the tune's argmin differed (x1.1 against x1.3 here). With
differences inside the spread measured between such stores counted as ties, broken by the smaller change
(oscar.common.STORE_TIE_REL, STORE_TIE_TABLE), both stores give the same factor and the same widths.
"""

import os
import subprocess
import sys

import pytest

import numpy as np

from oscar.common import STORE_TIE_REL, STORE_TIE_TABLE, narrower_on_ties, set_threads, smallest_change
from oscar.stats.fit import FitConfig, fit
from oscar.recipe.tune import TuneConfig, tune_key_clip
from oscar.validate.env import load_model
from oscar.recipe.widths import copy_widths_artifact


def test_ties_go_to_the_smaller_change():
    # the tune: an AVX2-only host's NLLs, x1.1 and x1.2 0.05 % apart (a tie: x1.1, nearer x1.0), x1.0 1.3 % behind
    assert smallest_change([1.0, 1.1, 1.2, 1.3], [2.835032, 2.797703, 2.796350, 2.855451]) == 1
    assert smallest_change([1.0, 1.1, 1.2], [2.80, 2.79, 2.78]) == 0  # 0.72 %: all tie, x1.0 is no change
    assert smallest_change([0.8, 1.1, 1.2], [2.8, 2.8, 2.7]) == 2  # beyond the band the best wins
    assert smallest_change([0.9, 1.1], [2.8, 2.8]) == 1 and smallest_change([0.9, 1.1], [2.8, 2.8], neutral=0.95) == 0
    # the widths: a wider option counts only where it beats each narrower one by more than 4 % of the largest |entry|
    assert STORE_TIE_TABLE == 0.04
    t = np.array([[0.0, -0.01, -0.012], [0.0, -0.5, -0.9], [0.0, 0.01, -0.03], [0.0, -0.04, -0.05]])
    assert narrower_on_ties(t).tolist() == [[0, 0, 0], [0, -0.5, -0.9], [0, 0, 0], [0, -0.04, -0.04]]
    # no band: a wider option worse than a narrower one reads as that one (the DP never pays for it)
    assert narrower_on_ties(t, rel=0).tolist() == [[0, -0.01, -0.012], [0, -0.5, -0.9], [0, 0, -0.03], [0, -0.04, -0.05]]


def _store(tmp_path, name: str, env: dict) -> str:
    store = str(tmp_path / f"{name}.zarr")
    r = subprocess.run([sys.executable, "-m", "oscar", "calibrate", "--model", "tiny-llama", "--store", store, "--tokens",
                        "4096", "--seq-len", "1024", "--threads", "1", "--no-progress"],
                       env={**os.environ, "OMP_NUM_THREADS": "1", **env}, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return store


def _recipe(store: str, model) -> dict:
    """The recipe `oscar fit` ships (fit, tune, widths to first order), on smaller windows."""
    m, tok = model
    fitted = fit(store, FitConfig(variant="scaled", progress=False, threads=1))
    tuned, rec = tune_key_clip(m, tok, fitted, TuneConfig(tokens=1024), progress=False)
    art, err = copy_widths_artifact(m, tok, tuned, TuneConfig(copy_windows=2, copy_length=1024), progress=False,
                                    estimate="gradient")
    return {"nll": rec["nll_per_token"], "factor": rec["chosen_factor"], "err": err,
            "widths": art.meta["layer_widths"]["widths"]}


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_two_kernel_paths_give_one_recipe(tmp_path):
    a_store = _store(tmp_path, "native", {"OSCAR_NATIVE": "force"})
    b_store = _store(tmp_path, "torch", {"OSCAR_NATIVE": "0"})
    m, tok, _ = load_model("tiny-llama")
    set_threads(1)
    a, b = _recipe(a_store, (m, tok)), _recipe(b_store, (m, tok))
    assert a["nll"] != b["nll"]  # the stores differ, and so do the objectives read through their artifacts
    plain = [min(r["nll"], key=lambda f: (r["nll"][f], float(f))) for r in (a, b)]
    print(f"tune NLL per token: native store {a['nll']}, torch store {b['nll']}; argmin without ties x{plain[0]} / "
          f"x{plain[1]}; chosen x{a['factor']} / x{b['factor']}")
    assert a["factor"] == b["factor"]
    assert a["widths"] == b["widths"], (a["err"], b["err"])
    # the chosen factor is the tie rule's on the recorded objectives
    fs = sorted(a["nll"], key=float)
    assert float(fs[smallest_change([float(f) for f in fs], [a["nll"][f] for f in fs], STORE_TIE_REL)]) == a["factor"]
