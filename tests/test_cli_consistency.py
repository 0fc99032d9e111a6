"""One meaning and one default per option name across commands: the sequence length, the layer ranges, the fit
variant and the needle protocol agree between the commands that share them; old spellings stay as aliases."""

from __future__ import annotations

import argparse

import pytest

from oscar.__main__ import build_parser
from oscar.run import RunConfig


def _sub(*path: str) -> argparse.ArgumentParser:
    p = build_parser()
    for name in path:
        (act,) = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        p = act.choices[name]
    return p


def _opt(p: argparse.ArgumentParser, flag: str) -> argparse.Action:
    (a,) = [a for a in p._actions if flag in a.option_strings]
    return a


def test_seq_len_default_is_one_value():
    run = RunConfig(out="unused")  # run's None resolves to the longest context it validates
    defaults = {"calibrate": _opt(_sub("calibrate"), "--seq-len").default,
                "plan": _opt(_sub("plan"), "--seq-len").default,
                "cluster render": _opt(_sub("cluster", "render"), "--seq-len").default,
                "run": run.seq_len}
    assert set(defaults.values()) == {4096}, defaults


def test_run_speaks_calibrate_names_and_keeps_the_old_spellings():
    p = _sub("run")
    for new, old, dest in (("--seq-len", "--calib-seq-len", "calib_seq_len"),
                           ("--positions", "--calib-positions", "calib_positions")):
        a = _opt(p, new)
        assert old in a.option_strings and a.dest == dest
        assert getattr(build_parser().parse_args(["run", "--out", "x", old, "2048"]), dest) == 2048
        assert getattr(build_parser().parse_args(["run", "--out", "x", new, "2048"]), dest) == 2048


def test_layer_ranges_have_one_name():
    plan, cal = _opt(_sub("plan"), "--stage-layers"), _opt(_sub("calibrate"), "--stage-layers")
    assert "--layers" in plan.option_strings  # the older spelling of plan's, kept
    assert plan.metavar == cal.metavar


def test_fit_variant_default_is_what_run_ships():
    assert _opt(_sub("fit"), "--variant").default == RunConfig(out="unused").variant == "scaled"


def test_needle_protocol_default_is_run_s():
    assert _opt(_sub("validate", "niah"), "--protocol").default == _opt(_sub("run"), "--niah-protocol").default \
        == "serving"


@pytest.mark.parametrize("cmd", [["calibrate"], ["plan"], ["cluster", "render"], ["run"], ["fit"],
                                 ["validate", "niah"], ["validate", "ppl"]])
def test_help_states_each_default_once(cmd, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args([*cmd, "--help"])
    out = capsys.readouterr().out
    assert "%(" not in out and "(default: None)" not in out


SHARED = ("--model", "--artifact", "--methods", "--out", "--device", "--stages", "--ray")


def test_shared_options_are_defined_in_one_place():
    """--model, --artifact, --methods, --out, --device, --stages and --ray are added through oscar/cli_options.py
    only (one flag spelling, type, default and common help), never by a stage's own add_argument."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    pat = re.compile(r"add_argument\(\s*[\"'](%s)[\"']" % "|".join(SHARED))
    found = [f"{f.relative_to(root)}: {m.group(1)}"
             for d in ("oscar", "pipeline", "stats", "kernels", "validate", "cluster", "reports")
             for f in sorted((root / d).rglob("*.py")) if f.name != "cli_options.py"
             for m in pat.finditer(f.read_text())]
    assert not found, found


def _shared_actions(p: argparse.ArgumentParser | None = None, path: tuple[str, ...] = ()):
    """(command, shared flag, action) over every (nested) subcommand."""
    for a in (p or build_parser())._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                yield from _shared_actions(sub, path + (name,))
        flag = next((s for s in a.option_strings if s in SHARED), None)
        if flag:
            yield " ".join(path), flag, a


def test_shared_options_keep_their_defaults():
    """Where a command means the common thing it takes the common default; the commands that differ are named."""
    from oscar import cli_options as co

    seen = {}
    for cmd, flag, a in _shared_actions():
        assert a.option_strings == [flag], (cmd, a.option_strings)  # no alias of a shared flag
        seen[(cmd, flag)] = a
    dev = {c: a.default for (c, f), a in seen.items() if f == "--device"}
    assert set(dev.values()) == {co.DEFAULT_DEVICE}, dev
    meth = {c: a.default for (c, f), a in seen.items() if f == "--methods"}
    assert meth.pop("validate attention") == "naive-int2,kivi2,hadamard-int2,oscar-ref-int2,oscar-int2"
    assert meth.pop("run") is None  # the main job's own (RunConfig: MAIN_JOB_METHODS, or --full's DEFAULT_METHODS)
    assert set(meth.values()) == {co.DEFAULT_METHODS}, meth
    model = {c: a.default for (c, f), a in seen.items() if f == "--model"}
    # fit and latent-attention read the store's model by default
    assert {c for c, d in model.items() if d != co.EMBEDDED_MODEL} == {"plan", "cluster render", "import", "fit",
                                                                        "validate latent-attention"}, model
    assert {c for (c, f), a in seen.items() if f == "--ray"} == {"calibrate", "validate ppl", "validate niah", "fit"}
