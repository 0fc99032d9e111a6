"""Brute-force float64 reference for the calibration statistics (test helper, not a test).

Independent of pipeline/capture.py: no hooks and no attention function. The layer inputs come
from a plain forward with `output_hidden_states=True`; q, k, v are recomputed from the layer's
own weights (norm, projections, optional q/k-norm) with an explicit rotate-half RoPE; the
attention probabilities S are an explicit softmax matrix; every statistic is accumulated with
explicit Python loops over sequences, heads and positions.

Import it from a test with `from helpers import capture_reference as ref`.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, D); cos/sin: (T, rd). Rotate-half convention on the first rd channels."""
    rd = cos.shape[-1]
    h = rd // 2
    y = x.clone()
    for i in range(h):
        a, b = x[:, i], x[:, i + h]
        y[:, i] = a * cos[:, i] - b * sin[:, i]
        y[:, i + h] = b * cos[:, i + h] + a * sin[:, i + h]
    return y


def layer_qkvo(model, layer: int, hidden: torch.Tensor, mask: torch.Tensor, *, softmax_dtype=torch.float64,
               offsets=None):
    """Recompute q (B,Hq,T,D), k, v (B,Hkv,T,D), S (B,Hq,T,T) and o = S V (B,Hq,T,D) for one layer;
    sequence b's RoPE positions start at offsets[b] (default 0)."""
    base = model.model
    lay = base.layers[layer]
    at = lay.self_attn
    B, T, _ = hidden.shape
    D = at.head_dim
    x = lay.input_layernorm(hidden)                                   # (B, T, hidden)
    lin = lambda m, t: t @ m.weight.T + (m.bias if m.bias is not None else 0)  # noqa: E731
    q = lin(at.q_proj, x).view(B, T, -1, D)
    k = lin(at.k_proj, x).view(B, T, -1, D)
    v = lin(at.v_proj, x).view(B, T, -1, D)
    if getattr(at, "q_norm", None) is not None and getattr(at, "use_qk_norm", True):
        q, k = at.q_norm(q), at.k_norm(k)
    q, k, v = q.transpose(1, 2).clone(), k.transpose(1, 2).clone(), v.transpose(1, 2).clone()
    off = torch.zeros(B, dtype=torch.long) if offsets is None else torch.as_tensor(offsets, dtype=torch.long)
    pos = off[:, None] + torch.arange(T)[None]                        # (B, T)
    cos, sin = base.rotary_emb(hidden, pos)                           # (B, T, rd)
    Hq, Hkv = q.shape[1], k.shape[1]
    for b in range(B):
        for h in range(Hq):
            q[b, h] = _rope(q[b, h], cos[b], sin[b])
        for h in range(Hkv):
            k[b, h] = _rope(k[b, h], cos[b], sin[b])
    G = Hq // Hkv
    S = torch.zeros(B, Hq, T, T, dtype=torch.float64)
    o = torch.zeros(B, Hq, T, D, dtype=torch.float64)
    for b in range(B):
        allowed = torch.tril(torch.ones(T, T, dtype=torch.bool)) & mask[b].bool()[None, :]  # causal & key padding
        for h in range(Hq):
            sc = (q[b, h] @ k[b, h // G].T) * at.scaling
            sc = torch.where(allowed, sc, torch.tensor(-torch.inf, dtype=sc.dtype))
            S[b, h] = torch.softmax(sc.to(softmax_dtype), dim=-1).double()
            for i in range(T):  # only allowed keys: a NaN value behind the mask must not leak in
                keep = allowed[i]
                o[b, h, i] = S[b, h, i, keep] @ v[b, h // G][keep]
    return q.double(), k.double(), v.double(), S, o


def reservoir_keys(seed: int, block: int, layer: int, S: int, G: int, T: int):
    h = hashlib.sha256(f"oscar-reservoir/{seed}/{block}/{layer}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(h[:8], "little") & ((1 << 63) - 1))
    kv = torch.rand(S, T, generator=g, dtype=torch.float64)
    qo = torch.rand(S, T, G, generator=g, dtype=torch.float64)
    return kv, qo


def block_reference(model, tokens: torch.Tensor, mask: torch.Tensor, *, layers, sink: int, reservoir: int,
                    seed: int, block: int, softmax_dtype=torch.float64, check_identity: bool = True,
                    seqs_per_block: int | None = None, offsets=None) -> dict:
    """Expected store arrays of one block: {layer: {name: ndarray}} (tokens, mask: (S, T)); sequence b read at
    RoPE positions offsets[b] + t (default 0)."""
    S_, T = tokens.shape
    off = torch.zeros(S_, dtype=torch.long) if offsets is None else torch.as_tensor(offsets, dtype=torch.long)
    with torch.no_grad():
        out = model.model(input_ids=tokens, attention_mask=mask, position_ids=off[:, None] + torch.arange(T)[None],
                          output_hidden_states=True, use_cache=False)
    hs = out.hidden_states
    res = {}
    for l in layers:
        with torch.no_grad():
            q, k, v, S, o = layer_qkvo(model, l, hs[l].double(), mask, softmax_dtype=softmax_dtype, offsets=off)
        Hq, Hkv, D = q.shape[1], k.shape[1], q.shape[-1]
        G = Hq // Hkv
        # counted rows: real, position >= sink, everything finite
        eligible = np.zeros((S_, T), bool)
        for b in range(S_):
            p = 0
            for t in range(T):
                if mask[b, t]:
                    eligible[b, t] = p >= sink
                    p += 1
        fin = np.zeros((S_, T), bool)
        for b in range(S_):
            for t in range(T):
                # o as the model computed it is non-finite iff the layer's output row is (o_proj, residual)
                fin[b, t] = (all(bool(torch.isfinite(z[b, :, t]).all()) for z in (q, k, v, o))
                             and bool(torch.isfinite(hs[l + 1][b, t]).all()))
        ok = eligible & fin
        r = {}
        X = {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "o": o.numpy()}
        for x in ("q", "k", "v", "o"):
            gram, s1 = np.zeros((Hkv, D, D)), np.zeros((Hkv, D))
            m3, m4, amax = np.zeros((Hkv, D)), np.zeros((Hkv, D)), np.zeros((Hkv, D))
            for h in range(Hkv):
                heads = range(h * G, (h + 1) * G) if x in "qo" else [h]
                for b in range(S_):
                    for t in range(T):
                        if not ok[b, t]:
                            continue
                        for hh in heads:
                            row = X[x][b, hh, t]
                            gram[h] += np.outer(row, row)
                            s1[h] += row
                            m3[h] += row ** 3
                            m4[h] += row ** 4
                            amax[h] = np.maximum(amax[h], np.abs(row))
            r.update({f"{x}_gram": gram, f"{x}_sum": s1, f"{x}_m3": m3, f"{x}_m4": m4, f"{x}_absmax": amax})
        n = int(ok.sum())
        r["kv_count"], r["q_count"] = n, n * G
        r["nonfinite"] = int((eligible & ~fin).sum())
        # published value target with C_Q of the same sequence
        vw, ws = np.zeros((Hkv, D, D)), np.zeros(Hkv)
        for b in range(S_):
            nb = int(ok[b].sum())
            for h in range(Hkv):
                cq = np.zeros((D, D))
                for t in range(T):
                    if ok[b, t]:
                        for hh in range(h * G, (h + 1) * G):
                            cq += np.outer(X["q"][b, hh, t], X["q"][b, hh, t])
                cq /= max(nb * G, 1)
                for t in range(T):
                    if ok[b, t]:
                        kt, vt = X["k"][b, h, t], X["v"][b, h, t]
                        w = kt @ cq @ kt
                        vw[h] += w * np.outer(vt, vt)
                        ws[h] += w
        r["vw_gram"], r["w_sum"] = vw, ws
        r["rows_k"] = np.stack([np.array([X["k"][b, h, t] for b in range(S_) for t in range(T) if ok[b, t]])
                                for h in range(Hkv)])            # (Hkv, n, D) counted key rows
        # C_S = V^T S^T S V over counted query rows, with the explicit S
        if check_identity:
            cs = np.zeros((Hkv, D, D))
            for b in range(S_):
                rows = np.flatnonzero(ok[b])
                for hq in range(Hq):
                    Sm = S[b, hq].numpy()[rows]                      # (n, T)
                    Vm = np.nan_to_num(X["v"][b, hq // G])           # (T, D); masked keys have S = 0
                    cs[hq // G] += Vm.T @ Sm.T @ Sm @ Vm
            r["cs_identity"] = cs
        # reservoirs: R smallest keys among counted rows
        if reservoir:
            kkv, kqo = reservoir_keys(seed, block, l, seqs_per_block or S_, G, T)
            cand = sorted((float(kkv[b, t]), b, t) for b in range(S_) for t in range(T) if ok[b, t])[:reservoir]
            for x in ("k", "v"):
                a = np.zeros((Hkv, reservoir, D), np.float32)
                for i, (_, b, t) in enumerate(cand):
                    a[:, i] = X[x][b, :, t]
                r[f"{x}_res"] = a
            r["res_count"] = len(cand)
            cand = sorted((float(kqo[b, t, g]), b, g, t) for b in range(S_) for g in range(G)
                          for t in range(T) if ok[b, t])[:reservoir]
            for x in ("q", "o"):
                a = np.zeros((Hkv, reservoir, D), np.float32)
                for i, (_, b, g, t) in enumerate(cand):
                    for h in range(Hkv):
                        a[h, i] = X[x][b, h * G + g, t]
                r[f"{x}_res"] = a
            r["qo_res_count"] = len(cand)
        res[l] = r
    return res


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = np.abs(b).max() if b.size else 0.0
    return float(np.abs(a - b).max() / scale) if scale > 0 else float(np.abs(a - b).max()) if a.size else 0.0


def compare(got: dict, want: dict, *, tol: float = 1e-10, res_tol: float = 1e-6) -> list[str]:
    """Names (with errors) of arrays in `want` that `got` misses or does not match."""
    bad = []
    for name, w in want.items():
        if name.startswith("rows_"):
            continue
        if name == "cs_identity":
            g = got["o_gram"]
        else:
            g = got[name]
        if name.endswith("_res"):
            # float32 copies of float64 reference rows (the model may also differ in the last bits)
            e = rel_err(g, w)
            if e > res_tol:
                bad.append(f"{name}: {e:.3g}")
        elif name.endswith("count") or name == "nonfinite":
            if int(np.asarray(g)) != int(w):
                bad.append(f"{name}: {int(np.asarray(g))} != {w}")
        else:
            e = rel_err(g, w)
            if not (e <= tol):
                bad.append(f"{name}: {e:.3g}")
    return bad


# --------------------------------------------------------------------------- test models and data

VOCAB = 97


def make_model(kind: str, seed: int = 0):
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=3,
                  max_position_embeddings=256, rms_norm_eps=1e-6)
    if kind == "llama":      # GQA 6 q / 2 kv heads, head_dim 10 (not a power of two)
        cfg = tf.LlamaConfig(num_attention_heads=6, num_key_value_heads=2, head_dim=10, **common)
        cls = tf.LlamaForCausalLM
    elif kind == "qwen3":    # q/k-norm, MQA (3 q heads share 1 kv head)
        cfg = tf.Qwen3Config(num_attention_heads=3, num_key_value_heads=1, head_dim=16, **common)
        cls = tf.Qwen3ForCausalLM
    elif kind == "glm4moe":  # partial RoPE (0.5), qkv bias, q/k-norm, dense first layer then experts
        cfg = tf.Glm4MoeConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=12, attention_bias=True,
                               use_qk_norm=True, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                               n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                "partial_rotary_factor": 0.5}, **common)
        cls = tf.Glm4MoeForCausalLM
    else:
        raise ValueError(kind)
    cfg._attn_implementation = "sdpa"
    model = cls(cfg).double().eval()
    if kind == "glm4moe":  # grouped_mm has no float64 kernel; the per-expert loop does
        model.set_experts_implementation("eager")
    with torch.no_grad():  # random biases and norm weights so that nothing is trivially symmetric
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    return model


def batch_data(S=3, T=13, seed=0, pad=(0, 4, 9)):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (S, T), generator=g)
    mask = torch.ones(S, T, dtype=torch.long)
    for s, p in enumerate(pad[:S]):
        if p:
            mask[s, T - p:] = 0  # right padding
    return tokens, mask
