"""Error metrics of a KV codec on one test context (seed 004's isolation metrics).

Inputs are one head's test queries q (M, D), keys/values k, v (T, D) and their
decoded versions. Logits are s = q k^T / sqrt(D), attention o = softmax(s) v.

- relmse_x = |X - X^|^2 / |X|^2 (Frobenius), cos_x = mean row cosine, for x in k, v, o.
- o_k / o_v: the output error with only K (resp. only V) compressed — the K-path /
  V-path decomposition.
- d2: seed 004's 2-D error metric on the attention output, the squared distance of
  the point (relMSE_O, 1 - cos_O) from the origin (docs/decisions/0004-ablation-harness.md).
- err6: the 6-D error geometry (relmse, 1-cos) x (K, V, O) and its norm.
- logit_var / logit_bias: variance and mean of eps = s^ - s over all (query, key) pairs.
- jensen_measured = E[exp(s + eps)] / exp(s) = mean over keys of exp(eps), per query;
  jensen_pred = exp(var(eps) / 2) with the variance over that query's keys; both
  averaged over queries: the softmax (convex) amplification of a zero-mean score error.
  jensen_log_*: log of the same per query, median over queries (robust; the report uses these). jensen_z is the
  measured partition-function ratio sum exp(s^) / sum exp(s), averaged over queries.
- topk: fraction of each query's true top-k keys that are in its estimated top-k.
"""

from __future__ import annotations

import math

import torch

GEOMETRY = ["relmse_k", "dir_k", "relmse_v", "dir_v", "relmse_o", "dir_o"]


def relmse(x: torch.Tensor, xh: torch.Tensor) -> float:
    return float(((xh - x) ** 2).sum() / (x**2).sum().clamp_min(1e-300))


def mean_cos(x: torch.Tensor, xh: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(x, xh, dim=-1, eps=1e-30).mean())


def topk_recall(s: torch.Tensor, sh: torch.Tensor, k: int) -> float:
    k = min(k, s.shape[-1])
    t = s.topk(k, -1).indices  # (M, k)
    e = sh.topk(k, -1).indices
    hit = (t.unsqueeze(-1) == e.unsqueeze(-2)).any(-1).float()  # (M, k)
    return float(hit.mean())


def compute_metrics(q, k, v, kh, vh, topk: int = 8) -> dict[str, float]:
    D = k.shape[-1]
    s = q @ k.T / math.sqrt(D)  # (M, T)
    sh = q @ kh.T / math.sqrt(D)
    eps = sh - s
    p, ph = torch.softmax(s, -1), torch.softmax(sh, -1)
    o, oh = p @ v, ph @ vh  # (M, D)
    m = {
        "relmse_k": relmse(k, kh), "cos_k": mean_cos(k, kh),
        "relmse_v": relmse(v, vh), "cos_v": mean_cos(v, vh),
        "relmse_o": relmse(o, oh), "cos_o": mean_cos(o, oh),
        "relmse_o_k": relmse(o, ph @ v), "relmse_o_v": relmse(o, p @ vh),
        "logit_var": float(eps.var()), "logit_bias": float(eps.mean()),
        "topk": topk_recall(s, sh, topk),
    }
    # per query over its keys (the softmax normalises per query), then averaged
    m["jensen_measured"] = float(torch.exp(eps).mean(-1).mean())
    m["jensen_pred"] = float(torch.exp(eps.var(-1) / 2).mean())
    # the same in log space, median over queries: robust to the rare catastrophic query
    # per-query centred: a per-query constant cancels in softmax, the spread is what inflates it
    ec = eps - eps.mean(-1, keepdim=True)
    lm = torch.logsumexp(ec, -1) - math.log(eps.shape[-1])  # (M,) log mean_k exp(eps - mean eps)
    m["jensen_log_measured"] = float(lm.median())
    m["jensen_log_pred"] = float((eps.var(-1) / 2).median())
    m["jensen_z"] = float((torch.logsumexp(sh, -1) - torch.logsumexp(s, -1)).exp().mean())
    for x in "kvo":
        m[f"dir_{x}"] = 1.0 - m[f"cos_{x}"]
    m["d2"] = m["relmse_o"] ** 2 + m["dir_o"] ** 2
    m["err6"] = math.sqrt(sum(m[g] ** 2 for g in GEOMETRY))
    return m
