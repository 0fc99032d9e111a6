"""Shared by the Ray tests (test helper, not a test): job options, the single-process reference
store, and the store equality check (`from helpers.cluster import ...`)."""

from __future__ import annotations

import json
import os
from contextlib import contextmanager

import numpy as np


@contextmanager
def attached_head(num_cpus: int, object_store_mb: int = 256):
    """A private loopback-only Ray head (cluster/localray.py) with this process attached as its driver."""
    from oscar.cluster.localray import LocalHead

    with LocalHead(num_cpus=num_cpus, object_store_mb=object_store_mb).session() as h:
        # late: ray reads its cluster mode and token when imported; the head's session sets them first
        import ray

        ray.init(address=h.address, log_to_driver=False)
        # the state API (list_actors, ...) finds its cluster by address, not by scanning: another test module's head
        # may be up at the same time on the other worker; the session restores the environment on exit
        os.environ["RAY_ADDRESS"] = h.address
        try:
            yield h
        finally:
            ray.shutdown()
    assert not os.path.exists(h.temp_dir), "a stopped head left its temp dir (session logs) behind"


def opts(model, store, blocks=3, **kw):
    d = dict(model=model, store=str(store), seq_len=48, sink=4, seqs_per_block=2, tokens=48 * 2 * blocks,
             reservoir=8, batch_size=1)
    d.update(kw)
    return d


_REFS: dict = {}


def reference(tmp_path_factory, **o):
    """The single-process store for these options (computed once per session), as `oscar calibrate` computes it:
    with the native CPU attention registered, as the stage actors register it (pipeline/capture.native_attention)."""
    from oscar.kernels import cpu_attention
    from oscar.pipeline.calibrate import CalibConfig, calibrate

    cpu_attention.register()

    key = json.dumps({k: v for k, v in o.items() if k != "store"}, sort_keys=True)
    if key not in _REFS:
        path = tmp_path_factory.mktemp("ref") / "ref.zarr"
        # one torch thread, as each stage actor runs (threads_per_stage defaults to cpus_per_stage = 1):
        # float32 summation order in the MoE layers depends on the thread count, so the reference pins it
        # rather than take the load-dependent default
        calibrate(CalibConfig(**{**o, "store": str(path), "threads": o.get("threads") or 1}), progress=False)
        _REFS[key] = path
    return _REFS[key]


def assert_same_store(ref, got, attrs: bool = True):
    from oscar.pipeline.store import CalibStore

    a, b = CalibStore(ref), CalibStore(got)
    assert a.done().all() and b.done().all()
    for name in ("tokens", "mask", "done"):
        assert np.array_equal(a.group[name][:], b.group[name][:]), name
    for l in range(a.num_layers):
        for n in a.spec:
            x, y = a.group[f"layers/{l}/{n}"][:], b.group[f"layers/{l}/{n}"][:]
            assert np.array_equal(x, y), f"layers/{l}/{n} differs (max {np.abs(x - y).max()})"
    for k, v in (a.group.attrs.items() if attrs else ()):  # the Ray store adds `cluster` (and MoE) attributes only
        assert b.group.attrs[k] == v, k


def per_expert(key: str, t) -> dict:
    """A checkpoint tensor in the per-expert layout published MoE checkpoints use: transformers' fused
    `experts.gate_up_proj` / `experts.down_proj` (E, ...) split into `experts.{e}.{gate,up,down}_proj.weight`."""
    if key.endswith("experts.gate_up_proj"):
        base = key[: -len("gate_up_proj")]
        out = {}
        for e in range(t.shape[0]):
            g, u = t[e].chunk(2, dim=0)
            out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = g.clone(), u.clone()
        return out
    if key.endswith("experts.down_proj"):
        base = key[: -len("down_proj")]
        return {f"{base}{e}.down_proj.weight": t[e].clone() for e in range(t.shape[0])}
    return {key: t}
