#!/usr/bin/env bash
# Create .venv and install the project with its dev extras. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/requirements-pipecat.txt -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # torch first and pinned (pyproject.toml only sets a floor): on a CPU-only machine this is the CPU build.
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e ".[dev,bench]"
  # Pipecat's Cartesia client for the tests; outside the dev extra because it caps protobuf below the
  # version the gRPC stubs need (see scripts/requirements-pipecat.txt).
  .venv/bin/python -m pip install -q --no-deps "pipecat-ai[cartesia]==1.14.0"
  .venv/bin/python -m pip install -q -r scripts/requirements-pipecat.txt
  touch "$stamp"
fi
