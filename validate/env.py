"""Model and held-out text for validation, through the pipeline stage.

`oscar.pipeline.models.load_model(spec) -> (model, tokenizer, info)` and
`oscar.pipeline.corpus.load_corpus(name) -> Corpus(..., calibration, heldout)`
are the sources of truth (same split as calibration). Validation reads the
held-out split only.
"""

from __future__ import annotations

import functools
import re
from types import SimpleNamespace
from typing import Any

from oscar.common import OscarError
from oscar.defaults import EMBEDDED_MODEL
from oscar.pipeline.corpus import first_chat_record, load_corpus
from oscar.pipeline.models import load_config, load_model as _load


def load_model(spec: str = EMBEDDED_MODEL, latent: bool = False):
    """(model, tokenizer, info) in eval mode, float32 on CPU; `latent`: the caller serves an MLA model's latent
    cache (every other caller refuses one)."""
    model, tok, info = _load(spec, latent=latent)  # refuses sliding-window models (oscar.constraints.check_model)
    return model.eval(), tok, info


def config_max_context(spec: str) -> int:
    """The model's context length from its config alone (no weights loaded)."""
    return max_context(SimpleNamespace(config=load_config(spec)))


def max_context(model) -> int:
    c = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(getattr(c, "max_position_embeddings", 0) or 0)


def _as_text(x: Any) -> str:
    if isinstance(x, str):
        return x
    if isinstance(x, (list, tuple)):
        return "\n\n".join(_as_text(t) for t in x)
    for attr in ("text", "texts", "documents"):
        if hasattr(x, attr):
            return _as_text(getattr(x, attr))
    raise OscarError(f"cannot read held-out text from {type(x).__name__}")


def refuse_chat_corpus(corpus: str) -> None:
    """Validation reads held-out text without a chat template: a corpus with 'messages' records is refused before
    any model loads (the recipe's tune renders them: it has the tokenizer)."""
    where = first_chat_record(corpus)
    if where:
        raise OscarError(f"{where} is a chat ('messages') record; validation reads the corpus's held-out text "
                         "without a chat template: give a 'text' corpus (--corpus)")


@functools.lru_cache(maxsize=4)
def heldout_text(corpus: str = "pydoc", dedupe: bool = True) -> str:
    """The held-out split of the corpus (never the calibration split), whitespace-normalised.

    dedupe: drop held-out sentences (>= 6 words) that also occur verbatim in the calibration
    split. pydoc topics repeat passages across documents: 114 of 300 random 30-word held-out
    windows occur in the calibration text without this, 0 of 300 with it (docs/validation.md).
    """
    c = load_corpus(corpus)
    held = " ".join(_as_text(c.heldout).split())
    if not dedupe:
        return held
    return drop_calibration_sentences(held, corpus)


@functools.lru_cache(maxsize=4)
def _calibration_text(corpus: str) -> str:
    return " ".join(_as_text(load_corpus(corpus).calibration).split())


def drop_calibration_sentences(text: str, corpus: str) -> str:
    """`text` without its sentences (>= 6 words) that occur verbatim in the corpus's calibration split."""
    cal = _calibration_text(corpus)
    sents = re.split(r"(?<=[.:?!])\s+", text)
    return " ".join(s for s in sents if len(s.split()) < 6 or s not in cal)
