"""The simulate and batch backends of the cache family: fake-quant K/V, exact attention over them.

`LayerQuant` fake-quantizes one layer's K/V exactly as the INT2 cache stores them: rotate (keys
centred by the artifact's key mean first), quantize/dequantize with `oscar.quant` under the
artifact's QuantSpec and clips, rotate back. Since the rotations are orthogonal, attention over the
un-rotated dequantized K/V equals the kernel's attention in the rotated space (q R_K)·(k̂ R_K) up to
float rounding. On it:

    SimQuantCache     one method's cache (sink and recent window kept exact): backend "simulate"
    MethodBatchCache  several methods over one prompt, one method per batch row: backend "batch"

(kernels/rowbatch.py holds the "rows" backend; kernels/backends.py `make_cache` builds any of them or the
paged OscarCache, kernels/cache.py.) Which tokens stay exact is a `Protocol`; the named
protocols methods are scored under (strict, serving, ...) are scoring's (oscar/scoring/protocols.py).

Codebook formats (Lloyd-Max codes instead of the uniform grid: tq-int2, sq-int2, validate/codebooks.py) and the
recipe's per-layer widths (oscar/scoring/layer_formats.py) reach LayerQuant through `register_codec`: the
artifact's meta["codec"]["kind"] names the reader, so kernels import nothing above them.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from oscar.common import OscarError
from oscar.kernels.protocol import Protocol
from oscar.kernels.rotation import LayerRotation
from oscar.quant import QuantSpec, fake_quant, fake_quant_parts
from oscar.stats.artifact import Artifact


def _acc(x: torch.Tensor) -> torch.dtype:
    """The simulator's arithmetic for activations x: float32, or float64 when the model computes in float64."""
    return torch.promote_types(x.dtype, torch.float32)


# ----------------------------------------------------------------- codebook formats

# meta["codec"]["kind"] -> reader(art, layer) -> (key codec, value codec, value mean (1, Hkv, 1, D) or None);
# a codec is a callable on rotated rows (B, Hkv, T, D) returning their round trip
CodecReader = Callable[[Artifact, int], "tuple[Callable, Callable, torch.Tensor | None] | None"]
CODECS: dict[str, CodecReader] = {}


def register_codec(kind: str, reader: CodecReader) -> None:
    CODECS[kind] = reader


def register_codecs(readers: dict[str, CodecReader]) -> None:
    """Register every reader of `readers` (another process's CODECS: a pipeline stage reads what its driver
    registered, cluster/scoring.py)."""
    CODECS.update(readers)


def layer_codecs(art: Artifact, layer: int):
    """The codebook reader's (key codec, value codec, value mean) of layer `layer`; None for the uniform grid."""
    c = art.meta.get("codec")
    if not c:
        return None
    reader = CODECS.get(c.get("kind"))
    if reader is None:
        raise OscarError(f"artifact codec {c.get('kind')!r} has no registered reader (known: {', '.join(CODECS) or 'none'}; "
                         f"validate/codebooks.py registers tq and sq, oscar/scoring/layer_formats.py layers, when imported)")
    return reader(art, layer)


# ----------------------------------------------------------------- fake-quant of one layer


def _clip_view(c: torch.Tensor, spec: QuantSpec, D: int) -> torch.Tensor:
    """Broadcast an artifact clip (Hkv,) or (Hkv, D) onto the grouped layout (B, Hkv, rows, groups)."""
    if c.dim() == 1:
        return c.view(-1, 1, 1)
    if spec.mode == "static" and spec.axis == "token":  # per-channel thresholds: the static spec groups one channel
        return c.view(c.shape[0], 1, D)
    raise OscarError(f"per-channel clip with {spec.mode}/{spec.axis} quantization is not supported by the simulator")


