"""Chat-formatted calibration text: 'messages' records (JSONL field or parquet column) rendered with the
model's chat template before tokenizing; refusals name the file and the record; the corpus fingerprint
follows the rendered text, so a store made under another template is not resumed."""

from __future__ import annotations

import copy
import json
import os

import numpy as np
import pytest

from oscar.common import OscarError
from oscar.pipeline import corpus as C
from oscar.pipeline import models as M

CHATS = [[{"role": "user", "content": f"What does function number {i} return?"},
          {"role": "assistant", "content": f"It returns {i} squared, that is {i * i}. " + "More words. " * i}]
         for i in range(10)]
OTHER_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.getbasetemp() / "oscar-cache"  # shared with test_models in one session
    old = os.environ.get("OSCAR_CACHE")
    os.environ["OSCAR_CACHE"] = str(d)
    yield M.load_tokenizer("tiny-llama")  # SmolLM2's tokenizer, which has a chat template
    if old is None:
        os.environ.pop("OSCAR_CACHE", None)
    else:
        os.environ["OSCAR_CACHE"] = old


def _jsonl(path, records) -> str:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return str(path)


def _with_template(tok, template):
    t = copy.deepcopy(tok)
    t.chat_template = template
    return t


def test_messages_are_rendered_with_the_chat_template_exact_ids(tok, tmp_path):
    assert tok.chat_template  # the premise: SmolLM2's tokenizer ships one
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHATS])
    c = C.load_corpus(path, heldout_fraction=0.0, tokenizer=tok)  # everything calibrates, in file order
    assert c.chat_records == len(CHATS) and c.to_dict()["chat_records"] == len(CHATS)
    assert c.calibration == [tok.apply_chat_template(m, tokenize=False) for m in CHATS]
    # the token ids, built independently: the template applied here, each record then EOS
    want = []
    for m in CHATS:
        want += tok(tok.apply_chat_template(m, tokenize=False), add_special_tokens=False)["input_ids"]
        want.append(tok.eos_token_id)
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    assert want.count(im_start) >= 2 * len(CHATS)  # the template's markers are special tokens, not text
    p = C.make_blocks(tok, c.calibration, seq_len=64, seqs_per_block=2)
    np.testing.assert_array_equal(p.tokens.reshape(-1)[: len(want)], want)
    assert p.num_tokens == len(want)


def test_parquet_messages_column_and_split_independent_of_the_template(tok, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHATS])
    pq.write_table(pa.table({"messages": CHATS}), tmp_path / "chat.parquet")
    a = C.load_corpus(path, tokenizer=tok)
    b = C.load_corpus(str(tmp_path / "chat.parquet"), tokenizer=tok)
    assert a.fingerprint == b.fingerprint and a.calibration == b.calibration and a.heldout
    # another template: the same records held out, another fingerprint (the rendered text changed)
    other = _with_template(tok, OTHER_TEMPLATE)
    o = C.load_corpus(path, tokenizer=other)
    assert o.fingerprint != a.fingerprint
    held = [m for m in CHATS if tok.apply_chat_template(m, tokenize=False) in a.heldout]
    assert o.heldout == [other.apply_chat_template(m, tokenize=False) for m in held]


def test_mixed_text_and_messages_records(tok, tmp_path):
    recs = [{"text": "Plain prose, used as it is."}, {"messages": CHATS[0]}, {"text": "More prose."}]
    c = C.load_corpus(_jsonl(tmp_path / "mixed.jsonl", recs), heldout_fraction=0.0, tokenizer=tok)
    assert c.calibration == ["Plain prose, used as it is.", tok.apply_chat_template(CHATS[0], tokenize=False),
                             "More prose."]
    assert c.chat_records == 1
    # a text-only file keeps the fingerprint it always had (no chat key in the store's corpus record)
    t = C.load_corpus(_jsonl(tmp_path / "t.jsonl", [recs[0], recs[2]]), tokenizer=tok)
    assert "chat_records" not in t.to_dict()


def test_chat_refusals_name_the_file_and_record(tok, tmp_path):
    ok = {"messages": CHATS[0]}
    cases = [([ok, {"text": "x"}, {"messages": [{"role": "user"}]}], r"bad\.jsonl:3: 'messages' must be"),
             ([ok, {"messages": []}], r"bad\.jsonl:2: 'messages' must be"),
             ([ok, {"messages": "hello"}], r"bad\.jsonl:2: 'messages' must be"),
             ([{"text": "x", "messages": CHATS[1]}], r"bad\.jsonl:1: .*either a 'text' or a 'messages'"),
             ([{"text": 3}], r"bad\.jsonl:1: .*string 'text' field or a 'messages' list")]
    for recs, pat in cases:
        with pytest.raises(OscarError, match=pat) as e:
            C.load_corpus(_jsonl(tmp_path / "bad.jsonl", recs), tokenizer=tok)
        assert "\n" not in str(e.value)
    # no chat template: refused by name, at the first chat record
    path = _jsonl(tmp_path / "c.jsonl", [{"text": "prose"}, {"text": "more"}, ok, ok])
    with pytest.raises(OscarError, match=r"c\.jsonl:3: a 'messages' record needs a chat template, and the "
                                         r"tokenizer .* has none"):
        C.load_corpus(path, tokenizer=_with_template(tok, None))
    with pytest.raises(OscarError, match=r"c\.jsonl:3: 'messages' records are rendered with the model's chat "
                                         r"template; this command reads the corpus without a tokenizer"):
        C.load_corpus(path)
    with pytest.raises(OscarError, match=r"c\.jsonl:3: the chat template refuses this record: no"):
        C.load_corpus(path, tokenizer=_with_template(tok, "{{ raise_exception('no') }}"))


def test_parquet_refusals_name_the_row(tok, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a", None, "c"], "messages": [None, CHATS[0], CHATS[1]]}), tmp_path / "p.parquet")
    with pytest.raises(OscarError, match=r"p\.parquet row 3: .*either a 'text' or a 'messages'"):
        C.load_corpus(str(tmp_path / "p.parquet"), tokenizer=tok)
    pq.write_table(pa.table({"text": ["a", None], "messages": [None, CHATS[0]]}), tmp_path / "q.parquet")
    c = C.load_corpus(str(tmp_path / "q.parquet"), heldout_fraction=0.0, tokenizer=tok)
    assert c.calibration == ["a", tok.apply_chat_template(CHATS[0], tokenize=False)]


def test_estimate_counts_chat_contents_without_a_tokenizer(tmp_path):
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHATS])
    est = C.estimate_size(path, heldout_fraction=0.0)
    assert est.chars == sum(len(x["content"]) for m in CHATS for x in m)
    assert est.tokens == round(est.chars / C.CHARS_PER_TOKEN)
    assert C.estimate_size(str(tmp_path / "nowhere.jsonl")) is None
