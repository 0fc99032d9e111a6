"""The cache family's members behind one interface, and `make_cache`, which builds any of them by name.

Every backend is built the same way, `Backend(spec).build()`, from the same argument type (`CacheSpec`: the
methods' artifacts grouped by prompt, the protocol, the sizes), as vLLM's attention backends share one interface:

    simulate   fake-quant K/V, exact attention (kernels/simulate.py `SimQuantCache`): one prompt, one method
    batch      several methods over one exact prefill, one per batch row (`MethodBatchCache`)
    rows       several prompts x methods as one batch, each row its own length (kernels/rowbatch.py)
    reference, triton, None
               the paged OscarCache (kernels/cache.py) on the dispatcher's kernels: the torch reference, Triton,
               or (None) whichever the dispatcher picks per call (Triton on CUDA, the reference on CPU;
               $OSCAR_KERNELS), as every kernel does
    latent     an MLA model's INT2 latent cache (kernels/latent.py), from a LatentArtifact: one prompt, one method
    latent-paged  the same cache as an engine stores it (kernels/latent_paged.py): packed 2-bit pages, decode through
               the latent kernel under `latent_paged.serve(model, cache)`; one sequence

A row whose artifact is None is the exact cache (transformers' DynamicCache) under the one-row backends. The serving
cache (kernels/cache.py) imports none of the simulators: this module sits above both.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from transformers.cache_utils import Cache, DynamicCache

from oscar.common import OscarError
from oscar.kernels.cache import OscarCache
from oscar.kernels.latent import LatentSimCache
from oscar.kernels.latent_paged import LatentPagedCache
from oscar.kernels.protocol import Protocol
from oscar.kernels.rowbatch import RowBatchCache
from oscar.kernels.simulate import MethodBatchCache, SimQuantCache
from oscar.stats.artifact import Artifact, LatentArtifact


@dataclass(frozen=True)
class CacheSpec:
    """What a cache of the family holds, for every backend.

    groups: the methods' artifacts, one group per prompt, one row per method (None: the exact cache); one-row
    backends (simulate, the paged ones) take one group of one row, batch one group, rows any number.
    prefill: an exact DynamicCache of the prompt's first chunk, taken over (simulate; required by batch).
    capacity: tokens (batch) or slots (rows) preallocated; num_layers, dtype: the model's (rows).
    held: the layers a pipeline stage runs, the only ones the cache holds (rows, paged).
    model, max_len, page_size: the paged cache's model, longest sequence and page (`OscarCache.from_artifact`)."""

    groups: tuple[tuple[Artifact | None, ...], ...]
    protocol: Protocol
    prefill: DynamicCache | None = None
    capacity: int = 0
    num_layers: int | None = None
    dtype: torch.dtype | None = None
    held: range | None = None
    model: Any = None
    max_len: int | None = None
    page_size: int | None = None

    @classmethod
    def one(cls, art: Artifact | None, protocol: Protocol, **kw) -> "CacheSpec":
        """One method's cache of one prompt (None: the exact cache)."""
        return cls(((art,),), protocol, **kw)

    @classmethod
    def batch(cls, arts: list[Artifact | None], protocol: Protocol, **kw) -> "CacheSpec":
        """Several methods over one prompt, one row each."""
        return cls((tuple(arts),), protocol, **kw)

    @classmethod
    def rows(cls, groups: list[list[Artifact | None]], protocol: Protocol, **kw) -> "CacheSpec":
        """Several prompts (group g: prompt g's methods), one row per (prompt, method)."""
        return cls(tuple(tuple(g) for g in groups), protocol, **kw)


def exact_cache(prefill: DynamicCache | None) -> DynamicCache:
    """The exact cache: empty, or holding a copy of `prefill`'s K/V."""
    c = DynamicCache()
    for l, src in enumerate(prefill.layers if prefill is not None else ()):
        c.update(src.keys, src.values, l)
    return c


class CacheBackend(ABC):
    """One member of the cache family: `Backend(spec)` (the one constructor signature), `build()` its Cache."""

    name: ClassVar[str]
    latent: ClassVar[bool] = False  # the backend serves an MLA model's latent (LatentArtifact), not per-head K/V

    def __init__(self, spec: CacheSpec):
        self.spec = spec
        for g in spec.groups:
            for art in g:
                if art is not None and isinstance(art, LatentArtifact) != self.latent:
                    other = "the latent backend" if not self.latent else "simulate, batch, rows or the paged ones"
                    raise OscarError(f"the {self.name} backend serves "
                                     f"{'latent (MLA) artifacts' if self.latent else 'per-head K/V artifacts'}; got "
                                     f"a {type(art).__name__} ({other} serves it)")

    def one(self) -> Artifact | None:
        """The artifact of a one-row spec (one group of one row)."""
        if len(self.spec.groups) != 1 or len(self.spec.groups[0]) != 1:
            raise OscarError(f"the {self.name} backend holds one method of one prompt; got "
                             f"{[len(g) for g in self.spec.groups]} rows per prompt (CacheSpec.one)")
        return self.spec.groups[0][0]

    @abstractmethod
    def build(self) -> Cache:
        """The cache, empty or holding the spec's prefill."""


