"""The artifact's format names and its one header reader (the JSON under the safetensors key ``oscar``).

A leaf (json + safetensors, no torch, no stage): `oscar.stats.artifact` loads and writes artifacts
through it, and the calibration report reads headers with it without importing a stage.
"""

from __future__ import annotations

import json
from typing import Any

import safetensors

from oscar.common import OscarError

ARTIFACT_FORMAT = "oscar-artifact/1"
# /2 = /1 + rot_q. Written only by artifacts that have rot_q, so a /1 reader refuses them instead of
# reading queries with rot_k (wrong logits); orthogonal artifacts stay /1.
ARTIFACT_FORMAT_Q = "oscar-artifact/2"
# /3 = /2 + a per-layer format (metadata `layer_quant`, rot_q when the key transform is scaled): an older reader
# would store every layer in the base format, so it must refuse them
ARTIFACT_FORMAT_L = "oscar-artifact/3"
READS = (ARTIFACT_FORMAT, ARTIFACT_FORMAT_Q, ARTIFACT_FORMAT_L)
# An MLA model's artifact: one r x r rotation per layer for the latent c_kv, its mean and per-group clips
# (oscar.stats.artifact.LatentArtifact); per-head readers refuse it by name, latent readers read only it
ARTIFACT_FORMAT_LATENT = "oscar-latent-artifact/1"


def _header(path: str) -> dict[str, Any] | None:
    """The JSON under the safetensors header key `oscar` (None: the file has none)."""
    try:
        with safetensors.safe_open(path, "pt") as f:
            raw = (f.metadata() or {}).get("oscar")
    except Exception as e:  # safetensors raises its own error types
        raise OscarError(f"{path}: not a readable safetensors artifact ({e})") from e
    return None if raw is None else json.loads(raw)


def read_metadata(path: str) -> dict[str, Any]:
    """The artifact's metadata dict; OscarError for a file that is not an oscar artifact this version reads."""
    meta = _header(path)
    if meta is None:
        raise OscarError(f"{path}: safetensors file has no 'oscar' metadata; not an oscar artifact")
    if meta.get("format") == ARTIFACT_FORMAT_LATENT:
        raise OscarError(f"{path} is a latent (MLA) artifact ({ARTIFACT_FORMAT_LATENT}, model "
                         f"{(meta.get('model') or {}).get('name')!r}): it rotates the latent c_kv, not per-head K/V")
    if meta.get("format") not in READS:
        raise OscarError(f"{path}: artifact format {meta.get('format')!r}, this version reads {' and '.join(map(repr, READS))}")
    return meta


def read_latent_metadata(path: str) -> dict[str, Any]:
    """A latent artifact's metadata; OscarError for any other file (a per-head artifact named as such)."""
    meta = _header(path) or {}
    if meta.get("format") in READS:
        raise OscarError(f"{path} is a per-head artifact ({meta['format']}): a latent (MLA) cache needs "
                         f"{ARTIFACT_FORMAT_LATENT}")
    if meta.get("format") != ARTIFACT_FORMAT_LATENT:
        raise OscarError(f"{path}: artifact format {meta.get('format')!r}, a latent artifact is "
                         f"{ARTIFACT_FORMAT_LATENT!r}")
    return meta
