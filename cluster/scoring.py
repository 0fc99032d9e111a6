"""Validation on the stage actors: a window's hidden states flow through the same layer ranges as calibration.

Two kinds of work: perplexity windows (`forward`, below) and needle batches, by either engine (oscar/scoring/engine.py):
- simulate (`rows_*`): each sample's haystack prefilled exactly through the stages, each stage keeping its own
  layers' rows of the batch's INT2 cache, then greedy decoding with one chain of stage calls per token, driven by
  the same loop as one process, `scoring.rows.run_rows`;
- cache (`cache_*`): the product path, `engine.niah_answers` on the stages: per (sample, method) row every stage
  builds a fresh OscarCache of its own layers on its device (kernels chosen by the dispatcher: Triton on CUDA, the
  torch reference on CPU), the haystack and the question go through the stages as chunks, then one chain of stage
  calls per greedy token (`engine.greedy_tokens`), the last stage picking it.

Each stage holds its own layers (cluster/loading.py; the first also the embeddings, the last also the final norm
and the LM head) and reads K/V the way the method under test stores them: the INT2 simulator of
kernels/window_attention.py over its own layers, or (bf16) the plain attention of one process. The last stage
turns the final hidden states into the window's NLL exactly as one process does (scoring.nll.hidden_nll), so
per-window NLLs equal one process's up to float summation order.

`ScoreStage` is a plain class (usable in one process); `score_actor_class()` wraps it with `ray.remote`.
`StagedScorer` starts one actor per stage and is what `validate.ppl.run_ppl(scorer=...)` calls: every window's
chain is submitted at once, so while stage 2 scores window w, stage 1 already runs window w + 1.
`StagedScorer.copy_gradients` runs the recipe's widths' gradient (oscar/recipe/widths.py) a window at a time, forward and
backward through the stages, each stage summing its own layers (kernels/grad_attention.py, as one process).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
from transformers import GenerationConfig

from oscar.cluster.loading import load_config, load_layer_range
from oscar.cluster.pipeline import ClusterConfig, connect, disconnect, place_groups, stage_ranges, wait_alive
from oscar.common import OscarError, is_latent, set_threads
from oscar.kernels import cpu_attention
from oscar.kernels import rowbatch as rowbatch_kernels
from oscar.kernels.backends import CacheSpec, make_cache
from oscar.kernels.simulate import CODECS, register_codecs
from oscar.kernels.grad_attention import (copy_nll_sum, drop_leaves, fresh_leaves, gradient_mode, layer_quants,
                                          window_sums)
from oscar.kernels.window_attention import simulated
from oscar.pipeline.models import load_tokenizer, resolve_model
from oscar.scoring import engine
from oscar.scoring.protocols import PROTOCOLS
from oscar.scoring.latent import latent_cache, window_chunks as latent_chunks
from oscar.scoring.prefill import PrefillPool, batch_capacity
from oscar.scoring.nll import hidden_nll
from oscar.scoring.rows import positions, run_rows


# Hidden states go from stage to stage as host tensors: each stage's process sees only the GPU Ray gave it, so a
# CUDA tensor's device index means nothing in the next one (a one-token decode hop is a few KB).


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
        self.stage.to(dtype)  # buffers too (the rotary frequencies), as one process's `scoring.dtype.with_dtype`
        self.latent = is_latent(config)  # an MLA model: every row and window through its latent cache (cache_*)
        self.arts: dict = {}
        self._sim: dict = {}  # (method, protocol) -> its simulator, built once (a LayerQuant per layer)
        rowbatch_kernels.register()  # the needle decode's attention (rows_step)
        self.pool = PrefillPool(self.stage)  # the needle batches' exact prefills, this stage's layers
        self.rows = None  # the needle batch's RowBatchCache, this stage's layers
        self.cache = None  # the needle row's or window's cache under --engine cache (OscarCache or exact), its layers
        self.kept = None  # the last stage: the window's final hidden states under --engine cache

    def load(self, arts: dict, codecs: dict | None = None) -> int:
        """The methods' artifacts (None: the plain model) by name, for the windows that follow; `codecs`: the
        simulator's codec readers the driver registered (`kernels.simulate.CODECS`: codebook formats, per-layer
        widths), so this process reads the same artifacts without importing the modules that define them."""
        register_codecs(codecs or {})
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
        `scoring.nll.window_nll` returns for the window `ids` (1, T)."""
        spec = self.stage.spec
        x = x.to(self.args.device)
        with self._reading(method, protocol):
            h = self.stage.embed(x) if spec.first else x  # (1, T, H)
            h = self.stage(h)  # (1, T, H)
        if not spec.last:
            return h.cpu()
        return hidden_nll(self.stage.lm_head, self.stage.norm(h), ids.to(h.device), prefixes=cuts)

    # ------------------------------------------------------------------ needles: a row batch's prefill and decode

    def rows_begin(self, groups: list[list[str]], protocol: str, capacity: int) -> float:
        """A needle batch: this stage's layers of one `RowBatchCache` (kernels/rowbatch.py) whose group g holds
        sample g's methods `groups[g]` (names of loaded artifacts). Returns this process's CPU seconds so far."""
        text = self.stage.config.get_text_config() if hasattr(self.stage.config, "get_text_config") else self.stage.config
        spec = self.stage.spec
        self.rows = make_cache(CacheSpec.rows([[self.arts[m] for m in g] for g in groups], PROTOCOLS[protocol],
                                              capacity=capacity, num_layers=int(text.num_hidden_layers),
                                              dtype=getattr(torch, self.args.dtype), held=range(spec.start, spec.stop)),
                               "rows")
        return time.process_time()

    def rows_prefill(self, g: int, ids: list[int], prev: tuple | None = None):
        """Sample g's chunk 1 (`ids`), exact, into the batch's group g, as `scoring.prefill.PrefillPool` prefills it
        in one process (the longest prefix a kept prefill shares is not recomputed). The first stage embeds
        ids[n:]; a later one receives (hidden states of ids[n:] (1, T - n, H), n) from the stage before."""
        spec = self.stage.spec
        n, cache = self.pool.lookup(ids)
        if spec.first:
            x = self.stage.embed(torch.tensor([ids[n:]], device=self.args.device))  # (1, T - n, H)
        else:
            x, sent = prev
            x = x.to(self.args.device)
            if sent != n:  # every stage keeps the same prompts in the same order, so this is a bug
                raise OscarError(f"stage {self.args.stage}: prefix of {n} tokens kept, the stage before reused {sent}")
        pos = torch.arange(n, len(ids), device=self.args.device)[None]  # (1, T - n)
        with cpu_attention.native_prefill(self.stage):
            h = self.stage(x, position_ids=pos, cache=cache)  # (1, T - n, H)
        self.pool.store(ids, n, cache)
        self.rows.load(g, cache)
        return None if spec.last else (h.cpu(), n)

    def rows_step(self, x: torch.Tensor, last: torch.Tensor | None = None):
        """One step of the active rows: token ids (A, t) in at the first stage, hidden states (A, t, H) from the
        stage before otherwise; hidden states out, or at the last stage each row's greedy next token, read at
        its chunk position `last` (A,) as `scoring.rows.LocalRows.step` reads it."""
        spec = self.stage.spec
        pos = positions(self.rows, x.shape[1]).to(self.args.device)  # (A, t)
        x = x.to(self.args.device)
        h = self.stage.embed(x) if spec.first else x  # (A, t, H)
        impl = self.stage.config._attn_implementation
        self.stage.set_attn_implementation(rowbatch_kernels.ATTN)
        try:
            h = self.stage(h, position_ids=pos, cache=self.rows)  # (A, t, H)
        finally:
            self.stage.set_attn_implementation(impl)
        self.rows.set_chunk(None)
        if not spec.last:
            return h.cpu()
        h = self.stage.norm(h)
        return self.stage.lm_head(h[torch.arange(h.shape[0]), last.to(h.device)]).argmax(-1).tolist()  # (A,)

    def rows_chunk(self, lengths: list[int] | None) -> None:
        self.rows.set_chunk(lengths)

    def rows_keep(self, slots: list[int]) -> list[int]:
        return self.rows.keep(slots)

    def rows_end(self) -> float:
        """The batch is done: its cache is freed. Returns this process's CPU seconds so far."""
        self.rows = None
        return time.process_time()

    # ------------------------------------------------------------------ needles through the product cache (--engine cache)

    def cache_begin(self, method: str, protocol: str, max_len: int, keep: bool = False) -> float:
        """A fresh cache for one needle row or perplexity window over this stage's layers, as `engine.niah_answers` /
        `engine.token_nll` build it in one process (`engine.new_cache`: the method's OscarCache, or the exact cache
        for bf16), on this stage's device. keep: the last stage keeps every chunk's final hidden states (`cache_nll`).
        Returns this process's CPU seconds so far."""
        spec = self.stage.spec
        if self.latent:  # the latent cache's simulator (oscar/scoring/latent.py), or the exact cache for bf16
            art = self.arts[method]
            self.cache = latent_cache(self.stage, art, PROTOCOLS[protocol] if art is not None else None,
                                      held=range(spec.start, spec.stop))
        else:
            with engine.served(self.stage):  # from_artifact switches the attention; restored after
                self.cache = engine.new_cache(self.stage, method, self.arts[method], PROTOCOLS[protocol], max_len,
                                              held=range(spec.start, spec.stop))
        self.kept = [] if keep and spec.last else None
        return time.process_time()

    def cache_forward(self, x: torch.Tensor, pick: bool = False):
        """One chunk of the row through this stage's layers and its cache: token ids (1, t) in at the first stage,
        hidden states (1, t, H) from the stage before otherwise; hidden states out, or at the last stage the greedy
        next token (`engine.next_token`) when `pick`, else None (the haystack chunk)."""
        spec = self.stage.spec
        x = x.to(self.args.device)
        n = self.cache.get_seq_length(spec.start)
        pos = torch.arange(n, n + x.shape[1], device=self.args.device)[None]  # (1, t): the row's next positions
        h = self.stage.embed(x) if spec.first else x  # (1, t, H)
        with contextlib.nullcontext() if self.latent else engine.served(self.stage):
            h = self.stage(h, position_ids=pos, cache=self.cache)  # (1, t, H)
        if not spec.last:
            return h.cpu()
        if self.kept is not None:
            self.kept.append(self.stage.norm(h))  # (1, t, H): what one process's `model.model` returns
        return engine.next_token(self.stage.lm_head(self.stage.norm(h[:, -1:]))[:, -1]) if pick else None  # (1, V)

    def cache_nll(self, ids: torch.Tensor, prefixes: tuple) -> tuple:
        """The last stage, after every chunk of the window `ids` (1, T): what `engine.window_nll` returns."""
        nll = engine.hidden_token_nll(self.stage.lm_head, torch.cat(self.kept, 1), ids.to(self.args.device))
        self.kept = None
        return engine.nll_sums(nll, prefixes)

    def cache_end(self) -> float:
        """The row is done: its pages go back and the cache is dropped. Returns this process's CPU seconds so far."""
        engine.free_cache(self.cache)
        self.cache, self.kept = None, None
        return time.process_time()

    def ping(self) -> bool:
        return True

    # The per-layer widths' gradient (oscar/recipe/widths.py `layer_copy_gradients`), a window at a time: every stage runs
    # its layers forward keeping the graph, the last differentiates the copy NLL, each earlier stage backpropagates
    # the gradient of the hidden states the next one received, then every stage sums its own layers.

    def grad_setup(self, arts: list, options: tuple, protocol: str, dtype: str, codecs: dict | None = None) -> int:
        """Quantizers of this stage's layers at each option (arts[o]: every layer at options[o]), the stage in
        `dtype` (the widths' compute dtype, as one process's `with_dtype` before its estimate; `grad_end` restores
        the stage's own); `codecs` as `load`'s (the options' artifacts are per-layer widths)."""
        register_codecs(codecs or {})
        cp = PROTOCOLS[protocol]
        self._grad = {"heads": arts[0].num_kv_heads, "options": options, "protocol": cp, "graph": None,
                      "quants": layer_quants(arts, cp, self.stage.spec.layers)}
        self.stage.to(getattr(torch, dtype))
        return os.getpid()

    def grad_forward(self, x: torch.Tensor, win: torch.Tensor, pos: torch.Tensor) -> torch.Tensor | None:
        """Token ids (first stage) or hidden states in; hidden states out, or on the last stage after the backward
        of the copy NLL summed at `pos` of `win` (1, T): the gradient of its input hidden states (None when it is
        the only stage)."""
        spec, g = self.stage.spec, self._grad
        fresh_leaves(spec.num_layers)
        x = x.to(self.args.device)
        leaf = None if spec.first else x.detach().requires_grad_()  # (1, T, H): what the previous stage backpropagates
        with gradient_mode(self.stage, g["quants"][0], g["protocol"]), torch.enable_grad():
            h = self.stage(self.stage.embed(x) if spec.first else leaf)  # (1, T, H)
            if spec.last:
                copy_nll_sum(self.stage.lm_head, self.stage.norm(h), win.to(h.device), pos.to(h.device)).backward()
                return None if leaf is None else leaf.grad.cpu()
        g["graph"] = (leaf, h)
        return h.detach().cpu()  # host tensors between stages, as `forward`'s

    def grad_backward(self, grad: torch.Tensor) -> torch.Tensor | None:
        """The gradient of this stage's output in; its input's out (None on the first stage)."""
        leaf, h = self._grad["graph"]
        self._grad["graph"] = None
        with torch.enable_grad():
            h.backward(grad.to(h.device))
        return None if leaf is None else leaf.grad.cpu()

    def grad_sums(self) -> np.ndarray:
        """(its layers, Hkv, O): the window's sums over this stage's layers (`window_sums`), its leaves dropped."""
        g = self._grad
        try:
            return window_sums(self.stage.spec.layers, g["options"], g["quants"], g["heads"])
        finally:
            drop_leaves()

    def grad_end(self) -> bool:
        """The stage back in its own dtype, for the windows it scores next."""
        self._grad = {}
        self.stage.to(getattr(torch, self.args.dtype))
        return True


