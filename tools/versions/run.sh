#!/usr/bin/env bash
# The supported range, tested (the README's "Versions"): for each end of it, a fresh virtual environment installs
# the package with that torch, Lightning and torchmetrics, and runs the tests of the tensor parts, the probes, the
# Lightning adapters and the copy atlas, their long runs too (the recipes' end-to-end runs are the default suite's
# and CI's long runs, on the README's torch).
#
#   bash tools/versions/run.sh                      # the floors, then the newest releases pip is served
#   bash tools/versions/run.sh "torch==2.9.1"       # any other set of requirements, one argument an environment
#
# Each environment takes a few minutes to install (PyPI's torch for Linux is the CUDA build; it runs on a CPU) and
# is removed after. Exit status: the first failing environment's.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ "$#" -gt 0 ]; then
  ends=("$@")
else
  ends=(
    # The floors of pyproject.toml: the oldest releases the package claims (isal's: the fast-digest extra's CRC-32).
    "torch==2.10.0 numpy==1.26.4 lightning==2.6.6 torchmetrics==1.4.0 isal==1.7.0"
    # No pins: the newest releases pip is served here within pyproject.toml's ranges (no isal: zlib's CRC-32).
    ""
  )
fi
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
for i in "${!ends[@]}"; do
  venv="$scratch/env$i"
  python3 -m venv "$venv"
  # shellcheck disable=SC2086  # one argument holds several requirements
  "$venv/bin/pip" install -q ${ends[$i]} ".[recipes,test]"
  versions=$("$venv/bin/python" -c 'import lightning, numpy, torch, torchmetrics as m
print(f"torch {torch.__version__}, lightning {lightning.__version__}, torchmetrics {m.__version__}, numpy {numpy.__version__}")')
  echo "versions: ${versions}"
  "$venv/bin/python" -m pytest -p no:cacheprovider -m "not slow" tests/parts tests/probes tests/lightning tests/atlas
  echo "versions: passed on ${versions}"
  rm -rf "$venv"
done