class LayerQuant:
    """Fake-quantization of one layer's K/V (B, Hkv, T, D) as the INT2 cache stores them."""

    def __init__(self, art: Artifact, layer: int, pages: bool = True):
        D = art.head_dim
        # the layer's rotations, key mean and clips as the paged cache holds them (kernels/rotation.py)
        self.rot = LayerRotation.from_artifact(art, layer)
        q = art.quant_for(layer)  # per-layer widths (Artifact.layer_quant): this layer's own format
        self.kspec, self.vspec = q.key_spec(D), q.value_spec(D)
        flush = q.page_size if pages else 1  # whole pages leave the exact window (Protocol.pages)
        self.key_group = self.kspec.group_size if self.kspec.axis == "channel" else flush  # tokens quantized together
        # codebook formats (tq-int2, sq-int2, per-layer widths: register_codec) replace the uniform grid, per token
        cb = layer_codecs(art, layer)
        self.codec_k, self.codec_v, self.v_mean = cb if cb else (None, None, None)
        self.kparts = q.key_parts(D)  # split keys (QuantConfig.key_split): a per-token group per part
        if cb:  # the codec reads its own clips
            self.key_group = flush
            self.clip_k = self.clip_v = None
        elif self.kparts:
            self.clip_k = self.rot.clip_k.reshape(art.num_kv_heads, -1)  # (Hkv, parts): a ratio per head and part
            self.clip_v = _clip_view(self.rot.clip_v, self.vspec, D)
        else:
            self.clip_k = _clip_view(self.rot.clip_k, self.kspec, D)
            self.clip_v = _clip_view(self.rot.clip_v, self.vspec, D)
        # Identity rotations (naive-int2, kivi2) skip their matmuls: x @ I == x exactly in float32.
        eye = torch.eye(D)
        self.k_eye = bool((self.rot.rot_k == eye).all() and (self.rot.rot_q == eye).all())
        self.v_eye = bool((self.rot.rot_v == eye).all())
        self.device = torch.device("cpu")

    def _on(self, dev: torch.device) -> None:
        """Every tensor this layer's fake-quantization reads on `dev` (once per device: a model on a GPU)."""
        if dev == self.device:
            return
        self.rot = self.rot.to(dev)
        for name in ("clip_k", "clip_v", "v_mean"):
            t = getattr(self, name)
            if isinstance(t, torch.Tensor):
                setattr(self, name, t.to(dev))
        for name in ("codec_k", "codec_v"):
            c = getattr(self, name)
            if c is not None:
                setattr(self, name, dataclasses.replace(c, **{f.name: getattr(c, f.name).to(dev) for f in dataclasses.fields(c)
                                                             if isinstance(getattr(c, f.name), torch.Tensor)}))
        self.device = dev

    def keys(self, k: torch.Tensor) -> torch.Tensor:
        """k (B, Hkv, T, D) -> dequantized k̂, same shape; T a multiple of key_group."""
        self._on(k.device)
        x = k.to(_acc(k))  # float32; float64 for a float64 model (the tune: no float32 rounding to flip a code)
        mu = self.rot.k_mean[None, :, None, :] if self.rot.k_mean is not None else None  # (1, Hkv, 1, D)
        if mu is not None:
            x = x - mu.to(x.dtype)
        xr = x if self.k_eye else x @ self.rot.rot_k.to(x.dtype)  # (B, Hkv, T, D)
        if self.codec_k:
            xq = self.codec_k(xr)
        elif self.kparts:  # split keys: part j under its clip ratio per head (stats/split.py split_fake_quant)
            xq = fake_quant_parts(xr, self.kparts, [self.clip_k[:, j].view(-1, 1, 1) for j in range(len(self.kparts))])
        else:
            xq = fake_quant(xr, self.kspec, self.clip_k)
        xq = xq.to(x.dtype)  # the codes are float32 arithmetic on float64-exact inputs: the same on every host
        if not self.k_eye:  # rot_k^{-1} = rot_qᵀ (= rot_kᵀ when orthogonal): back to the model's space
            xq = xq @ self.rot.rot_q.transpose(-1, -2).to(x.dtype)
        if mu is not None:
            xq = xq + mu.to(x.dtype)
        return xq.to(k.dtype)

    def values(self, v: torch.Tensor) -> torch.Tensor:
        self._on(v.device)
        x = v.to(_acc(v))
        if self.v_mean is not None:
            x = x - self.v_mean.to(x.dtype)
        vr = x if self.v_eye else x @ self.rot.rot_v.to(x.dtype)  # (B, Hkv, T, D)
        xq = (self.codec_v(vr) if self.codec_v else fake_quant(vr, self.vspec, self.clip_v)).to(x.dtype)
        if not self.v_eye:
            xq = xq @ self.rot.rot_v.to(x.dtype).transpose(-1, -2)
        if self.v_mean is not None:
            xq = xq + self.v_mean.to(x.dtype)
        return xq.to(v.dtype)

    def quantized_until(self, T: int, sink: int, recent: int) -> int:
        """Tokens [sink, b) are stored quantized once T tokens are written (keys quantize in whole groups)."""
        b = T - recent
        if b <= sink:
            return sink
        g = self.key_group
        return sink + (b - sink) // g * g


