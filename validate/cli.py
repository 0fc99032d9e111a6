"""`oscar validate niah|ppl|attention` (the main job `oscar run` is oscar/cli.py; the recipe's tune and widths are
steps of `oscar fit`, oscar/recipe/driver.py: they write an artifact, which validate/ does not)."""

from __future__ import annotations

import argparse

from oscar.cli_options import (
    DEFAULT_ENGINE, ENGINE_HELP, ENGINES, METHODS_HELP, METHODS_RULE, add_artifact, add_device, add_methods, add_model,
    add_out,
)
from oscar.defaults import SINK
from oscar.host import DTYPES, compute_dtype
from oscar.common import length_list, nonneg_int, nonneg_int_list, positive_int
from oscar.stats.rotations import LATENT_VARIANTS


def _lengths(s: str) -> list[int]:
    # late: keeps scipy (1.3 s) out of `oscar --help`
    from oscar.validate.ruler import parse_length

    return [parse_length(x) for x in s.split(",") if x.strip()]


def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


_DTYPE_HELP = ("model compute dtype: auto (default, as `oscar run`: bfloat16 on CUDA and on CPUs that multiply it "
               "natively (AVX-512 BF16, AMX), float32 on other CPUs, where bfloat16 runs ~6x slower), bfloat16 (the "
               "serving precision) or float32 (steadier digits: bfloat16 results move with the thread count)")
_PROGRESS_HELP = "no progress bars (ours and transformers')"


def _exec_args(parser, engine: bool = True) -> None:
    """--device (and --engine): where and through what the model runs (oscar/scoring/engine.py)."""
    add_device(parser)
    if engine:
        parser.add_argument("--engine", default=DEFAULT_ENGINE, choices=ENGINES, help=ENGINE_HELP)


def _qa_args(parser) -> None:
    """--squad / --hotpotqa: the files RULER's QA tasks read (oscar validate niah, oscar run)."""
    parser.add_argument("--squad", metavar="PATH", help="SQuAD v1.1 / v2.0 JSON file (the official layout) for task "
                        "qa_1: its paragraphs are the documents, its answerable questions the samples (default: none; "
                        "qa_1 is then skipped by --tasks all and refused if named)")
    parser.add_argument("--hotpotqa", metavar="PATH", help="HotpotQA JSON file (the official list of records with "
                        "question, answer, context) for task qa_2 (default: none; qa_2 is then skipped by --tasks all "
                        "and refused if named)")


