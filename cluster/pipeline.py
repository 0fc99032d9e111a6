"""The Ray driver: stage actors per replica, micro-batches through the object store.

`run_pipeline(store, model_dir, ...)` processes every block of an existing
`oscar-calib/1` store that is not yet done (the store was created by the
calibration front end, which wrote tokens, mask and root attributes):

- R replicas x N stage actors; stage i of every replica owns the same contiguous
  layer range (balanced by parameter count, or explicit). Each replica's stages
  are placed by one placement group (PACK: on as few nodes as hold them, so a
  replica of one stage per GPU spans nodes when it has more stages than a node has GPUs).
- Replicas split the pending blocks round-robin: every block goes to exactly one
  replica. Within a replica a block is cut into micro-batches of sequences; the
  driver chains `stage_0.forward -> stage_1.forward -> ...` per micro-batch and
  keeps up to `lookahead` blocks in flight (more when a block has fewer micro-batches
  than the pipeline has stages: `placement.lookahead_blocks`), so stage i works on
  micro-batch m+1 while stage i+1 works on m (pipeline parallelism).
- Fault tolerance: actors have `max_restarts`; their tasks are not retried by Ray
  (`max_task_retries=0`). When any micro-batch of a block fails (actor died,
  worker killed, node lost) the driver waits for that attempt to drain and
  resubmits the whole block; restarted actors reload their layers, and
  re-writing a block is idempotent. The store's done markers are the only
  progress record, so a killed job resubmitted later continues where it stopped.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import uuid
from collections import deque
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import torch
from tqdm import tqdm

from oscar.cluster.actors import EXPERT_ARRAY, StageArgs, stage_actor_class
from oscar.cluster.loading import load_config, _num_experts
from oscar.cluster.localray import LOOPBACK_ENV
from oscar.cluster.placement import lookahead_blocks
from oscar.cluster.plan import balance_layers, _is_moe_layer, param_bytes, parse_ranges
from oscar.common import OscarError, fingerprint
from oscar.pipeline.calibrate import prepare_store as _prepare
from oscar.dirlock import DirLock
from oscar.pipeline.store import CalibStore, WriterLock

_LOCAL_RAY: bool = False  # True when this module started the Ray runtime itself


@dataclass
class ClusterConfig:
    """Resources and shape of the pipeline (the `cluster` section of a job config)."""

    stages: int = 1
    replicas: int = 1
    micro_batch: int = 1                 # sequences per micro-batch
    layers: str | None = None            # explicit ranges "0:10,10:30"; default: balanced by parameters
    cpus_per_stage: float = 1.0
    gpus_per_stage: float = 0.0
    memory_per_stage: int | None = None  # bytes reserved per stage actor (Ray `memory` resource)
    # custom Ray resources per stage actor: one dict for every stage, or a list with one dict per
    # stage, e.g. [{}, {"bigmem": 1}] steers stage 1 onto nodes started with --resources '{"bigmem": 1}'
    stage_resources: dict[str, float] | list[dict[str, float]] | None = None
    threads_per_stage: int | None = None  # torch threads (default: cpus_per_stage, at least 1)
    max_restarts: int = 4                # per actor
    max_block_attempts: int = 6          # per block, before giving up
    lookahead: int = 2                   # blocks in flight per replica (at least; raised to keep every stage fed)
    dtype: str = "float32"
    placement_timeout: float = 120.0    # seconds to place the stages (and to re-place them after a node loss)
    startup_timeout: float = 1800.0     # seconds for a stage actor to load its layers (also after a restart)
    throttle_s: float = 0.0              # sleep after each micro-batch (tests; sharing a busy node)

    def __post_init__(self):
        for k in ("stages", "replicas", "micro_batch", "lookahead", "max_block_attempts"):
            if int(getattr(self, k)) < 1:
                raise OscarError(f"cluster.{k} must be >= 1, got {getattr(self, k)}")
        if self.cpus_per_stage <= 0 or self.gpus_per_stage < 0:
            raise OscarError("cluster.cpus_per_stage must be > 0 and gpus_per_stage >= 0")
        sr = self.stage_resources
        if sr is not None:
            items = sr if isinstance(sr, list) else [sr]
            for d in items:
                if not isinstance(d, dict) or not all(isinstance(k, str) and isinstance(v, (int, float)) and v >= 0
                                                      for k, v in d.items()):
                    raise OscarError(f"cluster.stage_resources must be a dict of resource -> amount >= 0, or a "
                                     f"list of such dicts (one per stage); got {sr!r}")
                if set(d) & {"CPU", "GPU", "memory"}:
                    raise OscarError("cluster.stage_resources holds custom resources only; CPU, GPU and memory "
                                     "come from cpus_per_stage, gpus_per_stage and memory_per_stage")
            if isinstance(sr, list) and len(sr) != self.stages:
                raise OscarError(f"cluster.stage_resources lists {len(sr)} stages but stages is {self.stages}")

    @property
    def threads(self) -> int:
        return int(self.threads_per_stage or max(1, int(self.cpus_per_stage)))

    @property
    def device(self) -> str:
        return "cuda" if self.gpus_per_stage > 0 else "cpu"

    def custom_resources(self, stage: int) -> dict[str, float]:
        sr = self.stage_resources
        if not sr:
            return {}
        return dict(sr[stage] if isinstance(sr, list) else sr)


@dataclass
class PipelineReport:
    store: str
    stages: list[tuple[int, int]]
    replicas: int
    micro_batch: int
    blocks_done: list[int]
    blocks_skipped: int                  # already done before this run
    block_retries: int
    failures: list[str]
    wall_seconds: float
    tokens: int
    tokens_per_second: float
    bubble: float                        # 1 - mean stage busy time / wall time (measured)
    bubble_ideal: float                  # (N-1)/(M+N-1) for M micro-batches per replica
    startup_seconds: float = 0.0         # actor start (layer loading) until every stage answered; in wall_seconds
    blocks_in_flight: int = 2            # per replica: cluster.lookahead, raised by `lookahead_blocks`
    stage_stats: list[dict] = field(default_factory=list)
    unused_experts: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


# --------------------------------------------------------------------------- ray session

def connect(address: str | None = "auto", *, num_cpus: int | None = None) -> str:
    """Attach to a Ray cluster: ADDRESS, or `auto` = $RAY_ADDRESS if set (inside a Ray job it
    is), else start a private local cluster bound to 127.0.0.1 (stopped by `disconnect`)."""
    global _LOCAL_RAY
    if address in (None, "", "auto"):
        address = os.environ.get("RAY_ADDRESS") or "local"
    if address == "local" and "ray" not in sys.modules:
        for k, v in LOOPBACK_ENV.items():  # single-node mode: every Ray component on 127.0.0.1
            os.environ.setdefault(k, v)
    # late: ray reads its cluster mode when imported; connect() sets LOOPBACK_ENV first (cluster/localray.py)
    import ray

    if ray.is_initialized():
        return "connected"
    if address == "local":
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
                 _node_ip_address="127.0.0.1")
        _LOCAL_RAY = True
        return "local"
    ray.init(address=address, log_to_driver=False)
    return address


def disconnect() -> None:
    # late: ray reads its cluster mode when imported; connect() sets LOOPBACK_ENV first (cluster/localray.py)
    import ray

    global _LOCAL_RAY
    if ray.is_initialized():
        ray.shutdown()
    _LOCAL_RAY = False


# --------------------------------------------------------------------------- helpers

def stage_ranges(model_dir: str, cc: ClusterConfig, num_layers: int) -> list[tuple[int, int]]:
    if cc.layers:
        r = parse_ranges(cc.layers, num_layers)
        if len(r) != cc.stages:
            raise OscarError(f"--stage-layers gives {len(r)} ranges but --stages is {cc.stages}")
        return r
    if cc.stages > num_layers:
        raise OscarError(f"--stages {cc.stages} exceeds the model's {num_layers} layers")
    pb = param_bytes(load_config(model_dir), 4)
    return balance_layers(pb.layers, cc.stages, pb.embed)


def job_id_for(store: str) -> str:
    """Prefix of the writer-lock job ids (and actor names) of the Ray runs on one store."""
    return "ray-" + fingerprint(os.path.abspath(store), 12)


def _ensure_expert_arrays(store, model_dir: str, layers: list[int]) -> tuple[int, list[int]]:
    """Create `layers/{l}/expert_tokens` (int64, (B, E), one chunk per block) for MoE layers."""
    cfg = load_config(model_dir)
    E = _num_experts(cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg)
    if not E:
        return 0, []
    moe = [l for l in layers if _is_moe_layer(cfg, l)]
    for l in moe:
        name = f"layers/{l}/{EXPERT_ARRAY}"
        if name not in store.group:
            store.group.create_array(name, shape=(store.num_blocks, E), chunks=(1, E), dtype="int64",
                                     fill_value=0, compressors=None)
    return E, moe


def unused_experts(store, layers: list[int] | None = None) -> dict[int, list[int]]:
    """{MoE layer: experts that received no token in any done block} (empty dict for dense models)."""
    done = store.done()
    out = {}
    for l in range(store.num_layers) if layers is None else layers:
        name = f"layers/{l}/{EXPERT_ARRAY}"
        if name not in store.group:
            continue
        blocks = np.flatnonzero(done[:, l])
        counts = store.group[name][:][blocks].sum(0)
        out[int(l)] = [int(e) for e in np.flatnonzero(counts == 0)]
    return out


def _is_ray_failure(e: BaseException) -> bool:
    # late: ray reads its cluster mode when imported; connect() sets LOOPBACK_ENV first (cluster/localray.py)
    import ray.exceptions as rex

    return isinstance(e, (rex.RayError,))


# --------------------------------------------------------------------------- driver

def run_pipeline(store_path: str, model_dir: str | None, cc: ClusterConfig, *, progress: bool = True,
                 on_block=None) -> PipelineReport:
    """Process every pending block of the store at `store_path` on the connected Ray cluster.

    Everything that defines the statistics (tokens, mask, sink, reservoir, seed, attention
    implementation) is read from the store; `model_dir` defaults to the store's model source.
    """
    # late: ray reads its cluster mode when imported; connect() sets LOOPBACK_ENV first (cluster/localray.py)
    import ray

    if not ray.is_initialized():
        raise OscarError("run_pipeline needs a Ray connection (oscar.cluster.pipeline.connect)")
    store = CalibStore(store_path, mode="r+")
    L = store.num_layers
    model_dir = model_dir or store.meta.model.get("source")
    if not model_dir:
        raise OscarError(f"store {store_path} records no model source; pass the model directory")
    ranges = stage_ranges(model_dir, cc, L)
    # One writer-lock job per driver run, shared with its stage actors (restarted ones too): a second
    # concurrent run on the same store is refused; a dead run's locks are taken over.
    job = f"{job_id_for(store_path)}-{uuid.uuid4().hex[:8]}"
    lock = WriterLock(store_path, range(L), job=job).acquire()
    pgs, replicas = [], []
    try:
        _, moe_layers = _ensure_expert_arrays(store, model_dir, list(range(L)))
        store.group.attrs["cluster"] = {"stages": [list(r) for r in ranges], "replicas": cc.replicas,
                                        "micro_batch": cc.micro_batch, "job": job}
        store.repair()  # damaged done blocks (missing / truncated / altered chunks) are un-marked and redone
        todo = store.todo_blocks()
        skipped = store.num_blocks - len(todo)

        place_groups(cc, len(ranges), job, into=pgs)
        _start_stages(store, store_path, model_dir, cc, ranges, job, pgs, into=replicas)
        t_start = time.time()
        # Barrier: every stage has loaded its layers before the first micro-batch, so no stage
        # computes while another is still loading (and the timed window holds no load time).
        for actors in replicas:
            wait_alive(actors, timeout=cc.startup_timeout)
        startup = time.time() - t_start

        masks = store.group["mask"]
        # Stage 0 must get the next block before it finishes the current one, while the oldest block in
        # flight still drains through the later stages: with few micro-batches per block, more blocks in flight.
        ahead = max(cc.lookahead, lookahead_blocks(len(ranges), math.ceil(store.meta.seqs_per_block / cc.micro_batch)))
        loop = _BlockLoop(replace(cc, lookahead=ahead), replicas, store.group["tokens"], masks, todo, on_block)
        loop.run(progress)
        wall = time.time() - t_start

        stats = _stage_stats(replicas)
        n = len(ranges)
        m_total = math.ceil(sum(loop.mb_per_block.values()) / cc.replicas)  # micro-batches per replica
        real_tokens = int(sum(int(masks[b].sum()) for b in loop.done_blocks))
        unused = unused_experts(CalibStore(store_path), moe_layers) if moe_layers else {}
        if unused:
            store.group.attrs["moe_unused_experts"] = {str(k): v for k, v in unused.items()}
        return PipelineReport(
            store=str(store_path), stages=ranges, replicas=cc.replicas, micro_batch=cc.micro_batch,
            blocks_done=sorted(loop.done_blocks), blocks_skipped=skipped, block_retries=len(loop.failures),
            failures=loop.failures, wall_seconds=wall, tokens=real_tokens,
            tokens_per_second=real_tokens / wall if wall > 0 else 0.0, bubble=measured_bubble(stats),
            bubble_ideal=(n - 1) / (m_total + n - 1) if todo else 0.0, startup_seconds=startup, blocks_in_flight=ahead,
            stage_stats=stats, unused_experts={str(k): v for k, v in unused.items()})
    finally:
        _release(replicas, pgs)  # also on errors: a long-lived caller must get its resources back
        lock.release()


def _bundle(cc: ClusterConfig) -> dict:
    """The resources of one stage (custom per-stage resources aside)."""
    bundle = {"CPU": cc.cpus_per_stage, **({"GPU": cc.gpus_per_stage} if cc.gpus_per_stage else {})}
    if cc.memory_per_stage:
        bundle["memory"] = cc.memory_per_stage
    return bundle


def place_groups(cc: ClusterConfig, n_stages: int, job: str, into: list) -> None:
    """One placement group per replica (a bundle per stage) into `into`, placed; a clear error when the
    cluster cannot (the caller removes the groups either way). PACK, not STRICT_PACK: a replica of one
    stage per GPU has more stages than a node has GPUs; a bundle (one stage's GPUs) never spans nodes."""
    # late: ray reads its cluster mode when imported; connect() sets LOOPBACK_ENV first (cluster/localray.py)
    import ray
    from ray.util.placement_group import placement_group

    bundle = _bundle(cc)
    for r in range(cc.replicas):
        into.append(placement_group([{**bundle, **cc.custom_resources(i)} for i in range(n_stages)],
                                    strategy="PACK", name=f"oscar-{job}-r{r}"))
    try:
        ray.get([pg.ready() for pg in into], timeout=cc.placement_timeout)
    except ray.exceptions.GetTimeoutError:
        raise OscarError(
            f"cannot place {cc.replicas} replica(s) x {n_stages} stages of {bundle}"
            f"{' + ' + str(cc.stage_resources) if cc.stage_resources else ''} within "
            f"{cc.placement_timeout:.0f}s; the cluster offers {ray.cluster_resources()}") from None


def _start_stages(store, store_path: str, model_dir: str, cc: ClusterConfig, ranges: list[tuple[int, int]], job: str,
                  pgs: list, into: list) -> None:
    """The stage actors of every replica into `into`, [replica][stage], each in its bundle of the replica's group."""
    # late: ray reads its cluster mode when imported; connect() sets LOOPBACK_ENV first (cluster/localray.py)
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    Actor = stage_actor_class()
    common = dict(model_dir=model_dir, store=str(store_path), job=job,
                  attn=str(store.meta.config.get("attn_implementation", "sdpa")),
                  sink=store.meta.sink, reservoir=store.meta.reservoir, seed=int(store.meta.config.get("seed", 0)),
                  seqs_per_block=store.meta.seqs_per_block, threads=cc.threads, dtype=cc.dtype, device=cc.device,
                  throttle_s=cc.throttle_s, num_devices=max(1, int(cc.gpus_per_stage)))
    for r, pg in enumerate(pgs):
        actors = []
        for i, (a, b) in enumerate(ranges):
            args = StageArgs(start=a, stop=b, stage=i, replica=r, **common)
            opts = dict(num_cpus=cc.cpus_per_stage, num_gpus=cc.gpus_per_stage,
                        max_restarts=cc.max_restarts, max_task_retries=0,
                        name=f"oscar-{job}-r{r}-s{i}", lifetime=None,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                            placement_group=pg, placement_group_bundle_index=i))
            if cc.memory_per_stage:
                opts["memory"] = cc.memory_per_stage
            if cc.custom_resources(i):
                opts["resources"] = cc.custom_resources(i)
            actors.append(Actor.options(**opts).remote(args))
        into.append(actors)