def generation_config(model_dir: str, config) -> GenerationConfig:
    """What `from_pretrained` gives a loaded model: the checkpoint's generation_config.json, else the config's."""
    try:
        return GenerationConfig.from_pretrained(model_dir)
    except OSError:
        return GenerationConfig.from_model_config(config)


def score_actor_class():
    """`ScoreStage` as a Ray actor class (Ray imported only here)."""
    # late: ray reads its cluster mode when imported; connect() sets LOOPBACK_ENV first (cluster/localray.py)
    import ray

    return ray.remote(ScoreStage)


class Calls:
    """How the driver calls its stages: Ray actors (`call` submits `actor.method.remote(...)`, `get` waits), or
    `ScoreStage` objects in this process (`Calls.direct()`: where Ray is not installed, e.g. a GPU check)."""

    def __init__(self, call=None, get=None):
        self.call = call or (lambda a, name, *args: getattr(a, name).remote(*args))
        self.get = get or _ray_get

    @staticmethod
    def direct() -> "Calls":
        return Calls(lambda a, name, *args: getattr(a, name)(*args), lambda x: x)


def _ray_get(refs):
    # late: ray reads its cluster mode when imported; connect() sets LOOPBACK_ENV first (cluster/localray.py)
    import ray

    return ray.get(refs)


