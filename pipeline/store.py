"""The calibration store `oscar-calib/2`: a zarr v3 group of per-block float64 sums.

See docs/store-format.md for the public names. Exactly-once resume comes from the layout:
every per-layer array has one chunk per block, a (block, layer) is rewritten whole and then
marked done (`done[b, l]`, written last), and `reduce` sums done blocks in block order.
Integrity: with its done marker each (block, layer) records a CRC-32 of every array's block
value (`checksums`); `CalibStore.verify` finds missing, truncated or altered chunks of done
blocks, `repair` un-marks them so a resumed run redoes them, and every reader refuses them.
Stores of format `oscar-calib/1` (no checksums) are read with a warning.

Writers: one process, or several (Ray stage actors), each owning a set of layers and
holding a `WriterLock` on them; chunks of different layers never share a file.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import socket
import sys
import threading
import time
import uuid
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np
import zarr

from oscar.common import OscarError, canonical_json, fingerprint, model_mismatch
from oscar.dirlock import HEARTBEAT, describe_holder, holder_alive, holder_record, renew_file


def _load_syncfs():
    """libc syncfs(2) (Linux): flush one filesystem, not the whole machine's dirty pages."""
    try:
        return ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):
        return None


_SYNCFS = _load_syncfs()

FORMAT = "oscar-calib/2"       # /1 + `checksums` (written with every done marker)
FORMAT_V1 = "oscar-calib/1"    # no checksums: read with a warning, never verified
# An MLA model's store: the latent's statistics per layer (`latent_layer_arrays`), checksummed as /2. A format of
# its own so that readers of per-head stores (and older versions of oscar-kv) refuse it by name.
FORMAT_LATENT = "oscar-calib-latent/1"
READS = (FORMAT_V1, FORMAT, FORMAT_LATENT)
XS = ("q", "k", "v", "o")
CHECKSUM_ALGO = "crc32"
EXTRA_SLOT = "_extra"  # last checksum slot: the additive arrays of a (block, layer) (Ray: expert_tokens), 0 if none
_WARNED: set[str] = set()


def block_checksum(value: np.ndarray, dtype) -> int:
    """CRC-32 of a block value as stored: C-order, little-endian `dtype` bytes (zlib releases the GIL)."""
    return zlib.crc32(np.ascontiguousarray(value, dtype=np.dtype(dtype).newbyteorder("<")).tobytes())


def warn_unverified(path, fmt: str) -> None:
    """Once per store and process: a /1 store has no checksums, damage in it goes unnoticed."""
    key = os.path.abspath(str(path))
    if key not in _WARNED:
        _WARNED.add(key)
        print(f"oscar: WARNING: {path} is an {fmt} store written before block checksums existed; its blocks "
              f"cannot be verified (a damaged chunk would go unnoticed). Re-calibrate into a new store to get "
              f"{FORMAT}.", file=sys.stderr)


@dataclass
class Damage:
    """One damaged array of a done (block, layer)."""
    block: int
    layer: int
    array: str
    problem: str  # "missing chunk", "truncated chunk (n of m bytes)", "checksum mismatch", ...

    def __str__(self) -> str:
        return f"block {self.block}, layer {self.layer}, {self.array}: {self.problem}"


def format_damage(path, damage: list[Damage], limit: int = 20) -> str:
    blocks = sorted({d.block for d in damage})
    lines = [f"store {path} is damaged: {len(damage)} array chunk(s) of done block(s) {blocks[:20]}"
             f"{'...' if len(blocks) > 20 else ''} fail verification:"]
    lines += [f"  {d}" for d in damage[:limit]]
    if len(damage) > limit:
        lines.append(f"  ... {len(damage) - limit} more")
    lines.append("re-run the same `oscar calibrate` command to redo those blocks (resume verifies and redoes them), "
                 "or `oscar verify` to list every damaged chunk")
    return "\n".join(lines)


def layer_arrays(H: int, D: int, R: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, per-block shape) of every `layers/{l}/` array, in write order."""
    a: dict[str, tuple[str, tuple[int, ...]]] = {}
    for x in XS:
        a[f"{x}_gram"] = ("float64", (H, D, D))
        a[f"{x}_sum"] = ("float64", (H, D))
        a[f"{x}_m3"] = ("float64", (H, D))
        a[f"{x}_m4"] = ("float64", (H, D))
        a[f"{x}_absmax"] = ("float64", (H, D))
        a[f"{x}_res"] = ("float32", (H, R, D))
    a["q_count"] = ("int64", ())
    a["kv_count"] = ("int64", ())
    a["vw_gram"] = ("float64", (H, D, D))
    a["w_sum"] = ("float64", (H,))
    a["nonfinite"] = ("int64", ())
    a["res_count"] = ("int64", ())
    a["qo_res_count"] = ("int64", ())
    return a


def latent_layer_arrays(r: int, R: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, per-block shape) of every `layers/{l}/` array of a latent store, in write order
    (r = kv_lora_rank; sums over a block's counted tokens, heads pooled; docs/store-format.md):

        c_gram, c_sum, c_m3, c_m4, c_absmax   the latent c_kv (kv_a_layernorm output): Σ c cᵀ, Σ c, Σ c³, Σ c⁴, max |c|
        qa_gram    Σ over heads and tokens of q̃ q̃ᵀ, q̃_h = q_nope,h W_UK,h (the absorbed queries: what the logits
                   read of the latent, the latent analogue of C_Q)
        ol_gram    Σ over heads and tokens of õ õᵀ, õ_h = S_h C (the attention-weighted latent: the value path's
                   input before W_UV, the analogue of C_S)
        uv_gram    token count x Σ_h W_UV,hᵀ W_UV,h (how the value up-projections weigh latent directions)
        c_res, qa_res   reservoirs (R rows) of latents and absorbed queries (a random head per row)
        count, q_count  latent rows, absorbed-query rows (count x heads); nonfinite, res_count, qo_res_count
    """
    a: dict[str, tuple[str, tuple[int, ...]]] = {
        "c_gram": ("float64", (r, r)), "c_sum": ("float64", (r,)), "c_m3": ("float64", (r,)),
        "c_m4": ("float64", (r,)), "c_absmax": ("float64", (r,)), "qa_gram": ("float64", (r, r)),
        "ol_gram": ("float64", (r, r)), "uv_gram": ("float64", (r, r)), "c_res": ("float32", (R, r)),
        "qa_res": ("float32", (R, r)), "count": ("int64", ()), "q_count": ("int64", ()), "nonfinite": ("int64", ()),
        "res_count": ("int64", ()), "qo_res_count": ("int64", ()),
    }
    return a


