#!/usr/bin/env bash
# The GPU kit's tests under the card's torch and triton (the GPU box runs torch 2.11.0+cu130 and
# triton 3.6.0 on Python 3.12, scripts/gpu/box-packages.txt), here on a CPU.
#
#   bash scripts/gpu/check_card_versions.sh          # the kit's gate and its full dry run (-m gpukit), ~10 min
#   bash scripts/gpu/check_card_versions.sh --all    # and the Triton-interpreter and torch.compile tests
#
# The environment lives outside the tree (CARD_VENV, default ~/.cache/orpheus-card-venv) and is reused:
# it is rebuilt only when the pins below, pyproject.toml or the project's .venv change. torch 2.11.0 from
# the package index is the CUDA build (with its nvidia-* wheels, some GB): it imports and runs on a CPU,
# as the box's does without its card. Every other package is held at the version the project's .venv
# has (`pip freeze` as constraints), so only torch and triton differ from what the CI lane tests.
# CARD_OFFLINE=1 uses CARD_VENV as it is and installs nothing (no package index needed for a rerun).
# Python: CARD_PYTHON, else the first Python 3.12 found (PATH, pyenv), else python3 with a warning; Debian
# 12's apt has no python3.12, so where pyenv has none the run is on 3.11 and says so.
# Prints the versions it ran with; exits non-zero when anything fails (or the versions are not the card's).
set -euo pipefail
cd "$(dirname "$0")/../.."

CARD_TORCH=2.11.0
CARD_TRITON=3.6.0
CARD_PYTHON_VERSION=3.12
VENV=${CARD_VENV:-$HOME/.cache/orpheus-card-venv}
# The tests that run Triton kernels in its interpreter (TRITON_INTERPRET=1, which each file sets for
# itself) or torch.compile on the CPU: where an API that differs between torch releases bites first.
KERNEL_TESTS=(tests/test_decode_attention.py tests/test_fused.py tests/test_lora_kernels.py tests/test_compiled.py)

usage() { echo "usage: bash scripts/gpu/check_card_versions.sh [--all]" >&2; exit 2; }
ALL=0
while [ $# -gt 0 ]; do
  case "$1" in
    --all) ALL=1 ;;
    *) usage ;;
  esac
  shift
done

runs_python() { [ -n "$1" ] && "$1" -c 'import sys, venv, ssl' >/dev/null 2>&1; }

pick_python() {
  if [ -n "${CARD_PYTHON:-}" ]; then
    runs_python "$CARD_PYTHON" || { echo "check_card_versions: CARD_PYTHON=$CARD_PYTHON does not run" >&2; exit 1; }
    echo "$CARD_PYTHON"; return
  fi
  local candidate
  # A pyenv shim named python3.12 is on PATH whether or not 3.12 is its selected version: try, don't trust.
  for candidate in "$(command -v python$CARD_PYTHON_VERSION || true)" \
                   "${PYENV_ROOT:-$HOME/.pyenv}"/versions/$CARD_PYTHON_VERSION*/bin/python$CARD_PYTHON_VERSION \
                   /usr/bin/python$CARD_PYTHON_VERSION /usr/local/bin/python$CARD_PYTHON_VERSION; do
    if runs_python "$candidate"; then echo "$candidate"; return; fi
  done
  echo "check_card_versions: no Python $CARD_PYTHON_VERSION here (the box's); using python3" >&2
  echo python3
}

# What the environment must hold; a change to any of it rebuilds the environment.
dependency_pins() {
  # The project's dependencies and the extras these tests need (bench: the plots test's matplotlib), the
  # runner (pytest, pytest-timeout) and the references the kernel tests compare against, by name only:
  # their versions come from the constraints.
  "$1" - <<'EOF'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
deps = list(project["dependencies"]) + list(project["optional-dependencies"]["bench"])
deps += ["pytest", "pytest-timeout", "transformers", "peft"]
print("\n".join(d for d in deps if not d.replace(" ", "").startswith(("torch>", "torch=", "triton"))))
EOF
}

project_constraints() {
  # The .venv's versions of everything but torch, triton and the project itself (torch 2.11.0's CUDA
  # wheels follow its own pins; the CPU build in .venv has none). Without a .venv, pyproject's ranges alone.
  [ -x .venv/bin/python ] || return 0
  .venv/bin/python -m pip freeze --disable-pip-version-check 2>/dev/null \
    | grep -viE '^(torch|triton|orpheus-serve)==|^-e |@ ' || true
}

