"""Stage actors: one contiguous layer range each, capturing and writing its own layers.

`StageWorker` is a plain class (usable in one process, and what the tests drive
directly); `stage_actor_class()` wraps it with `ray.remote`. A stage:

- loads only its layers (cluster/loading.py) and switches them to the capturing
  attention function of oscar.pipeline.capture;
- receives micro-batches of one block in order: token ids (first stage) or hidden
  states (later stages) plus the padding mask, runs its layers, and passes the
  hidden states on through Ray's object store;
- on `commit` (called after the block's last micro-batch, so the next stage is
  already computing) writes its layers' chunks and `done[b, l]` markers (one owner
  per chunk), MoE expert token counts first.

An actor restart re-runs the constructor and restores nothing in memory: the
store is the state. A block whose micro-batches a stage did not all see (it
restarted mid-block) is refused with `StageStateError` (at the next micro-batch
or at `commit`) and the driver redoes the whole block; re-writing a block's
chunks is idempotent (exactly once).
"""

from __future__ import annotations

import os
import resource
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from oscar.cluster.loading import load_config, load_layer_range
from oscar.common import OscarError, attention_shapes, is_latent, keep_freed_memory, latent_shapes, set_threads
from oscar.kernels import cpu_attention
from oscar.pipeline import capture
from oscar.pipeline.calibrate import store_offsets
from oscar.pipeline.capture import StopForward
from oscar.pipeline.latent import LatentSpec
from oscar.pipeline.store import CalibStore, WriterLock

EXPERT_ARRAY = "expert_tokens"  # layers/{l}/expert_tokens: int64 (B, E), MoE layers only


class StageStateError(RuntimeError):
    """A stage saw a micro-batch out of sequence (it restarted mid-block): redo the block."""


@dataclass
class StageArgs:
    """Everything a stage actor needs (picklable; its constructor re-reads the rest from disk)."""

    model_dir: str
    start: int
    stop: int
    store: str
    job: str                   # writer-lock job id shared by the driver and its actors
    attn: str = "sdpa"         # wrapped attention implementation
    sink: int = 0
    reservoir: int = 256
    seed: int = 0
    seqs_per_block: int = 1
    threads: int = 1
    dtype: str = "float32"
    device: str = "cpu"
    stage: int = 0
    replica: int = 0
    throttle_s: float = 0.0    # sleep after each micro-batch (not counted as busy)
    num_devices: int = 1       # GPUs of this stage: its layers are spread over cuda:0..n-1


@dataclass
class StageStats:
    stage: int
    replica: int
    layers: tuple[int, int]
    pid: int
    started: float
    load_seconds: float
    busy_seconds: float = 0.0
    micro_batches: int = 0
    blocks_written: list[int] = field(default_factory=list)
    first_call: float | None = None
    last_call: float | None = None
    node_id: str | None = None  # Ray node running this incarnation (None outside Ray)
    torch_threads: int | None = None  # torch.get_num_threads() seen by the first micro-batch
    # (start, end of compute, end incl. throttle) of each forward call, time.time(): the schedule a
    # benchmark reads back (bench/pipeline_bubble.py); 24 bytes a micro-batch
    spans: list[tuple[float, float, float]] = field(default_factory=list)


def router_modules(stage) -> dict[int, torch.nn.Module]:
    """{layer: MoE router module} of the layers a stage holds (modules with `experts` and `gate`)."""
    out = {}
    for key, layer in stage.layers.items():
        mlp = getattr(layer, "mlp", None)
        if mlp is not None and hasattr(mlp, "experts") and hasattr(mlp, "gate"):
            out[int(key)] = mlp.gate
    return out


def _topk_indices(output) -> torch.Tensor:
    """The selected-expert indices (N, top_k) in a router's output tuple."""
    items = output if isinstance(output, (tuple, list)) else (output,)
    ints = [t for t in items if isinstance(t, torch.Tensor) and not t.is_floating_point()]
    if not ints:
        raise OscarError("MoE router output holds no expert indices; cannot count tokens per expert")
    return ints[-1]


