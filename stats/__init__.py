"""oscar.stats: reductions, eigendecompositions, d_eff, robust estimation, rotations, clipping, artifact."""
