"""Several samples x methods in one `RowBatchCache` compute what each sample's `MethodBatchCache` computes.

A tiny random-init Llama (GQA 2:1, head_dim 16); prompts of different lengths, right-padded questions,
rows leaving the batch mid-decode.
"""

import copy

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from helpers.artifacts import rotated_artifact
from oscar.common import OscarError
from oscar.stats import reference_recipe as rr
from oscar.stats.artifact import QuantConfig
from oscar.kernels.simulate import MethodBatchCache
from oscar.kernels.protocol import Protocol
from oscar.validate.niah import greedy
from oscar.kernels.rowbatch import ATTN, RowBatchCache, register
from oscar.scoring.rows import decode_rows


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=256, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval()


def _arts(config):
    return [None, rotated_artifact(config, QuantConfig(bits=2, page_size=4), 1),
            rotated_artifact(config, QuantConfig(bits=2, key_axis="channel", group_size=4), 2),
            rotated_artifact(config, rr.reference_quant_config(), 3)]


def _prefill(model, ids):
    c = DynamicCache()
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]), cache=c, use_cache=True)
    return c


@pytest.mark.parametrize("recent", [0, 6])
def test_rows_equal_each_samples_method_batch(tiny, recent):
    """Teacher-forced: two samples (contexts 37 and 45 tokens, questions 5 and 8), four methods each; the
    question chunk right-padded, then 10 steps, rows leaving the batch at steps 3 and 6. Every row's
    logits equal those of its sample's MethodBatchCache row."""
    arts = _arts(tiny.config)
    proto = Protocol("t", sink=4, recent=recent)
    g = torch.Generator().manual_seed(5)
    ctxs = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (37, 45)]
    qs = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (5, 8)]
    steps = torch.randint(0, 97, (8, 10), generator=g)  # a continuation per row
    drop = {3: {1, 6}, 6: {0, 5, 7}}  # step -> rows leaving after it
    exact = [_prefill(tiny, c) for c in ctxs]
    with torch.no_grad():
        want = {}
        for s in range(2):
            mb = MethodBatchCache.from_prefill(arts, proto, exact[s], capacity=80)
            lg = [tiny(input_ids=torch.tensor([qs[s]] * 4), cache=mb, use_cache=True).logits[:, -1]]
            lg += [tiny(input_ids=steps[4 * s:4 * s + 4, t:t + 1], cache=mb, use_cache=True).logits[:, -1] for t in range(10)]
            for m in range(4):
                want[4 * s + m] = torch.stack([x[m] for x in lg])  # (11, V)

        rb = RowBatchCache([arts, arts], proto, tiny.config.num_hidden_layers, capacity=80, dtype=torch.float32)
        for s in range(2):
            rb.load(s, exact[s])
        register()
        tiny.set_attn_implementation(ATTN)
        try:
            got = {r: [] for r in range(8)}
            t = 8
            ids = torch.tensor([qs[r // 4] + [0] * (t - len(qs[r // 4])) for r in range(8)])
            rb.set_chunk([len(qs[r // 4]) for r in range(8)])
            pos = torch.tensor(rb.lengths())[:, None] + torch.arange(t)
            lg = tiny(input_ids=ids, position_ids=pos, cache=rb, use_cache=True).logits
            rb.set_chunk(None)
            for r in range(8):
                got[r].append(lg[r, len(qs[r // 4]) - 1])
            for step in range(10):
                ids = steps[rb.order, step:step + 1]
                pos = torch.tensor(rb.lengths())[:, None]
                lg = tiny(input_ids=ids, position_ids=pos, cache=rb, use_cache=True).logits[:, -1]
                for s, r in enumerate(rb.order):
                    got[r].append(lg[s])
                if step in drop:
                    rb.keep([s for s, r in enumerate(rb.order) if r not in drop[step]])
        finally:
            tiny.set_attn_implementation("sdpa")
    for r in range(8):
        g_r = torch.stack(got[r])
        assert torch.allclose(g_r, want[r][:len(g_r)], atol=1e-5), (r, (g_r - want[r][:len(g_r)]).abs().max())
    assert len(got[1]) == 5 and len(got[0]) == 8 and len(got[2]) == 11
    assert (want[1] - want[0]).abs().max() > 1e-3 and (want[4] - want[0]).abs().max() > 1e-3  # rows really differ


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_rows_equals_greedy_per_sample(tiny, dtype):
    """The batched greedy answers equal `greedy` on each sample's MethodBatchCache: three samples of
    different lengths and budgets, an EOS id that some rows emit, one row with budget 0."""
    model = copy.deepcopy(tiny).to(dtype)
    arts = _arts(tiny.config)
    proto = Protocol("t", sink=4, recent=5)
    g = torch.Generator().manual_seed(6)
    ctxs = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (30, 41, 52)]
    qs = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (6, 3, 9)]
    budgets = [10, 7, 0]
    exact = [_prefill(model, c) for c in ctxs]

    def per_sample(eos):
        out = []
        for s in range(3):
            mb = MethodBatchCache.from_prefill(arts, proto, exact[s], capacity=80)
            out += greedy(model, mb, qs[s], budgets[s], eos, rows=4, threads=1)
        return out

    free = per_sample(set())
    eos = {free[0][-1], free[4][2]}  # tokens some rows emit mid-answer: those rows stop there
    want = per_sample(eos)
    rb = RowBatchCache([arts] * 3, proto, tiny.config.num_hidden_layers, capacity=80, dtype=dtype)
    for s in range(3):
        rb.load(s, exact[s])
    got = decode_rows(model, rb, [qs[r // 4] for r in range(12)], [budgets[r // 4] for r in range(12)], eos)
    assert model.config._attn_implementation == "sdpa"
    assert got == want
    lens = [len(x) for x in got]
    assert lens[8:] == [0] * 4 and lens[0] == 9 and 10 in lens[:4], lens  # EOS and budget stops in one sample
    if dtype == torch.float32:  # (in bf16 the tiny model's sample-1 rows all emit the second EOS id at step 3)
        assert lens[4] == 2 and 7 in lens[4:8], lens


def test_capacity_and_row_count_refused(tiny):
    arts = _arts(tiny.config)[:2]
    rb = RowBatchCache([arts], Protocol("t", sink=4), tiny.config.num_hidden_layers, capacity=20, dtype=torch.float32)
    with pytest.raises(OscarError, match="capacity"):
        rb.load(0, _prefill(tiny, list(range(25))))
    rb = RowBatchCache([arts], Protocol("t", sink=4), tiny.config.num_hidden_layers, capacity=20, dtype=torch.float32)
    rb.load(0, _prefill(tiny, list(range(15))))
    with pytest.raises(OscarError, match="budgets"):
        decode_rows(tiny, rb, [[1, 2]] * 2, [3], set())
    with pytest.raises(OscarError, match="capacity"):
        decode_rows(tiny, rb, [[1, 2]] * 2, [10, 10], set())
    assert tiny.config._attn_implementation == "sdpa"
