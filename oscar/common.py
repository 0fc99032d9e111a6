"""Small helpers shared by every stage: errors, fingerprints, thread setup."""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import math
import os
import platform
import re
import tempfile
import time
from typing import Any

import numpy as np


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
        # late: keeps transformers (1.1 s) out of `oscar --help`
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_progress_bar()


def set_threads(n: int | None = None) -> int:
    """Pin torch's intra-op threads (default: `default_threads()`, or $OSCAR_THREADS)."""
    # late: keeps torch (2.1 s) out of `oscar --help`
    import torch

    n = n or int(os.environ.get("OSCAR_THREADS", "0")) or default_threads()
    torch.set_num_threads(n)
    return n


# glibc's mallopt parameters (malloc.h) and the values `keep_freed_memory` sets.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts: an allocation this size or smaller comes from the heap
TRIM_THRESHOLD = 1 << 30   # freed memory at the heap's top is kept up to this much


def keep_freed_memory() -> bool:
    """Keep freed memory in the process instead of handing it back to the kernel (glibc only; False elsewhere).

    A CPU forward allocates and frees the same activations at every layer. With glibc's adaptive thresholds the
    capture's forward handed them back and page-faulted them in again: 3.0-6.1 M minor faults and 14-26 s of system
    time per 16 SmolLM2 sequences of 2,048 tokens, against 0-1.2 M and 0.5-6 s for the plain forward in the same
    process (docs/decisions/0107-calibration-keeps-freed-memory.md). Fixed thresholds stop it; the cost is
    that the process keeps its peak heap until it exits (five blocks of 8 such sequences: 2.16 GB peak against
    1.92 GB, lab/capture_memory.py). OSCAR_KEEP_FREED_MEMORY=0 leaves glibc's defaults. Idempotent; call it
    before the compute starts."""
    if os.environ.get("OSCAR_KEEP_FREED_MEMORY", "1") == "0":
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def cgroup_cpu_quota() -> float | None:
    """CPUs this process's cgroup may use (cgroup v2 cpu.max, v1 cfs quota/period), None if unlimited."""
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            q, p = f.read().split()[:2]
        return None if q == "max" else int(q) / int(p)
    except (OSError, ValueError):
        pass
    try:
        with open("/sys/fs/cgroup/cpu/cpu.cfs_quota_us") as f:
            q = int(f.read())
        with open("/sys/fs/cgroup/cpu/cpu.cfs_period_us") as f:
            p = int(f.read())
        return None if q <= 0 else q / p
    except (OSError, ValueError):
        return None


def _cpu_busy(window_s: float) -> float | None:
    """CPUs kept busy by other processes over `window_s` (from /proc/stat, minus this process's own use)."""
    def stat():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + (v[4] if len(v) > 4 else 0)  # total, idle + iowait (jiffies)

    try:
        (t0, i0), c0, w0 = stat(), os.times(), time.monotonic()
        time.sleep(window_s)
        (t1, i1), c1, w1 = stat(), os.times(), time.monotonic()
    except (OSError, ValueError, IndexError):
        return None
    if t1 <= t0:
        return None
    cpus = os.cpu_count() or 1
    busy = cpus * (1 - (i1 - i0) / (t1 - t0))
    own = (c1.user + c1.system - c0.user - c0.system) / max(w1 - w0, 1e-9)
    return max(0.0, busy - own)


def default_threads(window_s: float = 0.3) -> int:
    """Threads worth running now: the CPUs this process may use (affinity, cgroup quota) minus those
    other processes keep busy (sampled over `window_s`; the 1-minute load average where /proc/stat is
    missing), at least 1. torch's threads spin and wait on each other: two threads on a machine whose
    other job holds ~1.8 of 2 cores ran calibration 9x slower than one thread (docs/decisions/README.md)."""
    return threads_decision(window_s)["threads"]


