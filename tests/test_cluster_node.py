"""Loss of a whole worker node mid-run (two Ray nodes on this machine, both on 127.0.0.1).

Stage 0 is steered onto the head and stage 1 onto a second node by custom resources
(`ClusterConfig.stage_resources`). After the first block is committed every process of the
second node (raylet, agents, the stage actor's worker) is SIGKILLed at once, as when a machine
dies; once the head has marked the node dead a replacement node with the same resource joins.
The placement group re-places the lost bundle there, Ray restarts the stage actor in it, the
driver redoes the blocks that were in flight, and the store equals the uninterrupted
single-process store: every block counted exactly once.
"""

from __future__ import annotations

import os
import time

import pytest

from oscar.cluster.localray import LocalHead, LocalWorkerNode, session_pids
from oscar.common import OscarError
from helpers import cluster as _h

# The head declares a node dead after 3 missed 1 s health checks (~5 s) instead of Ray's ~30 s default.
FAST_HEALTH_CHECK = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "1000",
                     "RAY_health_check_failure_threshold": "3"}


def _wait(cond, timeout: float, what: str):
    t0 = time.time()
    while not (v := cond()):
        if time.time() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.2)
    return v


def test_stage_resources_config():
    from oscar.cluster.pipeline import ClusterConfig

    cc = ClusterConfig(stages=2, stage_resources=[{}, {"victim": 1}])
    assert cc.custom_resources(0) == {} and cc.custom_resources(1) == {"victim": 1}
    assert ClusterConfig(stages=3, stage_resources={"a": 0.5}).custom_resources(2) == {"a": 0.5}
    assert ClusterConfig(stages=2).custom_resources(1) == {}
    with pytest.raises(OscarError, match="lists 1 stages but stages is 2"):
        ClusterConfig(stages=2, stage_resources=[{"a": 1}])
    with pytest.raises(OscarError, match="custom resources only"):
        ClusterConfig(stages=1, stage_resources={"GPU": 1})
    with pytest.raises(OscarError, match="resource -> amount"):
        ClusterConfig(stages=1, stage_resources={"a": -1})
    with pytest.raises(OscarError, match="resource -> amount"):
        ClusterConfig(stages=1, stage_resources=["a"])


def test_stage_refuses_out_of_sequence_micro_batches(tmp_path):
    """What makes a redone block exactly-once inside a (restarted) stage, without Ray: a micro-batch
    out of sequence is refused, a late call of an abandoned attempt does not break the current one,
    and only a complete attempt writes the block."""
    import numpy as np
    import torch

    from oscar.cluster.actors import StageArgs, StageStateError, StageWorker
    from oscar.cluster.pipeline import prepare_store
    from oscar.pipeline.calibrate import CalibConfig
    from oscar.pipeline.store import CalibStore

    o = _h.opts("tiny-llama", tmp_path / "s.zarr", blocks=2)
    store, model_dir = prepare_store(CalibConfig(**o))
    st = CalibStore(store)
    L = st.num_layers
    w = StageWorker(StageArgs(model_dir=model_dir, start=0, stop=L, store=store, job="t", sink=o["sink"],
                              reservoir=o["reservoir"], seqs_per_block=2))
    tok, msk = st.group["tokens"][:], st.group["mask"][:]

    def x(b, m):
        return {"input_ids": torch.from_numpy(tok[b, m:m + 1].astype(np.int64)),
                "mask": torch.from_numpy(msk[b, m:m + 1].astype(np.int64))}

    with pytest.raises(StageStateError):  # a fresh (restarted) stage never saw micro-batch 0
        w.forward(0, 1, 1, x(0, 1), "a")
    w.forward(0, 0, 0, x(0, 0), "b")
    with pytest.raises(StageStateError):  # a late call of the abandoned attempt "a"
        w.forward(0, 1, 1, x(0, 1), "a")
    with pytest.raises(StageStateError):  # attempt "b" has not seen micro-batch 1: nothing is written
        w.commit(0, 2, "a")
    assert not CalibStore(store).done()[0].any()
    w.forward(0, 1, 1, x(0, 1), "b")  # attempt "b" is intact and completes the block
    assert w.commit(0, 2, "b")["written"] == list(range(L)) and CalibStore(store).done()[0].all()
    w.forward(1, 0, 0, x(1, 0), "c")
    with pytest.raises(StageStateError):  # the same attempt out of order breaks it for good
        w.forward(1, 2, 0, x(1, 0), "c")
    with pytest.raises(StageStateError):
        w.forward(1, 1, 1, x(1, 1), "c")
    with pytest.raises(StageStateError):  # a stage asked to commit before its last micro-batch
        w.commit(1, 2, "c")
    assert not CalibStore(store).done()[1].any()
    w.close()


