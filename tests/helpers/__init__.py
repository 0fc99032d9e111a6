"""What the tests share (test helpers, not tests): one package, imported by plain `import` (pyproject's pytest
`pythonpath` puts tests/ on sys.path; tests run with --import-mode=importlib, so tests/ is no package).

- `synthetic_store`: calibration stores with planted spectra (also run by bench/fit.py, loaded by path there).
- `capture_reference`: the brute-force float64 reference for the calibration statistics and its tiny models.
- `stores`: small real stores: the capture tests' store metadata and blocks, a store of distinct reservoir rows.
- `cluster`: the Ray tests' job options, single-process reference store and store equality check.
- `artifacts`: tiny models and the artifacts with random rotations the cache and validation tests build.
- `fp8`: block-FP8 checkpoints and their dequantized twins (also used by bench/gpu_e2e.py, tests/ on its path).

A test never loads another test file or a bench/ or lab/ script (tests/test_import_graph.py checks both).
"""
