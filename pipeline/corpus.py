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
    chat_records: int = 0  # 'messages' records, rendered with the tokenizer's chat template

    @property
    def num_chars(self) -> dict:
        return {"calibration": sum(map(len, self.calibration)), "heldout": sum(map(len, self.heldout))}

    def to_dict(self) -> dict:
        """Store attributes (no texts)."""
        return {"name": self.name, "fingerprint": self.fingerprint, "split": self.split,
                "heldout_fraction": self.heldout_fraction, "source": self.source,
                "num_docs": {"calibration": len(self.calibration), "heldout": len(self.heldout)},
                "num_chars": self.num_chars, **({"chat_records": self.chat_records} if self.chat_records else {})}

    def part(self, which: str) -> list[str]:
        if which not in ("calibration", "heldout"):
            raise OscarError(f"corpus part must be 'calibration' or 'heldout', not {which!r}")
        return getattr(self, which)


def _sha(s: str) -> str:
    return hashlib.sha256(s.encode("utf-8")).hexdigest()


def split_documents(docs: list[tuple[str, str]], heldout_fraction: float) -> tuple[list[str], list[str]]:
    """(key, text) pairs -> (calibration, heldout) texts; each part keeps the input order."""
    held = heldout_indices(docs, heldout_fraction)
    cal = [t for i, (_, t) in enumerate(docs) if i not in held]
    ho = [t for i, (_, t) in enumerate(docs) if i in held]
    return cal, ho


def heldout_indices(docs: list[tuple[str, str]], heldout_fraction: float) -> set[int]:
    """The indices of `docs` ((key, text) pairs) that `split_documents` puts in the held-out part."""
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
    return set(held)


def _check_messages(m, where: str) -> list[dict]:
    """A chat record's messages: a non-empty list of {role, content} string pairs (extra keys are kept)."""
    if (not isinstance(m, list) or not m
            or not all(isinstance(x, dict) and isinstance(x.get("role"), str) and isinstance(x.get("content"), str)
                       for x in m)):
        raise OscarError(f"{where}: 'messages' must be a non-empty list of {{\"role\": str, \"content\": str}} objects")
    return m


def _record(obj: dict, where: str):
    """One record's document: its 'text' (str) or its 'messages' (list); None for a blank record."""
    text, msgs = obj.get("text"), obj.get("messages")
    if text is not None and msgs is not None:
        raise OscarError(f"{where}: a record has either a 'text' or a 'messages' field, not both")
    if msgs is not None:
        return _check_messages(msgs, where)
    if not isinstance(text, str):
        raise OscarError(f"{where}: each record must be an object with a string 'text' field or a 'messages' list")
    return text


def _read_docs(path: str) -> list[tuple[str, str | list]]:
    """(where, document) records of a user corpus, in file order: a text (str) or chat messages (list).

    ``where`` names the record in messages: ``path:line`` (JSONL) or ``path row N`` (parquet, 1-based).
    """
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
            cols = [c for c in ("text", "messages") if c in schema.names]
            if not cols:
                raise OscarError(f"parquet corpus {path} has no 'text' or 'messages' column "
                                 f"(columns: {', '.join(schema.names)})")
            rows = pq.read_table(path, columns=cols).to_pylist()
            recs = []
            for n, row in enumerate(rows, 1):
                if row.get("text") is None and row.get("messages") is None:
                    continue  # a null row, as a blank line in JSONL
                recs.append((f"{path} row {n}", _record(row, f"{path} row {n}")))
        elif low.endswith((".jsonl", ".ndjson")):
            recs = []
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise OscarError(f"{path}:{n}: invalid JSON ({e.msg})") from None
                    if not isinstance(obj, dict):
                        raise OscarError(f"{path}:{n}: each line must be an object with a string 'text' field "
                                         "or a 'messages' list")
                    recs.append((f"{path}:{n}", _record(obj, f"{path}:{n}")))
        elif low.endswith(".json"):
            raise OscarError(f"{path}: JSON corpora must be JSON Lines (.jsonl, one {{\"text\": ...}} per line)")
        else:  # plain text: documents separated by blank lines
            with open(path, encoding="utf-8") as f:
                recs = [(path, t) for t in re.split(r"\n[ \t]*\n", f.read())]
    except UnicodeDecodeError as e:
        raise OscarError(f"corpus {path} is not UTF-8 text: {e}") from None
    except PermissionError:
        raise OscarError(f"corpus file is not readable: {path}") from None
    return [(w, d.strip() if isinstance(d, str) else d) for w, d in recs if not isinstance(d, str) or d.strip()]


def render_chat(tokenizer, messages: list[dict], where: str) -> str:
    """A chat record as the text the model is served: its tokenizer's chat template, untokenized."""
    if tokenizer is None:
        raise OscarError(f"{where}: 'messages' records are rendered with the model's chat template; this command "
                         "reads the corpus without a tokenizer: give it 'text' records")
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise OscarError(f"{where}: a 'messages' record needs a chat template, and the tokenizer {name!r} has none; "
                         "give this corpus as 'text' records")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception as e:  # a template may refuse a record (e.g. roles that do not alternate)
        why = str(e).splitlines()[0] if str(e).strip() else type(e).__name__
        raise OscarError(f"{where}: the chat template refuses this record: {why}") from None


