#!/usr/bin/env bash
# Regenerate the committed gRPC stubs from src/orpheus_serve/proto/orpheus.proto.
# Generated from src/ so the stubs import each other as orpheus_serve.proto.*.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
"$PYTHON" -m grpc_tools.protoc -I src \
  --python_out=src --pyi_out=src --grpc_python_out=src \
  src/orpheus_serve/proto/orpheus.proto
