"""Quality cost of 8-bit (e4m3) scale/zero vs fp16 ones, on real SmolLM2 K/V (oscar-int2 format).

    python bench/fp8_params.py [--store S] [--artifact A] [--fp8-artifact B] [--ppl-tokens 4096 --ppl-context 1024]
                               [--no-ppl]

--fp8-artifact: the same fit with 8-bit params (clips searched for them; rotations identical), reported
as "fp8-refit". The committed figures used
    oscar fit reports/examples/smollm2/calib.zarr --variant centered --param-dtype float8_e4m3fn --out A8
(on a copy of the store) and `--fp8-artifact A8`; the part B perplexities take ~15 min on 2 cores.

Part A (calibration reservoir, every layer and KV head): the rotated K and V rows of the
store's reservoir, fake-quantized exactly as the cache stores pages (the artifact's
QuantConfig, clip ratios, rotations, key mean) with param_dtype float16 vs float8_e4m3fn:
relative MSE of K and V, and the relative error of attention outputs softmax(q k^T / sqrt(D)) v
of the reservoir's query rows over the reservoir's keys (a 1024-token context per head).
Also the e4m3 range facts that decide out-of-range handling: max |rotated value| (vs 448)
and the share of scales in e4m3's subnormal range (< 2^-6), plus an oracle per-(layer, head)
power-of-two unit (what a stored unit could buy at best).
Part B (optional): held-out perplexity, oscar-int2 with fp16 vs fp8 params and BF16, under
both protocols of `oscar validate ppl` (strict: every non-sink token read from INT2).

Writes bench/results/fp8_params.json and fp8_params.png (per-layer relative MSE).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import replace

import torch

from oscar.quant import FP8_MAX, fake_quant
from oscar.stats.artifact import load_artifact

EXAMPLE = "/work/main/reports/examples/smollm2"
DTYPES = {"fp16": "float16", "fp8": "float8_e4m3fn"}


def _clip(c: torch.Tensor) -> torch.Tensor:
    return c.float().reshape(-1, 1, 1)  # minmax ratios per KV head over (Hkv, N, groups)


def layer_errors(art, layer: int, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, nq: int = 256,
                 refit=None) -> dict:
    """Squared errors and norms for one layer; k, v, q (Hkv, N, D) model-space reservoir rows."""
    D = art.head_dim
    kr = k if art.k_mean is None else k - art.k_mean[layer].float().unsqueeze(1)
    kr = kr @ art.rot_k[layer].float()  # (Hkv, N, D) rotated, as the cache stores them
    vr = v @ art.rot_v[layer].float()
    qr = q[:, :nq] @ art.rot_k[layer].float()  # (Hkv, nq, D); q . mu is a per-query constant: no effect on softmax
    scale = 1 / math.sqrt(D)

    def attend(kk, vv):  # (Hkv, nq, D)
        return torch.softmax(qr @ kk.transpose(-1, -2) * scale, -1) @ vv

    o = attend(kr, vr)
    out = {"k_sq": kr.pow(2).sum().item(), "v_sq": vr.pow(2).sum().item(), "o_sq": o.pow(2).sum().item(),
           "max_abs": max(kr.abs().max().item(), vr.abs().max().item())}
    variants = [(n, art, pd) for n, pd in DTYPES.items()] + ([("fp8-refit", refit, DTYPES["fp8"])] if refit else [])
    for name, a, pd in variants:
        quant = replace(a.quant, param_dtype=pd)
        ks, vs = quant.key_spec(D), quant.value_spec(D)
        kq = fake_quant(kr, ks, _clip(a.clip_k[layer]))
        vq = fake_quant(vr, vs, _clip(a.clip_v[layer]))
        out[f"{name}_k_err"] = (kq - kr).pow(2).sum().item()
        out[f"{name}_v_err"] = (vq - vr).pow(2).sum().item()
        out[f"{name}_o_err"] = (attend(kq, vq) - o).pow(2).sum().item()
        if name == "fp8":
            from oscar.quant import choose_qparams

            sk, _ = choose_qparams(kr, ks, _clip(art.clip_k[layer]))
            sv, _ = choose_qparams(vr, vs, _clip(art.clip_v[layer]))
            s = torch.cat([sk.float().flatten(), sv.float().flatten()])
            out["fp8_scales"] = s.numel()
            out["fp8_subnormal_scales"] = int((s < 2**-6).sum())
            # oracle unit: a power of two per KV head putting max |x| in (128, 256] (exact scaling)
            def unit(x):
                return torch.exp2(torch.ceil(torch.log2(x.abs().amax((1, 2), keepdim=True).clamp_min(1e-30))) - 8)

            uk, uv = unit(kr), unit(vr)
            kq = fake_quant(kr / uk, ks, _clip(art.clip_k[layer])) * uk
            vq = fake_quant(vr / uv, vs, _clip(art.clip_v[layer])) * uv
            out["fp8unit_k_err"] = (kq - kr).pow(2).sum().item()
            out["fp8unit_v_err"] = (vq - vr).pow(2).sum().item()
            out["fp8unit_o_err"] = (attend(kq, vq) - o).pow(2).sum().item()
    return out


def reservoir_part(store: str, art, refit=None) -> dict:
    from oscar.pipeline.store import reduce

    layers = list(range(art.num_layers))
    res = {s: reduce(store, s, layers) for s in ("k_res", "v_res", "q_res")}
    per = []
    for l in layers:
        k, v, q = (torch.from_numpy(res[s][l]).float() for s in ("k_res", "v_res", "q_res"))
        per.append(layer_errors(art, l, k, v, q, refit=refit))
    tot = {key: sum(p[key] for p in per) for key in per[0] if key != "max_abs"}
    summary = {}
    names = ["fp16", "fp8", "fp8unit"] + (["fp8-refit"] if refit else [])
    for name in names:
        summary[name] = {f"rel_mse_{x}": tot[f"{name}_{x}_err"] / tot[f"{x}_sq"] for x in ("k", "v")}
        summary[name]["rel_err_attn_out"] = math.sqrt(tot[f"{name}_o_err"] / tot["o_sq"])
    for name in names[1:]:
        summary[f"{name}_vs_fp16"] = {key: summary[name][key] / summary["fp16"][key] for key in summary["fp16"]}
    max_abs = max(p["max_abs"] for p in per)
    summary["range"] = {"max_abs_rotated": max_abs, "headroom_vs_448": FP8_MAX / max_abs,
                        "subnormal_scale_share": tot["fp8_subnormal_scales"] / tot["fp8_scales"]}
    shown = [n for n in names if n != "fp8unit"]
    per_layer = [{"layer": l, **{f"{n}_rel_mse_{x}": p[f"{n}_{x}_err"] / p[f"{x}_sq"] for n in shown for x in ("k", "v")},
                  **{f"{n}_rel_err_o": math.sqrt(p[f"{n}_o_err"] / p["o_sq"]) for n in shown}, "max_abs": p["max_abs"]}
                 for l, p in enumerate(per)]
    return {"rows_per_head": int(res["k_res"][0].shape[1]), "queries_per_head": min(256, res["q_res"][0].shape[1]),
            "summary": summary, "per_layer": per_layer}


def ppl_part(art, tokens: int, context: int, refit=None) -> dict:
    from oscar.validate import env
    from oscar.scoring.protocols import PROTOCOLS
    from oscar.validate.ppl import heldout_ids
    from oscar.scoring.nll import window_nll
    from oscar.kernels.window_attention import simulated

    model, tok, _ = env.load_model("smollm2-135m")
    ids = torch.tensor([heldout_ids(tok, "pydoc", tokens)])
    wins = [ids[:, w * context:(w + 1) * context] for w in range(tokens // context)]
    out = {"tokens": tokens, "context": context, "windows": len(wins)}

    def ppl(fn):
        nll = cnt = 0
        for w in wins:
            a, b = fn(w)
            nll, cnt = nll + a, cnt + b
        return math.exp(nll / cnt)

    t = time.time()
    out["bf16"] = ppl(lambda w: window_nll(model, w))
    variants = [(n, art, pd) for n, pd in DTYPES.items()] + ([("fp8-refit", refit, DTYPES["fp8"])] if refit else [])
    for proto in ("strict", "serving"):
        for name, a0, pd in variants:
            a = replace(a0, quant=replace(a0.quant, param_dtype=pd))

            def run(w, a=a):
                with simulated(model, a, PROTOCOLS[proto]):
                    return window_nll(model, w)

            out[f"oscar-int2-{name}-{proto}"] = ppl(run)
            print(f"ppl {proto} {name}: {out[f'oscar-int2-{name}-{proto}']:.4f} (bf16 {out['bf16']:.4f})", flush=True)
        for name, _, _ in variants[1:]:
            out[f"{name}_vs_fp16_{proto}"] = out[f"oscar-int2-{name}-{proto}"] / out[f"oscar-int2-fp16-{proto}"]
    out["seconds"] = round(time.time() - t, 1)
    return out


def plot(per_layer: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    L = [p["layer"] for p in per_layer]
    for ax, (title, key) in zip(axes, (("K relative MSE", "rel_mse_k"), ("V relative MSE", "rel_mse_v"),
                                        ("attention output rel. error", "rel_err_o"))):
        for n, style, label in (("fp16", "o-", "fp16 scale/zero"), ("fp8", "s--", "e4m3, fp16-searched clips"),
                                ("fp8-refit", "^:", "e4m3, clips searched for e4m3")):
            if f"{n}_{key}" in per_layer[0]:
                ax.plot(L, [p[f"{n}_{key}"] for p in per_layer], style, ms=3, label=label)
        ax.set_title(title)
        ax.set_xlabel("layer")
    axes[0].legend()
    fig.suptitle("SmolLM2-135M, oscar-int2 (rotated, clipped), reservoir rows: fp16 vs 8-bit e4m3 params")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", default=os.path.join(EXAMPLE, "calib.zarr"))
    ap.add_argument("--artifact", default=os.path.join(EXAMPLE, "artifact.safetensors"))
    ap.add_argument("--fp8-artifact", default=None, help="the same fit with --param-dtype float8_e4m3fn")
    ap.add_argument("--ppl-tokens", type=int, default=4096)
    ap.add_argument("--ppl-context", type=int, default=1024)
    ap.add_argument("--no-ppl", action="store_true")
    ap.add_argument("--keep-ppl", action="store_true",
                    help="with --no-ppl: keep the perplexity section of an existing --out file (same artifacts)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "fp8_params.json"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    art = load_artifact(args.artifact)
    refit = load_artifact(args.fp8_artifact) if args.fp8_artifact else None
    if refit is not None and not all(torch.equal(a, b) for a, b in zip(art.rot_k + art.rot_v, refit.rot_k + refit.rot_v)):
        raise SystemExit("--fp8-artifact must be the same fit (same rotations) with --param-dtype float8_e4m3fn")
    res = {"store": args.store, "artifact": args.artifact, "fp8_artifact": args.fp8_artifact, "quant": vars(art.quant),
           "variant": art.meta.get("variant"), "command": "python bench/fp8_params.py " + " ".join(
               f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}")
               for k, v in vars(args).items() if v not in (None, False) and k != "out")}
    if refit is not None:
        res["fp8_refit_clips"] = {"k": [c.tolist() for c in refit.clip_k], "v": [c.tolist() for c in refit.clip_v]}
    t = time.time()
    res["reservoir"] = reservoir_part(args.store, art, refit)
    res["reservoir"]["seconds"] = round(time.time() - t, 1)
    print(json.dumps(res["reservoir"]["summary"], indent=1))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    plot(res["reservoir"]["per_layer"], args.out.replace(".json", ".png"))
    if not args.no_ppl:
        res["ppl"] = ppl_part(art, args.ppl_tokens, args.ppl_context, refit)
    elif args.keep_ppl and os.path.exists(args.out):
        old = json.load(open(args.out))
        if "ppl" in old and (old.get("artifact"), old.get("fp8_artifact")) == (args.artifact, args.fp8_artifact):
            res["ppl"] = old["ppl"]
            res["ppl_from"] = old.get("command")
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
