"""RULER-style synthetic long-context tasks, sized by the model's own tokenizer.

Written from the public task definitions of RULER (Hsieh et al., 2024,
NVIDIA/RULER `scripts/data/synthetic`): the same task families, needle
layouts and scoring, with our own templates, word lists and generators.

Tasks
- niah_single_1/2/3: one needle; haystack = noise sentences / held-out corpus
  text / held-out corpus text; value = 7-digit number / number / UUID.
- niah_multikey_1: 4 needles with different keys in corpus text, one asked.
- niah_multikey_2/3: the haystack is made of distractor needles (word-pair
  keys + numbers / UUID keys + UUIDs), one asked.
- niah_multivalue: one key, 4 values, all asked.
- niah_multiquery: 4 keys, all asked.
- vt: variable tracking, 1 chain of 4 hops in noise sentences.
- cwe: common words extraction (10 words that occur most in a numbered list).
- fwe: frequent words extraction (3 most frequent coded words, Zipf alpha 2).
- qa_1 / qa_2: question answering over documents from a SQuAD / HotpotQA JSON file the user gives
  (`--squad`, `--hotpotqa`): the question's gold document(s) (HotpotQA: every paragraph of its
  record; SQuAD: its paragraph, then the other paragraphs of the same article first among the
  distractors, as RULER) with other documents of the same file, shuffled, "Document N:" each, the
  question after them. Without the file these tasks are refused (named) or, under `--tasks all`,
  skipped with the reason (`resolve_tasks`).

Every prompt is split in two chunks for the strict protocol:
``context_ids`` (chat template head + instruction + haystack) and
``question_ids`` (question + end of user turn + assistant header + answer
prefix). ``len(context_ids) + len(question_ids) + max_new_tokens`` is the
target length within 2% (never above it); QA prompts grow in whole documents, so they end up to one
document (~100-200 tokens) below the target, as RULER's own QA prompts do.

Scoring follows RULER: ``string_match_all`` (fraction of references found in
the prediction, averaged) for every task but QA, ``string_match_part`` (any
reference found) for qa_1 / qa_2; both case-insensitive, in percent.
"""

from __future__ import annotations

import json
import os
import random
import string
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Callable

from oscar.common import OscarError, file_fingerprint
from oscar.validate.ruler_outputs import postprocess  # RULER's prediction cleanup (shared with the summary files)

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

# Own word lists for word-pair keys ("adjective-noun"), 80 x 80 = 6400 keys.
ADJECTIVES = """able acid angry arctic brave brief bright broad calm cheap clever cold cosmic crisp curly damp
dark deep dizzy dry dull eager early easy elder empty equal fair fancy fast fierce flat fresh
frozen gentle giant glad golden grand green happy harsh heavy hollow honest huge humble icy idle
jolly keen kind large late lazy light little lively loud lucky mellow mighty modern narrow neat noble
odd old pale plain polite proud quick quiet rapid rare rich rough round royal""".split()
NOUNS = """anchor apple arrow badge basket beacon bicycle blanket bottle bridge bucket butter cabin camera candle
canyon carpet castle cellar cherry cliff clock cloud comet copper cotton crayon desert dragon drum eagle
engine falcon feather fence forest fossil garden glacier guitar hammer harbor helmet island jacket jungle kettle
ladder lantern lemon magnet marble meadow mirror monkey mountain needle ocean orchard otter paddle parrot pebble
pencil pepper piano pillow planet pocket puzzle rabbit river rocket saddle tiger tower trumpet tunnel violin wagon""".split()
assert len(ADJECTIVES) == 80 and len(NOUNS) == 80, (len(ADJECTIVES), len(NOUNS))


@dataclass(frozen=True)
class TaskSpec:
    name: str
    kind: str  # niah | vt | cwe | fwe | qa
    haystack: str = "noise"  # noise | corpus | needle (niah only)
    key_type: str = "words"  # words | numbers | uuids
    value_type: str = "numbers"  # numbers | uuids
    num_keys: int = 1  # needles with distinct keys planted
    num_values: int = 1  # values per key
    num_queries: int = 1  # keys asked
    metric: str = "all"  # all | part
    dataset: str = ""  # qa only: squad | hotpotqa


