#!/usr/bin/env bash
# Download, here, the wheels a bare GPU box lacks to run the kit's stages (scripts/gpu/run.sh).
#
#   bash scripts/gpu/prepare.sh            # -> .whl/ (git-ignored), checked to stay under the size limit
#   WHL_DIR=/tmp/w WHL_PYTHON=3.11 bash scripts/gpu/prepare.sh   # the same set for another Python (tests)
#
# The GPU box has Python 3.12 with PyTorch (CUDA), transformers, numpy, pyyaml, httpx, safetensors,
# tokenizers, huggingface-hub, prometheus-client and more (scripts/gpu/box-packages.txt), and no
# network: whatever else the stages import travels in .whl/ with the working tree (64 MiB per call
# in all, tree included). Every wheel is pinned and downloaded with --no-deps, so each dependency is
# named here, at the version the project's own environment is tested with (tests/test_gpu_kit.py
# installs exactly this set into an environment holding only the box's packages and imports every
# module the serve and check stages import). Some of these the box has in some version, but ones the
# project has not been tested with: they travel so that the box runs what the tests ran:
#   grpcio, protobuf   the committed gRPC stubs and Riva's messages were generated with protobuf 6.x
#                      (6.33.5 exactly for nvidia-riva-client); protobuf 7 must not be picked up
#   msgpack, pyzmq     the serve stage runs the engine core in its own process (server.engine_process)
#   pytest & plugins   the check stage; pytest-timeout because pyproject's `timeout` setting needs it
#   httpx, httpcore    in step with the h11 that uvicorn needs
# PyAV (mp3/opus/aac/flac) is left out: the stages stream PCM only, and audio/encoding.py refuses the other
# formats with a clear error naming PyAV.
set -euo pipefail
cd "$(dirname "$0")/../.."

DEST=${WHL_DIR:-.whl}
LIMIT_MIB=${WHL_LIMIT_MIB:-40}
PY_VERSION=${WHL_PYTHON:-3.12}
ABI=cp${PY_VERSION/./}
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}

# name==version, one per line: kept in step with the project's tested environment.
REQUIRED=(
  # HTTP / WebSocket gateway
  fastapi==0.165.0
  starlette==1.10.0
  annotated-doc==0.0.7
  opentelemetry-api==1.45.2
  pydantic==2.14.4
  pydantic-core==2.50.5
  annotated-types==0.8.0
  typing-inspection==0.4.5
  typing-extensions==4.16.0
  anyio==4.16.0
  uvicorn==0.54.0
  h11==0.16.0
  click==8.5.1
  websockets==15.0.1
  # the benchmark client and the readiness probe; the box has some httpx, but h11 0.16 above needs httpcore 1.0.9
  httpx==0.28.1
  httpcore==1.0.9
  # gRPC gateway and Riva's TTS API
  grpcio==1.85.3
  grpcio-health-checking==1.81.1
  protobuf==6.33.5
  nvidia-riva-client==2.27.0
  # engine core in its own process
  pyzmq==27.3.0
  msgpack==1.2.4
  # codec
  snac==1.2.1
  einops==0.8.2
  # check stage: pytest -m gpu
  pytest==9.2.0
  pluggy==1.7.0
  iniconfig==2.3.1
  pygments==2.21.0
  packaging==26.4
  pytest-timeout==2.4.0
)

PLATFORMS=()
for n in 17 24 26 27 28 31 34; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)

size_kib() { du -sk "$DEST" | cut -f1; }

mkdir -p "$DEST"
# Wheels of another version of a pinned name would make two copies travel (and stop the install): start clean.
find "$DEST" -maxdepth 1 -name '*.whl' -delete
"$PYTHON" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version "$PY_VERSION" --implementation cp --abi "$ABI" --abi abi3 --abi none "${PLATFORMS[@]}" \
  -d "$DEST" "${REQUIRED[@]}" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)

count=$(find "$DEST" -maxdepth 1 -type f -name '*.whl' | wc -l)
if [ "$count" -ne "${#REQUIRED[@]}" ]; then
  echo "prepare: $count wheels in $DEST for ${#REQUIRED[@]} pinned packages" >&2
  exit 1
fi
kib=$(size_kib)
if [ "$kib" -gt $((LIMIT_MIB * 1024)) ]; then
  echo "prepare: $DEST is $((kib / 1024)) MiB, over the ${LIMIT_MIB} MiB limit" >&2
  exit 1
fi
echo "prepare: $count wheels in $DEST for Python $PY_VERSION, $((kib / 1024)) MiB ($kib KiB)"
