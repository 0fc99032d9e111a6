"""docs/cluster.md's local-cluster recipe, run as written (its bash block) on 127.0.0.1.

It must submit, finish and verify the store, and stop only the Ray it started: afterwards no
process of that cluster (its private temp dir) is left, and Rays of other users are untouched.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def recipe() -> str:
    text = (ROOT / "docs" / "cluster.md").read_text()
    sec = text[text.index("## Local testing"):]
    return re.search(r"```bash\n(.*?)```", sec, re.S).group(1)


def _procs_with(fragment: str) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if fragment in Path(f"/proc/{d}/cmdline").read_bytes().decode(errors="replace"):
                    out.append(int(d))
            except OSError:
                pass
    return out


@pytest.mark.slow
@pytest.mark.ray
def test_local_cluster_recipe_runs_as_written(tmp_path):
    from oscar.cluster.localray import free_port

    if not (ROOT / ".venv" / "bin" / "activate").exists():
        pytest.skip("needs the repository's .venv (bash scripts/setup.sh)")
    shutil.rmtree(ROOT / "runs" / "calib-local.zarr", ignore_errors=True)
    script = "set -e\n" + recipe() + '\necho "RAYDIR=$RAYDIR"\n'
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["DASH"] = str(free_port())  # the documented default 8265 may be taken on a shared machine
    p = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "all intact" in p.stdout and "SUCCEEDED" in p.stdout + p.stderr, p.stdout[-2000:]
    raydir = re.search(r"RAYDIR=(\S+)", p.stdout).group(1)
    assert _procs_with(raydir) == []  # the cluster it started is gone, nothing else was signalled
    shutil.rmtree(raydir, ignore_errors=True)
    shutil.rmtree(ROOT / "runs" / "calib-local.zarr", ignore_errors=True)
