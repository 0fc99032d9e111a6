"""Small real calibration stores for the tests (test helper, not a test)."""

from __future__ import annotations

import numpy as np
import torch

from helpers.capture_reference import batch_data
from oscar.common import attention_shapes, config_fingerprint
from oscar.pipeline.store import CalibStore, StoreMeta, layer_arrays


def meta_for(model, *, blocks=3, seqs=3, seq_len=13, sink=2, reservoir=5, seed=3, batch_size=2, corpus="c1", **cfg):
    """The store metadata of the capture tests' stores of `model` (blocks of `seqs` sequences of `seq_len` tokens)."""
    shapes = attention_shapes(model.config)
    return StoreMeta(model={"name": "rand", "fingerprint": config_fingerprint(model.config), **shapes},
                     corpus={"name": corpus, "fingerprint": "fp-" + corpus, "split": {"calibration": [0, 1]}},
                     seq_len=seq_len, sink=sink, num_blocks=blocks, seqs_per_block=seqs, reservoir=reservoir,
                     config={"seed": seed, "batch_size": batch_size, **cfg})


def block_data(blocks=3, seqs=3, T=13):
    """(tokens, mask) of `blocks` blocks of padded sequences, as the store holds them."""
    toks, masks = [], []
    for b in range(blocks):
        t, m = batch_data(S=seqs, T=T, seed=b, pad=((0, 4, 9), (0, 0, 0), (2, 0, 11))[b % 3])
        toks.append(t)
        masks.append(m)
    return torch.stack(toks).numpy().astype(np.int32), torch.stack(masks).numpy().astype(np.uint8)


def write_reservoir_store(path, B=4, L=2, H=2, R=96, D=16, seed=0):
    """A real oscar-calib/2 store (written by oscar.pipeline.store) whose q/k/v reservoirs hold
    distinct rows (scales 3 / 1 / 0.5) and whose blocks count R, R-10, R, R-3 valid rows."""
    rng = np.random.default_rng(seed)
    meta = StoreMeta(model={"name": "tiny", "fingerprint": "tiny", "num_layers": L, "num_q_heads": 2 * H,
                            "num_kv_heads": H, "head_dim": D},
                     corpus={"name": "synthetic", "fingerprint": "c", "split": "all"}, seq_len=8, sink=0,
                     num_blocks=B, seqs_per_block=1, reservoir=R, config={})
    st = CalibStore.create(path, meta, np.zeros((B, 1, 8), np.int32), np.ones((B, 1, 8), np.uint8))
    counts = np.array([R, R - 10, R, R - 3])[:B]
    for b in range(B):
        layers = {}
        for l in range(L):
            arrays = {n: np.zeros(tail, dtype) for n, (dtype, tail) in layer_arrays(H, D, R).items()}
            for n, sc in (("q", 3.0), ("k", 1.0), ("v", 0.5)):
                x = (rng.standard_normal((H, R, D)) * sc).astype("float32")
                x[:, counts[b]:] = 0  # rows past the count are 0, as calibration writes them
                arrays[f"{n}_res"] = x
            arrays["res_count"] = arrays["qo_res_count"] = np.int64(counts[b])
            layers[l] = arrays
        st.write_block(b, layers)
    return str(path)
