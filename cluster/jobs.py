"""Ray Jobs: `oscar submit` (resubmitting resumes) and `oscar status`.

A job config (YAML or JSON) is a calibration or a whole validation run:

    calibrate:   # a calibration: the options of `oscar calibrate` (CalibConfig field names)
      model: smollm2-135m
      store: /data/calib/smollm2.zarr
    run:         # or a validation run: the options of `oscar run` (RunConfig field names) -- calibrate
      model: /models/Qwen3-8B     # (on the Ray pipeline), fit, tune, needles, perplexity, report, all of
      out: /data/val/qwen3-8b     # ONE model, into `out` (its calib.zarr included)
    cluster:     # ClusterConfig of the calibration: stages, replicas, cpus_per_stage, gpus_per_stage, ...
      stages: 2
    job:         # how to launch the driver
      python: python            # interpreter on the head node
      num_gpus: 1               # GPUs the driver process gets (Ray's entrypoint_num_gpus; default 1 for a
                                # run -- its validation runs in the driver -- 0 for a calibration)
      num_cpus: 1               # CPUs of the driver (entrypoint_num_cpus; default Ray's)
      resources: {}             # custom resources of the driver (entrypoint_resources)
      runtime_env: {...}        # merged over cluster/runtime_env.yaml

The submission id is derived from the store (`oscar-calib-<hash of store path and
model>-<attempt>`), for a run from its output directory and model (`oscar-run-...`):
while an attempt is PENDING/RUNNING, submitting again attaches to it instead of starting
a duplicate; after a STOPPED/FAILED attempt, the next attempt resumes (a calibration's
done blocks are skipped, half-written ones redone; a run skips its finished stages and
scores only the needle samples and perplexity windows not yet in `out`).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from dataclasses import fields

import numpy as np
import yaml

from oscar.cluster.pipeline import ClusterConfig, unused_experts
from oscar.common import OscarError, fingerprint
from oscar.pipeline.calibrate import CalibConfig
from oscar.pipeline.store import CalibStore

CONFIG_ENV = "OSCAR_JOB_CONFIG"
RUNTIME_ENV_FILE = os.path.join(os.path.dirname(__file__), "runtime_env.yaml")
LIVE = ("PENDING", "RUNNING")
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


def load_job_config(path: str) -> dict:
    try:
        with open(path) as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise OscarError(f"cannot read job config {path}: {e}") from None
    try:
        cfg = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise OscarError(f"{path}: not valid YAML/JSON: {e}") from None
    return normalize_job_config(cfg, path)


JOB_KEYS = {"python", "runtime_env", "num_gpus", "num_cpus", "resources"}


def driver_config(argv: list[str]) -> dict:
    """The job config a Ray job's driver runs: the file named by its argument, else $OSCAR_JOB_CONFIG (which
    `oscar submit` sets), normalized like a submission's."""
    if argv:
        return load_job_config(argv[0])
    if os.environ.get(CONFIG_ENV):
        return normalize_job_config(json.loads(os.environ[CONFIG_ENV]), f"${CONFIG_ENV}")
    raise OscarError(f"no job config: pass a file or set ${CONFIG_ENV}")


