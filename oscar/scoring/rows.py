"""The needle decode loop over the rows backend (`oscar validate niah`'s decode loop).

`decode_rows` runs a `RowBatchCache` (kernels/rowbatch.py: several samples x methods as one batch, each
row its own length and positions) to every row's greedy answer; the cache and its attention function are
the kernels' rows backend, the loop (questions, budgets, EOS, rows leaving the batch) is scoring's, run alike by
validation's needles (validate/niah.py) and the pipeline stages.

The loop drives a *runner*: `LocalRows` (the model and its cache in this process) or the pipeline stages'
(cluster/scoring.py `StagedRows`: each stage holds its layers' rows of the same cache). A runner has `rows`, `order`
(active slot -> row), `set_chunk(lengths)`, `keep(slots)` (-> each new slot's old slot) and
`step(ids (A, t), last (A,))` -> each active row's next token (the logits at its `last` chunk position).
"""

from __future__ import annotations

import torch

from oscar.common import OscarError
from oscar.kernels.rowbatch import ATTN, RowBatchCache, register


class LocalRows:
    """The model in this process over its `RowBatchCache`."""

    def __init__(self, model, cache: RowBatchCache):
        self.model, self.cache = model, cache

    @property
    def rows(self) -> int:
        return self.cache.rows

    @property
    def order(self) -> list[int]:
        return self.cache.order

    def set_chunk(self, lengths: list[int] | None) -> None:
        self.cache.set_chunk(lengths)

    def keep(self, slots: list[int]) -> list[int]:
        return self.cache.keep(slots)

    def step(self, ids: torch.Tensor, last: torch.Tensor) -> list[int]:
        pos = positions(self.cache, ids.shape[1])  # (A, t)
        dev = self.model.lm_head.weight.device
        h = self.model.model(input_ids=ids.to(dev), position_ids=pos.to(dev), cache=self.cache,
                             use_cache=True).last_hidden_state  # (A, t, H)
        self.cache.set_chunk(None)
        return self.model.lm_head(h[torch.arange(h.shape[0]), last.to(dev)]).argmax(-1).tolist()  # (A,)


def positions(cache: RowBatchCache, t: int) -> torch.Tensor:
    """(A, t): each active row's positions for a chunk of t slots (a row's tokens fill slots [0, n_r))."""
    return torch.tensor(cache.lengths())[:, None] + torch.arange(t)


def decode_rows(model, cache: RowBatchCache, questions: list[list[int]], budgets: list[int], eos: set[int]) -> list[list[int]]:
    """Greedy answers of every row: its question chunk attends to its stored cache, then up to `budgets[r]`
    tokens, each attending to the cache; a row stops at EOS (not recorded) or at its budget.

    Row r computes what `niah.greedy` computes for its method and sample (within float summation order).
    """
    impl = model.config._attn_implementation
    register()
    model.set_attn_implementation(ATTN)
    try:
        with torch.no_grad():
            return run_rows(LocalRows(model, cache), questions, budgets, eos)
    finally:
        model.set_attn_implementation(impl)


def run_rows(runner, questions: list[list[int]], budgets: list[int], eos: set[int]) -> list[list[int]]:
    """`decode_rows`' loop over any runner (module docstring)."""
    if len(questions) != runner.rows or len(budgets) != runner.rows:
        raise OscarError(f"{len(questions)} questions / {len(budgets)} budgets for {runner.rows} rows")
    out: list[list[int]] = [[] for _ in questions]
    t = max(len(q) for q in questions)
    ids = torch.tensor([q + [q[-1]] * (t - len(q)) for q in questions])  # (R, t), right-padded
    last = torch.tensor([len(q) - 1 for q in questions])  # each row's last real question token
    runner.set_chunk([len(q) for q in questions])
    live = [r for r in range(runner.rows) if budgets[r] > 0]
    if len(live) < runner.rows:  # nothing to decode for these rows
        src = runner.keep(live)
        ids, last = ids[src], last[src]
        runner.set_chunk([len(questions[runner.order[s]]) for s in range(len(src))])
    while runner.order:
        nxt = runner.step(ids, last)  # (A,)
        stay = []
        for s, tok in enumerate(nxt):
            r = runner.order[s]
            if tok in eos:
                continue
            out[r].append(tok)
            if len(out[r]) < budgets[r]:
                stay.append(s)
        if len(stay) < len(nxt):
            nxt = [nxt[s] for s in runner.keep(stay)]
        ids = torch.tensor(nxt, dtype=torch.long)[:, None]
        last = torch.zeros(len(nxt), dtype=torch.long)
    return out