def check_failed_start_is_reported():
    """A stage whose constructor fails stops the run at the start barrier with its own message,
    instead of waiting out the timeout."""
    import ray

    from oscar.cluster.pipeline import wait_alive

    @ray.remote(num_cpus=0, max_restarts=2)
    class Broken:
        def __init__(self):
            raise OscarError("model directory /nonexistent has no config.json")

        def ping(self):
            return True

    t0 = time.time()
    with pytest.raises(OscarError, match="failed to start.*no config.json"):
        wait_alive([Broken.remote()], timeout=120)
    assert time.time() - t0 < 60


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(300)
def test_killed_worker_node_mid_run(tmp_path, tmp_path_factory):
    from oscar.cluster.pipeline import ClusterConfig, calibrate_on_ray
    from oscar.pipeline.calibrate import CalibConfig

    # 7 sequences in 4 blocks: the last block's second row is all padding (skipped, as on the single path)
    o = _h.opts("tiny-llama", tmp_path / "ray.zarr", blocks=4, tokens=48 * 7)
    ref = _h.reference(tmp_path_factory, **o)  # before any Ray process competes for the CPUs
    saved = dict(os.environ)
    head = LocalHead(num_cpus=2, object_store_mb=128, resources={"survivor": 1}, system_env=FAST_HEALTH_CHECK)
    nodes: list[LocalWorkerNode] = []
    head.use()  # loopback-only, private token: before `import ray`
    import ray

    try:
        head.start()
        ray.init(address=head.address, log_to_driver=False)
        head_node = ray.get_runtime_context().get_node_id()  # the driver is attached to the head

        def add_victim() -> str:
            n = LocalWorkerNode(head, num_cpus=1, resources={"victim": 1})
            nodes.append(n)
            n.start()
            return _wait(lambda: next((x["NodeID"] for x in ray.nodes() if x["Alive"]
                                       and x["Resources"].get("victim")), None), 60, "the victim node to join")

        check_failed_start_is_reported()
        first = add_victim()
        assert {x["NodeManagerAddress"] for x in ray.nodes()} == {"127.0.0.1"}  # loopback only
        lost: dict = {}

        def kill_node(block: int) -> None:
            if lost:
                return
            from oscar.pipeline.store import CalibStore

            lost["done"] = set(int(b) for b in CalibStore(o["store"]).done().all(1).nonzero()[0])
            sid = nodes[0].proc.pid
            lost["pids"] = nodes[0].kill()
            assert len(lost["pids"]) >= 3 and not session_pids(sid)  # ray start, raylet, agents, workers
            t0 = time.time()
            _wait(lambda: not any(x["Alive"] for x in ray.nodes() if x["NodeID"] == first), 60,
                  "the head to mark the killed node dead")
            lost["detected_s"] = time.time() - t0
            lost["replacement"] = add_victim()

        cc = ClusterConfig(stages=2, replicas=1, throttle_s=1.0, stage_resources=[{"survivor": 1}, {"victim": 1}])
        rep = calibrate_on_ray(CalibConfig(**o), cc, address=head.address, progress=False, on_block=kill_node)

        print(f"node lost after blocks {sorted(lost['done'])}, marked dead in {lost['detected_s']:.1f}s; "
              f"redone: {rep.failures}; {rep.wall_seconds:.1f}s")
        assert lost and lost["replacement"] != first
        assert sorted(rep.blocks_done) == [0, 1, 2, 3]
        assert rep.block_retries >= 1, rep.failures  # the blocks in flight on the lost node were redone
        assert lost["done"] and len(lost["done"]) < 4, lost  # killed mid-run
        s0, s1 = sorted(rep.stage_stats, key=lambda s: s["stage"])
        assert s0["node_id"] == head_node and set(s0["blocks_written"]) == {0, 1, 2, 3}  # never restarted
        assert s1["node_id"] == lost["replacement"], (s1, lost)  # restarted on the new node
        assert s1["pid"] not in lost["pids"]
        assert set(s1["blocks_written"]) >= {0, 1, 2, 3} - lost["done"]
        _h.assert_same_store(ref, o["store"])  # every block exactly once, bit-identical
    finally:
        ray.shutdown()
        for n in nodes:
            n.stop()
        head.stop()
        os.environ.clear()
        os.environ.update(saved)