TASKS: dict[str, TaskSpec] = {
    t.name: t
    for t in [
        TaskSpec("niah_single_1", "niah", "noise"),
        TaskSpec("niah_single_2", "niah", "corpus"),
        TaskSpec("niah_single_3", "niah", "corpus", value_type="uuids"),
        TaskSpec("niah_multikey_1", "niah", "corpus", num_keys=4),
        TaskSpec("niah_multikey_2", "niah", "needle"),
        TaskSpec("niah_multikey_3", "niah", "needle", key_type="uuids", value_type="uuids"),
        TaskSpec("niah_multivalue", "niah", "corpus", num_values=4),
        TaskSpec("niah_multiquery", "niah", "corpus", num_keys=4, num_queries=4),
        TaskSpec("vt", "vt", "noise"),
        TaskSpec("cwe", "cwe"),
        TaskSpec("fwe", "fwe"),
        TaskSpec("qa_1", "qa", metric="part", dataset="squad"),
        TaskSpec("qa_2", "qa", metric="part", dataset="hotpotqa"),
    ]
}

# The option that gives each QA dataset, and what it is.
QA_OPTIONS = {"squad": ("--squad", "a SQuAD v1.1 / v2.0 JSON file"),
              "hotpotqa": ("--hotpotqa", "a HotpotQA JSON file")}


@dataclass
class Sources:
    """Text the generators draw from: held-out corpus text only (never calibration)."""

    corpus_words: list[str]  # held-out text, whitespace-normalised, split on spaces
    vocab: list[str]  # distinct lowercase words for cwe (from the held-out text)
    name: str = "heldout"
    # more(n) -> at least n words of further text that is not calibration text, read only by a corpus
    # haystack longer than corpus_words (which would otherwise repeat the split: pydoc's held-out split
    # is ~7.7k words, a 32k-token Qwen haystack needs ~21k). None: such a haystack is refused.
    more: Callable[[int], list[str]] | None = field(default=None, repr=False)
    _more_words: list[str] = field(default_factory=list, repr=False)
    # QA documents and questions by dataset (squad, hotpotqa), read from the user's files (`load_qa`)
    qa: dict[str, "QaData"] = field(default_factory=dict, repr=False)

    def qa_data(self, task: str) -> "QaData":
        """The dataset a QA task reads, or the one-line refusal naming the option that gives it."""
        ds = TASKS[task].dataset
        if ds not in self.qa:
            opt, what = QA_OPTIONS[ds]
            raise OscarError(f"task {task} needs {opt} PATH ({what}); none was given")
        return self.qa[ds]

    @classmethod
    def from_text(cls, text: str, name: str = "heldout", more: Callable[[int], list[str]] | None = None) -> "Sources":
        words = text.split()
        if len(words) < 1000:
            raise OscarError(f"held-out text too short for haystacks ({len(words)} words, need >= 1000)")
        seen: dict[str, None] = {}
        for w in words:
            if w.isalpha() and w.islower() and 4 <= len(w) <= 10:
                seen.setdefault(w, None)
        return cls(corpus_words=words, vocab=sorted(seen), name=name, more=more)

    def haystack_words(self, n: int) -> list[str]:
        """The word list a corpus haystack of n words draws from: the held-out split, continued by
        `more` when n exceeds it, so that no haystack repeats text (samples within the split unchanged)."""
        W = self.corpus_words
        if n <= len(W):
            return W
        if self.more is None:
            raise OscarError(f"a corpus haystack of {n} words exceeds the {len(W)} held-out words of {self.name!r} "
                             "and would repeat them; give Sources a source of more held-out text (more=...)")
        if len(self._more_words) < n:
            self._more_words = list(self.more(n))
            if len(self._more_words) < n:
                raise OscarError(f"a corpus haystack of {n} words needs {n - len(W)} words beyond the held-out "
                                 f"split; only {len(self._more_words)} more are available")
        return W + self._more_words


# ----------------------------------------------------------------- QA files (qa_1: SQuAD, qa_2: HotpotQA)


@dataclass
class QaQuestion:
    question: str
    answers: list[str]
    gold: list[int]  # document ids the question is about (always in the prompt)
    more: list[int] = field(default_factory=list)  # first distractors: SQuAD's other paragraphs of the same article