def store_arrays(meta: "StoreMeta") -> dict[str, tuple[str, tuple[int, ...]]]:
    """The per-layer arrays of a store of `meta`'s kind."""
    L, H, D, R = meta.shapes
    return latent_layer_arrays(D, R) if meta.latent else layer_arrays(H, D, R)


@dataclass
class StoreMeta:
    """Root attributes: what the store was made from. Resume requires model, corpus and config to match."""
    model: dict          # name, fingerprint, num_layers, num_q_heads, num_kv_heads, head_dim
    corpus: dict         # name, fingerprint, split
    seq_len: int
    sink: int
    num_blocks: int
    seqs_per_block: int
    reservoir: int
    config: dict = field(default_factory=dict)
    format: str = FORMAT

    @property
    def latent(self) -> bool:
        """A latent (MLA) store: its arrays are `latent_layer_arrays`, D in `shapes` is kv_lora_rank."""
        return self.format == FORMAT_LATENT

    @property
    def shapes(self) -> tuple[int, int, int, int]:
        m = self.model
        if self.latent:
            return m["num_layers"], m["num_q_heads"], m["latent"]["kv_lora_rank"], self.reservoir
        return m["num_layers"], m["num_kv_heads"], m["head_dim"], self.reservoir

    def to_attrs(self) -> dict:
        return json.loads(canonical_json(asdict(self)))  # plain JSON types

    @classmethod
    def from_attrs(cls, a: dict, path: str = "store") -> "StoreMeta":
        keys = {"model", "corpus", "seq_len", "sink", "num_blocks", "seqs_per_block", "reservoir", "config", "format"}
        missing = [k for k in ("model", "corpus", "seq_len", "sink", "num_blocks", "seqs_per_block", "reservoir")
                   if k not in a]
        missing += [f"model.{k}" for k in ("num_layers", "num_kv_heads", "head_dim")
                    if "model" in a and k not in (a["model"] or {})]
        if a.get("format") == FORMAT_LATENT and not (a.get("model") or {}).get("latent"):
            missing.append("model.latent")
        if missing:
            raise OscarError(f"{path}: store root attributes incomplete (missing {', '.join(missing)})")
        return cls(**{k: a[k] for k in keys if k in a})


def store_fingerprint(attrs: dict, blocks: list[int]) -> str:
    """What an artifact's provenance records of the store it was fitted on: format, model, corpus,
    job config and the blocks used."""
    return fingerprint({"format": attrs.get("format"), "model": attrs.get("model"), "corpus": attrs.get("corpus"),
                        "config": attrs.get("config"), "blocks": list(blocks)})


def recorded_job(path: str | os.PathLike) -> dict | None:
    """The job config a store records (what `oscar calibrate --store PATH` alone resumes with), its blocks done
    and total; None where PATH holds no store of ours or one that records no job config (format /1)."""
    path = Path(path)
    a = _attrs(path) if path.is_dir() else {}
    if a.get("format") not in READS or a.get("creating") or not a.get("config"):
        return None
    done = CalibStore(path).done()  # (num_blocks, num_layers)
    return {"config": dict(a["config"]), "blocks_done": int(done.all(axis=1).sum()), "blocks_total": len(done)}


def resume_hint(path: str | os.PathLike) -> str:
    """What to do when a store cannot be resumed with the given settings: its own job config first, deleting it last."""
    return (f"to resume it: `oscar calibrate --store {path}` (it records its job config); to calibrate with these "
            f"settings, choose another --store; --overwrite deletes it and its done blocks")