class StagedRows:
    """A row batch held by the stages, as `scoring.rows.run_rows` drives it (its `LocalRows` in one process):
    every stage keeps the same rows in the same slots; a step is one chain of calls through them."""

    def __init__(self, stages: list, rows: int, calls: Calls):
        self.stages, self.rows, self.c = stages, rows, calls
        self.order = list(range(rows))  # active slot -> row, as RowBatchCache.keep moves them on every stage

    def set_chunk(self, lengths: list[int] | None) -> None:
        self.c.get([self.c.call(a, "rows_chunk", lengths) for a in self.stages])

    def keep(self, slots: list[int]) -> list[int]:
        srcs = self.c.get([self.c.call(a, "rows_keep", slots) for a in self.stages])
        if any(s != srcs[0] for s in srcs):
            raise OscarError(f"the stages moved their rows differently: {srcs}")
        self.order = [self.order[s] for s in srcs[0]]
        return srcs[0]

    def step(self, ids: torch.Tensor, last: torch.Tensor) -> list[int]:
        return chain(self.c, self.stages, "rows_step", ids, last)


def chain(c: Calls, stages: list, name: str, x, *last_args):
    """`x` through method `name` of every stage in order (each stage's output the next one's input; the last one also
    gets `last_args`); the last stage's result."""
    for a in stages[:-1]:
        x = c.call(a, name, x)
    return c.get(c.call(stages[-1], name, x, *last_args))


