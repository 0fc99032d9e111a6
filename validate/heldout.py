"""Held-out token sequences for the attention-level test, and the check that the fit never saw them.

Text, in this order, until enough tokens are cut:
  1. the corpus's held-out split (`env.heldout_text`: sentences also found verbatim in the
     calibration split dropped); ~12k SmolLM2 tokens for pydoc;
  2. docstrings of the running Python's standard library (module, class and function docstrings
     of its .py files, read with `ast`, never imported), in sorted path order: ~1.4 MB of English
     technical prose in every Python install, a source no calibration corpus of this project uses
     (docs/decisions/0047-attention-level-test-held-out-text-whole.md, "Attention-level test: held-out text").
Cut into whole sequences of `seq_len` tokens by the calibration's own `make_blocks` (EOS between
documents), the last one shorter.

`check_disjoint` compares every `ngram`-token run of those sequences with the calibration store's
`tokens` (every block, through `pipeline.store`) and refuses any shared run: a shared 32-token run
means the text was copied from what the artifact was fitted on.
"""

from __future__ import annotations

import ast
import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass, field

import numpy as np

from oscar.common import OscarError
from oscar.pipeline.corpus import make_blocks
from oscar.validate.env import drop_calibration_sentences, heldout_text

NGRAM = 32
_SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "pydoc_data", "ensurepip",
              "turtledemo", "__pycache__", "tkinter"}


def stdlib_docstrings(max_chars: int) -> list[str]:
    """Whitespace-normalised docstrings (>= 8 words, first occurrence only) of the standard library's
    .py files in sorted relative-path order, until `max_chars` characters are collected."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dp, dn, fn in os.walk(root):
        dn[:] = sorted(d for d in dn if d not in _SKIP_DIRS and not d.startswith("test"))
        files += [os.path.join(dp, f) for f in fn if f.endswith(".py") and not f.startswith("test")]
    files.sort(key=lambda p: os.path.relpath(p, root))
    out, seen, chars = [], set(), 0
    for p in files:
        try:
            with open(p, encoding="utf-8") as f:
                tree = ast.parse(f.read())
        except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
            continue
        nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
        for node in nodes:
            d = ast.get_docstring(node)
            d = " ".join(d.split()) if d else ""
            if len(d.split()) < 8 or d in seen:
                continue
            seen.add(d)
            out.append(d)
            chars += len(d)
            if chars >= max_chars:
                return out
    return out


def more_heldout_words(corpus: str = "pydoc"):
    """more(n) for `ruler.Sources`: >= n words of the standard library's docstrings (the attention-level
    test's second held-out source, `stdlib_docstrings`), sentences also found in the
    corpus's calibration split dropped. Read only by corpus haystacks longer than the held-out split."""
    def more(n: int) -> list[str]:
        words: list[str] = []
        chars = 8 * n  # ~6 characters per word with its space; grow until enough survive the dedupe
        while len(words) < n:
            docs = stdlib_docstrings(chars)
            words = drop_calibration_sentences(" ".join(docs), corpus).split()
            if sum(map(len, docs)) < chars:  # the standard library has no more
                break
            chars *= 2
        return words

    return more


@dataclass
class HeldoutSequences:
    seqs: list[np.ndarray]             # int64 (T_i,) token ids per sequence, positions 0..T_i-1
    sources: list[str]                 # per sequence: which text it starts in
    info: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(sum(len(s) for s in self.seqs))

    @property
    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for s in self.seqs:
            h.update(np.ascontiguousarray(s, dtype=np.int64).tobytes())
        return h.hexdigest()[:16]


