"""The recipe's per-layer key widths: the copy probe through the model, and the artifact it chooses.

After the key-clip tune (oscar/recipe/tune.py), each layer's keys may be stored at 2, 3 or 4 bits (values at 2) within
the fit's bits per element. What decides it is retrieval from the INT2 history: the NLL of spans copied from
calibration text (the tune's copy windows), measured with one layer at a time widened (`layer_copy_errors`,
2L + 1 forwards) or to first order from one forward and backward per window (`layer_copy_gradients`, the
default). The widths minimise the summed change at the fit's mean bits by an exact DP (`layer_widths`), and the
chosen artifact is written in the cache's own per-layer format (`native_layer_artifact`): what OscarCache, the
Triton kernels and `oscar bench memory --artifact` serve (docs/decisions/0072-per-layer-widths-by-the-copy-probe-to-first.md).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace

import numpy as np
import torch
from tqdm import tqdm

from oscar.common import OscarError, narrower_on_ties
from oscar.kernels.grad_attention import (copy_nll_sum, drop_leaves, fresh_leaves, gradient_mode, layer_quants,
                                          window_sums)
from oscar.kernels.protocol import Protocol
from oscar.kernels.window_attention import simulated
from oscar.quant import fake_quant
from oscar.recipe.tune import TuneConfig, calibration_ids, copy_nll, copy_windows
from oscar.stats.artifact import Artifact
from oscar.scoring.layer_formats import derived_artifact, layer_spec, oscar_bits, store_layers
from oscar.scoring.dtype import with_dtype
from oscar.scoring.protocols import PROTOCOLS

COPY_OPTIONS = ((2, 2), (3, 2), (4, 2))  # keys at 2 / 3 / 4 bits, values at 2 (the cache's formats)


class StaleLog(OscarError):
    """A copy probe / gradient log written for other inputs."""


def _copy_ident(art, options, cfg) -> dict:
    """What a copy probe / gradient log was written for: a rerun resumes only the same artifact, options, config."""
    return {"store_fingerprint": (art.meta.get("provenance") or {}).get("store_fingerprint"),
            "clip_k": [round(float(c.float().mean()), 6) for c in art.clip_k], "options": [list(o) for o in options],
            "copy": [cfg.copy_windows, cfg.copy_length, cfg.copy_span, cfg.copy_protocol, cfg.corpus, cfg.widths_dtype]}


def _read_log(log: str | None, ident: dict) -> list[dict]:
    if not log or not os.path.exists(log):
        return []
    recs = [json.loads(line) for line in open(log) if line.strip()]
    if any(r["ident"] != ident for r in recs):
        raise StaleLog(f"{log} was written for another artifact, options or copy config; use a new log")
    return recs


def _append_log(log: str | None, rec: dict) -> None:
    if log:
        with open(log, "a") as f:
            f.write(json.dumps(rec) + "\n")


def layer_copy_errors(model, tok, art, options, cfg: TuneConfig | None = None, log: str | None = None,
                      progress: bool = True):
    """Each layer's retrieval sensitivity to its width on calibration text (the per-layer key widths): (L, O) array,
    entry (l, o) the copied-span NLL per token (the copy objective's windows and protocol) with layer l alone at
    options[o] = (key bits, value bits) and every other layer at options[0], minus the all-options[0] NLL.

    One probe per (layer, wider option), each a forward of every copy window: L (O - 1) + 1 probes. Each probe's
    result is appended to `log` (JSONL) as it finishes; a rerun with the same log skips the probes found there
    and refuses a log written for another artifact, options or config."""
    cfg = cfg or TuneConfig()
    art.check_model(model.config)
    if cfg.copy_protocol not in PROTOCOLS:
        raise OscarError(f"tune: unknown copy protocol {cfg.copy_protocol!r}; known: {', '.join(PROTOCOLS)}")
    base = tuple(options[0])
    if base != (art.quant.bits, art.quant.bits):
        raise OscarError(f"layer copy errors: options[0] must be the artifact's own width {art.quant.bits}, got {base}")
    L = art.num_layers
    ident = _copy_ident(art, options, cfg)
    done = {(r["layer"], r["option"]): r["nll"] for r in _read_log(log, ident)}
    with_dtype(model, cfg.widths_dtype)
    cp = PROTOCOLS[cfg.copy_protocol]
    text = calibration_ids(tok, cfg.corpus, cfg.copy_windows * (cfg.copy_length - cfg.copy_span))
    dev = next(model.parameters()).device  # where the run put the model (the tune's --device)
    wins = [(w.to(dev), pos.to(dev)) for w, pos, _ in
            copy_windows(text, cfg.copy_windows, cfg.copy_length, cfg.copy_span, cp.sink, cp.recent)]
    n_tok = sum(len(pos) for _, pos in wins)
    probes = [(-1, 0)] + [(l, o) for l in range(L) for o in range(1, len(options))]  # (-1, 0): every layer at the base
    todo = [p for p in probes if p not in done]
    if progress:
        todo = tqdm(todo, desc="layer copy probes", unit="probe", initial=len(probes) - len(todo), total=len(probes))
    for l, o in todo:
        widths = [list(base)] * L
        if l >= 0:
            widths = widths[:l] + [list(options[o])] + widths[l + 1:]
        a = widths_artifact(art, widths)
        s = 0.0
        with simulated(model, a, cp):
            for win, pos in wins:
                s += copy_nll(model, win, pos)[0]
        done[(l, o)] = s / n_tok
        _append_log(log, {"layer": l, "option": o, "nll": done[(l, o)], "ident": ident})
    err = np.zeros((L, len(options)))
    for l in range(L):
        for o in range(1, len(options)):
            err[l, o] = done[(l, o)] - done[(-1, 0)]  # (L, O)
    return err


def _check_gradients(art, options, cfg: TuneConfig, config) -> Protocol:
    """The estimate's inputs refused before any work; returns the copy protocol."""
    art.check_model(config)
    base = tuple(options[0])
    if base != (art.quant.bits, art.quant.bits) or any(b < art.quant.bits for o in options for b in o):
        raise OscarError(f"layer copy gradients: options must start at the artifact's own {art.quant.bits} bits and "
                         f"widen from there, got {options}")
    if cfg.copy_protocol not in PROTOCOLS:
        raise OscarError(f"tune: unknown copy protocol {cfg.copy_protocol!r}; known: {', '.join(PROTOCOLS)}")
    return PROTOCOLS[cfg.copy_protocol]


def gradient_windows(tok, cfg: TuneConfig, cp: Protocol) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The copy windows the estimate differentiates: (window (1, T), scored positions) each, on CPU."""
    text = calibration_ids(tok, cfg.corpus, cfg.copy_windows * (cfg.copy_length - cfg.copy_span))
    return [(w, pos) for w, pos, _ in copy_windows(text, cfg.copy_windows, cfg.copy_length, cfg.copy_span, cp.sink,
                                                   cp.recent)]


def _option_artifacts(art, options) -> list:
    """Per option, `art` with every layer at it: what the estimate's quantizers are built from."""
    return [widths_artifact(art, [list(o)] * art.num_layers) for o in options]


def _gradients_here(model, art, options, cfg: TuneConfig, cp: Protocol, wins: list, todo: list[int]):
    """(window, its (L, Hkv, O) sums) for each window in `todo`: a forward and backward through `model` here."""
    quants = layer_quants(_option_artifacts(art, options), cp)
    with_dtype(model, cfg.widths_dtype)
    dev = next(model.parameters()).device  # where the run put the model (the tune's --device)
    L = art.num_layers
    with gradient_mode(model, quants[0], cp):
        try:
            for i in todo:
                win, pos = wins[i][0].to(dev), wins[i][1].to(dev)
                fresh_leaves(L)
                with torch.enable_grad():
                    h = model.model(input_ids=win, use_cache=False).last_hidden_state  # (1, T, H)
                    copy_nll_sum(model.lm_head, h, win, pos).backward()
                yield i, window_sums(range(L), options, quants, art.num_kv_heads)
        finally:
            drop_leaves()


def layer_copy_gradients(model, tok, art, options, cfg: TuneConfig | None = None, log: str | None = None,
                         progress: bool = True, heads: bool = False, scorer=None):
    """`layer_copy_errors` to first order, from one forward and backward per copy window instead of L (O - 1) + 1
    forwards: entry (l, o) = Σ ⟨∂NLL/∂K̂_l, Q_o(K_l) − Q_0(K_l)⟩ per copied token, the gradient taken with every
    layer at options[0] (the probe's base) and Q_o layer l's key quantizer at options[o]; an option that widens the
    values adds ⟨∂NLL/∂V̂_l, Q_o(V_l) − Q_0(V_l)⟩ (first order: the two widenings add).

    heads=True: (L, Hkv, O), each KV head's share (the inner product restricted to its keys; they sum to the layer's).
    Each window's sums are appended to `log` (JSONL) as it finishes; a rerun with the same log skips those windows
    (the result is the same sum in the same order) and refuses a log written for another artifact, options or config.
    scorer: the pipeline stages (cluster/scoring.py) run each window's forward and backward, each stage summing its
    own layers (`model` and `tok` None then); the log is the same, so either resumes the other's."""
    cfg = cfg or TuneConfig()
    cp = _check_gradients(art, options, cfg, model.config if scorer is None else scorer.config)
    ident = {**_copy_ident(art, options, cfg), "estimate": "gradient"}  # a probe log is not a gradient log
    done = {r["window"]: r for r in _read_log(log, ident)}
    wins = gradient_windows(tok if scorer is None else scorer.tokenizer, cfg, cp)
    todo = [i for i in range(len(wins)) if i not in done]
    if not todo:  # the log holds every window: nothing runs (no stage is started)
        sums = []
    elif scorer is None:
        sums = _gradients_here(model, art, options, cfg, cp, wins, todo)
    else:
        sums = scorer.copy_gradients(_option_artifacts(art, options), options, cfg, [(i, *wins[i]) for i in todo])
    if progress:
        sums = tqdm(sums, desc="layer copy gradients", unit="window", initial=len(wins) - len(todo), total=len(wins))
    for i, w in sums:  # w (L, Hkv, O): this window's summed NLL change
        done[i] = {"window": i, "tokens": len(wins[i][1]), "sums": w.tolist(), "ident": ident}
        _append_log(log, done[i])
    est = np.zeros((art.num_layers, art.num_kv_heads, len(options)))
    for i in range(len(wins)):  # window order, so a resumed run sums exactly as an uninterrupted one
        est += np.asarray(done[i]["sums"])
    est /= sum(done[i]["tokens"] for i in range(len(wins)))  # (L, Hkv, O)
    return est if heads else est.sum(1)  # (L, O)


ESTIMATES = ("probe", "gradient")  # how each layer's copy NLL change is obtained: measured, or to first order
STAGED_PROBE = ("--widths copy measures each layer's probe in one process; with --ray pass --widths gradient (the "
                "default) or none")


def copy_widths_artifact(model, tok, fitted, cfg: TuneConfig | None = None, log: str | None = None,
                         progress: bool = True, estimate: str = "probe", scorer=None):
    """`oscar fit --widths copy|gradient` (and `oscar run`): each layer's copied-span NLL change at COPY_OPTIONS,
    measured (`layer_copy_errors`, 2L + 1 forwards) or to first order (`layer_copy_gradients`, one forward +
    backward per window), each resumable from `log`; the DP's widths at `fitted`'s bits per element, written as
    the cache's per-layer format (`native_layer_artifact`). Returns (artifact, the (L, 3) table).
    scorer: the gradient's windows on the pipeline stages (cluster/scoring.py), `model` and `tok` None."""
    if estimate not in ESTIMATES:
        raise OscarError(f"widths: unknown estimate {estimate!r}; known: {', '.join(ESTIMATES)}")
    if estimate == "probe" and scorer is not None:
        raise OscarError(STAGED_PROBE)
    if estimate == "probe":
        err = layer_copy_errors(model, tok, fitted, COPY_OPTIONS, cfg, log=log, progress=progress)
    else:
        err = layer_copy_gradients(model, tok, fitted, COPY_OPTIONS, cfg, log=log, progress=progress, scorer=scorer)
    art = layer_artifact(fitted, COPY_OPTIONS, "oscar-layer-copy-int2", err)
    art.meta["codec"]["estimate"] = estimate
    return native_layer_artifact(art), err


# ----------------------------------------------------------------- the widths' artifacts

def _rows(ls, max_kv: int = 1024, max_q: int = 128, seed: int = 0):
    """A layer's reservoir rows (H, N, D) float64 tensors, subsampled as the fit's clip search does."""
    q, k, v = ls.rows("q"), ls.rows("k"), ls.rows("v")
    if q is None or k is None or v is None:
        raise OscarError("per-layer widths record their error tables on the store's reservoir rows; this store has none")
    rng = np.random.default_rng(seed)
    pick = lambda n, m: slice(None) if n <= m else np.sort(rng.choice(n, m, replace=False))  # noqa: E731
    kv = pick(k.shape[1], max_kv)
    T = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float64))  # noqa: E731
    return T(q[:, pick(q.shape[1], max_q)]), T(k[:, kv]), T(v[:, kv])


