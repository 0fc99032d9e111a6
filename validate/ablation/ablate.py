"""`oscar ablate`: the controlled ablation of seed 004 (regimes x schemes x budgets x seeds x paths).

Work unit = (regime, seed): one parquet part under DIR/parts/, written atomically,
so an interrupted run re-run with the same config skips finished units.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing as mp
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field

import pandas as pd
import torch
from tqdm import tqdm

from oscar.common import OscarError, fingerprint
from oscar.validate.ablation import stattests
from oscar.validate.ablation.metrics import compute_metrics
from oscar.validate.ablation.regimes import REGIMES, RegimeConfig, make_regime
from oscar.validate.ablation.schemes import SCHEMES, Ctx, UniformCodec, make_scheme, paged_roundtrip

SYNTHETIC = [r for r in REGIMES if r != "real"]
KS_METRICS = ["relmse_k", "relmse_v", "relmse_o", "d2", "logit_var", "topk"]
# seed 004's comparisons: rotation vs none, K-path QJL, V-path QJL, water-filling vs uniform, families.
SCHEME_PAIRS = [("tq_kv", "plain"), ("tq_qkv", "tq_kv"), ("tq_vqjl", "tq_kv"), ("sq_kv", "squ_kv"),
                ("sq", "squ"), ("squ_kv", "tq_kv"), ("oscar", "tq_kv"), ("oscar", "plain"), ("kivi", "plain"),
                ("oscar", "oscar_nc"), ("oscar", "oscar_kcov"), ("oscar", "oscar_nobr"), ("oscar", "oscar-ref"),
                ("oscar_scaled", "oscar"), ("oscar_mix", "oscar_scaled")]


@dataclass
class AblationConfig:
    out: str
    regimes: list[str] = field(default_factory=lambda: list(SYNTHETIC))
    schemes: list[str] | None = None  # None: every registered scheme
    bits: list[int] = field(default_factory=lambda: [2, 3, 4])
    seeds: int = 30
    paths: list[str] = field(default_factory=lambda: ["oracle", "production"])
    data: RegimeConfig = field(default_factory=RegimeConfig)
    alpha: float = 0.05
    correction: str = "holm"
    deff_regimes: list[str] = field(default_factory=lambda: ["lowrank", "powerlaw"])
    deff_budgets: list[int] = field(default_factory=lambda: [32, 64, 128, 256, 512, 1024, 2048, 4096])
    deff_seeds: int = 5
    # the serving-cache (Triton) path: slow under the CPU interpreter, so opt-in and small
    triton_seeds: int = 0  # seeds run on path "triton" (0: off)
    triton_schemes: list[str] = field(default_factory=lambda: ["plain", "oscar"])
    triton_regimes: list[str] = field(default_factory=lambda: ["isotropic", "heavy"])
    progress: bool = True
    workers: int = 0  # processes for the (regime, seed) units; 0: min(2, cores)

    def __post_init__(self):
        if self.data.store and "real" not in self.regimes:
            self.regimes = [*self.regimes, "real"]
        self.schemes = list(self.schemes or SCHEMES)
        bad = [r for r in self.regimes if r not in REGIMES]
        if bad:
            raise OscarError(f"unknown regime(s) {bad}; known: {', '.join(REGIMES)}")
        bad = [s for s in self.schemes if s not in SCHEMES]
        if bad:
            raise OscarError(f"unknown scheme(s) {bad}; known: {', '.join(SCHEMES)}")
        if "real" in self.regimes and not self.data.store:
            raise OscarError("the real regime needs a calibration store (--store PATH)")
        if not set(self.bits) <= {2, 3, 4}:
            raise OscarError(f"bits must be among 2, 3, 4, got {self.bits}")
        if self.seeds < 2:
            raise OscarError(f"need at least 2 seeds for the KS tests, got {self.seeds}")

    @classmethod
    def preset(cls, name: str, out: str, **kw) -> "AblationConfig":
        """full: everything, 30 seeds. quick: CI-sized (< 3 min on 2 cores). smoke: tests."""
        if name == "full":
            return cls(out=out, **kw)
        if name == "quick":
            data = dataclasses.replace(kw.pop("data", RegimeConfig()), n_calib=1024, n_test=256, n_query=32)
            d = dict(schemes=["plain", "plain_lm", "hadamard", "kivi", "tq_kv", "tq_qkv", "tq_vqjl", "sq", "squ", "squ_kv", "sq_kv",
                              "oscar", "oscar-ref"], seeds=30, deff_budgets=[32, 64, 256, 1024, 2048], deff_seeds=2)
            return cls(out=out, data=data, **{**d, **kw})
        if name == "smoke":
            data = dataclasses.replace(kw.pop("data", RegimeConfig()), D=32, n_calib=256, n_test=64, n_query=16)
            d = dict(regimes=["isotropic", "heavy"], schemes=["plain", "tq_kv", "tq_qkv"], bits=[2, 4], seeds=6,
                     deff_regimes=["lowrank"], deff_budgets=[32, 256], deff_seeds=2, workers=1)
            return cls(out=out, data=data, **{**d, **kw})
        raise OscarError(f"unknown preset {name!r} (full, quick, smoke)")

    def identity(self) -> dict:
        d = dataclasses.asdict(self)
        for k in ("out", "progress", "workers"):
            d.pop(k)
        return d


def run_unit(regime: str, seed: int, cfg: AblationConfig) -> list[dict]:
    """All schemes x bits x paths on one regime draw."""
    reg = make_regime(regime, cfg.data, seed)
    rows = []
    paths = list(cfg.paths)
    if cfg.triton_seeds and seed < cfg.triton_seeds and regime in cfg.triton_regimes:
        paths.append("triton")
    for path in paths:
        ctx0 = Ctx(path, seed)
        cal = {n: torch.from_numpy(reg.calib[n]).to(ctx0.dtype) for n in "qkv"}
        te = {n: torch.from_numpy(reg.test[n]).to(ctx0.dtype) for n in "qkv"}
        for name in cfg.schemes:
            for b in cfg.bits:
                if path == "triton" and (name not in cfg.triton_schemes or b not in (1, 2, 4, 8)):
                    continue
                sch = make_scheme(name, b).fit(cal, Ctx(path, seed))
                if path == "triton":
                    if not (type(sch.k) is UniformCodec and type(sch.v) is UniformCodec):  # (codebook codecs: no paged form)
                        raise OscarError(f"scheme {name} has no serving-cache (Triton) form; drop it from triton_schemes")
                    with _triton_env():
                        kh, bk = paged_roundtrip(sch.k, te["k"], "k")
                        vh, bv = paged_roundtrip(sch.v, te["v"], "v")
                else:
                    kh, bk = sch.k.roundtrip(te["k"])
                    vh, bv = sch.v.roundtrip(te["v"])
                if kh.shape != te["k"].shape or kh.dtype != ctx0.dtype or vh.dtype != ctx0.dtype:
                    raise RuntimeError(f"{name}@{b}: decoded {tuple(kh.shape)} {kh.dtype}, expected {tuple(te['k'].shape)} {ctx0.dtype}")
                m = compute_metrics(te["q"], te["k"], te["v"], kh, vh)
                base = dict(regime=regime, scheme=name, family=sch.family, bits=b, bits_per_element=(bk + bv) / 2,
                            bpe_k=bk, bpe_v=bv, seed=seed, path=path)
                rows += [dict(base, metric=k, value=float(v)) for k, v in m.items()]
    return rows


@contextlib.contextmanager
def _triton_env():
    """Route the paged cache's page quantizer to Triton (the interpreter when there is no GPU),
    restoring the environment after. TRITON_INTERPRET must be set before
    oscar.kernels.triton_quant is first imported (triton.jit reads it then)."""
    want = {"OSCAR_KERNELS": "triton"}
    if not torch.cuda.is_available():
        want["TRITON_INTERPRET"] = "1"
    old = {k: os.environ.get(k) for k in want}
    os.environ.update(want)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _do_unit(regime: str, seed: int, cfg: AblationConfig, path: str) -> None:
    torch.set_num_threads(1)  # many tiny ops: threads only add overhead
    _write(pd.DataFrame(run_unit(regime, seed, cfg)), path)


def _write(df, path: str) -> None:
    tmp = path + ".tmp"
    df.to_parquet(tmp, index=False)
    os.replace(tmp, path)


def run_ablation(cfg: AblationConfig) -> dict[str, str]:
    """Run (or resume) the ablation; returns the paths of the tables written. The report on them
    (report.md, plots) is `oscar.reports.ablation.build_report(cfg.out)`, which `oscar ablate` calls."""
    torch.set_num_threads(1)
    os.makedirs(os.path.join(cfg.out, "parts"), exist_ok=True)
    cpath = os.path.join(cfg.out, "config.json")
    ident = cfg.identity()
    fp = fingerprint(ident)
    if os.path.exists(cpath):
        old = json.load(open(cpath))
        if old.get("fingerprint") != fp:
            raise OscarError(f"{cfg.out} holds an ablation with a different config (fingerprint {old.get('fingerprint')} vs {fp}); "
                             "use another --out or delete it")
    else:
        with open(cpath, "w") as f:
            json.dump({"fingerprint": fp, "config": ident}, f, indent=1, default=str)

    t0 = time.time()
    units = [(r, s) for r in cfg.regimes for s in range(cfg.seeds)]
    part = lambda r, s: os.path.join(cfg.out, "parts", f"{r}__{s:04d}.parquet")  # noqa: E731
    todo = [u for u in units if not os.path.exists(part(*u))]
    bar = tqdm(desc="ablate", unit="draw", disable=not cfg.progress, initial=len(units) - len(todo), total=len(units))
    workers = cfg.workers or min(2, os.cpu_count() or 1)
    if workers <= 1 or len(todo) <= 1:
        for r, s in todo:
            _do_unit(r, s, cfg, part(r, s))
            bar.update()
    else:
        with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
            for f in as_completed([ex.submit(_do_unit, r, s, cfg, part(r, s)) for r, s in todo]):
                f.result()
                bar.update()
    bar.close()
    df = pd.concat([pd.read_parquet(part(*u)) for u in units], ignore_index=True)
    out = {"ablation": os.path.join(cfg.out, "ablation.parquet")}
    _write(df, out["ablation"])

    pairs = [p for p in SCHEME_PAIRS if p[0] in cfg.schemes and p[1] in cfg.schemes]
    ks = stattests.ks_table(df, KS_METRICS, cfg.alpha, cfg.correction, pairs)
    out["ks"] = os.path.join(cfg.out, "ks.parquet")
    _write(ks, out["ks"])
    out["gaps"] = os.path.join(cfg.out, "gaps.parquet")
    _write(stattests.gap_table(df), out["gaps"])

    dpath = os.path.join(cfg.out, "deff.parquet")
    if cfg.deff_regimes and not os.path.exists(dpath):
        _write(stattests.deff_study(cfg.deff_regimes, cfg.deff_budgets, cfg.deff_seeds, cfg.data), dpath)
    if os.path.exists(dpath):
        out["deff"] = dpath
    # "rotations": the schemes' own eigenbases (the key the report's run info prints)
    with open(os.path.join(cfg.out, "run.json"), "w") as f:
        json.dump({"seconds": round(time.time() - t0, 1), "units": len(units), "resumed_units": len(units) - len(todo),
                   "triton_path": (f"{cfg.triton_seeds} seeds x {cfg.triton_schemes} x {cfg.triton_regimes} through the paged cache"
                                   if cfg.triton_seeds else "off (--triton-seeds N)"), "rotations": "local"}, f, indent=1)
    return out
