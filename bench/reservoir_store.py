"""Stop-gap: a reservoir-only `oscar-calib/1` store from the real SmolLM2 model, for the
ablation's `real` regime until the capture pipeline (`oscar calibrate`) is on main.

Writes root attrs + `layers/{l}/{q,k,v}_res` (B, Hkv, R, D) + `res_count` (B,) for the
chosen layers only: post-RoPE q/k/v as the attention function receives them (captured
through a registered AttentionInterface function, with the matching mask function), rows
at positions >= sink, q rows pooled over the query heads of each KV group. Each block is
one sequence of `seq_len` tokens of the corpus's calibration split (`oscar.pipeline.corpus`),
model from `oscar.pipeline.models.load_model("smollm2-135m")`.

    python bench/reservoir_store.py OUT.zarr [--blocks 6 --seq-len 512 --layers 3 15 27]
"""

from __future__ import annotations

import argparse
import numpy as np
import torch


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--reservoir", type=int, default=256)
    ap.add_argument("--sink", type=int, default=64)
    ap.add_argument("--layers", type=int, nargs="+", default=[3, 15, 27])
    a = ap.parse_args(argv)

    import zarr
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from oscar.common import config_fingerprint
    from oscar.pipeline.corpus import load_corpus
    from oscar.pipeline.models import load_model

    torch.set_num_threads(2)
    model, tok, _info = load_model("smollm2-135m")
    cap: dict[int, tuple] = {}

    def capture(module, q, k, v, mask, **kw):  # q (B, Hq, T, D), k/v (B, Hkv, T, D), post-RoPE
        cap[module.layer_idx] = (q.detach(), k.detach(), v.detach())
        return sdpa_attention_forward(module, q, k, v, mask, **kw)

    AttentionInterface.register("oscar_capture", capture)
    AttentionMaskInterface.register("oscar_capture", sdpa_mask)
    model.set_attn_implementation("oscar_capture")

    corpus = load_corpus("pydoc")
    ids = tok("\n".join(corpus.calibration), return_tensors="pt").input_ids[0]
    cfg = model.config
    Hq, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // Hq
    B, R, T = a.blocks, a.reservoir, a.seq_len
    g = zarr.open_group(a.out, mode="w")
    g.attrs.update({"format": "oscar-calib/1", "seq_len": T, "sink": a.sink, "num_blocks": B, "reservoir": R,
                    "model": {"name": "smollm2-135m", "fingerprint": config_fingerprint(cfg), "num_layers": cfg.num_hidden_layers,
                              "num_q_heads": Hq, "num_kv_heads": Hkv, "head_dim": D},
                    "corpus": {"name": corpus.name, "fingerprint": corpus.fingerprint, "split": corpus.split},
                    "config": {"tool": "bench/reservoir_store.py (reservoir-only stop-gap)", "layers": a.layers}})
    arrs = {}
    for l in range(cfg.num_hidden_layers):  # every layer exists so layer indices match the model
        for n in "qkv":
            arrs[l, n] = g.create_array(f"layers/{l}/{n}_res", shape=(B, Hkv, R, D), dtype="float32", chunks=(1, Hkv, R, D),
                                        fill_value=0.0)
        arrs[l, "c"] = g.create_array(f"layers/{l}/res_count", shape=(B,), dtype="int64", chunks=(1,), fill_value=0)
    rng = np.random.Generator(np.random.PCG64(0))
    for b in range(B):
        x = ids[b * T: (b + 1) * T][None]
        with torch.no_grad():
            model(x)
        for l in a.layers:
            q, k, v = (t[0].float().numpy() for t in cap[l])  # (H, T, D)
            rows = rng.choice(np.arange(a.sink, T), R, replace=False)
            for h in range(Hkv):
                qh = q[h * (Hq // Hkv): (h + 1) * (Hq // Hkv), a.sink:].reshape(-1, D)  # pooled query heads
                arrs[l, "q"][b, h] = qh[rng.choice(len(qh), R, replace=False)]
                arrs[l, "k"][b, h] = k[h, rows]
                arrs[l, "v"][b, h] = v[h, rows]
            arrs[l, "c"][b] = R
        print(f"block {b + 1}/{B}", flush=True)


if __name__ == "__main__":
    main()