def layer_widths(errs: np.ndarray, costs: np.ndarray, budget: float) -> list[int]:
    """The option per layer minimising the summed error with the mean cost <= budget (exact, by dynamic
    programming over costs in units of 1/64 bit). errs, costs (L, options) -> option index per layer."""
    L, O = errs.shape
    units = np.round(costs * 64).astype(int)  # (L, O)
    cap = int(math.floor(budget * L * 64 + 1e-6))
    INF = float("inf")
    best = np.full(cap + 1, INF)
    best[0] = 0.0
    choice = np.zeros((L, cap + 1), dtype=int)
    for l in range(L):
        new = np.full(cap + 1, INF)
        for o in range(O):
            u = units[l, o]
            if u > cap:
                continue
            cand = np.full(cap + 1, INF)
            cand[u:] = best[:cap + 1 - u] + errs[l, o]
            better = cand < new
            new[better], choice[l, better] = cand[better], o
        best = new
    if not np.isfinite(best).any():
        raise OscarError(f"per-layer widths: no width per layer fits {budget} bits/element")
    c, out = int(np.argmin(best)), []
    for l in range(L - 1, -1, -1):  # walk back
        o = int(choice[l, c])
        out.append(o)
        c -= units[l, o]
    return out[::-1]


def layer_artifact(fitted: Artifact, options: tuple[tuple, ...], method: str, copy_err: np.ndarray) -> Artifact:
    """Per-layer widths from oscar-int2's artifact, its store and a table measured through the model.

    oscar-int2's rotations and grid per layer at one of `options` (key width, value width): the base width
    with fp8 scale/zero (2.25 bits), wider ones with fp16 (3.5 / 4.5) and no clip. `copy_err` (L, options) is
    the objective, measured outside this module (`layer_copy_errors` /
    `layer_copy_gradients`: each layer alone at each option, the copied-span NLL change on calibration text);
    the widths minimise its sum at oscar-int2's mean bits per element (`layer_widths`). Recorded beside it,
    per layer and option, on the store's reservoir rows (S = softmax of the rows' q·k / sqrt(D)): the relative
    attention-output error ||Ŝ V̂ − S V||² / ||S V||² averaged over KV heads, and the share of query rows
    whose highest-scoring key changes.
    """
    D = fitted.head_dim
    if fitted.quant.key_axis != "token" or fitted.quant.mode != "minmax":
        raise OscarError(f"{method} re-widths oscar-int2's per-token min/max groups; --artifact groups keys otherwise")
    _, _, layers = store_layers(fitted, method)
    base = fitted.quant.bits
    copy_err = np.asarray(copy_err, dtype=float)
    if copy_err.shape != (len(layers), len(options)) or not np.isfinite(copy_err).all() or any(
            not isinstance(kb, int) for kb, _ in options):
        raise OscarError(f"{method}: copy_err must be a finite (layers {len(layers)}, options {len(options)}) "
                         f"table over uniform widths, got shape {copy_err.shape}")
    errs, tops, costs, n_rows = [], [], [], 0
    for l, ls in enumerate(layers):
        q, k, v = _rows(ls, seed=l)
        mu = fitted.k_mean[l].double()[:, None, :] if fitted.k_mean is not None else 0.0
        qr = q @ (fitted.rot_q or fitted.rot_k)[l].double()
        kr = (k - mu) @ fitted.rot_k[l].double()
        vr = v @ fitted.rot_v[l].double()
        S = torch.softmax(qr @ kr.transpose(-1, -2) / math.sqrt(D), -1)  # (H, Nq, N)
        o = S @ vr
        den = (o ** 2).sum((-1, -2))
        top = S.argmax(-1)  # (H, Nq) the key each query row reads most
        n_rows = max(n_rows, top.numel())
        row_e, row_t, row_c = [], [], []
        for kb, vb in options:
            vs = layer_spec(fitted, vb)
            vh = fake_quant(vr.float(), vs, fitted.clip_v[l].float().view(-1, 1, 1) if vb == base else 1.0).double()
            ks = layer_spec(fitted, kb)
            kh = fake_quant(kr.float(), ks, fitted.clip_k[l].float().view(-1, 1, 1) if kb == base else 1.0).double()
            Sh = torch.softmax(qr @ kh.transpose(-1, -2) / math.sqrt(D), -1)
            kbits = ks.bits_per_element(D)
            row_e.append(float(((((Sh @ vh) - o) ** 2).sum((-1, -2)) / den).mean()))
            row_t.append(float((Sh.argmax(-1) != top).double().mean()))
            row_c.append(0.5 * (kbits + vs.bits_per_element(D)))
        errs.append(row_e), tops.append(row_t), costs.append(row_c)
    errs, tops, costs = np.array(errs), np.array(tops), np.array(costs)
    # NLL changes through the model: a wider option within the spread between stores calibrated through different
    # kernels (oscar.common.STORE_TIE_TABLE) ties with the narrower, which the DP's rule then keeps (the lower cost)
    pick = layer_widths(narrower_on_ties(copy_err), costs, oscar_bits(fitted))
    widths = [list(options[o]) for o in pick]
    rot_k, rot_q = list(fitted.rot_k), list(fitted.rot_q or fitted.rot_k)
    clip_k, clip_v = _width_clips(fitted, widths)
    rec = {"kind": "layers", "widths": widths, "options": [list(o) for o in options], "base_params": "fp8",
           "wide_params": "fp16", "objective": "copied-span NLL change with the layer alone at the width "
                                                "(calibration text, oscar/recipe/widths.py)",
           "err": [[round(float(e), 6) for e in row] for row in errs],
           "err_total": round(float(errs[np.arange(len(pick)), pick].sum()), 6),
           "err_total_base": round(float(errs[:, 0].sum()), 6), "chosen_by": "copy",
           "top1_changed": [[round(float(e), 6) for e in row] for row in tops],
           "top1_total": round(float(tops[np.arange(len(pick)), pick].sum()), 6),
           "top1_total_base": round(float(tops[:, 0].sum()), 6), "top1_rows": int(n_rows),
           "copy_err": [[round(float(e), 6) for e in row] for row in copy_err]}
    out = derived_artifact(fitted, method, rec, {})
    return replace(out, rot_k=rot_k, rot_q=rot_q if fitted.rot_q is not None else None, clip_k=clip_k, clip_v=clip_v)


