"""Calibration corpora (deterministic calibration / held-out split) and token block plans.

A corpus is a list of documents. The split is a pure function of the document
keys and lengths: documents are visited in sha256 order of their key and each
joins the held-out part if that part then still holds at most
``heldout_fraction`` of all characters (first fit). It is independent of the tokenizer, of
Python's randomized ``hash`` and of file order, so calibration and validation
always agree on which text is which.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pydoc_data.topics import topics

import numpy as np
import pyarrow.parquet as pq

from oscar.common import OscarError, fingerprint

SPLIT_RULE = ("documents in sha256(key) order; each goes to held-out if held-out stays within {f} of all "
              "characters (first fit; never every document; at least one if none fits)")


@dataclass
class Corpus:
    name: str
    fingerprint: str  # hash of the exact calibration + held-out texts and the split rule
    split: str  # human-readable split rule, recorded in stores
    calibration: list[str]
    heldout: list[str]
    heldout_fraction: float = 0.2
    source: str = ""  # path, or "pydoc_data.topics"

    @property
    def num_chars(self) -> dict:
        return {"calibration": sum(map(len, self.calibration)), "heldout": sum(map(len, self.heldout))}

    def to_dict(self) -> dict:
        """Store attributes (no texts)."""
        return {"name": self.name, "fingerprint": self.fingerprint, "split": self.split,
                "heldout_fraction": self.heldout_fraction, "source": self.source,
                "num_docs": {"calibration": len(self.calibration), "heldout": len(self.heldout)},
                "num_chars": self.num_chars}

    def part(self, which: str) -> list[str]:
        if which not in ("calibration", "heldout"):
            raise OscarError(f"corpus part must be 'calibration' or 'heldout', not {which!r}")
        return getattr(self, which)


def _sha(s: str) -> str:
    return hashlib.sha256(s.encode("utf-8")).hexdigest()


def split_documents(docs: list[tuple[str, str]], heldout_fraction: float) -> tuple[list[str], list[str]]:
    """(key, text) pairs -> (calibration, heldout) texts; each part keeps the input order."""
    if not 0.0 <= heldout_fraction < 1.0:
        raise OscarError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    total = sum(len(t) for _, t in docs)
    order = sorted(range(len(docs)), key=lambda i: (_sha(docs[i][0]), i))
    held: list[int] = []
    chars = 0
    for i in order:  # first fit in hash order: never overshoots the target fraction
        if chars + len(docs[i][1]) <= heldout_fraction * total and len(held) < len(docs) - 1:
            held.append(i)
            chars += len(docs[i][1])
    if not held and heldout_fraction > 0 and len(docs) > 1:  # every document is larger than the target
        held.append(order[0])
    held = set(held)
    cal = [t for i, (_, t) in enumerate(docs) if i not in held]
    ho = [t for i, (_, t) in enumerate(docs) if i in held]
    return cal, ho


def _read_docs(path: str) -> list[tuple[str, str]]:
    """(key, text) documents of a user corpus; key = sha256 of the text (duplicates split together)."""
    if not os.path.exists(path):
        raise OscarError(f"corpus file not found: {path}")
    if os.path.isdir(path):
        raise OscarError(f"corpus path is a directory, expected a .parquet, .jsonl or text file: {path}")
    low = path.lower()
    try:
        if low.endswith(".parquet"):
            try:
                schema = pq.read_schema(path)
            except Exception as e:
                raise OscarError(f"cannot read parquet corpus {path}: {e}") from None
            if "text" not in schema.names:
                raise OscarError(f"parquet corpus {path} has no 'text' column (columns: {', '.join(schema.names)})")
            texts = pq.read_table(path, columns=["text"]).column("text").to_pylist()
        elif low.endswith((".jsonl", ".ndjson")):
            texts = []
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise OscarError(f"{path}:{n}: invalid JSON ({e.msg})") from None
                    if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                        raise OscarError(f"{path}:{n}: each line must be an object with a string 'text' field")
                    texts.append(obj["text"])
        elif low.endswith(".json"):
            raise OscarError(f"{path}: JSON corpora must be JSON Lines (.jsonl, one {{\"text\": ...}} per line)")
        else:  # plain text: documents separated by blank lines
            with open(path, encoding="utf-8") as f:
                texts = re.split(r"\n[ \t]*\n", f.read())
    except UnicodeDecodeError as e:
        raise OscarError(f"corpus {path} is not UTF-8 text: {e}") from None
    except PermissionError:
        raise OscarError(f"corpus file is not readable: {path}") from None
    docs = [t.strip() for t in texts if isinstance(t, str)]
    return [(_sha(t), t) for t in docs if t]


def load_corpus(spec: str = "pydoc", heldout_fraction: float = 0.2) -> Corpus:
    """``pydoc`` (CPython's pydoc_data.topics) or a path to .parquet (text column), .jsonl (text field) or text."""
    if spec == "pydoc":
        docs = [(k, topics[k].strip()) for k in sorted(topics)]
        name, source = "pydoc", "pydoc_data.topics"
    else:
        path = os.path.expanduser(spec)
        docs = _read_docs(path)
        name, source = os.path.basename(path), os.path.abspath(path)
    docs = [(k, t) for k, t in docs if t.strip()]
    if not docs:
        raise OscarError(f"corpus {spec!r} is empty: no non-blank text")
    cal, ho = split_documents(docs, heldout_fraction)
    rule = SPLIT_RULE.format(f=heldout_fraction)
    fp = fingerprint({"calibration": _sha("\x00".join(cal)), "heldout": _sha("\x00".join(ho)), "split": rule})
    return Corpus(name=name, fingerprint=fp, split=rule, calibration=cal, heldout=ho,
                  heldout_fraction=heldout_fraction, source=source)


# ---------------------------------------------------------------- blocks


@dataclass
class BlockPlan:
    """Fixed-length token sequences grouped into blocks (the unit of capture, storage and resume)."""

    tokens: np.ndarray  # int32 (B, S, T) token ids; padding = pad_id
    mask: np.ndarray  # uint8 (B, S, T) 1 = real token, 0 = padding
    seq_len: int  # T
    seqs_per_block: int  # S
    num_tokens: int  # real tokens = mask.sum()
    pad_id: int = 0
    eos_id: int | None = None
    add_bos: bool = False
    num_seqs: int = 0  # sequences with at least one real token
    corpus_tokens: int = 0  # tokens in the whole (uncapped) stream
    meta: dict = field(default_factory=dict)

    @property
    def num_blocks(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def fingerprint(self) -> str:
        h = hashlib.sha256(np.ascontiguousarray(self.tokens).tobytes())
        h.update(np.ascontiguousarray(self.mask).tobytes())
        return h.hexdigest()[:16]

    def to_dict(self) -> dict:
        return {"seq_len": self.seq_len, "seqs_per_block": self.seqs_per_block, "num_blocks": self.num_blocks,
                "num_tokens": self.num_tokens, "num_seqs": self.num_seqs, "pad_id": self.pad_id,
                "eos_id": self.eos_id, "add_bos": self.add_bos, "corpus_tokens": self.corpus_tokens,
                "fingerprint": self.fingerprint}


def _token_stream(tokenizer, texts: list[str]) -> np.ndarray:
    eos = tokenizer.eos_token_id
    ids = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    out: list[int] = []
    for doc in ids:
        out.extend(doc)
        if eos is not None:
            out.append(eos)  # document separator
    return np.asarray(out, dtype=np.int64)


def make_blocks(tokenizer, texts: list[str], *, seq_len: int, seqs_per_block: int | None = None,
                block_tokens: int | None = None, num_blocks: int | None = None, max_tokens: int | None = None,
                add_bos: bool | None = None) -> BlockPlan:
    """Concatenate documents (EOS after each), cut into ``seq_len`` sequences, group into blocks.

    Block size: at most one of ``seqs_per_block``, ``block_tokens`` (-> block_tokens // seq_len
    sequences) or ``num_blocks`` (exactly that many equal blocks; the leftover
    ``n_seq % num_blocks`` sequences are dropped); default one
    sequence per block. ``max_tokens`` caps the real tokens used. ``add_bos`` puts the BOS
    token first in every sequence (default: only if the tokenizer adds one itself). The
    last sequence and last block are padded with ``pad_id`` under mask 0.
    """
    if not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
        raise OscarError(f"seq_len must be a positive integer, got {seq_len!r}")
    given = {k: v for k, v in dict(seqs_per_block=seqs_per_block, block_tokens=block_tokens,
                                   num_blocks=num_blocks).items() if v is not None}
    if len(given) > 1:
        raise OscarError(f"give at most one of seqs_per_block / block_tokens / num_blocks, got {sorted(given)}")
    for k, v in [*given.items(), ("max_tokens", max_tokens)]:
        if v is not None and v < 1:
            raise OscarError(f"{k} must be >= 1, got {v}")
    if block_tokens is not None and block_tokens < seq_len:
        raise OscarError(f"block_tokens={block_tokens} is smaller than one sequence (seq_len={seq_len})")
    if add_bos is None:
        probe = tokenizer("a")["input_ids"]
        add_bos = bool(probe) and tokenizer.bos_token_id is not None and probe[0] == tokenizer.bos_token_id
    if add_bos and tokenizer.bos_token_id is None:
        raise OscarError("add_bos=True but the tokenizer has no BOS token")
    if add_bos and seq_len < 2:
        raise OscarError("seq_len must be >= 2 when every sequence starts with BOS")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    pad = 0 if pad is None else int(pad)

    stream = _token_stream(tokenizer, texts)  # (N,)
    body = seq_len - int(add_bos)
    if len(stream) < body:
        raise OscarError(f"corpus too small: {len(stream)} tokens, one sequence of seq_len={seq_len} needs {body}"
                         + (" after BOS" if add_bos else ""))
    n_seq = -(-len(stream) // body)
    seqs = np.full((n_seq, seq_len), pad, dtype=np.int64)  # (N_seq, T)
    mask = np.zeros((n_seq, seq_len), dtype=np.uint8)
    flat = np.full(n_seq * body, pad, dtype=np.int64)
    flat[: len(stream)] = stream
    seqs[:, int(add_bos):] = flat.reshape(n_seq, body)
    fm = np.zeros(n_seq * body, dtype=np.uint8)
    fm[: len(stream)] = 1
    mask[:, int(add_bos):] = fm.reshape(n_seq, body)
    if add_bos:
        seqs[:, 0] = tokenizer.bos_token_id
        mask[:, 0] = 1
    if max_tokens is not None:  # cap real tokens in stream order (row-major over sequences)
        keep = np.cumsum(mask.reshape(-1)) <= max_tokens
        mask = (mask.reshape(-1) * keep).reshape(mask.shape).astype(np.uint8)
        seqs = np.where(mask == 1, seqs, pad)
        alive = mask.any(axis=1)
        n_keep = int(alive.nonzero()[0].max()) + 1 if alive.any() else 0
        seqs, mask = seqs[:n_keep], mask[:n_keep]
        if add_bos and n_keep and mask[-1].sum() == 1:  # a lone BOS is not a sequence
            seqs, mask = seqs[:-1], mask[:-1]
        if len(seqs) == 0:
            raise OscarError(f"max_tokens={max_tokens} leaves no sequence")
    n_seq = len(seqs)
    if num_blocks is not None:
        if num_blocks > n_seq:
            raise OscarError(f"num_blocks={num_blocks} but the corpus gives only {n_seq} sequences of {seq_len} tokens")
        S = n_seq // num_blocks  # exactly num_blocks equal blocks; the < num_blocks leftover sequences are dropped
        seqs, mask = seqs[: S * num_blocks], mask[: S * num_blocks]
        n_seq = len(seqs)
    elif block_tokens is not None:
        S = block_tokens // seq_len
    else:
        S = seqs_per_block or 1
    B = -(-n_seq // S)
    tok = np.full((B * S, seq_len), pad, dtype=np.int32)
    msk = np.zeros((B * S, seq_len), dtype=np.uint8)
    tok[:n_seq], msk[:n_seq] = seqs, mask
    return BlockPlan(tokens=tok.reshape(B, S, seq_len), mask=msk.reshape(B, S, seq_len), seq_len=int(seq_len),
                     seqs_per_block=int(S), num_tokens=int(msk.sum()), pad_id=pad,
                     eos_id=tokenizer.eos_token_id, add_bos=bool(add_bos), num_seqs=int(n_seq),
                     corpus_tokens=int(len(stream)))
