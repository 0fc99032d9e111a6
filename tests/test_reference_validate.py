"""oscar-ref-int2 in validation: page flushes, the method factory, and SmolLM2 end to end.

Fast checks run on a tiny random-init Llama and a synthetic store; the SmolLM2 test
(slow) calibrates a small store, fits `oscar`, scores perplexity of both methods under
both protocols and checks the report shows them side by side.
"""

import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from oscar.common import OscarError, config_fingerprint
from oscar.stats import reference_recipe as rr
from oscar.stats.artifact import identity_artifact, save_artifact, load_artifact
from oscar.kernels.simulate import LayerQuant, SimQuantCache
from oscar.validate.methods import method_artifact, reference_artifact
from oscar.kernels.protocol import Protocol

from helpers.synthetic_store import SynthSpec, write_synthetic_store


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=256, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval()


def _ref_art(config):
    a = identity_artifact(config, rr.reference_quant_config(), variant="oscar-ref")
    g = torch.Generator().manual_seed(1)
    for l in range(a.num_layers):
        q, _ = torch.linalg.qr(torch.randn(a.head_dim, a.head_dim, generator=g))
        a.rot_k[l] = q.expand(a.num_kv_heads, -1, -1).clone()
        a.rot_v[l] = q.flip(-1).expand(a.num_kv_heads, -1, -1).clone()
        a.clip_k[l] = torch.full((a.num_kv_heads,), rr.CLIP_K)
        a.clip_v[l] = torch.full((a.num_kv_heads,), rr.CLIP_V)
    return a


def test_pages_of_8_leave_the_window(tiny):
    lq = LayerQuant(_ref_art(tiny.config), 0)
    assert lq.key_group == 8
    # sink 64, recent 256, T = 64 + 256 + 13: 13 tokens past the window, one whole page of 8 released
    assert lq.quantized_until(64 + 256 + 13, 64, 256) == 72
    assert lq.quantized_until(64 + 256 + 7, 64, 256) == 64  # no complete page yet
    assert lq.quantized_until(64 + 16, 64, 0) == 80  # strict: two pages


