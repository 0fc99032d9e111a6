"""oscar.validate: model-level validation (cache methods, NIAH/RULER, perplexity, attention retrieval, intervals); the synthetic ablation is oscar.validate.ablation."""

# The methods every validation command compares by default (bf16 first, this project's recipe last).
DEFAULT_METHODS = ["bf16", "naive-int2", "kivi2", "hadamard-int2", "oscar-ref-int2", "oscar-kc-int2", "oscar-int2"]
