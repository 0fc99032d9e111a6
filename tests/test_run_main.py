"""`oscar run` end to end on small sizes (one process): every stage's output, the report, and a
re-run that skips every stage (the main job resumes instead of redoing work)."""

import json
import os
import subprocess
import sys
import time

import pandas as pd
import pytest

from oscar.run import RunConfig, run_main


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.full
def test_run_main_small_then_resume(tmp_path, capsys):
    # 512-token windows read at positions up to the 1024-token contexts validated (RunConfig.positions' default).
    # The compute dtype is the host's (float32 on a CPU without native bfloat16, where bf16 GEMMs run ~6x slower).
    cfg = RunConfig(out=str(tmp_path / "run"), ray=False, calib_tokens=4096, seq_len=512, samples=1,
                    tasks=["niah_single_1"], lengths=[1024], methods=["bf16", "naive-int2", "oscar-int2"],
                    ppl_tokens=1024, ppl_contexts=[1024], attn_lengths=[2048], progress=False, widths_windows=1)
    assert cfg.widths == "gradient" and cfg.variant == "scaled" and cfg.widths_length == 1024  # the defaults
    run_main(cfg)
    d = cfg.out
    for f in ("calib.zarr", "artifact.fit.safetensors", "artifact.safetensors", "results.parquet", "ppl.parquet", "goal.json",
              "attention.parquet", "report.md", "report.html", "run.json"):
        assert os.path.exists(os.path.join(d, f)), f
    res = pd.read_parquet(os.path.join(d, "results.parquet"))
    assert set(res.method) >= {"bf16", "naive-int2", "oscar-int2"} and (res.samples >= 1).all()
    ppl = pd.read_parquet(os.path.join(d, "ppl.parquet"))
    assert set(ppl.protocol) == {"strict", "serving"} and (ppl.ppl > 1).all()
    info = json.load(open(os.path.join(d, "run.json")))
    assert set(info["stage_seconds"]) >= {"calibrate", "fit", "tune", "widths", "niah", "ppl"}
    from oscar import host

    # the host it ran on, the dtype chosen for it and each native kernel's verdict, in run.json and the report
    assert info["compute_dtype"] == host.compute_dtype("auto", "cpu") and info["config"]["dtype"] == "auto"
    assert info["host"] == host.describe(info["host_info"]) and "CPUs" in info["host"]
    assert set(info["native_paths"]) == {"moments", "flash_cpu", "flash_cpu_bf16"} and all("why" in v for v in info["native_paths"].values())
    for f in ("ppl_config.json", "niah_config.json"):  # the stages ran in it (an identity names it unless float32:
        # float32 results written before the option keep their identity)
        assert json.load(open(os.path.join(d, f)))["identity"].get("dtype", "float32") == info["compute_dtype"]
    from oscar.stats.artifact import load_artifact

    tuned = load_artifact(os.path.join(d, "artifact.safetensors"))
    rec = tuned.meta["clip_tuning"]  # the served artifact carries its end-to-end clip choice
    from oscar.stats.artifact import calibrated_length

    assert tuned.meta["provenance"]["seq_len"] == 512 and calibrated_length(tuned) == 1024
    from oscar.recipe.tune import choose_factor

    assert choose_factor({float(f): v for f, v in rec["nll_per_token"].items()}, None, "nll", 0) == rec["chosen_factor"]
    report = open(os.path.join(d, "report.md")).read()
    assert "Product goal" in report and "niah_single_1" in report
    assert f"Model compute dtype {info['compute_dtype']}" in report and "flash_cpu: " in report
    capsys.readouterr()

    run_main(cfg)  # same config: every stage is found done and skipped
    err = capsys.readouterr().err
    for stage in ("calibrate", "fit", "tune key clip", "per-layer key widths (copy probe to first order)", "validate niah",
                  "validate ppl"):
        assert f"{stage}: done (skipped)" in err, err


