"""The product cache engine on the pipeline stages.

A stage's OscarCache holds only its own layers (`held`): pool pages and buffers for those layers alone, the same
bits in them as the one-process cache's, and a one-line refusal for any other layer. `oscar validate niah --engine
cache --ray ADDR --stages 2` gives the same greedy answers as `--engine cache` in one process."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import DynamicCache

from helpers.artifacts import SMALL, random_artifact, tiny_model
from oscar.cluster.pipeline import ClusterConfig
from oscar.cluster.scoring import Calls, ScoreArgs, ScoreStage, StagedScorer, chain
from oscar.common import OscarError, set_threads
from oscar.kernels.cache import OscarCache
from oscar.kernels.backends import CacheSpec, make_cache
from oscar.kernels.protocol import Protocol
from oscar.pipeline.models import resolve_model
from oscar.stats.artifact import load_artifact
from oscar.validate.niah import NiahConfig, run_niah
from oscar.validate.ppl import PplConfig, run_ppl


def layer_kv(m, T=40, seed=0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's post-RoPE (k, v) (1, Hkv, T, D) of a random prompt, from an exact prefill."""
    g = torch.Generator().manual_seed(seed)
    exact = DynamicCache()
    with torch.no_grad():
        m(input_ids=torch.randint(1, 96, (1, T), generator=g), cache=exact, use_cache=True)
    return [(l.keys, l.values) for l in exact.layers]


def filled(m, art, kv, held=None) -> OscarCache:
    """An OscarCache (of `held` layers) holding `kv` in its layers, written in two chunks as a stage writes them."""
    cache = OscarCache.from_artifact(m, art, max_len=64, held=held, **SMALL)
    for a, b in ((0, 25), (25, kv[0][0].shape[2])):
        for l in cache.held:
            cache.update(kv[l][0][:, :, a:b], kv[l][1][:, :, a:b], l)
    return cache


def pool_bytes(pcs) -> int:
    return sum(sum(pc.bytes_used().values()) for pc in pcs)


def test_a_stage_cache_holds_only_its_layers():
    m = tiny_model("llama")  # 2 layers
    art, kv = random_artifact(m.config), layer_kv(m)
    full, part = filled(m, art, kv), filled(m, art, kv, held=range(1, 2))
    assert full.held == range(2) and len(full.pool.layers) == 2  # the one-process cache: every layer, as before
    assert len(part.pool.layers) == 1 and part.pool[1].cfg == full.pool[1].cfg
    assert pool_bytes(part.pool.layers) == pool_bytes([full.pool[1]]) == pool_bytes(full.pool.layers) // 2
    assert part.get_seq_length() == full.get_seq_length() == 40
    assert part.pool[1].pages[part.seqs[0]] == full.pool[1].pages[full.seqs[0]]  # same page accounting
    for a, b in zip(part.layers[1].gather(), full.layers[1].gather()):
        assert torch.equal(a, b)  # the same sink, INT2 pages and window, bit for bit
    assert part.memory()["tokens"] == 40 and part.memory()["codes"] * 2 == full.memory()["codes"]
    part.release()
    assert len(part.pool[1].free_pages) == part.pool.cfg.num_pages  # every page back


def test_a_stage_cache_refuses_other_layers():
    m = tiny_model("llama")
    art, kv = random_artifact(m.config), layer_kv(m)
    part = filled(m, art, kv, held=range(1, 2))
    for touch in (lambda: part.update(kv[0][0], kv[0][1], 0), lambda: part.pool[0], lambda: part.get_seq_length(0)):
        with pytest.raises(OscarError) as e:
            touch()
        assert "layer 0 " in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(OscarError, match="not a non-empty range"):
        OscarCache.from_artifact(m, art, max_len=64, held=range(1, 3), **SMALL)
    p = Protocol("strict", sink=4, recent=16)
    c = make_cache(CacheSpec.one(art, p, model=m, max_len=64, page_size=4, held=range(0, 1)), backend=None)
    assert isinstance(c, OscarCache) and c.held == range(0, 1)  # passed through to the paged backends
    with pytest.raises(OscarError, match="simulate backend holds every layer"):
        make_cache(CacheSpec.one(art, p, held=range(0, 1)), backend="simulate")