def _mismatch(path: str, old: StoreMeta, new: StoreMeta) -> str | None:
    """Why the store at `path` cannot be resumed with `new` (None: it can)."""
    hint = resume_hint(path)
    om, nm = old.model, new.model
    why = model_mismatch(om, nm, "store")
    if why:
        return f"store {path}: {why}; {hint}"
    if om.get("name") != nm.get("name"):
        return (f"store {path} was made for model {om.get('name')!r} (fingerprint {om.get('fingerprint')}), "
                f"not {nm.get('name')!r} (fingerprint {nm.get('fingerprint')}); {hint}")
    oc, nc = old.corpus, new.corpus
    if oc.get("fingerprint") != nc.get("fingerprint") or oc.get("name") != nc.get("name"):
        return (f"store {path} was made from corpus {oc.get('name')!r} (fingerprint {oc.get('fingerprint')}), "
                f"not {nc.get('name')!r} (fingerprint {nc.get('fingerprint')}); {hint}")
    oa, na = old.to_attrs(), new.to_attrs()
    diffs = [f"{k}: {oa.get(k)!r} -> {na.get(k)!r}" for k in ("seq_len", "sink", "num_blocks", "seqs_per_block", "reservoir")
             if oa.get(k) != na.get(k)]
    oj, nj = oa.get("config", {}), na.get("config", {})
    diffs += [f"config.{k}: {oj.get(k)!r} -> {nj.get(k)!r}" for k in sorted(set(oj) | set(nj)) if oj.get(k) != nj.get(k)]
    if diffs:
        return f"store {path} was made with a different job config ({'; '.join(diffs)}); {hint}"
    return None


# --------------------------------------------------------------------------- writer lock

class WriterLock:
    """Per-layer lock files in `<store>.lock/` refusing a second concurrent writer.

    Several processes of one job (a Ray driver and its stage actors) pass the same `job` id:
    a lock held by the same job is shared, not refused. A lock whose holder is stale by the run directory's rules
    (oscar/dirlock.py: a dead process on this host, an expired lease on another) is taken over (and said so on
    stderr); a live holder is refused. The holder's heartbeat renews the lease of every layer file it owns.
    """

    def __init__(self, store_path: str | os.PathLike, layers: Iterable[int], *, job: str | None = None):
        self.dir = Path(str(store_path).rstrip("/") + ".lock")
        self.layers = sorted(int(l) for l in layers)
        self.host = socket.gethostname()
        self.job = job or f"{self.host}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.owned: list[Path] = []
        self.mu = threading.Lock()  # the heartbeat's lease renewal and the release never interleave
        self.info = {"job": self.job, **holder_record()}

    def _write_new(self, path: Path) -> bool:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(self.info, f)
        return True

    def acquire(self) -> "WriterLock":
        self.dir.mkdir(parents=True, exist_ok=True)
        try:
            for l in self.layers:
                path = self.dir / f"layer-{l:05d}.json"
                while not self._write_new(path):
                    try:
                        held = json.loads(path.read_text() or "{}")
                    except (OSError, ValueError):
                        held = {}
                    if held.get("job") == self.job:
                        break  # same job (driver / stage actors): shared
                    if held and holder_alive(held, self.host):
                        raise OscarError(
                            f"store {str(self.dir)[:-5]} is being written by {describe_holder(held)} (layer {l}: "
                            f"{path}); wait for it to finish, or delete that lock file if the process is gone")
                    # Stale: its holder died (or its node: the lease expired). Replace atomically, then check we
                    # won the race.
                    why = "dead pid" if held.get("host") == self.host else "expired lease of pid"
                    print(f"oscar: taking over stale lock {path} of {why} {held.get('pid')} on {held.get('host')} "
                          f"(job {held.get('job')}, since {held.get('since')})", file=sys.stderr)
                    tmp = path.with_suffix(f".{os.getpid()}.tmp")
                    tmp.write_text(json.dumps(self.info))
                    os.replace(tmp, path)
                    if json.loads(path.read_text()).get("job") != self.job:
                        continue
                    self.owned.append(path)
                    break
                else:
                    self.owned.append(path)
        except BaseException:
            self.release()
            raise
        HEARTBEAT.add(id(self), self._renew)
        return self

    def _renew(self, until: float) -> None:
        with self.mu:  # never after release has removed a file: that would bring the lock back
            for path in self.owned:
                renew_file(path, "job", self.job)(until)

    def release(self) -> None:
        HEARTBEAT.remove(id(self))
        with self.mu:
            for path in self.owned:
                try:
                    if json.loads(path.read_text()).get("job") == self.job:
                        path.unlink()
                except (OSError, ValueError):
                    pass
            self.owned = []
        try:
            self.dir.rmdir()  # only when empty
        except OSError:
            pass

    def __enter__(self) -> "WriterLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


# --------------------------------------------------------------------------- the store

def _attrs(path: Path) -> dict:
    try:
        return json.loads((path / "zarr.json").read_text()).get("attributes", {})
    except (OSError, ValueError):
        return {}


def store_format(path: str | os.PathLike) -> str | None:
    """The format a store directory records (None: no store of ours there); reads its root attributes only."""
    return _attrs(Path(path)).get("format")


def _is_store(path: Path) -> bool:
    return _attrs(path).get("format") in READS


