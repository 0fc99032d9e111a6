"""The product cache engine on the pipeline stages.

A stage's OscarCache holds only its own layers (`held`): pool pages and buffers for those layers alone, the same
bits in them as the one-process cache's, and a one-line refusal for any other layer. `oscar validate niah --engine
cache --ray ADDR --stages 2` gives the same greedy answers as `--engine cache` in one process."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from helpers.artifacts import SMALL, random_artifact, tiny_model
from oscar.common import OscarError
from oscar.kernels.cache import OscarCache, make_cache
from oscar.kernels.simulate import Protocol


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
    c = make_cache(art, p, backend=None, model=m, max_len=64, page_size=4, held=range(0, 1))
    assert isinstance(c, OscarCache) and c.held == range(0, 1)  # passed through to the paged backends
    with pytest.raises(OscarError, match="simulate backend holds every layer"):
        make_cache(art, p, backend="simulate", held=range(0, 1))
