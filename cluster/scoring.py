"""Validation on the stage actors: a window's hidden states flow through the same layer ranges as calibration.

Each stage holds its own layers (cluster/loading.py; the first also the embeddings, the last also the final norm
and the LM head) and reads K/V the way the method under test stores them: the INT2 simulator of
kernels/window_attention.py over its own layers, or (bf16) the plain attention of one process. The last stage
turns the final hidden states into the window's NLL exactly as one process does (validate.ppl.hidden_nll), so
per-window NLLs equal one process's up to float summation order.

`ScoreStage` is a plain class (usable in one process); `score_actor_class()` wraps it with `ray.remote`.
`StagedScorer` starts one actor per stage and is what `validate.ppl.run_ppl(scorer=...)` calls: every window's
chain is submitted at once, so while stage 2 scores window w, stage 1 already runs window w + 1.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from oscar.cluster.loading import load_config, load_layer_range
from oscar.cluster.pipeline import ClusterConfig, connect, disconnect, place_groups, stage_ranges, wait_alive
from oscar.common import OscarError, set_threads
from oscar.kernels import cpu_attention
from oscar.kernels.window_attention import simulated
from oscar.pipeline.models import load_tokenizer, resolve_model
from oscar.validate.methods import PROTOCOLS
from oscar.validate.ppl import hidden_nll


@dataclass
class ScoreArgs:
    model_dir: str
    start: int
    stop: int
    stage: int = 0
    dtype: str = "float32"
    device: str = "cpu"
    threads: int = 1


class ScoreStage:
    """Layers [start, stop) of the model, scoring windows under a method's cache."""

    def __init__(self, args: ScoreArgs):
        self.args = args
        set_threads(args.threads)
        torch.set_grad_enabled(False)
        cpu_attention.register()
        config = load_config(args.model_dir, attn_implementation="sdpa")
        dtype = getattr(torch, args.dtype)
        self.stage, self.report = load_layer_range(args.model_dir, args.start, args.stop, config=config, dtype=dtype,
                                                   devices=[args.device], head=True)
        self.stage.to(dtype)  # buffers too (the rotary frequencies), as one process's `validate.env.with_dtype`
        self.arts: dict = {}
        self._sim: dict = {}  # (method, protocol) -> its simulator, built once (a LayerQuant per layer)

    def load(self, arts: dict) -> int:
        """The methods' artifacts (None: the plain model) by name, for the windows that follow."""
        self.arts, self._sim = arts, {}
        return os.getpid()

    def _reading(self, method: str, protocol: str):
        """How the stage's attention reads K/V for `method`: its INT2 simulator, or the plain attention."""
        if self.arts[method] is None:
            return cpu_attention.native_prefill(self.stage)
        if (method, protocol) not in self._sim:
            self._sim[(method, protocol)] = simulated(self.stage, self.arts[method], PROTOCOLS[protocol])
        return self._sim[(method, protocol)]

    def forward(self, x: torch.Tensor, method: str, protocol: str, ids: torch.Tensor, cuts: tuple):
        """Token ids (first stage) or hidden states in; hidden states out, or on the last stage what
        `validate.ppl.window_nll` returns for the window `ids` (1, T)."""
        spec = self.stage.spec
        with self._reading(method, protocol):
            h = self.stage.embed(x.to(self.args.device)) if spec.first else x  # (1, T, H)
            h = self.stage(h)  # (1, T, H)
        if not spec.last:
            return h
        return hidden_nll(self.stage.lm_head, self.stage.norm(h), ids.to(h.device), prefixes=cuts)

    def ping(self) -> bool:
        return True


def score_actor_class():
    """`ScoreStage` as a Ray actor class (Ray imported only here)."""
    # late: ray reads its cluster mode when imported; connect() sets LOOPBACK_ENV first (cluster/localray.py)
    import ray

    return ray.remote(ScoreStage)


class StagedScorer:
    """The model as pipeline stages on a Ray cluster, for `run_ppl(scorer=...)`; a context manager (stops the
    actors, and the local cluster it started)."""

    def __init__(self, model: str, cc: ClusterConfig, address: str | None = "auto"):
        self.model_dir = resolve_model(model)
        self.config = load_config(self.model_dir)
        self.tokenizer = load_tokenizer(model)
        if cc.device != "cpu":
            raise OscarError("perplexity on the pipeline stages runs on CPU stages here (--gpus-per-stage 0)")
        text = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        self.ranges = stage_ranges(self.model_dir, cc, int(text.num_hidden_layers))
        self.cc, self.address, self.started = cc, address, False
        self.dtype = cc.dtype  # the stages' weights and compute
        self.actors: list = []
        self.pgs: list = []

    def __enter__(self):
        return self

    def _start(self) -> None:
        """Connect and start the stage actors: at the first `load`, after the caller's checks of its inputs."""
        self.started = connect(self.address, num_cpus=max(2, int(self.cc.stages * self.cc.cpus_per_stage))) == "local"
        # late: ray reads its cluster mode when imported; connect() sets LOOPBACK_ENV first (cluster/localray.py)
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        place_groups(self.cc, len(self.ranges), "score", self.pgs)
        Actor = score_actor_class()
        for i, (a, b) in enumerate(self.ranges):
            args = ScoreArgs(self.model_dir, a, b, stage=i, dtype=self.cc.dtype, threads=self.cc.threads)
            self.actors.append(Actor.options(
                num_cpus=self.cc.cpus_per_stage, max_restarts=self.cc.max_restarts,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=self.pgs[0],
                                                                     placement_group_bundle_index=i)).remote(args))
        wait_alive(self.actors, self.cc.startup_timeout)

    def __exit__(self, *exc):
        if not (self.actors or self.pgs or self.started):
            return
        # late: ray reads its cluster mode when imported; connect() sets LOOPBACK_ENV first (cluster/localray.py)
        import ray
        from ray.util.placement_group import remove_placement_group

        for a in self.actors:
            ray.kill(a)
        for pg in self.pgs:
            remove_placement_group(pg)
        self.actors, self.pgs = [], []
        if self.started:
            disconnect()

    def load(self, arts: dict) -> None:
        # late: ray reads its cluster mode when imported; connect() sets LOOPBACK_ENV first (cluster/localray.py)
        import ray

        if not self.actors:
            self._start()
        ref = ray.put(arts)
        ray.get([a.load.remote(ref) for a in self.actors])

    def score(self, jobs: list[tuple]):
        """For each (method, protocol, window ids (1, T), cuts), in order: what `window_nll` returns."""
        # late: ray reads its cluster mode when imported; connect() sets LOOPBACK_ENV first (cluster/localray.py)
        import ray

        refs = []
        for m, p, win, cuts in jobs:
            x = win
            for a in self.actors:
                x = a.forward.remote(x, m, p, win, cuts)
            refs.append(x)
        for r in refs:  # in order: the caller records each as it arrives (resume loses at most what is in flight)
            yield ray.get(r)
