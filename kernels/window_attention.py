"""The perplexity window's INT2 cache as one attention call: a whole window from an empty cache, with the position
mask that token-by-token decoding through the simulated cache (kernels/simulate.py) produces. Query i reads
key/value j

    exactly     if j < sink, or i - e(j) <= recent
    from INT2   otherwise (j <= i)

where e(j) is the step at which token j is released to INT2: the last token of j's page of `page_size` tokens
for per-token groups (the paged cache writes whole pages; e(j) = j under `strict-token`), the last token of j's
group of G tokens for KIVI-style per-channel keys. Tests check it against token-by-token decoding and the paged
cache (validate/ppl.py scores the windows).

    with simulated(model, art, protocol): model(ids)   # the model's attention reads K/V as the cache would
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from oscar.kernels import cpu_attention
from oscar.kernels.simulate import LayerQuant

_SIM: dict = {"quant": None, "protocol": None, "qchunk": None}  # qchunk: the band's query block (None: by width)


def fresh_mask(T: int, sink: int, recent: int, key_group: int, device=None) -> torch.Tensor:
    """(T, T) bool: query i reads key j exactly (True) or from INT2 (False); causality not applied."""
    j = torch.arange(T, device=device)
    return fresh(j, j, sink, recent, key_group)


def fresh(i: torch.Tensor, j: torch.Tensor, sink: int, recent: int, key_group: int) -> torch.Tensor:
    """(len(i), len(j)) bool: query position i reads key position j exactly (see the module docstring)."""
    return _fresh_pairs(i[:, None], j[None, :], sink, recent, key_group)


def group_end(j: torch.Tensor, sink: int, key_group: int) -> torch.Tensor:
    """The last position of key j's token group (j itself for a sink or token-granular groups): j is stored once
    that position is past, so freshness is nondecreasing in it."""
    if key_group > 1:
        return torch.where(j >= sink, sink + ((j - sink) // key_group + 1) * key_group - 1, j)
    return j


def _fresh_pairs(i: torch.Tensor, j: torch.Tensor, sink: int, recent: int, key_group: int) -> torch.Tensor:
    """`fresh` on broadcastable position tensors i (queries) and j (keys)."""
    return (j < sink) | ((i - group_end(j, sink, key_group)) <= recent)


def _flash_lse(q, k, v, scale: float, causal: bool):
    """Attention output (B, H, Tq, D) and log-sum-exp (B, H, Tq) of q over k, v (same heads); top-left causal."""
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is not None and q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16, torch.float64):
        out, lse = op(q, k, v, 0.0, causal, scale=scale)  # lse float32 (float64 for float64: the tune's dtype)
        return out, lse
    s = (q @ k.transpose(-1, -2)).to(torch.promote_types(q.dtype, torch.float32)) * scale  # fallback: (B, H, Tq, Tk)
    if causal:
        Tq, Tk = s.shape[-2:]
        s = s.masked_fill(torch.ones(Tq, Tk, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    return (torch.softmax(s, -1).to(v.dtype) @ v), lse


def sim_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    """query (B, Hq, T, D), key/value (B, Hkv, T, D) post-RoPE; a whole window from an empty cache.

    With W = recent + key_group, every key j <= i - W is read from the stored cache (INT2, or an
    exact sink) by query i: that part is one causal flash attention over the stored keys shifted
    by W. The band i - W < j <= i mixes exact and INT2 keys per (i, j) (the fresh mask); it is
    computed in query blocks, and the two parts are merged through their log-sum-exps. Same
    result as the dense masked softmax (tests compare it with token-by-token decoding).
    """
    lq = _SIM["quant"][module.layer_idx]
    p = _SIM["protocol"]
    B, Hq, T, D = query.shape
    sink = min(p.sink, T)
    b = lq.quantized_until(T, sink, 0)  # everything from sink, keys in whole groups
    kh, vh = key.clone(), value.clone()  # (B, Hkv, T, D): the stored cache (sink exact, [sink, b) INT2)
    kh[..., sink:b, :] = lq.keys(key[..., sink:b, :])
    vh[..., sink:b, :] = lq.values(value[..., sink:b, :])
    rep = Hq // key.shape[1]
    scale = scaling if scaling is not None else D ** -0.5
    W = p.recent + lq.key_group  # j <= i - W: read from the stored cache by every query i
    far = None
    if T > W:  # rows: queries W..T-1 over keys 0..T-W-1, plain causal
        qf, Ks, Vs = query[:, :, W:], kh[..., :T - W, :], vh[..., :T - W, :]
        if cpu_attention.supports(qf, Ks):  # the native kernel reads the KV heads in place (GQA)
            far = cpu_attention.causal_attention(qf, Ks, Vs, scale)
        else:
            far = _flash_lse(qf, Ks.repeat_interleave(rep, 1), Vs.repeat_interleave(rep, 1), scale, causal=True)
    band = _band if W <= 64 else _band_loop  # measured: batched blocks win for narrow bands only
    o, ln = band(query, key, value, kh, vh, sink, p.recent, lq.key_group, W, scale)  # (B, Hq, T, D), (B, Hq, T)
    if far is not None:  # queries W..T-1 also read the stored cache beyond the band: merge by log-sum-exp
        acc = torch.promote_types(query.dtype, torch.float32)
        of, lf = far[0].to(acc), far[1].to(acc)
        lse = torch.logaddexp(ln[:, :, W:], lf)
        o[:, :, W:] = torch.exp(ln[:, :, W:] - lse)[..., None] * o[:, :, W:] + torch.exp(lf - lse)[..., None] * of
    out = o.to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


def _band_loop(query, key, value, kh, vh, sink: int, recent: int, key_group: int, W: int, scale: float):
    """`_band` as a loop over blocks of 256 queries, each over its 256 + W - 1 keys (heads repeated): for
    wide bands (serving: W = 272, 320) this ran faster than the batched windows (bench/main_job_speed.py)."""
    B, Hq, T, D = query.shape
    rep = Hq // key.shape[1]
    acc = torch.promote_types(query.dtype, torch.float32)  # float32, or float64 for a float64 model (the tune)
    o_all = torch.empty(B, Hq, T, D, dtype=acc, device=query.device)
    ln_all = torch.empty(B, Hq, T, dtype=acc, device=query.device)
    pos = torch.arange(T, device=query.device)
    C = _SIM["qchunk"] or 256
    for q0 in range(0, T, C):
        q1 = min(T, q0 + C)
        k0 = max(0, q0 - W + 1)
        qi, kj = pos[q0:q1], pos[k0:q1]
        fr = fresh(qi, kj, sink, recent, key_group)  # (c, n) exact?
        band = (kj[None, :] <= qi[:, None]) & (kj[None, :] > qi[:, None] - W)
        K, V = key[..., k0:q1, :].repeat_interleave(rep, 1), value[..., k0:q1, :].repeat_interleave(rep, 1)
        q = query[:, :, q0:q1]  # (B, Hq, c, D)
        mixed = not bool((fr | ~band).all())  # token-granular groups: the band is all exact
        s = q @ K.transpose(-1, -2)  # (B, Hq, c, n)
        if mixed:
            Kh, Vh = kh[..., k0:q1, :].repeat_interleave(rep, 1), vh[..., k0:q1, :].repeat_interleave(rep, 1)
            s = torch.where(fr, s, q @ Kh.transpose(-1, -2))
        s = s.to(acc).mul_(scale).masked_fill_(~band, float("-inf"))
        m = s.amax(-1, keepdim=True)  # every row has its own key in the band: finite
        e = torch.exp(s - m)
        z = e.sum(-1, keepdim=True)
        if mixed:
            frf = fr.to(e.dtype)
            o_all[:, :, q0:q1] = ((e * frf) @ V.to(acc) + (e * (1 - frf)) @ Vh.to(acc)) / z  # (B, Hq, c, D)
        else:
            o_all[:, :, q0:q1] = (e @ V.to(acc)) / z
        ln_all[:, :, q0:q1] = (m + torch.log(z))[..., 0]
    return o_all, ln_all


def _band(query, key, value, kh, vh, sink: int, recent: int, key_group: int, W: int, scale: float):
    """Attention of every query i over its band i - W < j <= i (exact or stored K/V per the fresh mask),
    with its log-sum-exp: (B, Hq, T, D) float32, (B, Hq, T) float32.

    Queries go in blocks of C (16 for a narrow band, else 64), each reading the window of C + W - 1 keys
    ending at its last query, all blocks in one batched matmul per product; query heads are grouped per
    KV head (no repeat_kv). Scores are the model dtype's matmul, softmax and values in float32, as before
    (the previous loop took blocks of 256 queries over 256 + W - 1 keys: ~2x the work for the serving
    band, ~9x for strict's 16-token band)."""
    B, Hq, T, D = query.shape
    Hkv = key.shape[1]
    rep = Hq // Hkv
    C = _SIM["qchunk"] or (16 if W <= 32 else 64)  # W <= 64 here (sim_attention's choice)
    nb = -(-T // C)
    Tp, n = nb * C, C + W - 1
    dev = query.device
    pq = torch.arange(Tp, device=dev).view(nb, C)  # query positions per block
    pk = (torch.arange(nb, device=dev) * C - (W - 1))[:, None] + torch.arange(n, device=dev)  # (nb, n) key positions
    band = (pk[:, None, :] <= pq[:, :, None]) & (pk[:, None, :] > pq[:, :, None] - W) & (pk >= 0)[:, None, :]  # (nb, C, n)
    fr = _fresh_pairs(pq[:, :, None], pk[:, None, :], sink, recent, key_group)  # (nb, C, n): exact?
    mixed = not bool((fr | ~band).all())  # token-granular groups: the band is all exact

    def win(x):  # (B, Hkv, T, D) -> (B, Hkv, nb, D, n): block i's window of keys, transposed (a strided view)
        return F.pad(x, (0, 0, W - 1, Tp - T)).unfold(2, n, C)

    q = F.pad(query, (0, 0, 0, Tp - T)).view(B, Hkv, rep, nb, C, D).transpose(2, 3).reshape(B, Hkv, nb, rep * C, D)
    s = (q @ win(key)).view(B, Hkv, nb, rep, C, n)  # model dtype, as a plain attention's scores
    if mixed:
        s = torch.where(fr[:, None], s, (q @ win(kh)).view(B, Hkv, nb, rep, C, n))
    acc = torch.promote_types(query.dtype, torch.float32)  # float32, or float64 for a float64 model (the tune)
    s = s.to(acc).mul_(scale).masked_fill_(~band[:, None], float("-inf"))
    m = s.amax(-1, keepdim=True)  # every query has its own key in the band: finite
    e = torch.exp(s - m)
    z = e.sum(-1, keepdim=True)
    vw = win(value).to(acc).transpose(-1, -2)  # (B, Hkv, nb, n, D)
    if mixed:
        frf = fr[:, None].to(e.dtype)
        vhw = win(vh).to(acc).transpose(-1, -2)
        o = (e * frf).view(B, Hkv, nb, rep * C, n) @ vw + (e * (1 - frf)).view(B, Hkv, nb, rep * C, n) @ vhw
    else:
        o = e.view(B, Hkv, nb, rep * C, n) @ vw  # (B, Hkv, nb, rep*C, D)
    o = (o.view(B, Hkv, nb, rep, C, D) / z).transpose(2, 3).reshape(B, Hq, Tp, D)[:, :, :T]
    ln = (m + torch.log(z)).transpose(2, 3).reshape(B, Hq, Tp)[:, :, :T]
    return o, ln


def dense_sim_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    """The same masked attention as a dense (T, T) softmax over both K/V versions: the reference
    `sim_attention` is tested against, and the baseline of bench/validate_speed.py."""
    lq = _SIM["quant"][module.layer_idx]
    p = _SIM["protocol"]
    B, Hq, T, D = query.shape
    sink = min(p.sink, T)
    b = lq.quantized_until(T, sink, 0)
    kh, vh = key.clone(), value.clone()
    kh[..., sink:b, :] = lq.keys(key[..., sink:b, :])
    vh[..., sink:b, :] = lq.values(value[..., sink:b, :])
    rep = Hq // key.shape[1]
    K, V = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)  # (B, Hq, T, D)
    Kh, Vh = kh.repeat_interleave(rep, 1), vh.repeat_interleave(rep, 1)
    fresh = fresh_mask(T, sink, p.recent, lq.key_group, query.device)  # (T, T)
    pos = torch.arange(T, device=query.device)
    scale = scaling if scaling is not None else D ** -0.5
    out = torch.empty_like(query)
    C = 512
    for q0 in range(0, T, C):
        q = query[:, :, q0:q0 + C]  # (B, Hq, c, D)
        fr = fresh[q0:q0 + C]  # (c, T)
        causal = pos[None, :] <= pos[q0:q0 + C, None]
        s = torch.where(fr, q @ K.transpose(-1, -2), q @ Kh.transpose(-1, -2)) * scale  # (B, Hq, c, T)
        s = s.masked_fill(~causal, float("-inf"))
        w = torch.softmax(s.float(), dim=-1).to(query.dtype)
        frf = fr.to(w.dtype)
        out[:, :, q0:q0 + C] = (w * frf) @ V + (w * (1 - frf)) @ Vh
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    for name, fn in (("oscar_sim", sim_attention), ("oscar_sim_dense", dense_sim_attention)):
        AttentionInterface.register(name, fn)
        AttentionMaskInterface.register(name, sdpa_mask)  # our functions apply causality themselves


class simulated:
    """Context manager: the model's attention reads K/V through `art` under `protocol` (dense: the reference)."""

    def __init__(self, model, art, protocol, dense: bool = False):
        self.model, self.protocol, self.dense = model, protocol, dense
        self.quant = [LayerQuant(art, l, protocol.pages) for l in range(art.num_layers)]

    def __enter__(self):
        _register()
        self.prev = self.model.config._attn_implementation
        _SIM.update(quant=self.quant, protocol=self.protocol)
        self.model.set_attn_implementation("oscar_sim_dense" if self.dense else "oscar_sim")
        return self

    def __exit__(self, *exc):
        self.model.set_attn_implementation(self.prev)
        _SIM.update(quant=None, protocol=None)
