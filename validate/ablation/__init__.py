"""oscar.validate.ablation: the synthetic ablation (regimes, scheme zoo, metrics, statistical tests, `oscar ablate`).

Separate from the model-level validation in oscar.validate; that side reuses the ablation's quantizers
(validate/codebooks.py builds tq-int2 / sq-int2 from `schemes`) and its multiple-testing correction
(`stattests.holm`), never the other way round.
"""
