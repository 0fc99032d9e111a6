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