def _width_clips(fitted: Artifact, widths) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer (clip_k, clip_v): the fitted clips at the base width, none (ratio 1) at a wider one."""
    base, H = fitted.quant.bits, fitted.num_kv_heads
    return ([fitted.clip_k[l] if kb == base else torch.ones(H) for l, (kb, _) in enumerate(widths)],
            [fitted.clip_v[l] if vb == base else torch.ones(H) for l, (_, vb) in enumerate(widths)])


def widths_artifact(fitted: Artifact, widths, method: str = "oscar-layer-copy-int2", rec: dict | None = None) -> Artifact:
    """`fitted` with layer l's keys and values at widths[l] = (key bits, value bits): layer_artifact's format
    (the base width keeps its clips and fp8 scale/zero, a wider one fp16 and no clip) without its search; what
    a measured objective probes one layer at a time."""
    base, L = fitted.quant.bits, fitted.num_layers
    widths = [[int(kb), int(vb)] for kb, vb in widths]
    if len(widths) != L or any(not (base <= b <= 8) for w in widths for b in w):
        raise OscarError(f"{method}: widths must give (key, value) bits in {base}..8 for each of {L} layers, got {widths}")
    clip_k, clip_v = _width_clips(fitted, widths)
    out = derived_artifact(fitted, method, {"kind": "layers", "widths": widths, "base_params": "fp8", "wide_params": "fp16",
                                    **(rec or {})}, {})
    return replace(out, clip_k=clip_k, clip_v=clip_v)


def native_layer_artifact(art: Artifact) -> Artifact:
    """A "layers" codec artifact (the copy-chosen widths) in the cache's own per-layer format
    (`Artifact.layer_quant`, oscar-artifact/3): a layer's keys at base + 1 or + 2 bits become one wide part
    (key_split = D, key_top, fp16 key params), the base layers and every value keep the base grid with e4m3 params;
    the same grids, clips and rounding as the codec (tested: simulator and OscarCache agree). What OscarCache,
    the Triton kernels and `oscar bench memory --artifact` then serve. Refuses widths the cache has no format for
    (values wider than the base, keys more than 2 bits wider)."""
    c = art.meta.get("codec") or {}
    if c.get("kind") != "layers":
        raise OscarError(f"native_layer_artifact: the artifact has codec {c.get('kind')!r}, not per-layer widths ('layers')")
    base, D = art.quant, art.head_dim
    if base.key_split or base.key_axis != "token" or base.group_size or base.mode != "minmax" or base.clip_rule != "ratio":
        raise OscarError("native_layer_artifact: per-layer widths are built on one-group per-token min/max keys "
                         f"(key_split 0, key_axis token, group_size None, ratio clips); got {base}")
    q0 = replace(base, param_dtype="float8_e4m3fn")  # the codec's base grid: e4m3 scale/zero (codebooks.layer_spec)
    lq = []
    for l, (kb, vb) in enumerate(c["widths"]):
        if vb != base.bits or not base.bits <= int(kb) <= base.bits + 2:
            raise OscarError(f"native_layer_artifact: layer {l} has (key, value) widths ({kb}, {vb}); the cache stores "
                             f"values at {base.bits} bits and keys at {base.bits}..{base.bits + 2}")
        kb = int(kb)
        lq.append(q0 if kb == base.bits else replace(q0, key_split=D, key_top=kb - base.bits, key_param_dtype="float16"))
    # `variant` names the rotation recipe (refits of other methods read it): the base fit's, as the rotations are
    meta = {k: v for k, v in art.meta.items() if k not in ("codec", "base_variant")}
    meta["variant"] = art.meta.get("base_variant") or art.meta.get("variant")
    meta["layer_widths"] = {"method": art.meta.get("variant"),  # what chose them (probe tables, objective)
                            **{k: v for k, v in c.items() if k != "kind"}}
    out = replace(art, quant=q0, layer_quant=lq, meta=meta)
    out.validate()
    return out
