"""Small helpers shared by every stage: errors, fingerprints, thread setup."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any


class OscarError(Exception):
    """A user-facing error: bad input, mismatched store/artifact, refused request.

    The CLI prints the message (no traceback) and exits with status 2.
    """


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def fingerprint(obj: Any, n: int = 16) -> str:
    """Stable short hash of a JSON-able object (dict keys sorted)."""
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()[:n]


def file_fingerprint(path: str, n: int = 16, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()[:n]


def positional_or_option(args: Any, name: str, flag: str) -> Any:
    """The value of an option that also keeps its old positional spelling (`oscar fit STORE` = `oscar fit --store
    STORE`): parsers store the positional as `<name>_pos`. Both given and different, or neither: a clear error."""
    pos, opt = getattr(args, f"{name}_pos", None), getattr(args, name, None)
    if pos is not None and opt is not None and pos != opt:
        raise OscarError(f"{flag} given twice ({pos!r} positionally, {opt!r} as {flag}); give it once")
    if pos is None and opt is None:
        raise OscarError(f"{flag} is required (or give it as the first positional argument)")
    return opt if opt is not None else pos


def silence_progress() -> None:
    """Turn off every progress bar of this process and its children: tqdm (ours, Ray's), transformers'
    (weight loading) and huggingface_hub's. `--no-progress` calls it before any work starts."""
    os.environ["TQDM_DISABLE"] = "1"  # tqdm >= 4.66 reads TQDM_<param> as the default of each parameter
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_progress_bar()


def set_threads(n: int | None = None) -> int:
    """Pin torch's intra-op threads (default: all cores, or $OSCAR_THREADS)."""
    import torch

    n = n or int(os.environ.get("OSCAR_THREADS", "0")) or os.cpu_count() or 1
    torch.set_num_threads(n)
    return n


# Keys of a transformers config that do not change what the model computes.
_VOLATILE_CONFIG_KEYS = {
    "transformers_version", "_name_or_path", "name_or_path", "torch_dtype", "dtype",
    "_attn_implementation", "_attn_implementation_internal", "attn_implementation",
    "_commit_hash", "use_cache", "output_attentions", "output_hidden_states",
    "return_dict", "architectures", "_experts_implementation", "experts_implementation",
}


def config_fingerprint(config: Any) -> str:
    """Hash of a transformers config (or its dict) minus keys that don't change the math.

    Stores and artifacts record it; a store or artifact is refused for a model
    whose fingerprint differs.
    """
    d = config if isinstance(config, dict) else config.to_dict()
    return fingerprint({k: v for k, v in sorted(d.items()) if k not in _VOLATILE_CONFIG_KEYS and not k.startswith("_")})


def attention_shapes(config: Any) -> dict:
    """num_layers, num_q_heads, num_kv_heads, head_dim of a transformers text config."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    nq = c.num_attention_heads
    return {
        "num_layers": c.num_hidden_layers,
        "num_q_heads": nq,
        "num_kv_heads": getattr(c, "num_key_value_heads", None) or nq,
        "head_dim": getattr(c, "head_dim", None) or c.hidden_size // nq,
    }
