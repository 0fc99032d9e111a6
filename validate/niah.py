"""`oscar validate niah`: RULER-style tasks under a cache protocol (the CLI: serving by default), resumable per sample.

Strict protocol (docs/validation.md): chunk 1 (template head + instruction +
haystack) is prefilled; the method's cache stores it (sink exact, the rest
INT2 under the strict protocol); chunk 2 (question + answer prefix) attends to
that stored cache; then greedy decoding, each new token attending to the
cache. Chunk 1 attends to itself exactly (as a serving prefill does: the
chunk's own K/V are on chip, only what is *stored* is quantized), so its
exact prefill is computed once per sample and handed to every method's cache;
`tests/test_validate_niah.py` checks that this equals prefilling through the
method's cache. Several samples of a cell decode as one batch of (sample, method)
rows (`decode_batch`, `oscar.scoring.rows`); `greedy` on a `MethodBatchCache`
is the per-sample path it is tested against.

Files in OUT:
- niah_config.json    what the samples depend on (model, artifact, seed, protocol, corpus)
- niah_samples.jsonl  one line per (task, length, index, method), appended and flushed
- results.parquet     suite, task, method, length, samples, score (% string_match_all/part), ci_low, ci_high
                      (95 %), the paired difference to bf16 and its Holm-adjusted test (validate/evidence.py), ...
- memory.json         bytes per token per method
- ruler/<method>/<length>/summary.csv  RULER's summary layout (rows Tasks, Score, Nulls; validate/ruler_outputs.py)
- ruler/<method>/results.json          lm-evaluation-harness's results layout for its `ruler` group

`tasks` may hold "all": every task the inputs allow (qa_1 / qa_2 only with their --squad / --hotpotqa file);
what it leaves out is said on stderr and recorded in niah_config.json ("skipped_tasks") for the report.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace

import pandas as pd
import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from oscar.common import OscarError, file_fingerprint, fingerprint, fit_dim, is_latent
from oscar.defaults import DEFAULT_METHODS
from oscar.defaults import EMBEDDED_MODEL
from oscar.dirlock import DirLock
from oscar.validate.evidence import niah_stats, read_samples
from oscar.kernels.backends import CacheSpec, make_cache
from oscar.validate.ruler_outputs import write_ruler_outputs
from oscar.stats.artifact import check_pairing, load_artifact, load_latent_artifact
from oscar.scoring import engine
from oscar.scoring.dtype import DTYPES, with_dtype
from oscar.scoring.prefill import PrefillPool, batch_capacity, decode_threads, load_aware_threads
from oscar.scoring import rows as scoring_rows
from oscar.scoring.latent import latent_answers
from oscar.validate import env
from oscar.validate.heldout import more_heldout_words
from oscar.validate.methods import (
    NEEDS_ARTIFACT, bits_per_element, choose_methods, memory_row, parse_methods, record_skipped, uncalibrated_warning)
from oscar.scoring.protocols import PROTOCOL_VERSION, PROTOCOLS, SERVING
from oscar.validate.ruler import TASKS, Sources, load_qa, make_sample, resolve_tasks, score_one, skipped_line
from oscar.validate.workers import Workers, default_workers


@dataclass
class NiahConfig:
    out: str
    model: str = EMBEDDED_MODEL
    artifact: str | None = None
    methods: list[str] = field(default_factory=lambda: list(DEFAULT_METHODS))
    tasks: list[str] = field(default_factory=lambda: ["niah_single_1", "niah_single_2"])
    lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096])
    samples: int = 20
    seed: int = 0
    protocol: str = "strict"
    corpus: str = "pydoc"
    dtype: str = "float32"  # model compute dtype (oscar.scoring.dtype.with_dtype)
    # Samples of one (task, length) cell decoded together: max(1, batch_tokens // length) of them, all
    # their methods as rows of one `RowBatchCache` (4 at 1k, 2 at 2k, 1 at 4k: ~1.4 GB of float32 K/V).
    # Results do not depend on it beyond float summation order, so it is not part of the identity.
    batch_tokens: int = 4096
    engine: str = "simulate"  # oscar/scoring/engine.py: simulate (fake-quant simulator) or cache (OscarCache + kernels)
    device: str = "cpu"  # cpu, cuda, cuda:N (execution only: not part of the identity)
    # QA files (qa_1: SQuAD v1.1 / v2.0 JSON, qa_2: HotpotQA JSON); their fingerprints are checked per file in
    # niah_config.json ("qa_files"), so adding one to an OUT keeps the samples it holds
    squad: str | None = None
    hotpotqa: str | None = None
    # `methods` is the command's default list (the user named none): a method this model's head_dim cannot serve
    # is left out, said and recorded, instead of refused (validate/methods.py choose_methods); not an identity
    default_methods: bool = False

    def identity(self) -> dict:
        """What a stored sample depends on besides its row key; a mismatch refuses to mix results."""
        art = file_fingerprint(self.artifact) if self.artifact else None

        ident = {"model": self.model, "artifact": art, "seed": self.seed, "protocol": self.protocol, "corpus": self.corpus,
                 "protocol_version": PROTOCOL_VERSION}
        if self.dtype != "float32":  # float32 outputs written before the option keep their identity
            ident["dtype"] = self.dtype
        if self.engine != "simulate":  # the cache reads one token less exactly (oscar/scoring/engine.py): never mixed
            ident["engine"] = self.engine
        return ident


def check_lengths(lengths: list[int], max_ctx: int, model: str) -> None:
    bad = [L for L in lengths if max_ctx and L > max_ctx]
    if bad:
        raise OscarError(
            f"length(s) {', '.join(map(str, bad))} exceed {model}'s context of {max_ctx} tokens; "
            f"use lengths <= {max_ctx} (for 128k, run the same command with a 128k-capable model: docs/validation.md)"
        )


def check_artifact(artifact: str | None, methods: list[str]) -> None:
    """Refuse an artifact that is missing, or needed and not given."""
    if artifact is None and any(m in NEEDS_ARTIFACT for m in methods):
        raise OscarError(f"method(s) {', '.join(m for m in methods if m in NEEDS_ARTIFACT)} need --artifact")
    if artifact and not os.path.exists(artifact):
        raise OscarError(f"artifact {artifact} does not exist")


def check_stage_dtype(cfg, stages, what: str) -> None:
    """The pipeline stages compute in their own dtype: another one asked for is refused."""
    if stages is not None and cfg.dtype != stages.dtype:
        raise OscarError(f"{what} on the pipeline stages: they compute in their dtype {stages.dtype}; got dtype "
                         f"{cfg.dtype}")


def checked_artifact(cfg, methods: list[str], loaded=None, stages=None, what: str = "needles"):
    """(the model's config, the fitted artifact or None), the artifact refused in one line naming both sides when it
    was fitted for another model (layers, KV heads, head_dim, fingerprint): from the config alone, before any
    method is judged, any weight is loaded or OUT is made."""
    check_stage_dtype(cfg, stages, what)
    check_artifact(cfg.artifact, methods)
    config = (loaded[0].config if loaded else stages.config if stages is not None else env.load_config(cfg.model))
    if is_latent(config):
        check_latent_run(cfg, what, stages)
    fitted = (load_latent_artifact if is_latent(config) else load_artifact)(cfg.artifact) if cfg.artifact else None
    if fitted is not None:
        check_pairing(fitted, config, cfg.artifact, cfg.model)
    return config, fitted


def check_latent_run(cfg, what: str, stages=None) -> None:
    """What an MLA model's latent cache runs: the simulator (one process or the stages), and for needles in one
    process the paged latent cache (`--engine cache`); anything else is refused in one line."""
    if cfg.engine == "simulate":
        return
    if what != "needles" or stages is not None:
        raise OscarError(f"{what} of an MLA model ({cfg.model}){' on the stages' if stages is not None else ''}: "
                         f"--engine {cfg.engine} is built for needles in one process (the paged latent cache); "
                         f"use --engine simulate")


def locked_out(cfg):
    """The exclusive lock of cfg.out (oscar/dirlock.py), held for the command's lifetime."""
    return DirLock(cfg.out, what="output directory")


def model_or_stages(cfg, methods: list[str], lengths: list[int], loaded, dev, stages, what: str):
    """(model in cfg.dtype on `dev`, tokenizer, config), everything refusable refused before the weights load; or
    (None, tokenizer, config) when `stages` (cluster/scoring.py) hold the model: they run either engine in their own
    dtype, and lengths past the model's context are refused from its config."""
    if stages is None:
        model, tok = load_checked(cfg.model, cfg.artifact, methods, lengths, cfg.dtype, loaded)
        return engine.to_device(model, dev), tok, model.config
    check_stage_dtype(cfg, stages, what)
    check_lengths(lengths, env.max_context(SimpleNamespace(config=stages.config)), cfg.model)
    check_artifact(cfg.artifact, methods)
    return None, stages.tokenizer, stages.config


def load_checked(name: str, artifact: str | None, methods: list[str], lengths: list[int], dtype: str, loaded=None):
    """Refuse what cannot run (artifact missing or needed, lengths past the model's context,
    unknown dtype) before loading weights where possible; return (model in `dtype`, tokenizer)."""
    check_artifact(artifact, methods)
    if loaded is None:  # refuse impossible lengths before loading weights
        check_lengths(lengths, env.config_max_context(name) or 0, name)
    if dtype not in DTYPES:
        raise OscarError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
    model, tok, _ = loaded or env.load_model(name, latent=is_latent(env.load_config(name)))
    model = with_dtype(model, dtype)
    check_lengths(lengths, env.max_context(model), name)
    return model, tok


def _prepare_out(cfg: NiahConfig, qa: dict | None = None, skipped: dict | None = None) -> None:
    """Refuse an OUT made for other inputs; record the config, the QA files' fingerprints (qa: dataset ->
    QaData; one given before must be the same file) and the tasks `--tasks all` skipped."""
    os.makedirs(cfg.out, exist_ok=True)
    p = os.path.join(cfg.out, "niah_config.json")
    ident = cfg.identity()
    files = {k: {"path": d.path, "fingerprint": d.fingerprint} for k, d in (qa or {}).items()}
    old_files: dict = {}
    if os.path.exists(p):
        old = json.load(open(p))
        if old.get("identity") != ident:
            raise OscarError(
                f"{cfg.out} holds NIAH samples for {old.get('identity')}, not {ident}; "
                "use another --out (or delete niah_samples.jsonl to start over)"
            )
        old_files = old.get("qa_files") or {}
        for k, f in files.items():
            if k in old_files and old_files[k]["fingerprint"] != f["fingerprint"]:
                raise OscarError(f"{cfg.out} holds {k} samples from {old_files[k]['path']} (fingerprint "
                                 f"{old_files[k]['fingerprint']}), not from {f['path']} ({f['fingerprint']}); "
                                 "use another --out")
    rec = {"identity": ident, "config": asdict(cfg), "fingerprint": fingerprint(ident)}
    if files or old_files:
        rec["qa_files"] = {**old_files, **files}
    if skipped:
        rec["skipped_tasks"] = skipped
    with open(p, "w") as f:
        json.dump(rec, f, indent=1)


@torch.no_grad()
def greedy(model, cache, question_ids: list[int], max_new_tokens: int, eos: set[int], rows: int = 1,
           threads: int | None = None) -> list[list[int]]:
    """Chunk 2 attends to the stored cache, then greedy decoding (each token attends to the cache).

    The per-sample path (one sample's methods in a `MethodBatchCache`); `run_niah` decodes with
    `decode_batch`, which tests and bench/main_job_speed.py compare with this.
    rows: batch rows of `cache` (one per method, `MethodBatchCache`); each row stops at its own EOS
    and the batch at the last one. A stopped row keeps decoding its own continuation (rows are
    independent) but nothing more is recorded for it. threads: intra-op threads (default
    `decode_threads()`).
    """
    nthreads, impl = torch.get_num_threads(), model.config._attn_implementation
    torch.set_num_threads(threads or decode_threads())
    if impl == "sdpa":
        _register_gqa()
        model.set_attn_implementation("oscar_gqa")
    try:
        return _greedy_loop(model, cache, torch.tensor([question_ids] * rows), max_new_tokens, eos)
    finally:
        torch.set_num_threads(nthreads)
        if impl == "sdpa":
            model.set_attn_implementation(impl)


def gqa_attention(module, query, key, value, attention_mask=None, dropout=0.0, scaling=None, **kwargs):
    """SDPA reading the KV heads in place (GQA) also under a mask.

    transformers' SDPA path copies K/V to every query head (repeat_kv) whenever there is a mask, i.e.
    for the question chunk: (R, Hq, T, D) per layer. Same attention, no copy.
    """
    Tq, Tk = query.shape[2], key.shape[2]
    if attention_mask is None and Tq > 1:  # causal, aligned to the end of the keys
        attention_mask = torch.ones(Tq, Tk, dtype=torch.bool, device=query.device).tril(Tk - Tq)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                         enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


def _register_gqa() -> None:
    AttentionInterface.register("oscar_gqa", gqa_attention)
    AttentionMaskInterface.register("oscar_gqa", sdpa_mask)


def _greedy_loop(model, cache, ids, max_new_tokens: int, eos: set[int]) -> list[list[int]]:
    rows = ids.shape[0]
    out: list[list[int]] = [[] for _ in range(rows)]
    alive = [True] * rows
    for _ in range(max_new_tokens):
        logits = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]  # (R, V)
        nxt = logits.argmax(-1)  # (R,)
        for r, t in enumerate(nxt.tolist()):
            if alive[r]:
                if t in eos:
                    alive[r] = False
                else:
                    out[r].append(t)
        if not any(alive):
            break
        ids = nxt[:, None]
    return out


