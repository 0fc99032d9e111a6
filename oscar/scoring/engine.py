"""Execution engines of the model-level checks, and the device they run on.

    simulate  the fake-quant simulator (the cache family's simulate / batch / rows backends, kernels/simulate.py
              and kernels/rowbatch.py; kernels/window_attention.py's attention over `LayerQuant`): every method's INT2
              reading computed by `LayerQuant`, several methods and samples batched; the default.
    cache     the product path: the model's attention goes through `OscarCache` (kernels/cache.py,
              `from_artifact` installs its attention function) and kern's dispatcher (Triton on CUDA, the
              torch reference on CPU; $OSCAR_KERNELS forces one), one (sample, method) at a time.

What the cache engine runs (docs/validation.md, "Engines"):

- needles: the haystack (chunk 1) prefilled into the method's OscarCache (`kernels.generation.prefill`,
  OscarCache's prefill path: decode semantics, so later haystack tokens already read the INT2
  history), the question as a second chunk, then greedy decoding one token at a time through the
  dispatcher's decode kernel;
- perplexity (and the tune stage's NLL): each window from an empty cache, its first tokens prefilled in
  one chunk, the last `decode_tokens` teacher-forced one token at a time through the decode kernel;
  every predicted token is scored (the prefill path has decode semantics, so a prefilled token reads
  exactly what a decode step at its position would).

A protocol (sink S, recent R) is the cache `OscarCache(sink=S, recent=R)`: under `strict` (R = 0)
every non-sink token is read from INT2 once its page is complete, by the token completing it too.
The cache writes the current token before attending (`layout(p + 1)`), so it reads one token less
exactly than the simulator's protocol of the same name: the simulator's recent r is the cache's
r + 1 (`simulator_protocol`; tests compare the engines at that matched pair). `strict-token`
(one token at a time) is no cache format and is refused, as are codebook methods (tq-int2, sq-int2).
"""

from __future__ import annotations

import re
from dataclasses import replace

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from oscar.cli_options import DEFAULT_DEVICE, ENGINES
from oscar.common import OscarError
from oscar.kernels import dispatch
from oscar.kernels.backends import CacheSpec, make_cache
from oscar.kernels.cache_attention import ATTN_NAME, register_attention
from oscar.kernels.generation import prefill as cache_prefill
from oscar.kernels.paged import PagedConfig, PagedLayerCache
from oscar.kernels.rotation import LayerRotation
from oscar.kernels.reference import dequantize_sequence
from oscar.kernels.protocol import Protocol

DECODE_TOKENS = 16  # per perplexity window, the last tokens teacher-forced one at a time (cache engine)


class EngineUnsupported(OscarError):
    """A method or protocol the cache engine cannot run (the cache format cannot hold it)."""


def check_engine(engine: str) -> str:
    if engine not in ENGINES:
        raise OscarError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")
    return engine


