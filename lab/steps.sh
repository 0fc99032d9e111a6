# Sourced by the lab/*.sh A/B scripts: the repo's venv, the output folder W (default $1) and the steps to run
# (STEPS, default $2), with `has STEP` to test for one.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source .venv/bin/activate
W=${W:-$1}
STEPS=${STEPS:-$2}
mkdir -p "$W"
has() { [[ " $STEPS " == *" $1 "* ]]; }