def test_stage_actors_keep_their_own_layers_caches(scaled_artifact):
    """Two `ScoreStage`s of tiny-llama (4 layers) in this process (`Calls.direct`): after a chunk and a decode step, each holds an
    OscarCache of its own layers only, its pool allocated for them alone; the other stage's layers are refused."""
    set_threads(1)
    d = resolve_model("tiny-llama")
    stages = [ScoreStage(ScoreArgs(d, a, b, stage=i)) for i, (a, b) in enumerate([(0, 2), (2, 4)])]
    c = Calls.direct()
    for st in stages:
        st.load({"oscar-int2": load_artifact(scaled_artifact)})
        st.cache_begin("oscar-int2", "strict", 160)
    ids = torch.arange(150)[None] % 90 + 1  # (1, 150): past the 64-token sink, pages of INT2 history
    assert chain(c, stages, "cache_forward", ids) is None  # a haystack chunk: no token picked
    assert isinstance(chain(c, stages, "cache_forward", torch.tensor([[7]]), True), int)  # one decode step
    for st, held, other in zip(stages, (range(0, 2), range(2, 4)), (2, 0)):
        cache = st.cache
        assert isinstance(cache, OscarCache) and cache.held == held and len(cache.pool.layers) == 2
        assert cache.get_seq_length() == 151 and cache.pool[held.start].pages[cache.seqs[0]]  # INT2 pages written
        with pytest.raises(OscarError, match=f"layer {other} "):
            cache.pool[other]
        st.cache_end()
        assert st.cache is None


# ------------------------------------------------------------------ needles through the stages' caches (real Ray)


def answers(out) -> dict:
    return {(r["task"], r["length"], r["index"], r["method"]): r["pred"]
            for r in map(json.loads, open(os.path.join(out, "niah_samples.jsonl")))}


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(600)
@pytest.mark.parametrize("model,methods", [
    ("tiny-llama", ["bf16", "oscar-int2", "naive-int2"]),
    ("tiny-glm4-moe", ["bf16", "hadamard-int2", "naive-int2"]),
    pytest.param("smollm2-135m", ["bf16", "hadamard-int2", "naive-int2"], marks=pytest.mark.full),  # real needles
])
def test_cache_engine_on_two_stages_equals_one_process(model, methods, ray_head, scaled_artifact, tmp_path):
    """`--engine cache` on 2 stages (each its own layers' OscarCache, the torch reference kernels on CPU) against
    `--engine cache` in one process: the same greedy answer for every (length, sample, method) row. Both sides run
    the same float32 operations on the same shapes with one thread, so an answer could only change at an argmax tie
    within float summation order."""
    kw = dict(model=model, methods=methods, tasks=["niah_single_1"], lengths=[300, 600], samples=2,
              protocol="strict", dtype="float32", engine="cache",
              artifact=scaled_artifact if "oscar-int2" in methods else None)
    set_threads(1)  # each stage actor runs one thread
    run_niah(NiahConfig(out=str(tmp_path / "one"), **kw), progress=False, workers=1)
    with StagedScorer(model, ClusterConfig(stages=2, cpus_per_stage=1), address=ray_head.address) as sc:
        run_niah(NiahConfig(out=str(tmp_path / "two"), **kw), progress=False, stages=sc)
    one, two = answers(tmp_path / "one"), answers(tmp_path / "two")
    assert len(one) == 2 * 2 * len(methods) and one == two
    assert any(p for p in one.values())  # real answers, not all empty
    rows = [json.loads(x) for x in open(tmp_path / "two" / "niah_samples.jsonl")]
    assert all(r["stages"] == 2 and r["batch_cpu_s"] > 0 for r in rows)


def windows(out) -> dict:
    return {(r["method"], r["protocol"], r["context"], r["window"]): (r["nll"], r["count"])
            for r in map(json.loads, open(os.path.join(out, "ppl_windows.jsonl")))}


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(600)
def test_cache_engine_perplexity_on_two_stages_equals_one_process(ray_head, scaled_artifact, tmp_path):
    """`oscar validate ppl --engine cache` on 2 stages against one process (`engine.window_nll`: each window from an
    empty cache, its first tokens as one chunk, the last 16 one decode step each): every window's NLL within 1e-5
    relative (the same float32 operations in the same order with one thread; 1e-5 leaves room for a GEMM's
    reduction order only). The 128-token windows are prefixes of the 256-token ones (cut points)."""
    kw = dict(model="tiny-llama", methods=["bf16", "oscar-int2", "naive-int2"], contexts=[128, 256], tokens=512,
              protocols=["strict", "serving"], dtype="float32", engine="cache", artifact=scaled_artifact)
    set_threads(1)
    run_ppl(PplConfig(out=str(tmp_path / "one"), **kw), progress=False, workers=1)
    with StagedScorer("tiny-llama", ClusterConfig(stages=2, cpus_per_stage=1), address=ray_head.address) as sc:
        run_ppl(PplConfig(out=str(tmp_path / "two"), **kw), progress=False, scorer=sc)
    one, two = windows(tmp_path / "one"), windows(tmp_path / "two")
    assert one.keys() == two.keys() and len(one) == (1 + 2 * 2) * (4 + 2)  # bf16 once, 2 methods x 2 protocols
    for k in one:
        assert one[k][1] == two[k][1] and abs(one[k][0] - two[k][0]) <= 1e-5 * abs(one[k][0]), (k, one[k], two[k])
    assert one[("naive-int2", "strict", 256, 0)][0] != one[("bf16", "-", 256, 0)][0]  # the INT2 history is read
