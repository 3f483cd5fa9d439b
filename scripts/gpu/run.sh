#!/usr/bin/env bash
# Run stages of the GPU proof kit on a GPU box (or, with --dry-run, on any CPU machine).
#
#   bash scripts/gpu/run.sh --left SECONDS --call N [--card h100|h200] [--start-s S | --warm] [--done STAGE,...]
#                           [--plan-only] [--dry-run]
#   bash scripts/gpu/run.sh [--budget SECONDS] [--card h100|h200] [--dry-run] STAGE... | all
#
#   STAGE: serve base check codec engine serve-even compiled; `all` is check engine codec serve.
#
# With --left (the machine time the loan has left, `status`'s budget_left_s), the call is the plan's:
# scripts/gpu/plan.py makes the plan from the same arguments (the card's figures, the machine's start, the
# stages already measured), this prints it, and runs call N's stages with call N's budget. A plan that does
# not fit (its first stage does not fit at its floor) is refused: the reason, exit 3, nothing run. --plan-only
# prints the plan and stops. With --budget (default 540) the stages named run inside that budget: a call by hand.
#
# One deadline for the whole call: its budget, counted from now. Each stage gets what is left of it, less the
# floors of the stages after it in the call (plan.py's, for the card) and 10 s for the logs, and runs under
# `timeout`, which signals the stage's whole process group (the server and its engine core with it): no
# process is left holding GPU memory. Stages write STAGE.json after every piece they measure. `serve-even`
# is the serve stage again with even codec steps (kit.py serve --tag serve-even
# --override codec.ragged_steps=false), written as serve-even.json.
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

usage() {
  echo "usage: bash scripts/gpu/run.sh --left SECONDS --call N [--card h100|h200] [--start-s S | --warm]" \
       "[--done STAGE,...] [--plan-only] [--dry-run]" >&2
  echo "       bash scripts/gpu/run.sh [--budget SECONDS] [--card h100|h200] [--dry-run]" \
       "serve|base|check|codec|engine|serve-even|compiled... | all" >&2
  exit 2
}
number() { [[ "$1" =~ ^[0-9]+$ ]]; }
BUDGET=
LEFT=
CALL=
CARD=
START_S=90
WARM=()
DONE=()
PLAN_ONLY=0
DRY=()
STAGES=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=(--dry-run) ;;
    --plan-only) PLAN_ONLY=1 ;;
    --warm) WARM=(--warm) ;;
    --budget) [ $# -ge 2 ] && number "$2" || usage; BUDGET=$2; shift ;;
    --left) [ $# -ge 2 ] && number "$2" || usage; LEFT=$2; shift ;;
    --call) [ $# -ge 2 ] && number "$2" || usage; CALL=$2; shift ;;
    --start-s) [ $# -ge 2 ] && number "$2" || usage; START_S=$2; shift ;;
    --card) [ $# -ge 2 ] && [[ "$2" =~ ^(h100|h200)$ ]] || usage; CARD=$2; shift ;;
    --done) [ $# -ge 2 ] && [[ "$2" =~ ^[a-z,-]*$ ]] || usage; DONE=(--done "$2"); shift ;;
    serve|base|check|codec|engine|serve-even|compiled) STAGES+=("$1") ;;
    all) STAGES+=(check engine codec serve) ;;
    *) usage ;;
  esac
  shift