class _BlockLoop:
    """Blocks through the replicas' stage chains: up to `lookahead` blocks in flight per replica, a block
    whose micro-batch or commit failed (a Ray failure) redone from its start on the same replica."""

    def __init__(self, cc: ClusterConfig, replicas: list[list], tokens, masks, todo: list[int], on_block=None):
        self.cc, self.replicas, self.tokens, self.masks, self.on_block = cc, replicas, tokens, masks, on_block
        self.queues = [deque(todo[r::cc.replicas]) for r in range(cc.replicas)]
        self.todo = todo
        self.inflight: dict[int, dict] = {}          # block -> {replica, refs, pending, failed}
        self.attempts: dict[int, int] = {}
        self.failures: list[str] = []
        self.done_blocks: list[int] = []
        self.mb_per_block: dict[int, int] = {}  # micro-batches of each block submitted

    def submit(self, r: int, b: int) -> None:
        cc = self.cc
        self.attempts[b] = self.attempts.get(b, 0) + 1
        if self.attempts[b] > cc.max_block_attempts:
            raise OscarError(f"block {b} failed {cc.max_block_attempts} times; last errors: {self.failures[-3:]}")
        tag = uuid.uuid4().hex[:8]
        tok, msk = self.tokens[b], self.masks[b]             # (S, T)
        rows = np.flatnonzero(msk.any(1))  # trailing all-padding rows are skipped, as on the single path
        n_seq = int(rows[-1]) + 1 if rows.size else 1
        nb = self.mb_per_block[b] = math.ceil(n_seq / cc.micro_batch)
        refs = []
        for m in range(nb):
            lo, hi = m * cc.micro_batch, min(n_seq, (m + 1) * cc.micro_batch)
            # int64 like the single-process path: the same mask dtype reaches create_causal_mask
            x = {"input_ids": _tensor(tok[lo:hi].astype(np.int64)), "mask": _tensor(msk[lo:hi].astype(np.int64))}
            for actor in self.replicas[r]:
                x = actor.forward.remote(b, m, lo, x, tag)
            refs.append(x)
        # Each stage writes after its last micro-batch, in a call of its own: the next stage is
        # already computing. Calls from one submitter run in order, so the commit precedes the
        # next block's micro-batches on every stage.
        refs += [actor.commit.remote(b, nb, tag) for actor in self.replicas[r]]
        self.inflight[b] = {"replica": r, "refs": refs, "pending": set(refs), "failed": None}

    def fill(self) -> None:
        for r in range(self.cc.replicas):
            busy = sum(1 for v in self.inflight.values() if v["replica"] == r)
            while busy < self.cc.lookahead and self.queues[r]:
                self.submit(r, self.queues[r].popleft())
                busy += 1

    def settle(self, ref, bar) -> None:
        """One finished call: a failure marks its block for redoing; the block's last call completes it."""
        # late: ray reads its cluster mode when imported; connect() sets LOOPBACK_ENV first (cluster/localray.py)
        import ray

        b = next(k for k, v in self.inflight.items() if ref in v["pending"])
        entry = self.inflight[b]
        entry["pending"].discard(ref)
        try:
            ray.get(ref)
        except Exception as e:  # noqa: BLE001 - any failure redoes the block
            if not _is_ray_failure(e):
                raise
            if isinstance(getattr(e, "cause", None), OscarError):
                raise e.cause from None  # a user error inside a stage: no retry
            entry["failed"] = entry["failed"] or f"block {b}: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        if entry["pending"]:
            return
        del self.inflight[b]
        if entry["failed"]:
            self.failures.append(entry["failed"])
            print(f"oscar: {entry['failed']}; redoing block {b}", file=sys.stderr)
            wait_alive(self.replicas[entry["replica"]], timeout=self.cc.placement_timeout + self.cc.startup_timeout)
            self.queues[entry["replica"]].appendleft(b)
        else:
            self.done_blocks.append(b)
            bar.update(1)
            if self.on_block:
                self.on_block(b)

    def run(self, progress: bool) -> None:
        # late: ray reads its cluster mode when imported; connect() sets LOOPBACK_ENV first (cluster/localray.py)
        import ray

        bar = _progress(len(self.todo), progress)
        self.fill()
        while self.inflight:
            pending = [ref for v in self.inflight.values() for ref in v["pending"]]
            ready, _ = ray.wait(pending, num_returns=1, timeout=600)
            if not ready:
                raise OscarError("no micro-batch finished in 600 s; is the cluster alive? (ray status)")
            for ref in ready:
                self.settle(ref, bar)
            self.fill()
        bar.close()


