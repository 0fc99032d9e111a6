"""docs/serving.md: its snippets run exactly as written (real SmolLM2, a real scaled artifact fitted here), and
the statements around them hold (attention switched, DynamicCache fallback, window bytes in the model dtype)."""

from __future__ import annotations

import contextlib
import io
import os
import re

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def snippets() -> dict[str, str]:
    text = open(os.path.join(ROOT, "docs", "serving.md")).read()
    found = dict(re.findall(r"<!-- snippet: ([\w-]+) \(run by tests/test_serving_doc.py\) -->\n```python\n(.*?)```",
                            text, re.S))
    assert set(found) == {"quickstart", "plain-transformers"}, sorted(found)
    return found


@pytest.fixture(scope="module")
def served_dir(tmp_path_factory):
    """A directory holding runs/demo/artifact.safetensors: the main job's recipe (scaled keys, key mean, searched
    clips) fitted on a small real SmolLM2 calibration."""
    from oscar.pipeline.calibrate import CalibConfig, calibrate
    from oscar.stats.artifact import save_artifact
    from oscar.stats.fit import FitConfig, fit

    d = tmp_path_factory.mktemp("serve")
    store = str(d / "calib.zarr")
    calibrate(CalibConfig(model="smollm2-135m", store=store, seq_len=512, seqs_per_block=2, tokens=2048, reservoir=64,
                          threads=2), progress=False)
    art = fit(store, FitConfig(variant="scaled", progress=False, threads=2))
    assert art.rot_q is not None and art.k_mean is not None
    os.makedirs(d / "runs" / "demo")
    save_artifact(art, str(d / "runs" / "demo" / "artifact.safetensors"))
    return d


def run_snippet(code: str, cwd) -> tuple[dict, str]:
    ns: dict = {"__name__": "__doc_snippet__"}
    buf = io.StringIO()
    old = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(buf):
            exec(compile(code, "docs/serving.md", "exec"), ns)
    finally:
        os.chdir(old)
    return ns, buf.getvalue()


def test_quickstart_runs_as_written(served_dir):
    import torch
    from transformers import DynamicCache

    from oscar.host import compute_dtype
    from oscar.kernels.cache import OscarCache

    ns, out = run_snippet(snippets()["quickstart"], served_dir)
    model, cache, ids, gen = ns["model"], ns["cache"], ns["ids"], ns["out"]
    assert isinstance(cache, OscarCache) and gen.shape[1] > ids.shape[1]  # it decoded new tokens
    assert ids.shape[1] > cache.quant.sink + cache.quant.recent  # the history really went through INT2 pages
    assert model.config._attn_implementation == "oscar"  # what from_artifact changes
    mem = cache.memory()
    assert mem["codes"] > 0 and str(mem["codes"]) in out
    # the windows cost (sink + recent) x 2 x layers x KV heads x head_dim x bytes of the model's dtype
    c = model.config
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads)
    dtype = next(model.parameters()).dtype
    assert dtype == getattr(torch, compute_dtype("auto"))  # "auto" as written: this host's fast dtype
    elem = torch.tensor([], dtype=dtype).element_size()
    q = cache.quant
    window, rem = divmod(mem["sinks"] + mem["recent"], per_token * elem)
    assert rem == 0 and mem["sinks"] == q.sink * per_token * elem
    assert q.sink + q.recent <= window < q.sink + q.recent + q.page_size  # tokens leave the window in whole pages
    lo, hi = (q.sink + q.recent) * per_token * elem / 2**20, (q.sink + q.recent + q.page_size - 1) * per_token * elem / 2**20
    # the doc's table: 7.03-7.36 MiB in bfloat16, 14.06-14.72 MiB in float32
    assert (round(lo, 2), round(hi, 2)) == {2: (7.03, 7.36), 4: (14.06, 14.72)}[elem]
    # the same model still generates with a DynamicCache (SDPA fallback), exactly as before the switch
    short = ids[:, :40]
    a = model.generate(short, cache=DynamicCache(config=model.config), max_new_tokens=4, do_sample=False)
    model.set_attn_implementation("sdpa")
    b = model.generate(short, max_new_tokens=4, do_sample=False)
    assert torch.equal(a, b)


def test_plain_transformers_snippet_runs_as_written(served_dir):
    ns, out = run_snippet(snippets()["plain-transformers"], served_dir)
    assert ns["out"].shape[1] == ns["ids"].shape[1] + 8 and out.strip()
    assert ns["model"].config._attn_implementation == "oscar"


def test_from_artifact_refuses_another_models_artifact(served_dir):
    from oscar.common import OscarError
    from oscar.kernels.cache import OscarCache
    from oscar.pipeline.models import load_model

    model, _, _ = load_model("tiny-llama")
    with pytest.raises(OscarError, match="artifact does not match the model"):
        OscarCache.from_artifact(model, str(served_dir / "runs" / "demo" / "artifact.safetensors"))
    assert model.config._attn_implementation != "oscar"  # refused before anything was switched
