"""A calibration budget the corpus cannot supply is refused in one line, before the model is loaded or any
store is created: `oscar calibrate` (one process and --ray) with --blocks / --tokens / --seq-len beyond the
calibration split, and `oscar plan` / `oscar cluster render` against the corpus's estimated size. A store
made from chat records under one template is not resumed under another."""

from __future__ import annotations

import copy
import json
import re

import pytest

from oscar.__main__ import main
from oscar.common import OscarError
from oscar.pipeline import corpus as C
from oscar.pipeline import models as M
from oscar.pipeline.calibrate import CalibConfig, prepare_store

GIVES = r"gives [\d,]+ tokens = \d+ sequence\(s\) of (\d+) = \d+ block\(s\) of \d+ sequence\(s\)"


@pytest.fixture
def no_model(monkeypatch):
    """Loading weights, or starting Ray, fails the test: refusals come before either."""
    import oscar.cluster.pipeline as P

    def loaded(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(M, "load_model", loaded)
    monkeypatch.setattr(P, "connect", loaded)


def _refused(argv, capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("ray", [[], ["--ray", "local", "--stages", "2"]], ids=["single", "ray"])
def test_calibrate_refuses_more_than_the_corpus_gives(tmp_path, capsys, no_model, ray):
    store = tmp_path / "runs" / "s.zarr"
    base = ["calibrate", *ray, "--model", "tiny-llama", "--store", str(store), "--no-progress", "--seq-len", "512"]
    err = _refused(base + ["--blocks", "999"], capsys)
    m = re.search(r"--blocks 999 asks for more than the calibration split gives: corpus 'pydoc' " + GIVES
                  + r"; pass a larger calibration text with --corpus FILE, or at most --blocks (\d+)", err)
    assert m and m.group(1) == "512", err
    err = _refused(base + ["--tokens", "10000000"], capsys)
    m = re.search(r"--tokens 10,000,000 asks for more than the calibration split gives: corpus 'pydoc' " + GIVES
                  + r"; pass a larger calibration text with --corpus FILE, or at most --tokens (\d+)", err)
    assert m, err
    most = int(m.group(2))
    assert 80_000 < most < 100_000  # SmolLM2's tokens of the pydoc split (89,817 plus no BOS)
    err = _refused(base + ["--tokens", str(most), "--blocks", "9999"], capsys)  # under a cap: says so
    assert f"corpus 'pydoc' under --tokens {most:,} gives" in err
    err = _refused(base[:-1] + ["200000"], capsys)
    assert "less than one sequence of --seq-len 200000; pass a larger calibration text" in err
    assert not (tmp_path / "runs").exists()  # nothing left behind


def test_tokens_the_corpus_gives_exactly_are_accepted(tmp_path, monkeypatch):
    """The refusal is tight: --tokens equal to what the split gives builds the store (with every token)."""
    cfg = CalibConfig(model="tiny-llama", store=str(tmp_path / "a.zarr"), seq_len=4096, tokens=10**7)
    with pytest.raises(OscarError, match=r"at most --tokens (\d+)") as e:
        prepare_store(cfg)
    most = int(re.search(r"at most --tokens (\d+)", str(e.value)).group(1))
    meta, _ = prepare_store(CalibConfig(model="tiny-llama", store=str(tmp_path / "b.zarr"), seq_len=4096, tokens=most))
    from oscar.pipeline.store import CalibStore

    assert int(CalibStore(str(tmp_path / "b.zarr")).array("mask")[:].sum()) == most


def test_store_of_chat_records_is_not_resumed_under_another_template(tmp_path):
    tok = M.load_tokenizer("tiny-llama")
    chats = [[{"role": "user", "content": f"Question {i}? " + "words " * 40},
              {"role": "assistant", "content": f"Answer {i}. " + "more " * 40}] for i in range(12)]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats))
    cfg = dict(model="tiny-llama", corpus=str(path), store=str(tmp_path / "s.zarr"), seq_len=64, sink=4)
    meta, _ = prepare_store(CalibConfig(**cfg), tokenizer=tok)
    assert meta.corpus["chat_records"] == 12
    prepare_store(CalibConfig(**cfg), tokenizer=tok)  # the same template: resumable
    other = copy.deepcopy(tok)
    other.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    with pytest.raises(OscarError, match=r"was made from corpus 'chat.jsonl' \(fingerprint \w+\), not 'chat.jsonl'"):
        prepare_store(CalibConfig(**cfg), tokenizer=other)


GLM = ["--model", "glm-4.7", "--stages", "2", "--gpus-per-stage", "8", "--gpu-mem", "80"]


def test_plan_checks_its_blocks_against_the_corpus(tmp_path, capsys):
    est = C.estimate_size("pydoc")
    assert (est.chars, est.tokens) == (372_007, round(372_007 / 4.14))
    assert main(["plan", *GLM]) == 0  # default: as many blocks as the corpus gives
    out = capsys.readouterr().out
    assert "3 blocks: 2.5 GiB" in out and "note: corpus 'pydoc': calibration split of 372,007 characters, about " \
                                          "89,857 tokens" in out
    err = _refused(["plan", *GLM, "--blocks", "64"], capsys)
    assert ("--blocks 64 (x 8 sequences x 4096 = 2,097,152 tokens) asks for more than the corpus gives: corpus "
            "'pydoc': calibration split of 372,007 characters, about 89,857 tokens") in err
    assert "pass --corpus with a larger file, or --blocks 3 or fewer" in err
    assert main(["plan", *GLM, "--blocks", "4"]) == 0  # within the estimate's uncertainty (4 x 32k < 1.5 x 90k)
    capsys.readouterr()
    big = tmp_path / "big.txt"
    big.write_text("\n\n".join(f"Paragraph {i}. " + "Some calibration prose here. " * 40 for i in range(9000)))
    assert main(["plan", *GLM, "--blocks", "64", "--corpus", str(big)]) == 0
    assert "64 blocks: 52.5 GiB" in capsys.readouterr().out


