"""Scoring an MLA model (GLM-5, DeepSeek-V3) through its INT2 latent cache: needle answers and window NLLs.

The cache is the latent simulator (kernels/latent.py `LatentSimCache`): transformers' MLA attention hands it the
latent c_kv and the RoPE key, and reads back the history [sink, T - recent) as its INT2 round trip, whole pages at
a time; the model's own code does the rest (the DSA indexer's top-k included). A chunk attends to itself exactly
and reads the history as the cache held it before the chunk, so

- a needle row is the per-head simulator's protocol: the haystack prefilled in one chunk (exact among itself),
  the question as a second chunk, then one decode step per token;
- a perplexity window is fed one page per chunk after its first `sink + recent + page` tokens (which read nothing
  from INT2). Query i then reads key j from INT2 exactly when j's page ended more than `recent` tokens before i:
  the position mask the per-head window simulator applies (kernels/window_attention.py), which token-by-token
  decoding through the same cache also produces (tests/test_latent_scoring.py compares the two).

An exact row (artifact None) runs transformers' own cache for the model (DSA layers keep their indexer keys).
"""

from __future__ import annotations

import contextlib

import torch
from transformers import DynamicCache

from oscar.common import OscarError
from oscar.kernels.backends import CacheSpec, make_cache
from oscar.kernels.latent_paged import LatentPagedCache, serve
from oscar.kernels.protocol import Protocol
from oscar.scoring.engine import greedy_tokens, next_token
from oscar.scoring.nll import hidden_nll, window_nll
from oscar.stats.artifact import LatentArtifact


def latent_cache(model, art: LatentArtifact | None, protocol: Protocol | None, held: range | None = None):
    """An empty cache of one row: the INT2 latent simulator of `art` under `protocol`, or (None) the exact one;
    `held`: the layers a pipeline stage runs, the only ones written."""
    if art is None:
        return DynamicCache(config=model.config)
    if not protocol.pages:
        raise OscarError(f"protocol {protocol.name!r} releases one token at a time; the latent cache stores whole "
                         f"pages of {art.quant.page_size} tokens")
    return make_cache(CacheSpec.one(art, protocol, held=held), "latent")


def window_chunks(T: int, art: LatentArtifact | None, protocol: Protocol | None) -> list[tuple[int, int]]:
    """The chunks a T-token window goes through the cache in: one (exact), or a page at a time (`page_chunks`)."""
    return [(0, T)] if art is None else page_chunks(T, protocol.sink, protocol.recent, art.quant.page_size)


@torch.no_grad()
def latent_answers(model, samples, groups, protocol: Protocol, eos: set[int], paged: bool = False) -> list[list[int]]:
    """Greedy answers of every (sample, method) row, sample by sample, its methods' artifacts `groups[g]` in order
    (None: exact): each row a fresh cache, the haystack one chunk, the question the next, one token per step.
    paged: the INT2 rows through the paged latent cache, each step decoded by its kernel (kernels/latent_paged.py),
    the product path; else the simulator."""
    dev = next(model.parameters()).device
    out: list[list[int]] = []
    for s, arts in zip(samples, groups):
        ctx = torch.tensor([s.context_ids], device=dev)  # (1, T)
        for art in arts:
            if paged and art is not None:
                cache = LatentPagedCache(art, sink=protocol.sink, recent=protocol.recent)
                ctxm = serve(model, cache)
            else:
                cache, ctxm = latent_cache(model, art, protocol), contextlib.nullcontext()
            with ctxm:
                model(input_ids=ctx, cache=cache, use_cache=True, logits_to_keep=1)
                step = lambda ids, c=cache: next_token(model(input_ids=torch.tensor([ids], device=dev), cache=c,  # noqa: E731
                                                             use_cache=True, logits_to_keep=1).logits[:, -1])  # (1, V)
                out.append(greedy_tokens(step, s.question_ids, s.max_new_tokens, eos))
    return out


def page_chunks(T: int, sink: int, recent: int, page: int) -> list[tuple[int, int]]:
    """The chunks [a, b) a T-token window is fed in: the first sink + recent + page tokens at once (none of them
    reads the INT2 history), then one page at a time, aligned to the pages that start at `sink`."""
    k = min(T, sink + recent + page)
    return [(0, k)] + [(a, min(a + page, T)) for a in range(k, T, page)]


@torch.no_grad()
def latent_window_nll(model, art: LatentArtifact | None, protocol: Protocol, ids: torch.Tensor,
                      prefixes: tuple[int, ...] = ()):
    """`scoring.nll.window_nll`'s result for a (1, T) window read through `art`'s INT2 latent cache under `protocol`
    (None: the plain model). Each position reads only earlier ones, so a prefix window is this window's prefix."""
    if art is None:
        return window_nll(model, ids, prefixes=prefixes)
    cache = latent_cache(model, art, protocol)
    hs = [model.model(input_ids=ids[:, a:b], cache=cache, use_cache=True).last_hidden_state  # (1, b - a, H)
          for a, b in window_chunks(ids.shape[1], art, protocol)]
    return hidden_nll(model.lm_head, torch.cat(hs, 1), ids, prefixes=prefixes)
