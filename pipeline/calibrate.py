"""`oscar calibrate`: stream the calibration corpus through the model into the block store.

One process, whole model. The Ray job (`oscar.cluster`) reuses `Capture`, `CalibStore` and
`WriterLock` with one stage per layer range instead of `run_blocks`.
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from oscar.common import OscarError, keep_freed_memory, set_threads
from oscar.constraints import check_model
from oscar.defaults import EMBEDDED_MODEL, SINK
from oscar.dirlock import DirLock
from oscar.pipeline import capture as C
from oscar.pipeline.corpus import CorpusTooSmall, load_corpus, make_blocks
from oscar.pipeline.models import checkpoint_quantization, load_config, load_info, load_model, load_tokenizer
from oscar.pipeline.latent import LatentSpec
from oscar.pipeline.store import FORMAT, FORMAT_LATENT, CalibStore, StoreMeta, WriterLock, reduce

DTYPES = ("float32", "bfloat16", "float16", "float64")


@dataclass
class CalibConfig:
    model: str = EMBEDDED_MODEL
    corpus: str = "pydoc"
    store: str = "runs/calib.zarr"
    seq_len: int = 4096                 # the same default as `oscar plan`, `cluster render` and `run`
    positions: int | None = None        # absolute positions the windows cover (None: seq_len); see window_offsets
    sink: int = SINK                    # first positions of every sequence excluded (kept BF16 at serve time)
    blocks: int | None = None           # number of blocks, or
    block_tokens: int | None = None     # tokens per block, or
    seqs_per_block: int | None = None   # sequences per block (default: block_tokens = 16384)
    tokens: int | None = None           # cap on calibration tokens
    batch_size: int = 1                 # sequences per forward
    reservoir: int = 256                # reservoir rows per block, layer, KV head and x in q/k/v/o
    seed: int = 0
    attn_implementation: str = "sdpa"
    dtype: str = "float32"
    device: str = "cpu"
    threads: int | None = None
    overwrite: bool = False
    blocking: dict = field(init=False)  # the one make_blocks sizing argument in use

    def __post_init__(self):
        if self.seq_len <= 0:
            raise OscarError(f"--seq-len must be positive (got {self.seq_len})")
        if self.sink < 0:
            raise OscarError(f"--sink must be >= 0 (got {self.sink})")
        if self.positions is not None and self.positions < self.seq_len:
            raise OscarError(f"--positions {self.positions} must be at least --seq-len {self.seq_len}: the windows "
                             f"are placed inside [0, positions)")
        if self.seq_len <= self.sink:
            raise OscarError(f"--seq-len {self.seq_len} must be larger than --sink {self.sink}: "
                             f"every position would be excluded from the statistics")
        given = {k: v for k, v in (("num_blocks", self.blocks), ("block_tokens", self.block_tokens),
                                   ("seqs_per_block", self.seqs_per_block)) if v is not None}
        if len(given) > 1:
            raise OscarError("give at most one of --blocks, --block-tokens, --seqs-per-block")
        for k, v in given.items():
            if v <= 0:
                raise OscarError(f"{k} must be positive (got {v})")
        if "block_tokens" in given and self.block_tokens < self.seq_len:
            raise OscarError(f"--block-tokens {self.block_tokens} is smaller than one sequence (--seq-len {self.seq_len})")
        self.blocking = given or {"block_tokens": max(16384, self.seq_len)}
        if self.tokens is not None and self.tokens <= 0:
            raise OscarError(f"--tokens must be positive (got {self.tokens})")
        if self.batch_size <= 0 or self.reservoir < 0:
            raise OscarError("--batch-size must be positive and --reservoir >= 0")
        if self.dtype not in DTYPES:
            raise OscarError(f"--dtype must be one of {', '.join(DTYPES)} (got {self.dtype!r})")

    def job_config(self) -> dict:
        """What defines the statistics; a store resumes only under the same job config.

        Not included: where the store is, the device and thread count (a run may resume elsewhere),
        --overwrite.
        """
        d = asdict(self)
        for k in ("store", "device", "threads", "overwrite", "blocking"):
            d.pop(k)
        if d["positions"] in (None, self.seq_len):  # the same statistics as before the option existed: resumable
            d.pop("positions")
        return d


@dataclass
class CalibResult:
    store: str
    blocks_total: int
    blocks_run: int
    blocks_skipped: int
    blocks_redone: list[int]        # half-written blocks found and redone
    tokens_run: int                 # real tokens forwarded in this run
    wall_s: float
    forward_s: float                # model forward incl. capture (wall, device-synchronised)
    write_s: float                  # store writes the run waited for (the writer thread overlaps the next block)
    write_busy_s: float             # time the writer thread spent writing (overlapped or not)
    stats_s: float                  # part of forward_s spent in the statistics (CPU: not device-synchronised)
    nonfinite: dict[int, int]       # layer -> rows excluded for NaN/Inf (whole store)
    blocks_damaged: list[int] = field(default_factory=list)  # done blocks that failed verification, redone

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_run / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s}


def window_offsets(positions: int | None, seq_len: int, n: int) -> np.ndarray:
    """The absolute start position of each of `n` calibration windows (global sequence order).

    RoPE attention depends only on relative positions, so a window read at position_ids s..s+seq_len-1
    computes exactly what it computes at 0..seq_len-1, but its post-RoPE q/k are the ones a serving
    sequence holds at s..s+seq_len-1: the rotation, scales and clips then see the angles of long contexts
    for the attention cost of short windows. Windows cycle over the slots 0, L, 2L, ... of a
    `positions`-long sequence (the last slot ends at `positions`), so every position in [0, positions)
    is covered as evenly as one sequence of that length covers it.
    """
    if positions is None or positions <= seq_len:
        return np.zeros(n, dtype=np.int64)
    slots = -(-positions // seq_len)
    starts = np.minimum(np.arange(slots, dtype=np.int64) * seq_len, positions - seq_len)  # (slots,)
    return starts[np.arange(n) % slots]                                                      # (n,)


def store_offsets(meta) -> np.ndarray:
    """`window_offsets` of every window of a store (its StoreMeta), as (num_blocks, seqs_per_block)."""
    B, S = meta.num_blocks, meta.seqs_per_block
    return window_offsets(meta.config.get("positions"), meta.seq_len, B * S).reshape(B, S)


def _sync(device) -> None:
    if getattr(device, "type", str(device)) == "cuda":
        torch.cuda.synchronize(device)


def run_blocks(model, store, *, batch_size: int = 1, layers=None, progress: bool = True,
               job_note: str = "") -> CalibResult:
    """Capture every block of `store` not yet done (for `layers`, default all) and write it.

    The caller holds the WriterLock for `layers`. Tokens, mask, sink, reservoir size and seed
    all come from the store, so a resumed run cannot drift from the one that created it.
    """
    meta = store.meta
    m = meta.model
    layers = tuple(range(m["num_layers"])) if layers is None else tuple(layers)
    seed = int(meta.config.get("seed", 0))
    kw = dict(layers=layers, sink=meta.sink, reservoir=meta.reservoir, seed=seed, seqs_per_block=meta.seqs_per_block)
    spec = LatentSpec.of(m["latent"], **kw) if meta.latent else C.CaptureSpec(m["num_q_heads"], m["num_kv_heads"],
                                                                               m["head_dim"], **kw)
    impl = model.config._attn_implementation
    C.install(model, impl)
    model.eval()
    base = C.base_model(model)
    device = next(model.parameters()).device

    damaged = sorted({d.block for d in store.repair(layers)})  # damaged done blocks: un-marked, redone below
    done0 = store.done()                     # (B, L); we hold the locks of `layers`: nobody else writes them
    todo = [b for b in range(meta.num_blocks) if not done0[b, list(layers)].all()]
    redone = [b for b in todo if b not in damaged and any(store.partial(b, l) for l in layers if not done0[b, l])]
    for b in redone:
        print(f"oscar calibrate: block {b} was half-written by an interrupted run (chunks without done "
              f"marker); redoing it", file=sys.stderr)
    tokens_arr, mask_arr = store.array("tokens"), store.array("mask")
    total_tokens = int(mask_arr[:].sum())
    per_block = mask_arr[:].reshape(meta.num_blocks, -1).sum(1)
    done_tokens = int(per_block.sum() - per_block[todo].sum())

    T, offsets = meta.seq_len, store_offsets(meta)
    cap = C.Capture(spec, stop_after=max(layers))
    t_start = time.perf_counter()
    fwd_s = write_s = 0.0
    busy = [0.0]
    run_tokens = 0
    bar = _Progress(progress, meta.num_blocks, total_tokens, meta.num_blocks - len(todo), done_tokens, job_note)
    # One writer thread, at most one block in flight: block b's chunks are written while block
    # b+1 is computed (file writes release the GIL), and memory stays bounded.
    writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="oscar-store-writer")
    pending = None

    def write(b: int, arrays: dict) -> None:
        t = time.perf_counter()
        store.write_block(b, {l: arrays[l] for l in layers if not done0[b, l]})  # never rewrite a done chunk
        busy[0] += time.perf_counter() - t

    def wait() -> float:
        nonlocal pending
        t = time.perf_counter()
        if pending is not None:
            f, pending = pending, None
            f.result()  # re-raises a failed write
        return time.perf_counter() - t

    try:
        with bar, torch.no_grad():
            for b in todo:
                toks = torch.from_numpy(np.asarray(tokens_arr[b], dtype=np.int64))   # (S, T)
                mask = torch.from_numpy(np.asarray(mask_arr[b], dtype=np.int64))     # (S, T)
                t0 = time.perf_counter()
                cap.start_block(b)
                n_seq = int(mask.any(1).nonzero().max()) + 1 if mask.any() else 1  # trailing all-padding rows: skip
                for s0 in range(0, n_seq, batch_size):
                    s1 = min(s0 + batch_size, n_seq)
                    ids, mb = toks[s0:s1].to(device), mask[s0:s1].to(device)
                    pos = torch.from_numpy(offsets[b, s0:s1, None] + np.arange(T)).to(device)  # (s, T)
                    try:
                        with cap.batch(mb, seq_offset=s0):
                            base(input_ids=ids, attention_mask=mb, position_ids=pos, use_cache=False)
                    except C.StopForward:  # the last captured layer is done: its MLP and later layers are not needed
                        pass
                arrays = cap.finish_block()
                _sync(device)
                fwd_s += time.perf_counter() - t0
                write_s += wait()
                pending = writer.submit(write, b, arrays)
                n = int(mask.sum())
                run_tokens += n
                bar.advance(n)
            write_s += wait()
    finally:
        # An interrupted run still commits the block already handed to the writer; nothing else.
        try:
            if pending is not None:
                pending.result()
        finally:
            writer.shutdown(wait=True)
            model.set_attn_implementation(impl[len(C.PREFIX):] if impl.startswith(C.PREFIX) else impl)
    wall = time.perf_counter() - t_start
    nonfinite = {l: int(v) for l, v in reduce(store, "nonfinite", layers).items()}
    bad = {l: n for l, n in nonfinite.items() if n}
    if bad:
        print("oscar calibrate: rows with NaN/Inf activations were excluded from the statistics: "
              + ", ".join(f"layer {l}: {n}" for l, n in bad.items()), file=sys.stderr)
    return CalibResult(store=str(store.path), blocks_total=meta.num_blocks, blocks_run=len(todo),
                       blocks_skipped=meta.num_blocks - len(todo), blocks_redone=redone, tokens_run=run_tokens,
                       wall_s=wall, forward_s=fwd_s, write_s=write_s, write_busy_s=busy[0], stats_s=cap.stats_s,
                       nonfinite=nonfinite, blocks_damaged=damaged)


class _Progress:
    """A rich progress bar over blocks and tokens (or nothing)."""

    def __init__(self, enabled, blocks, tokens, blocks_done, tokens_done, note=""):
        self.enabled = enabled
        if not enabled:
            return

        self.p = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                          TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                          transient=False)
        self.tb = self.p.add_task(f"calibrate{note} blocks", total=blocks, completed=blocks_done, rate="")
        self.tt = self.p.add_task(f"calibrate{note} tokens", total=tokens, completed=tokens_done, rate="")
        self.t0, self.n = time.perf_counter(), 0

    def __enter__(self):
        if self.enabled:
            self.p.__enter__()
        return self

    def __exit__(self, *exc):
        if self.enabled:
            self.p.__exit__(*exc)

    def advance(self, tokens: int) -> None:
        if not self.enabled:
            return
        self.n += tokens
        rate = f"{self.n / max(time.perf_counter() - self.t0, 1e-9):,.0f} tok/s"
        self.p.update(self.tb, advance=1, rate="")
        self.p.update(self.tt, advance=tokens, rate=rate)


def _torch_dtype(name: str):
    return getattr(torch, name)


def check_calibration(cfg: CalibConfig, info=None, tokenizer=None, latent: bool = True):
    """Everything a calibration refuses before it writes anything or loads weights (a model no stage can serve,
    positions past the model's, a budget the corpus cannot supply): (ModelInfo, tokenizer, corpus, BlockPlan).
    `latent`: an MLA model is calibrated into a latent store (False: refused, for a caller whose later steps are
    per-head only)."""
    info = info or load_info(cfg.model)
    check_servable(info, latent)
    if cfg.positions and info.max_position_embeddings and cfg.positions > info.max_position_embeddings:
        raise OscarError(f"--positions {cfg.positions} is past model {info.name!r}'s max_position_embeddings "
                         f"({info.max_position_embeddings}): it was never trained, and is not served, there")
    tokenizer = tokenizer or load_tokenizer(info.source)
    return (info, tokenizer, *corpus_blocks(cfg, tokenizer))


def prepare_store(cfg: CalibConfig, info=None, tokenizer=None):
    """Create (or validate for resume) the store of `cfg` without loading weights.

    Shared by the single-process path and the Ray driver (which must not hold the
    model). Returns (store metadata, ModelInfo); the store's lock is released.
    """
    info, tokenizer, corpus, plan = check_calibration(cfg, info, tokenizer)
    tokens, mask = np.asarray(plan.tokens, dtype=np.int32), np.asarray(plan.mask, dtype=np.uint8)
    if tokens.size == 0 or int(mask.sum()) == 0:
        raise OscarError(f"corpus {cfg.corpus!r} produced no tokens to calibrate on")
    B, S, T = tokens.shape
    info_d = info.to_dict()
    keys = ("name", "fingerprint", "num_layers", "num_q_heads", "num_kv_heads", "head_dim", "model_type", "source",
            "config_fingerprint", "weights_fingerprint", "weights_layers") + (("latent",) if info.latent else ())
    meta = StoreMeta(
        model={k: info_d.get(k) for k in keys}, corpus=corpus.to_dict(),
        seq_len=T, sink=cfg.sink, num_blocks=B, seqs_per_block=S, reservoir=cfg.reservoir, config=cfg.job_config(),
        format=FORMAT_LATENT if info.latent else FORMAT)
    Path(cfg.store).parent.mkdir(parents=True, exist_ok=True)
    with WriterLock(cfg.store, range(info.num_layers)):
        CalibStore.open_or_create(cfg.store, meta, tokens, mask, overwrite=cfg.overwrite)
    return meta, info


def _supply(tokens: int, seqs: int, seq_len: int, seqs_per_block: int) -> str:
    """What a calibration split gives, in the units a budget is asked in."""
    blocks = -(-seqs // seqs_per_block)
    return (f"{tokens:,} tokens = {seqs} sequence(s) of {seq_len} = {blocks} block(s) of {seqs_per_block} "
            f"sequence(s)")


def corpus_blocks(cfg: CalibConfig, tokenizer):
    """(corpus, BlockPlan) of `cfg`, or a one-line refusal when the budget asks for more than the
    calibration split gives: --blocks beyond its sequences, --tokens beyond its tokens, --seq-len beyond
    the whole split. Runs before any model weights are loaded or any store is created."""
    corpus = load_corpus(cfg.corpus, tokenizer=tokenizer)
    if not corpus.calibration or not any(t.strip() for t in corpus.calibration):
        raise OscarError(f"corpus {cfg.corpus!r} has no calibration text (empty corpus)")
    where = f"corpus {cfg.corpus!r}" + (f" under --tokens {cfg.tokens:,}" if cfg.tokens else "") + " gives"
    more = "pass a larger calibration text with --corpus FILE"
    try:
        plan = make_blocks(tokenizer, corpus.calibration, seq_len=cfg.seq_len, max_tokens=cfg.tokens, **cfg.blocking)
    except CorpusTooSmall as e:
        if not e.seqs:
            raise OscarError(f"{where} {e.tokens:,} tokens, less than one sequence of --seq-len {cfg.seq_len}; "
                             f"{more}, or a smaller --seq-len") from None
        raise OscarError(f"--blocks {cfg.blocks} asks for more than the calibration split gives: {where} "
                         f"{_supply(e.tokens, e.seqs, e.seq_len, 1)}; {more}, or at most --blocks {e.seqs}") from None
    if cfg.tokens and cfg.tokens > plan.supply_tokens:
        # Refused rather than quietly capped: the budget a job was sized for (`oscar plan`, `cluster render`)
        # must be the one it calibrates on.
        raise OscarError(f"--tokens {cfg.tokens:,} asks for more than the calibration split gives: corpus "
                         f"{cfg.corpus!r} gives {_supply(plan.supply_tokens, plan.num_seqs, cfg.seq_len, plan.seqs_per_block)}; "
                         f"{more}, or at most --tokens {plan.supply_tokens}")
    return corpus, plan


def check_servable(info, latent: bool = True) -> None:
    """Refuse up front a model no later stage can serve (sliding-window layers, a head_dim INT2 cannot pack, a latent
    the latent format cannot group) or no loader reads (a quantized checkpoint other than block FP8): before
    weights, in the Ray driver too."""
    config = load_config(info.source)
    check_model(config, None if info.latent else info.head_dim, what=f"model {info.name!r}", latent=latent)
    checkpoint_quantization(config, os.path.join(info.source, "config.json"))


def calibrate(cfg: CalibConfig, progress: bool = True) -> CalibResult:
    """Calibrate `cfg.model` on `cfg.corpus` into `cfg.store`, resuming a matching store."""
    set_threads(cfg.threads)
    keep_freed_memory()  # the forward's activations stay allocated between layers (no page faults per layer)
    lock = DirLock(cfg.store, store=True)
    lock.check_free()  # a second writer of the store: refused before any work
    with lock:  # one writer for the whole calibration (the per-layer WriterLock below is the stages' share of it)
        # The store first (the corpus tokenized, the budget checked, nothing loaded): a job the corpus cannot
        # supply is refused before the weights are read.
        _, info = prepare_store(cfg, info=load_info(cfg.model))
        model, _, info = load_model(cfg.model, attn_implementation=cfg.attn_implementation,
                                    dtype=_torch_dtype(cfg.dtype), device=cfg.device, latent=True)
        with WriterLock(cfg.store, range(info.num_layers)):
            store = CalibStore(cfg.store, "r+")
            return run_blocks(model, store, batch_size=cfg.batch_size, progress=progress)
