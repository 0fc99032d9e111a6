"""Which tokens a cache keeps exact: the type every backend of the cache family is built with (kernels/backends.py).

The named protocols methods are scored and validated under (strict, serving, ...) are scoring's
(oscar/scoring/protocols.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from oscar.defaults import SINK


@dataclass(frozen=True)
class Protocol:
    """Which tokens the cache keeps exact: the first `sink` and the last `recent` (docs/validation.md lists the named ones).

    pages: per-token K/V leave the exact window in whole pages of the artifact's `page_size`, as the
    paged cache stores them (< 1 page stays exact beyond `recent`); False: one token at a time, a
    stricter reading than any cache runs (`strict-token`, a diagnostic). Per-channel key groups are
    always released whole (an incomplete group cannot be quantized).
    """

    name: str
    sink: int = SINK
    recent: int = 0
    pages: bool = True
