"""Corpora (pydoc split, user files) and block plans."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest

from oscar.common import OscarError
from oscar.pipeline import corpus as C
from oscar.pipeline import models as M


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.getbasetemp() / "oscar-cache"  # shared with test_models in one session
    old = os.environ.get("OSCAR_CACHE")
    os.environ["OSCAR_CACHE"] = str(d)
    yield M.load_tokenizer("tiny-llama")  # SmolLM2's tokenizer
    if old is None:
        os.environ.pop("OSCAR_CACHE", None)
    else:
        os.environ["OSCAR_CACHE"] = old


# ---------------------------------------------------------------- pydoc split


def test_pydoc_split_disjoint_complete_deterministic(tok):
    from pydoc_data.topics import topics

    c = C.load_corpus("pydoc")
    assert c.name == "pydoc" and c.fingerprint == C.load_corpus().fingerprint
    assert C.load_corpus("pydoc").calibration == c.calibration
    assert not set(c.calibration) & set(c.heldout)
    assert sorted(c.calibration + c.heldout) == sorted(v.strip() for v in topics.values())
    assert 0.15 <= c.num_chars["heldout"] / sum(c.num_chars.values()) <= 0.2
    n_cal = len(C._token_stream(tok, c.calibration))
    n_ho = len(C._token_stream(tok, c.heldout))
    assert n_ho / (n_cal + n_ho) >= 0.15
    assert n_ho >= 8192 + 4096  # an 8k haystack and a 4k perplexity window
    assert C.load_corpus("pydoc", heldout_fraction=0.3).fingerprint != c.fingerprint
    assert c.to_dict()["split"] == c.split and "sha256" in c.split


def test_split_ignores_input_order_and_python_hash():
    docs = [(f"k{i}", "x" * (10 + i)) for i in range(50)]
    cal, ho = C.split_documents(docs, 0.2)
    shuffled = docs[:]
    random.Random(1).shuffle(shuffled)
    cal2, ho2 = C.split_documents(shuffled, 0.2)
    assert set(cal) == set(cal2) and set(ho) == set(ho2)
    assert sum(map(len, ho)) <= 0.2 * sum(len(t) for _, t in docs)
    assert C.split_documents(docs, 0.0) == ([t for _, t in docs], [])
    assert C.split_documents([("a", "only")], 0.5) == (["only"], [])  # never every document
    with pytest.raises(OscarError, match="heldout_fraction"):
        C.split_documents(docs, 1.0)


# ---------------------------------------------------------------- user corpora


def _texts(n=12):
    return [f"Document {i}. " + "word " * (20 + 7 * i) for i in range(n)]


def test_parquet_jsonl_txt_loaders_agree(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = _texts()
    pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), tmp_path / "c.parquet")
    with open(tmp_path / "c.jsonl", "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t, "meta": 1}) + "\n\n")  # blank lines are skipped
    (tmp_path / "c.txt").write_text("\n\n  \n".join(texts) + "\n")
    cs = [C.load_corpus(str(tmp_path / f)) for f in ("c.parquet", "c.jsonl", "c.txt")]
    for c in cs:
        assert sorted(c.calibration + c.heldout) == sorted(t.strip() for t in texts)
        assert c.heldout and c.calibration
    assert cs[0].fingerprint == cs[1].fingerprint == cs[2].fingerprint  # same texts, same split
    assert cs[0].name == "c.parquet" and cs[0].source == str(tmp_path / "c.parquet")


def test_user_corpus_errors(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    with pytest.raises(OscarError, match="not found"):
        C.load_corpus(str(tmp_path / "missing.txt"))
    with pytest.raises(OscarError, match="directory"):
        C.load_corpus(str(tmp_path))
    (tmp_path / "blank.txt").write_text("\n   \n\n\t\n")
    with pytest.raises(OscarError, match="empty"):
        C.load_corpus(str(tmp_path / "blank.txt"))
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "nocol.parquet")
    with pytest.raises(OscarError, match="no 'text' or 'messages' column.*body"):
        C.load_corpus(str(tmp_path / "nocol.parquet"))
    pq.write_table(pa.table({"text": ["", "  ", None]}), tmp_path / "empty.parquet")
    with pytest.raises(OscarError, match="empty"):
        C.load_corpus(str(tmp_path / "empty.parquet"))
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{broken\n')
    with pytest.raises(OscarError, match="bad.jsonl:2: invalid JSON"):
        C.load_corpus(str(tmp_path / "bad.jsonl"))
    (tmp_path / "nofield.jsonl").write_text('{"body": "ok"}\n')
    with pytest.raises(OscarError, match="string 'text' field"):
        C.load_corpus(str(tmp_path / "nofield.jsonl"))
    (tmp_path / "arr.json").write_text('[{"text": "a"}]')
    with pytest.raises(OscarError, match="JSON Lines"):
        C.load_corpus(str(tmp_path / "arr.json"))
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(OscarError, match="not UTF-8"):
        C.load_corpus(str(tmp_path / "bin.txt"))
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(OscarError, match="cannot read parquet"):
        C.load_corpus(str(tmp_path / "junk.parquet"))


# ---------------------------------------------------------------- blocks


def test_blocks_cover_stream_with_eos_and_padding(tok):
    texts = _texts(5)
    stream = C._token_stream(tok, texts)
    eos = tok.eos_token_id
    assert (stream == eos).sum() == 5 and stream[-1] == eos
    p = C.make_blocks(tok, texts, seq_len=64, seqs_per_block=3)
    n_seq = -(-len(stream) // 64)
    assert p.tokens.dtype == np.int32 and p.mask.dtype == np.uint8
    assert p.tokens.shape == p.mask.shape == (-(-n_seq // 3), 3, 64)
    assert p.num_tokens == len(stream) == int(p.mask.sum()) and p.num_seqs == n_seq
    np.testing.assert_array_equal(p.tokens.reshape(-1)[: len(stream)], stream)  # stream order kept
    assert (p.mask.reshape(-1)[: len(stream)] == 1).all() and (p.mask.reshape(-1)[len(stream):] == 0).all()
    assert (p.tokens.reshape(-1)[len(stream):] == p.pad_id).all()
    q = C.make_blocks(tok, texts, seq_len=64, seqs_per_block=3)
    assert p.fingerprint == q.fingerprint and np.array_equal(p.tokens, q.tokens)
    assert C.make_blocks(tok, texts[::-1], seq_len=64, seqs_per_block=3).fingerprint != p.fingerprint
    assert not p.add_bos  # SmolLM2's tokenizer adds no BOS by itself
    assert json.dumps(p.to_dict())


def test_block_options(tok):
    texts = _texts(8)
    n = len(C._token_stream(tok, texts))
    p = C.make_blocks(tok, texts, seq_len=32, block_tokens=100)
    assert p.seqs_per_block == 3
    p = C.make_blocks(tok, texts, seq_len=32, num_blocks=4)
    n_seq = -(-n // 32)
    assert p.num_blocks == 4 and p.seqs_per_block == n_seq // 4
    assert p.num_tokens == min(n, 4 * (n_seq // 4) * 32)
    p = C.make_blocks(tok, texts, seq_len=32, max_tokens=100, seqs_per_block=2)
    assert p.num_tokens == 100 and p.tokens.shape == (2, 2, 32)
    assert p.mask[1, 1].sum() == 4 and (p.tokens[1, 1, 4:] == p.pad_id).all()
    p = C.make_blocks(tok, texts, seq_len=32, add_bos=True)
    assert (p.tokens[:, 0, 0] == tok.bos_token_id).all() and p.add_bos
    np.testing.assert_array_equal(p.tokens[:, 0, 1:].reshape(-1)[: 31 * 3], C._token_stream(tok, texts)[: 31 * 3])
    assert p.num_tokens == n + p.num_seqs


def test_block_errors(tok):
    texts = ["a short text"]
    n = len(C._token_stream(tok, texts))
    with pytest.raises(OscarError, match="seq_len must be a positive integer"):
        C.make_blocks(tok, texts, seq_len=0)
    with pytest.raises(OscarError, match=f"corpus too small: {n} tokens"):
        C.make_blocks(tok, texts, seq_len=n + 1)
    with pytest.raises(OscarError, match="at most one of"):
        C.make_blocks(tok, texts, seq_len=2, seqs_per_block=1, block_tokens=4)
    with pytest.raises(OscarError, match="smaller than one sequence"):
        C.make_blocks(tok, texts, seq_len=4, block_tokens=2)
    with pytest.raises(OscarError, match="num_blocks=99"):
        C.make_blocks(tok, texts, seq_len=2, num_blocks=99)
    with pytest.raises(OscarError, match="max_tokens must be >= 1"):
        C.make_blocks(tok, texts, seq_len=2, max_tokens=0)
    assert C.make_blocks(tok, texts, seq_len=n).num_tokens == n  # exactly one full sequence