def test_artifact_with_retired_flush_pages_field_loads(tiny, tmp_path):
    """Artifacts written while `QuantConfig.flush_pages` existed still load (the protocol decides flushes now)."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    path, old = str(tmp_path / "new.safetensors"), str(tmp_path / "old.safetensors")
    save_artifact(_ref_art(tiny.config), path)
    with safe_open(path, "pt") as f:
        meta, tensors = json.loads(f.metadata()["oscar"]), {k: f.get_tensor(k) for k in f.keys()}
    assert "flush_pages" not in meta["quant"]
    meta["quant"]["flush_pages"] = True
    save_file(tensors, old, metadata={"oscar": json.dumps(meta)})
    assert load_artifact(old).quant == rr.reference_quant_config()


def test_masked_ppl_equals_token_by_token_decode_reference_format(tiny):
    from oscar.kernels.window_attention import simulated

    art = _ref_art(tiny.config)
    proto = Protocol("t", sink=3, recent=5)
    ids = torch.randint(0, 97, (1, 37), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        cache = SimQuantCache(art, proto)
        step = torch.cat([tiny(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True).logits
                          for t in range(ids.shape[1])], dim=1)
        with simulated(tiny, art, proto):
            masked = tiny(input_ids=ids, use_cache=False).logits
        exact = tiny(input_ids=ids, use_cache=False).logits
    assert torch.allclose(step, masked, atol=2e-4), (step - masked).abs().max()
    assert (step - exact).abs().max() > 1e-3


def _store_and_oscar_artifact(tmp_path, config):
    from oscar.stats.fit import FitConfig, fit

    p = str(tmp_path / "store")
    write_synthetic_store(p, SynthSpec(num_layers=2, num_kv_heads=2, head_dim=16, num_q_heads=4, num_blocks=2, rows=64,
                                       reservoir=32, fingerprint=config_fingerprint(config), seed=2))
    art = fit(p, FitConfig(variant="hadamard", clip=False, progress=False, threads=1))
    return p, art


def test_method_factory(tiny, tmp_path):
    from oscar.stats.fit import FitConfig, fit

    ref = _ref_art(tiny.config)
    assert method_artifact("oscar-ref-int2", tiny.config, ref) is ref  # an oscar-ref artifact is used as is
    p, art = _store_and_oscar_artifact(tmp_path, tiny.config)
    got = method_artifact("oscar-ref-int2", tiny.config, art)
    want = fit(p, FitConfig(variant="oscar-ref", progress=False, threads=1))
    assert got.meta["variant"] == "oscar-ref" and got.quant == rr.reference_quant_config()
    for l in range(2):
        assert torch.equal(got.rot_k[l], want.rot_k[l]) and torch.equal(got.rot_v[l], want.rot_v[l])
    assert reference_artifact(art) is got  # fitted once per store
    with pytest.raises(OscarError, match="needs --artifact"):
        method_artifact("oscar-ref-int2", tiny.config, None)
    art.meta["provenance"]["store"] = str(tmp_path / "gone")
    with pytest.raises(OscarError, match="does not exist"):
        method_artifact("oscar-ref-int2", tiny.config, art)


def test_channel_keys_method(tiny, tmp_path):
    """oscar-kc-int2: the same variant refitted on the same store with per-channel key groups of head_dim tokens."""
    import dataclasses

    from oscar.stats.fit import FitConfig, fit
    from oscar.validate.methods import channel_keys_artifact

    p, art = _store_and_oscar_artifact(tmp_path, tiny.config)
    got = method_artifact("oscar-kc-int2", tiny.config, art)
    assert got.quant.key_axis == "channel" and got.quant.group_size == art.head_dim and got.quant.value_axis == "token"
    assert got.meta["variant"] == art.meta["variant"]
    want = fit(p, FitConfig(variant="hadamard", quant=got.quant, progress=False, threads=1))
    for l in range(2):
        assert torch.equal(got.rot_k[l], want.rot_k[l]) and torch.equal(got.clip_k[l], want.clip_k[l])
    assert channel_keys_artifact(art) is got  # fitted once per store
    kc = dataclasses.replace(art, quant=got.quant)
    assert channel_keys_artifact(kc) is kc  # already per-channel: used as is
    with pytest.raises(OscarError, match="needs --artifact"):
        method_artifact("oscar-kc-int2", tiny.config, None)


@pytest.mark.slow
@pytest.mark.full
def test_smollm2_report_has_both_methods_and_protocols(tmp_path):
    """On SmolLM2: calibrate a small store, fit oscar, ppl of oscar-int2 and oscar-ref-int2 (strict + serving), report."""
    import pandas as pd

    from oscar.pipeline.calibrate import CalibConfig, calibrate
    from oscar.reports.build import build_report
    from oscar.stats.fit import FitConfig, fit
    from oscar.validate.env import load_model
    from oscar.validate.ppl import PplConfig, run_ppl

    store = str(tmp_path / "calib.zarr")
    calibrate(CalibConfig(model="smollm2-135m", store=store, seq_len=384, sink=64, tokens=768, seqs_per_block=1,
                          reservoir=64), progress=False)
    art = fit(store, FitConfig(progress=False, clip_rows=128, clip_queries=32))
    ap = str(tmp_path / "artifact.safetensors")
    save_artifact(art, ap)
    out = str(tmp_path / "run")
    loaded = load_model("smollm2-135m")
    run_ppl(PplConfig(out=out, artifact=ap, methods=["bf16", "oscar-ref-int2", "oscar-int2"], contexts=[512],
                      tokens=512, protocols=["strict", "serving"]), loaded=loaded, progress=False)
    ppl = pd.read_parquet(os.path.join(out, "ppl.parquet"))
    # windows scored under an older meaning of the protocols are not resumed into the new table
    import json

    cpath = os.path.join(out, "ppl_config.json")
    saved = open(cpath).read()
    old = json.loads(saved)
    old["identity"].pop("protocol_version")
    open(cpath, "w").write(json.dumps(old))
    with pytest.raises(OscarError, match="holds perplexities for another"):
        run_ppl(PplConfig(out=out, artifact=ap, methods=["bf16"], contexts=[512], tokens=512), loaded=loaded,
                progress=False)
    open(cpath, "w").write(saved)
    for m in ("oscar-ref-int2", "oscar-int2"):
        for p in ("strict", "serving"):
            r = ppl[(ppl.method == m) & (ppl.protocol == p)]
            assert len(r) == 1 and 1.0 < float(r.ppl.iloc[0]) < 1e4, (m, p)
    bpe = ppl.set_index("method").bits_per_element
    assert float(bpe["oscar-ref-int2"].iloc[0]) == 3.0  # 2 + 64/64: float32 scale + zero at head_dim 64
    rep = build_report(out)
    md = open(os.path.join(out, "report.md")).read()
    row = next(line for line in md.splitlines() if line.startswith("| oscar-ref-int2 "))
    assert row.count("×") == 2  # strict and serving perplexities, each with its ratio to bf16
    assert "ppl oscar-int2 < oscar-ref-int2 (strict)" in md and "ppl oscar-int2 < oscar-ref-int2 (serving)" in md
    print("\n" + "\n".join(line for line in md.splitlines() if line.startswith("| oscar") or "oscar-ref" in line))
    assert rep is not None
