"""The window NLL: next-token NLL of a window read through whatever cache or simulator is active.

One process computes it from the model (`window_nll`), the last pipeline stage from the final hidden states
(`hidden_nll`, cluster/scoring.py), in the same chunks and order. The recipe's tune and validation's perplexity
both score windows with it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.no_grad()
def window_nll(model, ids: torch.Tensor, chunk: int = 512, prefixes: tuple[int, ...] = ()):
    """Sum of next-token NLL over a (1, T) window and the count T-1 (logits computed in chunks).

    prefixes: window lengths P < T whose (nll, P-1) are returned too, as a list after the pair: under
    a causal model (and the simulator's position mask, which only looks back) the first P positions of
    this window compute exactly what a window of P tokens starting here computes.
    """
    h = model.model(input_ids=ids, use_cache=False).last_hidden_state  # (1, T, H)
    return hidden_nll(model.lm_head, h, ids, chunk, prefixes)


def hidden_nll(lm_head, h: torch.Tensor, ids: torch.Tensor, chunk: int = 512, prefixes: tuple[int, ...] = ()):
    """`window_nll` from the final hidden states h (1, T, H), after the final norm: what the last pipeline stage
    computes (cluster/scoring.py), in the same chunks and order as one process."""
    T = ids.shape[1]
    cuts = sorted({P - 1 for P in prefixes if 1 < P < T} | {T - 1})  # predicted tokens per part
    tot, sums, a = 0.0, {}, 0
    for a in range(0, T - 1, chunk):
        for lo, hi in _split(a, min(a + chunk, T - 1), cuts):
            logits = lm_head(h[:, lo:hi]).float()  # (1, c, V)
            tot += F.cross_entropy(logits[0], ids[0, lo + 1:hi + 1], reduction="sum").item()
            if hi in cuts:
                sums[hi] = tot
    if not prefixes:
        return tot, T - 1
    return tot, T - 1, [(sums[P - 1], P - 1) for P in prefixes]


def _split(a: int, b: int, cuts: list[int]) -> list[tuple[int, int]]:
    """[a, b) cut at every cut point strictly inside it."""
    pts = [a] + [c for c in cuts if a < c < b] + [b]
    return list(zip(pts[:-1], pts[1:]))
