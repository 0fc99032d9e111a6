"""oscar.validate.ablation: the synthetic ablation (regimes, scheme zoo, metrics, statistical tests, `oscar ablate`).

Separate from the model-level validation in oscar.validate; that side reuses the ablation's quantizers
(validate/codebooks.py builds tq-int2 / sq-int2 from `schemes`), never the other way round; both use
the multiple-testing corrections of the shared leaf oscar.validate.intervals.
"""