def _stage_stats(replicas: list[list]) -> list[dict]:
    # late: ray reads its cluster mode when imported; connect() sets LOOPBACK_ENV first (cluster/localray.py)
    import ray

    stats = []
    for actors in replicas:
        for a in actors:
            try:
                stats.append(ray.get(a.get_stats.remote(), timeout=60))
            except Exception as e:  # noqa: BLE001
                stats.append({"error": str(e)[:200]})
    return stats


def _release(replicas: list[list], pgs: list) -> None:
    """Kill the stage actors and remove the placement groups (whatever is already gone is skipped)."""
    # late: ray reads its cluster mode when imported; connect() sets LOOPBACK_ENV first (cluster/localray.py)
    import ray
    from ray.util.placement_group import remove_placement_group

    for actors in replicas:
        for a in actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
    for pg in pgs:
        try:
            remove_placement_group(pg)
        except Exception:  # noqa: BLE001
            pass


def measured_bubble(stats: list[dict]) -> float:
    """Idle fraction of the stages: per replica, 1 - mean(stage busy time) / (last call end - first call start).

    Restarted actors only report their last incarnation, so the figure is approximate after a failure.
    """
    by_rep: dict[int, list[dict]] = {}
    for s in stats:
        if s.get("first_call") and s.get("last_call"):
            by_rep.setdefault(s["replica"], []).append(s)
    out = []
    for ss in by_rep.values():
        wall = max(s["last_call"] for s in ss) - min(s["first_call"] for s in ss)
        if wall > 0:
            out.append(1 - sum(s["busy_seconds"] for s in ss) / len(ss) / wall)
    return float(np.mean(out)) if out else 0.0


