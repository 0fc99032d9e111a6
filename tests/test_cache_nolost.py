"""OscarCache never loses work: length checked before decoding, max_len enforced, tokens kept on exhaustion,
reuse for a new prompt refused (or an explicit reset)."""

from __future__ import annotations

import pytest
import torch

from helpers.artifacts import SMALL, random_artifact, tiny_model  # SMALL: sink 4, recent 16, pages of 4
from oscar.common import OscarError
from oscar.kernels.cache import OscarCache
from oscar.kernels.generation import CacheFull, generate
from oscar.kernels.paged import PoolExhausted


@pytest.fixture(scope="module")
def setup():
    m = tiny_model("llama")
    return m, random_artifact(m.config)


def _ids(T, seed=0):
    return torch.randint(3, 90, (1, T), generator=torch.Generator().manual_seed(seed))


def _greedy(m, art, ids, n, **kw):
    c = OscarCache.from_artifact(m, art, **SMALL, **kw)
    return m.generate(ids, past_key_values=c, max_new_tokens=n, do_sample=False, min_new_tokens=n)


def test_length_checked_before_decoding(setup):
    m, art = setup
    c = OscarCache.from_artifact(m, art, max_pages=4, **SMALL)  # room: 4 + 16 + 5 * 4 - 1 = 39 tokens
    assert c.capacity(1) == 39
    with pytest.raises(OscarError, match=r"can hold 39 tokens per sequence.*\(30\) \+ max_new_tokens \(20\) = 50"):
        generate(m, c, _ids(30), max_new_tokens=20, do_sample=False)
    assert c.get_seq_length() == 0  # nothing computed, the cache is untouched
    out = generate(m, c, _ids(30), max_new_tokens=9, do_sample=False, min_new_tokens=9)  # 39 fits
    assert out.shape == (1, 39)


def test_exhaustion_mid_generate_keeps_the_tokens(setup):
    m, art = setup
    c = OscarCache.from_artifact(m, art, max_pages=4, **SMALL)
    with pytest.raises(CacheFull, match="the tokens generated are in") as e:
        generate(m, c, _ids(30), max_new_tokens=40, allow_partial=True, do_sample=False, min_new_tokens=40)
    got = e.value.sequences
    assert got.shape == (1, 40) and c.get_seq_length() == 39  # 10 tokens generated and kept; all 39 cached
    ref = _greedy(m, art, _ids(30), 10, max_len=64)  # the same tokens an unconstrained cache produces
    assert torch.equal(got, ref)


def test_shared_pool_running_out_mid_decode_keeps_the_tokens(setup):
    """A fork shares the pool: what it takes is only known during decoding; the tokens produced survive."""
    m, art = setup
    a = OscarCache.from_artifact(m, art, max_pages=8, max_seqs=2, **SMALL)
    from oscar.kernels.generation import prefill

    prefill(m, a, _ids(24))
    b = a.fork()
    before = a.capacity()
    prefill(m, b, _ids(12, seed=1))  # b appends 12 tokens: 3 more pages taken from the shared pool
    room = a.capacity()
    assert room == before - 3 * 4
    with pytest.raises(OscarError, match=f"can hold {room} tokens"):  # refused up front, nothing lost
        generate(m, a, torch.cat([_ids(24), _ids(4, seed=2)], 1), max_new_tokens=30, do_sample=False)
    assert a.get_seq_length() == 24
    with pytest.raises(CacheFull) as e:
        generate(m, a, torch.cat([_ids(24), _ids(4, seed=2)], 1), max_new_tokens=30, allow_partial=True,
                 do_sample=False, min_new_tokens=30)
    assert e.value.sequences.shape[1] == room + 1 and a.get_seq_length() == room


def test_max_len_enforced(setup):
    m, art = setup
    c = OscarCache.from_artifact(m, art, max_len=40, **SMALL)
    assert c.capacity(1) == 40
    with pytest.raises(OscarError, match="max_len=40"):  # the model.generate path, without the helper
        m.generate(_ids(30), past_key_values=c, max_new_tokens=20, do_sample=False, min_new_tokens=20)
    with pytest.raises(OscarError, match=r"can hold 40 tokens"):
        generate(m, OscarCache.from_artifact(m, art, max_len=40, **SMALL), _ids(30), max_new_tokens=11)
    out = generate(m, OscarCache.from_artifact(m, art, max_len=40, **SMALL), _ids(30), max_new_tokens=10,
                   do_sample=False, min_new_tokens=10)
    assert out.shape == (1, 40)


def test_reuse_for_new_prompt_refused_or_reset(setup):
    m, art = setup
    c = OscarCache.from_artifact(m, art, max_len=128, **SMALL)
    first = m.generate(_ids(40), past_key_values=c, max_new_tokens=5, do_sample=False, min_new_tokens=5)
    for T in (30, 60):  # shorter and longer than the cached 44 tokens: both refused, nothing silently wrong
        with pytest.raises(OscarError, match="reused for another prompt.*cache.reset"):
            m.generate(_ids(T, seed=3), past_key_values=c, max_new_tokens=3, do_sample=False)
    with pytest.raises(OscarError, match="reused for another prompt"):
        generate(m, c, _ids(30, seed=3), max_new_tokens=3)
    assert c.get_seq_length() == 44
    # continuing the cached conversation is allowed
    more = m.generate(torch.cat([first, _ids(3, seed=4)], 1), past_key_values=c, max_new_tokens=2, do_sample=False,
                      min_new_tokens=2)
    assert more.shape == (1, 50)
    c.reset()  # explicit: a new prompt on the same cache equals a fresh cache
    assert c.get_seq_length() == 0
    again = m.generate(_ids(30, seed=3), past_key_values=c, max_new_tokens=4, do_sample=False, min_new_tokens=4)
    assert torch.equal(again, _greedy(m, art, _ids(30, seed=3), 4, max_len=128))


def test_pool_exhausted_message_without_the_helper(setup):
    m, art = setup
    c = OscarCache.from_artifact(m, art, max_pages=2, **SMALL)
    with pytest.raises(PoolExhausted, match="room for 31.*keeps the tokens"):
        m.generate(_ids(40), past_key_values=c, max_new_tokens=2, do_sample=False)
    assert c.get_seq_length() == 0  # refused by layer 0: no layer holds a partial chunk
