"""Ray job entrypoint: `python -m oscar.cluster.entrypoint [CONFIG]`.

Runs inside a Ray job (the driver process on the head node; `ray.init("auto")` attaches
to the job's cluster). The job config comes from $OSCAR_JOB_CONFIG (JSON, set by
`oscar submit` through the runtime environment) or from a YAML/JSON file argument.
Re-running it on the same store resumes: done blocks are skipped. (A `run:` config, a whole
validation run, has its own entrypoint: `python -m oscar.run`, oscar/run.py's `job_main`.)
"""

from __future__ import annotations

import json
import os
import sys

from oscar.cluster.jobs import driver_config
from oscar.cluster.pipeline import ClusterConfig, calibrate_on_ray, format_report
from oscar.common import OscarError
from oscar.pipeline.calibrate import CalibConfig


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = driver_config(argv)
        rep = calibrate_on_ray(CalibConfig(**cfg["calibrate"]), ClusterConfig(**cfg["cluster"]),
                               address=os.environ.get("RAY_ADDRESS") or "auto", progress=True)
    except OscarError as e:
        print(f"oscar job: error: {e}", file=sys.stderr)
        return 2
    print(format_report(rep))
    print("OSCAR_REPORT " + json.dumps({k: v for k, v in rep.to_dict().items() if k != "stage_stats"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