def _tensor(a: np.ndarray):
    return torch.from_numpy(np.ascontiguousarray(a))


def wait_alive(actors, timeout: float) -> None:
    """Block until every actor of a replica answers (Ray restarts dead ones up to max_restarts)."""
    # late: ray reads its cluster mode when imported; connect() sets LOOPBACK_ENV first (cluster/localray.py)
    import ray

    deadline = time.time() + timeout
    for a in actors:
        while True:
            try:
                ray.get(a.ping.remote(), timeout=max(1.0, deadline - time.time()))
                break
            except (ray.exceptions.RayError, TimeoutError) as e:
                if isinstance(e, ray.exceptions.RayActorError) and e.actor_init_failed:
                    msg = str(e).strip().splitlines()
                    raise OscarError("a stage actor failed to start: " + (msg[-1] if msg else repr(e))) from None
                if time.time() > deadline:
                    raise OscarError(f"a stage actor did not answer within {timeout:.0f}s (loading its layers, "
                                     f"or waiting for a node; cluster.startup_timeout)") from None
                time.sleep(0.5)


class _NoBar:
    def update(self, n):
        pass

    def close(self):
        pass


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoBar()

    return tqdm(total=total, desc="blocks (ray)", unit="block", file=sys.stderr)


# --------------------------------------------------------------------------- calibrate front end