def normalize_job_config(cfg, where: str = "job config") -> dict:
    """The config with paths made absolute and every section checked here, not on the cluster:
    {"calibrate": ..., "cluster": ..., "job": ...} or {"run": ..., "cluster": ..., "job": ...}."""
    if not isinstance(cfg, dict) or not (isinstance(cfg.get("calibrate"), dict) or isinstance(cfg.get("run"), dict)):
        raise OscarError(f"{where}: needs a `calibrate:` section (options of oscar calibrate) or a `run:` section "
                         "(options of oscar run)")
    unknown = set(cfg) - {"calibrate", "run", "cluster", "job"}
    if unknown:
        raise OscarError(f"{where}: unknown sections {sorted(unknown)} (calibrate or run, cluster, job)")
    if "calibrate" in cfg and "run" in cfg:
        raise OscarError(f"{where}: give `calibrate:` or `run:`, not both (a run calibrates its own model into "
                         "run.out/calib.zarr; its `run.calibrate` holds further calibrate options)")
    clu = dict(cfg.get("cluster") or {})
    cnames = {f.name for f in fields(ClusterConfig)}
    bad = set(clu) - cnames
    if bad:
        raise OscarError(f"{where}: unknown cluster options {sorted(bad)}; known: {sorted(cnames)}")
    ClusterConfig(**clu)  # validate now, not on the cluster
    job = dict(cfg.get("job") or {})
    bad = set(job) - JOB_KEYS
    if bad:
        raise OscarError(f"{where}: unknown job options {sorted(bad)}; known: {sorted(JOB_KEYS)}")
    for k in ("num_gpus", "num_cpus"):
        if k in job and (isinstance(job[k], bool) or not isinstance(job[k], (int, float)) or job[k] < 0):
            raise OscarError(f"{where}: job.{k} must be a number >= 0, got {job[k]!r}")
    if "resources" in job and not (isinstance(job["resources"], dict) and all(
            isinstance(k, str) and isinstance(v, (int, float)) and v >= 0 for k, v in job["resources"].items())):
        raise OscarError(f"{where}: job.resources must map resource names to amounts >= 0, got {job['resources']!r}")
    if "run" in cfg:
        return {"run": _normalize_run(cfg["run"], where), "cluster": clu, "job": job}
    return {"calibrate": _normalize_calibrate(cfg["calibrate"], where), "cluster": clu, "job": job}


def _normalize_calibrate(cal: dict, where: str) -> dict:
    cal = dict(cal)
    names = {f.name for f in fields(CalibConfig) if f.init}
    bad = set(cal) - names
    if bad:
        raise OscarError(f"{where}: unknown calibrate options {sorted(bad)}; known: {sorted(names)}")
    if "store" not in cal:
        raise OscarError(f"{where}: calibrate.store is required (the store identifies the job)")
    cal["store"] = os.path.abspath(os.path.expanduser(cal["store"]))
    CalibConfig(**cal)
    return cal


def _normalize_run(run: dict, where: str) -> dict:
    """The run section's shape (out made absolute). Its options are RunConfig's, which cluster may not import
    (the main job sits above every stage): `oscar.run.check_run_section` checks them when the driver starts,
    before any stage runs."""
    run = dict(run)
    if "out" not in run:
        raise OscarError(f"{where}: run.out is required (the output directory identifies the job)")
    run["out"] = os.path.abspath(os.path.expanduser(run["out"]))
    if not isinstance(run.get("calibrate") or {}, dict) or not isinstance(run.get("cluster") or {}, dict):
        raise OscarError(f"{where}: run.calibrate must be a mapping of oscar calibrate options; the calibration's "
                         "cluster options go in the top-level `cluster:` section")
    if "cluster" in run:
        raise OscarError(f"{where}: put the calibration's cluster options in the top-level `cluster:` section, "
                         "not under run")
    return run


def submission_base(cfg: dict) -> str:
    if "run" in cfg:
        r = cfg["run"]
        return "oscar-run-" + fingerprint({"out": r["out"], "model": r.get("model")}, 12)
    cal = cfg["calibrate"]
    return "oscar-calib-" + fingerprint({"store": cal["store"], "model": cal.get("model")}, 12)


def runtime_env(cfg: dict) -> dict:
    """cluster/runtime_env.yaml, then the job's own runtime_env, then the config itself."""
    with open(RUNTIME_ENV_FILE) as f:
        env = yaml.safe_load(f) or {}
    own = cfg["job"].get("runtime_env") or {}
    env_vars = {**(env.get("env_vars") or {}), **(own.get("env_vars") or {})}
    env = {**env, **own}
    env_vars[CONFIG_ENV] = json.dumps({k: cfg[k] for k in ("calibrate", "run", "cluster") if k in cfg})
    env["env_vars"] = {k: str(v) for k, v in env_vars.items()}
    return env


def entrypoint(cfg: dict) -> str:
    python = cfg["job"].get("python") or "python"
    return f"{shlex.quote(python)} -m " + ("oscar.run" if "run" in cfg else "oscar.cluster.entrypoint")