if [ "${CARD_OFFLINE:-0}" = 1 ]; then
  [ -x "$VENV/bin/python" ] || { echo "check_card_versions: CARD_OFFLINE=1 and no environment at $VENV" >&2; exit 1; }
else
  PY=$(pick_python)
  if [ -x "$VENV/bin/python" ] && [ "$("$VENV/bin/python" -c 'import sys; print(sys.version_info[:2])')" \
       != "$("$PY" -c 'import sys; print(sys.version_info[:2])')" ]; then
    echo "=== $VENV has another Python than $PY: rebuilding it"
    rm -rf "$VENV"
  fi
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  mkdir -p "$VENV/card"
  project_constraints > "$VENV/card/constraints.txt"
  dependency_pins "$VENV/bin/python" > "$VENV/card/requirements.txt"
  want=$(cat <(echo "torch==$CARD_TORCH triton==$CARD_TRITON") "$VENV/card/constraints.txt" \
         "$VENV/card/requirements.txt" | sha256sum | cut -d' ' -f1)
  if [ "$(cat "$VENV/card/installed" 2>/dev/null || true)" != "$want" ]; then
    echo "=== installing torch $CARD_TORCH, triton $CARD_TRITON and the project's dependencies into $VENV"
    pip_install() { "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@"; }
    pip_install --upgrade pip
    # torch first: its CUDA wheels are the big download, and the rest must then keep it.
    pip_install "torch==$CARD_TORCH" "triton==$CARD_TRITON"
    pip_install -c "$VENV/card/constraints.txt" "torch==$CARD_TORCH" "triton==$CARD_TRITON" \
      -r "$VENV/card/requirements.txt"
    echo "$want" > "$VENV/card/installed"
  fi
fi
VPY=$VENV/bin/python

echo "=== versions"
# The box's are the ones the gate compares with; a mismatch is a failure, not a warning.
"$VPY" - "$CARD_TORCH" "$CARD_TRITON" "$CARD_PYTHON_VERSION" <<'EOF'
import platform, sys
import numpy, torch, triton
want_torch, want_triton, want_python = sys.argv[1:]
print(f"python {platform.python_version()} (box: {want_python}.x)")
print(f"torch {torch.__version__} (CUDA build {torch.version.cuda}; CUDA available here: {torch.cuda.is_available()})")
print(f"triton {triton.__version__}")
print(f"numpy {numpy.__version__}")
if torch.__version__.split("+")[0] != want_torch or triton.__version__ != want_triton:
    sys.exit(f"check_card_versions: torch {torch.__version__} / triton {triton.__version__}, "
             f"not the card's {want_torch} / {want_triton}")
if platform.python_version().rsplit(".", 1)[0] != want_python:
    print(f"DIFFERS FROM THE BOX: Python {platform.python_version()} here, {want_python} there")
EOF
if [ -x .venv/bin/python ]; then
  echo "the project's .venv (the CI lane): $(.venv/bin/python -c 'import sys, torch, triton; print(f"python {sys.version.split()[0]}, torch {torch.__version__}, triton {triton.__version__}")' 2>/dev/null || echo unreadable)"
fi

# Each part runs to its end, so one run reports every failure; the exit status is the first failure's.
unset TRITON_INTERPRET PYTHONPATH
failed=()
part() {
  local name=$1; shift
  echo "=== $name: $*"
  if "$VPY" -m pytest -q -p no:cacheprovider "$@"; then echo "=== $name: passed"
  else echo "=== $name: FAILED"; failed+=("$name"); fi
}
part gate tests/test_gpu_kit.py
part gpukit -m gpukit tests/test_gpu_kit.py
if [ "$ALL" -eq 1 ]; then
  part kernels "${KERNEL_TESTS[@]}"
fi

if [ ${#failed[@]} -gt 0 ]; then
  echo "check_card_versions: FAILED under torch $CARD_TORCH / triton $CARD_TRITON: ${failed[*]}" >&2
  exit 1
fi
echo "check_card_versions: passed under torch $CARD_TORCH / triton $CARD_TRITON"