def usable_cpus() -> tuple[int, float | None, float]:
    """(CPUs this process may run on by affinity, the cgroup quota in CPUs or None, the smaller of the two)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    return cpus, quota, (min(float(cpus), quota) if quota else float(cpus))


def threads_decision(window_s: float = 0.3) -> dict:
    """`default_threads` with its inputs (benches record them)."""
    cpus, quota, avail = usable_cpus()
    busy = _cpu_busy(window_s)
    load1 = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    other = busy if busy is not None else (load1 or 0.0)
    free = min(avail, (os.cpu_count() or cpus) - other)  # the host's other work competes for our CPUs too
    n = max(1, min(int(avail), int(free + 0.25)))  # a thread needs (nearly) a whole free core
    return {"threads": n, "cpus_allowed": cpus, "cgroup_quota": quota, "busy_other": other, "loadavg_1": load1,
            "window_s": window_s}


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


# Multi-head Latent Attention models whose latent cache oscar-kv knows, by model_type (transformers' class names).
LATENT_ARCHITECTURES = {"glm_moe_dsa": "GlmMoeDsaForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}


def is_latent(config: Any) -> bool:
    """An MLA model: its serving cache is a compressed latent (`kv_lora_rank`) plus one shared RoPE key per token,
    not per-head K/V."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(c, "kv_lora_rank", None))


def latent_shapes(config: Any) -> dict:
    """The cache and attention shapes of an MLA config: num_layers, num_heads, kv_lora_rank (r, the latent's width),
    rope_dim (the shared RoPE key), nope_dim / v_dim (per head, the up-projections' outputs), the DSA indexer's
    heads / head_dim / top-k (0 when the model has none) and the MTP layers its checkpoints carry."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not is_latent(c):
        raise OscarError(f"{getattr(c, 'model_type', 'this model')} has no latent cache (no kv_lora_rank)")
    return {
        "num_layers": c.num_hidden_layers,
        "num_heads": c.num_attention_heads,
        "kv_lora_rank": c.kv_lora_rank,
        "rope_dim": c.qk_rope_head_dim,
        "nope_dim": c.qk_nope_head_dim,
        "v_dim": c.v_head_dim,
        "q_lora_rank": getattr(c, "q_lora_rank", None) or 0,
        "index_heads": getattr(c, "index_n_heads", 0) or 0,
        "index_dim": getattr(c, "index_head_dim", 0) or 0,
        "index_topk": getattr(c, "index_topk", 0) or 0,
        "mtp_layers": getattr(c, "num_nextn_predict_layers", 0) or 0,
    }


def latent_refusal(config: Any, what: str = "this model") -> str:
    """Why a per-head (GQA) K/V step cannot take an MLA model: one line naming the architecture."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    arch = LATENT_ARCHITECTURES.get(getattr(c, "model_type", ""), getattr(c, "model_type", "?"))
    return (f"{what} is {arch}, a Multi-head Latent Attention model: its cache is the {c.kv_lora_rank}-value "
            f"latent c_kv plus a {c.qk_rope_head_dim}-value RoPE key per token and layer, not per-head K/V, so "
            "this per-head step cannot take it (its per-head head_dim would be read from the wrong tensors)")


