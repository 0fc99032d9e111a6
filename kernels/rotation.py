"""One layer's rotation of the INT2 cache: rotations, key mean and clips, as every backend reads them.

`LayerRotation` is the one representation of a layer's rotation: the paged cache (kernels/paged.py) rotates and
un-rotates with it, the simulators (kernels/simulate.py `LayerQuant`, and through it kernels/rowbatch.py) read the
same tensors.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from oscar.common import OscarError
from oscar.stats.artifact import Artifact


@dataclass
class LayerRotation:
    """One layer's rotations, key mean and clips (from an `Artifact` or identity).

    rot_k, rot_v: (Hkv, D, D) float32, x_rot = x @ R. k_mean: (Hkv, D) or None.
    rot_q: (Hkv, D, D) the query transform, rot_k^{-T}; defaults to rot_k (orthogonal). Queries are
    read as q @ rot_q and stored keys un-rotated with rot_qᵀ, so both paths hold for a scaled rot_k.
    clip_k, clip_v: (Hkv,) or (Hkv, D); ratios in minmax mode, absolute thresholds in static mode.
    """

    rot_k: torch.Tensor
    rot_v: torch.Tensor
    clip_k: torch.Tensor
    clip_v: torch.Tensor
    k_mean: torch.Tensor | None = None
    rot_q: torch.Tensor | None = None
    identity: bool = field(init=False)  # no rotation and no centering: skip the matmuls (exact)

    def __post_init__(self):
        f = lambda t: None if t is None else t.to(torch.float32).contiguous()  # noqa: E731  kernels assume row-major
        self.rot_k, self.rot_v, self.clip_k, self.clip_v, self.k_mean, self.rot_q = map(
            f, (self.rot_k, self.rot_v, self.clip_k, self.clip_v, self.k_mean, self.rot_q))
        if self.rot_q is None:
            self.rot_q = self.rot_k
        elif self.rot_q.shape != self.rot_k.shape:
            raise OscarError(f"rot_q shape {tuple(self.rot_q.shape)} differs from rot_k's {tuple(self.rot_k.shape)}")
        H, D, _ = self.rot_k.shape
        eye = torch.eye(D, device=self.rot_k.device).expand(H, D, D)
        self.identity = bool(torch.equal(self.rot_k.float(), eye) and torch.equal(self.rot_v.float(), eye)
                             and torch.equal(self.rot_q, eye) and self.k_mean is None)

    @classmethod
    def from_artifact(cls, art: Artifact, layer: int, device: str | torch.device = "cpu") -> "LayerRotation":
        f = lambda t: None if t is None else t.to(device=device, dtype=torch.float32).contiguous()  # noqa: E731
        return cls(rot_k=f(art.rot_k[layer]), rot_v=f(art.rot_v[layer]), clip_k=f(art.clip_k[layer]),
                   clip_v=f(art.clip_v[layer]), k_mean=f(art.k_mean[layer]) if art.k_mean is not None else None,
                   rot_q=f(art.rot_q[layer]) if art.rot_q is not None else None)

    @classmethod
    def identity_for(cls, num_kv_heads: int, head_dim: int, clip: float = 1.0, device="cpu") -> "LayerRotation":
        eye = torch.eye(head_dim, device=device).expand(num_kv_heads, head_dim, head_dim).contiguous()
        c = torch.full((num_kv_heads,), clip, device=device)
        return cls(rot_k=eye, rot_v=eye.clone(), clip_k=c, clip_v=c.clone())

    def rotate_k(self, k: torch.Tensor) -> torch.Tensor:
        """(..., Hkv, T, D) -> (k - mu) @ R_K in float32."""
        if self.identity:
            return k.float()
        kf = k.float()
        if self.k_mean is not None:
            kf = kf - self.k_mean.unsqueeze(-2)  # (Hkv, 1, D)
        return kf @ self.rot_k

    def rotate_v(self, v: torch.Tensor) -> torch.Tensor:
        return v.float() if self.identity else v.float() @ self.rot_v

    def unrotate_k(self, k_rot: torch.Tensor) -> torch.Tensor:
        if self.identity:
            return k_rot.float()
        k = k_rot.float() @ self.rot_q.transpose(-1, -2)  # rot_k^{-1} = rot_qᵀ
        return k + self.k_mean.unsqueeze(-2) if self.k_mean is not None else k

    def unrotate_v(self, v_rot: torch.Tensor) -> torch.Tensor:
        return v_rot.float() if self.identity else v_rot.float() @ self.rot_v.transpose(-1, -2)

    def to(self, device: str | torch.device) -> "LayerRotation":
        """The same rotation with every tensor on `device` (nothing recomputed: `identity` is kept)."""
        out = copy.copy(self)
        for name in ("rot_k", "rot_v", "clip_k", "clip_v", "k_mean", "rot_q"):
            t = getattr(self, name)
            if t is not None:
                setattr(out, name, t.to(device))
        return out
