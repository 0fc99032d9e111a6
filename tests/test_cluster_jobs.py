"""Job configs and shipped manifests (no Ray needed): validation, store-derived submission ids,
runtime environment, the calibrate --ray flags, bad input."""

from __future__ import annotations

import json
import os
import pytest
import yaml

from oscar.cluster import jobs
from oscar.cluster.pipeline import ClusterConfig
from oscar.common import OscarError

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cfg(tmp_path, **cal):
    return {"calibrate": {"model": "tiny-llama", "store": str(tmp_path / "s.zarr"), **cal},
            "cluster": {"stages": 2}}


def test_submission_id_is_derived_from_the_store(tmp_path, monkeypatch):
    a = jobs.normalize_job_config(cfg(tmp_path))
    monkeypatch.chdir(tmp_path)
    rel = jobs.normalize_job_config({"calibrate": {"model": "tiny-llama", "store": "s.zarr"}})
    assert rel["calibrate"]["store"] == a["calibrate"]["store"]          # relative paths made absolute
    assert jobs.submission_base(rel) == jobs.submission_base(a)           # cluster section not part of it
    other = jobs.normalize_job_config(cfg(tmp_path / "x"))
    assert jobs.submission_base(other) != jobs.submission_base(a)
    env = jobs.runtime_env({**a, "job": {"runtime_env": {"env_vars": {"X": 1}}}})
    assert env["env_vars"]["X"] == "1" and env["env_vars"]["TOKENIZERS_PARALLELISM"] == "false"
    assert json.loads(env["env_vars"][jobs.CONFIG_ENV])["calibrate"]["store"] == a["calibrate"]["store"]


@pytest.mark.parametrize("bad,match", [
    ({"calibrate": {"model": "x"}}, "calibrate.store is required"),
    ({"cluster": {}}, "needs a `calibrate:` section"),
    ({"calibrate": {"store": "s", "bogus": 1}}, "unknown calibrate options"),
    ({"calibrate": {"store": "s"}, "cluster": {"stagez": 2}}, "unknown cluster options"),
    ({"calibrate": {"store": "s"}, "cluster": {"stages": 0}}, "cluster.stages must be >= 1"),
    ({"calibrate": {"store": "s", "seq_len": 8, "sink": 8}}, "must be larger than --sink"),
    ({"calibrate": {"store": "s"}, "extra": {}}, "unknown sections"),
])
def test_bad_job_configs(bad, match):
    with pytest.raises(OscarError, match=match):
        jobs.normalize_job_config(bad)