def submission(cfg: dict, submission_id: str, attempt: int) -> dict:
    """The keyword arguments of `JobSubmissionClient.submit_job` for this config: the entrypoint, its
    runtime environment and what the driver process asks Ray for. A run's driver runs the validation
    itself, so it asks for a GPU (job.num_gpus, default 1; 0 on a CPU cluster); the calibration's stage
    actors ask for their own (cluster.gpus_per_stage)."""
    job = cfg["job"]
    kw = {"entrypoint": entrypoint(cfg), "submission_id": submission_id, "runtime_env": runtime_env(cfg),
          "metadata": {"attempt": str(attempt)}}
    if "run" in cfg:
        kw["metadata"].update(out=cfg["run"]["out"], model=str(cfg["run"].get("model", "")))
    else:
        kw["metadata"]["store"] = cfg["calibrate"]["store"]
    gpus = job.get("num_gpus", 1 if "run" in cfg else 0)
    if gpus:
        kw["entrypoint_num_gpus"] = gpus
    if job.get("num_cpus") is not None:
        kw["entrypoint_num_cpus"] = job["num_cpus"]
    if job.get("resources"):
        kw["entrypoint_resources"] = dict(job["resources"])
    return kw


def _client(address: str | None):
    # late: ray reads its cluster mode when imported; connect() sets LOOPBACK_ENV first (cluster/localray.py)
    from ray.job_submission import JobSubmissionClient

    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        raise OscarError("give --address http://HOST:8265 (the Ray dashboard) or set RAY_ADDRESS")
    try:
        return JobSubmissionClient(address)
    except Exception as e:  # noqa: BLE001 - connection errors come in several types
        raise OscarError(f"cannot reach the Ray Jobs API at {address}: {e}") from None


def attempts(client, base: str) -> list:
    """Jobs of this store, oldest attempt first."""
    jobs = [j for j in client.list_jobs() if (j.submission_id or "").startswith(base + "-")]
    return sorted(jobs, key=lambda j: int(j.submission_id.rsplit("-", 1)[1]))


AGENT_WAIT_S = 120.0  # a head just started: its job agent may not be up yet


def _submit_when_ready(client, kw: dict, wait_s: float = AGENT_WAIT_S) -> None:
    """`client.submit_job(**kw)`, retried while the head answers that no job agent is up yet (a cluster started
    moments ago, or a loaded head); any other error at once."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            client.submit_job(**kw)
            return
        except Exception as e:  # noqa: BLE001 - the Jobs API reports it as a generic request failure
            if "No available agent" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(2.0)


def submit(config_path: str, *, address: str | None = None, wait: bool = False, timeout: float | None = None,
           poll: float = 2.0, progress: bool = True) -> int:
    cfg = load_job_config(config_path)
    client = _client(address)
    base = submission_base(cfg)
    sid = None
    for _ in range(5):  # a concurrent submitter may take the attempt number first
        prev = attempts(client, base)
        live = [j for j in prev if str(j.status) in LIVE or getattr(j.status, "value", None) in LIVE]
        if live:
            sid = live[-1].submission_id
            print(f"oscar submit: {sid} is already {_status_name(live[-1].status)} for this "
                  f"{'run' if 'run' in cfg else 'store'}; "
                  f"not submitting a duplicate")
            break
        n = int(prev[-1].submission_id.rsplit("-", 1)[1]) + 1 if prev else 1
        sid = f"{base}-{n}"
        try:
            _submit_when_ready(client, submission(cfg, sid, n))
        except Exception as e:  # noqa: BLE001
            if "already exists" in str(e):
                continue
            raise OscarError(f"job submission failed: {e}") from None
        what = "resumes the run: finished stages skipped, scored samples kept" if "run" in cfg else "resumes the store"
        print(f"oscar submit: submitted {sid}" + (f" (attempt {n}: {what})" if n > 1 else ""))
        break
    else:
        raise OscarError(f"could not find a free submission id for {base}")
    if not wait:
        return 0
    status = wait_for(client, sid, timeout=timeout, poll=poll, progress=progress)
    print(f"oscar submit: {sid} {status}")
    if status != "SUCCEEDED":
        if not progress:  # with progress the log has been followed already
            logs = client.get_job_logs(sid)
            print("\n".join(logs.splitlines()[-30:]), file=sys.stderr)
        return 1
    return 0


def _status_name(s) -> str:
    return str(getattr(s, "value", s))


def wait_for(client, sid: str, *, timeout: float | None = None, poll: float = 2.0, progress: bool = False,
             stream=None) -> str:
    """Poll until the job ends. progress: print each status change (with the elapsed time) and the job log's new
    output as it arrives — the driver's block bar and report — to `stream` (stderr)."""
    stream = stream or sys.stderr
    t0 = time.time()
    last, seen = None, 0
    while True:
        st = _status_name(client.get_job_status(sid))
        if progress:
            if st != last:
                print(f"oscar submit: {sid} {st} after {time.time() - t0:.0f} s", file=stream, flush=True)
                last = st
            try:
                logs = client.get_job_logs(sid) or ""
            except Exception:  # noqa: BLE001 - logs are not there before the driver starts
                logs = ""
            if len(logs) > seen:
                stream.write(logs[seen:])
                stream.flush()
                seen = len(logs)
        if st in TERMINAL:
            return st
        if timeout is not None and time.time() - t0 > timeout:
            raise OscarError(f"job {sid} still {st} after {timeout:.0f}s")
        time.sleep(poll)


