"""`oscar run --out DIR`: the main job on the embedded defaults, resumable stage by stage.

    calibrate (local Ray cluster, or this process with --no-ray)  -> DIR/calib.zarr
    the recipe, as `oscar fit` makes it (oscar/recipe/driver.py):
      fit                                                          -> DIR/artifact.fit.safetensors
      tune key clip (strict NLL on calibration text; --no-tune)    -> DIR/artifact.tuned.safetensors, DIR/calibration/
      per-layer key widths (copy probe; --widths none)             -> DIR/artifact.safetensors
    validate niah (serving protocol; --niah-protocol)              -> DIR/results.parquet, niah_samples.jsonl
    validate ppl (strict + serving)                                -> DIR/ppl.parquet, goal.json
    validate attention (held-out captured q/k/v; not a model run)  -> DIR/attention.parquet, attention.json
    report                                                         -> DIR/report.md, DIR/report.html

Sizes the user does not give take the 15-minute defaults (`DEMO_SIZES`) or, with --full, the evidence
sizes (`FULL_SIZES`, both in oscar/defaults.py).

With --stages N (or a `run:` job's `cluster.stages`) the tune, widths, needles and perplexity run on N pipeline
stage actors holding the layer ranges calibration uses (cluster/scoring.py), the way a model larger than one
device is validated; run.json's `placement` and the report say where each step ran.

Each stage records DIR/stages/<stage>.json (its input fingerprint, outputs and
seconds). A re-run skips a stage whose marker matches and whose outputs exist;
calibrate, niah and ppl also resume *inside* the stage (blocks, samples,
windows), so an interrupted job loses at most one unit of work.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, fields, replace

import torch

from oscar.cluster.jobs import driver_config
from oscar.cluster.pipeline import ClusterConfig, calibrate_on_ray
from oscar.cluster.scoring import StagedScorer
from oscar.common import OscarError, file_fingerprint, fingerprint, parse_token_count
from oscar.defaults import DEMO_SIZES, EMBEDDED_MODEL, FULL_SIZES
from oscar.dirlock import DirLock
from oscar.host import compute_dtype, describe, info as host_info, process_seconds
from oscar import native_build
from oscar.kernels import cpu_attention
from oscar.pipeline import native
from oscar.pipeline.calibrate import CalibConfig, calibrate, check_calibration
from oscar.pipeline.corpus import first_chat_record
from oscar.pipeline.models import load_config
from oscar.reports.build import build_report
from oscar.recipe.driver import WIDTHS, RecipeConfig, RecipePaths, Stages, check_staged_widths, run_recipe
from oscar.reports.calibration import calibration_section, widths_section
from oscar.stats.fit import FitConfig
from oscar.validate.attention import AttnConfig, run_attention
from oscar.scoring.engine import check_engine, resolve_device
from oscar.validate.env import load_model
from oscar.scoring.protocols import PROTOCOL_VERSION
from oscar.recipe.tune import TuneConfig
from oscar.validate.methods import NEEDS_ARTIFACT, choose_methods
from oscar.validate.niah import NiahConfig, run_niah
from oscar.validate.ppl import PplConfig, run_ppl
from oscar.validate.ruler import load_qa, resolve_tasks, skipped_line


@dataclass
class RunConfig:
    out: str
    ray: bool = True
    model: str = EMBEDDED_MODEL
    corpus: str = "pydoc"
    # The sizes below left at None take the main job's defaults, sized to 15 minutes on a 2-core CPU, or with `full`
    # the evidence sizes (oscar/defaults.py DEMO_SIZES / FULL_SIZES; docs/decisions/0099-the-main-job-s-defaults-measure-at-4k-only.md).
    samples: int | None = None  # NIAH samples per cell
    full: bool = False  # the evidence sizes: what the committed example and the rendered cluster job run
    calib_tokens: int | None = None  # calibration tokens (of ~90k in the pydoc calibration split)
    # Calibration sequence length; None: the longest context the job validates (needles, perplexity). The fit
    # then sees queries and keys at every position it is judged on: past the calibration length RoPE's slow
    # pairs turn beyond any calibrated row and the INT2 key error grows (docs/decisions/0065-calibrate-at-the-serving-length-oscar-run.md, "Calibrate at
    # the serving length"; lab/key_error_by_position.py).
    seq_len: int | None = None
    # Absolute positions the calibration covers; None: the longest context validated (and at least seq_len). Windows
    # shorter than that are read at RoPE offsets (`oscar calibrate --positions`): the same statistics as sequences of
    # that length for a window's attention cost (docs/decisions/0066-calibrate-at-positions-not-lengths-oscar.md, "Calibrate at positions, not lengths").
    positions: int | None = None
    # RULER tasks of the needle stage; "all": every task the inputs allow (qa_1 / qa_2 need squad / hotpotqa)
    tasks: list[str] = field(default_factory=lambda: ["niah_single_1", "niah_single_2"])
    squad: str | None = None  # SQuAD v1.1 / v2.0 JSON for qa_1
    hotpotqa: str | None = None  # HotpotQA JSON for qa_2
    lengths: list[int] | None = None  # needle lengths
    # The long end: needle cells at these lengths too, for the first task only, bf16 and oscar-int2 of `methods`,
    # `long_samples` each (a long prefill is costly: fewer samples). The calibration's positions cover them, so one
    # artifact serves every cell; the calibration length (and the tune's, the widths') stays that of the rest.
    long_lengths: list[int] | None = None
    long_samples: int = 5
    methods: list[str] | None = None
    # Held-out tokens scored per perplexity context: the 4k interval rests on a window's 512-token segments; the
    # pydoc held-out split holds 12,427 tokens, so 3 windows of 4k at most (the evidence size).
    # docs/decisions/0046-intervals-on-every-model-level-figure-three.md, "Intervals on every model-level figure".
    ppl_tokens: int | None = None
    ppl_contexts: list[int] | None = None
    # Attention-level test: every key a distinct held-out row captured through the model, so the
    # capture costs a forward per key: 4k by default, 4k and 16k under `full`, 128k is
    # `oscar validate attention` (docs/decisions/0047-attention-level-test-held-out-text-whole.md, "Attention-level test: held-out text").
    attn_lengths: list[int] | None = None
    # The product recipe behind `oscar-int2`: the OSCAR rotation with the calibrated key mean
    # subtracted, keys scaled along the query eigenvectors (queries by the inverse) and searched
    # clips (docs/decisions/0032-main-job-recipe-oscar-int2-oscar-rotation-key.md, "Main job recipe" and "Scaled keys"), one per-token group, then per-layer key
    # widths (below); with --widths none the keys split into a 3-bit part (the D/4 directions C_Q weighs most)
    # and a 2-bit part at the same 2.5 bits per element (docs/decisions/README.md, split keys).
    # None: "scaled" (per-layer widths are chosen on a one-group fit), or "split" under --widths none
    variant: str | None = None
    # Per-layer key widths (docs/decisions/0072-per-layer-widths-by-the-copy-probe-to-first.md "Per-layer widths by the copy probe to first order"): after
    # the tune, each layer's keys at 2, 3 or 4 bits (values at 2) within the fit's bits per element, by the NLL change
    # of spans copied from the INT2 history of calibration text with that layer widened; oscar-int2 becomes the
    # per-layer artifact. "gradient" (the default): the change to first order, a forward + backward per window
    # (~2.5 min for SmolLM2 at 4 x 2048 on 2 CPUs); "copy": measured, 2L + 1 forwards (`oscar fit --widths copy`,
    # ~35 min; needles not distinguishable from the gradient's, docs/decisions/0072-per-layer-widths-by-the-copy-probe-to-first.md); "none": the tuned fit itself (split keys by default).
    widths: str = "gradient"
    widths_windows: int = 4
    widths_length: int | None = None  # None: min(2048, the longest context validated)
    # Scale the fit's key clips by the factor with the lowest strict NLL on calibration text
    # (oscar/recipe/tune.py; docs/decisions/0034-key-clip-tuned-end-to-end-oscar-validate-tune.md, "Key clip tuned end to end").
    tune: bool = True
    # What the tune minimises: nll (strict NLL), copy (a copied span read from the INT2 history) or guarded
    # (copy among the factors within 0.5 % of the best NLL); oscar/recipe/tune.py.
    tune_objective: str = "nll"
    # NIAH runs on the method's deployed cache (sink 64 + recent 256 in BF16, the rest INT2);
    # "strict" (recent 0: the tokens being generated leave the window with their page) is
    # available with --niah-protocol strict. Perplexity always reports both protocols.
    niah_protocol: str = "serving"
    # Model compute dtype for NIAH, perplexity and the attention capture: auto (bfloat16 on CUDA and on CPUs that
    # multiply it natively, AVX-512 BF16 or AMX; float32 on other CPUs, where torch's bfloat16 GEMMs run ~6x slower:
    # oscar/host.py), bfloat16 or float32. Calibration, the tune and the widths compute in float32 either way.
    dtype: str = "auto"
    # oscar/scoring/engine.py: simulate (the fake-quant simulator, the default: faster on CPU, docs/decisions/0057-engines-engine-simulate-stays-the-default-engine.md
    # "Engines") or cache (OscarCache + the kernel dispatcher) for tune, NIAH, perplexity, attention; device: cpu, cuda[:N]
    engine: str = "simulate"
    device: str = "cpu"
    # The calibration on Ray: ClusterConfig options (cluster/pipeline.py, e.g. {"stages": 2, "gpus_per_stage": 1};
    # default one stage with every CPU of this machine) and further CalibConfig options (device, dtype,
    # block_tokens, batch_size, ...; model, corpus, store, seq_len, positions and tokens are the run's own). Set by a
    # `run:` job of `oscar submit` (cluster/jobs.py); the stage actors calibrate the model this run validates.
    cluster: dict | None = None
    calibrate: dict | None = None
    # The model-driven steps (the recipe's tune and widths, needles, perplexity) on this many pipeline stage actors
    # on the run's Ray cluster, each holding a layer range as calibration's stages do (cluster/scoring.py): how a model
    # larger than one device is validated. None: the calibration's `cluster.stages` (1 by default); 1: the model in
    # this process. The stages compute on CPU with the simulator; the attention-level test, which captures q/k/v
    # through the whole model, is not run on them.
    stages: int | None = None
    progress: bool = True

    def _check_sizes(self) -> None:
        """Sizes and length lists checked before any stage runs (a `run:` job config reaches here unparsed by argparse):
        lengths may be written as tokens or k-units ("4k"); every size must be at least 1."""
        for name in ("lengths", "ppl_contexts", "attn_lengths", "long_lengths"):
            v = getattr(self, name)
            if v is None and name == "long_lengths":  # none asked for
                continue
            if isinstance(v, (str, int)):
                v = str(v).split(",")
            try:
                out = [x if isinstance(x, int) and not isinstance(x, bool) else parse_token_count(str(x)) for x in v]
            except (TypeError, ValueError):
                raise OscarError(f"oscar run: {name} must be a list of token lengths (e.g. [1024, 4k]), got {v!r}") from None
            if not out or min(out) < 1:
                raise OscarError(f"oscar run: {name} must be a non-empty list of lengths of at least 1 token, got {v!r}")
            setattr(self, name, out)
        for name in ("samples", "calib_tokens", "ppl_tokens", "widths_windows", "seq_len", "positions", "widths_length",
                     "long_samples"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise OscarError(f"oscar run: {name} must be a positive integer, got {v!r}")

    @property
    def calib_positions(self) -> int | None:
        """`positions` as the calibration takes it: None when the windows already span it (no offsets)."""
        return self.positions if self.positions > self.seq_len else None

    @property
    def long_methods(self) -> list[str]:
        """The methods the long-end cells score: bf16 (the paired reference) and oscar-int2, those of `methods`."""
        return [m for m in self.methods if m in ("bf16", "oscar-int2")]

    @property
    def compute_dtype(self) -> str:
        """`dtype` as this host runs it (oscar.host.compute_dtype)."""
        return compute_dtype(self.dtype, self.device)

    @property
    def longest_context(self) -> int:
        """The longest context the job validates (needles, perplexity): the default calibration length."""
        return max([*self.lengths, *self.ppl_contexts])

    def __post_init__(self):
        # no methods given: the sizes' default list, from which a method the model cannot serve is left out (said in
        # run.json and the report) instead of refused (validate/methods.py choose_methods); not a field
        self.default_methods = self.methods is None
        for name, v in (FULL_SIZES if self.full else DEMO_SIZES).items():
            if getattr(self, name) is None:
                setattr(self, name, list(v) if isinstance(v, list) else v)
        self._check_sizes()
        if self.seq_len is None:
            self.seq_len = self.longest_context
        if self.positions is None:
            self.positions = max(self.seq_len, self.longest_context, *(self.long_lengths or []))
        if self.positions < self.seq_len:
            raise OscarError(f"oscar run: calibration positions {self.positions} must be at least the calibration "
                             f"length {self.seq_len}")
        if self.seq_len > self.calib_tokens:
            raise OscarError(f"oscar run: {self.calib_tokens} calibration tokens do not fill one {self.seq_len}-token "
                             "sequence (the calibration length defaults to the longest context validated); raise "
                             "calib_tokens, or set a shorter seq_len: its windows are still read at positions up to "
                             f"{self.positions}")
        if self.widths not in WIDTHS:
            raise OscarError(f"oscar run: --widths must be one of {', '.join(WIDTHS)}, got {self.widths!r}")
        if self.variant is None:
            self.variant = "split" if self.widths == "none" else "scaled"
        if self.widths_length is None:
            self.widths_length = min(2048, self.longest_context)
        if self.widths != "none" and self.variant == "split":
            raise OscarError(f"oscar run: --widths {self.widths} chooses per-layer key widths on a one-group fit; --variant "
                             f"{self.variant} already splits the keys (use --variant scaled, the default with --widths)")

        if self.stages is None:
            self.stages = int((self.cluster or {}).get("stages", 1))
        if not isinstance(self.stages, int) or isinstance(self.stages, bool) or self.stages < 1:
            raise OscarError(f"oscar run: stages must be a positive integer, got {self.stages!r}")
        if self.stages > 1:  # refused now, not after calibrating
            if not self.ray:
                raise OscarError(f"oscar run: --stages {self.stages} runs stage actors on Ray; drop --no-ray")
            if self.engine != "simulate" or self.device != "cpu":
                raise OscarError(f"oscar run: the pipeline stages compute on CPU with the simulator; --stages "
                                 f"{self.stages} takes --engine simulate --device cpu (stages: 1 validates in one "
                                 "process on the device)")
            check_staged_widths(self.widths)

        TuneConfig(objective=self.tune_objective)  # an unknown objective fails before calibration, not after
        if self.long_lengths and not self.long_methods:
            raise OscarError(f"oscar run: the long-end needle cells ({', '.join(map(str, self.long_lengths))}) score bf16 "
                             f"and oscar-int2; --methods {','.join(self.methods)} has neither")
        if self.long_lengths and max(self.long_lengths) > self.positions:
            raise OscarError(f"oscar run: long-end needle cells of {max(self.long_lengths)} tokens reach past the "
                             f"calibration positions {self.positions}; raise --positions (one artifact serves every cell)")
        if isinstance(self.tasks, str):
            self.tasks = [t.strip() for t in self.tasks.split(",") if t.strip()]

        # unknown tasks, a QA task without its file and a malformed QA file fail here too, not after calibration
        self.skipped_tasks = resolve_tasks(self.tasks, load_qa(self.squad, self.hotpotqa))[1]  # not a field


def _say(msg: str) -> None:
    print(f"[oscar run {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _calib_config(cfg: RunConfig, store: str) -> CalibConfig:
    return CalibConfig(model=cfg.model, corpus=cfg.corpus, store=store, seq_len=cfg.seq_len, tokens=cfg.calib_tokens,
                       positions=cfg.calib_positions, **(cfg.calibrate or {}))


def _calibrate(cfg: RunConfig, store: str) -> dict:
    cc = _calib_config(cfg, store)
    cpu_attention.register()  # the capture's attention: the native CPU kernel (pipeline/capture.native_attention)
    if cfg.ray:
        _say("calibrating on a local Ray cluster (127.0.0.1; --no-ray for one process)")
        clu = {"stages": 1, "replicas": 1, "cpus_per_stage": float(os.cpu_count() or 1), **(cfg.cluster or {})}
        rep = calibrate_on_ray(cc, ClusterConfig(**clu), address="auto", progress=cfg.progress)
        return {"backend": "ray", "report": rep.to_dict() if hasattr(rep, "to_dict") else str(rep)}
    res = calibrate(cc, progress=cfg.progress)
    return {"backend": "process", "report": res.to_dict()}


@dataclass
class _Job:
    """One `oscar run` in progress: its directory, stage markers, and the model, loaded once by whichever
    stage needs it first."""

    cfg: RunConfig
    st: Stages
    loaded: list = field(default_factory=list)

    @property
    def dir(self) -> str:
        return self.cfg.out

    @property
    def store(self) -> str:
        return os.path.join(self.dir, "calib.zarr")

    @property
    def fit_path(self) -> str:
        return os.path.join(self.dir, "artifact.fit.safetensors")

    @property
    def art_path(self) -> str:
        """oscar-int2's artifact: the tuned fit, or (--widths copy / gradient) its per-layer widths."""
        return os.path.join(self.dir, "artifact.safetensors")

    @property
    def tuned_path(self) -> str:
        return os.path.join(self.dir, "artifact.tuned.safetensors") if self.cfg.widths != "none" else self.art_path

    def model(self):
        if not self.loaded:
            self.loaded.append(load_model(self.cfg.model))
        return self.loaded[0]

    def staged(self, dtype: str):
        """The model as `cfg.stages` stage actors computing in `dtype` (started at their first use), or None when
        the steps run in this process."""
        cfg = self.cfg
        if cfg.stages == 1:
            return nullcontext()
        base = {k: v for k, v in (cfg.cluster or {}).items() if k in ("layers", "memory_per_stage", "stage_resources",
                                                                       "startup_timeout", "placement_timeout")}
        cpus = float((cfg.cluster or {}).get("cpus_per_stage") or max(1, (os.cpu_count() or 1) // cfg.stages))
        cc = ClusterConfig(**base, stages=cfg.stages, cpus_per_stage=cpus, dtype=dtype)
        return StagedScorer(cfg.model, cc, address="auto")

    def placement(self) -> dict:
        """Where each step runs in this invocation: stages and device (run.json, the report)."""
        cfg = self.cfg
        clu = {"stages": 1, "replicas": 1, **(cfg.cluster or {})}
        cal = ({"stages": int(clu["stages"]), "replicas": int(clu["replicas"]),
                "device": "cuda" if float(clu.get("gpus_per_stage") or 0) > 0 or (cfg.calibrate or {}).get("device", "cpu")
                .startswith("cuda") else "cpu", "on": "Ray"} if cfg.ray else {"stages": 1, "device": "cpu", "on": "this process"})
        model = ({"stages": cfg.stages, "device": "cpu", "on": "Ray stage actors"} if cfg.stages > 1
                 else {"stages": 1, "device": cfg.device, "on": "this process"})
        out = {"calibrate": cal, "tune": model, "widths": model, "niah": model, "ppl": model}
        out["attention"] = ({"stages": 1, "device": cfg.device, "on": "this process"} if cfg.stages == 1
                            else {"on": "not run", "why": "it captures q/k/v through the whole model in one process"})
        return out


def _stage_calibrate(job: _Job) -> str:
    """1. calibrate -> DIR/calib.zarr; returns the stage's fingerprint (the fit's input)."""
    cfg = job.cfg
    fp_cal = fingerprint({"model": cfg.model, "corpus": cfg.corpus, "tokens": cfg.calib_tokens, "seq_len": cfg.seq_len,
                          **({"positions": cfg.calib_positions} if cfg.calib_positions else {}),
                          **({"calibrate": cfg.calibrate} if cfg.calibrate else {})})
    job.st.run("calibrate", "calibrate", fp_cal, [job.store], lambda: _calibrate(cfg, job.store))
    return fp_cal


def _stage_recipe(job: _Job, fp_cal: str) -> None:
    """2.-3. the recipe (oscar/recipe/driver.py): fit -> DIR/artifact.fit.safetensors, key clip tuned on calibration text ->
    DIR/artifact.tuned.safetensors (+ the report's calibration section in DIR/calibration/), per-layer key widths ->
    DIR/artifact.safetensors (its log beside it: an interrupted step resumes window by window)."""
    cfg, d = job.cfg, job.dir
    rcfg = RecipeConfig(tune=cfg.tune, objective=cfg.tune_objective, widths=cfg.widths, widths_windows=cfg.widths_windows,
                        widths_length=cfg.widths_length, corpus=cfg.corpus, engine=cfg.engine, device=cfg.device,
                        progress=cfg.progress)
    paths = RecipePaths(fit=job.fit_path, tuned=job.tuned_path, out=job.art_path, logs=d)
    calib = os.path.join(d, "calibration")
    with job.staged(TuneConfig().dtype) as sc:  # the tune's objective in float64 on the stages too
        run_recipe(job.store, paths, FitConfig(variant=cfg.variant, progress=cfg.progress), rcfg, job.st, fp_cal,
                   job.model, on_tuned=lambda p: calibration_section(p, job.store, calib),
                   on_widths=lambda p: widths_section(p, calib), scorer=sc)  # the report's plot of the probe


def _stage_validate(job: _Job) -> None:
    """4.-6. NIAH (resumable per sample), perplexity (resumable per window), attention-level retrieval on
    captured q/k/v; each keyed on the tuned artifact's bytes."""
    cfg, d, art_path = job.cfg, job.dir, job.art_path
    art_fp = file_fingerprint(art_path)

    def fp(c) -> str:  # the device is execution only; the default engine is left out (older markers stay valid)
        d = {k: v for k, v in asdict(c).items() if k not in ("device", "default_methods")
             and not (k == "engine" and v == "simulate")}
        for k in ("squad", "hotpotqa"):  # QA files by content; none given: left out (older markers stay valid)
            if d.get(k):
                d[k] = file_fingerprint(d[k])
            else:
                d.pop(k, None)
        return fingerprint({"art": art_fp, "cfg": d, "protocols": PROTOCOL_VERSION})

    ncfg = NiahConfig(out=d, model=cfg.model, artifact=art_path, methods=cfg.methods, tasks=cfg.tasks,
                      lengths=cfg.lengths, samples=cfg.samples, corpus=cfg.corpus,
                      protocol=cfg.niah_protocol, dtype=cfg.compute_dtype, engine=cfg.engine, device=cfg.device,
                      squad=cfg.squad, hotpotqa=cfg.hotpotqa, default_methods=cfg.default_methods)
    pcfg = PplConfig(out=d, model=cfg.model, artifact=art_path, methods=cfg.methods, contexts=cfg.ppl_contexts,
                     tokens=cfg.ppl_tokens, corpus=cfg.corpus, dtype=cfg.compute_dtype, engine=cfg.engine, device=cfg.device,
                     default_methods=cfg.default_methods)
    with job.staged(cfg.compute_dtype) as sc:  # one set of stage actors for both steps (the weights load once)
        if sc is None:
            niah, ppl = (lambda: run_niah(ncfg, loaded=job.model(), progress=cfg.progress),
                         lambda: run_ppl(pcfg, loaded=job.model(), progress=cfg.progress))
        else:
            niah, ppl = (lambda: run_niah(ncfg, progress=cfg.progress, stages=sc),
                         lambda: run_ppl(pcfg, progress=cfg.progress, scorer=sc))
        job.st.run("niah", "validate niah" + ("" if sc is None else f" ({cfg.stages} stages)"), fp(ncfg),
                   [os.path.join(d, "results.parquet")], niah)
        job.st.run("ppl", "validate ppl" + ("" if sc is None else f" ({cfg.stages} stages)"), fp(pcfg),
                   [os.path.join(d, "ppl.parquet")], ppl)
    if cfg.stages > 1:
        _say("validate attention: not run on the pipeline stages (it captures q/k/v through the whole model)")
    else:
        acfg = AttnConfig(out=d, store=job.store, artifact=art_path, lengths=cfg.attn_lengths, dtype=cfg.compute_dtype,
                          engine=cfg.engine, device=cfg.device)
        job.st.run("attention", "validate attention (held-out captured q/k/v; attention-level, not a model run)",
                   fp(acfg), [os.path.join(d, "attention.parquet")],
                   lambda: run_attention(acfg, progress=cfg.progress, loaded=job.model()))
    if cfg.long_lengths:  # the same samples file and artifact: results.parquet then holds every cell
        lcfg = long_niah_config(ncfg, cfg)
        with job.staged(cfg.compute_dtype) as sc:
            job.st.run("niah-long", "validate niah, the long end" + ("" if sc is None else f" ({cfg.stages} stages)"),
                       fp(lcfg), [os.path.join(d, "results.parquet")],
                       (lambda: run_niah(lcfg, loaded=job.model(), progress=cfg.progress)) if sc is None else
                       (lambda: run_niah(lcfg, progress=cfg.progress, stages=sc)))


def long_niah_config(ncfg: NiahConfig, cfg: RunConfig) -> NiahConfig:
    """The long-end needle cells: the first task, cfg.long_lengths, cfg.long_samples, bf16 and oscar-int2."""
    task = resolve_tasks(cfg.tasks, load_qa(cfg.squad, cfg.hotpotqa))[0][0]
    return replace(ncfg, tasks=[task], lengths=list(cfg.long_lengths), samples=cfg.long_samples,
                   methods=cfg.long_methods)


def native_paths() -> dict:
    """Each native CPU kernel's verdict on this host (pipeline/native.py, kernels/cpu_attention.py: built, measured
    against torch by oscar/native_build.py), for run.json."""
    out = {}
    for name, ok, why in (("moments", native.chosen, lambda: native.WHY_NOT),
                          ("flash_cpu", cpu_attention.chosen, lambda: cpu_attention.WHY_NOT),
                          ("flash_cpu_bf16", lambda: cpu_attention.chosen(torch.bfloat16),
                           lambda: cpu_attention.WHY_NOT)):
        ok()
        out[name] = native_build.CHOICES.get(name) or {"native": False, "why": why() or "not built"}
    return out


def _k(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _ks(v: list[int]) -> str:
    return ",".join(map(_k, v))


def run_command(cfg: RunConfig) -> str:
    """The `oscar run` command that makes this run: every option that differs from its default (run.json). What only a
    `run:` job config sets (corpus, widths windows and length, cluster) is in run.json's config."""
    sizes = FULL_SIZES if cfg.full else DEMO_SIZES
    c = [f"oscar run --out {cfg.out}"] + (["--no-ray"] if not cfg.ray else []) + (["--full"] if cfg.full else [])
    c += [] if cfg.model == EMBEDDED_MODEL else [f"--model {cfg.model}"]
    for opt, name in (("--samples", "samples"), ("--calib-tokens", "calib_tokens"), ("--ppl-tokens", "ppl_tokens")):
        c += [] if getattr(cfg, name) == sizes[name] else [f"{opt} {getattr(cfg, name)}"]
    for opt, name in (("--lengths", "lengths"), ("--ppl-contexts", "ppl_contexts"), ("--attn-lengths", "attn_lengths")):
        c += [] if getattr(cfg, name) == sizes[name] else [f"{opt} {_ks(getattr(cfg, name))}"]
    c += [] if cfg.methods == sizes["methods"] else [f"--methods {','.join(cfg.methods)}"]
    c += [] if cfg.tasks == ["niah_single_1", "niah_single_2"] else [f"--tasks {','.join(cfg.tasks)}"]
    if cfg.long_lengths:
        c += [f"--long-lengths {_ks(cfg.long_lengths)}", f"--long-samples {cfg.long_samples}"]
    c += [] if cfg.seq_len == cfg.longest_context else [f"--seq-len {cfg.seq_len}"]
    c += [] if cfg.positions == max(cfg.seq_len, cfg.longest_context, *(cfg.long_lengths or [])) else \
        [f"--positions {cfg.positions}"]
    c += [] if cfg.variant == ("split" if cfg.widths == "none" else "scaled") else [f"--variant {cfg.variant}"]
    c += [] if cfg.tune else ["--no-tune"]
    c += [] if cfg.tune_objective == "nll" else [f"--tune-objective {cfg.tune_objective}"]
    c += [] if cfg.widths == "gradient" else [f"--widths {cfg.widths}"]
    c += [] if cfg.niah_protocol == "serving" else [f"--niah-protocol {cfg.niah_protocol}"]
    c += [] if cfg.dtype == "auto" else [f"--dtype {cfg.dtype}"]
    c += [] if cfg.engine == "simulate" else [f"--engine {cfg.engine}"]
    c += [] if cfg.device == "cpu" else [f"--device {cfg.device}"]
    c += [] if cfg.stages == 1 or cfg.cluster else [f"--stages {cfg.stages}"]
    c += ([f"--squad {cfg.squad}"] if cfg.squad else []) + ([f"--hotpotqa {cfg.hotpotqa}"] if cfg.hotpotqa else [])
    return " ".join(c)


def step_commands(job: _Job) -> list[dict]:
    """Each step this run holds as the product command that computes it on its own, with the wall and CPU seconds
    it took here (summed over the invocations an interrupted step took; run.json's "steps", the report's Commands)."""
    cfg, d, st = job.cfg, job.dir, job.st
    art, dt = job.art_path, cfg.compute_dtype
    common = f"--model {cfg.model} --artifact {art}" + ("" if cfg.corpus == "pydoc" else f" --corpus {cfg.corpus}")
    recipe = (f"oscar fit {job.store} --variant {cfg.variant}" + ("" if cfg.tune else " --no-tune")
              + ("" if cfg.tune_objective == "nll" else f" --tune-objective {cfg.tune_objective}")
              + f" --widths {cfg.widths} --model {cfg.model} --out {art}")
    niah = (f"oscar validate niah {common} --protocol {cfg.niah_protocol} --dtype {dt} --out {d}"
            + (f" --squad {cfg.squad}" if cfg.squad else "") + (f" --hotpotqa {cfg.hotpotqa}" if cfg.hotpotqa else ""))
    cmds = {
        "calibrate": (f"oscar calibrate --model {cfg.model} --corpus {cfg.corpus} --store {job.store} --seq-len "
                      f"{cfg.seq_len} --positions {cfg.positions} --tokens {cfg.calib_tokens}"),
        "fit": recipe, "tune": recipe, "widths": recipe,
        "niah": (f"{niah} --methods {','.join(cfg.methods)} --tasks {','.join(cfg.tasks)} --lengths {_ks(cfg.lengths)} "
                 f"--samples {cfg.samples}"),
        "ppl": (f"oscar validate ppl {common} --methods {','.join(cfg.methods)} --lengths {_ks(cfg.ppl_contexts)} "
                f"--tokens {cfg.ppl_tokens} --dtype {dt} --out {d}"),
        "attention": (f"oscar validate attention --store {job.store} --artifact {art} --lengths {_ks(cfg.attn_lengths)} "
                      f"--dtype {dt} --out {d}"),
    }
    if cfg.long_lengths:
        lc = long_niah_config(NiahConfig(out=d), cfg)
        cmds["niah-long"] = (f"{niah} --methods {','.join(lc.methods)} --tasks {lc.tasks[0]} --lengths "
                             f"{_ks(lc.lengths)} --samples {lc.samples}")
    notes = {"tune": "a step of the oscar fit above", "widths": "a step of the oscar fit above"}
    return [{"stage": k, "command": cmds.get(k, "oscar run"), "wall_s": v, "cpu_s": st.cpu_seconds.get(k),
             **({"note": notes[k]} if k in notes else {})} for k, v in st.seconds.items()]


def _stage_report(job: _Job, elapsed: Callable[[], float]) -> dict:
    """7. DIR/run.json, then the report (always rebuilt: cheap, reads files only); returns run.json's content.
    `elapsed()`: the command's wall time so far; the report states it as of its own writing, and run.json keeps
    the same figure (`wall_seconds`) beside the per-stage times."""
    cfg, d, st = job.cfg, job.dir, job.st
    hinfo = host_info()
    info = {"command": run_command(cfg), "steps": step_commands(job),
            "model": cfg.model, "host": describe(hinfo), "host_info": hinfo, "compute_dtype": cfg.compute_dtype,
            "native_paths": native_paths(), "placement": job.placement(), "config": asdict(cfg),
            "stage_seconds": st.seconds, "stage_cpu_seconds": st.cpu_seconds,
            "total_seconds": sum(st.seconds.values()), "total_cpu_seconds": sum(st.cpu_seconds.values()),
            "wall_seconds": elapsed()}
    skipped = os.path.join(d, "skipped_methods.json")
    if os.path.exists(skipped):  # methods of the default list this model cannot serve (the report's header too)
        info["skipped_methods"] = json.load(open(skipped))
    _write_json(os.path.join(d, "run.json"), info)  # a record even if the report fails
    r = build_report(d, wall_clock=elapsed)
    info["wall_seconds"] = r.wall_seconds  # the figure the report states: the command's start to the report
    _write_json(os.path.join(d, "run.json"), info)
    _say(f"report: {r.md_path}, {r.html_path}  ({r.wall_seconds / 60:.1f} min wall; stages: "
         + ", ".join(f"{k} {v:.0f}s" for k, v in st.seconds.items()) + ")")
    return info


def _write_json(path: str, obj: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def run_main(cfg: RunConfig, elapsed: Callable[[], float] | None = None) -> dict:
    """Run (or resume) the main job in cfg.out; returns what DIR/run.json records. `elapsed()`: the command's wall
    time so far (`oscar run` and the Ray job pass oscar.host.process_seconds: from the process's start, imports,
    kernel builds and Ray's start-up included); default: from this call."""
    t_call = time.monotonic()
    elapsed = elapsed or (lambda: time.monotonic() - t_call)
    check_engine(cfg.engine)
    resolve_device(cfg.device)  # --device cuda without CUDA: refused before any stage runs
    chat = first_chat_record(cfg.corpus)
    if chat:  # validation reads the held-out text without a tokenizer: refused now, not after calibrating
        raise OscarError(f"oscar run: {chat} is a chat ('messages') record; the run also validates on the corpus's "
                         "held-out text, read without a chat template: give a 'text' corpus, or calibrate chats "
                         "with `oscar calibrate --corpus`")
    lock = DirLock(cfg.out, what="run directory")
    lock.check_free()  # a second `oscar run` on DIR: refused in one line before any work
    store = os.path.join(cfg.out, "calib.zarr")
    if not os.path.exists(store):  # what calibration would refuse (a budget the corpus cannot supply, ...): before DIR
        check_calibration(_calib_config(cfg, store), latent=False)  # the run's recipe and validation are per-head
    if not cfg.default_methods:  # a named method the model's head_dim cannot serve: refused now, not after the fit
        data_free = [m for m in cfg.methods if m not in NEEDS_ARTIFACT]
        choose_methods(data_free, load_config(cfg.model), None, default=False, model=cfg.model)
    with lock:  # DIR has one writer for the whole job (its stages take the same lock, shared)
        job = _Job(cfg, Stages(cfg.out))
        _say(f"output in {cfg.out}; samples/cell {cfg.samples}, lengths {cfg.lengths}, methods {','.join(cfg.methods)}")
        if getattr(cfg, "skipped_tasks", None):
            print(skipped_line(cfg.skipped_tasks), file=sys.stderr, flush=True)
        fp_cal = _stage_calibrate(job)
        _stage_recipe(job, fp_cal)
        _stage_validate(job)
        return _stage_report(job, elapsed)


# --------------------------------------------------------------------------- as a Ray job (`oscar submit`)

# CalibConfig options a run sets itself: one model, one corpus, its own store.
RUN_OWNS_CALIBRATE = ("model", "corpus", "store", "seq_len", "positions", "tokens")


def check_run_section(run: dict, where: str = "job config", cluster: dict | None = None) -> RunConfig:
    """The `run:` section of a job config (cluster/jobs.py shapes it) as a RunConfig on the job's `cluster:`
    section, or a clear error."""
    names = {f.name for f in fields(RunConfig) if f.init} - {"ray", "progress", "cluster"}
    bad = set(run) - names
    if bad:
        raise OscarError(f"{where}: unknown run options {sorted(bad)}; known: {sorted(names)}")
    cal = run.get("calibrate") or {}
    owned = set(cal) & set(RUN_OWNS_CALIBRATE)
    unknown = set(cal) - {f.name for f in fields(CalibConfig) if f.init}
    if owned or unknown:
        raise OscarError(f"{where}: run.calibrate holds further options of oscar calibrate (device, dtype, block_tokens, "
                         f"...); {sorted(owned)} are the run's own (model, corpus, store, seq_len, positions, tokens are "
                         f"set by the run: calib_tokens, seq_len, positions)" if owned else
                         f"{where}: unknown run.calibrate options {sorted(unknown)}")
    return RunConfig(**run, cluster=cluster)


def job_main(argv: list[str] | None = None) -> int:
    """Ray job entrypoint of a `run:` config: `python -m oscar.run [CONFIG]` (config from $OSCAR_JOB_CONFIG, set
    by `oscar submit`, or a file). The whole run of one model in this driver (on the GPU the submission asked
    for): calibration on the job's Ray cluster with its `cluster:` section, then fit, tune, validation and report
    into run.out. Re-running skips finished stages and scores only the samples and windows `out` lacks."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = driver_config(argv)
        if "run" not in cfg:
            raise OscarError("not a run config (no `run:` section); a calibration runs python -m oscar.cluster.entrypoint")
        rc = check_run_section(cfg["run"], cluster=cfg["cluster"])  # Ray: RunConfig's default
        info = run_main(rc, elapsed=process_seconds)
    except OscarError as e:
        print(f"oscar job: error: {e}", file=sys.stderr)
        return 2
    print("OSCAR_RUN " + json.dumps({k: info[k] for k in ("stage_seconds", "total_seconds", "wall_seconds")}))
    return 0


if __name__ == "__main__":
    sys.exit(job_main())