@dataclass
class QaData:
    dataset: str  # squad | hotpotqa
    path: str
    docs: list[str]  # distinct documents, sorted (as RULER)
    questions: list[QaQuestion]
    fingerprint: str = ""

    @property
    def option(self) -> str:
        return QA_OPTIONS[self.dataset][0]

    def question_for(self, task: str, seed: int, index: int) -> QaQuestion:
        """Sample `index`'s question: a seeded order of the file's questions, the same at every length (RULER
        asks question `index` at every length too); more samples than questions is refused."""
        n = len(self.questions)
        if index >= n:
            raise OscarError(f"{self.option} {self.path} holds {n} usable questions; sample {index + 1} of {task} "
                             f"needs at least {index + 1} (lower --samples or give a larger file)")
        order = list(range(n))
        random.Random(hash_seed(seed, task, 0, -1)).shuffle(order)
        return self.questions[order[index]]


def _bad(option: str, path: str, where: str, what: str) -> OscarError:
    return OscarError(f"{option} {path}: record {where}: {what}")


def _load_json(option: str, path: str):
    if not os.path.isfile(path):
        raise OscarError(f"{option} {path}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise OscarError(f"{option} {path}: not JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise OscarError(f"{option} {path}: cannot read it ({e})") from None


def _str(x) -> bool:
    return isinstance(x, str) and bool(x.strip())


def read_squad(path: str, option: str = "--squad") -> QaData:
    """SQuAD v1.1 / v2.0 JSON: {"data": [{"paragraphs": [{"context", "qas": [{"question", "answers": [{"text"}],
    "is_impossible"?}]}]}]}. Unanswerable questions (v2.0's is_impossible) are left out, as RULER does; a record
    that breaks the layout is refused by its path in the JSON (data[i].paragraphs[j].qas[k])."""
    top = _load_json(option, path)
    if not isinstance(top, dict) or not isinstance(top.get("data"), list):
        raise OscarError(f"{option} {path}: not SQuAD's layout (expected {{\"data\": [...]}} at the top)")
    raw: list[tuple[str, list[str], str, list[str]]] = []  # question, answers, context, article contexts
    for a, art in enumerate(top["data"]):
        w = f"data[{a}]"
        if not isinstance(art, dict) or not isinstance(art.get("paragraphs"), list):
            raise _bad(option, path, w, "expected an object with a \"paragraphs\" list")
        ctxs = []
        for p, par in enumerate(art["paragraphs"]):
            wp = f"{w}.paragraphs[{p}]"
            if not isinstance(par, dict) or not _str(par.get("context")) or not isinstance(par.get("qas"), list):
                raise _bad(option, path, wp, "expected an object with a \"context\" string and a \"qas\" list")
            ctxs.append(par["context"])
        for p, par in enumerate(art["paragraphs"]):
            for q, qa in enumerate(par["qas"]):
                wq = f"{w}.paragraphs[{p}].qas[{q}]"
                if not isinstance(qa, dict) or not _str(qa.get("question")):
                    raise _bad(option, path, wq, "expected an object with a \"question\" string")
                imp = qa.get("is_impossible", False)
                if not isinstance(imp, bool):
                    raise _bad(option, path, wq, "\"is_impossible\" must be true or false")
                ans = qa.get("answers")
                if not isinstance(ans, list) or not all(isinstance(x, dict) and isinstance(x.get("text"), str) for x in ans):
                    raise _bad(option, path, wq, "\"answers\" must be a list of {\"text\": ...} objects")
                if imp:
                    continue
                texts = list(dict.fromkeys(x["text"].strip() for x in ans if x["text"].strip()))
                if not texts:
                    raise _bad(option, path, wq, "an answerable question (no \"is_impossible\": true) without answer text")
                raw.append((qa["question"].strip(), texts, par["context"], ctxs))
    if not raw:
        raise OscarError(f"{option} {path}: no answerable questions")
    docs = sorted({c for _, _, c, _ in raw} | {c for *_, cs in raw for c in cs})
    ids = {d: i for i, d in enumerate(docs)}
    qs = [QaQuestion(q, a, [ids[c]], [i for i in dict.fromkeys(ids[x] for x in cs) if i != ids[c]]) for q, a, c, cs in raw]
    return QaData("squad", path, docs, qs, file_fingerprint(path))


def read_hotpotqa(path: str, option: str = "--hotpotqa") -> QaData:
    """HotpotQA JSON: [{"question", "answer", "context": [[title, [sentences]], ...]}, ...]. A document is
    "title\nsentences" (RULER's form); every paragraph of a record's context is one of its gold documents."""
    top = _load_json(option, path)
    if not isinstance(top, list):
        raise OscarError(f"{option} {path}: not HotpotQA's layout (expected a list of records at the top)")
    raw: list[tuple[str, str, list[str]]] = []
    for r, rec in enumerate(top):
        w = f"[{r}]"
        if not isinstance(rec, dict) or not _str(rec.get("question")) or not _str(rec.get("answer")):
            raise _bad(option, path, w, "expected an object with \"question\" and \"answer\" strings")
        ctx = rec.get("context")
        if not isinstance(ctx, list) or not ctx:
            raise _bad(option, path, w, "expected a non-empty \"context\" list of [title, [sentences]]")
        docs = []
        for c, par in enumerate(ctx):
            if not (isinstance(par, list) and len(par) == 2 and isinstance(par[0], str) and isinstance(par[1], list)
                    and all(isinstance(x, str) for x in par[1])):
                raise _bad(option, path, f"{w}.context[{c}]", "expected [title, [sentences]]")
            docs.append(f"{par[0]}\n{''.join(par[1])}")
        raw.append((rec["question"].strip(), rec["answer"].strip(), list(dict.fromkeys(docs))))
    if not raw:
        raise OscarError(f"{option} {path}: no records")
    docs = sorted({d for *_, ds in raw for d in ds})
    ids = {d: i for i, d in enumerate(docs)}
    return QaData("hotpotqa", path, docs, [QaQuestion(q, [a], [ids[d] for d in ds]) for q, a, ds in raw],
                  file_fingerprint(path))


def load_qa(squad: str | None = None, hotpotqa: str | None = None) -> dict[str, QaData]:
    """The QA datasets the user gave, read and checked (`Sources.qa`)."""
    out = {}
    if squad:
        out["squad"] = read_squad(squad)
    if hotpotqa:
        out["hotpotqa"] = read_hotpotqa(hotpotqa)
    return out


def resolve_tasks(tasks: list[str] | str, have: set[str] | dict) -> tuple[list[str], dict[str, str]]:
    """(tasks to run, {task: why it is skipped}). "all" stands for every task the inputs allow: QA tasks
    whose file (`have`: the QA datasets given) is missing are skipped with the reason; a QA task named
    explicitly without its file is refused with the option that gives it; an unknown task is refused."""
    tasks = [t.strip() for t in (tasks.split(",") if isinstance(tasks, str) else tasks) if t.strip()]
    out: list[str] = []
    skipped: dict[str, str] = {}
    for t in tasks:
        if t == "all":
            for u, spec in TASKS.items():
                if spec.kind == "qa" and spec.dataset not in have:
                    opt, what = QA_OPTIONS[spec.dataset]
                    skipped[u] = f"no {opt} file ({what}) given"
                else:
                    out.append(u)
        elif t not in TASKS:
            raise OscarError(f"unknown task {t!r}; known: {', '.join(TASKS)}, or all")
        else:
            spec = TASKS[t]
            if spec.kind == "qa" and spec.dataset not in have:
                opt, what = QA_OPTIONS[spec.dataset]
                raise OscarError(f"task {t} needs {opt} PATH ({what}); none was given")
            out.append(t)
    out = list(dict.fromkeys(out))
    return out, {t: r for t, r in skipped.items() if t not in out}


def skipped_line(skipped: dict[str, str]) -> str:
    """The stderr line that says which tasks `--tasks all` left out and why."""
    return "oscar: --tasks all: skipping " + "; ".join(f"{t} ({r})" for t, r in skipped.items())


@dataclass
class Sample:
    task: str
    length: int  # target length in tokens (prompt + room for the answer)
    index: int
    context_ids: list[int]  # chunk 1: template head + instruction + haystack
    question_ids: list[int]  # chunk 2: question + assistant header + answer prefix
    answers: list[str]
    max_new_tokens: int
    metric: str = "all"
    context_text: str = field(default="", repr=False)
    question_text: str = field(default="", repr=False)

    @property
    def prompt_tokens(self) -> int:
        return len(self.context_ids) + len(self.question_ids)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.max_new_tokens


# ----------------------------------------------------------------- scoring (RULER)


def string_match_all(preds: list[str], refs: list[list[str]]) -> float:
    """Mean over samples of the fraction of references contained in the prediction, in %."""
    if not preds:
        return 0.0
    tot = sum(sum(r.lower() in p.lower() for r in ref) / len(ref) for p, ref in zip(preds, refs))
    return 100.0 * tot / len(preds)


def string_match_part(preds: list[str], refs: list[list[str]]) -> float:
    """Mean over samples of 1 if any reference is contained in the prediction, in %."""
    if not preds:
        return 0.0
    tot = sum(max(float(r.lower() in p.lower()) for r in ref) for p, ref in zip(preds, refs))
    return 100.0 * tot / len(preds)


METRICS: dict[str, Callable[[list[str], list[list[str]]], float]] = {"all": string_match_all, "part": string_match_part}


def score_one(pred: str, answers: list[str], metric: str) -> float:
    """One sample's score in [0, 1] under the task's metric."""
    return METRICS[metric]([postprocess(pred)], [answers]) / 100.0


# ----------------------------------------------------------------- value drawing


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _word_pair(rng: random.Random) -> str:
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


_DRAW = {"numbers": _number, "uuids": _uuid, "words": _word_pair}


def _distinct(rng: random.Random, kind: str, n: int, avoid: set[str], text: str = "") -> list[str]:
    out: list[str] = []
    for _ in range(n * 50 + 100):
        if len(out) == n:
            return out
        v = _DRAW[kind](rng)
        if v in avoid or v in out or (text and v in text):
            continue
        out.append(v)
    raise OscarError(f"cannot draw {n} distinct {kind} keys/values (pool exhausted); lower the target length")


def _singular(kind: str) -> str:
    return {"numbers": "number", "uuids": "uuid", "words": "word"}[kind]


# ----------------------------------------------------------------- task bodies
# Each body builder returns (context_body, question, answer_prefix, answers)
# for a given size n (haystack units); the rng is re-seeded per call so the
# needles do not move while the size is searched.


def _insert_sentences(units: list[str], items: list[str], rng: random.Random, boundaries: list[int] | None = None) -> list[str]:
    """Insert each item at a random depth (at a sentence boundary), keeping their order."""
    cand = boundaries if boundaries is not None else list(range(len(units) + 1))
    pos = sorted(rng.choice(cand) for _ in items)
    out: list[str] = []
    j = 0
    for i in range(len(units) + 1):
        while j < len(items) and pos[j] == i:
            out.append(items[j])
            j += 1
        if i < len(units):
            out.append(units[i])
    return out


def _noise_units(n: int) -> list[str]:
    sents = [s.strip() + "." for s in NOISE.split(".") if s.strip()]
    return [sents[i % len(sents)] for i in range(n)]


def _corpus_units(src: Sources, n: int, offset: int) -> tuple[list[str], list[int]]:
    """n consecutive held-out words from offset (wrapping within the split, which repeats nothing while
    n <= its size; past it the split continues into `src.more`'s text), and the sentence boundaries in them."""
    W = src.haystack_words(n)  # offset < len(corpus_words), len(W) >= len(corpus_words) + n: no word twice
    words = [W[(offset + i) % len(W)] for i in range(n)]
    bounds = [0] + [i + 1 for i, w in enumerate(words) if w.endswith((".", ":", "?", "!"))]
    return words, sorted(set(bounds))


def _niah_body(spec: TaskSpec, src: Sources, seed: int, n: int):
    rng = random.Random(seed)
    offset = rng.randrange(len(src.corpus_words))
    vsing = _singular(spec.value_type)
    vplur = spec.value_type
    keys = _distinct(rng, spec.key_type, spec.num_keys, set())
    values = [_distinct(rng, spec.value_type, spec.num_values, set()) for _ in keys]
    needles = [f"One of the special magic {vplur} for {k} is: {v}." for k, vs in zip(keys, values) for v in vs]
    order = list(range(len(needles)))
    rng.shuffle(order)
    needles = [needles[i] for i in order]
    asked = list(range(spec.num_queries))  # keys[0:num_queries] are asked
    if spec.haystack == "noise":
        units = _noise_units(n)
        body = " ".join(_insert_sentences(units, needles, rng))
    elif spec.haystack == "corpus":
        words, bounds = _corpus_units(src, n, offset)
        body = " ".join(_insert_sentences(words, needles, rng, bounds))
    else:  # needle haystack: n distractor needles, then noise filler words up to size
        dk = _distinct(rng, spec.key_type, n, set(keys))
        dv = _distinct(rng, spec.value_type, n, {v for vs in values for v in vs})
        units = [f"One of the special magic {vplur} for {k} is: {v}." for k, v in zip(dk, dv)]
        body = " ".join(_insert_sentences(units, needles, rng))
    qkeys = [keys[i] for i in asked]
    answers = [v for i in asked for v in values[i]]
    qk = ", ".join(qkeys[:-1]) + (", and " if len(qkeys) > 2 else " and ") + qkeys[-1] if len(qkeys) > 1 else qkeys[0]
    many = len(answers) > 1
    intro = (f"Some special magic {vplur} are hidden within the following text. Make sure to memorize them. "
             f"I will quiz you about the {vplur} afterwards.\n")
    question = (f"What {'are all' if many else 'is'} the special magic {vplur if many else vsing} for {qk} "
                f"mentioned in the provided text?")
    prefix = f"The special magic {vplur if many else vsing} for {qk} mentioned in the provided text {'are' if many else 'is'}"
    return intro + body + "\n", question, prefix, answers


def _vt_body(spec: TaskSpec, src: Sources, seed: int, n: int, hops: int = 4):
    rng = random.Random(seed)
    names: list[str] = []
    while len(names) < hops + 1:
        v = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if v not in names:
            names.append(v)
    value = _number(rng)[:5]
    stmts = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i + 1]} = VAR {names[i]}." for i in range(hops)]
    body = " ".join(_insert_sentences(_noise_units(n), stmts, rng))
    intro = "Memorize and track the chain of variable assignments hidden in the following text.\n"
    question = f"Question: Find all variables that are assigned the value {value} in the text above."
    prefix = (f"Answer: According to the chain of variable assignments in the text above, {hops + 1} variables "
              f"are assigned the value {value}, they are:")
    return intro + body + "\n", question, prefix, names


