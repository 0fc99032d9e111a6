"""The named protocols methods are scored under: which tokens stay exact (the first `sink`, the last `recent`).

The type is the cache family's (`Protocol`, kernels/); the names are scoring's, read alike by the recipe (the
tune's strict NLL, the widths' serving copy probe) and by validation (docs/validation.md lists them).
"""

from __future__ import annotations

from oscar.defaults import RECENT, SINK
from oscar.kernels.protocol import Protocol

# Bumped whenever a protocol's meaning changes, so stored results of the old meaning are not resumed
# into new tables (NIAH/perplexity identities, `oscar run` stage fingerprints). 2: per-token K/V leave
# the exact window in whole pages (was: one token at a time).
PROTOCOL_VERSION = 2
STRICT = Protocol("strict", sink=SINK, recent=0)
SERVING = Protocol("serving", sink=SINK, recent=RECENT)
STRICT_TOKEN = Protocol("strict-token", sink=SINK, recent=0, pages=False)
PROTOCOLS = {p.name: p for p in (STRICT, SERVING, STRICT_TOKEN)}
