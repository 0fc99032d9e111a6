"""The `oscar` command: a thin dispatcher over each stage's importable functions.

Each stage owns a `cli.py` with `register(subparsers)`; handlers import their
heavy dependencies when called, each such import marked `# late:` with its cost,
so that `oscar --help` loads no torch, transformers or ray.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

from oscar import __version__
from oscar.common import OscarError, check_output_path, silence_progress
from oscar.dirlock import DirLock

STAGE_CLIS = [
    "oscar.pipeline.cli",   # calibrate, verify, models
    "oscar.stats.cli",      # fit, variants, inspect, export, import
    "oscar.kernels.cli",    # bench memory
    "oscar.validate.cli",   # validate niah/ppl/tune/attention
    "oscar.cli",            # run (the main job, oscar/run.py), ablate
    "oscar.cluster.cli",    # submit, status, plan
    "oscar.reports.cli",    # report
]


class HelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to an option's help unless the help already states its default or there is
    none to state (None, a flag that is off, a required option)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        h = action.help or ""
        if ("default" in h.lower() or not action.option_strings or action.required
                or action.default is None or action.default is argparse.SUPPRESS or isinstance(action.default, bool)):
            return h
        return h + " (default: %(default)s)"


class _SubParsers(argparse._SubParsersAction):
    def add_parser(self, name, **kwargs):
        if kwargs.get("help") and not kwargs.get("description"):  # `oscar X --help` says what X does
            kwargs["description"] = kwargs["help"][:1].upper() + kwargs["help"][1:] + "."
        return super().add_parser(name, **kwargs)


class OscarParser(argparse.ArgumentParser):
    """Every `oscar` parser, nested subcommands included, formats option defaults the same way and gets a
    description (its one-line help when it has no longer one)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self.register("action", "parsers", _SubParsers)


def build_parser() -> argparse.ArgumentParser:
    p = OscarParser(prog="oscar", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"oscar-kv {__version__}",
                   help="print the installed oscar-kv version and exit")
    p.add_argument("--allow-weights-mismatch", action="store_true",
                   help="accept an artifact fitted on a model with the same config but other weights "
                        "(a deliberate transfer; default: refuse, naming the layers that differ)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=OscarParser,
                           help="`oscar COMMAND --help` gives each command's options, their meaning and defaults")
    for mod in STAGE_CLIS:
        try:
            m = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name == mod:  # stage not built yet
                continue
            raise
        m.register(sub)
    return p


def _suppress_defaults(p: argparse.ArgumentParser) -> None:
    p._defaults.clear()
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sp in set(a.choices.values()):
                _suppress_defaults(sp)
        elif a.dest not in ("help", "version"):
            a.default = argparse.SUPPRESS


def given_options(argv: list[str] | None) -> set[str]:
    """The dests set on the command line (not by a default): parsing again with every default suppressed
    leaves only those. A command uses it to tell a flag left out from one given at its default value."""
    p = build_parser()
    _suppress_defaults(p)
    return set(vars(p.parse_args(argv)))


def interruptible() -> None:
    """Make SIGINT raise KeyboardInterrupt even when it arrived ignored.

    A shell without job control (a script, `cmd &`, CI) starts background commands with SIGINT
    ignored, and Python then installs no KeyboardInterrupt handler: `kill -INT` (or Ctrl-C sent to
    the group) did nothing to `oscar run` while SIGTERM worked. Every long command here is
    resumable, so an interrupt must stop it (exit 130, "re-run the same command to resume").
    """
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


# Commands whose --out is one file (the others write a directory of files).
FILE_OUTPUTS = {("fit",), ("import",), ("validate", "tune"), ("validate", "widths"), ("bench", "memory")}


def command_path(args) -> tuple[str, ...]:
    """("validate", "niah"), ("fit",), ...: the (nested) subcommand the arguments select."""
    path = (args.command,)
    for dest in ("validate_command", "bench", "cluster_command", "models_command"):
        if getattr(args, dest, None):
            path += (getattr(args, dest),)
    return path


# Commands that load the model named by --model (its spec is checked up front); and those that read a store.
MODEL_INPUTS = {("calibrate",), ("run",), ("validate", "niah"), ("validate", "ppl"), ("validate", "tune"),
                ("validate", "widths")}
STORE_INPUTS = {("fit",), ("validate", "attention")}


def _resumes(args) -> bool:
    """`oscar calibrate` on a store that records its job (and no --overwrite): a resume."""
    if getattr(args, "overwrite", False) or not getattr(args, "store", None) or not os.path.isdir(args.store):
        return False
    # late: keeps zarr (0.33 s) out of `oscar --help`
    from oscar.pipeline.store import recorded_job

    try:
        return recorded_job(args.store) is not None
    except (OscarError, OSError, ValueError):
        return False  # not a readable store: the command says why


