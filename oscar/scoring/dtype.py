"""The dtype the model computes in while it is scored (the recipe's float64 objectives, validation's float32)."""

from __future__ import annotations

import torch

from oscar.common import OscarError
from oscar.host import compute_dtype

DTYPES = ("float32", "bfloat16", "auto", "float64")  # float64: the recipe's objectives (oscar/recipe/tune.py)


def with_dtype(model, dtype: str = "float32"):
    """The model computing in `dtype` (in place); "auto": the host's fast dtype for the model's device
    (oscar.host.compute_dtype: float32 on CPUs without native bfloat16). `bfloat16` changes every activation's
    rounding, so its results are not comparable digit for digit with float32 runs."""
    if dtype not in DTYPES:
        raise OscarError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
    dt = getattr(torch, compute_dtype(dtype, str(next(model.parameters()).device)) if dtype == "auto" else dtype)
    if next(model.parameters()).dtype != dt:
        model.to(dt)
    return model