def heldout_sequences(tokenizer, num_tokens: int, seq_len: int, corpus: str = "pydoc") -> HeldoutSequences:
    """`num_tokens` tokens of held-out text as whole sequences of `seq_len` (the last one shorter)."""
    if num_tokens < 1 or seq_len < 2:
        raise OscarError(f"need num_tokens >= 1 and seq_len >= 2, got {num_tokens}, {seq_len}")
    held = heldout_text(corpus)
    n_held = len(tokenizer(held, add_special_tokens=False)["input_ids"]) + 1  # + EOS
    # ~3.5 characters per token on this prose; ask for 1.5x what the budget needs, then cut by tokens
    docs = stdlib_docstrings(max(0, int(1.5 * 3.5 * (num_tokens - n_held))) + 1) if num_tokens > n_held else []
    plan = make_blocks(tokenizer, [held, *docs], seq_len=seq_len, max_tokens=num_tokens)
    toks, mask = plan.tokens.reshape(-1, seq_len), plan.mask.reshape(-1, seq_len)
    seqs = [toks[i][mask[i] == 1].astype(np.int64) for i in range(len(toks)) if mask[i].any()]
    got = sum(len(s) for s in seqs)
    if got < num_tokens:
        raise OscarError(f"held-out text gives only {got} tokens (held-out split of {corpus!r} + {len(docs)} standard "
                         f"library docstrings); {num_tokens} needed: use shorter --lengths")
    starts = np.cumsum([0] + [len(s) for s in seqs])
    src = ["heldout:" + corpus if a < n_held else "stdlib-docstrings" for a in starts[:-1]]
    info = {"corpus_heldout_tokens": min(n_held, got), "docstring_tokens": max(0, got - n_held),
            "docstrings": len(docs), "python": sys.version.split()[0], "seq_len": seq_len, "num_seqs": len(seqs)}
    return HeldoutSequences(seqs=seqs, sources=src, info=info)


def ngram_hashes(tokens: np.ndarray, n: int) -> np.ndarray:
    """uint64 polynomial hash of every window tokens[i:i+n] (len(tokens) - n + 1 of them; wraps mod 2^64)."""
    t = np.asarray(tokens, dtype=np.uint64)
    if len(t) < n:
        return np.zeros(0, np.uint64)
    w = np.lib.stride_tricks.sliding_window_view(t + np.uint64(1), n)           # (m, n)
    p = np.uint64(1_000_003) ** np.arange(n - 1, -1, -1, dtype=np.uint64)       # (n,)
    with np.errstate(over="ignore"):
        return (w * p).sum(1, dtype=np.uint64)


def check_disjoint(seqs: list[np.ndarray], cal_tokens: np.ndarray, cal_mask: np.ndarray, n: int = NGRAM) -> dict:
    """Refuse held-out sequences sharing any `n`-token run with the calibration tokens (B, S, T) under mask.

    Every calibration sequence's real tokens are hashed by n-gram; a hash hit is confirmed on the
    tokens themselves (no refusal on a hash collision). Returns what was compared.
    """
    cal_tokens = np.asarray(cal_tokens).reshape(-1, np.asarray(cal_tokens).shape[-1])
    cal_mask = np.asarray(cal_mask).reshape(cal_tokens.shape).astype(bool)
    cal_seqs = [cal_tokens[i][cal_mask[i]].astype(np.int64) for i in range(len(cal_tokens)) if cal_mask[i].any()]
    hs = [ngram_hashes(s, n) for s in cal_seqs]
    owner = np.concatenate([np.full(len(h), i) for i, h in enumerate(hs)]) if hs else np.zeros(0, int)
    offset = np.concatenate([np.arange(len(h)) for h in hs]) if hs else np.zeros(0, int)
    allh = np.concatenate(hs) if hs else np.zeros(0, np.uint64)
    order = np.argsort(allh, kind="stable")
    sorted_h = allh[order]
    for i, s in enumerate(seqs):
        h = ngram_hashes(s, n)
        j = np.searchsorted(sorted_h, h)
        hit = np.flatnonzero((j < len(sorted_h)) & (sorted_h[np.minimum(j, len(sorted_h) - 1)] == h))
        for p in hit:
            k = j[p]
            while k < len(sorted_h) and sorted_h[k] == h[p]:
                c = order[k]
                cs, co = cal_seqs[owner[c]], offset[c]
                if np.array_equal(cs[co:co + n], s[p:p + n]):
                    raise OscarError(
                        f"held-out sequence {i} (tokens {p}..{p + n - 1}) repeats {n} tokens of calibration "
                        f"sequence {owner[c]} (from token {co}) of the store the artifact was fitted on: the "
                        f"attention-level test would score rows the fit has seen; refusing")
                k += 1
    return {"ngram": n, "calibration_sequences": len(cal_seqs), "calibration_tokens": int(sum(len(s) for s in cal_seqs)),
            "heldout_tokens": int(sum(len(s) for s in seqs)), "shared_ngrams": 0}
