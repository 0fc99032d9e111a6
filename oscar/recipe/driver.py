"""The shipped recipe, the steps of `oscar fit` after the rotations: the key-clip tune, then per-layer key widths.

    fit (stats/fit.py: rotations, clips)            -> the fitted artifact
    tune key clip (oscar/recipe/tune.py)            -> the tuned artifact
    per-layer key widths (oscar/recipe/widths.py)   -> oscar-int2's artifact (the cache's per-layer format)

Each step is resumable (`Stages`: a marker of its input fingerprint beside its output; the widths also log each
window), and `--no-tune --widths none` leaves the plain fit. The tune and the widths read the model through the
INT2 cache (the simulator of kernels/, the engines and NLLs of oscar/scoring/); nothing here imports validate/.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from dataclasses import asdict, dataclass, fields
from typing import Callable

import numpy as np

from oscar.cli_options import WIDTHS  # per-layer key widths: none, measured (copy probe) or to first order
from oscar.common import OscarError, file_fingerprint, fingerprint
from oscar.kernels.memory import artifact_bits_per_element
from oscar.pipeline.store import CalibStore, store_fingerprint
from oscar.stats.artifact import load_artifact, save_artifact
from oscar.stats.fit import FitConfig, fit
from oscar.recipe.tune import TuneConfig, tune_key_clip
from oscar.scoring.protocols import PROTOCOL_VERSION
from oscar.recipe.widths import STAGED_PROBE, StaleLog, copy_widths_artifact

# ----------------------------------------------------------------- the recipe, step by step



def say(msg: str) -> None:
    print(f"[oscar {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and of the children it has waited for (worker processes)."""
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


class Stages:
    """Step markers under DIR/stages/: skip a step whose inputs and outputs match. Each marker records the step's
    wall and CPU seconds, summed over the invocations an interrupted step took (DIR/stages/<step>.spent.json holds
    what the interrupted ones spent; a kill -9 loses its invocation's share)."""

    def __init__(self, out: str):
        self.dir = os.path.join(out, "stages")
        os.makedirs(self.dir, exist_ok=True)
        self.seconds: dict[str, float] = {}
        self.cpu_seconds: dict[str, float] = {}

    def done(self, name: str, fp: str, outputs: list[str]) -> bool:
        p = os.path.join(self.dir, f"{name}.json")
        if not os.path.exists(p):
            return False
        m = json.load(open(p))
        ok = m.get("fingerprint") == fp and all(os.path.exists(o) for o in outputs)
        if ok:
            self.seconds[name] = m.get("seconds", 0.0)
            if "cpu_seconds" in m:  # markers written before CPU time was recorded have none
                self.cpu_seconds[name] = m["cpu_seconds"]
        return ok

    def mark(self, name: str, fp: str, outputs: list[str], seconds: float, extra: dict | None = None,
             cpu: float | None = None) -> None:
        self.seconds[name] = seconds
        rec = {"fingerprint": fp, "outputs": outputs, "seconds": seconds}
        if cpu is not None:
            self.cpu_seconds[name] = rec["cpu_seconds"] = cpu
        with open(os.path.join(self.dir, f"{name}.json"), "w") as f:
            json.dump({**rec, **(extra or {})}, f, indent=1)

    def run(self, name: str, label: str, fp: str, outputs: list[str], work) -> bool:
        """Skip step `name` if done with fingerprint `fp` and its outputs exist; else run `work()` and mark it done
        (a dict it returns is kept in the marker). True if it ran."""
        if self.done(name, fp, outputs):
            say(f"{label}: done (skipped)")
            return False
        say(f"{label} ...")
        spent_path = os.path.join(self.dir, f"{name}.spent.json")
        spent = json.load(open(spent_path)) if os.path.exists(spent_path) else {}
        if spent.get("fingerprint") != fp:  # what an interrupted run of other inputs spent is not this step's
            spent = {"fingerprint": fp, "seconds": 0.0, "cpu_seconds": 0.0}
        t, c = time.time(), cpu_seconds()
        try:
            extra = work()
        except BaseException:  # interrupted (Ctrl-C, SIGTERM as SystemExit) or failed: keep what it spent
            with open(spent_path, "w") as f:
                json.dump({**spent, "seconds": spent["seconds"] + time.time() - t,
                           "cpu_seconds": spent["cpu_seconds"] + cpu_seconds() - c}, f)
            raise
        self.mark(name, fp, outputs, spent["seconds"] + time.time() - t, extra if isinstance(extra, dict) else None,
                  cpu=spent["cpu_seconds"] + cpu_seconds() - c)
        if os.path.exists(spent_path):
            os.remove(spent_path)
        return True