def batch_cost(samples, cpu_s: float, wall0: float, stages: list) -> dict:
    """What a needle batch cost on the stages (the fields of `validate.niah._timed`, and the number of stages)."""
    return {"batch_samples": len(samples), "batch_cpu_s": round(cpu_s, 2),
            "batch_wall_s": round(time.perf_counter() - wall0, 2), "stages": len(stages)}


def needle_batch(stages: list, samples, names: list[list[str]], protocol: str, eos: set[int],
                 calls: Calls | None = None) -> tuple[list[list[int]], dict]:
    """What `validate.niah._decode_timed` returns for one batch, computed by `stages` (their artifacts loaded):
    sample g's chunk 1 prefilled exactly through every stage (the samples' chains submitted at once, so Ray's
    stages pipeline them), each stage keeping its layers of the batch's rows for sample g's methods `names[g]`,
    then the rows decoded greedily together (`scoring.rows.run_rows`, one chain of stage calls per step)."""
    c = calls or Calls()
    w0 = time.perf_counter()
    c0 = c.get([c.call(a, "rows_begin", names, protocol, batch_capacity(samples)) for a in stages])
    ends = []
    for g, s in enumerate(samples):
        x = None
        for a in stages:
            x = c.call(a, "rows_prefill", g, s.context_ids, x)
        ends.append(x)
    c.get(ends)
    gens = run_rows(StagedRows(stages, sum(len(n) for n in names), c),
                    [s.question_ids for s, ms in zip(samples, names) for _ in ms],
                    [s.max_new_tokens for s, ms in zip(samples, names) for _ in ms], eos)
    c1 = c.get([c.call(a, "rows_end") for a in stages])
    return gens, batch_cost(samples, sum(c1) - sum(c0), w0, stages)


