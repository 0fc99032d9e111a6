"""Calibration section of the report: plots + a JSON/Markdown fragment that `reports/` embeds.

Reads only the artifact (its metadata, through `oscar.artifact_header`, and eig_k / eig_v
tensors) and the store's root attributes; writes PNGs (matplotlib, Agg) into out_dir.
Imports no stage module (reports/ calls it).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import safetensors
import zarr

from oscar.artifact_header import read_metadata
from oscar.common import OscarError
from oscar.reports.plots import pyplot


def _spectra_plot(eigs: list[np.ndarray], title: str, path: str) -> None:
    plt = pyplot()
    L = len(eigs)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    cmap = plt.get_cmap("viridis")
    for l, w in enumerate(eigs):  # w (H, D): normalised per head, head-averaged for readability
        wn = w / np.maximum(w[:, :1], 1e-30)
        ax.semilogy(np.arange(1, w.shape[1] + 1), np.maximum(wn.mean(0), 1e-12), color=cmap(l / max(L - 1, 1)), lw=1)
    sm = plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(0, L - 1))
    fig.colorbar(sm, ax=ax, label="layer")
    ax.set(xlabel="eigenvalue index", ylabel="λ_i / λ_1 (mean over KV heads)", title=title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _heat(mat: np.ndarray, title: str, label: str, path: str, cmap: str = "viridis", vmin=None, vmax=None) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 1.2 + 0.25 * mat.shape[0]))
    im = ax.imshow(mat, aspect="auto", cmap=cmap, vmin=vmin, vmax=vmax, interpolation="nearest")
    ax.set(xlabel="layer", ylabel="KV head", title=title)
    fig.colorbar(im, ax=ax, label=label)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _clip_plot(ck: np.ndarray, cv: np.ndarray, mode: str, path: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    L = ck.shape[0]
    series = [(ck, "K"), (cv, "V")]
    if ck.ndim == 3:  # split keys: a ratio per head and part (L, H, 2)
        series = [(ck[..., 0], "K wide part (3-bit)"), (ck[..., 1], "K rest (2-bit)"), (cv, "V")]
    for c, name in series:
        ax.plot(np.arange(L), c.mean(1), marker="o", ms=3, label=f"{name} (mean over heads)")
        ax.fill_between(np.arange(L), c.min(1), c.max(1), alpha=0.2)
    ax.set(xlabel="layer", ylabel="clip ratio" if mode == "minmax" else "clip threshold (abs)", title="chosen clips")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def calibration_section(artifact_path: str, store_path: str | None, out_dir: str) -> dict[str, Any]:
    """Write plots and `calibration.json` / `calibration.md` into out_dir; return the summary dict
    ({"markdown", "json", "figures": [paths], "summary": {...}})."""
    os.makedirs(out_dir, exist_ok=True)
    meta = read_metadata(artifact_path)
    layers = meta.get("layers")
    if not layers:
        raise OscarError(f"{artifact_path}: artifact has no fit metadata (not produced by `oscar fit`)")
    with safetensors.safe_open(artifact_path, "np") as f:
        keys = set(f.keys())
        L = len(layers)
        eig_k = [f.get_tensor(f"layers.{l}.eig_k") for l in range(L) if f"layers.{l}.eig_k" in keys]
        eig_v = [f.get_tensor(f"layers.{l}.eig_v") for l in range(L) if f"layers.{l}.eig_v" in keys]
    store_attrs = {}
    if store_path:
        store_attrs = dict(zarr.open_group(store_path, mode="r").attrs)

    figs = []

    def out(name):
        p = os.path.join(out_dir, name)
        figs.append(p)
        return p

    if eig_k:
        _spectra_plot(eig_k, "K-side spectra (C_Q unless the variant says otherwise)", out("calib_spectrum_k.png"))
    if eig_v:
        _spectra_plot(eig_v, "V-side spectra (C_S unless the variant says otherwise)", out("calib_spectrum_v.png"))
    arr = lambda key, side: np.array([lm[key][side] for lm in layers], dtype=float).T  # (H, L)
    deff_k, deff_v = arr("d_eff", "k"), arr("d_eff", "v")
    stab_q, stab_o = arr("stability", "q"), arr("stability", "o")
    _heat(np.vstack([deff_k, deff_v]), "d_eff (top: K heads, bottom: V heads)", "d_eff", out("calib_deff.png"))
    _heat(np.vstack([stab_q, stab_o]), "leading-subspace stability across blocks (top: C_Q, bottom: C_S)",
          "median mean cos²", out("calib_stability.png"), cmap="magma", vmin=0, vmax=1)
    kq = arr("kurtosis", "q")
    ko = arr("kurtosis", "o") if "o" in layers[0]["kurtosis"] else kq
    _heat(np.log10(np.maximum(np.vstack([kq, ko]), 0) + 1), "excess kurtosis (top: q, bottom: o)",
          "log10(1 + median excess kurtosis)", out("calib_kurtosis.png"), cmap="inferno")
    ck = np.array([lm["clip_k"] for lm in layers])
    cv = np.array([lm["clip_v"] for lm in layers])
    mode = meta.get("quant", {}).get("mode", "minmax")
    _clip_plot(ck, cv, mode, out("calib_clips.png"))

    heavy = {x: int(sum(sum(lm["heavy"].get(x, [])) for lm in layers)) for x in layers[0]["heavy"]}
    summary = {
        "variant": meta.get("variant"),
        "model": meta.get("model", {}).get("name"),
        "store_fingerprint": meta.get("provenance", {}).get("store_fingerprint"),
        "store_format": store_attrs.get("format"),
        "blocks": len(meta.get("provenance", {}).get("blocks", [])),
        "partial": meta.get("provenance", {}).get("partial"),
        "tokens": meta.get("provenance", {}).get("tokens"),
        "d_eff_k": {"min": int(deff_k.min()), "median": float(np.median(deff_k)), "max": int(deff_k.max())},
        "d_eff_v": {"min": int(deff_v.min()), "median": float(np.median(deff_v)), "max": int(deff_v.max())},
        "stability_q_min": float(np.nanmin(stab_q)) if np.isfinite(stab_q).any() else None,
        "stability_o_min": float(np.nanmin(stab_o)) if np.isfinite(stab_o).any() else None,
        "heavy_heads": heavy,
        "pruned_eigenvalues": int(sum(len(p) for lm in layers for side in lm["pruned"].values() for p in side)),
        "fallbacks": sum(f.get("to", "hadamard") == "hadamard" for f in meta.get("fallbacks", [])),
        "clip_k": {"min": float(ck.min()), "mean": float(ck.mean()), "max": float(ck.max())},
        "clip_v": {"min": float(cv.min()), "mean": float(cv.mean()), "max": float(cv.max())},
        "clip_mode": mode,
    }
    rel = lambda p: os.path.basename(p)
    md = [
        "## Calibration",
        "",
        f"Variant `{summary['variant']}`, model `{summary['model']}`, store `{summary['store_fingerprint']}` "
        f"({summary['blocks']} blocks{', PARTIAL' if summary['partial'] else ''}, {summary['tokens']} tokens).",
        "",
        "| quantity | min | median/mean | max |",
        "|---|---|---|---|",
        f"| d_eff K | {summary['d_eff_k']['min']} | {summary['d_eff_k']['median']:.1f} | {summary['d_eff_k']['max']} |",
        f"| d_eff V | {summary['d_eff_v']['min']} | {summary['d_eff_v']['median']:.1f} | {summary['d_eff_v']['max']} |",
        f"| clip K ({mode}) | {summary['clip_k']['min']:.4g} | {summary['clip_k']['mean']:.4g} | {summary['clip_k']['max']:.4g} |",
        f"| clip V ({mode}) | {summary['clip_v']['min']:.4g} | {summary['clip_v']['mean']:.4g} | {summary['clip_v']['max']:.4g} |",
        "",
        f"Heavy-tailed heads (layer×head): {heavy}; pruned spurious eigenvalues: {summary['pruned_eigenvalues']}; "
        f"fallbacks to Hadamard: {summary['fallbacks']}.",
        "",
    ]
    tune = meta.get("clip_tuning")
    if tune:  # the recipe's tune: the cache uses the fit's key clips (table, plot) × the chosen factor
        summary["clip_tuning"] = tune
        c = tune.get("config", {})
        md += [f"Key clips tuned end to end: × **{tune['chosen_factor']}** (mean {tune['mean_clip_k_before']:.3f} → "
               f"{tune['mean_clip_k_after']:.3f}; the table and plot show the fit's clips), chosen by next-token NLL "
               f"on {c.get('tokens')} tokens of calibration text under the {c.get('protocol')} protocol: "
               + ", ".join(f"×{f} {v:.4f}" for f, v in tune["nll_per_token"].items()) + ".", ""]
    md += [f"![{rel(p)}]({rel(p)})" for p in figs]
    for fb in meta.get("fallbacks", [])[:20]:
        md.append(f"- fallback: layer {fb['layer']} head {fb['head']} {fb['side']}: {fb['reason']}")
    md_path, js_path = os.path.join(out_dir, "calibration.md"), os.path.join(out_dir, "calibration.json")
    with open(md_path, "w") as f:
        f.write("\n".join(md) + "\n")
    with open(js_path, "w") as f:
        json.dump({"summary": summary, "figures": [rel(p) for p in figs]}, f, indent=1)
    return {"markdown": md_path, "json": js_path, "figures": figs, "summary": summary}


def widths_section(artifact_path: str, out_dir: str) -> str:
    """`oscar run --widths copy`'s report fragment: each layer's copy-probe NLL change at 3- and 4-bit keys (every other
    layer at 2) and the widths the DP chose, a plot and a table, into out_dir/widths.{md,png}; returns the .md path.
    Reads the artifact's header only (`layer_widths`, `layer_quant`)."""
    meta = read_metadata(artifact_path)
    rec = meta.get("layer_widths") or {}
    err, widths = rec.get("copy_err"), rec.get("widths")
    if not err or not widths:
        raise OscarError(f"{artifact_path}: no per-layer widths chosen by the copy probe (layer_widths.copy_err)")
    e = np.asarray(err, dtype=float)  # (L, 3): options (2, 2), (3, 2), (4, 2)
    grad = rec.get("estimate") == "gradient"  # the probe to first order (oscar.recipe.widths.layer_copy_gradients)
    kb = np.array([int(w[0]) for w in widths])
    L = len(kb)
    os.makedirs(out_dir, exist_ok=True)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.2, 3.6))
    x = np.arange(L)
    ax.bar(x - 0.2, e[:, 1], 0.4, label="layer alone at 3-bit keys", color="tab:blue")
    ax.bar(x + 0.2, e[:, 2], 0.4, label="layer alone at 4-bit keys", color="tab:orange")
    for l in np.nonzero(kb > 2)[0]:
        ax.annotate(f"{kb[l]}", (l, min(e[l, 1:].min(), 0)), ha="center", va="top", fontsize=8, fontweight="bold")
    ax.axhline(0, color="k", lw=0.6)
    ax.set(xlabel="layer (chosen key bits marked)", ylabel="copied-span NLL change (nats/token)",
           title="per-layer key widths: the copy probe on calibration text" + (" (first order)" if grad else ""))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "widths.png"), dpi=110)
    plt.close(fig)
    wide = ", ".join(f"{l} ({kb[l]}-bit)" for l in range(L) if kb[l] > 2) or "none"
    md = ["## Per-layer key widths (copy probe" + (", first order)" if grad else ")"), "",
          f"Keys wider than 2 bits in layers {wide}; every value and the other layers' keys at 2 bits (e4m3 scale/zero; "
          "wide keys fp16), within the fitted artifact's bits per element. Each bar: the NLL of spans copied from the "
          "INT2 history of calibration text with that layer alone widened, minus all layers at 2 bits (negative: "
          "widening helps)" + ("; here to first order, from the gradient of that NLL with every layer at 2 bits"
                                if grad else "") + ". docs/decisions/0071-per-layer-widths-in-the-cache-format-served-end.md, \"Per-layer widths in the cache format\".", "",
          "![per-layer key widths](widths.png)", ""]
    path = os.path.join(out_dir, "widths.md")
    with open(path, "w") as f:
        f.write("\n".join(md))
    return path