def _cwe_freq(length: int) -> int:
    # Common words take <= ~40% of the budget at short lengths (30 repeats from 8k up).
    return max(5, min(30, int(0.4 * length / (10 * 5))))


def _cwe_body(spec: TaskSpec, src: Sources, seed: int, n: int, length: int = 4096, num_cw: int = 10, freq_ucw: int = 3):
    rng = random.Random(seed)
    if len(src.vocab) < num_cw + n:
        raise OscarError(f"cwe: vocabulary of {len(src.vocab)} words too small for {num_cw + n} distinct words")
    words = rng.sample(src.vocab, num_cw + n)
    common, rare = words[:num_cw], words[num_cw:]
    lst = [w for w in common for _ in range(_cwe_freq(length))] + [w for w in rare for _ in range(freq_ucw)]
    rng.shuffle(lst)
    body = " ".join(f"{i + 1}. {w}" for i, w in enumerate(lst))
    intro = ("Below is a numbered list of words. In these words, some appear more often than others. "
             "Memorize the ones that appear most often.\n")
    question = f"Question: What are the {num_cw} most common words in the above list?"
    prefix = f"Answer: The top {num_cw} words that appear most often in the list are:"
    return intro + body + "\n", question, prefix, common


def _fwe_body(spec: TaskSpec, src: Sources, seed: int, n: int, alpha: float = 2.0, vocab: int = 40):
    rng = random.Random(seed)
    coded: list[str] = []
    while len(coded) < vocab:
        w = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(4, 6)))
        if w not in coded:
            coded.append(w)
    n = max(n, 20)
    w = [1.0 / (r + 1) ** alpha for r in range(vocab)]
    counts = [max(1, int(n * x / sum(w))) for x in w]
    # Keep the top 3 strictly ahead of the rest (no ties decide the answer).
    for r in (2, 1, 0):
        counts[r] = max(counts[r], counts[r + 1] + 1)
    toks = [c for c, k in zip(coded, counts) for _ in range(k)]
    rng.shuffle(toks)
    body = " ".join(t if i % 8 else f".... {t}" for i, t in enumerate(toks))
    intro = ("Read the following coded text and track the frequency of each coded word. "
             "Find the three most frequently appearing coded words.\n")
    question = ("Question: Do not provide any explanation. Please ignore the dots '....'. "
                "What are the three most frequently appearing words in the above coded text?")
    prefix = "Answer: According to the coded text above, the three most frequently appearing words are:"
    return intro + body + "\n", question, prefix, coded[:3]


