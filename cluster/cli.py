"""CLI of the cluster stage: `oscar plan`, `oscar submit`, `oscar status`.

Handlers parse arguments and call importable functions; Ray is imported lazily.
The Ray flags of `oscar calibrate` (--ray/--stages/--replicas) are added by
`add_ray_arguments` and dispatched by `maybe_run_on_ray` (see cluster/pipeline.py).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import fields

from oscar.cli_options import add_model, add_out, add_ray, add_stages
from oscar.cluster.placement import GPUS, UTILIZATION
from oscar.cluster.steps import StepSizes
from oscar.common import OscarError, fit_dim, nonneg_float, positional_or_option, positive_float, positive_int
from oscar.pipeline.cli import calib_config


def register(sub: argparse._SubParsersAction) -> None:
    add_ray_arguments(sub.choices.get("calibrate"))
    add_staged_validation(sub.choices.get("validate"))
    p = sub.add_parser("plan", help="plan a pipeline: memory per stage, activations, store size, stage count",
                       description="From the model config alone (no weights): parameter bytes per stage, float64 "
                                   "accumulators, activations per micro-batch, store size and, with --gpu-mem, the "
                                   "smallest stage count that fits; then memory and time of each step on the stages "
                                   "(calibrate, tune, widths, perplexity, needles) and the INT2 KV cache per stage "
                                   "at --context (docs/scale.md).")
    add_model(p, "config.json, model directory, shipped config (glm-4.7) or preset", required=True)
    add_stages(p, "pipeline stages (layer ranges) per replica; required without --nodes (with --nodes: the "
                  "placement's choice)", type=int)
    p.add_argument("--gpus-per-stage", type=int, default=None,
                   help="GPUs that share one stage's weights (default: 1; with --nodes: the fewest that fit)")
    p.add_argument("--nodes", type=int, default=None,
                   help="GPU nodes to place stages and replicas on (with --gpus-per-node): one stage per GPU "
                        "when a GPU holds a share of the layers, stages across nodes (default: no placement)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs of one node, with --nodes")
    p.add_argument("--gpu", default="h100", choices=sorted(GPUS),
                   help="GPU whose datasheet FLOP/s (and, without --gpu-mem, memory) the placement and the "
                        "wall-time estimate use")
    p.add_argument("--gpu-mem", type=float, default=None, metavar="GiB",
                   help="memory of one GPU, to check the plan and suggest a stage count; a plan that does not fit "
                        "is printed, then refused (exit 2) (default: no check; with --nodes: --gpu's memory)")
    p.add_argument("--utilization", type=float, default=UTILIZATION,
                   help="share of the GPU's datasheet FLOP/s the wall-time estimate assumes")
    p.add_argument("--stage-layers", "--layers", dest="layers", default=None, metavar="A:B,B:C",
                   help="explicit layer ranges, one per stage, as `oscar calibrate --stage-layers` (default: balanced "
                        "by parameters; --layers: the older spelling)")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per calibration sequence")
    p.add_argument("--batch-size", "--micro-batch", dest="micro_batch", type=int, default=1,
                   help="sequences per forward pass, as `oscar calibrate --batch-size` (--micro-batch: the same)")
    p.add_argument("--seqs-per-block", type=int, default=8, help="sequences per store block")
    p.add_argument("--blocks", type=int, default=None, help="store blocks (for the store size; default: the "
                   "tokens recommended for the model's head_dim, 1,024 per dimension, or all --corpus gives when "
                   "that is less, estimated without a tokenizer; docs/calibrate.md)")
    p.add_argument("--corpus", default="pydoc", help="calibration corpus the blocks are checked against: pydoc "
                   "(default) or a file; more blocks than it gives are refused")
    p.add_argument("--reservoir", type=int, default=256, help="reservoir rows per block, layer and KV head")
    p.add_argument("--dtype", default=None, help="weight/activation dtype (default: the config's)")
    p.add_argument("--context", type=int, default=StepSizes.context,
                   help="tokens of the one-sequence KV cache sized per stage, and the longest needle length of the "
                        "needle estimate (4k, 8k, ... doubling up to it)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_plan)

    s = sub.add_parser("submit", help="submit a calibration or a whole validation run as a Ray job (resubmitting resumes)",
                       description="Submit a job config (calibrate: or run: options + cluster section) through the Ray "
                                   "Jobs API. The submission id comes from the store (a run: its out directory and "
                                   "model), so resubmitting attaches to a live attempt or resumes after a failed one "
                                   "(docs/cluster.md, docs/validation.md).")
    s.add_argument("config", help="job config (YAML/JSON): calibrate: (or run:) options + cluster section")
    s.add_argument("--address", default=None, help="Ray dashboard address, e.g. http://127.0.0.1:8265 "
                   "(default: $RAY_ADDRESS)")
    s.add_argument("--wait", action="store_true", help="follow the job until it ends, printing its status changes and "
                   "new log lines; exit 0 only on SUCCEEDED")
    s.add_argument("--timeout", type=positive_float, default=None, help="with --wait: give up after this many seconds (default: wait for the end)")
    s.add_argument("--no-progress", action="store_true", help="with --wait: print only the final status")
    s.set_defaults(func=_submit)

    t = sub.add_parser("status", help="blocks done per stage of a (running) calibration store",
                       description="Blocks done per stage and layer of a calibration store (read from its done "
                                   "markers), and with --address the Ray jobs that wrote it.")
    t.add_argument("store_pos", nargs="?", metavar="STORE", default=None,
                   help="calibration store; the same as --store (the positional spelling scripts use)")
    t.add_argument("--store", default=None, help="calibration store (zarr directory); required, here or as STORE")
    t.add_argument("--address", default=None,
                   help="also show the Ray job's status (dashboard address; default: the store only)")
    t.add_argument("--json", action="store_true", help="print the status as JSON")
    t.set_defaults(func=_status)
    _register_render(sub)


def _register_render(sub) -> None:
    c = sub.add_parser("cluster", help="cluster manifests: `oscar cluster render`",
                       description="Cluster manifests for calibrating at scale (docs/cluster.md).")
    cs = c.add_subparsers(dest="cluster_command", required=True, metavar="ACTION")
    r = cs.add_parser("render", help="write complete KubeRay / Ray-launcher manifests, checked against `oscar plan`",
                      description="Fill the shipped templates (cluster/templates) with these parameters and write "
                                  "complete manifests. Refuses, writing nothing, while a required parameter is unset "
                                  "or when `oscar plan` says the GPUs cannot hold the model.")
    req = "required"
    r.add_argument("--target", choices=("kuberay", "aws"), default="kuberay",
                   help="kuberay: a RayJob (rayjob.yaml); aws: a Ray cluster launcher config (cluster.yaml) + the job "
                        "config for `oscar submit` (job.yaml)")
    add_out(r, "directory the manifests are written to")
    r.add_argument("--image", help=f"container image with oscar-kv installed (built from the Dockerfile); {req}")
    r.add_argument("--nodes", type=int, help=f"GPU worker nodes (pods); {req}")
    r.add_argument("--gpus-per-node", type=int, help=f"GPUs of one worker node; {req}")
    r.add_argument("--gpu-mem", type=float, metavar="GiB", help=f"memory of one GPU, for the plan check; {req}")
    r.add_argument("--cpus-per-node", type=int, help=f"CPUs of one worker node (shared by its stages); {req}")
    r.add_argument("--memory-per-node", type=float, metavar="GiB", help=f"kuberay: memory of one worker pod; {req} "
                   "for kuberay")
    add_model(r, f"model directory (HF safetensors + index) as the nodes see it; {req}", default=None)
    r.add_argument("--model-config", help="config the plan reads on this machine: config.json, model directory or a "
                   "shipped config such as glm-4.7 (default: --model, when it is readable here)")
    r.add_argument("--job", choices=("calibrate", "run"), default="calibrate",
                   help="calibrate: the calibration alone (`oscar calibrate --ray auto`); run: the whole main job "
                        "(`python -m oscar.run`: calibrate, the recipe, needles and perplexity on the same stages, "
                        "report) into --run-dir")
    r.add_argument("--store", help=f"calibration store as the nodes see it, below --shared-dir; {req} with --job calibrate")
    r.add_argument("--run-dir", help=f"the run's directory as the nodes see it, below --shared-dir; {req} with --job run")
    r.add_argument("--corpus", default="pydoc", help="calibration corpus: pydoc or a file below a shared mount; the "
                   "blocks the manifest promises are checked against its size where it is readable here")
    r.add_argument("--shared-dir", default="/data", help="mount point of the volume every node shares (store, corpus)")
    r.add_argument("--pvc", help="kuberay: ReadWriteMany PersistentVolumeClaim mounted at --shared-dir; required for kuberay")
    r.add_argument("--models-pvc", help="kuberay: ReadOnlyMany claim with the weights, mounted at --models-dir "
                   "(default: none; the model is then below --shared-dir)")
    r.add_argument("--models-dir", default="/models", help="kuberay: mount point of --models-pvc")
    r.add_argument("--region", help="aws: region of the cluster; required for aws")
    r.add_argument("--instance-type", help="aws: GPU worker instance type, e.g. p5.48xlarge; required for aws")
    r.add_argument("--head-instance-type", default="m7i.4xlarge", help="aws: head node instance type (driver only)")
    r.add_argument("--ami", default="latest_dlami", help="aws: node AMI (latest_dlami: Ray's Deep Learning AMI of the region)")
    r.add_argument("--mount-command", help="aws: host command run before the container starts that mounts the shared "
                   "filesystem at --shared-dir (e.g. a Lustre or NFS mount); required for aws")
    r.add_argument("--disk-gib", type=int, default=500, help="aws: root volume of each worker (GiB)")
    add_stages(r, "pipeline stages per replica (default: the smallest count `oscar plan` fits)", type=int)
    r.add_argument("--gpus-per-stage", type=int, help="GPUs per stage, dividing --gpus-per-node (default: --gpus-per-node)")
    r.add_argument("--seq-len", type=int, default=4096, help="tokens per calibration sequence")
    r.add_argument("--positions", type=int, default=None,
                   help="RoPE positions the windows cover, as `oscar calibrate --positions` (default: --seq-len)")
    r.add_argument("--seqs-per-block", type=int, default=8, help="sequences per store block")
    r.add_argument("--batch-size", "--micro-batch", dest="batch_size", type=int, default=1,
                   help="sequences per forward pass (--micro-batch: the same)")
    r.add_argument("--tokens", type=int, help="calibration tokens (default: those recommended for the model's "
                   "head_dim, 1,024 per dimension, or the whole corpus when it gives less; docs/calibrate.md); more "
                   "than the corpus gives is refused")
    r.add_argument("--dtype", default="bfloat16", help="weight and activation dtype on the GPUs")
    r.add_argument("--name", default="oscar-calib", help="RayJob / cluster name")
    r.add_argument("--head-cpus", type=int, default=8, help="kuberay: CPUs of the head pod (driver only)")
    r.add_argument("--head-memory", type=float, default=32.0, metavar="GiB", help="kuberay: memory of the head pod")
    r.add_argument("--dashboard", default="http://127.0.0.1:8265",
                   help="aws: dashboard address the printed `oscar submit` uses (after `ray dashboard cluster.yaml`)")
    r.set_defaults(func=_render)


def _render(args) -> int:
    # late: keeps torch (2.1 s) out of `oscar --help`
    from oscar.cluster.render import RenderConfig, render, write

    cfg = RenderConfig(**{f.name: getattr(args, f.name) for f in fields(RenderConfig) if hasattr(args, f.name)})
    r = render(cfg)
    for p in write(r, args.out):
        print(p)
    for note in r.notes:
        print(note)
    print("runs: " + " ".join(r.command))
    return 0


def _plan(args) -> int:
    # late: keeps torch (2.1 s) out of `oscar --help`
    from oscar.cluster.plan import (PlanConfig, corpus_budget, format_plan, load_model_config, make_plan, misfit,
                                    plan_placed)

    if args.stages is None and args.nodes is None:
        raise OscarError("give --stages N, or --nodes N (with --gpus-per-node) to place the stages")
    gpu = GPUS[args.gpu]
    mem = args.gpu_mem if args.gpu_mem is not None or args.nodes is None else gpu.mem_gib
    for flag, v in (("--nodes", args.nodes), ("--gpus-per-node", args.gpus_per_node)):
        if v is not None and v < 1:
            raise OscarError(f"{flag} must be >= 1, got {v}")
    if not 0 < args.utilization <= 1:
        raise OscarError(f"--utilization must be in (0, 1], got {args.utilization:g}")
    if args.blocks is not None and args.blocks < 1:
        raise OscarError(f"--blocks must be >= 1, got {args.blocks}")
    pc = PlanConfig(stages=1 if args.stages is None else args.stages,
                    gpus_per_stage=1 if args.gpus_per_stage is None else args.gpus_per_stage, gpu_mem_gib=mem,
                    seq_len=args.seq_len, micro_batch=args.micro_batch, seqs_per_block=args.seqs_per_block,
                    num_blocks=1, reservoir=args.reservoir, dtype=args.dtype, layers=args.layers,
                    name=args.model, sizes=StepSizes(context=args.context))
    pc.check()  # sizes first: no config is read for a plan that cannot exist
    config = load_model_config(args.model)
    pc.num_blocks, note = corpus_budget(args.corpus, seq_len=args.seq_len, seqs_per_block=args.seqs_per_block,
                                        blocks=args.blocks, head_dim=fit_dim(config))
    if args.nodes is not None:
        plan = plan_placed(config, pc, nodes=args.nodes, gpus_per_node=args.gpus_per_node, gpu=gpu,
                           stages=args.stages, gpus_per_stage=args.gpus_per_stage, utilization=args.utilization)
    else:
        plan = make_plan(config, pc, gpu=gpu, utilization=args.utilization)
    plan.notes.append(note)
    # A plan that does not fit is still printed (stdout; JSON with "fits": false): its table shows which
    # stage is too large and by how much, which is what choosing --stages / --gpus-per-stage needs.
    # Then the one-line refusal (stderr, exit 2), so a script or `set -e` never takes it for a plan that fits.
    print(json.dumps(plan.to_dict(), indent=1) if args.json else format_plan(plan))
    why = misfit(plan, explicit_layers=bool(args.layers))
    if why:
        raise OscarError(why)
    return 0


def _submit(args) -> int:
    # late: keeps torch (2.1 s) out of `oscar --help`
    from oscar.cluster.jobs import submit

    return submit(args.config, address=args.address, wait=args.wait, timeout=args.timeout,
                  progress=not args.no_progress)


def _status(args) -> int:
    # late: keeps torch (2.1 s) out of `oscar --help`
    from oscar.cluster.jobs import format_status, store_status

    st = store_status(positional_or_option(args, "store", "--store"), address=args.address)
    print(json.dumps(st, indent=1) if args.json else format_status(st))
    return 1 if st.get("damage") else 0


# --------------------------------------------------------------------------- calibrate --ray

def add_ray_arguments(p: argparse.ArgumentParser | None) -> None:
    """Add the Ray flags to the `calibrate` parser (owned by oscar.pipeline.cli) and route
    `--ray` runs to oscar.cluster; without `--ray` the single-process handler runs unchanged.

    Registered after the pipeline CLI (oscar/__main__.py order), so the pipeline never imports
    the cluster stage.
    """
    if p is None:
        return
    g = p.add_argument_group("distributed (Ray)")
    add_ray(g)
    add_stages(g, "stage actors per replica (layer ranges; default 1 with --ray)")
    g.add_argument("--replicas", type=positive_int, default=None, help="pipeline replicas splitting the blocks (default 1 with --ray)")
    g.add_argument("--stage-layers", default=None, metavar="A:B,B:C",
                   help="explicit layer ranges (default: balanced by parameter count)")
    g.add_argument("--cpus-per-stage", type=nonneg_float, default=1.0, help="Ray CPUs reserved per stage actor")
    g.add_argument("--gpus-per-stage", type=nonneg_float, default=0.0, help="Ray GPUs reserved per stage actor")
    g.add_argument("--memory-per-stage", type=positive_float, default=None, metavar="GiB",
                   help="host memory reserved per stage actor (Ray `memory` resource; default: none reserved)")
    g.add_argument("--stage-resources", default=None, metavar="JSON",
                   help='custom Ray resources per stage actor: {"res": 1} for every stage, or a list with one '
                        'dict per stage, e.g. \'[{}, {"bigmem": 1}]\' (default: none)')
    g.add_argument("--max-restarts", type=int, default=4, help="restarts per stage actor")
    single = p.get_default("func")
    p.set_defaults(func=lambda args: calibrate_dispatch(args, single))


def _without_ray(args, flags: tuple[str, ...]) -> bool:
    """True when `--ray` is not given (the single-process handler runs); then none of `flags` may be."""
    if getattr(args, "ray", None) is not None:
        return False
    if any(getattr(args, f, None) for f in flags):
        raise OscarError(f"{'/'.join('--' + f for f in flags)} need{'s' if len(flags) == 1 else ''} --ray ADDRESS|auto")
    return True


def calibrate_dispatch(args, single) -> int:
    if _without_ray(args, ("stages", "replicas")):
        return single(args)
    # late: keeps torch (2.1 s) out of `oscar --help`
    from oscar.cluster.pipeline import calibrate_on_ray, cluster_config_from_args, format_report

    cfg = calib_config(args)
    rep = calibrate_on_ray(cfg, cluster_config_from_args(args), address=args.ray,
                           progress=not getattr(args, "no_progress", False))
    if getattr(args, "json", False):
        print(json.dumps(rep.to_dict(), indent=1))
    else:
        print(format_report(rep))
    return 0


def add_staged_validation(v: argparse.ArgumentParser | None) -> None:
    """`oscar validate ppl|niah --ray ADDRESS|auto --stages N`: windows scored, needle batches prefilled and decoded
    by stage actors holding the layer ranges calibration uses (cluster/scoring.py); without --ray the
    single-process handler runs unchanged. Registered after the validate CLI, so validate never imports the
    cluster stage."""
    if v is None:
        return
    vs = next(a for a in v._actions if isinstance(a, argparse._SubParsersAction))
    for name, dispatch in (("ppl", ppl_dispatch), ("niah", niah_dispatch)):
        p = vs.choices[name]
        g = p.add_argument_group("pipeline stages (Ray)")
        add_ray(g)
        add_stages(g, "stage actors (layer ranges balanced by parameters; default 1 with --ray); the last also holds "
                      "the final norm and the LM head")
        g.add_argument("--cpus-per-stage", type=nonneg_float, default=1.0, help="Ray CPUs reserved per stage actor")
        g.add_argument("--gpus-per-stage", type=nonneg_float, default=None,
                       help="Ray GPUs per stage actor with --device cuda (default 1; fractions share a GPU)")
        single = p.get_default("func")
        p.set_defaults(func=lambda args, single=single, dispatch=dispatch: dispatch(args, single))


def _staged(args, cfg):
    """The stage actors for a validation run described by `args` (the CLI's) and `cfg` (its config)."""
    cuda = args.device != "cpu"
    gpus = args.gpus_per_stage if args.gpus_per_stage is not None else float(cuda)
    if cuda != (gpus > 0) or args.device not in ("cpu", "cuda"):
        raise OscarError(f"--ray --device {args.device} --gpus-per-stage {gpus:g}: stage actors on GPUs take "
                         "--device cuda (each sees the GPU Ray gives it) with --gpus-per-stage > 0; on CPU, none")
    # late: keeps torch (2.1 s) out of `oscar --help`
    from oscar.cluster.pipeline import ClusterConfig
    from oscar.cluster.scoring import StagedScorer

    cc = ClusterConfig(stages=args.stages or 1, cpus_per_stage=args.cpus_per_stage, gpus_per_stage=gpus,
                       dtype=cfg.dtype)
    return StagedScorer(cfg.model, cc, address=args.ray)


def niah_dispatch(args, single) -> int:
    # late: keeps torch (2.1 s) out of `oscar --help`
    from oscar.validate import cli as vcli
    from oscar.validate.niah import run_niah

    return _dispatch(args, single, vcli.niah_config, lambda cfg, sc: run_niah(cfg, progress=not args.no_progress,
                                                                            stages=sc), vcli.niah_table)


def ppl_dispatch(args, single) -> int:
    # late: keeps torch (2.1 s) out of `oscar --help`
    from oscar.validate.cli import ppl_config
    from oscar.validate.ppl import run_ppl

    return _dispatch(args, single, ppl_config, lambda cfg, sc: run_ppl(cfg, progress=not args.no_progress, scorer=sc),
                     lambda df: df.round(3).to_string(index=False))


def _dispatch(args, single, config, run, table) -> int:
    """The single-process handler without --ray; else `run(config(args), stages)` on the stage actors, its table
    printed."""
    if _without_ray(args, ("stages",)):
        return single(args)
    cfg = config(args)
    with _staged(args, cfg) as sc:
        print(table(run(cfg, sc)))
    return 0
