"""The shipped recipe: the fit stage's model-driven steps (key-clip tune, per-layer key widths) and their driver.

It reads the model through scoring (oscar/scoring/) and writes artifacts through stats/; it never imports
validate/, so a change to a report cannot change the shipped artifact.
"""