class SimulateBackend(CacheBackend):
    name = "simulate"

    def build(self) -> Cache:
        art, s = self.one(), self.spec
        if art is None:  # the exact cache, whatever the backend
            return exact_cache(s.prefill)
        if s.held is not None:
            raise OscarError("the simulate backend holds every layer; held= is for the rows and paged backends")
        return SimQuantCache(art, s.protocol) if s.prefill is None else SimQuantCache.from_prefill(art, s.protocol,
                                                                                                   s.prefill)


class BatchBackend(CacheBackend):
    name = "batch"

    def build(self) -> Cache:
        s = self.spec
        if s.prefill is None:
            raise OscarError("the batch backend takes over an exact prefill (prefill=DynamicCache)")
        if len(s.groups) != 1:
            raise OscarError(f"the batch backend holds the methods of one prompt; got {len(s.groups)} prompts "
                             "(the rows backend holds several)")
        return MethodBatchCache.from_prefill(list(s.groups[0]), s.protocol, s.prefill, s.capacity)


class RowsBackend(CacheBackend):
    name = "rows"

    def build(self) -> Cache:
        s = self.spec
        return RowBatchCache([list(g) for g in s.groups], s.protocol, s.num_layers, s.capacity, s.dtype, held=s.held)


class PagedBackend(CacheBackend):
    """The paged OscarCache; `kernels` None lets the dispatcher choose per call."""

    name = "paged"
    kernels: ClassVar[str | None] = None

    def build(self) -> Cache:
        art, s = self.one(), self.spec
        if art is None:  # the exact cache, whatever the backend
            return exact_cache(s.prefill)
        if not s.protocol.pages:
            raise OscarError(f"protocol {s.protocol.name!r} releases K/V one token at a time: no paged cache holds that")
        if s.prefill is not None:
            raise OscarError("the paged cache prefills through the model (kernels.generation.prefill), not from a "
                             "DynamicCache")
        return OscarCache.from_artifact(s.model, art, max_len=s.max_len, backend=self.kernels, sink=s.protocol.sink,
                                        recent=s.protocol.recent, page_size=s.page_size, held=s.held)


class ReferenceBackend(PagedBackend):
    name = kernels = "reference"


class TritonBackend(PagedBackend):
    name = kernels = "triton"


class LatentBackend(CacheBackend):
    """An MLA model's INT2 latent cache, simulated (kernels/latent.py `LatentSimCache`): transformers' MLA attention
    hands it latents, it serves the history's INT2 round trip; generate() unchanged."""

    name = "latent"
    latent = True

    def build(self) -> Cache:
        art, s = self.one(), self.spec
        if art is None:  # the exact cache, the prefill's DSA indexer keys (GLM-5) included
            return copy.deepcopy(s.prefill) if s.prefill is not None else DynamicCache()
        # held (a stage's layers): the others' layers are built (references to the artifact) and never written
        cache = LatentSimCache(art, sink=s.protocol.sink, recent=s.protocol.recent)
        if s.prefill is not None:  # the prompt's exact latents, as if that chunk passed through update()
            for l, src in enumerate(s.prefill.layers):
                cache.update(src.keys, src.values, l)
                if getattr(src, "indexer_keys", None) is not None:  # GLM-5's DSA indexer reads every past key
                    cache.layers[l].update_indexer(src.indexer_keys)
        return cache


class LatentPagedBackend(CacheBackend):
    """An MLA model's INT2 latent cache as an engine stores it (kernels/latent_paged.py `LatentPagedCache`); its
    decode reads the packed pages under `latent_paged.serve(model, cache)`."""

    name = "latent-paged"
    latent = True

    def build(self) -> Cache:
        art, s = self.one(), self.spec
        if art is None:
            return copy.deepcopy(s.prefill) if s.prefill is not None else DynamicCache()
        if s.prefill is not None or s.held is not None:
            raise OscarError("the latent-paged backend fills through the model (no prefill handed over) and holds "
                             "every layer of one sequence")
        return LatentPagedCache(art, sink=s.protocol.sink, recent=s.protocol.recent)


BACKENDS: dict[str, type[CacheBackend]] = {b.name: b for b in (SimulateBackend, BatchBackend, RowsBackend,
                                                               ReferenceBackend, TritonBackend, LatentBackend,
                                                               LatentPagedBackend)}


def make_cache(spec: CacheSpec, backend: str | None = "simulate") -> Cache:
    """The cache of `spec` built by backend `backend` (BACKENDS; None: the paged cache on the dispatcher's
    kernels)."""
    if backend is not None and backend not in BACKENDS:
        raise OscarError(f"unknown cache backend {backend!r}; known: {', '.join(BACKENDS)}")
    return (BACKENDS[backend] if backend is not None else PagedBackend)(spec).build()