_QA_INSTRUCTION = "Answer the question from the documents. Reply with the answer alone, no other words."


def _qa_body(data: QaData, q: QaQuestion, order: list[int], seed: int, n: int):
    """The question's gold documents and the first n - len(gold) of `order` (its distractors), shuffled,
    "Document N:" each, then the question (RULER's QA layout; our own wording)."""
    ids = q.gold + order[: max(0, n - len(q.gold))]
    random.Random(seed).shuffle(ids)
    docs = "\n\n".join(f"Document {i + 1}:\n{data.docs[d]}" for i, d in enumerate(ids))
    intro = f"{_QA_INSTRUCTION}\n\nThe documents:\n\n"
    question = f"{_QA_INSTRUCTION}\n\nQuestion: {q.question}"
    return intro + docs + "\n\n", question, "Answer:", list(q.answers)


def _qa_order(data: QaData, q: QaQuestion, seed: int) -> list[int]:
    """Distractor documents in the order they join the prompt: the same article's other paragraphs first
    (SQuAD), then every other document of the file, each group in a seeded order."""
    rng = random.Random(seed)
    more = [d for d in q.more if d not in q.gold]
    rng.shuffle(more)
    taken = set(q.gold) | set(more)
    rest = [d for d in range(len(data.docs)) if d not in taken]
    rng.shuffle(rest)
    return more + rest