def save_whole(art, path: str) -> None:
    """The artifact written whole or not at all (a re-run never reads a half-written one)."""
    tmp = path + ".tmp"
    save_artifact(art, tmp)
    os.replace(tmp, path)


@dataclass
class RecipeConfig:
    """What turns a fit into oscar-int2's artifact; `tune=False, widths="none"` is the plain fit."""
    tune: bool = True  # scale the fit's key clips by the factor with the lowest strict NLL on calibration text
    objective: str = "nll"  # what the tune minimises (TuneConfig.objective)
    widths: str = "gradient"  # per-layer key widths: none | copy (measured) | gradient (to first order)
    widths_windows: int = 4  # copy windows the widths are chosen on
    widths_length: int = 2048  # tokens per copy window
    corpus: str = "pydoc"  # calibration text of the tune and the widths (the store's)
    engine: str = "simulate"  # the tune's engine (oscar/scoring/engine.py)
    device: str = "cpu"
    progress: bool = True

    def __post_init__(self):
        if self.widths not in WIDTHS:
            raise OscarError(f"--widths must be one of {', '.join(WIDTHS)}, got {self.widths!r}")
        TuneConfig(objective=self.objective)  # an unknown objective fails before any step runs

    @property
    def needs_model(self) -> bool:
        return self.tune or self.widths != "none"


@dataclass
class RecipePaths:
    """Where each step writes: the fitted and the tuned artifacts, oscar-int2's, and the widths' log directory."""
    fit: str
    tuned: str  # = out when there are no widths
    out: str
    logs: str


STAGED_WIDTHS = ("none", "gradient")  # the widths estimates the pipeline stages run (not the probe: 2L + 1 forwards)


def check_staged_widths(widths: str) -> None:
    """Refuse, before any work, widths the pipeline stages do not compute."""
    if widths not in STAGED_WIDTHS:
        raise OscarError(STAGED_PROBE)


def _fit_fingerprint(fp_cal: str, fcfg: FitConfig) -> str:
    """The fit step's inputs; settings left at their defaults are left out (markers of the main job stay valid)."""
    base = FitConfig(variant=fcfg.variant)
    extra = {f.name: getattr(fcfg, f.name) for f in fields(FitConfig)
             if f.name not in ("variant", "progress", "threads") and getattr(fcfg, f.name) != getattr(base, f.name)}
    return fingerprint({"cal": fp_cal, "fit": fcfg.variant, **({"fit_config": str(extra)} if extra else {})})


