#!/usr/bin/env bash
# Run one stage of the GPU proof kit on a GPU box (or, with --dry-run, on any CPU machine).
#
#   bash scripts/gpu/run.sh check|engine|codec|serve|all [--dry-run]
#
# Results: STAGE.json and STAGE.md per stage under $OUT when it is set, else gpu-results/. Then, here:
#   python scripts/gpu/report.py RESULTS_DIR        # merges them into docs/PERFORMANCE.md
#
# On a bare box the wheels from scripts/gpu/prepare.sh (.whl/, carried with the tree) are installed
# into a target folder put first on PYTHONPATH; the box's own torch stays. A dry run uses the
# environment it finds (the project's .venv when there is one) and installs nothing.
set -euo pipefail
cd "$(dirname "$0")/../.."

usage() { echo "usage: bash scripts/gpu/run.sh check|engine|codec|serve|all [--dry-run]" >&2; exit 2; }
[ $# -ge 1 ] || usage
STAGE=$1
shift
DRY=()
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=(--dry-run) ;;
    *) usage ;;
  esac
done
case "$STAGE" in
  check|engine|codec|serve) STAGES=("$STAGE") ;;
  all) STAGES=(check engine codec serve) ;;
  *) usage ;;
esac

RESULTS=${OUT:-gpu-results}
mkdir -p "$RESULTS"
if [ -z "${PYTHON:-}" ]; then
  if [ ${#DRY[@]} -gt 0 ] && [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi

if [ ${#DRY[@]} -eq 0 ] && compgen -G ".whl/*.whl" >/dev/null; then
  SITE=${KIT_SITE:-/tmp/orpheus-gpu-site}
  if [ ! -f "$SITE/.installed" ]; then
    "$PYTHON" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target "$SITE" .whl/*.whl
    touch "$SITE/.installed"
  fi
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

status=0
for stage in "${STAGES[@]}"; do
  echo "=== $stage $(date -u +%H:%M:%S)"
  "$PYTHON" scripts/gpu/kit.py "$stage" --results "$RESULTS" "${DRY[@]}" || status=1
done
exit $status
