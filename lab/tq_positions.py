"""Which key channels tq-int2 treats as outliers, from the store against the keys a short context holds.

tq-int2 (validate/codebooks.py) gives the D/4 key channels of highest centred energy 3 bits and the rest 2, and
subtracts the key mean, both read from the calibration store. A store calibrated at positions up to 32k averages
post-RoPE keys over every rotation those positions give; a 1k-2k context holds keys at its own positions only. This
captures one calibration-split sequence's post-RoPE keys at positions [0, T) and compares, per layer and KV head:

    overlap   |outliers(store) ∩ outliers(context)| / (D / 4): the 3-bit channels the context needed that it got
    mean gap  ||mean(context) - mean(store)|| / sqrt(centred energy(context)): the key offset centering leaves

    python lab/tq_positions.py --artifact runs/qwen-example/artifact.safetensors --model qwen2.5-0.5b --tokens 2048
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from oscar.recipe.tune import calibration_ids
from oscar.stats.artifact import load_artifact
from oscar.validate import env
from oscar.validate.codebooks import store_layers

KEYS: dict[int, torch.Tensor] = {}


def _recording(module, query, key, value, attention_mask, **kw):
    KEYS[module.layer_idx] = key[0].detach().double()  # (Hkv, T, D) post-RoPE
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", required=True, help="an oscar-int2 artifact whose store tq-int2 is built from")
    ap.add_argument("--model", required=True, help="the model the store was calibrated on")
    ap.add_argument("--tokens", type=int, default=2048, help="the context's length (default 2048)")
    ap.add_argument("--corpus", default="pydoc", help="corpus of the context: its calibration split (default pydoc)")
    a = ap.parse_args(argv)
    _, view, layers = store_layers(load_artifact(a.artifact), "tq-int2")
    model, tok, _ = env.load_model(a.model)
    AttentionInterface.register("lab_record", _recording)
    model.set_attn_implementation("lab_record")
    ids = torch.tensor([calibration_ids(tok, a.corpus, a.tokens)])
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    D = view.head_dim
    n_hi = D // 4
    overlap, gap = [], []
    for l, ls in enumerate(layers):
        mu = ls.mean("k")                                                   # (H, D) over the store's positions
        e_store = np.einsum("hdd->hd", ls.cov("k")) - mu**2                  # centred energy per channel
        k = KEYS[l].numpy()                                                  # (H, T, D)
        mu_c, e_c = k.mean(1), k.var(1)
        for h in range(k.shape[0]):
            s = set(np.argsort(-e_store[h], kind="stable")[:n_hi])
            c = set(np.argsort(-e_c[h], kind="stable")[:n_hi])
            overlap.append(len(s & c) / n_hi)
            gap.append(float(np.linalg.norm(mu_c[h] - mu[h]) / np.sqrt(e_c[h].sum())))
    res = {"artifact": a.artifact, "model": a.model, "context_tokens": a.tokens, "store_positions":
           (load_artifact(a.artifact).meta.get("provenance") or {}).get("positions"),
           "outlier_overlap_mean": float(np.mean(overlap)), "outlier_overlap_min": float(np.min(overlap)),
           "mean_gap_mean": float(np.mean(gap)), "mean_gap_max": float(np.max(gap)), "heads": len(overlap)}
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