def num_layers(config: Any) -> int:
    """Decoder layers of a transformers config (GQA or MLA)."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    return c.num_hidden_layers


def fit_dim(config: Any) -> int:
    """The width a fitted rotation acts on: head_dim (per-head K/V), or kv_lora_rank (an MLA latent); the
    calibration budget is counted per such dimension (docs/decisions/0093-calibration-budget-1024-tokens-per-head-dim.md)."""
    return latent_shapes(config)["kv_lora_rank"] if is_latent(config) else attention_shapes(config)["head_dim"]


def attention_shapes(config: Any) -> dict:
    """num_layers, num_q_heads, num_kv_heads, head_dim of a transformers text config (per-head K/V caches; an MLA
    config is refused: its `head_dim` is the RoPE key's, and its cache is `latent_shapes`)."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    if is_latent(c):
        raise OscarError(latent_refusal(c))
    nq = c.num_attention_heads
    return {
        "num_layers": c.num_hidden_layers,
        "num_q_heads": nq,
        "num_kv_heads": getattr(c, "num_key_value_heads", None) or nq,
        "head_dim": getattr(c, "head_dim", None) or c.hidden_size // nq,
    }


# --------------------------------------------------------------------------- weights fingerprint
# Which checkpoint tensors identify a model's attention: every projection and norm that shapes q, k, v, o.
_ATTN_KEY = re.compile(r"\.layers\.(\d+)\.(self_attn\.[A-Za-z0-9_.]+|input_layernorm\.[A-Za-z0-9_.]+)$")
WEIGHTS_SCHEME = "attn-sampled-v1"  # 16 windows of 4 KiB per tensor (whole tensor when <= 64 KiB)
_WIN, _NWIN = 4096, 16
_WEIGHTS_MEMO: dict[tuple, dict | None] = {}


def _safetensors_header(path: str) -> tuple[dict, int]:
    """(header JSON, offset of the data section) of a safetensors file."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n)), 8 + n


def _weight_files(model_dir: str) -> dict[str, str] | None:
    idx = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(idx):
        with open(idx) as f:
            d = json.load(f)
        wm = d.get("weight_map") if isinstance(d, dict) else None
        if not isinstance(wm, dict):
            raise OscarError(f"{idx}: not a safetensors index (no weight_map object)")
        return {k: os.path.join(model_dir, v) for k, v in wm.items()}
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.isfile(single):
        return {k: single for k in _safetensors_header(single)[0] if k != "__metadata__"}
    return None


def _check_index_files(model_dir: str, files: dict[str, str]) -> None:
    """Every shard the index names exists (a one-line error naming a key and its missing file)."""
    first: dict[str, str] = {}
    for name, path in sorted(files.items()):
        first.setdefault(path, name)
    for path, name in first.items():
        if not os.path.isfile(path):
            raise OscarError(f"{model_dir}/model.safetensors.index.json: weight_map puts {name} in "
                             f"{os.path.basename(path)}, but there is no file {path}")


def weights_fingerprint(model_dir: str | None, layers=None) -> dict | None:
    """{weights_fingerprint, weights_layers, weights_scheme} of a safetensors checkpoint directory, or None.

    Per decoder layer, a hash of its attention tensors (q/k/v/o projections, their biases, q/k norms,
    the input norm): name, dtype, shape and 16 evenly spaced 4 KiB windows of the stored bytes
    (the whole tensor when it is at most 64 KiB). Reads ~64 KiB per tensor through the checkpoint
    index, so a 358B checkpoint costs ~50 MB of reads and a stage can check only its layer range
    (`layers`). It identifies the model (another fine-tune differs everywhere), not the integrity of
    every byte of the checkpoint.
    """
    if not model_dir or not os.path.isdir(model_dir):
        return None
    try:
        files = _weight_files(model_dir)
    except (OSError, ValueError):
        return None
    if not files:
        return None
    _check_index_files(model_dir, files)
    key = (os.path.realpath(model_dir), tuple(sorted((p, os.stat(p).st_mtime_ns) for p in set(files.values()))),
           None if layers is None else tuple(layers))
    if key in _WEIGHTS_MEMO:
        return _WEIGHTS_MEMO[key]
    per_layer: dict[int, list[tuple[str, str]]] = {}
    headers: dict[str, tuple[dict, int]] = {}
    want = None if layers is None else set(int(l) for l in layers)
    for name, path in sorted(files.items()):
        m = _ATTN_KEY.search(name)
        if not m or (want is not None and int(m.group(1)) not in want):
            continue
        if path not in headers:
            headers[path] = _safetensors_header(path)
        hdr, base = headers[path]
        if name not in hdr:
            raise OscarError(f"{model_dir}/model.safetensors.index.json: weight_map puts {name} in "
                             f"{os.path.basename(path)}, but {path} holds no such tensor")
        t = hdr[name]
        a, b = t["data_offsets"]
        n = b - a
        h = hashlib.sha256(canonical_json([m.group(2), t["dtype"], t["shape"], n]).encode())
        with open(path, "rb") as f:
            starts = [0] if n <= _WIN * _NWIN else [i * (n - _WIN) // (_NWIN - 1) for i in range(_NWIN)]
            for s in starts:
                f.seek(base + a + s)
                h.update(f.read(n if len(starts) == 1 else _WIN))
        per_layer.setdefault(int(m.group(1)), []).append((m.group(2), h.hexdigest()))
    if not per_layer:
        _WEIGHTS_MEMO[key] = None
        return None
    L = max(per_layer) + 1
    lay = [fingerprint(sorted(per_layer.get(l, []))) if l in per_layer else None for l in range(L)]
    out = {"weights_fingerprint": fingerprint(lay), "weights_layers": lay, "weights_scheme": WEIGHTS_SCHEME}
    _WEIGHTS_MEMO[key] = out
    return out


def model_fingerprint(config_fp: str, weights: dict | None) -> str:
    """The model fingerprint stores and artifacts carry: config hash, combined with the weights' when known."""
    return fingerprint({"config": config_fp, "weights": weights["weights_fingerprint"]}) if weights else config_fp


def model_mismatch(have: dict, want: dict, what: str = "store") -> str | None:
    """Why model record `have` (of a store / artifact) does not describe model `want` (None: same model).

    Records written before weights were fingerprinted carry only the config hash as `fingerprint`:
    they are compared on the config alone.
    """
    hc = have.get("config_fingerprint", have.get("fingerprint"))
    wc = want.get("config_fingerprint", want.get("fingerprint"))
    if hc and wc and hc != wc:
        return (f"the {what} was made for model {have.get('name')!r} with config fingerprint {hc}, this model "
                f"({want.get('name')!r}) has config fingerprint {wc}: a different model (another config)")
    hw, ww = have.get("weights_fingerprint"), want.get("weights_fingerprint")
    if hw and ww and hw != ww:
        hl, wl = have.get("weights_layers") or [], want.get("weights_layers") or []
        diff = [l for l, (a, b) in enumerate(zip(hl, wl)) if a and b and a != b]
        return (f"the {what} was made for model {have.get('name')!r} with weights fingerprint {hw}, this model "
                f"({want.get('name')!r}) has the same config but weights fingerprint {ww} (attention weights of "
                f"layers {diff[:12]}{'...' if len(diff) > 12 else ''} differ): same config, different weights")
    return None


def allow_weights_mismatch() -> bool:
    """`oscar --allow-weights-mismatch ...` (or $OSCAR_ALLOW_WEIGHTS_MISMATCH=1): a deliberate transfer."""
    return os.environ.get("OSCAR_ALLOW_WEIGHTS_MISMATCH", "") not in ("", "0")


# --------------------------------------------------------------------------- argument types
# argparse `type=` functions: a bad value is a one-line usage error (exit 2) before any command runs. They raise
# ArgumentTypeError (argparse prints its message), never OscarError.

def _number(s: str, what: str, conv, ok):
    """`conv(s)` when it parses, is finite and satisfies `ok`; else a usage error saying it must be `what`."""
    try:
        v = conv(str(s).strip())
    except ValueError:
        v = None
    if v is None or not math.isfinite(v) or not ok(v):
        raise argparse.ArgumentTypeError(f"must be {what}, got {s!r}")
    return v


def positive_int(s: str) -> int:
    """An integer >= 1 (sizes, counts, lengths)."""
    return _number(s, "a positive integer", int, lambda v: v >= 1)


def nonneg_int(s: str) -> int:
    """An integer >= 0 (windows that may be empty, seeds, indices)."""
    return _number(s, "an integer >= 0", int, lambda v: v >= 0)


def positive_float(s: str) -> float:
    """A finite number > 0 (GiB, seconds, degrees of freedom)."""
    return _number(s, "a positive number", float, lambda v: v > 0)


def nonneg_float(s: str) -> float:
    """A finite number >= 0."""
    return _number(s, "a number >= 0", float, lambda v: v >= 0)


def int_between(lo: int, hi: int):
    """`type=` for an integer in lo..hi (bits per element: 1..8)."""
    def check(s: str) -> int:
        return _number(s, f"an integer in {lo}..{hi}", int, lambda v: lo <= v <= hi)

    check.__name__ = f"int_{lo}_{hi}"
    return check


def _items(s: str, what: str) -> list[str]:
    items = [x.strip() for x in str(s).split(",")]
    if not any(items):
        raise argparse.ArgumentTypeError(f"must be a comma list of {what}, got {s!r}")
    if not all(items):
        raise argparse.ArgumentTypeError(f"empty item in the comma list {s!r}")
    return items


def parse_token_count(s: str) -> int:
    """'4k' -> 4096, '128k' -> 131072, '1500' -> 1500 (1k = 1024 tokens, fractions of k truncated as the validate
    commands read them); ValueError otherwise."""
    t = str(s).strip().lower()
    if not t.endswith("k"):
        return int(t)
    v = float(t[:-1]) * 1024
    if not math.isfinite(v):
        raise ValueError(s)
    return int(v)


def length_list(s: str) -> str:
    """`type=` for a comma list of token lengths (1k = 1024): every one a positive whole number of tokens.
    Returns the string unchanged (the command parses it as before); a bad list is a usage error at parse time."""
    for x in _items(s, "lengths"):
        try:
            v = parse_token_count(x)
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad length {x!r} in {s!r}: use tokens (e.g. 3000) or k-units "
                                             "(1k = 1024)") from None
        if v < 1:
            raise argparse.ArgumentTypeError(f"length {x!r} in {s!r} must be at least 1 token")
    return s


