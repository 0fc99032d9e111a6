"""`oscar cluster render`: complete manifests from named parameters; the command they run parses with the real
CLI; unset parameters and GPU counts `oscar plan` says cannot hold the model are refused, writing nothing."""

from __future__ import annotations

import os
import shlex

import pytest
import yaml

from oscar.__main__ import build_parser, main
from oscar.cluster import jobs
from oscar.cluster.pipeline import ClusterConfig
from oscar.cluster.render import REQUIRED, RenderConfig, fill, render
from oscar.common import OscarError

IMAGE = "registry.internal/ml/oscar-kv:0.1.0-cu128"
KUBE = dict(target="kuberay", image=IMAGE, nodes=2, gpus_per_node=8, gpu_mem=80, cpus_per_node=32, memory_per_node=256,
            model="/data/models/GLM-4.7", model_config="glm-4.7", store="/data/calib/glm47.zarr", pvc="oscar-data",
            tokens=2097152, positions=131072, corpus="/data/corpus/calib.jsonl")  # 2.1 M tokens: a corpus of its own
AWS = dict(target="aws", image=IMAGE, nodes=1, gpus_per_node=8, gpu_mem=141, cpus_per_node=192,
           model="/data/models/GLM-4.7", model_config="glm-4.7", store="/data/calib/glm47.zarr", region="us-west-2",
           instance_type="p5en.48xlarge", mount_command="sudo mount -t nfs fs.internal:/export /data")


def argv_of(kw: dict) -> list[str]:
    out = []
    for k, v in kw.items():
        out += [f"--{k.replace('_', '-')}", str(v)]
    return out