def prepare_store(cfg) -> tuple[str, str]:
    """Create (or validate for resume) the store without loading weights: the driver of a
    Ray job must not hold the model. Returns (store path, local model directory)."""
    _, info = _prepare(cfg)
    return str(cfg.store), info.source


def cluster_config_from_args(args) -> ClusterConfig:
    mem = getattr(args, "memory_per_stage", None)
    res = getattr(args, "stage_resources", None)
    if res:
        try:
            res = json.loads(res)
        except ValueError as e:
            raise OscarError(f"--stage-resources is not JSON ({e}): {res!r}") from None
    return ClusterConfig(stages=args.stages or 1, replicas=args.replicas or 1, layers=getattr(args, "stage_layers", None),
                         cpus_per_stage=args.cpus_per_stage, gpus_per_stage=args.gpus_per_stage,
                         memory_per_stage=int(mem * (1 << 30)) if mem else None, max_restarts=args.max_restarts,
                         stage_resources=res or None)


def format_report(r: PipelineReport) -> str:
    ranges = ", ".join(f"{a}-{b - 1}" for a, b in r.stages)
    lines = [f"oscar calibrate (ray): {len(r.blocks_done)} blocks done, {r.blocks_skipped} already done, "
             f"{r.block_retries} redone after failures; {r.replicas} replica(s) x stages [{ranges}]",
             f"  {r.tokens:,} tokens in {r.wall_seconds:.1f} s ({r.tokens_per_second:,.0f} tok/s incl. "
             f"{r.startup_seconds:.1f} s of actor start); "
             f"pipeline bubble {r.bubble:.1%} measured, {r.bubble_ideal:.1%} ideal for "
             f"{r.micro_batch}-sequence micro-batches"]
    for f in r.failures:
        lines.append(f"  redone: {f}")
    for l, ex in r.unused_experts.items():
        if ex:
            lines.append(f"  layer {l}: experts with no routed token: {ex}")
    return "\n".join(lines)


def calibrate_on_ray(cfg, cc: ClusterConfig, address: str | None = "auto", progress: bool = True,
                     on_block=None) -> PipelineReport:
    """`oscar calibrate --ray ...`: the same store as the single-process path, computed by stage actors."""
    if cfg.device != "cpu" and not cc.gpus_per_stage:
        raise OscarError("--device cuda on Ray: give --gpus-per-stage (each stage actor gets its own GPUs)")
    cc.micro_batch = cfg.batch_size  # one notion of micro-batch: the summation order must match the single path
    cc.dtype = cfg.dtype
    lock = DirLock(cfg.store, store=True)
    lock.check_free()  # a second writer of the store: refused before any work (the driver holds it throughout)
    with lock:
        store, model_dir = prepare_store(cfg)
        connect(address, num_cpus=max(2, int(math.ceil(cc.stages * cc.replicas * cc.cpus_per_stage))))
        try:
            return run_pipeline(store, model_dir, cc, progress=progress, on_block=on_block)
        finally:
            if _LOCAL_RAY:
                disconnect()
