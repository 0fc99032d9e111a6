"""The rows backend of the cache family: several needle samples x methods decoded as one batch.

`MethodBatchCache` (simulate.py) decodes one sample's methods together. `RowBatchCache` holds the
rows of several samples, one row per (sample, method), whose prompts differ in length. Row r keeps
its own length n_r: its tokens fill slots [0, n_r) of its buffer row, a new chunk is written from
slot n_r on (a shorter question is right-padded: the pads lie beyond the row's length, are never
read, and the next token overwrites them), and a query at position p reads slots j <= p. Slot index
= token position, so RoPE gets each row's own positions (`position_ids`). Row r stores exactly what
`MethodBatchCache` stores for its method (same quantized ranges, same flush steps); tests check the
two agree. The decode loop over it is scoring's (oscar/scoring/rows.py `decode_rows`).

Why it is faster (docs/decisions/0050-needle-decoding-several-samples-per-batch.md, "Needle decoding: several samples per batch"):
- attention is `rows_attention`: float32 scores and float32 accumulation, query heads viewed per
  KV head (GQA without repeat_kv). SDPA's CPU flash kernel for a one-token bfloat16 query was the
  decode step's main cost (21 ms vs 3.7 ms for (7, 9, 1, 64) x 4k keys, one thread);
- K/V are stored in float32 whatever the model dtype, holding exactly the model dtype's values
  (quantized blocks are rounded to the model dtype first): the faster matmul on this CPU, and scores
  at least as precise as the bf16 kernel's (products of bf16 values are exact in float32);
- one step reads the weights once for every row of every sample in the batch;
- a row that is done (EOS or its answer budget) leaves the batch: the last active row moves into
  its slot, so the batch stays a contiguous prefix of the buffers and finished rows cost nothing.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from oscar.common import OscarError
from oscar.kernels.paged import Elsewhere, check_held
from oscar.kernels.protocol import Protocol
from oscar.kernels.simulate import LayerQuant, commit_row

ATTN = "oscar_rows"
# Scores held at once by rows_attention (4 MiB of float32: a few L2-sized chunks); rows are chunked beyond.
# A question chunk's scores (rows x Hq x t x S) are tens of MB: in row chunks that stay in cache, its
# masking, softmax and value product ran 1.7x faster than in one 64 MiB block, bit-identical (each row's
# products are the same batched-matmul entries; bench/main_job_speed.py "rows_attention").
_SCORE_ELEMS = 1 << 20


def rows_attention(module, query, key, value, attention_mask=None, dropout=0.0, scaling=None, position_ids=None,
                   **kwargs):
    """query (A, Hq, t, D) in the model dtype; key/value (A, Hkv, S, D) float32 slots of `RowBatchCache`.

    Query i of row r (at position position_ids[r, i]) reads slots j <= that position; float32
    softmax; returns (A, t, Hq, D) in the query's dtype, as transformers' attention functions do.
    """
    if position_ids is None:
        raise OscarError("rows_attention needs position_ids (each row's own positions)")
    A, Hq, t, D = query.shape
    Hkv, S = key.shape[1], key.shape[2]
    rep = Hq // Hkv
    scale = scaling if scaling is not None else D ** -0.5
    q = query.to(key.dtype).reshape(A, Hkv, rep * t, D)  # head h = g * rep + i reads KV head g (repeat_kv's order)
    pos = position_ids.expand(A, t) if position_ids.shape[0] == 1 else position_ids
    out = torch.empty(A, Hkv, rep * t, D, dtype=key.dtype, device=key.device)
    step = max(1, _SCORE_ELEMS // (Hkv * rep * t * S))
    j = torch.arange(S, device=key.device)
    for a in range(0, A, step):
        b = min(A, a + step)
        s = torch.matmul(q[a:b], key[a:b].transpose(-1, -2)).mul_(scale)  # (c, Hkv, rep*t, S)
        hide = (j[None, None, :] > pos[a:b, :, None])[:, None, None]  # (c, 1, 1, t, S): not yet written, or pads
        s = s.view(b - a, Hkv, rep, t, S).masked_fill_(hide, float("-inf"))
        p = torch.softmax(s, dim=-1).view(b - a, Hkv, rep * t, S)
        torch.matmul(p, value[a:b], out=out[a:b])  # (c, Hkv, rep*t, D)
    return out.view(A, Hq, t, D).transpose(1, 2).to(query.dtype), None


def register() -> None:
    """Register `rows_attention` with transformers as ATTN (its mask function: none, it masks by position)."""

    AttentionInterface.register(ATTN, rows_attention)
    AttentionMaskInterface.register(ATTN, lambda *a, **k: None)  # rows_attention masks by position itself


class RowLayer(DynamicLayer):
    """One layer's K/V of every row: float32 buffers (R, Hkv, capacity, D); rows [0, active) in the batch.

    Per row, the same state as `BatchQuantLayer`: [sink, n_quant) fake-quantized, the rest exact; a flush
    owed by a step is applied at the start of the next update (after that step's attention read the cache).
    """

    def __init__(self, lqs: list[LayerQuant | None], protocol: Protocol, dtype: torch.dtype):
        super().__init__()
        self.lqs, self.sink, self.recent, self.model_dtype = list(lqs), protocol.sink, protocol.recent, dtype
        R = len(lqs)
        self.n = [0] * R  # tokens held per slot
        self.n_quant = [protocol.sink] * R
        self.pre: list[tuple[int, torch.Tensor, torch.Tensor] | None] = [None] * R  # (start, k̂, v̂) ahead of the flush
        self.active = R
        self.chunk: list[int] | None = None  # real tokens per active row of the chunk being written

    def alloc(self, heads: int, capacity: int, head_dim: int, device) -> None:
        R = len(self.lqs)
        # Slots past a row's length are masked, but a masked score times a non-finite value is NaN:
        # values start as zeros; masked keys are overwritten by -inf scores, so keys need no fill.
        self.kbuf = torch.empty(R, heads, capacity, head_dim, dtype=torch.float32, device=device)  # (R, Hkv, cap, D)
        self.vbuf = torch.zeros_like(self.kbuf)
        self.dtype, self.device, self.is_initialized = torch.float32, device, True

    def load(self, rows: range, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Rows `rows` take over one exact prefill (1, Hkv, T, D), as `BatchQuantLayer.load` does per row."""
        T = keys.shape[-2]
        if T > self.kbuf.shape[2]:
            raise OscarError(f"prefill of {T} tokens exceeds the batch capacity {self.kbuf.shape[2]}")
        done: dict[int, tuple] = {}  # id(LayerQuant) -> its quantized prefill: rows of one method share it
        for r in rows:
            self.n[r] = T
            lq = self.lqs[r]
            b_all = lq.quantized_until(T, self.sink, 0) if lq is not None else 0
            if b_all <= self.sink:  # nothing quantized (the exact cache, or a prompt within the sink)
                self.kbuf[r, :, :T], self.vbuf[r, :, :T] = keys[0], values[0]
                continue
            b = lq.quantized_until(T, self.sink, self.recent)
            if id(lq) not in done:
                done[id(lq)] = (lq.keys(keys[..., self.sink:b_all, :])[0], lq.values(values[..., self.sink:b_all, :])[0])
            kq, vq = done[id(lq)]  # (Hkv, b_all - sink, D), model dtype
            for buf, x, xq in ((self.kbuf, keys[0], kq), (self.vbuf, values[0], vq)):
                buf[r, :, :self.sink] = x[:, :self.sink]
                buf[r, :, self.sink:b] = xq[:, :b - self.sink]
                buf[r, :, b:T] = x[:, b:]
            if b_all > b:
                self.pre[r] = (b, kq[:, b - self.sink:], vq[:, b - self.sink:])
            self.n_quant[r] = b

    def _commit(self) -> None:
        for r in range(self.active):
            lq = self.lqs[r]
            if lq is None:
                continue
            a, b = self.n_quant[r], lq.quantized_until(self.n[r], self.sink, self.recent)
            if b <= a:
                continue
            # float32 buffers: quantize from the model dtype, as MethodBatchCache does
            commit_row(lq, self.pre[r], self.kbuf, self.vbuf, r, a, b, dtype=self.model_dtype)
            self.n_quant[r] = b

    def update(self, key_states, value_states, *args, **kwargs):
        A, H, t, D = key_states.shape
        if A != self.active:
            raise OscarError(f"batch of {A} rows for a cache with {self.active} active rows")
        self._commit()
        n = torch.tensor(self.n[:A])
        S = int(n.max()) + t
        if S > self.kbuf.shape[2]:
            raise OscarError(f"row batch capacity {self.kbuf.shape[2]} exceeded ({S} slots); size it by the prompts")
        ar = torch.arange(A)
        if t == 1:
            self.kbuf[ar, :, n] = key_states[:, :, 0].float()  # (A, Hkv, D)
            self.vbuf[ar, :, n] = value_states[:, :, 0].float()
        else:
            idx = n[:, None] + torch.arange(t)  # (A, t)
            self.kbuf[ar[:, None], :, idx] = key_states.transpose(1, 2).float()  # (A, t, Hkv, D)
            self.vbuf[ar[:, None], :, idx] = value_states.transpose(1, 2).float()
        lens = self.chunk if self.chunk is not None else [t] * A
        for r in range(A):
            self.n[r] += lens[r]
        return self.kbuf[:A, :, :S], self.vbuf[:A, :, :S]

    def move(self, dst: int, src: int) -> None:
        """Slot `src`'s row takes slot `dst` (the row that was in `dst` is done)."""
        m = self.n[src]
        self.kbuf[dst, :, :m] = self.kbuf[src, :, :m]
        self.vbuf[dst, :, :m] = self.vbuf[src, :, :m]
        for a in (self.lqs, self.n, self.n_quant, self.pre):
            a[dst] = a[src]

    def get_seq_length(self) -> int:
        return max(self.n[:self.active]) if self.active else 0


class RowBatchCache(Cache):
    """Rows of several samples: group g holds one sample's methods (`arts[g]`, None: the exact cache).

    Build it with the groups and a capacity in slots (>= every row's context + question + answer
    budget), then `load(g, exact)` each group's exact prefill; `decode_rows` runs the batch.
    """

    def __init__(self, groups: list[list], protocol: Protocol, num_layers: int, capacity: int, dtype: torch.dtype,
                 held: range | None = None):
        self.groups = groups
        self.capacity, self.dtype = capacity, dtype
        # the layers this cache holds: all of them in one process, a pipeline stage's own range on a stage (the
        # others are `Elsewhere`: the model's attention indexes the cache by its global layer index)
        self.held = check_held(held, num_layers)
        self.starts = [sum(len(g) for g in groups[:i]) for i in range(len(groups) + 1)]
        quant: dict[tuple[int, int], LayerQuant] = {}  # one LayerQuant per (method artifact, layer), shared by rows

        def lq(art, l):
            if art is None:
                return None
            if (id(art), l) not in quant:
                quant[(id(art), l)] = LayerQuant(art, l, protocol.pages)
            return quant[(id(art), l)]

        super().__init__(layers=[RowLayer([lq(a, l) for g in groups for a in g], protocol, dtype) if l in self.held
                                 else Elsewhere(l) for l in range(num_layers)])
        self.order = list(range(self.starts[-1]))  # active slot -> row (rows numbered group by group)

    @property
    def rows(self) -> int:
        return self.starts[-1]

    def load(self, g: int, exact: DynamicCache) -> None:
        rows = range(self.starts[g], self.starts[g + 1])
        if len(exact.layers) < self.held.stop or not all(exact.layers[l].is_initialized for l in self.held):
            raise OscarError(f"the prefill does not hold every layer of {self.held.start}..{self.held.stop - 1}")
        for l in self.held:
            layer, src = self.layers[l], exact.layers[l]
            if not layer.is_initialized:
                layer.alloc(src.keys.shape[1], self.capacity, src.keys.shape[3], src.keys.device)
            layer.load(rows, src.keys, src.values)

    def lengths(self) -> list[int]:
        """Tokens held by each active slot."""
        l0 = self.layers[self.held.start]
        return l0.n[:l0.active]

    def set_chunk(self, lengths: list[int] | None) -> None:
        """The next forward writes a right-padded chunk with `lengths[s]` real tokens in slot s (None: all real)."""
        for l in self.held:
            self.layers[l].chunk = lengths

    def keep(self, slots: list[int]) -> list[int]:
        """Only the rows in active `slots` (ascending) stay in the batch; the others are done.

        The rows beyond the new batch size move into the freed slots; returns, per new slot, its old slot."""
        A = len(slots)
        kept = set(slots)
        moves = list(zip([s for s in range(A) if s not in kept], [s for s in slots if s >= A]))  # (to, from)
        for layer in (self.layers[l] for l in self.held):
            for d, s in moves:
                layer.move(d, s)
            layer.active = A
        src = list(range(A))
        for d, s in moves:
            src[d] = s
        self.order = [self.order[s] for s in src]
        return src
