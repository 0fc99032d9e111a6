"""The options the commands share, each defined once: `--model`, `--artifact`, `--methods`, `--out`, `--device`,
`--stages` and `--ray` (flag, type, default, help).

Every stage's CLI adds them through these functions, so a flag keeps one spelling, one type and one default
across commands. Where a command means something narrower (`oscar plan --model` reads a config only, `--out` is
a file for some commands and a directory for others) it passes its own help, and where its default differs it
passes that default; the shared text below is what the commands that mean the common thing print. A shared
leaf: argparse and the other leaves only, so every stage may import it.

Where commands differ (kept as they were; tests/test_cli_consistency.py names them):
- --model: `plan` requires it and reads a config only; `cluster render` has no default (the path the nodes see);
  `import` has none (the model whose fingerprint is checked); `fit` has none (the store's model); `calibrate` and
  `bench memory` word their help.
- --methods: `validate attention` defaults to naive-int2,kivi2,hadamard-int2,oscar-ref-int2,oscar-int2 (no bf16,
  no oscar-kc-int2); `run` words its help (the methods beyond the default).
- --device: `calibrate` takes any torch device string (no CUDA check up front), so it has its own help.
- --stages: `plan` requires it, `plan` and `cluster render` parse a plain int, `calibrate --ray` a positive one.
- --out: a file for fit, import and bench memory (optional there), a directory elsewhere.
- --artifact: `export` also takes it as a positional.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

from oscar.common import positive_int
from oscar.defaults import DEFAULT_METHODS as _DEFAULT_METHODS
from oscar.defaults import EMBEDDED_MODEL, TUNE_OBJECTIVES

DEFAULT_METHODS = ",".join(_DEFAULT_METHODS)  # --methods' default, as typed on the command line
# The formats `oscar export` writes and `oscar import` reads (stats/interop.py), named here so their CLI lists
# them without importing the converters (torch).
EXPORT_FORMATS = ("sglang-oscar", "gguf-rot")
# --engine (oscar/scoring/engine.py runs them), named here so `oscar validate ... --help` lists them without importing torch.
# oscar/scoring/engine.py still defines its own copies; tests/test_cli_consistency.py checks they agree.
ENGINES = ("simulate", "cache")
DEFAULT_ENGINE = "simulate"  # faster on CPU (several methods batched): docs/decisions/0057-engines-engine-simulate-stays-the-default-engine.md
ENGINE_HELP = ("execution engine: simulate (default: the fake-quant simulator, several methods and samples "
               "batched) or cache (the product path: OscarCache and the kernel dispatcher, prefill then decode; "
               "docs/validation.md, 'Engines')")
DEFAULT_DEVICE = "cpu"

MODEL_HELP = "model preset, HF directory or .gguf file"
ARTIFACT_HELP = "fitted artifact (default: none; needed by oscar-int2 and oscar-kc-int2)"
METHODS_HELP = ("comma list of cache methods (docs/validation.md: bf16, naive-int2, kivi2, hadamard-int2, "
                "oscar-ref-int2, oscar-kc-int2, oscar-int2, ...)")
# How a command that judges every method against the model treats one it cannot serve (validate/methods.py).
METHODS_RULE = ("; a method named here that cannot serve the model is refused; without --methods, one the model "
                "cannot serve is left out, said and recorded")
DEVICE_HELP = "device the model runs on: cpu (default), cuda or cuda:N (refused when CUDA is not available)"
RAY_HELP = ("run on a Ray cluster: ADDRESS (ray://..., host:port) or auto ($RAY_ADDRESS, a running local cluster, "
            "else start one on 127.0.0.1; default: no Ray, this process)")

Parser = argparse.ArgumentParser | argparse._ArgumentGroup

# The recipe's steps after the fit (oscar/recipe/driver.py), as `oscar fit` and `oscar run` take them.
WIDTHS = ("none", "copy", "gradient")


def add_model(p: Parser, help: str = MODEL_HELP, *, default: str | None = EMBEDDED_MODEL,
              required: bool = False) -> argparse.Action:
    """--model: the model a command loads (default: the embedded model)."""
    return p.add_argument("--model", default=None if required else default, required=required, help=help)


def add_artifact(p: Parser, help: str = ARTIFACT_HELP, *, required: bool = False) -> argparse.Action:
    """--artifact: a fitted artifact (.safetensors); no default."""
    return p.add_argument("--artifact", default=None, required=required, help=help)


def add_methods(p: Parser, help: str = METHODS_HELP, *, default: str = DEFAULT_METHODS) -> argparse.Action:
    """--methods: a comma list of cache methods (validate/methods.py)."""
    return p.add_argument("--methods", default=default, help=help)


def add_out(p: Parser, help: str, *, required: bool = True) -> argparse.Action:
    """--out: where a command writes (each command says whether a file or a directory); required unless told."""
    return p.add_argument("--out", default=None, required=required, help=help)


def add_device(p: Parser, help: str = DEVICE_HELP, *, default: str = DEFAULT_DEVICE) -> argparse.Action:
    """--device: the torch device the model runs on."""
    return p.add_argument("--device", default=default, help=help)


def add_stages(p: Parser, help: str, *, type: Callable[[str], Any] = positive_int,
               required: bool = False) -> argparse.Action:
    """--stages: pipeline stages (layer ranges) of one replica; no default."""
    return p.add_argument("--stages", type=type, default=None, required=required, help=help)


def add_ray(p: Parser, help: str = RAY_HELP) -> argparse.Action:
    """--ray ADDRESS: run on a Ray cluster (default: none, this process)."""
    return p.add_argument("--ray", metavar="ADDRESS", default=None, help=help)


def add_recipe(p: Parser) -> None:
    """--no-tune, --tune-objective, --widths: the recipe's steps after the fit (oscar/recipe/driver.py); `--no-tune
    --widths none` is the plain fit."""
    p.add_argument("--no-tune", action="store_true",
                   help="keep the fit's key clips (skip the tune: the factor x the clips with the lowest strict NLL on "
                        "calibration text, factors within 1 %% of it tying to the one nearest x1.0)")
    p.add_argument("--tune-objective", default="nll", choices=TUNE_OBJECTIVES,
                   help="what the key-clip tune minimises: nll (strict NLL), copy (NLL of a span copied from the INT2 "
                        "history), guarded (copy among the factors within 0.5 %% of the best NLL) (default %(default)s)")
    p.add_argument("--widths", default="gradient", choices=WIDTHS,
                   help="per-layer key widths, chosen after the tune by the NLL of spans copied from the INT2 history "
                        "of calibration text with one layer's keys at 3 / 4 bits, served as a per-layer artifact at the "
                        "same bits: gradient = that NLL change to first order (default; ~2.5 min for SmolLM2 on 2 "
                        "CPUs); copy = measured layer by layer (~35 min); none = the tuned fit itself")
