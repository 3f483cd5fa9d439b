#!/usr/bin/env bash
# Set up (if needed), lint, and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The playground's browser tests drive a real headless Chromium: Debian's package, never a download.
# Installed here rather than in setup.sh, which serving shares and which needs no browser.
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1 \
    && [ -z "${ORPHEUS_CHROMIUM:-}" ] && command -v apt-get >/dev/null 2>&1; then
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo -n"; fi
  echo "installing chromium (apt-get) for the browser tests"
  if ! { $sudo apt-get update -qq && $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } \
      >/tmp/orpheus-chromium-install.log 2>&1; then
    echo "could not install chromium (see /tmp/orpheus-chromium-install.log); the browser tests will fail" >&2
  fi
fi
# promtool checks the Prometheus alert rules (deploy/prometheus) and runs their unit tests; prometheus itself
# scrapes a test server to run every dashboard query (tests/test_observability.py). Debian's package has both.
if ! command -v promtool >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo -n"; fi
  echo "installing prometheus (apt-get) for promtool and the observability tests"
  if ! { $sudo apt-get update -qq && $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; } \
      >/tmp/orpheus-prometheus-install.log 2>&1; then
    echo "could not install prometheus (see /tmp/orpheus-prometheus-install.log); the promtool tests will skip" >&2
  fi
fi
.venv/bin/python -m ruff check .
# No arguments: the CI lane, everything but the `leak` (thousands of requests, for a quiet machine), `ray` (a
# local Ray cluster), `gpukit` (the GPU kit on a simulated bare box) and `full_size` (the big form of a check whose
# CI-sized form runs here) markers, with the soak at its CI size, to stay inside CI's 20 minutes on two cores.
# --all: every marker (slow, soak at its full size, full_size, leak, ray, gpukit, browser).
# Anything else goes to pytest as is.
#
# Then the gateway tests again with the engine core in the server's process (server.engine_process: false, the
# embedding mode); the pass above ran them split. The CI lane runs the ones marked `core_in_process`: each
# protocol's stream, the stats, admission and readiness, the drain, slow and stalled HTTP readers beside normal
# streams, contexts and their cancels: what goes through the core's client (core/client.py) and so differs between
# the two. Parsing, refusals and fuzzing never reach the core's client, and a stalled WebSocket or gRPC reader
# differs from a stalled HTTP one only in the gateway. --all runs these files whole.
GATEWAY_FILES=(tests/test_gateway_e2e.py tests/test_gateway_limits.py tests/test_gateway_units.py
               tests/test_slow_readers.py tests/test_ws_contexts.py tests/test_cartesia_fuzz.py
               tests/test_elevenlabs_fuzz.py tests/test_elevenlabs_hostile.py)
CI_MARKERS="not leak and not ray and not gpukit and not full_size"
SOAK_CI=${ORPHEUS_SOAK_REQUESTS:-240}
SOAK_ALL=${ORPHEUS_SOAK_REQUESTS:-600}

# The CI lane's shards side by side (pytest --shard, tests/conftest.py): most tests wait on audio paced in real
# time, so two processes share two cores well; the windows of tests that wait on time stretch with the load they
# measure (tests/pace.py). ORPHEUS_TEST_SHARDS=1 runs the lane in one process.
ci_shard() {  # ci_shard I N: shard I of N; the last shard also runs the in-process pass
  local status=0
  ORPHEUS_SOAK_REQUESTS=$SOAK_CI .venv/bin/python -m pytest -m "$CI_MARKERS" --shard "$1/$2" --durations=15 || status=$?
  if [ "$1" = "$2" ]; then
    ORPHEUS_ENGINE_PROCESS=0 .venv/bin/python -m pytest -m core_in_process "${GATEWAY_FILES[@]}" || status=$?
  fi
  return "$status"
}

if [ "${1:-}" = "--all" ]; then
  shift
  status=0
  ORPHEUS_SOAK_REQUESTS=$SOAK_ALL ORPHEUS_GPUKIT=1 .venv/bin/python -m pytest "$@" || status=$?
  ORPHEUS_ENGINE_PROCESS=0 .venv/bin/python -m pytest "${GATEWAY_FILES[@]}" || status=$?
  exit "$status"
elif [ "$#" -eq 0 ]; then
  shards=${ORPHEUS_TEST_SHARDS:-2}
  logs=$(mktemp -d)
  pids=()
  for ((i = 2; i <= shards; i++)); do
    ci_shard "$i" "$shards" >"$logs/shard-$i.log" 2>&1 &
    pids+=("$!")
  done
  status=0
  ci_shard 1 "$shards" || status=$?
  for ((i = 2; i <= shards; i++)); do
    wait "${pids[$((i - 2))]}" || status=$?
    echo "======================== shard $i of $shards ========================"
    cat "$logs/shard-$i.log"
  done
  rm -rf "$logs"
  exit "$status"
else
  exec .venv/bin/python -m pytest "$@"
fi
