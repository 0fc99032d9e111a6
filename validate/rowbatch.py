"""The needle decode loop over the rows backend (`oscar validate niah`'s decode loop).

`decode_rows` runs a `RowBatchCache` (kernels/rowbatch.py: several samples x methods as one batch, each
row its own length and positions) to every row's greedy answer; the cache and its attention function are
the kernels' rows backend, the loop (questions, budgets, EOS, rows leaving the batch) is validation's.
"""

from __future__ import annotations

import torch

from oscar.common import OscarError
from oscar.kernels.rowbatch import ATTN, RowBatchCache, register


def decode_rows(model, cache: RowBatchCache, questions: list[list[int]], budgets: list[int], eos: set[int]) -> list[list[int]]:
    """Greedy answers of every row: its question chunk attends to its stored cache, then up to `budgets[r]`
    tokens, each attending to the cache; a row stops at EOS (not recorded) or at its budget.

    Row r computes what `niah.greedy` computes for its method and sample (within float summation order).
    """
    if len(questions) != cache.rows or len(budgets) != cache.rows:
        raise OscarError(f"{len(questions)} questions / {len(budgets)} budgets for {cache.rows} rows")
    impl = model.config._attn_implementation
    register()
    model.set_attn_implementation(ATTN)
    try:
        with torch.no_grad():
            return _loop(model, cache, questions, budgets, eos)
    finally:
        model.set_attn_implementation(impl)


def _loop(model, cache: RowBatchCache, questions, budgets, eos) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in questions]
    t = max(len(q) for q in questions)
    ids = torch.tensor([q + [q[-1]] * (t - len(q)) for q in questions])  # (R, t), right-padded
    last = torch.tensor([len(q) - 1 for q in questions])  # each row's last real question token
    cache.set_chunk([len(q) for q in questions])
    live = [r for r in range(cache.rows) if budgets[r] > 0]
    if len(live) < cache.rows:  # nothing to decode for these rows
        src = cache.keep(live)
        ids, last = ids[src], last[src]
        cache.set_chunk([len(questions[cache.order[s]]) for s in range(len(src))])
    while cache.order:
        pos = torch.tensor(cache.lengths())[:, None] + torch.arange(ids.shape[1])  # (A, t): each row's positions
        dev = model.lm_head.weight.device
        h = model.model(input_ids=ids.to(dev), position_ids=pos.to(dev), cache=cache,
                        use_cache=True).last_hidden_state  # (A, t, H)
        cache.set_chunk(None)
        nxt = model.lm_head(h[torch.arange(h.shape[0]), last]).argmax(-1).tolist()  # (A,)
        stay = []
        for s, tok in enumerate(nxt):
            r = cache.order[s]
            if tok in eos:
                continue
            out[r].append(tok)
            if len(out[r]) < budgets[r]:
                stay.append(s)
        if len(stay) < len(nxt):
            nxt = [nxt[s] for s in cache.keep(stay)]
        ids = torch.tensor(nxt, dtype=torch.long)[:, None]
        last = torch.zeros(len(nxt), dtype=torch.long)
    return out
