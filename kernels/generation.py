"""Generation with OscarCache: `prefill`, `generate` (never loses work) and the stopping criterion they use.

    cache = OscarCache.from_artifact(model, "artifact.safetensors")
    prefill(model, cache, haystack)                     # the needle-test protocol's first chunk
    out = generate(model, cache, ids, max_new_tokens=32)   # refuses what cannot fit, or stops and keeps the tokens
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers.generation.stopping_criteria import StoppingCriteriaList

from oscar.common import OscarError

if TYPE_CHECKING:
    from oscar.kernels.cache import OscarCache


try:
    from transformers.generation.stopping_criteria import StoppingCriteria as _StoppingCriteria
except ImportError:  # pragma: no cover - transformers always ships it
    _StoppingCriteria = object


class CacheRoom(_StoppingCriteria):
    """Stops generation when the next decode step would not fit in the cache; `hit` says it did."""

    def __init__(self, cache: OscarCache):
        self.cache, self.hit = cache, False

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        full = self.cache.get_seq_length() + 1 > self.cache.capacity()  # the newest token is not cached yet
        self.hit = self.hit or full
        return torch.full((input_ids.shape[0],), full, dtype=torch.bool, device=input_ids.device)


class CacheFull(OscarError):
    """The cache ran out during `generate`: `.sequences` (B, T) holds the prompt and every token generated."""

    def __init__(self, message: str, sequences: torch.Tensor):
        super().__init__(message)
        self.sequences = sequences


def generate(model, cache: OscarCache, input_ids: torch.Tensor, *, max_new_tokens: int, allow_partial: bool = False,
             **kwargs) -> torch.Tensor:
    """`model.generate` with an OscarCache that never loses work.

    Before decoding: the prompt must continue what the cache holds (else refused: `cache.reset()`),
    and prompt + max_new_tokens must fit in the cache (max_len, free pages): else refused at once,
    nothing computed. allow_partial=True decodes as far as the cache allows instead and then raises
    `CacheFull` carrying the sequences generated so far. A pool shared with forks that runs out
    mid-decode also ends in `CacheFull` with the tokens produced.
    """

    B, T = input_ids.shape
    n = cache.get_seq_length()
    cache.check_prefix(input_ids)
    if n and T <= n:
        raise OscarError(f"this OscarCache already holds {n} tokens per sequence and the prompt has {T}: it is being "
                         f"reused for another prompt; call cache.reset() first, or build a new cache")
    room, want = cache.capacity(B), T + max_new_tokens
    if T > room or (want > room and not allow_partial):
        raise OscarError(f"the OscarCache can hold {room} tokens per sequence (max_len={cache.max_len}, free pages), "
                         f"but the prompt ({T}) + max_new_tokens ({max_new_tokens}) = {want}; nothing was generated: "
                         f"build the cache with a larger max_len / max_pages, ask for fewer tokens, or pass "
                         f"allow_partial=True to keep what fits")
    stop = CacheRoom(cache)
    crit = StoppingCriteriaList([stop, *(kwargs.pop("stopping_criteria", None) or [])])
    out = model.generate(input_ids, past_key_values=cache, max_new_tokens=max_new_tokens, stopping_criteria=crit,
                         **kwargs)
    seqs = out if isinstance(out, torch.Tensor) else out.sequences
    if stop.hit and seqs.shape[1] < want:
        raise CacheFull(f"the OscarCache is full after {seqs.shape[1]} tokens per sequence ({seqs.shape[1] - T} "
                        f"generated of {max_new_tokens} asked; room {cache.capacity()}): the tokens generated are in "
                        f"this error's .sequences", seqs)
    return out


def prefill(model, cache: OscarCache, input_ids: torch.Tensor, chunk: int | None = None,
            attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Run input_ids (B, T) through the model into `cache` (in chunks of `chunk` tokens); last logits (B, V).

    The needle-test protocol: prefill the haystack, then `model.generate(cat(haystack, question),
    past_key_values=cache)`: generate feeds only the uncached question tokens, which attend to the
    quantized haystack exactly as a decode step would.
    """
    import inspect

    T = input_ids.shape[1]
    chunk = chunk or T
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"  # 5.x renamed it
    start = cache.get_seq_length()
    logits = None
    with torch.no_grad():
        for s in range(0, T, chunk):
            e = min(T, s + chunk)
            am = attention_mask[:, : start + e] if attention_mask is not None else None
            out = model(input_ids=input_ids[:, s:e], attention_mask=am, use_cache=True, logits_to_keep=1,
                        **{name: cache})
            logits = out.logits[:, -1]
    return logits