def test_kuberay_manifest_is_complete_and_runs_a_real_oscar_command(tmp_path):
    assert main(["cluster", "render", "--out", str(tmp_path), *argv_of(KUBE)]) == 0
    rayjob = yaml.safe_load(open(tmp_path / "rayjob.yaml"))
    assert rayjob["kind"] == "RayJob" and rayjob["apiVersion"] == "ray.io/v1"
    spec = rayjob["spec"]["rayClusterSpec"]
    head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    workers = spec["workerGroupSpecs"][0]
    worker = workers["template"]["spec"]["containers"][0]
    assert head["image"] == worker["image"] == IMAGE
    lim = worker["resources"]["limits"]
    assert (lim["nvidia.com/gpu"], lim["cpu"], lim["memory"]) == (8, 32, "256Gi") and worker["resources"]["requests"] == lim
    assert workers["replicas"] == workers["minReplicas"] == workers["maxReplicas"] == 2
    vols = spec["headGroupSpec"]["template"]["spec"]["volumes"]
    assert vols == [{"name": "data", "persistentVolumeClaim": {"claimName": "oscar-data"}}]
    text = (tmp_path / "rayjob.yaml").read_text()
    for fake in ("ami-0123456789abcdef0", "fs-XXXX", "ghcr.io/example", "{{", "}}"):
        assert fake not in text
    # the header names the render command that reproduces the file, and it parses
    again = shlex.split(text.split("# Rendered by: ")[1].splitlines()[0])
    a2 = build_parser().parse_args(again[1:] + ["--out", str(tmp_path / "again")])
    assert a2.image == IMAGE and a2.nodes == 2 and a2.tokens == KUBE["tokens"]
    assert main(again[1:] + ["--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "rayjob.yaml").read_text() == text

    # the exact command, parsed by the real CLI parser
    argv = shlex.split(rayjob["spec"]["entrypoint"])
    assert argv[0] == "oscar"
    args = build_parser().parse_args(argv[1:])
    assert args.command == "calibrate" and args.ray == "auto" and args.device == "cuda" and args.dtype == "bfloat16"
    assert (args.model, args.store, args.tokens) == (KUBE["model"], KUBE["store"], KUBE["tokens"])
    assert args.positions == 131072 and args.seq_len == 4096  # 4k windows covering 128k positions
    # oscar plan --nodes 2 --gpus-per-node 8 --gpu-mem 80: one stage per GPU (>= 10 fit), 16 fill the GPUs
    assert (args.stages, args.replicas, args.gpus_per_stage) == (16, 1, 1.0)
    assert len(args.stage_layers.split(",")) == 16 and args.stage_layers.endswith(":92")
    c = ClusterConfig(stages=args.stages, replicas=args.replicas, gpus_per_stage=args.gpus_per_stage)
    assert workers["replicas"] * lim["nvidia.com/gpu"] == c.stages * c.replicas * c.gpus_per_stage  # the arithmetic adds up
    assert args.cpus_per_stage * c.stages * c.replicas <= lim["cpu"] * workers["replicas"]


def test_aws_launcher_and_job_config(tmp_path, capsys):
    assert main(["cluster", "render", "--out", str(tmp_path), *argv_of(AWS)]) == 0
    printed = capsys.readouterr().out
    cl = yaml.safe_load(open(tmp_path / "cluster.yaml"))
    assert cl["docker"]["image"] == IMAGE and cl["provider"]["region"] == "us-west-2"
    w = cl["available_node_types"]["gpu_worker"]
    assert w["resources"] == {"CPU": 192, "GPU": 8} and w["min_workers"] == w["max_workers"] == 1
    assert w["node_config"]["InstanceType"] == "p5en.48xlarge" and w["node_config"]["ImageId"] == "latest_dlami"
    assert AWS["mount_command"] in cl["initialization_commands"]
    assert not any("pip install" in c for c in cl.get("setup_commands", []))  # the image carries oscar-kv
    job = jobs.normalize_job_config(yaml.safe_load(open(tmp_path / "job.yaml")))
    assert job["calibrate"]["positions"] == 202752  # not given: every position GLM-4.7 serves
    assert job["calibrate"]["store"] == AWS["store"] and job["calibrate"]["device"] == "cuda"
    assert job["cluster"]["stages"] * job["cluster"]["replicas"] * job["cluster"]["gpus_per_stage"] == 8  # 1 x 8 x H200
    run = printed.split("runs: ")[1].strip()
    args = build_parser().parse_args(shlex.split(run)[1:])
    assert args.command == "submit" and args.config == "job.yaml" and args.wait
    assert run in (tmp_path / "cluster.yaml").read_text()


@pytest.mark.parametrize("target,base", [("kuberay", KUBE), ("aws", AWS)])
def test_every_required_parameter_unset_is_refused(tmp_path, target, base, capsys):
    for name in (*REQUIRED[target], "store"):
        kw = {k: v for k, v in base.items() if k != name}
        out = tmp_path / f"{target}-{name}"
        assert main(["cluster", "render", "--out", str(out), *argv_of(kw)]) == 2
        err = capsys.readouterr().err
        assert f"parameter(s) unset: --{name.replace('_', '-')}" in err and "nothing written" in err, err
        assert not out.exists()


def test_gpu_counts_the_plan_cannot_hold_are_refused(tmp_path):
    with pytest.raises(OscarError, match=r"no placement fits on 1 x 8 GPUs of 80 GiB: 1 GPU\(s\) per stage: needs 10 "
                                         r"stages, 8 stage slots; .* 8 GPU\(s\) per stage: needs 2 stages, 1 stage slots"):
        render(RenderConfig(**{**KUBE, "nodes": 1}))
    # --stages with --gpus-per-stage: the layout as given, checked as before
    old = {**KUBE, "gpus_per_stage": 8}
    with pytest.raises(OscarError, match=r"needs 2 stage\(s\) x 8 GPU\(s\) = 16 GPUs, but --nodes 1 x --gpus-per-node 8 = 8"):
        render(RenderConfig(**{**old, "nodes": 1, "stages": 2}))
    with pytest.raises(OscarError, match=r"does not fit: stage 0 .* peaks at .* GiB > 576.0 GiB .* smallest stage count "
                                         r"that fits is 2"):
        render(RenderConfig(**{**old, "stages": 1}))
    with pytest.raises(OscarError, match="a single layer does not fit"):
        render(RenderConfig(**{**KUBE, "gpu_mem": 1}))
    with pytest.raises(OscarError, match="do not split into replicas"):
        render(RenderConfig(**{**old, "nodes": 3, "stages": 2}))
    two = render(RenderConfig(**{**old, "stages": 2}))  # the one-stage-per-node layout stays available
    assert two.command[two.command.index("--stages") + 1] == "2" and "--stage-layers" not in two.command
    assert main(["cluster", "render", "--out", str(tmp_path / "x"), *argv_of({**KUBE, "nodes": 1})]) == 2
    assert not (tmp_path / "x").exists()


def test_bad_paths_and_configs_are_refused():
    with pytest.raises(OscarError, match="not on a volume every node mounts"):
        render(RenderConfig(**{**KUBE, "store": "/scratch/s.zarr"}))
    with pytest.raises(OscarError, match="must be an absolute path"):
        render(RenderConfig(**{**KUBE, "store": "calib.zarr"}))
    with pytest.raises(OscarError, match="give --model-config"):
        render(RenderConfig(**{**KUBE, "model_config": None}))
    with pytest.raises(OscarError, match="must divide --gpus-per-node"):
        render(RenderConfig(**{**KUBE, "gpus_per_stage": 3}))
    with pytest.raises(OscarError, match="one line"):
        render(RenderConfig(**{**KUBE, "image": "a\nkind: Pod"}))
    with pytest.raises(OscarError, match="--positions 2048 must be at least --seq-len 4096"):
        render(RenderConfig(**{**KUBE, "positions": 2048}))
    ok = render(RenderConfig(**{**KUBE, "models_pvc": "glm47-weights", "model": "/models/GLM-4.7"}))
    vols = yaml.safe_load(ok.files["rayjob.yaml"])["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["volumes"]
    assert {"name": "models", "persistentVolumeClaim": {"claimName": "glm47-weights", "readOnly": True}} in vols


def test_template_parameters_without_value_are_refused():
    with pytest.raises(OscarError, match="template parameter\\(s\\) unset: image, nodes"):
        fill("image: {{image}}\nreplicas: {{ nodes }}\nname: {{name}}", {"name": '"x"'})


def test_small_real_model_plans_from_its_own_config():
    """--model readable here: the plan reads it directly (the tiny preset, one stage on one GPU)."""
    r = render(RenderConfig(**{**KUBE, "model": "/data/m", "model_config": "tiny-llama", "nodes": 1, "gpus_per_node": 1,
                               "gpu_mem": 1, "positions": None}))  # tiny-llama serves 8192 positions, not 131072
    args = build_parser().parse_args(r.command[1:])
    assert (args.stages, args.replicas, args.gpus_per_stage) == (1, 1, 1.0)


def test_positions_beyond_the_model_are_refused(tmp_path, capsys):
    with pytest.raises(OscarError, match="--positions 300000 is beyond glm-4.7's max_position_embeddings 202752"):
        render(RenderConfig(**{**KUBE, "positions": 300000}))
    with pytest.raises(OscarError, match="--seq-len 16384 is beyond tiny-llama's max_position_embeddings 8192"):
        render(RenderConfig(**{**KUBE, "model_config": "tiny-llama", "positions": None, "seq_len": 16384}))
    out = tmp_path / "out"
    assert main(["cluster", "render", "--out", str(out), *argv_of({**KUBE, "positions": 202753})]) == 2
    err = capsys.readouterr().err
    assert "202753" in err and "202752" in err and err.count("\n") == 1 and not out.exists()
    assert render(RenderConfig(**{**KUBE, "positions": 202752})).command[-1] == "202752"  # the last one it serves


def test_default_positions_are_the_served_context(tmp_path, capsys):
    """Without --positions, a model serving far more than the windows cover is calibrated at every position it
    serves (the command says --positions 202752, a printed note and the manifest say why); --positions is kept
    as given; a model that serves little more keeps the windows' own positions."""
    kw = {k: v for k, v in KUBE.items() if k != "positions"}
    r = render(RenderConfig(**kw))
    assert r.command[r.command.index("--positions") + 1] == "202752"
    assert main(["cluster", "render", "--out", str(tmp_path / "a"), *argv_of(kw)]) == 0
    note = ("positions: 0..202751, every position glm-4.7 serves (the default: an artifact's key error grows past its "
            "calibrated positions); --positions N for a shorter served context")
    printed = capsys.readouterr().out
    assert note in printed and "--positions 202752" in printed
    assert note in (tmp_path / "a" / "rayjob.yaml").read_text()
    assert main(["cluster", "render", "--out", str(tmp_path / "b"), *argv_of(KUBE)]) == 0  # --positions 131072
    assert "positions:" not in capsys.readouterr().out
    assert "--positions 131072" in (tmp_path / "b" / "rayjob.yaml").read_text()
    small = render(RenderConfig(**{**kw, "model": "/data/m", "model_config": "tiny-llama", "nodes": 1,
                                   "gpus_per_node": 1, "gpu_mem": 1, "seq_len": 6144}))  # 8192 < 2 x 6144
    assert not any(n.startswith("positions:") for n in small.notes) and "--positions" not in small.command


@pytest.mark.parametrize("name,value", [("nodes", 0), ("gpus_per_node", 0), ("gpu_mem", 0), ("gpu_mem", -80),
                                        ("cpus_per_node", 0), ("memory_per_node", 0), ("seq_len", 0),
                                        ("positions", 0), ("positions", -1), ("seqs_per_block", 0),
                                        ("batch_size", 0), ("stages", 0), ("gpus_per_stage", 0), ("tokens", 0),
                                        ("head_cpus", 0), ("head_memory", 0), ("disk_gib", 0)])
def test_non_positive_sizes_are_refused_before_anything(tmp_path, capsys, monkeypatch, name, value):
    from oscar.cluster import plan

    def no_config(spec):
        raise AssertionError("the config was read before the sizes were checked")

    monkeypatch.setattr(plan, "load_model_config", no_config)
    out = tmp_path / "out"
    assert main(["cluster", "render", "--out", str(out), *argv_of({**KUBE, name: value})]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"oscar cluster: error: --{name.replace('_', '-')} must be") and err.count("\n") == 1, err
    assert "nothing written" in err and not out.exists()


@pytest.mark.parametrize("target,base", [("kuberay", KUBE), ("aws", AWS)])
def test_run_job_renders_the_whole_job_on_the_plans_stages(tmp_path, target, base, capsys):
    """`--job run`: the main job (calibrate -> recipe -> needles + perplexity on the stages -> report) with the
    placement the calibration gets; its config is what the driver checks (`oscar.run.check_run_section`)."""
    from oscar.run import check_run_section

    kw = {k: v for k, v in base.items() if k != "store"}
    assert main(["cluster", "render", "--out", str(tmp_path / "x"), *argv_of(kw), "--job", "run"]) == 2
    assert "parameter(s) unset: --run-dir" in capsys.readouterr().err and not (tmp_path / "x").exists()
    assert main(["cluster", "render", "--out", str(tmp_path / "y"), *argv_of(kw), "--job", "run", "--run-dir",
                 "/tmp/run"]) == 2
    assert "is not on a volume every node mounts" in capsys.readouterr().err
    assert main(["cluster", "render", "--out", str(tmp_path), *argv_of(kw), "--job", "run", "--run-dir",
                 "/data/runs/glm47"]) == 0
    if target == "kuberay":
        rayjob = yaml.safe_load(open(tmp_path / "rayjob.yaml"))
        assert rayjob["spec"]["entrypoint"] == "python -m oscar.run"
        env = yaml.safe_load(rayjob["spec"]["runtimeEnvYAML"])["env_vars"]
        job = jobs.normalize_job_config(yaml.safe_load(env[jobs.CONFIG_ENV]))  # JSON: what the driver reads
        assert "the whole oscar run" in open(tmp_path / "rayjob.yaml").read().splitlines()[0]
    else:
        job = jobs.normalize_job_config(yaml.safe_load(open(tmp_path / "job.yaml")))
    assert "calibrate" not in job and job["job"]["num_gpus"] == 0  # the driver holds no weights
    assert job["run"]["out"] == "/data/runs/glm47" and job["run"]["calibrate"]["device"] == "cuda"
    assert job["run"]["full"] is True  # the cluster job is the evidence run, not the 15-minute defaults
    rc = check_run_section(job["run"], cluster=job["cluster"])
    assert rc.stages == job["cluster"]["stages"] > 1  # the recipe and validation on the calibration's stages
    assert rc.widths == "none" or rc.widths in __import__("oscar.recipe.driver").recipe.driver.STAGED_WIDTHS