RENDER = ["cluster", "render", "--image", "i", "--nodes", "2", "--gpus-per-node", "8", "--gpu-mem", "80",
          "--cpus-per-node", "32", "--memory-per-node", "256", "--model", "/data/models/GLM-4.7", "--model-config",
          "glm-4.7", "--store", "/data/calib/glm47.zarr", "--pvc", "oscar-data"]


def test_render_checks_the_manifest_budget_against_the_corpus(tmp_path, capsys):
    err = _refused(RENDER + ["--out", str(tmp_path / "a"), "--tokens", "2097152"], capsys)
    assert ("--tokens 2,097,152 asks for more than the corpus gives: corpus 'pydoc': calibration split of 372,007 "
            "characters, about 89,857 tokens (4.14 characters per token on SmolLM2's tokenizer; another tokenizer "
            "assumed within 50%); pass --corpus with a larger file below /data, or --tokens 89857 or fewer; "
            "nothing written") in err
    assert not (tmp_path / "a").exists()
    assert main(RENDER + ["--out", str(tmp_path / "b")]) == 0
    text = (tmp_path / "b" / "rayjob.yaml").read_text()
    assert "store: 840 MiB per block, 3 blocks = 2.5 GiB" in text
    assert "about 89,857 tokens" in text and "3 block(s) of 8 x 4096 tokens (the whole split" in text
    # a corpus only the nodes see: the promised blocks are said to be unchecked
    assert main(RENDER + ["--out", str(tmp_path / "c"), "--corpus", "/data/corpus/calib.jsonl",
                          "--tokens", "2097152"]) == 0
    text = (tmp_path / "c" / "rayjob.yaml").read_text()
    assert "64 blocks = 52.5 GiB" in text and "corpus /data/corpus/calib.jsonl: not readable here, so 64 blocks" in text


def test_run_refuses_a_chat_corpus_before_any_stage(tmp_path):
    """`oscar run` validates on the corpus's held-out text, read without a chat template: a chat corpus is
    refused before calibrating, naming its first chat record."""
    from oscar.run import RunConfig, run_main

    path = tmp_path / "chat.jsonl"
    path.write_text('{"text": "prose"}\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    out = tmp_path / "run"
    with pytest.raises(OscarError, match=r"oscar run: .*chat\.jsonl:2 is a chat \('messages'\) record"):
        run_main(RunConfig(out=str(out), corpus=str(path)))
    assert not out.exists()
    assert C.first_chat_record("pydoc") is None


def test_plan_and_render_apply_the_recommended_budget(tmp_path, capsys):
    """Without --blocks / --tokens: the tokens recommended for the model's head_dim (1,024 per dimension) when the
    corpus gives more, passed to the job as --tokens; the whole corpus, said to be below it, when it gives less."""
    from oscar.cluster.plan import corpus_budget, recommended_tokens

    assert recommended_tokens(64) == 65_536 and recommended_tokens(128) == 131_072
    n, note = corpus_budget("pydoc", seq_len=4096, seqs_per_block=8, head_dim=64)  # 65,536 < ~89,857
    assert n == 2 and note.endswith("2 block(s) of 8 x 4096 tokens (the recommended 65,536 tokens for head_dim 64)")
    n, note = corpus_budget("pydoc", seq_len=4096, seqs_per_block=8, head_dim=128)  # GLM-4.7: more than pydoc gives
    assert n == 3 and "(the whole split; --corpus FILE for more); below the 131,072 tokens recommended" in note
    n, note = corpus_budget("pydoc", seq_len=4096, seqs_per_block=8, blocks=1, head_dim=64)
    assert n == 1 and note.endswith("below the 65,536 tokens recommended for head_dim 64 (docs/calibrate.md)")
    n, _ = corpus_budget("/data/not-here.jsonl", seq_len=4096, seqs_per_block=8, head_dim=128)
    assert n == 4  # unreadable here: the recommendation, 4 blocks of 32k

    tiny = RENDER[:RENDER.index("--model-config") + 1] + ["tiny-llama"] + RENDER[RENDER.index("--model-config") + 2:]
    assert main(tiny + ["--out", str(tmp_path / "t"), "--nodes", "1", "--gpus-per-node", "1", "--gpu-mem", "1"]) == 0
    text = (tmp_path / "t" / "rayjob.yaml").read_text()
    assert "--tokens 32768" in text  # tiny-llama: head_dim 32
    assert main(RENDER + ["--out", str(tmp_path / "g")]) == 0  # GLM-4.7: the whole pydoc split, no cap
    assert "--tokens" not in (tmp_path / "g" / "rayjob.yaml").read_text()


@pytest.mark.parametrize("what", ["niah", "ppl"])
def test_validation_refuses_a_chat_corpus_before_loading(what, tmp_path, capsys, monkeypatch):
    """Needles and perplexity read held-out text without a chat template: a corpus with 'messages' records is
    refused in one line naming the record, before any weights load and before --out is made."""
    import oscar.validate.env as env

    monkeypatch.setattr(env, "load_model", lambda *a, **k: pytest.fail("weights loaded"))
    f = tmp_path / "chat.jsonl"
    f.write_text(json.dumps({"text": "plain prose " * 20}) + "\n" +
                 json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}) + "\n")
    out = tmp_path / "out"
    assert main(["validate", what, "--model", "tiny-llama", "--methods", "bf16", "--corpus", str(f), "--lengths", "128",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{f}:2 is a chat ('messages') record" in err and err.count("\n") == 1 and not out.exists()
