"""lab/niah_misses.py: a miss is classified against the context the sample really had."""

import importlib.util
import re
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "_niah_misses", Path(__file__).resolve().parents[1] / "niah_misses.py")
misses = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(misses)


def test_classify_on_a_real_multikey_sample():
    from oscar.validate import env
    from oscar.validate.ruler import Sources, make_sample

    _, tok, _ = env.load_model()
    s = make_sample("niah_multikey_1", 1024, 0, tok, Sources.from_text(env.heldout_text("pydoc")), seed=0)
    answer = s.answers[0]
    others = [n for n in re.findall(r"\b\d{7}\b", s.context_text) if n != answer]
    assert len(others) >= 3  # multikey_1 plants 4 needles, one asked
    assert misses.classify(f" {others[0]}.", answer, s.context_text) == "distractor"
    near = answer[:-1] + str((int(answer[-1]) + 1) % 10)
    assert near not in s.context_text
    assert misses.classify(f" {near}.", answer, s.context_text) == "near"
    assert misses.classify(" 12.", answer, s.context_text) == "other"
    assert misses.classify(" I do not know.", answer, s.context_text) == "other"


def test_classify_uuid_values():
    ctx = "The special magic uuid for x is: 47ea59fe-cc5c-4e64-8136-bbe264c4ae34. And for y: 00ac63a2-552d-49fd-8fb4-83dbb1f0f4a8."
    a = "47ea59fe-cc5c-4e64-8136-bbe264c4ae34"
    assert misses.classify(" 47ea59fe-cc5c-4e64-8136-bbe2644ae34.", a, ctx) == "near"  # one character dropped
    assert misses.classify(" 00ac63a2-552d-49fd-8fb4-83dbb1f0f4a8.", a, ctx) == "distractor"
    assert misses.classify(" 47.", a, ctx) == "other"  # a fragment of the answer is not a distractor


def test_a_number_of_another_length_in_the_context_is_not_a_distractor():
    ctx = "r[0] = 3.140000; the special magic number for x is: 7615914."
    assert misses.classify(' "r[0]".', "5555555", ctx) == "other"
    assert misses.classify(" 7615914.", "5555555", ctx) == "distractor"
