"""Exact prefills of needle haystacks, shared by the methods scored on one prompt, and the decode thread count.

`PrefillPool` prefills a prompt exactly once (continuing the kept prompt it shares most tokens with); the
methods' caches then take the prefill over (the rows backend, kernels/rowbatch.py). One process
(validate/niah.py) and each pipeline stage (cluster/scoring.py, its own layers) use the same pool.
"""

from __future__ import annotations

import os

import torch
from transformers import DynamicCache

from oscar.kernels import cpu_attention


def decode_threads() -> int:
    """Intra-op threads for decoding: all of them on a quiet machine, one on a busy one.

    Decode steps are thousands of small, memory-bound ops. On a quiet 2-core machine two threads
    halve a 6-row SmolLM2 decode (1k: 4.75 -> 2.76 s, 4k: 10.1 -> 5.9 s per sample); with another
    process on the cores, OpenMP barriers stall (measured 2.4 s -> 0.12 s per step with one thread).
    Quiet = 1-minute load average below cores + 0.5 (this process's own threads count). Thread
    counts change float summation order only (logits within 3e-5).
    """
    n = torch.get_num_threads()
    try:
        busy = os.getloadavg()[0] >= (os.cpu_count() or 1) + 0.5
    except OSError:
        busy = True
    return 1 if busy else n


class load_aware_threads:
    """Context manager: intra-op threads = `decode_threads()` inside, restored after."""

    def __enter__(self):
        self.prev = torch.get_num_threads()
        torch.set_num_threads(decode_threads())
        return self

    def __exit__(self, *exc):
        torch.set_num_threads(self.prev)


class PrefillPool:
    """Exact prefills of the last few prompts; a new prompt continues the one it shares most tokens with.

    Causal attention: the K/V of a shared token prefix do not depend on what follows, so the
    prompt is prefilled from the end of that prefix (noise haystacks share everything before the
    needle). The result equals a one-shot prefill up to float summation order.
    """

    def __init__(self, model, keep: int = 4):
        self.model, self.keep = model, keep
        self.entries: list[tuple[list[int], object]] = []
        self.reused = self.computed = 0  # tokens

    @staticmethod
    def _lcp(a: list[int], b: list[int]) -> int:
        n = min(len(a), len(b))
        i = 0
        while i < n and a[i] == b[i]:
            i += 1
        return i

    def lookup(self, ids: list[int]) -> tuple[int, DynamicCache]:
        """(n, a cache holding the K/V of ids[:n]): the longest prefix of `ids` a kept prefill shares, at most
        len(ids) - 1 (at least one token runs through the model). Only the layers the kept cache holds (a pipeline
        stage's own) are copied."""
        best, n = None, 0
        for e_ids, c in self.entries:
            k = self._lcp(e_ids, ids)
            if k > n:
                best, n = c, k
        n = min(n, len(ids) - 1)
        cache = DynamicCache()
        if n > 0:
            for l, layer in enumerate(best.layers):
                if layer.is_initialized:
                    cache.update(layer.keys[..., :n, :], layer.values[..., :n, :], l)
        return n, cache

    def store(self, ids: list[int], n: int, cache: DynamicCache) -> None:
        self.reused += n
        self.computed += len(ids) - n
        self.entries = (self.entries + [(list(ids), cache)])[-self.keep:]

    @torch.no_grad()
    def prefill(self, ids: list[int]):
        n, cache = self.lookup(ids)
        with load_aware_threads(), cpu_attention.native_prefill(self.model):  # two threads on a busy 2-core machine stall in OpenMP barriers
            self.model(input_ids=torch.tensor([ids[n:]], device=self.model.device), cache=cache, use_cache=True, logits_to_keep=1)
        self.store(ids, n, cache)
        return cache


def batch_capacity(samples) -> int:
    """Slots a row batch of `samples` needs: the longest context + question + answer budget."""
    return max(len(s.context_ids) for s in samples) + max(len(s.question_ids) for s in samples) + \
        max(s.max_new_tokens for s in samples)