def cache_needle_batch(stages: list, samples, names: list[list[str]], protocol: str, eos: set[int],
                       calls: Calls | None = None) -> tuple[list[list[int]], dict]:
    """What `engine.niah_answers` returns for one batch (timed as `validate.niah._timed`), computed by `stages` (their
    artifacts loaded) with the product cache: per (sample, method) row in its order, a fresh cache on every stage over
    its own layers, the haystack as one chunk through the stages, then the question chunk and one chain of stage
    calls per greedy token (`engine.greedy_tokens`), the last stage picking it."""
    c = calls or Calls()
    w0, cpu, gens = time.perf_counter(), 0.0, []
    for s, ms in zip(samples, names):
        ctx = torch.tensor([s.context_ids])  # (1, T)
        for m in ms:
            c0 = c.get([c.call(a, "cache_begin", m, protocol, engine.row_length(s)) for a in stages])
            chain(c, stages, "cache_forward", ctx)
            step = lambda ids: chain(c, stages, "cache_forward", torch.tensor([ids]), True)  # noqa: E731  (1, t) ids
            gens.append(engine.greedy_tokens(step, s.question_ids, s.max_new_tokens, eos))
            cpu += sum(c.get([c.call(a, "cache_end") for a in stages])) - sum(c0)
    return gens, batch_cost(samples, cpu, w0, stages)


def cache_window(actors: list, method: str, protocol: str, win: torch.Tensor, cuts: tuple,
                 chunks: list[tuple[int, int]] | None = None):
    """`engine.window_nll` of window `win` (1, T) on Ray stage actors, submitted whole without waiting (an actor runs
    one caller's calls in order, so the stages pipeline consecutive windows): a fresh cache per stage, the window's
    chunks (`engine.window_chunks`; an MLA model's: `scoring.latent.window_chunks`) through the stages, the NLL on
    the last. Returns the result's object ref."""
    T = win.shape[1]
    for a in actors:
        a.cache_begin.remote(method, protocol, T, True)
    for s, e in chunks or engine.window_chunks(T):
        x = win[:, s:e]  # (1, e - s)
        for a in actors:
            x = a.cache_forward.remote(x)
    ref = actors[-1].cache_nll.remote(win, cuts)
    for a in actors:
        a.cache_end.remote()
    return ref