def _keyed_docs(spec: str) -> tuple[list[tuple[str, str]], dict[int, tuple[str, list]], str, str]:
    """(docs as (key, text) pairs, chat records by index in docs -> (where, messages), name, source).

    A chat record's text is its canonical JSON until rendered: what the split sees."""
    chat: dict[int, tuple[str, list]] = {}
    if spec == "pydoc":
        docs = [(k, topics[k].strip()) for k in sorted(topics)]
        name, source = "pydoc", "pydoc_data.topics"
    else:
        path = os.path.expanduser(spec)
        docs = []
        for where, d in _read_docs(path):
            if isinstance(d, list):
                chat[len(docs)] = (where, d)
                d = json.dumps(d, sort_keys=True, ensure_ascii=False)
            docs.append((_sha(d), d))  # key = sha256 of the text: duplicates split together
        name, source = os.path.basename(path), os.path.abspath(path)
    if not docs:
        raise OscarError(f"corpus {spec!r} is empty: no non-blank text")
    return docs, chat, name, source


def first_chat_record(spec: str) -> str | None:
    """Where the first 'messages' record of corpus `spec` is (``path:line``), or None: for the commands that
    read a corpus without a tokenizer, to refuse a chat corpus before any work."""
    if spec == "pydoc":
        return None
    _, chat, _, _ = _keyed_docs(spec)
    return chat[min(chat)][0] if chat else None


def load_corpus(spec: str = "pydoc", heldout_fraction: float = 0.2, tokenizer=None) -> Corpus:
    """``pydoc`` (CPython's pydoc_data.topics) or a path to .parquet (text / messages columns), .jsonl (text /
    messages fields) or text.

    A chat record (``messages``) is rendered with `tokenizer`'s chat template after the split: the split
    sees its canonical JSON, so which record is held out does not depend on the model, while the
    fingerprint covers the rendered text (another template, another corpus fingerprint).
    """
    docs, chat, name, source = _keyed_docs(spec)
    held = heldout_indices(docs, heldout_fraction)
    texts = [render_chat(tokenizer, chat[i][1], chat[i][0]) if i in chat else t for i, (_, t) in enumerate(docs)]
    cal = [t for i, t in enumerate(texts) if i not in held]
    ho = [t for i, t in enumerate(texts) if i in held]
    rule = SPLIT_RULE.format(f=heldout_fraction)
    fp = fingerprint({"calibration": _sha("\x00".join(cal)), "heldout": _sha("\x00".join(ho)), "split": rule})
    return Corpus(name=name, fingerprint=fp, split=rule, calibration=cal, heldout=ho,
                  heldout_fraction=heldout_fraction, source=source, chat_records=len(chat))


# ---------------------------------------------------------------- size without a tokenizer

# Characters per token of pydoc's calibration split under SmolLM2's tokenizer (372,007 characters,
# 89,817 tokens); a manifest is sized before any tokenizer is at hand. Another tokenizer is assumed to
# land within TOKENS_UNCERTAINTY of the estimate: a budget is refused only beyond that.
CHARS_PER_TOKEN = 4.14
TOKENS_UNCERTAINTY = 0.5


@dataclass
class SizeEstimate:
    name: str
    chars: int   # characters of the calibration split
    tokens: int  # chars / CHARS_PER_TOKEN

    @property
    def most_tokens(self) -> int:
        """The most tokens a tokenizer is assumed to get out of it (the estimate plus its uncertainty)."""
        return int(self.tokens * (1 + TOKENS_UNCERTAINTY))

    def describe(self) -> str:
        return (f"corpus {self.name!r}: calibration split of {self.chars:,} characters, about {self.tokens:,} tokens "
                f"({CHARS_PER_TOKEN} characters per token on SmolLM2's tokenizer; another tokenizer assumed "
                f"within {TOKENS_UNCERTAINTY:.0%})")


def estimate_size(spec: str, heldout_fraction: float = 0.2) -> SizeEstimate | None:
    """The calibration split's size in characters and estimated tokens, without a tokenizer; None for a
    file not readable here."""
    if spec != "pydoc" and not os.path.isfile(os.path.expanduser(spec)):
        return None
    docs, chat, _, _ = _keyed_docs(spec)
    held = heldout_indices(docs, heldout_fraction)
    # A chat record counts its contents only: a lower bound of the rendered text (the template adds role
    # markers), so the estimate never refuses a budget because of a template.
    chars = sum(sum(len(m["content"]) for m in chat[i][1]) if i in chat else len(t)
                for i, (_, t) in enumerate(docs) if i not in held)
    return SizeEstimate(spec, chars, round(chars / CHARS_PER_TOKEN))


# ---------------------------------------------------------------- blocks


class CorpusTooSmall(OscarError):
    """A block plan asks for more than the text gives; `tokens` / `seqs` say what it gives (real tokens,
    sequences of `seq_len` with at least one), for the caller to word the refusal in its own flags."""

    def __init__(self, msg: str, *, tokens: int, seqs: int, seq_len: int):
        super().__init__(msg)
        self.tokens, self.seqs, self.seq_len = tokens, seqs, seq_len


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
    supply_tokens: int = 0  # real tokens (BOS included) the whole stream gives before max_tokens
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
        raise CorpusTooSmall(f"corpus too small: {len(stream)} tokens, one sequence of seq_len={seq_len} needs {body}"
                         + (" after BOS" if add_bos else ""), tokens=len(stream), seqs=0, seq_len=seq_len)
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
    supply = int(mask.sum())
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
            raise CorpusTooSmall(f"num_blocks={num_blocks} but the corpus gives only {n_seq} sequences of {seq_len} "
                                 f"tokens ({int(mask.sum()):,} tokens)", tokens=int(mask.sum()), seqs=n_seq,
                                 seq_len=seq_len)
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
                     corpus_tokens=int(len(stream)), supply_tokens=supply)
