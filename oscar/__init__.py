"""oscar-kv: attention-aware rotations for 2-bit KV caches.

Stages live in oscar.pipeline (calibrate), oscar.stats (fit), oscar.kernels
(serve path), oscar.validate, oscar.cluster (Ray) and oscar.reports.
"""

__version__ = "0.1.0"
