"""A validation run as a Ray job (`oscar submit` of a `run:` config) on a real Ray cluster on 127.0.0.1:
calibrate (on the Ray pipeline), fit, tune, needles, perplexity, attention and report of ONE model;
stopped while it scores needle samples and resubmitted, it skips its finished stages and scores only
the samples not yet written (none twice, the ones written before the stop untouched).

The driver would ask Ray for a GPU (job.num_gpus, default 1: tests/test_cluster_jobs.py checks the
submission); this CPU host submits with num_gpus 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import yaml

from oscar.cluster.localray import LocalHead

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.timeout(900)]

TASKS = ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multivalue", "niah_multiquery"]
LENGTHS, SAMPLES, METHODS = [512, 1024], 3, ["bf16", "oscar-int2"]  # kivi2: skipped on tiny-llama (head_dim 32)
TOTAL = len(TASKS) * len(LENGTHS) * SAMPLES * len(METHODS)  # needle rows of the finished run


@pytest.fixture(scope="module")
def head():
    with LocalHead(num_cpus=4, object_store_mb=256).session() as h:  # loopback-only, private token
        yield h


def oscar(*args, timeout=600):
    r = subprocess.run([sys.executable, "-m", "oscar", *args], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def _status(client, sid) -> str:
    s = client.get_job_status(sid)
    return str(getattr(s, "value", s))


def _keys(path) -> list[tuple]:
    rows = [json.loads(l) for l in open(path)] if os.path.exists(path) else []
    return [(r["task"], r["length"], r["index"], r["method"]) for r in rows]


@pytest.mark.full
def test_validation_job_stop_resubmit_resumes_from_scored_samples(head, tmp_path):
    from ray.job_submission import JobSubmissionClient

    out = tmp_path / "val"
    run = {"model": "tiny-llama", "out": str(out), "calib_tokens": 1024, "seq_len": 256,
           "calibrate": {"block_tokens": 512}, "tasks": TASKS, "lengths": LENGTHS, "samples": SAMPLES,
           "methods": METHODS, "ppl_contexts": [256], "ppl_tokens": 2048, "attn_lengths": [256], "dtype": "float32",
           "widths": "none"}  # the job's 2 stages run the tune, needles and perplexity too
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump({"run": run, "cluster": {"stages": 2, "cpus_per_stage": 1},
                                   "job": {"python": sys.executable, "num_gpus": 0}}))
    client = JobSubmissionClient(head.dashboard)
    sid = oscar("submit", str(cfg), "--address", head.dashboard).stdout.split("submitted ")[1].split()[0]
    assert sid.startswith("oscar-run-") and sid.endswith("-1")

    samples = out / "niah_samples.jsonl"
    t0 = time.time()
    while not _keys(samples):  # stop while the needle stage is scoring
        assert time.time() - t0 < 600 and _status(client, sid) in ("PENDING", "RUNNING"), \
            _status(client, sid) + client.get_job_logs(sid)[-3000:]
        time.sleep(0.2)
    client.stop_job(sid)
    while _status(client, sid) not in ("STOPPED", "FAILED", "SUCCEEDED"):
        time.sleep(0.5)
    assert _status(client, sid) == "STOPPED"
    before = open(samples).read()
    k = len(_keys(samples))
    assert 0 < k < TOTAL, f"{k} of {TOTAL} rows at the stop: the stop came too late to test resuming"
    for f in ("calibrate", "fit", "tune"):
        assert (out / "stages" / f"{f}.json").exists()  # finished before the stop
    assert not (out / "stages" / "niah.json").exists()

    r = oscar("submit", str(cfg), "--address", head.dashboard, "--wait", "--timeout", "600", "--no-progress",
              timeout=700)
    sid2 = sid[:-2] + "-2"
    assert f"{sid2} SUCCEEDED" in r.stdout and "resumes the run" in r.stdout, r.stdout + r.stderr
    logs = client.get_job_logs(sid2)
    for f in ("calibrate", "fit", "tune key clip"):
        assert f"{f}: done (skipped)" in logs, logs[-3000:]
    keys = _keys(samples)
    assert len(keys) == len(set(keys)) == TOTAL  # every sample scored once
    assert open(samples).read().startswith(before)  # the rows scored before the stop were kept, not redone
    assert (out / "report.md").exists() and (out / "ppl.parquet").exists()
    placement = json.load(open(out / "run.json"))["placement"]  # the steps ran on the job's 2 stages
    assert placement["calibrate"]["stages"] == placement["niah"]["stages"] == placement["tune"]["stages"] == 2
    assert not (out / "attention.parquet").exists() and "Steps ran on:" in open(out / "report.md").read()
    # the model validated is the model calibrated: the run's store and artifact are both of tiny-llama
    from oscar.pipeline.store import CalibStore

    assert "tiny-llama" in json.dumps(CalibStore(str(out / "calib.zarr")).meta.model)
    info = json.loads(json.dumps(client.get_job_info(sid2).metadata))
    assert info["out"] == str(out) and info["model"] == "tiny-llama"