# --------------------------------------------------------------------------- status

def store_status(store: str, address: str | None = None) -> dict:
    """Blocks done per stage (from the store's done markers and the stages its Ray job recorded)."""
    st = CalibStore(store)
    done = st.done()  # (B, L)
    cl = st.group.attrs.get("cluster") or {}
    ranges = [tuple(r) for r in cl.get("stages", [])] or [(0, st.num_layers)]
    out = {
        "store": str(st.path), "num_blocks": st.num_blocks, "num_layers": st.num_layers,
        "blocks_done": int(done.all(1).sum()),
        "stages": [{"stage": i, "layers": [a, b], "blocks_done": int(done[:, a:b].all(1).sum())}
                   for i, (a, b) in enumerate(ranges)],
        "layers_blocks_done": [int(x) for x in done.sum(0)],
        "replicas": cl.get("replicas"),
        "unused_experts": {str(k): v for k, v in unused_experts(st).items()},
        "tokens_done": int(np.asarray(st.group["mask"][:])[done.all(1)].sum()),
        "verified": st.checksummed,
        "damage": [str(d) for d in st.verify()],  # damaged chunks of done blocks (re-run calibrate: redone)
    }
    if address:
        client = _client(address)
        model = st.meta.model.get("name")
        # The store alone does not know the submitted model spec; match on the store path.
        jobs = [j for j in client.list_jobs() if (j.metadata or {}).get("store") == os.path.abspath(store)]
        out["jobs"] = [{"submission_id": j.submission_id, "status": _status_name(j.status)}
                       for j in sorted(jobs, key=lambda j: j.submission_id or "")]
        out["model"] = model
    return out


def format_status(s: dict) -> str:
    lines = [f"{s['store']}: {s['blocks_done']}/{s['num_blocks']} blocks done "
             f"({s['tokens_done']:,} tokens), {s['num_layers']} layers"]
    for st in s["stages"]:
        a, b = st["layers"]
        lines.append(f"  stage {st['stage']}  layers {a:>3}-{b - 1:<3}  {st['blocks_done']}/{s['num_blocks']} blocks")
    if s.get("damage"):
        lines.append(f"  DAMAGED: {len(s['damage'])} chunk(s) of done blocks fail verification (re-run the same "
                     f"calibrate command to redo them):")
        lines += [f"    {d}" for d in s["damage"][:20]]
    for l, ex in s.get("unused_experts", {}).items():
        lines.append(f"  layer {l}: {len(ex)} experts with no routed token" + (f": {ex}" if ex else ""))
    for j in s.get("jobs", []):
        lines.append(f"  job {j['submission_id']}: {j['status']}")
    return "\n".join(lines)
