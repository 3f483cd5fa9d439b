#!/usr/bin/env bash
# Set up (if needed) and run the server. Arguments go to production_server.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python production_server.py "$@"
