"""README.md and docs/ describe the product by what it is: no work-process words (issue numbers, hypothesis
labels, session words), no document over 600 lines, and every decision record has a status and is listed in
docs/decisions/README.md."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAX_LINES = 600

# Work-process words: "issue 16" / "issue16" / "issues 15", "hypothesis 4" / "hypotheses 1 and 3", the labels
# H1..H9, and "session" in the sense of a working session ("this session", "session 6"; a process session,
# as Unix and Ray use the word, is a thing of the product and allowed).
WORDS = re.compile(r"(?<![a-z])issues?[\s_#-]*\d+|\bhypothes[ie]s\s+\d+|\bH[1-9]\b|(?<!process )\bsessions?\b", re.I)

def work_words(text: str) -> list[str]:
    """The work-process words in `text` (file names included: a path is named after what the file does)."""
    return [m.group(0) for m in WORDS.finditer(text)]


def _docs() -> list[pathlib.Path]:
    return [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


def _without_generated_blocks(text: str) -> str:
    """README's generated results block is the report's own output (`oscar report --readme`), checked
    byte for byte by tests/test_readme.py; its words are the report builder's, checked with the package."""
    return re.sub(r"<!-- BEGIN GENERATED.*?<!-- END GENERATED -->", "", text, flags=re.S)


def test_the_pattern_finds_work_words_and_spares_product_words():
    assert work_words("as issue 16 found") == ["issue 16"]
    assert work_words("Issue 16's goal") == ["Issue 16"]
    assert work_words("see issue16 and issues 15") == ["issue16", "issues 15"]
    assert work_words("(hypothesis 4 again)") == ["hypothesis 4"]
    assert work_words("hypotheses 1 and 3") == ["hypotheses 1"]
    assert work_words("`oscar-lm-int2` (H1) and H3") == ["H1", "H3"]
    assert work_words("unverified this session") == ["session"]
    assert work_words("in session 6 and between sessions") == ["session", "sessions"]
    assert work_words("`python bench/issue16_goal.py`, `tests/test_issue16_goal.py`") == ["issue16", "issue16"]
    # product words stay: GPUs, head dims, Unix process sessions, the Hadamard matrix, descriptive file names
    assert work_words("one H100 or H200; H P_br; D = 64; a process session at once") == []
    assert work_words("`python lab/goal_cells.py`, `lab/results/goal_qwen.md`") == []
    assert work_words("the issues this closes; tissue 5") == []


def test_readme_and_docs_hold_no_work_process_words():
    bad = []
    for p in _docs():
        text = p.read_text()
        if p.name == "README.md" and p.parent == ROOT:
            text = _without_generated_blocks(text)
        for i, line in enumerate(text.splitlines(), 1):
            bad += [f"{p.relative_to(ROOT)}:{i}: {w!r}" for w in work_words(line)]
    assert not bad, "work-process words (say what the thing is instead):\n" + "\n".join(bad)


def test_no_doc_is_over_600_lines():
    long = {str(p.relative_to(ROOT)): n for p in _docs() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"documents over {MAX_LINES} lines (split them): {long}"


def test_decision_records_have_a_title_and_status_and_are_indexed():
    d = ROOT / "docs" / "decisions"
    records = sorted(d.glob("[0-9][0-9][0-9][0-9]-*.md"))
    assert records, "no decision records in docs/decisions/"
    index = (d / "README.md").read_text()
    numbers = [r.name[:4] for r in records]
    assert len(set(numbers)) == len(numbers), "two records share a number"
    status = re.compile(r"^Status: (accepted|superseded by \d{4}|rejected)\b", re.M)
    for r in records:
        text = r.read_text()
        assert text.startswith("# "), f"{r.name}: the first line is the title (# ...)"
        assert status.search(text), f"{r.name}: no 'Status: accepted / superseded by NNNN / rejected' line"
        for n in re.findall(r"^Status: superseded by (\d{4})", text, re.M):
            assert list(d.glob(f"{n}-*.md")), f"{r.name}: superseded by {n}, which does not exist"
        assert f"]({r.name})" in index, f"{r.name} is not listed in docs/decisions/README.md"
    assert not (ROOT / "docs" / "decisions.md").exists(), "the single decisions file is split into docs/decisions/"