def _body(spec: TaskSpec, src: Sources, seed: int, n: int, length: int):
    if spec.kind == "niah":
        return _niah_body(spec, src, seed, n)
    if spec.kind == "vt":
        return _vt_body(spec, src, seed, n)
    if spec.kind == "cwe":
        return _cwe_body(spec, src, seed, n, length=length)
    return _fwe_body(spec, src, seed, n)


# ----------------------------------------------------------------- assembly and sizing


def split_prompt(tokenizer, context: str, question: str, prefix: str) -> tuple[str, str]:
    """Render the chat template and cut it where the question starts: (chunk-1 text, chunk-2 text)."""
    content = context + question
    if getattr(tokenizer, "chat_template", None):
        full = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
    else:
        full = content + "\n"
    cut = full.rfind(question)
    if cut < 0:
        raise OscarError("the chat template altered the question text; cannot split the prompt in two chunks")
    return full[:cut], full[cut:] + prefix


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def answer_budget(tokenizer, answers: list[str], qa: bool = False) -> int:
    """Tokens left for the answer: the references' own length plus slack (RULER reserves a fixed budget).
    QA: the references are alternatives (any one scores), so RULER's 32 tokens or the longest one plus slack."""
    if qa:
        return max(32, max(len(_encode(tokenizer, " " + a)) for a in answers) + 16)
    return len(_encode(tokenizer, " " + ", ".join(answers))) + 16


