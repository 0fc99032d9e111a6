"""A bound on how far two float32 evaluations of the same window NLL can lie apart, derived from the tensors of one
run (test helper, not a test): the engine-parity tests compare the simulator and OscarCache against it.

Both engines compute one function f (the window's summed next-token NLL under a method's cache at the matched
protocol) in float32 with different operation orders and shapes: SDPA / the native kernel / the torch prefill
path / the decode kernel for attention, and the same linears and norms applied to chunks of other sizes. Each
computation is the exact one plus rounding at every reduction site. With u = 2^-24 and gamma(n) = n u / (1 - n u),
the standard bound for a length-n dot product (Higham, "Accuracy and Stability of Numerical Algorithms", 3.1) is
|fl(x . y) - x . y| <= gamma(n) |x| . |y|, whatever the summation order. Per site, for one evaluation:

- a linear layer y = x W^T (+ b):            |dy| <= gamma(in + 1) (|x| |W|^T + |b|)
- an RMSNorm y = w x / sqrt(mean x^2 + eps):  |dy| <= gamma(H + 4) |y|        (H summed squares, a root, a division)
- attention o_i = sum_j p_ij v_j, p = softmax(s), s_ij = scale q_i . k_j, computed in the model space (simulator)
  or in the rotated space (q R_Q) . ((k - mu) R_K) + q . mu and (sum_j p_ij v_rot_j) R_V^T (the cache): every
  order's score error is within e_ij = scale gamma(3D + 4) (|q| . |k| + (|q| |R_Q|) . (|k - mu| |R_K|) + |q| . |mu|);
  to first order the softmax moves p_ij by at most p_ij (e_ij + sum_k p_ik e_ik + gamma(T + 4)) (the shift by the
  row maximum is exact, the normaliser sums T terms), and the value sum adds gamma(T + 2D) sum_j p_ij |v~_j|, with
  |v~| = |v| + (|v| |R_V|) |R_V|^T covering both value orders. Keys and values are each query's effective ones:
  exact inside the protocol's fresh window, the fake-quantized reading outside.

The two evaluations differ by at most twice one evaluation's error at every site, a_e = 2 |df/dy_e| err_e for
element e of a site's output once f is linearised around the run (first order in u, the standard forward error
analysis; df/dy by autograd on the same run); the final sum of T non-negative per-token terms adds at most u f per
addition. Summing every a_e is the worst case ("worst": every rounding error at its extreme, with the sign that
hurts), orders of magnitude above what float32 does. The bound used ("bound") is the probabilistic one of Higham
and Mary (SIAM J. Sci. Comput. 41(5), 2019): rounding errors modelled as independent, mean zero, each within its
deterministic bound, so by Hoeffding's inequality |f_cache - f_sim| <= LAMBDA sqrt(sum_e a_e^2) except with
probability 2 exp(-LAMBDA^2 / 2). Not covered, and said so where the bound is used: second-order terms (O(u^2)
relative) and a 2-bit code that flips because a pre-quantization value lies within rounding distance of a decision
boundary (a discrete change; the engines quantize the same rounded values only up to that distance).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

U32 = 2.0 ** -24
LAMBDA = 6.0  # the probabilistic bound's width: exceeded with probability <= 2 exp(-LAMBDA^2 / 2) = 3e-8


def gamma(n: int, u: float = U32) -> float:
    return n * u / (1 - n * u)


def engine_nll_bound(model, art, protocol, ids: torch.Tensor) -> dict:
    """{"bound": the first-order bound on |NLL_cache - NLL_sim| (nats, summed over the window), "nll": the window's
    NLL, "sites": {kind: its share}} for a float32 `model`, method artifact `art` at simulator `protocol`
    (the cache engine's matched one), window ids (1, T)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from oscar.kernels.simulate import LayerQuant
    from oscar.kernels.window_attention import fresh_mask

    assert next(model.parameters()).dtype == torch.float32, "the bound is for a float32 model"
    quant = [LayerQuant(art, l, protocol.pages) for l in range(art.num_layers)]
    sites: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # (kind, output kept for its grad, one evaluation's error)

    def keep(kind: str, y: torch.Tensor, err: torch.Tensor) -> None:
        if y.requires_grad:
            y.retain_grad()
            sites.append((kind, y, err.detach()))

    def attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
        l, lq = module.layer_idx, quant[module.layer_idx]
        B, Hq, T, D = query.shape
        Hkv = key.shape[1]
        rep = Hq // Hkv
        sink = min(protocol.sink, T)
        b = lq.quantized_until(T, sink, 0)
        with torch.no_grad():
            kh, vh = key.clone(), value.clone()  # (B, Hkv, T, D): the stored reading outside the fresh window
            kh[..., sink:b, :] = lq.keys(key[..., sink:b, :])
            vh[..., sink:b, :] = lq.values(value[..., sink:b, :])
        fr = fresh_mask(T, sink, protocol.recent, lq.key_group, query.device)  # (T, T) exact?
        causal = torch.ones(T, T, dtype=torch.bool, device=query.device).tril()
        scale = scaling if scaling is not None else D ** -0.5
        K, V = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)  # (B, Hq, T, D)
        Kh, Vh = kh.repeat_interleave(rep, 1), vh.repeat_interleave(rep, 1)
        s = torch.where(fr, query @ K.transpose(-1, -2), query @ Kh.transpose(-1, -2)) * scale  # (B, Hq, T, T)
        p = torch.softmax(s.masked_fill(~causal, float("-inf")), -1)
        frf = fr.to(p.dtype)
        out = (p * frf) @ V + (p * (1 - frf)) @ Vh  # (B, Hq, T, D)
        with torch.no_grad():
            rq = (art.rot_q[l] if art.rot_q is not None else art.rot_k[l]).float().abs().repeat_interleave(rep, 0)
            rk = art.rot_k[l].float().abs().repeat_interleave(rep, 0)  # (Hq, D, D)
            rv = art.rot_v[l].float().abs().repeat_interleave(rep, 0)
            mu = (art.k_mean[l].float().repeat_interleave(rep, 0)[None, :, None, :] if art.k_mean is not None
                  else torch.zeros(1, Hq, 1, D))  # (1, Hq, 1, D)
            aq = query.detach().abs()
            aqr = aq @ rq  # (B, Hq, T, D)

            def score_mag(k):  # |q|.|k| + (|q||R_Q|).(|k - mu||R_K|) + |q|.|mu|: (B, Hq, T, T)
                return aq @ k.abs().transpose(-1, -2) + aqr @ ((k - mu).abs() @ rk).transpose(-1, -2) + aq @ mu.abs().transpose(-1, -2)

            e = torch.where(fr, score_mag(K), score_mag(Kh)) * scale * gamma(3 * D + 4)
            e = e.masked_fill(~causal, 0)
            pd = p.detach()
            a = pd * (e + (pd * e).sum(-1, keepdim=True) + gamma(T + 4) + gamma(T + 2 * D))  # (B, Hq, T, T)
            vt = lambda v: v.abs() + (v.abs() @ rv) @ rv.transpose(-1, -2)  # noqa: E731  (B, Hq, T, D)
            err = (a * frf) @ vt(V) + (a * (1 - frf)) @ vt(Vh)  # (B, Hq, T, D)
        o = out.transpose(1, 2)  # (B, T, Hq, D)
        keep("attention", o, err.transpose(1, 2))
        return o, None

    def linear_hook(mod, inp, out):
        x = inp[0]
        with torch.no_grad():
            err = x.abs() @ mod.weight.abs().t()  # (..., out)
            if mod.bias is not None:
                err = err + mod.bias.abs()
            err = err * gamma(mod.in_features + 1)
        keep("linear", out, err)

    def norm_hook(mod, inp, out):
        keep("norm", out, out.detach().abs() * gamma(inp[0].shape[-1] + 4))

    name = "oscar_rounding_bound"
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    prev = model.config._attn_implementation
    hooks = []
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            hooks.append(m.register_forward_hook(linear_hook))
        elif type(m).__name__.endswith("RMSNorm"):
            hooks.append(m.register_forward_hook(norm_hook))
    model.set_attn_implementation(name)
    try:
        with torch.enable_grad():
            emb = model.get_input_embeddings()(ids).detach().requires_grad_(True)  # (1, T, H): the graph's root
            logits = model(inputs_embeds=emb, use_cache=False).logits[0, :-1].float()  # (T - 1, V)
            nll = F.cross_entropy(logits, ids[0, 1:], reduction="sum")
            nll.backward()
    finally:
        for h in hooks:
            h.remove()
        model.set_attn_implementation(prev)
    shares: dict[str, float] = {}
    squares = 0.0
    for kind, y, err in sites:
        a = y.grad.abs() * 2 * err  # each element's reach on f: |df/dy| x the two evaluations' gap
        shares[kind] = shares.get(kind, 0.0) + float(a.sum())
        squares += float((a.double() ** 2).sum())
    T, f = ids.shape[1], float(nll.detach())
    shares["final sum"] = gamma(T) * f  # T non-negative terms: every partial sum <= f
    squares += T * (U32 * f) ** 2  # a rounding of at most u x (a partial sum <= f) per addition
    model.zero_grad(set_to_none=True)
    return {"worst": sum(shares.values()), "bound": LAMBDA * squares ** 0.5, "nll": f, "sites": shares}
