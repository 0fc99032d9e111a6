"""CLI of the cluster stage: `oscar plan`, `oscar submit`, `oscar status`.

Handlers parse arguments and call importable functions; Ray is imported lazily.
The Ray flags of `oscar calibrate` (--ray/--stages/--replicas) are added by
`add_ray_arguments` and dispatched by `maybe_run_on_ray` (see cluster/pipeline.py).
"""

from __future__ import annotations

import argparse
import json


def register(sub: argparse._SubParsersAction) -> None:
    add_ray_arguments(sub.choices.get("calibrate"))
    p = sub.add_parser("plan", help="plan a pipeline: memory per stage, activations, store size, stage count")
    p.add_argument("--model", required=True, help="config.json, model directory, shipped config (glm-4.7) or preset")
    p.add_argument("--stages", type=int, required=True)
    p.add_argument("--gpus-per-stage", type=int, default=1)
    p.add_argument("--gpu-mem", type=float, default=None, metavar="GiB", help="GPU memory, to suggest a stage count")
    p.add_argument("--layers", default=None, help="explicit ranges START:STOP,... (default: balanced by parameters)")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--seqs-per-block", type=int, default=8)
    p.add_argument("--blocks", type=int, default=64)
    p.add_argument("--reservoir", type=int, default=256)
    p.add_argument("--dtype", default=None, help="weight/activation dtype (default: the config's)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_plan)

    s = sub.add_parser("submit", help="submit a calibration as a Ray job (resubmitting resumes)")
    s.add_argument("config", help="job config (YAML/JSON): calibrate options + cluster section")
    s.add_argument("--address", default=None, help="Ray dashboard address, e.g. http://127.0.0.1:8265 "
                   "(default: $RAY_ADDRESS)")
    s.add_argument("--wait", action="store_true", help="poll until the job ends; exit 0 only on SUCCEEDED")
    s.add_argument("--timeout", type=float, default=None, help="with --wait: give up after this many seconds")
    s.set_defaults(func=_submit)

    t = sub.add_parser("status", help="blocks done per stage of a (running) calibration store")
    t.add_argument("store")
    t.add_argument("--address", default=None, help="also show the Ray job's status (dashboard address)")
    t.add_argument("--json", action="store_true")
    t.set_defaults(func=_status)


def _plan(args) -> int:
    from oscar.cluster.plan import format_plan, load_model_config, make_plan

    cfg = load_model_config(args.model)
    plan = make_plan(cfg, stages=args.stages, gpus_per_stage=args.gpus_per_stage, gpu_mem_gib=args.gpu_mem,
                     seq_len=args.seq_len, micro_batch=args.micro_batch, seqs_per_block=args.seqs_per_block,
                     num_blocks=args.blocks, reservoir=args.reservoir, dtype=args.dtype, layers=args.layers,
                     name=args.model)
    print(json.dumps(plan.to_dict(), indent=1) if args.json else format_plan(plan))
    return 0


def _submit(args) -> int:
    from oscar.cluster.jobs import submit

    return submit(args.config, address=args.address, wait=args.wait, timeout=args.timeout)


def _status(args) -> int:
    from oscar.cluster.jobs import format_status, store_status

    st = store_status(args.store, address=args.address)
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
    g.add_argument("--ray", metavar="ADDRESS", default=None,
                   help="run on a Ray cluster: ADDRESS (ray://..., host:port) or auto ($RAY_ADDRESS, a running "
                        "local cluster, else start one on 127.0.0.1)")
    g.add_argument("--stages", type=int, default=None, help="stage actors per replica (layer ranges)")
    g.add_argument("--replicas", type=int, default=None, help="pipeline replicas splitting the blocks")
    g.add_argument("--stage-layers", default=None, metavar="A:B,B:C",
                   help="explicit layer ranges (default: balanced by parameter count)")
    g.add_argument("--cpus-per-stage", type=float, default=1.0)
    g.add_argument("--gpus-per-stage", type=float, default=0.0)
    g.add_argument("--memory-per-stage", type=float, default=None, metavar="GiB")
    g.add_argument("--stage-resources", default=None, metavar="JSON",
                   help='custom Ray resources per stage actor: {"res": 1} for every stage, or a list with one '
                        'dict per stage, e.g. \'[{}, {"bigmem": 1}]\'')
    g.add_argument("--max-restarts", type=int, default=4, help="restarts per stage actor")
    single = p.get_default("func")
    p.set_defaults(func=lambda args: calibrate_dispatch(args, single))


def calibrate_dispatch(args, single) -> int:
    from oscar.common import OscarError

    if getattr(args, "ray", None) is None:
        if getattr(args, "stages", None) or getattr(args, "replicas", None):
            raise OscarError("--stages/--replicas need --ray ADDRESS|auto")
        return single(args)
    from oscar.cluster.pipeline import calibrate_on_ray, cluster_config_from_args, format_report
    from oscar.pipeline.calibrate import CalibConfig

    cfg = calib_config_from_args(CalibConfig, args)
    rep = calibrate_on_ray(cfg, cluster_config_from_args(args), address=args.ray,
                           progress=not getattr(args, "no_progress", False))
    if getattr(args, "json", False):
        print(json.dumps(rep.to_dict(), indent=1))
    else:
        print(format_report(rep))
    return 0


def calib_config_from_args(cls, args):
    """The pipeline's CalibConfig from parsed `calibrate` arguments (fields matched by name)."""
    import dataclasses

    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if f.init and hasattr(args, f.name)}
    return cls(**kw)
