"""Scoring: what turns a model, a real or simulated INT2 cache and text into NLLs, answers and gradients.

The floor between the kernels and the recipe: the engines (the simulator or the served cache), the named
protocols, the dtype the model computes in, the window NLL, the needle decode loops and the per-layer formats
the widths build. The recipe (oscar/recipe/) and validation (validate/) both read it; it imports neither.
"""