done
if [ -n "$LEFT" ]; then  # the plan's call: no stages or budget by hand
  [ -n "$CALL" ] && [ -z "$BUDGET" ] && [ ${#STAGES[@]} -eq 0 ] || usage
else
  [ -z "$CALL" ] && [ ${#WARM[@]} -eq 0 ] && [ ${#DONE[@]} -eq 0 ] && [ "$PLAN_ONLY" -eq 0 ] || usage
  [ ${#STAGES[@]} -ge 1 ] || usage
  BUDGET=${BUDGET:-540}
fi

if [ -z "${PYTHON:-}" ]; then
  if [ ${#DRY[@]} -gt 0 ] && [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if [ -z "$CARD" ]; then  # the card this box has; a box without one (a dry run) plans on the slower H100
  case "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)" in
    *H200*) CARD=h200 ;;
    *) CARD=h100 ;;
  esac
fi

# The plan (plan.py: standard library only, so it runs before any wheel is installed).
FLOORS=()
if [ -n "$LEFT" ]; then
  PLAN=(scripts/gpu/plan.py --left "$LEFT" --card "$CARD" --start-s "$START_S" "${WARM[@]}" "${DONE[@]}")
  rc=0
  "$PYTHON" "${PLAN[@]}" || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "=== no call run: plan.py exit $rc (3: the plan for ${LEFT} s of machine time left is refused)" >&2
    exit "$rc"
  fi
  rc=0
  LINE=$("$PYTHON" "${PLAN[@]}" --call-line "$CALL") || rc=$?
  if [ "$rc" -ne 0 ]; then echo "=== no call $CALL in this plan" >&2; exit "$rc"; fi
  read -r BUDGET CALL_STAGES <<<"$LINE"
  for entry in $CALL_STAGES; do STAGES+=("${entry%%:*}"); FLOORS+=("${entry##*:}"); done
  echo "=== call $CALL of the plan: budget ${BUDGET} s, stages ${STAGES[*]}"
  [ "$PLAN_ONLY" -eq 0 ] || exit 0
else
  LINE=$("$PYTHON" scripts/gpu/plan.py --card "$CARD" --floors "${STAGES[@]}")
  for entry in $LINE; do FLOORS+=("${entry##*:}"); done
fi
DEADLINE=$((START + BUDGET))

RESULTS=${OUT:-gpu-results}
WORK=${KIT_WORK:-/tmp/orpheus-gpu-kit}
mkdir -p "$RESULTS" "$WORK/logs"

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

# kit.py's arguments for a stage: serve-even is the serve stage with even codec steps, in serve-even.json.
kit_stage() {
  case "$1" in
    serve-even) echo serve --tag serve-even --override codec.ragged_steps=false ;;
    *) echo "$1" ;;
  esac
}

status=0
for i in "${!STAGES[@]}"; do
  stage=${STAGES[$i]}
  reserve=10  # the log archive and the reply
  for floor in "${FLOORS[@]:$((i + 1))}"; do reserve=$((reserve + floor)); done
  now=$(date +%s)
  stage_s=$((DEADLINE - now - reserve))
  if [ "$stage_s" -lt 20 ]; then
    echo "=== $stage skipped: ${stage_s} s left of the budget for it" | tee -a "$WORK/logs/run.log"
    status=1
    continue
  fi
  echo "=== $stage $(date -u +%H:%M:%S), ${stage_s} s (call budget ${BUDGET} s, $((now - START)) s used," \
       "${reserve} s kept for the logs and the floors after it)" | tee -a "$WORK/logs/run.log"
  # The stage stops starting new work before its deadline; timeout (TERM to the whole process group,
  # KILL 10 s later) is the backstop, 5 s after it.
  rc=0
  # shellcheck disable=SC2046  # kit_stage's words are the stage's arguments
  timeout --kill-after=10 $((stage_s + 5)) "$PYTHON" scripts/gpu/kit.py $(kit_stage "$stage") --results "$RESULTS" \
    --work "$WORK" --deadline $((now + stage_s)) "${DRY[@]}" 2>&1 | tee "$WORK/logs/$stage.log" || rc=$?
  [ "$rc" -eq 0 ] || status=1
  echo "=== $stage done in $(($(date +%s) - now)) s (exit $rc)" | tee -a "$WORK/logs/run.log"
  archive_logs
done
echo "=== call took $(($(date +%s) - START)) s of ${BUDGET} s"
exit $status