class StageWorker:
    def __init__(self, args: StageArgs):
        t0 = time.time()
        self.args = args
        set_threads(args.threads)
        keep_freed_memory()  # as `oscar calibrate`: the forward's activations stay allocated between layers
        torch.set_grad_enabled(False)
        cpu_attention.register()  # the capture's sdpa runs the native CPU kernel (pipeline/capture.native_attention)
        name = capture.register(args.attn)
        config = load_config(args.model_dir, attn_implementation=name)
        devices = ([f"cuda:{i}" for i in range(max(1, args.num_devices))] if args.device == "cuda"
                   else [args.device])
        self.stage, self.report = load_layer_range(args.model_dir, args.start, args.stop, config=config,
                                                   dtype=getattr(torch, args.dtype), devices=devices)
        self.layers = tuple(range(args.start, args.stop))
        kw = dict(layers=self.layers, sink=args.sink, reservoir=args.reservoir, seed=args.seed,
                  seqs_per_block=args.seqs_per_block)
        if is_latent(config):  # an MLA model: the latent statistics, its layers' latents handed over by hooks
            spec = LatentSpec.of(latent_shapes(config), **kw)
            capture.hook_latents(self.stage)
        else:
            sh = attention_shapes(config)
            spec = capture.CaptureSpec(sh["num_q_heads"], sh["num_kv_heads"], sh["head_dim"], **kw)
        self.cap = capture.Capture(spec)
        self.store = CalibStore(args.store, mode="r+")

        self.offsets = store_offsets(self.store.meta)  # (B, S) RoPE start of every window (`--positions`; zeros)
        self.lock = WriterLock(args.store, self.layers, job=args.job).acquire()
        # MoE: count tokens routed to each expert (hook on the router: grouped expert kernels can't bypass it).
        self.routers = router_modules(self.stage)
        if self.stage.spec.last and self.layers[-1] not in self.routers:
            # the last stage's final MLP and norm are dead compute (no logits); an MoE router there still counts
            self.cap.stop_after = self.layers[-1]
        self.num_experts = 0
        self.expert_counts: dict[int, torch.Tensor] = {}
        self._valid: torch.Tensor | None = None  # (mb*T,) bool: real tokens of the current micro-batch
        for l, gate in self.routers.items():
            self.num_experts = int(getattr(gate, "num_experts", 0) or getattr(self.stage.layers[str(l)].mlp.experts,
                                                                               "num_experts", 0))
            gate.register_forward_hook(self._count_hook(l))
        self._expect: tuple[int, int, str] | None = None  # (block, next micro-batch, attempt)
        self.stats = StageStats(args.stage, args.replica, (args.start, args.stop), os.getpid(), t0, time.time() - t0)
        self.stats.node_id = _ray_node_id()

    # ------------------------------------------------------------------ MoE counts
    def _count_hook(self, layer: int):
        def hook(module, inputs, output):
            idx = _topk_indices(output)  # (N, top_k)
            if self._valid is not None:
                idx = idx[self._valid[: idx.shape[0]]]
            self.expert_counts[layer] += torch.bincount(idx.reshape(-1).long(), minlength=self.num_experts).cpu()
        return hook

    # ------------------------------------------------------------------ work
    def forward(self, block: int, mb: int, seq_offset: int, payload: dict, attempt: str = "") -> dict:
        """Run micro-batch `mb` of `block` (attempt `attempt`) and pass the hidden states on."""
        t0 = time.time()
        if self.stats.first_call is None:
            self.stats.first_call, self.stats.torch_threads = t0, torch.get_num_threads()
        if mb == 0:
            self.cap.start_block(block)
            self.expert_counts = {l: torch.zeros(self.num_experts, dtype=torch.int64) for l in self.routers}
            self._expect = (block, 0, attempt)
        if self._expect != (block, mb, attempt):
            got = self._expect
            if got is None or got[2] == attempt:  # a late call of an abandoned attempt leaves the current one be
                self._expect = None
            raise StageStateError(f"stage {self.args.stage} (layers {self.args.start}-{self.args.stop - 1}, pid "
                                  f"{os.getpid()}) got block {block} micro-batch {mb} but expected {got}: it lost "
                                  f"its in-memory state (restart); the block must be redone")
        mask = payload["mask"]  # (mb, T) uint8
        self._valid = mask.reshape(-1).bool()
        with self.cap.batch(mask, seq_offset):
            if self.stage.spec.first:
                hidden = self.stage.embed(payload["input_ids"].long())  # (mb, T, H)
            else:
                hidden = payload["hidden"]
            T = mask.shape[1]
            pos = torch.from_numpy(self.offsets[block, seq_offset:seq_offset + mask.shape[0], None]
                                   + np.arange(T))                          # (mb, T)
            try:
                hidden = self.stage(hidden, attention_mask=mask, position_ids=pos)
            except StopForward:  # last stage: nothing after its last attention is needed
                hidden = None
        self._valid = None
        self._expect = (block, mb + 1, attempt)
        out: dict = {"block": block, "mb": mb}
        if not self.stage.spec.last:
            out.update(hidden=hidden, mask=mask)
        t1 = time.time()
        if self.args.throttle_s:
            time.sleep(self.args.throttle_s)
        self.stats.spans.append((t0, t1, time.time()))
        self.stats.busy_seconds += t1 - t0
        self.stats.micro_batches += 1
        self.stats.last_call = t1
        return out

    def commit(self, block: int, n_mb: int, attempt: str = "") -> dict:
        """Write the block's chunks of this stage's layers once all `n_mb` micro-batches of this
        attempt went through. A separate call after the last `forward`: the next stage already has
        the last hidden states and computes while this one writes."""
        t0 = time.time()
        if self._expect != (block, n_mb, attempt):
            got = self._expect
            if got is None or got[2] == attempt:
                self._expect = None
            raise StageStateError(f"stage {self.args.stage} (layers {self.args.start}-{self.args.stop - 1}, pid "
                                  f"{os.getpid()}) asked to commit block {block} after {n_mb} micro-batches but "
                                  f"is at {got}: it lost its in-memory state (restart); the block must be redone")
        self._write(block)
        self._expect = None
        t1 = time.time()
        self.stats.busy_seconds += t1 - t0
        self.stats.last_call = t1
        return {"block": block, "written": list(self.layers)}

    def _write(self, block: int) -> None:
        arrays = self.cap.finish_block(self.layers)
        todo = {l: arrays[l] for l in self.layers if not self.store.done_at(block, l)}  # never rewrite a done chunk
        # expert counts are written and checksummed with their layer, before the done markers (the commit point)
        extra = {l: {EXPERT_ARRAY: self.expert_counts[l].numpy()} for l in todo if l in self.expert_counts}
        self.store.write_block(block, todo, extra=extra)  # one filesystem sync for the stage's layers
        self.stats.blocks_written.append(block)

    # ------------------------------------------------------------------ introspection
    def info(self) -> dict:
        return {"stats": asdict(self.stats), "keys": self.report.keys, "shards": self.report.shards,
                "bytes": self.report.bytes, "params": [n for n, p in self.stage.named_parameters()],
                "pid": os.getpid(), "num_experts": self.num_experts}

    def get_stats(self) -> dict:
        return {**asdict(self.stats), "peak_rss_bytes": peak_rss_bytes()}

    def pid(self) -> int:
        return os.getpid()

    def ping(self) -> bool:
        return True

    def close(self) -> None:
        self.lock.release()


def _ray_node_id() -> str | None:
    if "ray" not in sys.modules:  # a plain StageWorker outside Ray
        return None
    # late: ray reads its cluster mode when imported; connect() sets LOOPBACK_ENV first (cluster/localray.py)
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM), in bytes."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def stage_actor_class():
    """`StageWorker` as a Ray actor class (Ray imported only here)."""
    # late: ray reads its cluster mode when imported; connect() sets LOOPBACK_ENV first (cluster/localray.py)
    import ray

    return ray.remote(StageWorker)