def register(sub: argparse._SubParsersAction) -> None:
    v = sub.add_parser("validate", help="RULER-style needle tests, perplexity, attention-level retrieval",
                       description="Model-level checks of an artifact against BF16 and the baseline INT2 schemes; "
                                   "niah and ppl resume when re-run with the same options (docs/validation.md).")
    vs = v.add_subparsers(dest="validate_command", required=True, metavar="CHECK")

    n = vs.add_parser("niah", help="RULER-style tasks under the strict protocol (resumable)",
                      description="RULER-style needle-in-a-haystack tasks on held-out haystacks, every method on the "
                                  "same samples; writes DIR/results.parquet and DIR/niah_samples.jsonl.")
    add_model(n)
    add_artifact(n)
    add_methods(n, METHODS_HELP + METHODS_RULE)
    n.add_argument("--tasks", default="niah_single_1,niah_single_2",
                   help="comma list of RULER tasks, or 'all' (every task the inputs allow: qa_1 / qa_2 only with "
                        "--squad / --hotpotqa; the others skipped are named on stderr and in the report)")
    _qa_args(n)
    n.add_argument("--lengths", "--contexts", dest="lengths", default="1k,2k,4k", type=length_list,
                   help="comma list of haystack lengths, e.g. 1k,2k,4k,...,128k (1k = 1024 tokens; --contexts: the "
                        "same, as `oscar validate ppl` spelled it)")
    n.add_argument("--samples", type=positive_int, default=20, help="samples per (task, length) cell")
    n.add_argument("--seed", type=nonneg_int, default=0, help="seed of the haystacks, needles and questions")
    n.add_argument("--protocol", default="serving", choices=["strict", "serving", "strict-token"],
                   help="cache protocol: serving (sink + recent window exact: the deployed cache; the default, as "
                        "`oscar run`), strict (recent window 0: sinks and under a page of the latest tokens exact), "
                        "strict-token (diagnostic: per-token K/V quantized the moment they are written)")
    n.add_argument("--corpus", default="pydoc", help="haystack corpus: pydoc, or a .parquet / .jsonl / .txt file")
    n.add_argument("--dtype", default="auto", choices=DTYPES, help=_DTYPE_HELP)
    add_out(n, "output directory (resumes what it already holds)")
    _exec_args(n)
    n.add_argument("--no-progress", action="store_true", help=_PROGRESS_HELP)
    n.set_defaults(func=_niah)

    p = vs.add_parser("ppl", help="held-out perplexity, strict and serving protocols",
                      description="Held-out perplexity of every method, paired by window against bf16; writes "
                                  "DIR/ppl.parquet and DIR/goal.json.")
    add_model(p)
    add_artifact(p)
    add_methods(p, METHODS_HELP + METHODS_RULE)
    p.add_argument("--lengths", "--contexts", dest="contexts", default="1k,4k", type=length_list,
                   help="comma list of context lengths scored (1k = 1024 tokens; --contexts: the older spelling)")
    p.add_argument("--protocol", "--protocols", dest="protocols", default="strict,serving",
                   help="one protocol or a comma list: strict, serving, strict-token (diagnostic; docs/validation.md); "
                        "--protocols: the older spelling")
    p.add_argument("--tokens", type=positive_int, default=8192,
                   help="held-out tokens scored per context (past the corpus's held-out split: the standard library's "
                        "docstrings, as the needle haystacks)")
    p.add_argument("--corpus", default="pydoc", help="held-out corpus: pydoc, or a .parquet / .jsonl / .txt file")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help=_DTYPE_HELP)
    add_out(p, "output directory (resumes what it already holds)")
    _exec_args(p)
    p.add_argument("--no-progress", action="store_true", help=_PROGRESS_HELP)
    p.set_defaults(func=_ppl)

    a = vs.add_parser("attention", help="attention-level retrieval to 128k on held-out captured q/k/v (not a model run)",
                      description="Whole held-out sequences (text the fit never saw) captured at their own positions "
                                  "and laid end to end; the needle is the real key a real query prefers most; each "
                                  "method's INT2 reading must keep it first. Writes DIR/attention.parquet and "
                                  "DIR/attention.json.")
    a.add_argument("--store", required=True, help="calibration store the artifact was fitted on (held-out text is checked "
                   "against its tokens; the model is the store's)")
    add_artifact(a)
    add_methods(a, default="naive-int2,kivi2,hadamard-int2,oscar-ref-int2,oscar-int2")
    a.add_argument("--lengths", "--contexts", dest="lengths", default="4k,16k,64k,128k", type=length_list,
                   help="context lengths in keys, every key a distinct held-out row (1k = 1024 tokens; --contexts: the same)")
    a.add_argument("--windows", type=positive_int, default=8,
                   help="contexts per layer and length, each scored by every query head")
    a.add_argument("--layers", default="", type=nonneg_int_list, help="comma list of layers (default: 4 spread over depth)")
    a.add_argument("--seq-len", type=positive_int, default=4096,
                   help="tokens per captured held-out sequence, at most the model's context")
    a.add_argument("--sink", type=nonneg_int, default=SINK, help="first keys of each context kept exact")
    a.add_argument("--corpus", default="pydoc", help="corpus whose held-out split comes first")
    a.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="model compute dtype of the capture")
    a.add_argument("--seed", type=nonneg_int, default=0, help="seed of the context offsets")
    add_out(a, "output directory (attention.parquet, attention.json)")
    _exec_args(a)
    a.add_argument("--no-progress", action="store_true", help=_PROGRESS_HELP)
    a.set_defaults(func=_attention)

    la = vs.add_parser("latent-attention", help="attention-level errors of an MLA model's INT2 latent cache per fit "
                       "variant (held-out text; not a needle run)",
                       description="Fit each latent variant (attention-aware, the public OSCAR reference, Hadamard, "
                                   "identity) from a latent store, run held-out sequences through the model once and "
                                   "read each layer's history from each variant's INT2 latent cache: score, value and "
                                   "output errors relative to the exact attention, with 95 percent intervals and the "
                                   "attention-aware fit against the reference paired. Writes "
                                   "DIR/latent_attention.parquet and DIR/latent_attention.json.")
    la.add_argument("--store", required=True, help="latent calibration store (oscar-calib-latent/1) of the MLA model")
    add_model(la, "the store's model, checked against its config (default: the model directory the store records)",
              default=None)
    la.add_argument("--variants", default=",".join(LATENT_VARIANTS),
                    help=f"latent fit variants to compare (default all: {', '.join(LATENT_VARIANTS)})")
    la.add_argument("--seq-len", type=positive_int, default=512, help="tokens per held-out sequence")
    la.add_argument("--sequences", type=positive_int, default=2, help="held-out sequences (each layer of each is a unit)")
    la.add_argument("--sink", type=nonneg_int, default=None, help="first tokens kept exact (default: the artifact's)")
    la.add_argument("--recent", type=nonneg_int, default=None, help="latest tokens kept exact (default: the artifact's)")
    add_out(la, "output directory (latent_attention.parquet, latent_attention.json)")
    la.set_defaults(func=_latent_attention)