class StagedScorer:
    """The model as pipeline stages on a Ray cluster, for `run_ppl(scorer=...)`; a context manager (stops the
    actors, and the local cluster it started)."""

    def __init__(self, model: str, cc: ClusterConfig, address: str | None = "auto"):
        self.model_dir = resolve_model(model)
        self.config = load_config(self.model_dir)
        self.tokenizer = load_tokenizer(model)
        self.generation_config = generation_config(self.model_dir, self.config)  # the needles' EOS
        text = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        self.ranges = stage_ranges(self.model_dir, cc, int(text.num_hidden_layers))
        self.cc, self.address, self.started = cc, address, False
        self.dtype = cc.dtype  # the stages' weights and compute
        self.actors: list = []
        self.pgs: list = []
        self.exact: set[str] = set()  # the loaded methods without an artifact (bf16)
        self.arts: dict = {}
        self.latent = is_latent(self.config)  # an MLA model: rows and windows through the latent cache, either engine

    def __enter__(self):
        return self

    def _start(self) -> None:
        """Connect and start the stage actors: at the first `load`, after the caller's checks of its inputs."""
        self.started = connect(self.address, num_cpus=max(2, int(self.cc.stages * self.cc.cpus_per_stage))) == "local"
        # late: ray reads its cluster mode when imported; connect() sets LOOPBACK_ENV first (cluster/localray.py)
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        need, have = self.cc.gpus_per_stage * len(self.ranges), ray.cluster_resources().get("GPU", 0)
        if need > have:  # refused now, not after the placement's timeout
            raise OscarError(f"{len(self.ranges)} stages x {self.cc.gpus_per_stage:g} GPU need {need:g} GPUs; the Ray "
                             f"cluster has {have:g}")
        place_groups(self.cc, len(self.ranges), "score", self.pgs)
        Actor = score_actor_class()
        for i, (a, b) in enumerate(self.ranges):
            args = ScoreArgs(self.model_dir, a, b, stage=i, dtype=self.cc.dtype, device=self.cc.device,
                             threads=self.cc.threads)
            self.actors.append(Actor.options(
                num_cpus=self.cc.cpus_per_stage, num_gpus=self.cc.gpus_per_stage, max_restarts=self.cc.max_restarts,
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
        self.exact = {m for m, a in arts.items() if a is None}  # what --engine cache scores as one process does
        self.arts = arts
        ref, codecs = ray.put(arts), ray.put(dict(CODECS))
        ray.get([a.load.remote(ref, codecs) for a in self.actors])

    def needle_batch(self, samples, names: list[list[str]], protocol: str, eos: set[int],
                     engine: str = "simulate") -> tuple[list[list[int]], dict]:
        """`needle_batch` (engine "simulate") or `cache_needle_batch` ("cache") on this scorer's stage actors."""
        run = cache_needle_batch if engine == "cache" or self.latent else needle_batch  # latent: one process's loop
        return run(self.actors, samples, names, protocol, eos)

    def score(self, jobs: list[tuple], engine: str = "simulate"):
        """For each (method, protocol, window ids (1, T), cuts), in order: what `window_nll` returns (engine
        "simulate"; bf16 under either engine, as in one process), or `engine.window_nll` (engine "cache": every stage
        its own layers' OscarCache, `cache_window`)."""
        # late: ray reads its cluster mode when imported; connect() sets LOOPBACK_ENV first (cluster/localray.py)
        import ray

        refs = []
        for m, p, win, cuts in jobs:
            if self.latent:  # as `scoring.latent.latent_window_nll`: the window in its chunks through the latent cache
                art = self.arts[m]
                chunks = latent_chunks(win.shape[1], art, PROTOCOLS[p] if art is not None else None)
                refs.append(cache_window(self.actors, m, p, win, cuts, chunks))
                continue
            if engine == "cache" and m not in self.exact:
                refs.append(cache_window(self.actors, m, p, win, cuts))
                continue
            x = win
            for a in self.actors:
                x = a.forward.remote(x, m, p, win, cuts)
            refs.append(x)
        for r in refs:  # in order: the caller records each as it arrives (resume loses at most what is in flight)
            yield ray.get(r)

    def copy_gradients(self, arts: list, options: tuple, cfg, windows: list[tuple]):
        """For each (index, window (1, T), scored positions) in order: (index, its (L, Hkv, O) sums), the forward
        and backward of `oscar.recipe.widths.layer_copy_gradients` run through the stages, each summing its own layers
        (arts[o]: the artifact with every layer at options[o]; cfg: its TuneConfig)."""
        # late: ray reads its cluster mode when imported; connect() sets LOOPBACK_ENV first (cluster/localray.py)
        import ray

        if not self.actors:
            self._start()
        ref, codecs = ray.put(arts), ray.put(dict(CODECS))
        ray.get([a.grad_setup.remote(ref, tuple(options), cfg.copy_protocol, cfg.widths_dtype, codecs)
                 for a in self.actors])
        try:
            refs = []
            for i, win, pos in windows:  # every chain at once: an actor runs its calls in order, a window at a time
                x = win
                for a in self.actors:
                    x = a.grad_forward.remote(x, win, pos)
                for a in self.actors[-2::-1]:
                    x = a.grad_backward.remote(x)
                refs.append((i, [a.grad_sums.remote() for a in self.actors]))
            for i, parts in refs:  # in order: the caller logs each as it arrives
                yield i, np.concatenate(ray.get(parts))  # (L, Hkv, O)
        finally:
            ray.get([a.grad_end.remote() for a in self.actors])
