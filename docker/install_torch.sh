#!/bin/sh
# torch for the image, before the package (as scripts/setup.sh does): the package itself only asks for
# torch>=2.9, so whatever is installed here is what the image serves with.
#   TORCH_VERSION  the pin (scripts/setup.sh's); empty: keep the base image's own torch (TensorRT-LLM's container)
#   TORCH_INDEX_URL  where pip looks for it (e.g. https://download.pytorch.org/whl/cu130); empty: PyPI
#   /wheels/torch-*.whl  a wheel from the build context (docker/wheels/, bound at /wheels; WHEEL_DIR moves
#                        it): the CPU build uses this machine's CPU wheel, so it never downloads a CUDA torch
# Ends by printing the torch the image has, and fails if it is not the pinned release.
set -eu
PYTHON=${PYTHON:-python3}
installed() { "$PYTHON" -c "import torch; print(torch.__version__)" 2>/dev/null || true; }

if [ -z "${TORCH_VERSION:-}" ]; then
  have=$(installed)
  [ -n "$have" ] || { echo "TORCH_VERSION is empty and the base image has no torch" >&2; exit 1; }
  echo "keeping the base image's torch $have"
  exit 0
fi

wheel=$(ls "${WHEEL_DIR:-/wheels}"/torch-*.whl 2>/dev/null | head -n 1 || true)
if [ -n "$wheel" ]; then
  case "$(basename "$wheel")" in
    "torch-$TORCH_VERSION-"*|"torch-$TORCH_VERSION+"*) ;;
    *) echo "$wheel is not torch $TORCH_VERSION (scripts/setup.sh's pin)" >&2; exit 1 ;;
  esac
  "$PYTHON" -m pip install "$wheel"
elif [ "$(installed | cut -d+ -f1)" = "$TORCH_VERSION" ]; then
  echo "the base image already has torch $(installed)"
else
  if [ -n "${TORCH_INDEX_URL:-}" ]; then
    "$PYTHON" -m pip install "torch==$TORCH_VERSION" --index-url "$TORCH_INDEX_URL"
  else
    "$PYTHON" -m pip install "torch==$TORCH_VERSION"
  fi
fi

have=$(installed)
[ "${have%%+*}" = "$TORCH_VERSION" ] || { echo "torch $have installed, $TORCH_VERSION wanted" >&2; exit 1; }
echo "torch $have"
