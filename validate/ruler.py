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

Every prompt is split in two chunks for the strict protocol:
``context_ids`` (chat template head + instruction + haystack) and
``question_ids`` (question + end of user turn + assistant header + answer
prefix). ``len(context_ids) + len(question_ids) + max_new_tokens`` is the
target length within 2% (never above it).

Scoring follows RULER: ``string_match_all`` (fraction of references found in
the prediction, averaged) for every task here, ``string_match_part`` (any
reference found) for QA-style tasks; both case-insensitive, in percent.
"""

from __future__ import annotations

import random
import re
import string
import uuid
from dataclasses import dataclass, field
from typing import Callable

from oscar.common import OscarError

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
    kind: str  # niah | vt | cwe | fwe
    haystack: str = "noise"  # noise | corpus | needle (niah only)
    key_type: str = "words"  # words | numbers | uuids
    value_type: str = "numbers"  # numbers | uuids
    num_keys: int = 1  # needles with distinct keys planted
    num_values: int = 1  # values per key
    num_queries: int = 1  # keys asked
    metric: str = "all"  # all | part


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
    ]
}


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

_CTRL = re.compile(r"[\x00-\x1f]")


def postprocess(pred: str) -> str:
    """RULER's prediction cleanup: control characters become newlines, then strip."""
    return _CTRL.sub("\n", pred).strip()


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


def answer_budget(tokenizer, answers: list[str]) -> int:
    """Tokens left for the answer: the references' own length plus slack (RULER reserves a fixed budget)."""
    return len(_encode(tokenizer, " " + ", ".join(answers))) + 16


def _initial_units(spec: TaskSpec, length: int) -> int:
    per = {"noise": 6, "corpus": 1.4, "needle": 18 if spec.key_type == "words" else 60}
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

    def build(n: int):
        ctx, q, prefix, answers = _body(spec, src, sseed, n, length)
        c_text, q_text = split_prompt(tokenizer, ctx, q, prefix)
        c_ids, q_ids = _encode(tokenizer, c_text), _encode(tokenizer, q_text)
        room = answer_budget(tokenizer, answers)
        return len(c_ids) + len(q_ids) + room, (c_ids, q_ids, answers, room, c_text, q_text)

    lo, hi = 0, None
    n = _initial_units(spec, length)
    # Exponential bracket then bisection on the largest n with total(n) <= length.
    while True:
        tot, _ = build(n)
        if tot <= length:
            lo = n
            if hi is not None and hi - lo <= 1:
                break
            n = n * 2 if hi is None else (lo + hi) // 2
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
    import zlib

    return zlib.crc32(f"{seed}/{task}/{length}/{index}".encode())


def parse_length(s: str) -> int:
    """'4k' -> 4096, '128k' -> 131072, '1500' -> 1500."""
    s = s.strip().lower()
    try:
        return int(float(s[:-1]) * 1024) if s.endswith("k") else int(s)
    except ValueError:
        raise OscarError(f"bad length {s!r}: use tokens (e.g. 3000) or k-units (1k = 1024)") from None
