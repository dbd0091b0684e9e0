#!/usr/bin/env bash
# GPU verification in one run (issue: the GPU evidence is a report committed with the code it measured).
#
# On a CUDA machine that has torch, lightning, torchmetrics and scikit-learn but no registry access:
#   1. copy the pure-Python wheels into the checkout:  cp -r ../shared/wheels wheels   (git-ignored)
#      (hydra-core, omegaconf, antlr4-python3-runtime, gymnasium, farama-notifications; to prepare them
#      elsewhere: pip download --no-deps --only-binary=:all: -d wheels hydra-core==1.3.8 omegaconf==2.3.1
#      gymnasium==1.4.0 farama-notifications==0.0.6, plus antlr4-python3-runtime==4.9.3 built as a wheel)
#      The benchmarks compare against peer libraries (the `bench` extra, and timm; benchmarks/peers.py): their
#      wheels, and the packages they need that the machine lacks, can travel in wheels/ too, downloaded for the
#      machine's Python (pip download --no-deps --only-binary=:all: --python-version 3.12 --platform
#      manylinux_2_28_x86_64 -d wheels diffusers==0.42.1 ema-pytorch==0.8.3 stable-baselines3==2.9.2 timm==1.0.31
#      torchrl==0.14.1 tensordict==0.14.3 ...). A peer that does not import there gets a row saying why.
#   2. bash tools/gpu_check/run.sh [--budget S] [--time-limit T] -> docs/gpu-results.md; exit 1 if a test, a recipe
#      run or a GPU claim of the manual failed, or a step was not run (--budget: S seconds of timing per benchmark
#      configuration; --time-limit: no step starts after T seconds; with --budget 2 the whole check took over 545 s
#      on an H200). The report is rewritten after each step, so a call stopped at its limit still leaves one.
#   3. bash tools/gpu_check/run.sh --suite     -> docs/gpu-suite.md: the default suite on the GPU (minutes)
# Nothing is fetched from the network. Extra arguments go to tools/gpu_check/check.py (python -m tools.gpu_check.check) (e.g. --dry-run);
# PYTHON=path/to/python picks the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/../.."
if compgen -G "wheels/*.whl" > /dev/null; then
  "${PYTHON:-python3}" -m pip install -q --no-index --no-deps --target /tmp/gpu-check-site wheels/*.whl
  export PYTHONPATH="/tmp/gpu-check-site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
exec "${PYTHON:-python3}" -m tools.gpu_check.check "$@"