def test_run_calibrates_at_the_longest_validated_context(tmp_path):
    """The calibration length defaults to the longest needle or perplexity context (the fit sees every position it is
    judged on); a budget that cannot fill one such sequence is refused before anything runs."""
    from oscar.common import OscarError

    assert RunConfig(out=str(tmp_path)).seq_len == 4096  # the embedded defaults: needles and perplexity to 4k
    assert RunConfig(out=str(tmp_path), lengths=[1024], ppl_contexts=[1024]).seq_len == 1024
    assert RunConfig(out=str(tmp_path), seq_len=2048).seq_len == 2048  # an explicit length is kept
    with pytest.raises(OscarError, match="do not fill one 8192-token sequence"):
        RunConfig(out=str(tmp_path), lengths=[8192], calib_tokens=4096)
    # the positions covered follow the longest context even when the windows are shorter (read at RoPE offsets)
    assert RunConfig(out=str(tmp_path)).positions == 4096
    assert RunConfig(out=str(tmp_path), seq_len=2048).positions == 4096
    assert RunConfig(out=str(tmp_path), seq_len=8192, calib_tokens=8192).positions == 8192
    assert RunConfig(out=str(tmp_path), lengths=[8192], calib_tokens=4096, seq_len=2048).positions == 8192
    with pytest.raises(OscarError, match="positions 1024 must be at least the calibration length 2048"):
        RunConfig(out=str(tmp_path), seq_len=2048, positions=1024)


def test_default_sizes_and_full(tmp_path):
    """Sizes left unset take the 15-minute defaults, or the evidence sizes under `full`; a size given is kept either
    way, and the CLI passes None for what the user did not give."""
    from oscar.__main__ import build_parser
    from oscar.defaults import DEFAULT_METHODS, MAIN_JOB_METHODS
    from oscar.defaults import DEMO_SIZES as DEMO, FULL_SIZES as FULL

    demo, full = RunConfig(out=str(tmp_path)), RunConfig(out=str(tmp_path), full=True)
    for cfg, sizes in ((demo, DEMO), (full, FULL)):
        assert {k: getattr(cfg, k) for k in sizes} == sizes
    assert (demo.samples, demo.lengths, demo.methods, demo.ppl_tokens, demo.ppl_contexts, demo.attn_lengths,
            demo.calib_tokens) == (10, [4096], MAIN_JOB_METHODS, 4096, [4096], [4096], 32768)
    assert (full.samples, full.lengths, full.methods, full.ppl_tokens, full.ppl_contexts, full.attn_lengths,
            full.calib_tokens) == (20, [1024, 2048, 4096], DEFAULT_METHODS, 12288, [1024, 4096], [4096, 16384], 65536)
    assert demo.seq_len == full.seq_len == demo.positions == full.positions == 4096  # both validate to 4k
    given = RunConfig(out=str(tmp_path), full=True, samples=3, lengths=[512], methods=["bf16"], calib_tokens=8192)
    assert (given.samples, given.lengths, given.methods, given.calib_tokens, given.ppl_tokens) == \
        (3, [512], ["bf16"], 8192, 12288)
    args = build_parser().parse_args(["run", "--out", "x"])
    assert args.samples is None and args.methods is None and args.calib_tokens is None and not args.full
    assert build_parser().parse_args(["run", "--out", "x", "--calib-tokens", "16384"]).calib_tokens == 16384
    for name in ("methods", "lengths", "ppl_contexts", "attn_lengths"):  # a run's lists are its own, not the module's
        getattr(RunConfig(out=str(tmp_path)), name).append(1)
        assert getattr(RunConfig(out=str(tmp_path)), name) == DEMO[name]