# ----------------------------------------------------------------- the cache


class SimQuantLayer(DynamicLayer):
    """A cache layer holding K/V with [sink, T - recent) fake-quantized; a new chunk attends to itself exactly."""

    def __init__(self, lq: LayerQuant, protocol: Protocol):
        super().__init__()
        self.lq, self.sink, self.recent = lq, protocol.sink, protocol.recent
        self.n_quant = protocol.sink  # [sink, n_quant) already quantized

    def _commit(self) -> None:
        T = self.keys.shape[-2]
        b = self.lq.quantized_until(T, self.sink, self.recent)
        a = self.n_quant
        if b > a:  # new tensors, never in place: the caller still holds the returned ones
            k, v = self.keys, self.values
            self.keys = torch.cat([k[..., :a, :], self.lq.keys(k[..., a:b, :]), k[..., b:, :]], dim=-2)
            self.values = torch.cat([v[..., :a, :], self.lq.values(v[..., a:b, :]), v[..., b:, :]], dim=-2)
            self.n_quant = b

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        out = (self.keys, self.values)
        self._commit()
        return out

    def load(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Take over a prefilled exact cache: the same as that chunk passing through update()."""
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values
        self._commit()


class SimQuantCache(Cache):
    def __init__(self, art: Artifact, protocol: Protocol):
        super().__init__(layers=[SimQuantLayer(LayerQuant(art, l, protocol.pages), protocol) for l in range(art.num_layers)])

    @classmethod
    def from_prefill(cls, art: Artifact, protocol: Protocol, exact: DynamicCache) -> "SimQuantCache":
        c = cls(art, protocol)
        for layer, src in zip(c.layers, exact.layers):
            layer.load(src.keys, src.values)
        return c


class BatchQuantLayer(DynamicLayer):
    """One layer of several methods decoding the same prompt, one method per batch row.

    Row r holds exactly what `SimQuantLayer` holds for its method: [sink, n_quant[r]) fake-quantized,
    the rest exact. K/V live in preallocated buffers (R, Hkv, capacity, D) written in place, so a
    decode step costs one token, not a copy of the whole history. The flush owed by a step is
    applied at the start of the next update (the attention of that step has read the cache by
    then), which is what SimQuantLayer's commit-after-append returns to its next caller.
    """

    def __init__(self, lqs: list[LayerQuant | None], protocol: Protocol):
        super().__init__()
        self.lqs, self.sink, self.recent = lqs, protocol.sink, protocol.recent
        self.n = 0
        self.n_quant = [protocol.sink] * len(lqs)
        self.pre: list[tuple[int, torch.Tensor, torch.Tensor] | None] = [None] * len(lqs)  # (start, k̂, v̂) ahead of the flush

    def _alloc(self, like: torch.Tensor, capacity: int) -> None:
        R = len(self.lqs)
        _, H, _, D = like.shape
        self.kbuf = like.new_empty(R, H, capacity, D)  # (R, Hkv, cap, D)
        self.vbuf = like.new_empty(R, H, capacity, D)
        self.dtype, self.device, self.is_initialized = like.dtype, like.device, True

    def load(self, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> None:
        """Take over an exact prefill (1, Hkv, T, D) for every row, as that chunk passing through update().

        Each row quantizes all its complete groups now, in one call: the part the protocol already
        stores quantized is written, the rest (the recent window) is kept to be flushed later,
        token for token the values a later flush would compute (groups are independent).
        """
        T = keys.shape[-2]
        self._alloc(keys, max(capacity, T))
        self.kbuf[:, :, :T] = keys[0]
        self.vbuf[:, :, :T] = values[0]
        self.n = T
        for r, lq in enumerate(self.lqs):
            if lq is None:
                continue
            b_all = lq.quantized_until(T, self.sink, 0)
            b = lq.quantized_until(T, self.sink, self.recent)
            if b_all > self.sink:
                kq = lq.keys(keys[..., self.sink:b_all, :])[0]  # (Hkv, b_all - sink, D)
                vq = lq.values(values[..., self.sink:b_all, :])[0]
                self.kbuf[r, :, self.sink:b] = kq[:, :b - self.sink]
                self.vbuf[r, :, self.sink:b] = vq[:, :b - self.sink]
                if b_all > b:
                    self.pre[r] = (b, kq[:, b - self.sink:], vq[:, b - self.sink:])
            self.n_quant[r] = b
        self._view()

    def _view(self) -> None:
        self.keys, self.values = self.kbuf[:, :, :self.n], self.vbuf[:, :, :self.n]

    def _commit(self) -> None:
        for r, lq in enumerate(self.lqs):
            if lq is None:
                continue
            a, b = self.n_quant[r], lq.quantized_until(self.n, self.sink, self.recent)
            if b <= a:
                continue
            commit_row(lq, self.pre[r], self.kbuf, self.vbuf, r, a, b)
            self.n_quant[r] = b

    def update(self, key_states, value_states, *args, **kwargs):
        R, H, t, D = key_states.shape
        if not self.is_initialized:
            self._alloc(key_states[:1], t + 256)
        if R != len(self.lqs):
            raise OscarError(f"batch of {R} rows for a cache of {len(self.lqs)} methods")
        self._commit()
        if self.n + t > self.kbuf.shape[2]:  # grow (rare: capacity is sized by the caller)
            cap = max(2 * self.kbuf.shape[2], self.n + t)
            k, v = self.kbuf[:, :, :self.n], self.vbuf[:, :, :self.n]
            self._alloc(key_states[:1], cap)
            self.kbuf[:, :, :self.n], self.vbuf[:, :, :self.n] = k, v
        self.kbuf[:, :, self.n:self.n + t] = key_states
        self.vbuf[:, :, self.n:self.n + t] = value_states
        self.n += t
        self._view()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.n


def commit_row(lq: "LayerQuant", pre, kbuf: torch.Tensor, vbuf: torch.Tensor, r: int, a: int, b: int,
               dtype: torch.dtype | None = None) -> None:
    """Replace tokens [a, b) of row r of kbuf/vbuf (R, Hkv, S, D) by their INT2 reading: from `pre`
    (start, k̂, v̂) quantized ahead at load time where it covers them, else quantized now — from
    `dtype` (the model's) when the buffers hold wider values than the model wrote."""
    if pre is not None:
        s0, kq, vq = pre
        e = min(b, s0 + kq.shape[1])
        if e > a:
            kbuf[r, :, a:e] = kq[:, a - s0:e - s0]
            vbuf[r, :, a:e] = vq[:, a - s0:e - s0]
            a = e
    if b > a:  # tokens written after the load (strict protocol, or past the window)
        k, v = kbuf[r:r + 1, :, a:b], vbuf[r:r + 1, :, a:b]
        if dtype is not None:
            k, v = k.to(dtype), v.to(dtype)
        kbuf[r:r + 1, :, a:b] = lq.keys(k)
        vbuf[r:r + 1, :, a:b] = lq.values(v)


class MethodBatchCache(Cache):
    """Several methods' caches over one prompt, one method per batch row (None: the exact cache).

    Decoding the methods together reads the weights once per step for all of them; each row's
    attention reads only its own row, so row r computes what `SimQuantCache(arts[r], ...)` does.
    """

    def __init__(self, arts: list[Artifact | None], protocol: Protocol, num_layers: int):
        self.arts = arts
        super().__init__(layers=[BatchQuantLayer([LayerQuant(a, l, protocol.pages) if a is not None else None for a in arts], protocol)
                                 for l in range(num_layers)])

    @classmethod
    def from_prefill(cls, arts: list[Artifact | None], protocol: Protocol, exact: DynamicCache,
                     capacity: int = 0) -> "MethodBatchCache":
        c = cls(arts, protocol, len(exact.layers))
        for layer, src in zip(c.layers, exact.layers):
            layer.load(src.keys, src.values, capacity)
        return c
