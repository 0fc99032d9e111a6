"""oscar-kv: attention-aware rotations for 2-bit KV caches.

The stages are subpackages: oscar.pipeline (calibrate: model loading, attention capture, the zarr block store),
oscar.stats (fit: reductions, eigendecompositions, rotations, clipping, the recipe, the artifact), oscar.kernels
(serve path: INT2 cache layout, torch references, Triton and CPU kernels), oscar.validate (NIAH/RULER,
perplexity, attention-level checks; the synthetic ablation in oscar.validate.ablation), oscar.cluster (Ray stage
actors, placement, jobs) and oscar.reports (Markdown/HTML reports from result files).

In a source checkout the stage folders sit beside this one (the design card's layout) and hold no __init__.py:
a folder without one is at most a namespace portion, which never shadows an installed package of the same name
(Hugging Face's `kernels`, PyPI's `pipeline`, `validate`, ...) from any working directory. `_StageFinder` maps
`oscar.<stage>` onto them; an installed wheel has them under oscar/ and needs no finder.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys

__version__ = "0.1.0"

STAGES = ("pipeline", "stats", "kernels", "validate", "cluster", "reports")


class _StageFinder:
    """Meta-path finder for `oscar.<stage>` -> <checkout>/<stage>/ as a namespace package (no loader, one path)."""

    def __init__(self, dirs: dict[str, str]):
        self.dirs = dirs

    def find_spec(self, fullname: str, path=None, target=None):
        d = self.dirs.get(fullname)
        if d is None:
            return None
        spec = importlib.machinery.ModuleSpec(fullname, None, is_package=True)
        spec.submodule_search_locations = [d]
        return spec


def _install_stage_finder() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    dirs = {f"{__name__}.{s}": os.path.join(root, s) for s in STAGES
            if not os.path.isdir(os.path.join(here, s)) and os.path.isdir(os.path.join(root, s))}
    if dirs and not any(isinstance(f, _StageFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _StageFinder(dirs))


_install_stage_finder()