def _initial_units(spec: TaskSpec, length: int) -> int:
    per = {"noise": 6, "corpus": 1.4, "needle": 18 if spec.key_type == "words" else 60}
    if spec.kind == "qa":
        return max(1, int(length / 200))  # documents (SQuAD paragraphs ~150 tokens, HotpotQA ~100)
    if spec.kind == "cwe":
        return max(1, int(length / 14))
    if spec.kind == "fwe":
        return max(20, int(length / 3))
    return max(1, int(length / per[spec.haystack]))


def make_sample(task: str, length: int, index: int, tokenizer, src: Sources, seed: int = 0, tol: float = 0.02) -> Sample:
    """Build sample `index` of `task` sized to `length` tokens (prompt + answer room) for this tokenizer."""
    if task not in TASKS:
        raise OscarError(f"unknown task {task!r}; known: {', '.join(TASKS)}")
    spec = TASKS[task]
    sseed = hash_seed(seed, task, length, index)
    cap = None  # most units a prompt can hold (QA: every document of the file)
    if spec.kind == "qa":
        data = src.qa_data(task)
        qq = data.question_for(task, seed, index)
        order = _qa_order(data, qq, sseed)
        cap = len(qq.gold) + len(order)
        body = lambda n: _qa_body(data, qq, order, sseed, n)  # noqa: E731
    else:
        body = lambda n: _body(spec, src, sseed, n, length)  # noqa: E731

    def build(n: int):
        ctx, q, prefix, answers = body(n)
        c_text, q_text = split_prompt(tokenizer, ctx, q, prefix)
        c_ids, q_ids = _encode(tokenizer, c_text), _encode(tokenizer, q_text)
        room = answer_budget(tokenizer, answers, qa=spec.kind == "qa")
        return len(c_ids) + len(q_ids) + room, (c_ids, q_ids, answers, room, c_text, q_text)

    lo, hi = 0, None
    n = _initial_units(spec, length) if cap is None else min(cap, _initial_units(spec, length))
    # Exponential bracket then bisection on the largest n with total(n) <= length.
    while True:
        tot, _ = build(n)
        if tot <= length:
            lo = n
            if (hi is not None and hi - lo <= 1) or (cap is not None and hi is None and n >= cap):
                break
            n = (n * 2 if cap is None else min(n * 2, cap)) if hi is None else (lo + hi) // 2
        else:
            hi = n
            if hi - lo <= 1:
                break
            n = (lo + hi) // 2
        if hi is not None and hi - lo <= 1:
            break
    tot, (c_ids, q_ids, answers, room, c_text, q_text) = build(lo)
    if tot > length or lo == 0:
        raise OscarError(f"{task}: target length {length} is too short for the task's fixed text ({tot} tokens)")
    if cap is not None and lo >= cap and tot < (1 - tol) * length:
        raise OscarError(f"{task}: all {cap} documents of {data.option} {data.path} make {tot} of the {length} tokens; "
                         "give a larger file or shorter lengths")
    if spec.haystack == "needle" and spec.kind == "niah" and tot < (1 - tol) * length:
        c_ids, q_ids, c_text = _pad_noise(tokenizer, c_text, q_text, length - room)
    return Sample(task, length, index, c_ids, q_ids, answers, room, spec.metric, c_text, q_text)