@pytest.mark.slow
def test_run_main_with_copy_widths_serves_the_per_layer_artifact(tmp_path, capsys):
    """`oscar run` with its default `--widths gradient` (tiny-llama, small sizes): the fit is one-group (`scaled`), the tune writes
    artifact.tuned.safetensors, the widths stage the per-layer artifact (oscar-artifact/3, widths from the copy
    probe to first order) the validation stages then score as oscar-int2; a re-run skips the stage. --widths with
    split keys is refused before any work. (`--widths copy` differs by the estimate only: the measured probe,
    tested through `oscar fit --widths copy`.)"""
    from oscar.artifact_header import read_metadata
    from oscar.common import OscarError
    from oscar.kernels.memory import artifact_bits_per_element
    from oscar.stats.artifact import load_artifact

    cfg = RunConfig(out=str(tmp_path / "run"), ray=False, model="tiny-llama", calib_tokens=2048, seq_len=256, samples=1,
                    tasks=["niah_single_1"], lengths=[512], methods=["bf16", "oscar-int2"], ppl_tokens=512,
                    ppl_contexts=[512], attn_lengths=[1024], progress=False, widths="gradient", widths_windows=1,
                    widths_length=512)
    assert cfg.variant == "scaled"
    run_main(cfg)
    d = cfg.out
    assert read_metadata(os.path.join(d, "artifact.safetensors"))["format"] == "oscar-artifact/3"
    art, tuned = load_artifact(os.path.join(d, "artifact.safetensors")), load_artifact(os.path.join(d, "artifact.tuned.safetensors"))
    assert art.layer_quant is not None and tuned.layer_quant is None
    assert artifact_bits_per_element(art) <= artifact_bits_per_element(tuned) + 1e-12
    info = json.load(open(os.path.join(d, "run.json")))
    assert "widths" in info["stage_seconds"] and "--widths" not in info["command"]  # the default
    # every stage's output, and the host it ran on with the dtype chosen for it and each native kernel's verdict
    # (the SmolLM2 run of the full suite checks the same on the embedded model)
    for f in ("calib.zarr", "artifact.fit.safetensors", "results.parquet", "ppl.parquet", "attention.parquet",
              "report.html"):
        assert os.path.exists(os.path.join(d, f)), f
    assert set(pd.read_parquet(os.path.join(d, "ppl.parquet")).protocol) == {"strict", "serving"}
    from oscar import host

    assert info["compute_dtype"] == host.compute_dtype("auto", "cpu") and info["config"]["dtype"] == "auto"
    assert info["host"] == host.describe(info["host_info"]) and "CPUs" in info["host"]
    assert set(info["native_paths"]) == {"moments", "flash_cpu", "flash_cpu_bf16"} and all("why" in v for v in info["native_paths"].values())
    for f in ("ppl_config.json", "niah_config.json"):
        assert json.load(open(os.path.join(d, f)))["identity"].get("dtype", "float32") == info["compute_dtype"]
    assert f"Model compute dtype {info['compute_dtype']}" in open(os.path.join(d, "report.md")).read()
    rec = read_metadata(os.path.join(d, "artifact.safetensors"))["layer_widths"]
    assert rec["estimate"] == "gradient" and len(rec["copy_err"]) == art.num_layers
    assert len(open(os.path.join(d, "widths.gradients.jsonl")).readlines()) == 1  # one window's sums: resumable
    assert "oscar-int2" in set(pd.read_parquet(os.path.join(d, "results.parquet")).method)
    assert os.path.exists(os.path.join(d, "calibration", "widths.png"))
    assert "Per-layer key widths (copy probe, first order)" in open(os.path.join(d, "report.md")).read()
    capsys.readouterr()
    run_main(cfg)
    assert "per-layer key widths (copy probe to first order): done (skipped)" in capsys.readouterr().err
    with pytest.raises(OscarError, match="--widths copy .* --variant split"):
        RunConfig(out=str(tmp_path / "x"), widths="copy", variant="split")
    with pytest.raises(OscarError, match="--widths must be one of none, copy, gradient"):
        RunConfig(out=str(tmp_path / "x"), widths="grad")
    assert RunConfig(out=str(tmp_path / "x"), widths="none").variant == "split"


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_report_states_the_commands_wall_time(tmp_path):
    """`oscar run`'s report and run.json give the command's wall time, from its process's start to the report
    (imports, kernel checks, model loading and the report included), beside the per-stage times: at least their sum,
    and what a clock around the command reads when the report is written."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "oscar", "run", "--out", str(out), "--no-ray", "--model", "tiny-llama", "--samples", "1",
           "--calib-tokens", "4096", "--methods", "bf16,oscar-int2", "--tasks", "niah_single_1", "--no-progress",
           "--lengths", "1k", "--ppl-contexts", "1k", "--ppl-tokens", "2k", "--attn-lengths", "1k"]  # every stage, small
    t0 = time.time()
    subprocess.run(cmd, check=True, capture_output=True, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})
    outer = time.time() - t0
    info = json.load(open(out / "run.json"))
    wall, stages = info["wall_seconds"], info["stage_seconds"]
    assert set(stages) == {"calibrate", "fit", "tune", "widths", "niah", "ppl", "attention"}, stages
    assert wall >= sum(stages.values()) == pytest.approx(info["total_seconds"])
    to_report = os.path.getmtime(out / "report.md") - t0  # the clock around the command, read at the report
    # slack above: run.json rounds to 0.1 s (+0.05), the process's start is read in clock ticks, floored (+1 tick),
    # and a file's mtime comes from the kernel's coarse clock, up to a tick behind (+1 tick)
    slack = 0.05 + 2 / os.sysconf("SC_CLK_TCK") + 0.005
    assert to_report - 1.0 <= wall <= min(to_report, outer) + slack, (wall, to_report, outer)
    head = open(out / "report.md").read().splitlines()[2]
    assert f"{wall / 60:.1f} min wall from the command's start to the report" in head, head
    assert all(f"{k} {v:.0f} s" in head for k, v in stages.items()), head


def test_run_command_reproduces_the_config(tmp_path):
    """run.json's command, parsed again, asks for the same run (every size the user gave, the long end, the
    calibration positions), and the new lengths read k-units."""
    import shlex
    from dataclasses import asdict

    from oscar.__main__ import build_parser
    from oscar.cli import run_config
    from oscar.run import run_command

    out = str(tmp_path / "r")
    for argv in (["--model", "qwen2.5-0.5b", "--full", "--no-ray", "--methods", "bf16,oscar-int2,kivi2,tq-int2", "--tasks",
                  "niah_single_1,niah_single_2,niah_single_3,niah_multikey_1", "--lengths", "1k,2k,4k,8k",
                  "--ppl-contexts", "1k,4k,8k", "--ppl-tokens", "64k", "--attn-lengths", "4k", "--long-lengths",
                  "16k,32k", "--long-samples", "5", "--positions", "32k"],
                 ["--samples", "3", "--seq-len", "1k", "--positions", "3k", "--widths", "none", "--no-tune"], []):
        cfg = run_config(build_parser().parse_args(["run", "--out", out, *argv]))
        cmd = run_command(cfg)
        again = run_config(build_parser().parse_args(shlex.split(cmd)[1:]))
        assert asdict(again) == asdict(cfg), cmd
    assert (cfg.positions, cfg.long_lengths) == (4096, None)
    full = run_config(build_parser().parse_args(["run", "--out", out, "--full", "--lengths", "1k,8k", "--ppl-tokens", "64k",
                                                 "--long-lengths", "32k", "--methods", "bf16,kivi2,oscar-int2"]))
    assert (full.lengths, full.ppl_tokens, full.seq_len, full.positions, full.long_methods) == \
        ([1024, 8192], 65536, 8192, 32768, ["bf16", "oscar-int2"])


def test_stages_record_cpu_time_summed_over_interrupted_invocations(tmp_path):
    """A step's marker holds its wall and CPU seconds; an invocation interrupted inside the step (Ctrl-C, or a
    SIGTERM, which `oscar run` turns into SystemExit) leaves what it spent, and the invocation that finishes adds it."""
    import time

    from oscar.recipe.driver import Stages

    def burn(seconds: float, then=None):
        t = time.process_time()
        while time.process_time() - t < seconds:
            pass
        if then:
            raise then

    st = Stages(str(tmp_path))
    with pytest.raises(KeyboardInterrupt):
        st.run("x", "x", "fp1", [], lambda: burn(0.2, KeyboardInterrupt()))
    spent = json.load(open(tmp_path / "stages" / "x.spent.json"))
    assert spent["cpu_seconds"] >= 0.2 and spent["fingerprint"] == "fp1" and "x" not in st.cpu_seconds
    assert st.run("x", "x", "fp1", [], lambda: burn(0.1))
    mark = json.load(open(tmp_path / "stages" / "x.json"))
    assert mark["cpu_seconds"] >= 0.3 and mark["seconds"] >= 0.3 and st.cpu_seconds["x"] == mark["cpu_seconds"]
    assert not (tmp_path / "stages" / "x.spent.json").exists()
    again = Stages(str(tmp_path))
    assert not again.run("x", "x", "fp1", [], lambda: burn(5)) and again.cpu_seconds == {"x": mark["cpu_seconds"]}
    with pytest.raises(SystemExit):  # another input's interrupted time is not this step's
        again.run("y", "y", "fp1", [], lambda: burn(0.2, SystemExit(143)))
    assert again.run("y", "y", "fp2", [], lambda: burn(0.05))
    assert json.load(open(tmp_path / "stages" / "y.json"))["cpu_seconds"] < 0.2