def resolve_device(spec: str | torch.device | None) -> torch.device:
    """torch.device of `spec` (cpu, cuda, cuda:N); a CUDA device this machine lacks is refused, never run on CPU."""
    s = str(spec if spec is not None else DEFAULT_DEVICE).strip().lower()
    if s == "cpu":
        return torch.device("cpu")
    m = re.fullmatch(r"cuda(?::(\d+))?", s)
    if not m:
        raise OscarError(f"unknown device {spec!r}; expected cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise OscarError(f"--device {spec}: CUDA is not available here (torch {torch.__version__}, "
                         f"torch.cuda.is_available() is False); nothing was run: use --device cpu")
    idx = int(m.group(1) or 0)
    n = torch.cuda.device_count()
    if idx >= n:
        raise OscarError(f"--device {spec}: this machine has {n} CUDA device(s) (cuda:0..cuda:{n - 1})")
    return torch.device("cuda", idx)


def to_device(model, device: torch.device):
    """The model on `device` (in place)."""
    if next(model.parameters()).device != device:
        model.to(device)
    return model


# ----------------------------------------------------------------- which methods the cache holds


def cache_options(name: str, art, protocol) -> dict:
    """`OscarCache.from_artifact` overrides running method `name` (artifact `art`) under `protocol`.

    Channel-grouped keys (kivi2, oscar-kc-int2) group G tokens per page in the cache, so their pages
    hold G tokens (the simulator releases them in groups of G too). Raises EngineUnsupported for what
    the cache format cannot hold."""

    if not protocol.pages:
        raise EngineUnsupported(f"protocol {protocol.name!r} releases per-token K/V one token at a time, a diagnostic "
                                f"no paged cache runs; use --engine simulate for it")
    if art.meta.get("codec"):
        raise EngineUnsupported(f"method {name} stores Lloyd-Max codebook codes (validate/codebooks.py), not a format "
                                f"OscarCache holds (uniform INT2 grids); use --engine simulate for it")
    q = art.quant
    page = (q.group_size or q.page_size) if q.key_axis == "channel" else q.page_size
    if protocol.recent % page:
        raise EngineUnsupported(f"method {name}: the cache's recent window ({protocol.recent}) must be a multiple of "
                                f"its page of {page} tokens")
    return {"sink": protocol.sink, "recent": protocol.recent, "page_size": page}


def check_methods(arts: dict, protocols) -> None:
    """Refuse, before anything runs, every (method, protocol) the cache engine cannot run (one error naming all)."""
    bad = []
    for p in protocols:
        for m, a in arts.items():
            if a is None:
                continue
            try:
                cache_options(m, a, p)
            except EngineUnsupported as e:
                bad.append(str(e))
    if bad:
        raise EngineUnsupported("--engine cache cannot run: " + "; ".join(dict.fromkeys(bad)))


def simulator_protocol(protocol):
    """The simulator protocol that reads exactly what OscarCache(sink, recent) reads: recent - 1
    (the cache writes the current token before attending; `test_simulator_matches_oscarcache`)."""
    if protocol.recent < 1:
        raise OscarError(f"OscarCache with recent {protocol.recent} reads one token less exactly than any simulator "
                         f"protocol (recent >= 0)")
    return replace(protocol, name=protocol.name + "-matched", recent=protocol.recent - 1)


def new_cache(model, name: str, art, protocol, max_len: int, held: range | None = None):
    """An empty OscarCache for method `name` (None: the exact DynamicCache), its kernels chosen by the dispatcher;
    `held`: the layers `model` runs (a pipeline stage's own), the only ones the cache holds."""

    if art is None:
        return make_cache(CacheSpec.one(None, protocol), backend=None)
    page = cache_options(name, art, protocol)["page_size"]  # refuses what the cache format cannot hold
    return make_cache(CacheSpec.one(art, protocol, model=model, max_len=max_len, page_size=page, held=held), backend=None)


class served:
    """Context manager: the model as OscarCache.from_artifact leaves it, its attention implementation restored after."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):

        self.prev = self.model.config._attn_implementation
        register_attention()
        self.model.set_attn_implementation(ATTN_NAME)  # non-Oscar caches (bf16) fall back to SDPA inside it
        return self

    def __exit__(self, *exc):
        self.model.set_attn_implementation(self.prev)


# ----------------------------------------------------------------- needles


@torch.no_grad()
def niah_answers(model, samples, groups, names, protocol, eos: set[int], prefill: str = "cache") -> list[list[int]]:
    """Greedy answers of every (sample, method) row, rows as `niah.decode_batch` orders them: sample by
    sample, its methods `names[g]` (artifacts `groups[g]`, None: exact) in order. Each row: a fresh cache,
    the haystack prefilled into it, the question as a second chunk, then one decode step per token.

    prefill="cache": OscarCache's own prefill (decode semantics, the product path); "exact": the haystack
    attends to itself exactly (an SDPA prefill) and its K/V are then stored through the cache's `update`,
    the simulator's needle protocol (bench/engine_speed.py compares the two)."""

    if prefill not in ("cache", "exact"):
        raise OscarError(f"prefill must be 'cache' or 'exact', got {prefill!r}")
    dev = next(model.parameters()).device
    out: list[list[int]] = []
    with served(model):
        for s, arts, ms in zip(samples, groups, names):
            ctx = torch.tensor([s.context_ids], device=dev)  # (1, T)
            exact = None
            for m, art in zip(ms, arts):
                cache = new_cache(model, m, art, protocol, row_length(s))
                if prefill == "cache" or art is None:
                    cache_prefill(model, cache, ctx)
                else:
                    if exact is None:  # one exact prefill per sample (SDPA: not an OscarCache)
                        exact = DynamicCache()
                        model(input_ids=ctx, cache=exact, use_cache=True, logits_to_keep=1)
                    for l, layer in enumerate(exact.layers):
                        cache.update(layer.keys, layer.values, l)  # stored as the cache stores a chunk
                step = lambda ids: next_token(model(input_ids=torch.tensor([ids], device=dev), cache=cache,  # noqa: E731
                                                    use_cache=True, logits_to_keep=1).logits[:, -1])  # (1, V)
                out.append(greedy_tokens(step, s.question_ids, s.max_new_tokens, eos))
                free_cache(cache)
    return out


def row_length(sample) -> int:
    """Tokens a needle row's cache holds at most: context + question + answer budget."""
    return len(sample.context_ids) + len(sample.question_ids) + sample.max_new_tokens


def next_token(logits: torch.Tensor) -> int:
    """The greedy token of a row's last logits (1, V)."""
    return int(logits.argmax(-1))


def greedy_tokens(step, question: list[int], budget: int, eos: set[int]) -> list[int]:
    """A needle row's answer: `step(ids)` feeds token ids through the row's cache and returns the next token
    (`next_token`); the question is the second chunk, then one decode step (the dispatcher's kernel) per token,
    up to `budget` tokens or the first EOS. One process and the pipeline stages (cluster/scoring.py) share it."""
    ids, toks = list(question), []
    for _ in range(budget):
        t = step(ids)
        if t in eos:
            break
        toks.append(t)
        ids = [t]
    return toks


def free_cache(cache) -> None:
    """Give an OscarCache's pages back (the exact DynamicCache holds none)."""
    if hasattr(cache, "release"):
        cache.release()


# ----------------------------------------------------------------- perplexity


@torch.no_grad()
def token_nll(model, name: str, art, protocol, ids: torch.Tensor, decode_tokens: int = DECODE_TOKENS) -> torch.Tensor:
    """(T - 1,) float64 next-token NLL of a (1, T) window fed through the method's cache from empty:
    tokens [0, T - decode_tokens) as one prefill chunk, the rest one decode step each (teacher forced)."""

    T = ids.shape[1]
    dev = next(model.parameters()).device
    ids = ids.to(dev)
    hs = []
    with served(model):
        cache = new_cache(model, name, art, protocol, T)
        for a, b in window_chunks(T, decode_tokens):
            hs.append(model.model(input_ids=ids[:, a:b], cache=cache, use_cache=True).last_hidden_state)  # (1, b - a, H)
        free_cache(cache)
    return hidden_token_nll(model.lm_head, torch.cat(hs, 1), ids)


def window_chunks(T: int, decode_tokens: int = DECODE_TOKENS) -> list[tuple[int, int]]:
    """The chunks [a, b) a T-token window is fed in: the first T - decode_tokens tokens at once, then one at a time."""
    k = max(1, T - max(0, decode_tokens))
    return [(0, k)] + [(t, t + 1) for t in range(k, T)]


def hidden_token_nll(lm_head, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """(T - 1,) float64 next-token NLL of the window `ids` (1, T) from its final (normed) hidden states h (1, >= T - 1, H)."""
    T = ids.shape[1]
    h = h[:, :T - 1]  # (1, T - 1, H): the states predicting tokens 1..T-1
    nll = torch.empty(T - 1, dtype=torch.float64)
    for a in range(0, T - 1, 512):  # logits in chunks: (512, V) at a time
        b = min(T - 1, a + 512)
        logits = lm_head(h[:, a:b]).float()[0]
        nll[a:b] = F.cross_entropy(logits, ids[0, a + 1:b + 1].to(logits.device), reduction="none").double().cpu()
    return nll


def window_nll(model, name: str, art, protocol, ids: torch.Tensor, prefixes: tuple[int, ...] = (),
               decode_tokens: int = DECODE_TOKENS):
    """`scoring.nll.window_nll`'s result (sum, count[, [(sum, count) of each prefix window P]]) through the cache.

    A prefix window of P tokens is read from this window's first P positions: under decode semantics
    position p depends only on tokens <= p, so it computes what a P-token window fed the same way does
    (its last tokens then came through the prefill path instead of decode steps: same semantics)."""
    return nll_sums(token_nll(model, name, art, protocol, ids, decode_tokens), prefixes)


def nll_sums(nll: torch.Tensor, prefixes: tuple[int, ...] = ()):
    """`window_nll`'s result from a window's per-token NLL (T - 1,)."""
    tot, n = float(nll.sum()), nll.shape[0]
    if not prefixes:
        return tot, n
    return tot, n, [(float(nll[:P - 1].sum()), P - 1) for P in prefixes]


# ----------------------------------------------------------------- attention-level


def cache_stream(name: str, art, layer: int, Ks: torch.Tensor, Vs: torch.Tensor, dtype: torch.dtype):
    """The INT2 reading of a key/value stream (Hkv, S, D) as layer `layer` of the paged cache stores it
    (`validate attention --engine cache`): appended to a `PagedLayerCache` with no sink and no recent
    window (pages quantized by the dispatcher: Triton on CUDA), read back un-rotated in float32. Every
    whole page is INT2, the last < page tokens stay exact (`attention.quantize_stream`'s incomplete group)."""

    opts = cache_options(name, art, Protocol("attention", sink=0, recent=0))
    q = replace(art.quant_for(layer), **opts)  # the layer's own format (per-layer widths)
    H, S, D = Ks.shape
    try:
        cfg = PagedConfig(q, H, D, -(-S // opts["page_size"]), max_seqs=1, dtype=dtype, device=Ks.device)
    except ValueError as e:
        raise EngineUnsupported(f"method {name}: cache format: {e}") from e
    pc = PagedLayerCache(cfg, LayerRotation.from_artifact(art, layer, Ks.device), quantizer=dispatch.quantize_pages)
    s = pc.new_sequence()
    pc.append_batch([s], Ks[None].to(dtype), Vs[None].to(dtype))  # (1, Hkv, S, D)
    return dequantize_sequence(pc, s, dtype=torch.float32)  # (Hkv, S, D) each