def _pad_noise(tokenizer, c_text: str, q_text: str, budget: int):
    """Needle haystacks move in whole needles: fill the remainder with noise words before the question."""
    words = (NOISE + " ") * 200
    words = words.split()
    head, tail = c_text[: c_text.rfind("\n")], c_text[c_text.rfind("\n"):]
    lo, hi = 0, len(words)
    best = None
    while lo <= hi:
        m = (lo + hi) // 2
        ct = head + (" " + " ".join(words[:m]) if m else "") + tail
        c_ids, q_ids = _encode(tokenizer, ct), _encode(tokenizer, q_text)
        if len(c_ids) + len(q_ids) <= budget:
            best, lo = (c_ids, q_ids, ct), m + 1
        else:
            hi = m - 1
    return best


def hash_seed(seed: int, task: str, length: int, index: int) -> int:
    """A stable per-sample seed (Python's hash() is salted per process; this is not)."""
    return zlib.crc32(f"{seed}/{task}/{length}/{index}".encode())


def parse_length(s: str) -> int:
    """'4k' -> 4096, '128k' -> 131072, '1500' -> 1500."""
    s = s.strip().lower()
    try:
        return int(float(s[:-1]) * 1024) if s.endswith("k") else int(s)
    except ValueError:
        raise OscarError(f"bad length {s!r}: use tokens (e.g. 3000) or k-units (1k = 1024)") from None
