#!/usr/bin/env bash
# The replay against the card it replays (docs/PERFORMANCE.md, "Replay calibration against the H200"): the H200's
# own serve stage (gRPC, 280-token utterances, 2 requests a stream, a 2 s ramp, the card's server settings) replayed
# at levels 16 and 64 with the code the card ran (a38a740, plus the replay of ea61977 and the patch
# docs/gpu-results/2026-11-28-h200/calibration.diff: the profile's measured inputs and --sim-card-serve), then with
# this tree. Each replay runs twice: with the engine step's interpreter time measured (serve.json's core CPU per
# step) and with the estimate (a copy of the folder whose serve.json lacks core_cpu_us_per_token).
#
#   bash scripts/replay_calibration.sh [OUT_DIR]     (default /tmp/replay-calibration; run as root for nice -15)
#
# Each run prints the card and the replay side by side per level; results in OUT_DIR/<code>-<inputs>/results.json.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${1:-/tmp/replay-calibration}"
CARD="$ROOT/docs/gpu-results/2026-11-28-h200"
PY="$ROOT/.venv/bin/python"
OLD="$OUT/tree-a38a740"
mkdir -p "$OUT"

if [ ! -d "$OLD" ]; then
  git -C "$ROOT" worktree add --detach "$OLD" ea61977   # a38a740 + the replay
  git -C "$OLD" apply "$CARD/calibration.diff"
fi
PYTHONPATH="$OLD/src" "$PY" -c 'import orpheus_serve, sys; sys.exit(not orpheus_serve.__file__.startswith(sys.argv[1]))' "$OLD/src"

# The folder with the estimate: serve.json without the core's CPU per token (so its runs' comparison shows no card
# CPU a step either: that is the field removed).
ESTIMATE="$OUT/estimate-profile"
mkdir -p "$ESTIMATE"
cp "$CARD/engine.json" "$CARD/codec.json" "$ESTIMATE/"
"$PY" - "$CARD/serve.json" "$ESTIMATE/serve.json" <<'EOF'
import json, sys
serve = json.load(open(sys.argv[1]))
for row in [*serve["rows"], serve.get("warmup") or {}]:
    row.pop("core_cpu_us_per_token", None)
    row.pop("core_host", None)
json.dump(serve, open(sys.argv[2], "w"), indent=1)
EOF

NICE=()
if [ "$(id -u)" = 0 ]; then NICE=(nice -n -15); fi
run() {  # code tree, label, profile folder
  local tree="$1" label="$2" profile="$3"
  echo "== $label: $(uptime)"
  PYTHONPATH="$tree/src" "${NICE[@]}" "$PY" "$tree/benchmark.py" --mode sim --sim-profile "$profile" --sim-card-serve \
    --sim-levels 16 64 --no-progress --output "$OUT/$label/results.json" 2>&1 | tee "$OUT/$label.log"
  echo "== $label done: $(uptime)"
}
run "$OLD" a38a740-estimate "$ESTIMATE"
run "$OLD" a38a740-measured "$CARD"
run "$ROOT" main-estimate "$ESTIMATE"
run "$ROOT" main-measured "$CARD"