def native_attention(args) -> None:
    """A command that runs the model registers the native CPU attention with transformers first: the calibration
    capture (pipeline/capture.py) looks it up there by name rather than importing kernels, later in the data flow."""
    if command_path(args) in MODEL_INPUTS:
        from oscar.kernels.cpu_attention import register  # late: keeps torch (2.1 s) out of `oscar --help`

        register()


def check_inputs(args) -> None:
    """Inputs that can be checked without loading anything, checked before any work: the model spec, a corpus
    file, an artifact file, a calibration store. (cluster render names paths as the cluster's nodes see them.)"""
    path = command_path(args)
    if path == ("cluster", "render"):
        return
    device = getattr(args, "device", None)
    # with --ray the device is the stage actors' (each on the GPUs Ray gives it): the driver needs none
    if isinstance(device, str) and device.strip().lower().startswith("cuda") and not getattr(args, "ray", None):
        # late: keeps torch (2.1 s) out of `oscar --help`
        from oscar.scoring.engine import resolve_device  # torch: only when a CUDA device is asked for

        resolve_device(device)  # a CUDA device this machine lacks is refused first, whatever else is wrong
    if path == ("calibrate",) and _resumes(args):
        return  # the store's recorded job supplies --model and --corpus; calibrate compares any given (pipeline/cli.py)
    if path in MODEL_INPUTS and getattr(args, "model", None):
        # late: keeps torch (2.1 s) out of `oscar --help`
        from oscar.pipeline.models import check_model_spec

        check_model_spec(args.model)
    corpus = getattr(args, "corpus", None)
    if corpus and corpus != "pydoc":
        p = os.path.expanduser(corpus)
        if not os.path.exists(p):
            raise OscarError(f"--corpus {corpus}: no such file (pydoc, or a .parquet / .jsonl / .txt file)")
        if os.path.isdir(p):
            raise OscarError(f"--corpus {corpus} is a directory; give a .parquet / .jsonl / .txt file")
    for dest, flag in (("artifact", "--artifact"), ("artifact_pos", "ARTIFACT")):
        a = getattr(args, dest, None)
        if a and not os.path.isfile(os.path.expanduser(a)):
            raise OscarError(f"{flag} {a}: " + ("is a directory, not an artifact file" if os.path.isdir(a)
                                                 else "no such artifact file"))
    given = {getattr(args, d, None) for d in ("store", "store_pos")} - {None}
    if path in STORE_INPUTS and len(given) == 1:  # given twice or never: the command says so itself
        st = os.path.expanduser(given.pop())
        if not os.path.isdir(st):
            raise OscarError(f"calibration store {st} does not exist" if not os.path.exists(st)
                             else f"{st} is not a calibration store (not a directory)")


# Commands that write a directory with one owner (oscar/dirlock.py): the option naming it; a store's lock is beside it.
LOCKED_OUTPUTS = {("run",): ("out", "run directory"), ("validate", "niah"): ("out", "output directory"),
                  ("validate", "ppl"): ("out", "output directory"), ("calibrate",): ("store", "calibration store")}


def check_outputs(args) -> None:
    """Output paths checked before any work: a command must not compute for minutes and then fail to write.
    Writability is probed (a temporary file created and removed), so nothing is left behind on refusal. A directory
    another live process writes is refused here, in one line naming it, before anything is imported or loaded."""
    if getattr(args, "out", None):
        check_output_path(args.out, file=command_path(args) in FILE_OUTPUTS)
    if args.command == "calibrate" and getattr(args, "store", None):
        check_output_path(args.store, file=False, flag="--store")
    dest, what = LOCKED_OUTPUTS.get(command_path(args), (None, None))
    if dest and getattr(args, dest, None):
        DirLock(getattr(args, dest), store=dest == "store", what=what).check_free()
    if args.command == "report" and getattr(args, "dir", None) and os.path.isdir(args.dir):
        check_output_path(args.dir, file=False, flag="DIR")  # report.md and report.html are written into it
        if getattr(args, "readme", None):
            check_output_path(args.readme, file=True, flag="--readme")


def _quiet_broken_pipe() -> int:
    """stdout's reader went away (`oscar inspect ... | head -1`): stop quietly, as Unix tools do."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's final flush must not fail again
    except (OSError, ValueError):
        pass
    return 141  # 128 + SIGPIPE


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args._given = given_options(argv)
    if args.allow_weights_mismatch:
        os.environ["OSCAR_ALLOW_WEIGHTS_MISMATCH"] = "1"  # read by Artifact.check_model in every stage
    interruptible()
    try:
        check_outputs(args)  # first: a directory another process writes is refused before anything is imported
        if getattr(args, "no_progress", False):
            silence_progress()
        check_inputs(args)
        native_attention(args)
        rc = args.func(args)
        sys.stdout.flush()
    except BrokenPipeError:
        return _quiet_broken_pipe()
    except OscarError as e:
        print(f"oscar {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"oscar {args.command}: interrupted; re-run the same command to resume", file=sys.stderr)
        return 130
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
