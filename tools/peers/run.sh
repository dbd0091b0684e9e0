#!/usr/bin/env bash
# The peers' tests (tests/peers and tests/parts/test_ema_migration.py: timm, diffusers, ema-pytorch, Lightning and
# stable-baselines3 side by side with ours, and the "coming from" page run as it is shown), in a fresh virtual
# environment that installs every peer: the README's torch, the `bench` extra's pinned peers, and timm on its own with
# --no-deps (it requires torchvision, whose PyPI build does not import beside this torch: benchmarks/peers.py).
#
#   bash tools/peers/run.sh
#
# COPY_CORRECT_REQUIRE_PEERS=1 makes every skip under tests/peers a failure (tests/peers/conftest.py): a peer missing
# here fails the run instead of skipping its tests. The environment is removed after. Exit status: pytest's.
set -euo pipefail
cd "$(dirname "$0")/../.."
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
venv="$scratch/env"
python3 -m venv "$venv"
"$venv/bin/pip" install -q torch==2.13.0 ".[recipes,test,bench]"
"$venv/bin/pip" install -q --no-deps timm==1.0.31
versions=$("$venv/bin/python" -c 'import importlib.metadata as m
print(", ".join(f"{d} {m.version(d)}" for d in ("torch", "timm", "diffusers", "ema-pytorch", "lightning", "stable-baselines3")))')
echo "peers: ${versions}"
COPY_CORRECT_REQUIRE_PEERS=1 "$venv/bin/python" -m pytest -p no:cacheprovider tests/peers tests/parts/test_ema_migration.py
echo "peers: passed on ${versions}"