def test_shipped_manifests_are_valid():
    """The shipped job configs parse and validate; cluster manifests are rendered (tests/test_cluster_render.py),
    here the GLM-4.7 RayJob's arithmetic: the worker GPUs are exactly the stages' GPUs."""
    import shlex

    from oscar.__main__ import build_parser
    from oscar.cluster.render import RenderConfig, render

    for f in ("runtime_env.yaml", "job-example.yaml"):
        yaml.safe_load(open(os.path.join(HERE, "cluster", f)))
    for f in ("rayjob-glm47.yaml", "cluster-gpu.yaml"):  # replaced by `oscar cluster render`: no fake values shipped
        assert not os.path.exists(os.path.join(HERE, "cluster", f))
    r = render(RenderConfig(target="kuberay", image="img", nodes=2, gpus_per_node=8, gpu_mem=80, cpus_per_node=32,
                            memory_per_node=256, model="/data/GLM-4.7", model_config="glm-4.7", store="/data/s.zarr",
                            pvc="data"))
    rayjob = yaml.safe_load(r.files["rayjob.yaml"])
    assert rayjob["kind"] == "RayJob" and rayjob["spec"]["entrypoint"].startswith("oscar calibrate --ray auto ")
    args = build_parser().parse_args(shlex.split(rayjob["spec"]["entrypoint"])[1:])
    job = jobs.normalize_job_config({"calibrate": {"model": args.model, "store": args.store, "seq_len": args.seq_len},
                                     "cluster": {"stages": args.stages, "replicas": args.replicas,
                                                 "gpus_per_stage": args.gpus_per_stage}})
    workers = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    gpus = int(workers["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
    c = ClusterConfig(**job["cluster"])
    assert workers["replicas"] * gpus == c.stages * c.replicas * c.gpus_per_stage  # the arithmetic adds up
    jobs.normalize_job_config(yaml.safe_load(open(os.path.join(HERE, "cluster", "job-example.yaml"))))


def test_cli_flags_and_errors(tmp_path, capsys):
    from oscar.__main__ import main

    with pytest.raises(SystemExit):
        main(["calibrate", "--help"])
    out = capsys.readouterr().out
    assert "--ray ADDRESS" in out and "--replicas" in out and "--stage-layers" in out
    assert main(["calibrate", "--model", "tiny-llama", "--store", str(tmp_path / "s"), "--stages", "2"]) == 2
    assert "need --ray" in capsys.readouterr().err
    assert main(["submit", str(tmp_path / "missing.yaml"), "--address", "http://127.0.0.1:1"]) == 2
    assert "cannot read job config" in capsys.readouterr().err
    assert main(["status", str(tmp_path / "nostore")]) == 2
    assert "not a zarr store" in capsys.readouterr().err


def test_a_second_writer_is_refused(tmp_path):
    """A running Ray driver holds the store's layer locks; another run on the same store is refused."""
    from oscar.cluster.pipeline import job_id_for, prepare_store
    from oscar.pipeline.calibrate import CalibConfig
    from oscar.pipeline.store import WriterLock

    c = CalibConfig(model="tiny-llama", store=str(tmp_path / "s.zarr"), seq_len=32, sink=2, seqs_per_block=2,
                    tokens=128, reservoir=4)
    store, model_dir = prepare_store(c)
    assert os.path.isfile(os.path.join(model_dir, "config.json"))
    with WriterLock(store, range(4), job=f"{job_id_for(store)}-live"):  # this process = a live driver
        with pytest.raises(OscarError, match="is being written by pid"):
            prepare_store(c)
    prepare_store(c)  # released: resuming is fine


# ----------------------------------------------------------------- validation runs as jobs (`run:` section)


def run_cfg(tmp_path, job=None, **run):
    return {"run": {"model": "tiny-llama", "out": str(tmp_path / "val"), **run}, "cluster": {"stages": 2},
            **({"job": job} if job is not None else {})}


def test_run_job_asks_for_a_gpu_and_is_identified_by_its_output(tmp_path, monkeypatch):
    """A `run:` job: one model calibrated, fitted and validated into `out`; the submission asks Ray for a GPU
    for the driver (which runs the validation) unless the config says otherwise; the id comes from out + model."""
    a = jobs.normalize_job_config(run_cfg(tmp_path, lengths=[1024], calibrate={"block_tokens": 4096}))
    monkeypatch.chdir(tmp_path)
    rel = jobs.normalize_job_config({"run": {"model": "tiny-llama", "out": "val"}})
    assert rel["run"]["out"] == a["run"]["out"] == str(tmp_path / "val")
    assert jobs.submission_base(a) == jobs.submission_base(rel) and jobs.submission_base(a).startswith("oscar-run-")
    assert jobs.submission_base(a) != jobs.submission_base(jobs.normalize_job_config(run_cfg(tmp_path / "x")))
    assert jobs.submission_base(a) != jobs.submission_base(
        jobs.normalize_job_config({"run": {"model": "smollm2-135m", "out": str(tmp_path / "val")}}))
    kw = jobs.submission(a, "sid-1", 1)
    assert kw["entrypoint_num_gpus"] == 1 and kw["entrypoint"].endswith("-m oscar.run")
    assert kw["metadata"]["out"] == a["run"]["out"] and kw["metadata"]["model"] == "tiny-llama"
    sent = json.loads(kw["runtime_env"]["env_vars"][jobs.CONFIG_ENV])
    assert sent["run"]["lengths"] == [1024] and sent["run"]["calibrate"] == {"block_tokens": 4096}
    assert sent["cluster"] == {"stages": 2} and "calibrate" not in sent
    # a CPU cluster: 0 GPUs (the key is left out: Ray's default); CPUs and custom resources pass through
    cpu = jobs.submission(jobs.normalize_job_config(run_cfg(tmp_path, job={"num_gpus": 0, "num_cpus": 2,
                                                                          "resources": {"big": 1}})), "s", 2)
    assert "entrypoint_num_gpus" not in cpu and cpu["entrypoint_num_cpus"] == 2 and cpu["entrypoint_resources"] == {"big": 1}
    assert jobs.submission(jobs.normalize_job_config(run_cfg(tmp_path, job={"num_gpus": 0.5})), "s", 1)[
        "entrypoint_num_gpus"] == 0.5  # a fraction: driver and a calibration stage sharing one GPU
    # a calibration job's driver asks for no GPU (its stage actors ask for theirs)
    assert "entrypoint_num_gpus" not in jobs.submission(jobs.normalize_job_config(cfg(tmp_path)), "s", 1)


def test_shipped_validation_job(tmp_path):
    """cluster/job-validate.yaml (docs/validation.md's GPU job) is a valid run of ONE 128k-capable model that
    asks for a GPU for its driver and calibrates on GPU stage actors."""
    from oscar.run import check_run_section

    c = jobs.normalize_job_config(yaml.safe_load(open(os.path.join(HERE, "cluster", "job-validate.yaml"))))
    rc = check_run_section(c["run"])
    assert max(rc.lengths) == 131072 and rc.calibrate["device"] == "cuda" and c["cluster"]["gpus_per_stage"] >= 1
    assert rc.device == "cuda" and rc.engine == "cache"  # validated on the GPU through the shipped cache
    # short windows, but the calibration covers every position the needles reach (read at RoPE offsets)
    assert rc.seq_len < max(rc.lengths) == rc.positions and rc.seq_len <= rc.calib_tokens
    kw = jobs.submission(c, "s", 1)
    assert kw["entrypoint_num_gpus"] >= 1 and kw["entrypoint"] == "python -m oscar.run"
    doc = open(os.path.join(HERE, "docs", "validation.md")).read()
    sec = doc[doc.index("## To 128k with a real model"):doc.index("## The recipe's tune and widths")]
    assert "oscar submit cluster/job-validate.yaml" in sec and "model: " + rc.model in sec


@pytest.mark.parametrize("bad,match", [
    ({"run": {"model": "tiny-llama"}}, "run.out is required"),
    ({"run": {"out": "o"}, "calibrate": {"store": "s"}}, "not both"),
    ({"run": {"out": "o", "calibrate": ["device"]}}, "run.calibrate must be a mapping"),
    ({"run": {"out": "o", "cluster": {"stages": 2}}}, "top-level `cluster:` section"),
    ({"run": {"out": "o"}, "job": {"num_gpus": -1}}, "job.num_gpus must be a number >= 0"),
    ({"run": {"out": "o"}, "job": {"num_gpus": "one"}}, "job.num_gpus must be a number >= 0"),
    ({"run": {"out": "o"}, "job": {"resources": {"x": -1}}}, "job.resources must map"),
    ({"run": {"out": "o"}, "job": {"gpus": 1}}, "unknown job options"),
    ({"run": {"out": "o"}, "cluster": {"stages": 0}}, "cluster.stages must be >= 1"),
])
def test_bad_run_job_configs(bad, match):
    with pytest.raises(OscarError, match=match):
        jobs.normalize_job_config(bad)


@pytest.mark.parametrize("run,match", [
    ({"out": "o", "bogus": 1}, "unknown run options"),
    ({"out": "o", "ray": False}, "unknown run options"),
    ({"out": "o", "calibrate": {"model": "smollm2-135m"}}, "are the run's own"),
    ({"out": "o", "calibrate": {"bogus": 1}}, "unknown run.calibrate options"),
])
def test_bad_run_options_refused_by_the_driver(run, match, tmp_path, capsys):
    """The run's options are RunConfig's (oscar/run.py, above cluster): the job's driver refuses them before
    any stage runs, with the same message as a bad calibrate option."""
    from oscar.run import check_run_section, job_main

    with pytest.raises(OscarError, match=match):
        check_run_section(run)
    p = tmp_path / "job.yaml"
    p.write_text(yaml.safe_dump({"run": {**run, "out": str(tmp_path / "o")}}))
    assert job_main([str(p)]) == 2
    assert "oscar job: error:" in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_submission_waits_for_the_heads_job_agent():
    """A head started moments ago answers 'No available agent' until its job agent is up: the submission is
    retried until it is, and any other error is raised at once."""
    from oscar.cluster.jobs import _submit_when_ready

    class Client:
        def __init__(self, fails: int, msg: str):
            self.fails, self.msg, self.calls = fails, msg, 0

        def submit_job(self, **kw):
            self.calls += 1
            if self.calls <= self.fails:
                raise RuntimeError(self.msg)

    c = Client(2, "Request failed with status code 500: No available agent to submit job, please try again later.")
    _submit_when_ready(c, {})
    assert c.calls == 3
    c = Client(1, "Request failed with status code 500: bad runtime env")
    with pytest.raises(RuntimeError, match="bad runtime env"):
        _submit_when_ready(c, {})
    assert c.calls == 1
