"""`oscar cluster render`: complete cluster manifests from named parameters, checked against `oscar plan`.

Two targets, both templates in cluster/templates/ with ``{{name}}`` parameters:

    kuberay  -> rayjob.yaml            a KubeRay RayJob whose entrypoint is an `oscar calibrate --ray auto` command
    aws      -> cluster.yaml, job.yaml a Ray cluster launcher config (nodes run the image) and the job config
                                       `oscar submit job.yaml --address ... --wait` sends

Nothing is written while a parameter is unset, and nothing is written for a GPU count that `oscar plan`
says cannot hold the model: a stage (its layers, float64 accumulators and activations) must fit 90 % of
its GPUs' memory, the check `oscar plan --gpu-mem` makes. Sizes below 1 and positions beyond the model's
`max_position_embeddings` are refused too. No Ray import: rendering runs anywhere.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
from dataclasses import dataclass, field, fields, replace
from importlib.metadata import version

import yaml

from oscar.cluster import plan as planner
from oscar.cluster.jobs import CONFIG_ENV
from oscar.cluster.placement import fmt_seconds
from oscar.cluster.plan import PlanConfig, corpus_budget, make_plan, plan_placed
from oscar.common import OscarError, fit_dim, is_latent, latent_refusal
from oscar.pipeline.corpus import estimate_size

TEMPLATES = os.path.join(os.path.dirname(__file__), "templates")
TARGETS = {"kuberay": ("rayjob.yaml",), "aws": ("cluster-aws.yaml",)}
_PARAM = re.compile(r"\{\{\s*([a-z_]+)\s*\}\}")
GiB = 1 << 30

# Parameters without a default, per target: the render refuses while any is unset.
REQUIRED = {
    "kuberay": ("image", "nodes", "gpus_per_node", "gpu_mem", "cpus_per_node", "memory_per_node", "model", "pvc"),
    "aws": ("image", "nodes", "gpus_per_node", "gpu_mem", "cpus_per_node", "model", "region", "instance_type",
            "mount_command"),
}
JOBS = {"calibrate": "store", "run": "run_dir"}  # what the job writes, on the shared volume: a required parameter

# Sizes that must be >= 1 (integers) or positive GiB, when set.
_COUNTS = ("nodes", "gpus_per_node", "cpus_per_node", "stages", "gpus_per_stage", "seq_len", "positions",
           "seqs_per_block", "batch_size", "tokens", "disk_gib", "head_cpus")
_GIB = ("gpu_mem", "memory_per_node", "head_memory")
# Without --positions, a model serving at least this many times the positions the windows cover gets a
# printed note: the artifact is calibrated for the short range only.
FAR_POSITIONS = 2


@dataclass
class RenderConfig:
    target: str                       # kuberay | aws
    out: str | None = None            # output directory
    image: str | None = None          # container image with oscar-kv installed (Dockerfile)
    nodes: int | None = None          # GPU worker nodes (pods)
    gpus_per_node: int | None = None
    gpu_mem: float | None = None      # GiB of one GPU
    cpus_per_node: int | None = None
    memory_per_node: float | None = None  # GiB (kuberay pod memory)
    model: str | None = None          # model directory as the nodes see it
    model_config: str | None = None   # config the plan reads here (default: --model when readable here)
    store: str | None = None          # calibration store as the nodes see it (on the shared volume)
    # calibrate: the calibration alone (`oscar calibrate --ray auto`); run: the whole job (`python -m oscar.run`:
    # calibrate -> the recipe -> needles + perplexity on the stages -> report) into run_dir
    job: str = "calibrate"
    run_dir: str | None = None        # job run: the run's directory as the nodes see it (on the shared volume)
    corpus: str = "pydoc"
    shared_dir: str = "/data"         # shared volume mount point: the store (and the corpus, the model) live below
    pvc: str | None = None            # kuberay: ReadWriteMany claim mounted at shared_dir
    models_pvc: str | None = None     # kuberay: optional ReadOnlyMany claim mounted at models_dir
    models_dir: str = "/models"
    region: str | None = None         # aws
    instance_type: str | None = None  # aws GPU worker instance type
    head_instance_type: str = "m7i.4xlarge"
    ami: str = "latest_dlami"         # aws: Ray's default Deep Learning AMI for the region
    mount_command: str | None = None  # aws: host command that makes shared_dir the shared filesystem
    disk_gib: int = 500
    stages: int | None = None         # default: the smallest count `oscar plan` fits
    gpus_per_stage: int | None = None  # default: gpus_per_node (one stage per node)
    seq_len: int = 4096
    positions: int | None = None      # RoPE positions the windows cover (`oscar calibrate --positions`)
    seqs_per_block: int = 8
    batch_size: int = 1
    tokens: int | None = None
    dtype: str = "bfloat16"
    name: str = "oscar-calib"
    head_cpus: int = 8
    head_memory: float = 32.0         # GiB
    dashboard: str = "http://127.0.0.1:8265"


@dataclass
class Rendered:
    files: dict[str, str]             # file name -> text
    command: list[str]                # the `oscar ...` command the cluster runs (argv, "oscar" first)
    plan: dict
    notes: list[str] = field(default_factory=list)  # printed with the file names (and in the manifests' header)


def _check_params(cfg: RenderConfig) -> None:
    if cfg.target not in TARGETS:
        raise OscarError(f"--target {cfg.target!r}: one of {', '.join(TARGETS)}")
    if cfg.job not in JOBS:
        raise OscarError(f"--job {cfg.job!r}: one of {', '.join(JOBS)}")
    unset = [k for k in (*REQUIRED[cfg.target], JOBS[cfg.job]) if getattr(cfg, k) in (None, "")]
    if unset:
        raise OscarError(f"cannot render the {cfg.target} manifest: parameter(s) unset: "
                         + ", ".join("--" + k.replace("_", "-") for k in unset) + "; nothing written")
    for f in fields(cfg):
        v = getattr(cfg, f.name)
        if isinstance(v, str) and ("\n" in v or "\r" in v):
            raise OscarError(f"--{f.name.replace('_', '-')} must be one line")
    for k in _COUNTS:  # sizes: refused before any config is read (unset optional ones keep their default)
        v = getattr(cfg, k)
        if v is not None and v < 1:
            raise OscarError(f"--{k.replace('_', '-')} must be >= 1, got {v}; nothing written")
    for k in _GIB:
        v = getattr(cfg, k)
        if v is not None and not (math.isfinite(v) and v > 0):
            raise OscarError(f"--{k.replace('_', '-')} must be a positive number of GiB, got {v:g}; nothing written")
    if cfg.positions is not None and cfg.positions < cfg.seq_len:
        raise OscarError(f"--positions {cfg.positions} must be at least --seq-len {cfg.seq_len}; nothing written")
    shared = [cfg.shared_dir] + ([cfg.models_dir] if cfg.models_pvc else [])
    out = JOBS[cfg.job]
    for name, path in ((out, getattr(cfg, out)), ("model", cfg.model)) + ((("corpus", cfg.corpus),) if cfg.corpus != "pydoc" else ()):
        flag = name.replace("_", "-")
        if not os.path.isabs(path):
            raise OscarError(f"--{flag} {path!r} must be an absolute path as the nodes see it")
        roots = [cfg.shared_dir] if name == out else shared
        if not any(os.path.normpath(path).startswith(os.path.normpath(r) + os.sep) for r in roots):
            raise OscarError(f"--{flag} {path!r} is not on a volume every node mounts ({' or '.join(roots)}); "
                             f"every stage must read the {name}" + (" and write its layers there" if name == out else ""))


def _layout(cfg: RenderConfig) -> tuple[int, int]:
    """(gpus_per_stage, stage slots): stages never span nodes (a stage's GPUs are packed in one node)."""
    g = cfg.gpus_per_stage or cfg.gpus_per_node
    if g < 1 or cfg.gpus_per_node % g:
        raise OscarError(f"--gpus-per-stage {g} must divide --gpus-per-node {cfg.gpus_per_node} (a stage's GPUs are "
                         "in one node)")
    return g, cfg.nodes * (cfg.gpus_per_node // g)


def plan_for(cfg: RenderConfig):
    """(plan, stages, replicas, gpus_per_stage, notes), or a clear refusal when the GPUs cannot hold the model
    or --positions goes beyond the model's (notes: `positions_notes`). Without both --stages and
    --gpus-per-stage the placement of `oscar plan --nodes` chooses what is unset (cluster/placement.py):
    one stage per GPU where a GPU holds a share of the layers, stages across nodes."""
    spec = cfg.model_config or cfg.model
    try:
        mcfg = planner.load_model_config(spec)  # looked up at call time: tests replace it
    except OscarError as e:
        hint = "" if cfg.model_config else (" (--model names the path on the nodes; give --model-config: a local "
                                            "config.json, model directory or shipped config such as glm-4.7)")
        raise OscarError(f"cannot plan the model: {e}{hint}") from None
    if cfg.job == "run" and is_latent(mcfg):  # `oscar run`'s recipe and validation are per-head
        raise OscarError(f"--job run: {latent_refusal(mcfg, spec)}; render --job calibrate, then `oscar fit STORE "
                         "--no-tune --widths none`; nothing written")
    notes = positions_notes(cfg, mcfg, spec)  # refuses --positions beyond the model's before any planning
    blocks, note = corpus_budget(cfg.corpus, seq_len=cfg.seq_len, seqs_per_block=cfg.seqs_per_block,
                                 tokens=cfg.tokens, larger=f" below {cfg.shared_dir}", end="; nothing written",
                                 head_dim=fit_dim(mcfg))
    notes.append(note)
    if cfg.stages is None or cfg.gpus_per_stage is None:
        if cfg.gpus_per_stage is not None:
            _layout(cfg)  # the same one-line refusal for a stage size that does not divide a node
        pc = PlanConfig(stages=1, gpu_mem_gib=cfg.gpu_mem, seq_len=cfg.seq_len, micro_batch=cfg.batch_size,
                        seqs_per_block=cfg.seqs_per_block, num_blocks=blocks, dtype=cfg.dtype, name=spec)
        try:
            plan = plan_placed(mcfg, pc, nodes=cfg.nodes, gpus_per_node=cfg.gpus_per_node, stages=cfg.stages,
                               gpus_per_stage=cfg.gpus_per_stage)
        except OscarError as e:
            raise OscarError(f"oscar plan: {e}; nothing written") from None
        pl = plan.placement
        return plan, pl["stages"], pl["replicas"], pl["gpus_per_stage"], notes
    g, slots = _layout(cfg)
    kw = dict(gpus_per_stage=g, gpu_mem_gib=cfg.gpu_mem, seq_len=cfg.seq_len, micro_batch=cfg.batch_size,
              seqs_per_block=cfg.seqs_per_block, num_blocks=blocks, dtype=cfg.dtype, name=spec)
    stages = cfg.stages
    if stages is None:
        stages = make_plan(mcfg, PlanConfig(stages=1, **kw)).suggested_stages
        if stages is None:
            raise OscarError(f"oscar plan: no stage count fits {spec} on GPUs of {cfg.gpu_mem:g} GiB x {g} per stage "
                             "(a single layer exceeds the budget); nothing written")
    plan = make_plan(mcfg, PlanConfig(stages=stages, **kw))
    budget = g * cfg.gpu_mem * GiB * 0.9
    worst = max(plan.stages, key=lambda s: s.peak_bytes)
    fit_hint = (f"the smallest stage count that fits is {plan.suggested_stages} "
                f"({plan.suggested_stages * g} GPUs per replica)" if plan.suggested_stages else "no stage count fits")
    if worst.peak_bytes > budget:
        raise OscarError(f"oscar plan: {spec} in {stages} stage(s) of {g} x {cfg.gpu_mem:g} GiB GPUs does not fit: "
                         f"stage {worst.stage} (layers {worst.layers[0]}-{worst.layers[1] - 1}) peaks at "
                         f"{worst.peak_bytes / GiB:.1f} GiB > {budget / GiB:.1f} GiB (90 % of its GPUs); {fit_hint}; "
                         "nothing written")
    if stages > slots:
        raise OscarError(f"oscar plan: {spec} needs {stages} stage(s) x {g} GPU(s) = {stages * g} GPUs, but "
                         f"--nodes {cfg.nodes} x --gpus-per-node {cfg.gpus_per_node} = {cfg.nodes * cfg.gpus_per_node}; "
                         "nothing written")
    if slots % stages:
        raise OscarError(f"{cfg.nodes} node(s) x {cfg.gpus_per_node // g} stage(s) per node = {slots} stage slots do not "
                         f"split into replicas of {stages} stage(s); use --nodes that is a multiple of "
                         f"{stages // math.gcd(stages, cfg.gpus_per_node // g)}; nothing written")
    return plan, stages, slots // stages, g, notes


def positions_notes(cfg: RenderConfig, mcfg, spec: str) -> list[str]:
    """Refuse positions the model does not serve; without --positions, say which positions the artifact
    will cover when the model serves far more (`FAR_POSITIONS` times or more)."""
    text = mcfg.get_text_config() if hasattr(mcfg, "get_text_config") else mcfg
    limit = getattr(text, "max_position_embeddings", None)
    covered = cfg.positions or cfg.seq_len
    flag = "--positions" if cfg.positions else "--seq-len"
    if not isinstance(limit, int) or limit < 1:
        return []  # the config does not say: nothing to check against
    if covered > limit:
        raise OscarError(f"{flag} {covered} is beyond {spec}'s max_position_embeddings {limit} (positions "
                         f"0..{limit - 1}); nothing written")
    if cfg.positions is None and limit >= FAR_POSITIONS * covered:
        return [f"positions: 0..{limit - 1}, every position {spec} serves (the default: an artifact's key error "
                f"grows past its calibrated positions); --positions N for a shorter served context"]
    return []


def budget_tokens(cfg: RenderConfig, spec: str) -> int | None:
    """--tokens, else the tokens recommended for the model's head_dim (cluster/plan.py `recommended_tokens`) when the
    corpus gives more or cannot be read here, else None (the whole corpus, as the plan says)."""
    if cfg.tokens is not None:
        return cfg.tokens
    rec = planner.recommended_tokens(fit_dim(planner.load_model_config(spec)))
    est = estimate_size(cfg.corpus)
    return rec if est is None or rec < est.tokens else None


def served_positions(cfg: RenderConfig, spec: str) -> int | None:
    """The positions the calibration covers: --positions, else every position the model serves when that is
    `FAR_POSITIONS` times the windows or more (windows read at RoPE offsets cost no more attention: decision
    "Calibrate at positions, not lengths"), else the windows' own (None)."""
    if cfg.positions is not None:
        return cfg.positions
    mcfg = planner.load_model_config(spec)
    text = mcfg.get_text_config() if hasattr(mcfg, "get_text_config") else mcfg
    limit = getattr(text, "max_position_embeddings", None)
    return limit if isinstance(limit, int) and limit >= FAR_POSITIONS * cfg.seq_len else None


def calibrate_command(cfg: RenderConfig, stages: int, replicas: int, g: int, layers: str | None = None) -> list[str]:
    """The `oscar calibrate --ray auto ...` the cluster runs (inside a Ray job, auto attaches to it); `layers`:
    the plan's `--stage-layers` (the placement's split balanced by compute time)."""
    cpus = max(1, cfg.cpus_per_node // (cfg.gpus_per_node // g))  # the node's CPUs shared by its stages
    cmd = ["oscar", "calibrate", "--ray", "auto", "--model", cfg.model, "--corpus", cfg.corpus, "--store", cfg.store,
           "--seq-len", str(cfg.seq_len), "--seqs-per-block", str(cfg.seqs_per_block), "--batch-size", str(cfg.batch_size),
           "--dtype", cfg.dtype, "--device", "cuda", "--stages", str(stages), "--replicas", str(replicas),
           "--gpus-per-stage", str(g), "--cpus-per-stage", str(cpus)]
    if layers:
        cmd += ["--stage-layers", layers]
    if cfg.tokens:
        cmd += ["--tokens", str(cfg.tokens)]
    if cfg.positions:
        cmd += ["--positions", str(cfg.positions)]
    return cmd


def run_job(cfg: RenderConfig, stages: int, replicas: int, g: int, cmd: list[str], layers: str | None) -> dict:
    """The job config of `--job run`: its `run:` section (RunConfig's options: the main job on this model, calibrated
    as `calibrate_command` would, into run_dir) and the calibration's `cluster:` section, whose stages then run the
    recipe, needles and perplexity too. The driver holds no weights (job.num_gpus 0) and checks the section when it
    starts (`oscar.run.check_run_section`)."""
    # full: a rendered cluster job is the evidence run (20 samples per cell, every method), not the 15-minute demo
    run = {"model": cfg.model, "out": cfg.run_dir, "corpus": cfg.corpus, "seq_len": cfg.seq_len, "full": True,
           **({"calib_tokens": cfg.tokens} if cfg.tokens else {}), **({"positions": cfg.positions} if cfg.positions else {}),
           "calibrate": {"device": "cuda", "dtype": cfg.dtype, "seqs_per_block": cfg.seqs_per_block,
                         "batch_size": cfg.batch_size}}  # the default widths (gradient) run on the stages too
    return {"run": run, "cluster": _cluster_section(stages, replicas, g, cmd, layers),
            "job": {"python": "python", "num_gpus": 0}}


def _cluster_section(stages: int, replicas: int, g: int, cmd: list[str], layers: str | None) -> dict:
    return {"stages": stages, "replicas": replicas, "gpus_per_stage": g, **({"layers": layers} if layers else {}),
            "cpus_per_stage": float(cmd[cmd.index("--cpus-per-stage") + 1])}


def _comment(lines: list[str]) -> str:
    return "\n".join("#   " + x for x in lines)


def _plan_lines(plan, stages: int, replicas: int, g: int, cfg: RenderConfig) -> list[str]:
    out = [f"weights ({cfg.dtype}): {plan.loaded_param_bytes / GiB:.1f} GiB loaded by the stages "
           "(no LM head / final norm)"]
    for s in plan.stages:
        out.append(f"stage {s.stage}: layers {s.layers[0]}-{s.layers[1] - 1}{' + embeddings' if s.embeddings else ''}: "
                   f"peak {s.peak_bytes / GiB:.1f} GiB -> {s.per_gpu_bytes / GiB:.1f} GiB per GPU on {g} GPU(s) "
                   f"(budget {0.9 * cfg.gpu_mem:.1f} GiB = 90 % of {cfg.gpu_mem:g} GiB)")
    out.append(f"{replicas} replica(s) x {stages} stage(s) x {g} GPU(s) of {cfg.nodes} node(s) x {cfg.gpus_per_node} GPUs"
               + (" (a replica's stages span nodes)" if stages * g > cfg.gpus_per_node else ""))
    e = plan.estimate
    if e:
        out.append(f"pipeline efficiency {e['efficiency']:.1%} (M/(M+P-1), M = {e['micro_batches']} micro-batches per "
                   f"replica); wall-time estimate {fmt_seconds(e['wall_seconds'])} for {e['tokens']:,} tokens "
                   f"(`oscar plan --nodes` prints its assumptions)")
    out.append(f"store: {plan.store_per_block['total'] / 2**20:.0f} MiB per block, {plan.num_blocks} blocks = "
               f"{plan.store_total_bytes / GiB:.1f} GiB at {cfg.store}")
    return out


def fill(template: str, values: dict[str, str]) -> str:
    """Substitute {{name}}; refuse a template parameter without a value."""
    missing = sorted({m for m in _PARAM.findall(template) if values.get(m) is None})
    if missing:
        raise OscarError(f"template parameter(s) unset: {', '.join(missing)}; nothing written")
    return _PARAM.sub(lambda m: values[m.group(1)], template)


def render_argv(cfg: RenderConfig) -> list[str]:
    """The `oscar cluster render` arguments that reproduce `cfg` (non-default fields; --out left to the user)."""
    out = []
    for f in fields(cfg):
        v = getattr(cfg, f.name)
        if f.name != "out" and v is not None and v != f.default:
            out += [f"--{f.name.replace('_', '-')}", f"{v:g}" if isinstance(v, float) else str(v)]
    return out


def render(cfg: RenderConfig) -> Rendered:
    _check_params(cfg)
    plan, stages, replicas, g, notes = plan_for(cfg)
    layers = (plan.placement or {}).get("layers")
    user = cfg  # what the render command reproduces; the job calibrates the recommended budget at the served positions
    spec = cfg.model_config or cfg.model
    cfg = replace(cfg, positions=served_positions(cfg, spec), tokens=budget_tokens(cfg, spec))
    cmd = calibrate_command(cfg, stages, replicas, g, layers)
    job = run_job(cfg, stages, replicas, g, cmd, layers) if cfg.job == "run" else None
    if job is not None:
        cmd = ["python", "-m", "oscar.run"]  # the driver: the job config comes from $OSCAR_JOB_CONFIG
    q = json.dumps  # a JSON string is a valid YAML double-quoted scalar
    plan_cmd = (f"oscar plan --model {shlex.quote(cfg.model_config or cfg.model)} --nodes {cfg.nodes} "
                f"--gpus-per-node {cfg.gpus_per_node} --stages {stages} --gpus-per-stage {g} "
                f"--gpu-mem {cfg.gpu_mem:g} --seq-len {cfg.seq_len} --seqs-per-block {cfg.seqs_per_block} "
                f"--blocks {plan.num_blocks} --dtype {cfg.dtype}" + (f" --stage-layers {layers}" if layers else ""))
    v = {
        "model": cfg.model, "render_command": shlex.join(["oscar", "cluster", "render", *render_argv(user)]),
        "plan_command": plan_cmd, "plan_comment": _comment(_plan_lines(plan, stages, replicas, g, cfg) + notes),
        "name": q(cfg.name), "image": q(cfg.image),
        "command": q(shlex.join(cmd)),
        "what": (f"calibrate {cfg.model} into a calibration store" if job is None else
                 f"the whole oscar run of {cfg.model} (calibrate, the recipe, needles, perplexity, report) into "
                 f"{cfg.run_dir}"),
        # the run's job config reaches its driver as $OSCAR_JOB_CONFIG (cluster/jobs.py CONFIG_ENV), a JSON string
        "job_env": "" if job is None else f"\n      {CONFIG_ENV}: {q(json.dumps(job))}",
        "nodes": str(cfg.nodes), "gpus_per_node": str(cfg.gpus_per_node), "cpus_per_node": str(cfg.cpus_per_node),
        "stages": str(stages), "replicas": str(replicas), "gpus_per_stage": str(g),
        "head_cpus": q(str(cfg.head_cpus)), "head_memory": q(f"{cfg.head_memory:g}Gi"),
    }
    files = {}
    if cfg.target == "kuberay":
        mounts = [f"                - {{name: data, mountPath: {q(cfg.shared_dir)}}}"]
        vols = [f"            - name: data\n              persistentVolumeClaim: {{claimName: {q(cfg.pvc)}}}"]
        if cfg.models_pvc:
            mounts.append(f"                - {{name: models, mountPath: {q(cfg.models_dir)}, readOnly: true}}")
            vols.append(f"            - name: models\n              persistentVolumeClaim: {{claimName: {q(cfg.models_pvc)}, "
                        "readOnly: true}")
        v.update(ray_version=q(_ray_version()), memory_per_node=q(f"{cfg.memory_per_node:g}Gi"),
                 volume_mounts="\n".join(mounts), volumes="\n".join(vols))
        files["rayjob.yaml"] = fill(_read("rayjob.yaml"), v)
    else:
        job = job or {"calibrate": {"model": cfg.model, "corpus": cfg.corpus, "store": cfg.store, "seq_len": cfg.seq_len,
                                    "seqs_per_block": cfg.seqs_per_block, "batch_size": cfg.batch_size, "dtype": cfg.dtype,
                                    "device": "cuda", **({"tokens": cfg.tokens} if cfg.tokens else {}),
                                    **({"positions": cfg.positions} if cfg.positions else {})},
                      "cluster": _cluster_section(stages, replicas, g, cmd, layers), "job": {"python": "python"}}
        submit = ["oscar", "submit", "job.yaml", "--address", cfg.dashboard, "--wait"]
        opts = ["--shm-size=16g", "--ulimit nofile=65536:65536", '--entrypoint=""',
                f"-v {shlex.quote(cfg.shared_dir)}:{shlex.quote(cfg.shared_dir)}"]
        v.update(region=q(cfg.region), instance_type=q(cfg.instance_type), head_instance_type=q(cfg.head_instance_type),
                 ami=q(cfg.ami), disk_gib=str(cfg.disk_gib), docker_run_options=q(opts),
                 mkdir_command=q("sudo mkdir -p " + shlex.quote(cfg.shared_dir)), mount_command=q(cfg.mount_command),
                 submit_command=shlex.join(submit))
        files["cluster.yaml"] = fill(_read("cluster-aws.yaml"), v)
        files["job.yaml"] = (f"# Job config for `{shlex.join(submit)}` (rendered with cluster.yaml).\n"
                             + yaml.safe_dump(job, sort_keys=False))
        cmd = submit
    for name, text in files.items():  # what we write parses
        try:
            list(yaml.safe_load_all(text))
        except yaml.YAMLError as e:  # a parameter broke the YAML: a bug or a hostile value, never written
            raise OscarError(f"rendered {name} is not valid YAML ({e}); nothing written") from None
    return Rendered(files, cmd, plan.to_dict(), notes)


def _read(name: str) -> str:
    with open(os.path.join(TEMPLATES, name)) as f:
        return f.read()


def _ray_version() -> str:
    try:
        return version("ray")
    except Exception:  # noqa: BLE001 - ray not installed here: the image's pin (scripts/constraints.txt)
        for line in _read_constraints():
            if line.startswith("ray=="):
                return line.split("==")[1]
    raise OscarError("cannot tell the Ray version for rayVersion: install oscar-kv[cluster]")


def _read_constraints() -> list[str]:
    p = os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts", "constraints.txt")
    return open(p).read().split() if os.path.exists(p) else []


def write(r: Rendered, out: str) -> list[str]:
    os.makedirs(out, exist_ok=True)
    paths = []
    for name, text in r.files.items():
        p = os.path.join(out, name)
        with open(p + ".tmp", "w") as f:
            f.write(text)
        os.replace(p + ".tmp", p)
        paths.append(p)
    return paths