def run_recipe(store: str, paths: RecipePaths, fcfg: FitConfig, rcfg: RecipeConfig, st: Stages, fp_cal: str,
               model: Callable[[], tuple], on_tuned: Callable[[str], None] | None = None,
               on_widths: Callable[[str], None] | None = None, scorer=None) -> dict:
    """fit -> tune -> widths, each skipped when its marker matches; `model()` loads the model (once) for the steps
    that read it, or `scorer` (the pipeline stages, cluster/scoring.py) scores the tune's windows and runs the
    widths' gradient. Returns what the steps record (the tune's NLLs, the widths chosen)."""
    if scorer is not None:
        check_staged_widths(rcfg.widths)
    rec: dict = {}

    def do_fit() -> None:
        save_whole(fit(store, fcfg), paths.fit)

    st.run("fit", "fit", _fit_fingerprint(fp_cal, fcfg), [paths.fit], do_fit)

    tcfg = TuneConfig(corpus=rcfg.corpus, objective=rcfg.objective)
    fp_t = fingerprint({"fit": file_fingerprint(paths.fit), "tune": asdict(tcfg) if rcfg.tune else None,
                        "protocols": PROTOCOL_VERSION, **({"engine": rcfg.engine} if rcfg.engine != "simulate" else {})})

    def do_tune() -> dict | None:
        art, r = load_artifact(paths.fit), None
        if rcfg.tune:
            m, tok, _ = model() if scorer is None else (None, None, None)
            art, r = tune_key_clip(m, tok, art, tcfg, progress=rcfg.progress, engine=rcfg.engine, device=rcfg.device,
                                   scorer=scorer)
            say(f"tune: key clips x{r['chosen_factor']} (mean {r['mean_clip_k_before']:.3f} -> "
                f"{r['mean_clip_k_after']:.3f}; strict NLL/token on calibration text " +
                ", ".join(f"x{f} {v:.4f}" for f, v in r["nll_per_token"].items()) + ")" +
                ("" if rcfg.objective == "nll" else f"; objective {rcfg.objective}, copy NLL/token " +
                 ", ".join(f"x{f} {v:.4f}" for f, v in r["copy_nll_per_token"].items())))
            rec["clip_tuning"] = r
        save_whole(art, paths.tuned)
        if on_tuned:
            on_tuned(paths.tuned)
        return {"clip_tuning": r} if r else None

    st.run("tune", "tune key clip" if rcfg.tune else "tune (skipped: --no-tune)", fp_t, [paths.tuned], do_tune)
    if rcfg.widths == "none":
        return rec

    fp_w = fingerprint({"tuned": file_fingerprint(paths.tuned), "widths": rcfg.widths, "windows": rcfg.widths_windows,
                        "length": rcfg.widths_length, "corpus": rcfg.corpus, "protocols": PROTOCOL_VERSION})
    estimate = "probe" if rcfg.widths == "copy" else "gradient"

    def do_widths() -> dict:
        m, tok, _ = model() if scorer is None else (None, None, None)
        tcfg = TuneConfig(corpus=rcfg.corpus, copy_windows=rcfg.widths_windows, copy_length=rcfg.widths_length)
        log = os.path.join(paths.logs, f"widths.{'probes' if rcfg.widths == 'copy' else 'gradients'}.jsonl")
        try:
            out, _ = copy_widths_artifact(m, tok, load_artifact(paths.tuned), tcfg, log=log, progress=rcfg.progress,
                                          estimate=estimate, scorer=scorer)
        except StaleLog:  # the step's inputs changed since the log was written (its fingerprint did): start afresh
            os.replace(log, log + ".old")
            say(f"widths: {log} was written for other inputs; kept as {log}.old, starting afresh")
            out, _ = copy_widths_artifact(m, tok, load_artifact(paths.tuned), tcfg, log=log, progress=rcfg.progress,
                                          estimate=estimate, scorer=scorer)
        save_whole(out, paths.out)
        if on_widths:
            on_widths(paths.out)
        wide = {l: out.quant_for(l).bits + out.quant_for(l).key_top for l in range(out.num_layers)
                if out.quant_for(l).key_split}
        bits = artifact_bits_per_element(out)
        say(f"widths: keys wider in layers {wide} (key bits), {bits:.3f} bits per element")
        rec["widths"] = {"wide_key_layers": wide, "bits_per_element": bits}
        return {"widths": rec["widths"]}

    how = "copy probe" if rcfg.widths == "copy" else "copy probe to first order"
    st.run("widths", f"per-layer key widths ({how})", fp_w, [paths.out], do_widths)
    return rec


def store_inputs(store: str) -> tuple[str, str, str]:
    """(model, corpus, fingerprint) a store was calibrated with, read without verifying its blocks (the fit does)."""
    if not os.path.exists(store):
        raise OscarError(f"calibration store {store} does not exist")
    st = CalibStore(store)
    attrs = dict(st.group.attrs)
    c = attrs.get("corpus") or {}
    corpus = "pydoc" if c.get("source") == "pydoc_data.topics" else c.get("source") or "pydoc"
    done = [int(b) for b in np.flatnonzero(st.done().all(1))]  # (B, L) markers read once
    return attrs["model"]["name"], corpus, fingerprint({"store": os.path.abspath(store),
                                                        "contents": store_fingerprint(attrs, done)})