def _default_methods(args) -> bool:
    """--methods left out: its default list, from which a method the model cannot serve is left out (and said)
    instead of refused."""
    given = getattr(args, "_given", None)
    return given is not None and "methods" not in given


def niah_config(args):
    """The NiahConfig `oscar validate niah`'s options describe."""
    # late: keeps torch (2.1 s) out of `oscar --help`
    from oscar.validate.niah import NiahConfig

    return NiahConfig(out=args.out, model=args.model, artifact=args.artifact, methods=_csv(args.methods),
                      tasks=_csv(args.tasks), lengths=_lengths(args.lengths), samples=args.samples, seed=args.seed,
                      protocol=args.protocol, corpus=args.corpus, dtype=compute_dtype(args.dtype, args.device),
                      engine=args.engine, device=args.device, squad=args.squad, hotpotqa=args.hotpotqa,
                      default_methods=_default_methods(args))


def niah_table(df) -> str:
    return df.pivot_table(index=["task", "method"], columns="length", values="score").round(1).to_string()


def _niah(args) -> int:
    # late: keeps torch (2.1 s) out of `oscar --help`
    from oscar.validate.niah import run_niah

    print(niah_table(run_niah(niah_config(args), progress=not args.no_progress)))
    return 0


def ppl_config(args):
    """The PplConfig `oscar validate ppl`'s options describe."""
    # late: keeps torch (2.1 s) out of `oscar --help`
    from oscar.validate.ppl import PplConfig

    return PplConfig(out=args.out, model=args.model, artifact=args.artifact, methods=_csv(args.methods),
                     contexts=_lengths(args.contexts), protocols=_csv(args.protocols), tokens=args.tokens,
                     corpus=args.corpus, dtype=compute_dtype(args.dtype, args.device), engine=args.engine,
                     device=args.device, default_methods=_default_methods(args))


def _ppl(args) -> int:
    # late: keeps torch (2.1 s) out of `oscar --help`
    from oscar.validate.ppl import run_ppl

    df = run_ppl(ppl_config(args), progress=not args.no_progress)
    print(df.round(3).to_string(index=False))
    return 0


def _latent_attention(args) -> int:
    # late: keeps torch (2.1 s) out of `oscar --help`
    from oscar.validate.latent_attention import LatentAttnConfig, run_latent_attention

    s = run_latent_attention(LatentAttnConfig(store=args.store, out=args.out, model=args.model, seq_len=args.seq_len,
                                              sequences=args.sequences, variants=_csv(args.variants), sink=args.sink,
                                              recent=args.recent))
    print(f"{'variant':10s} {'score err':>22s} {'value err':>22s} {'output err':>22s}")
    for v, r in s["variants"].items():
        cell = lambda d: f"{d['mean']:.4f} [{d['lo']:.4f}, {d['hi']:.4f}]"  # noqa: E731
        print(f"{v:10s} {cell(r['score_err']):>22s} {cell(r['value_err']):>22s} {cell(r['output_err']):>22s}")
    for k, r in s.get("attention_vs_reference", {}).items():
        print(f"attention / reference {k}: x{r['ratio']:.3f} [{r['lo']:.3f}, {r['hi']:.3f}] {r['verdict']}")
    return 0


def _attention(args) -> int:
    # late: keeps torch (2.1 s) out of `oscar --help`
    from oscar.validate.attention import AttnConfig, run_attention

    cfg = AttnConfig(out=args.out, store=args.store, artifact=args.artifact, methods=_csv(args.methods),
                     lengths=_lengths(args.lengths), windows=args.windows, seed=args.seed, seq_len=args.seq_len,
                     sink=args.sink, corpus=args.corpus, dtype=args.dtype, layers=[int(x) for x in _csv(args.layers)],
                     engine=args.engine, device=args.device)
    df = run_attention(cfg, progress=not args.no_progress)
    print(df.round(4).to_string(index=False))
    return 0
