#!/usr/bin/env bash
# Run stages of the GPU proof kit on a GPU box (or, with --dry-run, on any CPU machine).
#
#   bash scripts/gpu/run.sh [--budget SECONDS] [--dry-run] STAGE... | all     (STAGE: check engine codec serve)
#
# One deadline for the whole call: --budget seconds from now (default 540; a GPU box kills a command at
# 600). Each stage gets what is left of it, less a floor kept for each later stage, and runs under
# `timeout`, which signals the stage's whole process group (the server and its engine core with it):
# no process is left holding GPU memory. Stages write STAGE.json after every piece they measure.
# The card run is two calls (scripts/gpu/README.md): `--budget 500 serve`, then
# `--budget 245 check codec engine` (the engine stage last: it fits its pieces to whatever is left).
#
# Results: STAGE.json per stage and logs-STAGES.tar.gz (every log of the call, one archive named by its
# stages, so two calls' archives sit side by side) under $OUT when it is set, else gpu-results/. Then, here:
#   python scripts/gpu/report.py RESULTS_DIR        # docs/gpu-results/<date>-<card>/ and docs/PERFORMANCE.md
#
# On a bare box the wheels from scripts/gpu/prepare.sh (.whl/, carried with the tree; KIT_WHEELS names
# another folder) are installed into a target folder put first on PYTHONPATH; the box's own torch stays.
# A dry run uses the environment it finds (the project's .venv when there is one) and installs nothing
# unless KIT_WHEELS is set.
set -euo pipefail
cd "$(dirname "$0")/../.."
START=$(date +%s)

usage() { echo "usage: bash scripts/gpu/run.sh [--budget SECONDS] [--dry-run] check|engine|codec|serve... | all" >&2
          exit 2; }
BUDGET=540
DRY=()
STAGES=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=(--dry-run) ;;
    --budget) [ $# -ge 2 ] && [[ "$2" =~ ^[0-9]+$ ]] || usage; BUDGET=$2; shift ;;
    check|engine|codec|serve) STAGES+=("$1") ;;
    all) STAGES+=(check engine codec serve) ;;
    *) usage ;;
  esac
  shift
done
[ ${#STAGES[@]} -ge 1 ] || usage
DEADLINE=$((START + BUDGET))

# The least each stage needs (seconds), kept back for the stages after the running one. On an H200 check
# took 46 s and codec 35 s; engine is sized to ~150 s (its pieces stop by its deadline); serve's levels
# stop starting once one more would not fit.
floor() { case "$1" in check) echo 50 ;; engine) echo 135 ;; codec) echo 40 ;; serve) echo 180 ;; esac; }

RESULTS=${OUT:-gpu-results}
WORK=${KIT_WORK:-/tmp/orpheus-gpu-kit}
mkdir -p "$RESULTS" "$WORK/logs"
if [ -z "${PYTHON:-}" ]; then
  if [ ${#DRY[@]} -gt 0 ] && [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi

WHEELS=${KIT_WHEELS:-$([ ${#DRY[@]} -eq 0 ] && echo .whl || true)}
if [ -n "$WHEELS" ] && compgen -G "$WHEELS/*.whl" >/dev/null; then
  SITE=${KIT_SITE:-/tmp/orpheus-gpu-site}
  if [ ! -f "$SITE/.installed" ]; then
    echo "=== installing $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS into $SITE"
    "$PYTHON" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target "$SITE" "$WHEELS"/*.whl
    touch "$SITE/.installed"
  fi
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

LOGS="logs-$(IFS=-; echo "${STAGES[*]}").tar.gz"
archive_logs() { tar -czf "$RESULTS/$LOGS.tmp" -C "$WORK" logs && mv "$RESULTS/$LOGS.tmp" "$RESULTS/$LOGS"; }

status=0
for i in "${!STAGES[@]}"; do
  stage=${STAGES[$i]}
  reserve=10  # the log archive and the reply
  for later in "${STAGES[@]:$((i + 1))}"; do reserve=$((reserve + $(floor "$later"))); done
  now=$(date +%s)
  stage_s=$((DEADLINE - now - reserve))
  if [ "$stage_s" -lt 20 ]; then
    echo "=== $stage skipped: ${stage_s} s left of the budget for it" | tee -a "$WORK/logs/run.log"
    status=1
    continue
  fi
  echo "=== $stage $(date -u +%H:%M:%S), ${stage_s} s (call budget ${BUDGET} s, $((now - START)) s used)" \
    | tee -a "$WORK/logs/run.log"
  # The stage stops starting new work before its deadline; timeout (TERM to the whole process group,
  # KILL 10 s later) is the backstop, 5 s after it.
  rc=0
  timeout --kill-after=10 $((stage_s + 5)) "$PYTHON" scripts/gpu/kit.py "$stage" --results "$RESULTS" \
    --work "$WORK" --deadline $((now + stage_s)) "${DRY[@]}" 2>&1 | tee "$WORK/logs/$stage.log" || rc=$?
  [ "$rc" -eq 0 ] || status=1
  echo "=== $stage done in $(($(date +%s) - now)) s (exit $rc)" | tee -a "$WORK/logs/run.log"
  archive_logs
done
echo "=== call took $(($(date +%s) - START)) s of ${BUDGET} s"
exit $status