class CalibStore:
    """An opened calibration store (read with mode="r", write with mode="r+")."""

    def __init__(self, path: str | os.PathLike, mode: str = "r"):
        self.path = Path(path)
        if not (self.path / "zarr.json").exists():
            raise OscarError(f"{self.path} is not a zarr store (no zarr.json)")
        try:
            self.group = zarr.open_group(str(self.path), mode=mode)
        except Exception as e:  # zarr raises several types for corrupt metadata
            raise OscarError(f"cannot open zarr store {self.path}: {e}") from e
        attrs = dict(self.group.attrs)
        if attrs.get("format") not in READS:
            raise OscarError(f"{self.path} is not an oscar calibration store: store format {attrs.get('format')!r}, "
                             f"readable: {' or '.join(READS)}")
        if attrs.get("creating"):
            raise OscarError(f"{self.path} was never fully created (a killed run); re-run oscar calibrate")
        self.meta = StoreMeta.from_attrs(attrs, str(self.path))
        self.num_layers, self.H, self.D, self.R = self.meta.shapes
        self.num_blocks = self.meta.num_blocks
        self.spec = store_arrays(self.meta)
        listed = (attrs.get("checksums") or {}).get("arrays")
        if listed:  # a store may hold a subset of the arrays (synthetic bench stores): its slots say which
            self.spec = {n: self.spec[n] for n in listed if n in self.spec}
        if "done" not in self.group:
            raise OscarError(f"{self.path}: store has no 'done' array")
        if tuple(self.group["done"].shape) != (self.num_blocks, self.num_layers):
            raise OscarError(f"{self.path}: 'done' has shape {tuple(self.group['done'].shape)}, expected "
                             f"(num_blocks, num_layers) = {(self.num_blocks, self.num_layers)}")
        self._arrays: dict[str, object] = {}
        self._dirs: set[Path] = set()
        self.mode = mode
        self.checksummed = attrs.get("format") != FORMAT_V1 and "checksums" in self.group
        if not self.checksummed:
            warn_unverified(self.path, attrs.get("format"))
        self.checksum_names = list(self.spec) + [EXTRA_SLOT]
        self.checksum_s = 0.0  # time spent hashing and writing checksum records (bench/calibrate.py reports it)

    # ---------------------------------------------------------------- creation
    @classmethod
    def create(cls, path: str | os.PathLike, meta: StoreMeta, tokens: np.ndarray, mask: np.ndarray,
               arrays: Iterable[str] | None = None) -> "CalibStore":
        """Create an empty store (tokens and mask written, nothing done). `path` must not hold a store.

        `arrays`: the per-layer arrays to hold (default: all of `layer_arrays`); a subset is for
        synthetic bench stores, recorded as the checksum slots (`checksums.arrays`)."""
        path = Path(path)
        L, H, D, R = meta.shapes
        B, S, T = meta.num_blocks, meta.seqs_per_block, meta.seq_len
        if tokens.shape != (B, S, T) or mask.shape != (B, S, T):
            raise OscarError(f"tokens {tokens.shape} / mask {mask.shape} do not match (blocks, seqs, seq_len) = {(B, S, T)}")
        # `creating` marks a store whose arrays are not all there yet (a killed creation is redone).
        root = zarr.create_group(store=str(path), zarr_format=3, overwrite=False,
                                 attributes={"format": meta.format, "creating": True})
        kw = dict(compressors=None, fill_value=0)
        root.create_array("tokens", shape=(B, S, T), chunks=(1, S, T), dtype="int32", fill_value=0)[:] = tokens
        root.create_array("mask", shape=(B, S, T), chunks=(1, S, T), dtype="uint8", fill_value=0)[:] = mask
        root.create_array("done", shape=(B, L), chunks=(1, 1), dtype="uint8", **kw)
        spec = store_arrays(meta)
        if arrays is not None:
            unknown = set(arrays) - set(spec)
            if unknown:
                raise OscarError(f"unknown store arrays {sorted(unknown)}; known: {', '.join(spec)}")
            spec = {n: v for n, v in spec.items() if n in set(arrays)}
        # one CRC-32 per array of a (block, layer), in spec order + EXTRA_SLOT; written just before done[b, l]
        root.create_array("checksums", shape=(B, L, len(spec) + 1), chunks=(1, 1, len(spec) + 1), dtype="uint32", **kw)
        for l in range(L):
            for name, (dtype, tail) in spec.items():
                root.create_array(f"layers/{l}/{name}", shape=(B, *tail), chunks=(1, *tail), dtype=dtype, **kw)
        root.attrs.update({**meta.to_attrs(), "creating": False,
                           "checksums": {"algorithm": CHECKSUM_ALGO, "arrays": [*spec, EXTRA_SLOT]}})
        return cls(path, mode="r+")

    @classmethod
    def open_or_create(cls, path: str | os.PathLike, meta: StoreMeta, tokens: np.ndarray, mask: np.ndarray,
                       *, overwrite: bool = False) -> "CalibStore":
        """Resume the store at `path` if it matches `meta` (refuse otherwise), or create it.

        The caller holds the WriterLock of every layer (creation and overwrite touch them all).
        """
        path = Path(path)
        if path.exists() and not path.is_dir():
            raise OscarError(f"--store {path} exists and is not a directory")
        if path.exists() and any(path.iterdir()):
            if not _is_store(path):
                raise OscarError(f"--store {path} is a non-empty directory that is not an {FORMAT} store; "
                                 f"refusing to touch it")
            if overwrite:
                print(f"oscar: --overwrite: deleting the existing store {path}", file=sys.stderr)
                shutil.rmtree(path)
            elif _attrs(path).get("creating"):
                print(f"oscar: {path} was left half-created by a killed run; creating it again", file=sys.stderr)
                shutil.rmtree(path)
            else:
                store = cls(path, mode="r+")
                why = _mismatch(str(path), store.meta, meta)
                if why:
                    raise OscarError(why)
                if not (np.array_equal(store.group["tokens"][:], tokens)
                        and np.array_equal(store.group["mask"][:], mask)):
                    raise OscarError(f"store {path} holds other token ids than this corpus and tokenizer produce "
                                     f"(same fingerprints); choose another --store, or --overwrite to delete it")
                return store
        if path.exists():
            path.rmdir()
        return cls.create(path, meta, tokens, mask)

    # ---------------------------------------------------------------- state
    def array(self, name: str):
        a = self._arrays.get(name)
        if a is None:
            a = self._arrays[name] = self.group[name]
        return a

    def done(self) -> np.ndarray:
        """(num_blocks, num_layers) bool."""
        return self.array("done")[:].astype(bool)

    def todo_blocks(self, layers: Iterable[int] | None = None) -> list[int]:
        """Blocks not yet done for at least one of `layers`, in block order."""
        layers = list(range(self.num_layers)) if layers is None else list(layers)
        d = self.done()[:, layers]
        return [b for b in range(self.num_blocks) if not d[b].all()]

    def _chunk_path(self, name: str, block: int) -> Path:
        a = self.array(name)
        key = a.metadata.encode_chunk_key((block,) + (0,) * (a.ndim - 1))
        return self.path / a.path / key

    def partial(self, block: int, layer: int) -> bool:
        """True if (block, layer) has chunks written but no done marker (a crashed write)."""
        if self.done_at(block, layer):
            return False
        first = next(iter(self.spec))  # chunks are written in spec order: the first exists if any does
        return self._chunk_path(f"layers/{layer}/{first}", block).exists()

    def done_at(self, block: int, layer: int) -> bool:
        return bool(self.array("done")[block, layer])

    # ---------------------------------------------------------------- writing
    def _raw_codec(self, a) -> bool:
        """True if chunks of `a` are stored as raw little-endian bytes (no compression)."""
        codecs = a.metadata.codecs
        return len(codecs) == 1 and type(codecs[0]).__name__ == "BytesCodec" and str(getattr(codecs[0].endian, "value", "")) == "little"

    def _write_file(self, path: Path, data: bytes) -> None:
        """Replace one chunk file atomically (write a temp file, rename)."""
        self._mkdir(path.parent)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)

    def put(self, name: str, block: int, value: np.ndarray) -> int:
        """Write chunk `block` of a one-block-per-chunk array whole; returns its CRC-32 (`block_checksum`)."""
        a = self.array(name)
        value = np.asarray(value)
        if value.shape != a.shape[1:]:
            raise ValueError(f"{name}: block value shape {value.shape} != {a.shape[1:]}")
        data = np.ascontiguousarray(value, dtype=a.dtype.newbyteorder("<")).tobytes()
        if self._raw_codec(a):
            # Uncompressed little-endian chunk = the raw C-order bytes: write it directly (atomic
            # rename), ~10x faster than zarr's per-chunk async machinery for hundreds of small arrays.
            self._write_file(self._chunk_path(name, block), data)
        else:
            a[block] = value
        t = time.perf_counter()
        crc = zlib.crc32(data)
        self.checksum_s += time.perf_counter() - t
        return crc

    def write_layer(self, block: int, layer: int, arrays: dict[str, np.ndarray]) -> None:
        """Write every array of (block, layer) whole, then the done marker (last)."""
        self.write_block(block, {layer: arrays})

    def write_block(self, block: int, layers: dict[int, dict[str, np.ndarray]],
                    extra: dict[int, dict[str, np.ndarray]] | None = None) -> None:
        """Write every array of `block` for each of `layers`, make them durable, then the done markers.

        `extra`: additive arrays per layer (the Ray path's `expert_tokens`), written and checksummed
        with the layer. Each layer's checksums chunk is written after its arrays and before the sync.
        One filesystem sync per block instead of one fsync per marker: a marker is only ever
        written after its chunks reached the disk, so even a host crash cannot leave a done
        marker over missing data (a lost marker only means the block is redone).
        """
        extra = extra or {}
        for layer, arrays in layers.items():
            missing = set(self.spec) - set(arrays)
            if missing:
                raise ValueError(f"write_layer: missing arrays {sorted(missing)}")
        for layer, arrays in layers.items():
            crcs = [self.put(f"layers/{layer}/{name}", block, arrays[name]) for name in self.spec]
            ex = 0
            for name in sorted(extra.get(layer, {})):
                ex = zlib.crc32(name.encode(), ex)
                ex = zlib.crc32(self.put(f"layers/{layer}/{name}", block, extra[layer][name]).to_bytes(4, "little"), ex)
            if self.checksummed:
                t = time.perf_counter()
                self._put_checksums(block, layer, crcs + [ex])
                self.checksum_s += time.perf_counter() - t
        self.sync()
        for layer in layers:
            self._put_done(block, layer)

    def sync(self) -> None:
        """Flush the store's filesystem (syncfs on Linux; fsync of the root elsewhere)."""
        fd = os.open(self.path, os.O_RDONLY)
        try:
            if _SYNCFS is None or _SYNCFS(fd) != 0:
                os.fsync(fd)
        finally:
            os.close(fd)

    def _mkdir(self, d: Path) -> None:
        if d not in self._dirs:
            d.mkdir(parents=True, exist_ok=True)
            self._dirs.add(d)

    def _done_path(self, block: int, layer: int) -> Path:
        return self.path / "done" / self.array("done").metadata.encode_chunk_key((block, layer))

    def _put_done(self, block: int, layer: int) -> None:
        self._write_file(self._done_path(block, layer), b"\x01")

    def _put_checksums(self, block: int, layer: int, crcs: list[int]) -> None:
        a = self.array("checksums")
        path = self.path / "checksums" / a.metadata.encode_chunk_key((block, layer, 0))
        self._write_file(path, np.asarray(crcs, dtype="<u4").tobytes())

    # ---------------------------------------------------------------- integrity
    def _extra_names(self, layer: int) -> list[str]:
        """Additive arrays of `layers/{layer}/` (not in the spec), from the directory listing."""
        d = self.path / "layers" / str(layer)
        try:
            return sorted(n for n in os.listdir(d) if n not in self.spec and (d / n / "zarr.json").exists())
        except OSError:
            return []

    def _read_block(self, name: str, block: int) -> tuple[bytes | None, str | None]:
        """(stored bytes of chunk `block` of `name` as block_checksum hashes them, problem or None)."""
        a = self.array(name)
        path = self._chunk_path(name, block)
        if not path.exists():
            return None, "missing chunk"
        want = int(np.prod(a.shape[1:], dtype=np.int64)) * a.dtype.itemsize
        if self._raw_codec(a):
            try:
                data = path.read_bytes()
            except OSError as e:
                return None, f"unreadable chunk ({e.strerror})"
            if len(data) != want:
                return None, f"truncated chunk ({len(data)} of {want} bytes)" if len(data) < want else \
                    f"oversized chunk ({len(data)} bytes, expected {want})"
            return data, None
        try:
            v = a[block]
        except Exception as e:  # a corrupt compressed chunk: zarr/numcodecs raise many types
            return None, f"undecodable chunk ({type(e).__name__}: {str(e)[:120]})"
        return np.ascontiguousarray(v, dtype=a.dtype.newbyteorder("<")).tobytes(), None

    def verify_block(self, block: int, layer: int) -> list[Damage]:
        """Damage of one done (block, layer): every array re-read and compared to its recorded CRC-32."""
        if not self.checksummed:
            return []
        ca = self.array("checksums")
        cpath = self.path / "checksums" / ca.metadata.encode_chunk_key((block, layer, 0))
        try:
            rec = np.frombuffer(cpath.read_bytes(), dtype="<u4")
        except OSError:
            return [Damage(block, layer, "checksums", "checksum record missing")]
        if rec.size != len(self.checksum_names):
            return [Damage(block, layer, "checksums", f"checksum record truncated ({rec.size * 4} of "
                                                      f"{len(self.checksum_names) * 4} bytes)")]
        out = []
        for i, name in enumerate(self.spec):
            data, problem = self._read_block(f"layers/{layer}/{name}", block)
            if problem is None and zlib.crc32(data) != int(rec[i]):
                problem = "checksum mismatch (the chunk's bytes were altered)"
            if problem:
                out.append(Damage(block, layer, f"layers/{layer}/{name}", problem))
        if int(rec[-1]):  # additive arrays were written with this (block, layer): their combined CRC
            ex, names = 0, self._extra_names(layer)
            for name in names:
                data, problem = self._read_block(f"layers/{layer}/{name}", block)
                if problem:
                    out.append(Damage(block, layer, f"layers/{layer}/{name}", problem))
                    data = b""
                ex = zlib.crc32(name.encode(), ex)
                ex = zlib.crc32(zlib.crc32(data).to_bytes(4, "little"), ex)
            if ex != int(rec[-1]) and not any(d.array in {f"layers/{layer}/{n}" for n in names} for d in out):
                out.append(Damage(block, layer, f"layers/{layer}/{','.join(names) or '(additive arrays)'}",
                                  "checksum mismatch (the chunk's bytes were altered, or an additive array is gone)"))
        return out

    def verify(self, layers: Iterable[int] | None = None, blocks: Iterable[int] | None = None) -> list[Damage]:
        """Every damaged array chunk of the done (block, layer)s of `layers` x `blocks` (default: all).

        A store without checksums (format /1) verifies nothing (it warned when opened).
        """
        if not self.checksummed:
            return []
        layers = range(self.num_layers) if layers is None else layers
        blocks = range(self.num_blocks) if blocks is None else blocks
        done = self.done()
        return [d for b in blocks for l in layers if done[b, l] for d in self.verify_block(b, l)]

    def check(self, layers: Iterable[int] | None = None) -> None:
        """Raise OscarError naming every damaged chunk (block, layer, array): what readers call."""
        damage = self.verify(layers)
        if damage:
            raise OscarError(format_damage(self.path, damage))

    def repair(self, layers: Iterable[int] | None = None) -> list[Damage]:
        """Un-mark every damaged done (block, layer) of `layers` so a resumed run redoes it (the caller
        holds their WriterLock); reports each on stderr. Returns the damage found."""
        damage = self.verify(layers)
        for b, l in sorted({(d.block, d.layer) for d in damage}):
            for d in damage:
                if (d.block, d.layer) == (b, l):
                    print(f"oscar calibrate: damaged done block: {d}; redoing block {b} layer {l}", file=sys.stderr)
            try:
                self._done_path(b, l).unlink()
            except FileNotFoundError:
                pass
        return damage

    # ---------------------------------------------------------------- reading
    def has(self, name: str) -> bool:
        return name in self.group

    def read(self, name: str, blocks: list[int] | None = None) -> np.ndarray:
        """Array `name` (e.g. `layers/3/q_gram`), restricted to `blocks` along the block axis (default: all)."""
        if name not in self.group:
            raise OscarError(f"{self.path}: store has no array {name!r}")
        a = self.array(name)
        if blocks is None:
            return np.asarray(a[:])
        blocks = [int(b) for b in blocks]
        if blocks and blocks == list(range(blocks[0], blocks[-1] + 1)):
            return np.asarray(a[blocks[0]:blocks[-1] + 1])
        return np.asarray(a.get_orthogonal_selection((blocks,)))

    def reservoir(self, layer: int, x: str, head: int) -> list[np.ndarray]:
        """Valid reservoir rows of `x` in q/k/v/o for one KV head, per block: [(n_b, D) float32]
        (`res_count` rows for k/v; `qo_res_count` for q/o when the store has it)."""
        if not 0 <= layer < self.num_layers:
            raise OscarError(f"layer {layer} out of range (store has {self.num_layers})")
        if not 0 <= head < self.H:
            raise OscarError(f"head {head} out of range (store has {self.H} KV heads)")
        cnt = self.read(f"layers/{layer}/res_count")
        if x in "qo" and self.has(f"layers/{layer}/qo_res_count"):
            cnt = self.read(f"layers/{layer}/qo_res_count")
        a = self.array(f"layers/{layer}/{x}_res")
        return [np.asarray(a[b, head, : int(cnt[b])]) for b in range(len(cnt))]

    def block_values(self, stat: str, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """(done block indices, their per-block values (n, ...)) of `layers/{layer}/{stat}`."""
        if stat not in self.spec:
            raise OscarError(f"unknown statistic {stat!r}; the store has {', '.join(self.spec)}")
        blocks = np.flatnonzero(self.done()[:, layer])
        vals = self.array(f"layers/{layer}/{stat}")[:]
        return blocks, vals[blocks]


def _reduce_one(stat: str, vals: np.ndarray, counts: np.ndarray | None) -> np.ndarray:
    if stat.endswith("_res") and vals.ndim == 3:  # a latent store's (R, r) per block: (N, r)
        return np.concatenate([v[: int(c)] for v, c in zip(vals, counts)], axis=0) if len(vals) else vals[0, :0]
    if stat.endswith("_res"):  # concatenate the valid rows of every block: (Hkv, N, D)
        return np.concatenate([v[:, : int(c)] for v, c in zip(vals, counts)], axis=1) if len(vals) else vals[:0].sum(0)[:, :0]
    if stat.endswith("_absmax"):
        return np.max(vals, axis=0) if len(vals) else np.zeros(vals.shape[1:], vals.dtype)
    acc = np.zeros(vals.shape[1:], dtype=vals.dtype)
    for v in vals:  # block order: deterministic, bit-identical across resumes
        acc = acc + v
    return acc


def reduce(store: "CalibStore | str | os.PathLike", stat: str, layers: Iterable[int] | None = None) -> dict[int, np.ndarray]:
    """{layer: sum over done blocks in block order} of `layers/{l}/{stat}`.

    float64 sums (int64 for counts); `*_absmax` -> max; `*_res` -> the valid reservoir rows of
    all done blocks concatenated, (Hkv, N, D). Divide sums by `q_count` / `kv_count` yourself.
    """
    st = store if isinstance(store, CalibStore) else CalibStore(store)
    layers = range(st.num_layers) if layers is None else layers
    out = {}
    for l in layers:
        blocks, vals = st.block_values(stat, l)
        counts = None
        if stat.endswith("_res"):
            cname = "qo_res_count" if stat[0] in "qo" else "res_count"
            counts = st.array(f"layers/{l}/{cname}")[:][blocks]
        out[int(l)] = _reduce_one(stat, vals, counts)
    return out


def open_verified(path: str | os.PathLike, what: str = "calibration store") -> CalibStore:
    """The one way a stage opens a store to read it: the format and attributes are checked, and every
    done block is verified (a damaged chunk is refused by block, layer and array)."""
    if not os.path.exists(path):
        raise OscarError(f"{what} {path} does not exist")
    st = CalibStore(path)
    st.check()
    return st


# --------------------------------------------------------------------------- inspect

def excess_kurtosis(n, s1: np.ndarray, s2: np.ndarray, s3: np.ndarray, s4: np.ndarray,
                    empty: float = 0.0) -> np.ndarray:
    """Per-channel excess kurtosis E[(x-mu)^4] / var^2 - 3 from the stored power sums Σx, Σx², Σx³, Σx⁴
    over n rows (any matching shapes); `empty` where a channel has no variance. The one formula:
    fit's tail diagnostics (oscar.stats.tails) and `summarize` use it."""
    mu = s1 / n
    m2 = s2 / n - mu**2
    m4 = s4 / n - 4 * mu * s3 / n + 6 * mu**2 * s2 / n - 3 * mu**4
    with np.errstate(divide="ignore", invalid="ignore"):
        k = m4 / m2**2 - 3.0
    return np.where(m2 > 1e-300, k, empty)


def summarize(path: str | os.PathLike, *, top: int = 3) -> dict:
    """Schema, progress, token counts and per-layer spectra of a store (JSON-able)."""
    st = CalibStore(path)
    st.check()  # a damaged done block is refused, by block, layer and array
    m = st.meta
    done = st.done()
    full = done.all(1)
    mask = st.group["mask"][:]
    layers = []
    for l in range(st.num_layers):
        blocks = np.flatnonzero(done[:, l])
        rec = {"layer": l, "blocks_done": int(len(blocks))}
        if len(blocks) and m.latent:
            r = {s: reduce(st, s, [l])[l] for s in ("c_gram", "qa_gram", "ol_gram", "count", "q_count", "nonfinite")}
            n, nq = max(int(r["count"]), 1), max(int(r["q_count"]), 1)
            top_of = lambda C: np.linalg.eigvalsh(C)[::-1][:top][None]  # noqa: E731  (1, top), as per-head rows
            rec.update(q_rows=int(r["q_count"]), kv_rows=int(r["count"]), nonfinite=int(r["nonfinite"]),
                       cq_top_eig=top_of(r["qa_gram"] / nq).tolist(), cs_top_eig=top_of(r["ol_gram"] / nq).tolist(),
                       cc_top_eig=top_of(r["c_gram"] / n).tolist(), k_kurtosis_max=None, k_kurtosis_median=None)
        elif len(blocks):
            r = {s: reduce(st, s, [l])[l] for s in ("q_gram", "o_gram", "k_gram", "k_sum", "k_m3", "k_m4",
                                                     "q_count", "kv_count", "nonfinite")}
            nq, nk = int(r["q_count"]), int(r["kv_count"])
            cq = r["q_gram"] / max(nq, 1)
            cs = r["o_gram"] / max(nq, 1)
            eq = np.linalg.eigvalsh(cq)[..., ::-1][..., :top]   # (Hkv, top) descending
            es = np.linalg.eigvalsh(cs)[..., ::-1][..., :top]
            k2 = np.diagonal(r["k_gram"], axis1=-2, axis2=-1)  # Σk² per channel, (Hkv, D)
            ku = 3.0 + excess_kurtosis(np.float64(max(nk, 1)), r["k_sum"], k2, r["k_m3"], r["k_m4"], empty=np.nan)
            rec.update(q_rows=nq, kv_rows=nk, nonfinite=int(r["nonfinite"]),
                       cq_top_eig=eq.tolist(), cs_top_eig=es.tolist(),
                       k_kurtosis_max=float(np.nanmax(ku)) if np.isfinite(ku).any() else None,
                       k_kurtosis_median=float(np.nanmedian(ku)) if np.isfinite(ku).any() else None)
        if len(blocks) and f"layers/{l}/expert_tokens" in st.group:  # MoE layers of a Ray run
            counts = st.group[f"layers/{l}/expert_tokens"][:][blocks].sum(0)  # (E,)
            rec["expert_tokens"] = counts.tolist()
            rec["unused_experts"] = np.flatnonzero(counts == 0).tolist()
        layers.append(rec)
    schema = {"tokens": {"dtype": "int32", "shape": list(st.group["tokens"].shape)},
              "mask": {"dtype": "uint8", "shape": list(mask.shape)},
              "done": {"dtype": "uint8", "shape": list(done.shape)}}
    for name, (dtype, tail) in st.spec.items():
        schema[f"layers/{{l}}/{name}"] = {"dtype": dtype, "shape": [st.num_blocks, *tail]}
    return {
        "path": str(st.path), "format": m.format, "verified": st.checksummed, "model": m.model, "corpus": m.corpus,
        "seq_len": m.seq_len, "sink": m.sink, "num_blocks": m.num_blocks, "seqs_per_block": m.seqs_per_block,
        "reservoir": m.reservoir, "config": m.config,
        "blocks_done": int(full.sum()), "blocks_partial": int((done.any(1) & ~full).sum()),
        "tokens_total": int(mask.sum()), "tokens_done": int(mask[full].sum()),
        "schema": schema, "layers": layers,
    }


def format_summary(s: dict) -> str:
    m = s["model"]
    lines = [
        f"{s['path']}: {s['format']}" + ("" if s.get("verified", True) else " (no checksums: not verified)"),
        f"  model   {m.get('name')} (fingerprint {m.get('fingerprint')}): {m['num_layers']} layers, "
        f"{m['num_q_heads']} q / {m['num_kv_heads']} kv heads, head_dim {m['head_dim']}",
        f"  corpus  {s['corpus'].get('name')} (fingerprint {s['corpus'].get('fingerprint')}), split {s['corpus'].get('split')}",
        f"  blocks  {s['blocks_done']}/{s['num_blocks']} done ({s['blocks_partial']} partially), "
        f"{s['seqs_per_block']} seqs x {s['seq_len']} tokens, sink {s['sink']}, reservoir {s['reservoir']}",
        f"  tokens  {s['tokens_done']:,} of {s['tokens_total']:,} in done blocks",
        "  schema",
    ]
    lines += [f"    {k:<24} {v['dtype']:<8} {tuple(v['shape'])}" for k, v in s["schema"].items()]
    lines.append("  layer  blocks  kv rows   C_Q top eigenvalues (head 0)   C_S top eigenvalues (head 0)   "
                 "k kurtosis max/median  nonfinite")
    for r in s["layers"]:
        if "cq_top_eig" not in r:
            lines.append(f"  {r['layer']:>5}  {r['blocks_done']:>6}  (nothing done)")
            continue
        f = lambda e: " ".join(f"{x:9.3g}" for x in e[0])  # noqa: E731
        km, kmed = r["k_kurtosis_max"], r["k_kurtosis_median"]
        kt = f"{km:8.2f} / {kmed:6.2f}" if km is not None else "       - /      -"
        lines.append(f"  {r['layer']:>5}  {r['blocks_done']:>6}  {r['kv_rows']:>7}   {f(r['cq_top_eig']):<29}  "
                     f"{f(r['cs_top_eig']):<29}  {kt}  {r['nonfinite']:>9}")
    moe = [r for r in s["layers"] if "unused_experts" in r]
    if moe:
        lines.append("  MoE routing (tokens per expert, done blocks)")
    for r in moe:
        n = len(r["unused_experts"])
        lines.append(f"    layer {r['layer']}: {n} of {len(r['expert_tokens'])} experts received no token"
                     + (f": {r['unused_experts']}" if n else ""))
    return "\n".join(lines)