def decode_batch(model, samples, groups, protocol, pool: "PrefillPool", eos: set[int]) -> list[list[int]]:
    """Greedy answers of every (sample, method) row: samples[g]'s chunk 1 prefilled exactly once (through
    `pool`) and handed to the caches of its methods `groups[g]` (artifacts, None: exact), then all rows
    decoded as one `RowBatchCache`. Rows come sample by sample, methods in the order given. An MLA model's rows
    run one at a time through its latent cache (oscar/scoring/latent.py), each with its own prefill."""
    if is_latent(model.config):
        return latent_answers(model, samples, groups, protocol, eos)
    cache = make_cache(CacheSpec.rows(groups, protocol, capacity=batch_capacity(samples), dtype=next(model.parameters()).dtype,
                                      num_layers=model.config.get_text_config().num_hidden_layers), "rows")
    for g, s in enumerate(samples):  # chunk 1, exact, shared by every method of the sample
        cache.load(g, pool.prefill(s.context_ids))
    with load_aware_threads():
        return scoring_rows.decode_rows(model, cache, [s.question_ids for s, ms in zip(samples, groups) for _ in ms],
                                    [s.max_new_tokens for s, ms in zip(samples, groups) for _ in ms], eos)


def _batches(cells, methods, done, batch_tokens: int):
    """Consecutive samples of one (task, length) with methods still to score, up to
    max(1, batch_tokens // length) per batch: [(task, length, index, missing methods), ...]."""
    batch: list = []
    for t, L, i in cells:
        missing = [m for m in methods if (t, L, i, m) not in done]
        if not missing:
            continue
        if batch and ((batch[0][0], batch[0][1]) != (t, L) or len(batch) >= max(1, batch_tokens // L)):
            yield batch
            batch = []
        batch.append((t, L, i, missing))
    if batch:
        yield batch


class _Inline:
    """`Workers`' stand-in when everything runs in this process."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def eos_ids(model, tok) -> set[int]:
    e = model.generation_config.eos_token_id if model.generation_config is not None else None
    ids = set(e if isinstance(e, (list, tuple)) else [e] if e is not None else [])
    if tok.eos_token_id is not None:
        ids.add(tok.eos_token_id)
    return ids


def _niah_init(model, arg) -> dict:
    """A worker's state (validate/workers.py): the model, the methods' artifacts, its own prefill pool."""
    arts, protocol, eos = arg
    return {"model": model, "arts": arts, "protocol": PROTOCOLS[protocol], "eos": eos, "pool": PrefillPool(model)}


def _timed(decode, samples) -> tuple[list[list[int]], dict]:
    """`decode()`'s generations and what they cost in the process that ran it (prefill + decode of all the
    batch's rows): the per-sample figure long-context reports quote (reports/build.py, Compute). Not part of a
    sample's identity."""
    c0, w0 = time.process_time(), time.perf_counter()
    gens = decode()
    return gens, {"batch_samples": len(samples), "batch_cpu_s": round(time.process_time() - c0, 2),
                  "batch_wall_s": round(time.perf_counter() - w0, 2)}


def _decode_timed(model, samples, groups, protocol, pool, eos) -> tuple[list[list[int]], dict]:
    """`decode_batch` (the simulator), timed."""
    return _timed(lambda: decode_batch(model, samples, groups, protocol, pool, eos), samples)


def _niah_unit(st: dict, arg) -> tuple[list[list[int]], dict]:
    """One batch in a worker: what `_decode_timed` returns in this process."""
    samples, missing = arg
    with torch.no_grad():
        return _decode_timed(st["model"], samples, [[st["arts"][m] for m in ms] for ms in missing], st["protocol"],
                             st["pool"], st["eos"])


def run_niah(cfg: NiahConfig, loaded=None, progress: bool = True, workers: int | None = None, stages=None):
    """Score every (task, length, sample, method) not yet in OUT; returns the results table.

    workers: processes decoding batches in parallel (validate/workers.py; default: one per CPU this process
    may use, up to 4, or $OSCAR_WORKERS; 1: in this process). Batches go round-robin, each worker with its
    own prefill pool; a worker runs one intra-op thread.
    stages: where the batches are decoded instead of a model in this process: an object with `config`,
    `generation_config`, `tokenizer`, `dtype`, `load(arts)` and `needle_batch(samples, names, protocol, eos, engine=)`
    -> what `_decode_timed` (engine "simulate") or the timed `engine.niah_answers` ("cache") returns (the pipeline
    stages of cluster/scoring.py); this process then holds no weights."""
    engine.check_engine(cfg.engine)
    env.refuse_chat_corpus(cfg.corpus)  # before any weights load
    # before loading weights: no silent CPU run (the pipeline stages check their own devices)
    dev = engine.resolve_device(cfg.device) if stages is None else torch.device("cpu")
    methods = parse_methods(cfg.methods)
    qa = load_qa(cfg.squad, cfg.hotpotqa)  # a malformed file is refused before any weight is loaded
    tasks, skipped = resolve_tasks(cfg.tasks, qa)
    if skipped:
        print(skipped_line(skipped), file=sys.stderr)
    if cfg.protocol not in PROTOCOLS:
        raise OscarError(f"unknown protocol {cfg.protocol!r}; known: {', '.join(PROTOCOLS)}")
    if cfg.samples < 1:
        raise OscarError("--samples must be >= 1")
    if cfg.batch_tokens < 1:
        raise OscarError(f"batch_tokens must be >= 1, got {cfg.batch_tokens}")
    lock = locked_out(cfg)
    lock.check_free()  # another writer of OUT: refused before anything loads
    config, fitted = checked_artifact(cfg, methods, loaded, stages)
    arts, dropped = choose_methods(methods, config, fitted, default=cfg.default_methods, model=cfg.model)
    if cfg.engine == "cache" and not is_latent(config):  # refuse what the cache format cannot hold before anything runs
        engine.check_methods({m: arts[m] for m in methods if m not in dropped}, [PROTOCOLS[cfg.protocol]])
    with lock:
        return _run_niah(cfg, loaded, progress, workers, stages, dev, methods, qa, tasks, skipped, fitted, arts, dropped)


def _run_niah(cfg, loaded, progress, workers, stages, dev, methods, qa, tasks, skipped, fitted, arts, dropped):
    """run_niah once OUT is locked and every refusal is behind: load, score, write."""
    model, tok, config = model_or_stages(cfg, methods, cfg.lengths, loaded, dev, stages, "needles")
    _prepare_out(cfg, {k: qa[k] for k in sorted(qa) if any(TASKS[t].dataset == k for t in tasks)}, skipped)
    if (warn := uncalibrated_warning(fitted, max(cfg.lengths))):
        print(f"oscar: WARNING: {warn}", file=sys.stderr)
    if dropped:
        record_skipped(cfg.out, dropped)
    methods = [m for m in methods if m not in dropped]
    protocol = PROTOCOLS[cfg.protocol]
    src = Sources.from_text(env.heldout_text(cfg.corpus), more=more_heldout_words(cfg.corpus))
    src.qa = qa
    eos = eos_ids(stages or model, tok)  # what reads the model's generation config

    path = os.path.join(cfg.out, "niah_samples.jsonl")
    done = read_samples(path)  # a line cut by a kill: that sample is redone
    cells = [(t, L, i) for t in tasks for L in cfg.lengths for i in range(cfg.samples)]
    todo = sum(1 for (t, L, i) in cells for m in methods if (t, L, i, m) not in done)
    if stages is not None and todo:  # the stage actors start (a cluster that cannot hold them is refused) here
        stages.load({m: arts[m] for m in methods})
    bar = tqdm(total=todo, desc="niah", unit="run", disable=not progress, dynamic_ncols=True)

    batches = list(_batches(cells, methods, done, cfg.batch_tokens))
    n = workers or default_workers(len(batches))
    if stages is not None or next(model.parameters()).device.type != "cpu" or cfg.engine == "cache":
        n = 1  # worker processes share a CPU host's cores; an accelerator runs one stream; the cache engine inline
    with open(path, "a") as f, (Workers(n, model, _niah_init, (arts, cfg.protocol, eos)) if n > 1 else _Inline()) as W:
        units = [[make_sample(t, L, i, tok, src, seed=cfg.seed) for t, L, i, _ in batch] for batch in batches]
        if stages is not None:  # each batch's prefill and decode flow through the stage actors, by either engine
            results = ((k, stages.needle_batch(s, [b[3] for b in batch], cfg.protocol, eos, engine=cfg.engine))
                       for k, (s, batch) in enumerate(zip(units, batches)))
        elif n > 1:
            results = W.map(_niah_unit, [(s, [b[3] for b in batch]) for s, batch in zip(units, batches)], static=True)
        elif cfg.engine == "cache" and is_latent(model.config):  # the paged latent cache, its decode kernel
            results = ((k, _timed(lambda s=s, batch=batch: latent_answers(
                               model, s, [[arts[m] for m in b[3]] for b in batch], protocol, eos, paged=True), s))
                       for k, (s, batch) in enumerate(zip(units, batches)))
        elif cfg.engine == "cache":  # the product path, one (sample, method) at a time (oscar/scoring/engine.py)
            results = ((k, _timed(lambda s=s, batch=batch: engine.niah_answers(
                               model, s, [[arts[m] for m in b[3]] for b in batch], [b[3] for b in batch], protocol, eos), s))
                       for k, (s, batch) in enumerate(zip(units, batches)))
        else:
            pool = PrefillPool(model)
            results = ((k, _decode_timed(model, s, [[arts[m] for m in b[3]] for b in batch], protocol, pool, eos))
                       for k, (s, batch) in enumerate(zip(units, batches)))
        for k, (gens, cost) in results:
            batch, samples = batches[k], units[k]
            t, L = batch[0][0], batch[0][1]
            bar.set_postfix_str(f"{t} {L} #{batch[0][2]}" + (f"-{batch[-1][2]}" if len(batch) > 1 else ""))
            r = 0
            for s, (_, _, i, missing) in zip(samples, batch):
                for m in missing:
                    pred = tok.decode(gens[r], skip_special_tokens=True)
                    r += 1
                    row = {"task": t, "length": L, "index": i, "method": m, "score": score_one(pred, s.answers, s.metric),
                           "pred": pred, "answers": s.answers, "metric": s.metric, "prompt_tokens": s.prompt_tokens,
                           "protocol": cfg.protocol, **cost}
                    f.write(json.dumps(row) + "\n")
                    done[(t, L, i, m)] = row
                f.flush()
                os.fsync(f.fileno())
                bar.update(len(missing))
    bar.close()
    write_memory(cfg.out, methods, arts, config, max(cfg.lengths), protocol)
    return write_results(cfg, methods, done, arts, config)


def write_memory(out: str, methods, arts, config, context: int, protocol) -> None:
    ctxs = sorted({context, 32768, 131072})
    rows = [memory_row(m, arts[m], config, c, p) for m in methods for p in dict.fromkeys([protocol, SERVING]) for c in ctxs]
    path = os.path.join(out, "memory.json")
    old = json.load(open(path)) if os.path.exists(path) else []
    keep = [r for r in old if (r["method"], r["protocol"], r["context"]) not in {(x["method"], x["protocol"], x["context"]) for x in rows}]
    with open(path, "w") as f:
        json.dump(keep + rows, f, indent=1)


def write_results(cfg: NiahConfig, methods, done: dict, arts, config):
    """Aggregate the per-sample lines of the requested cells into DIR/results.parquet."""
    D = fit_dim(config)  # what a method's bits per element are counted over

    rows = []
    for st in niah_stats(done):  # every sample in OUT (one identity per OUT, see _prepare_out)
        m = st["method"]
        art = arts[m] if m in arts else None
        rows.append({"suite": "ruler", "task": st["task"], "method": m, "length": st["length"], "samples": st["samples"],
                     "score": st["score"], "protocol": cfg.protocol, "model": cfg.model,
                     "bits_per_element": bits_per_element(art, D) if m in arts else float("nan"),
                     **{k: v for k, v in st.items() if k not in ("task", "method", "length", "samples", "score")}})
    df = pd.DataFrame(rows)
    df.to_parquet(os.path.join(cfg.out, "results.parquet"), index=False)

    write_ruler_outputs(cfg.out, done, {"model": cfg.model, "protocol": cfg.protocol, "seed": cfg.seed,
                                        "dtype": cfg.dtype, "engine": cfg.engine, "corpus": cfg.corpus},
                        lengths=cfg.lengths)
    return df
