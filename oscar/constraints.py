"""What the serving formats require of a model, checked up front by every stage.

One place for the constraints that used to surface late (after a calibration, in `generate`):
INT2 codes are packed `8 // bits` per byte (head_dim * bits a whole number of bytes), token-axis
groups must divide head_dim, the recent window is whole pages, Hadamard rotations exist only for
head dims 2^k, 12*2^k and 20*2^k, and no stage supports sliding-window attention layers (the cache,
its kernels and the validation simulator attend over the whole history). Pure integer logic on
plain arguments, so the pipeline (before any stage that knows a QuantConfig) can use it too.
"""

from __future__ import annotations

from typing import Any

from oscar.common import LATENT_ARCHITECTURES, OscarError, is_latent, latent_refusal
from oscar.defaults import LATENT_GROUP, PAGE_SIZE, RECENT

SLIDING_WINDOW = ("sliding-window attention layers are not supported by oscar-kv: the INT2 cache, its kernels and "
                  "the validation simulator attend over the whole history, so every stage (calibrate, validate, "
                  "OscarCache) refuses such a model")


HADAMARD_PALEY_ORDERS = (12, 20)  # oscar.stats.hadamard's Paley factors (its Kronecker products with 2^k)


def hadamard_supported(n: int) -> bool:
    """A normalised Hadamard matrix of order n exists here (oscar.stats.hadamard: 2^k, 12*2^k, 20*2^k)."""
    pow2 = lambda m: m >= 1 and m & (m - 1) == 0  # noqa: E731
    return any(n % m == 0 and pow2(n // m) for m in (1,) + HADAMARD_PALEY_ORDERS)


def format_problems(head_dim: int, *, bits: int = 2, group_size: int | None = None, key_axis: str = "token",
                    page_size: int = PAGE_SIZE, recent: int = RECENT, hadamard: bool = False,
                    key_split: int = 0, key_drop: int = 0) -> list[str]:
    """Why the cache format (QuantConfig fields) cannot store K/V of `head_dim` (empty: it can)."""
    D, out = int(head_dim), []
    stored = D - key_drop
    if key_split and (key_split % 8 or not 0 < key_split <= stored):
        out.append(f"key_split {key_split} must be a multiple of 8 up to the {stored} stored key channels of head_dim "
                   f"{D} (the wide channels' top bits are packed 8 per byte; all of them: one wide part)")
    elif key_split and key_split < stored and not (hadamard_supported(key_split) and hadamard_supported(stored - key_split)):
        out.append(f"split keys of {key_split} + {stored - key_split} channels need a Hadamard of each order "
                   f"(2^k, 12*2^k, 20*2^k)")
    if key_drop and (key_drop < 0 or (stored * bits) % 8):
        out.append(f"key_drop {key_drop}: the {stored} stored key channels at {bits} bits must fill whole bytes "
                   f"(key_split: the split format's)")
    if bits not in (1, 2, 4, 8):
        out.append(f"bits {bits} cannot be packed into bytes (1, 2, 4 or 8)")
    elif (D * bits) % 8:
        out.append(f"head_dim {D} * bits {bits} is not a whole number of bytes ({8 // bits} codes per byte): "
                   f"INT{bits} needs head_dim a multiple of {8 // bits}")
    g = group_size or D
    if D % g:  # values (and token-axis keys) are grouped per token over `group_size` channels
        out.append(f"group_size {g} does not divide head_dim {D} (per-token groups of channels)")
    if page_size < 1 or recent % page_size:
        out.append(f"recent window {recent} is not a whole number of pages of {page_size}")
    if hadamard and not hadamard_supported(D):
        out.append(f"head_dim {D} has no Hadamard construction (supported: 2^k, 12*2^k, 20*2^k)")
    return out


def quant_problems(head_dim: int, quant: Any, *, hadamard: bool = False) -> list[str]:
    """format_problems of a QuantConfig-like object."""
    return format_problems(head_dim, bits=quant.bits, group_size=quant.group_size, key_axis=quant.key_axis,
                           page_size=quant.page_size, recent=quant.recent, hadamard=hadamard,
                           key_split=getattr(quant, "key_split", 0), key_drop=getattr(quant, "key_drop", 0))


def sliding_layers(config: Any) -> list[int]:
    """Layers of a transformers config that use sliding-window attention (empty: none)."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = getattr(c, "layer_types", None)
    if types:
        return [i for i, t in enumerate(types) if "sliding" in str(t)]
    if getattr(c, "sliding_window", None) and getattr(c, "use_sliding_window", True) is not False:
        return list(range(int(getattr(c, "num_hidden_layers", 0) or 0)))
    return []


def latent_problems(config: Any, group: int = LATENT_GROUP) -> list[str]:
    """Why the INT2 latent cache (c_kv in `group`-value groups, the RoPE key in the model dtype) cannot serve an MLA
    config (empty: it can)."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    out = []
    mt = getattr(c, "model_type", "")
    if mt not in LATENT_ARCHITECTURES:
        out.append(f"model_type {mt!r} is a latent-attention architecture oscar-kv does not know (known: "
                   f"{', '.join(f'{v} ({k})' for k, v in LATENT_ARCHITECTURES.items())})")
    r = int(c.kv_lora_rank)
    if group < 1 or r % group:
        out.append(f"kv_lora_rank {r} is not a whole number of {group}-value groups (the latent is quantized per "
                   f"token in groups of {group})")
    return out


def check_model(config: Any, head_dim: int | None = None, *, what: str = "this model", latent: bool = False) -> None:
    """Refuse, before any work, a model no stage can serve: sliding-window layers, or a head_dim that the
    default INT2 cache format (2 bits, token groups of head_dim, pages of 16) cannot pack. An MLA model is refused
    by a per-head step (`latent=False`) and checked against the latent cache format by a latent one."""
    sw = sliding_layers(config)
    if sw:
        raise OscarError(f"{what} has sliding-window attention in layers {sw[:8]}{'...' if len(sw) > 8 else ''}: "
                         f"{SLIDING_WINDOW}")
    if is_latent(config):
        if not latent:
            raise OscarError(latent_refusal(config, what))
        probs = latent_problems(config)
        if probs:
            raise OscarError(f"{what}: no INT2 latent cache can serve it ({'; '.join(probs)}); refused before any work")
        return
    if head_dim is not None:
        probs = format_problems(head_dim)
        if probs:
            raise OscarError(f"{what}: no INT2 cache can serve head_dim {head_dim} ({'; '.join(probs)}); refused "
                             f"before any work (calibrating it would give statistics no later stage can use)")