def token_count(s: str) -> int:
    """`type=` for one token count, as tokens or k-units (1k = 1024): a positive whole number of tokens."""
    return parse_token_count(length_list(s))


def nonneg_int_list(s: str) -> str:
    """`type=` for a comma list of integers >= 0 (layer indices); the empty string (the default) is allowed.
    Returns the string unchanged."""
    if not str(s).strip():
        return s
    for x in _items(s, "integers >= 0"):
        try:
            v = int(x)
        except ValueError:
            v = -1
        if v < 0:
            raise argparse.ArgumentTypeError(f"{x!r} in {s!r} must be an integer >= 0")
    return s


def positive_float_list(s: str) -> str:
    """`type=` for a comma list of numbers > 0 (clip factors). Returns the string unchanged."""
    for x in _items(s, "positive numbers"):
        try:
            v = float(x)
        except ValueError:
            v = float("nan")
        if not (math.isfinite(v) and v > 0):
            raise argparse.ArgumentTypeError(f"{x!r} in {s!r} must be a positive number")
    return s


# --------------------------------------------------------------------------- output paths
FILE_SUFFIXES = (".safetensors", ".json", ".jsonl", ".parquet", ".md", ".html", ".txt", ".csv", ".gguf", ".png")


def _probe_writable(d: str) -> str | None:
    """Why no file can be created in existing directory `d` (None: one can). `os.access` is not enough: root is
    granted W_OK on /proc, /sys and read-only mounts, where creating a file then fails. So create a uniquely named
    empty file in `d` and remove it at once."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=".oscar-write-probe-", dir=d)
    except OSError as e:
        return e.strerror or str(e)
    os.close(fd)
    try:
        os.unlink(tmp)
    except OSError:
        pass
    return None


def check_output_path(path: str, *, file: bool | None = None, flag: str = "--out") -> None:
    """Refuse, before any work, an output path the command could not write at the end.

    file=None: a path with a known file suffix (.safetensors, .json, ...) is a file, else a directory.
    A file needs an existing directory where a file can be created (probed: a temporary file is created and
    removed) and must not be a directory; an existing file must open for writing. A directory (created by the
    command) must not be an existing file, and its nearest existing ancestor must be a directory where the
    command can create entries (probed the same way). Nothing is created or left behind.
    """
    p = os.path.abspath(os.path.expanduser(str(path)))
    file = os.path.splitext(p)[1].lower() in FILE_SUFFIXES if file is None else file
    if file:
        if os.path.isdir(p):
            raise OscarError(f"{flag} {path} is a directory; give a file path")
        d = os.path.dirname(p)
        if not os.path.isdir(d):
            raise OscarError(f"{flag} {path}: directory {os.path.dirname(str(path)) or d} does not exist "
                             f"(create it first)")
        if os.path.exists(p):
            try:
                os.close(os.open(p, os.O_WRONLY))  # no O_TRUNC, no O_CREAT: the file is left as it is
            except OSError as e:
                raise OscarError(f"{flag} {path}: not writable ({e.strerror or e})") from None
        why = _probe_writable(d)
        if why:
            raise OscarError(f"{flag} {path}: cannot create a file in {os.path.dirname(str(path)) or d} ({why})")
        return
    if os.path.exists(p) and not os.path.isdir(p):
        raise OscarError(f"{flag} {path} exists and is not a directory")
    a = p
    while not os.path.exists(a):
        a = os.path.dirname(a)
    if not os.path.isdir(a):
        raise OscarError(f"{flag} {path}: {a} is a file, so the directory cannot be created")
    why = _probe_writable(a) if os.access(a, os.X_OK) else "permission denied"
    if why:
        raise OscarError(f"{flag} {path}: {a} is not writable ({why})")


# The recipe's discrete choices (the clip factor of the tune, each layer's clip, the per-layer widths) compare
# float32 objectives that different hosts compute with different kernels (summation orders of AVX2 and AVX-512
# GEMMs, the native or torch attention). float32's unit roundoff is u = 2^-24 ~ 6e-8; a reduction of n terms in
# another order moves a sum by ~sqrt(n) u relative (random rounding), and a forward (+ backward) through L layers
# adds L such steps: L sqrt(n) u = 30 x sqrt(2048) x 6e-8 ~ 8e-5 for SmolLM2's 30 layers over a 2048-token window.
# Objectives within TIE_REL of each other are therefore ties, broken by a fixed rule at each choice
# (docs/decisions/0084-the-recipe-s-choices-do-not-depend-on-the-host-s.md, "The recipe's choices do not depend on the host's kernels").
TIE_REL = 1e-4


# How far the recipe's objectives move between stores of one model calibrated through different kernel paths:
# `bash lab/tie_spread.sh DIR` (SmolLM2, 16,384 calibration tokens, one store through the native CPU kernels, one
# through torch's, one on a host held to AVX2). The INT2 codes of the tune's window flip between such stores'
# artifacts and no scoring precision removes that (docs/decisions/0084-the-recipe-s-choices-do-not-depend-on-the-host-s.md):
# differences inside the measured spread are ties, broken by the smaller change
# (docs/decisions/0103-the-recipe-s-choices-tie-at-the-spread-between-stores.md).
# The tune: the gap between two factors' NLLs moved by up to 0.98 % (float64 scoring; 0.68 % in float32).
STORE_TIE_REL = 0.01
# The widths: an entry of the copy-NLL table moved by up to 1.8 % of the table's largest |entry| (at the tuned
# x1.1), and the DP weighs one layer's gain against another's, a difference that moves by up to twice that.
STORE_TIE_TABLE = 0.04


def smallest_change(options, values, rel: float = STORE_TIE_REL, neutral: float = 1.0) -> int:
    """Index of the option to take: among `values` (lower is better) within `rel` of the best (ties), the option
    nearest `neutral` (the smallest change; x1.0 for a scale factor), then the smaller option."""
    return min(tied_best(values, rel), key=lambda i: (abs(math.log(options[i] / neutral)), options[i]))


def narrower_on_ties(table, rel: float = STORE_TIE_TABLE) -> np.ndarray:
    """A (rows, options) table of objectives (lower is better; options from the narrowest to the widest) as a
    choice should read it: an option counts as better than the narrower ones only where it beats each of them by
    more than `rel` of the table's largest |entry|; otherwise it takes the best narrower value, a tie that a rule
    preferring the lower cost gives to the narrower option."""
    t = np.asarray(table, dtype=float)
    tol = rel * float(np.abs(t).max())
    out = t.copy()
    for o in range(1, t.shape[1]):
        out[:, o] = np.where(t[:, o] < t[:, :o].min(1) - tol, t[:, o], out[:, :o].min(1))
    return out


def tied_best(values, rel: float = TIE_REL) -> list[int]:
    """Indices of `values` (a 1-D sequence, lower is better) within `rel` of the smallest, in order: the candidates
    a fixed rule then chooses from. Negative or zero minima use the band rel * max|v| around the minimum."""
    v = [float(x) for x in values]
    lo = min(v)
    scale = lo if lo > 0 else max(abs(x) for x in v)
    return [i for i, x in enumerate(v) if x <= lo + rel * scale]
