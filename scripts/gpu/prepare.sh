#!/usr/bin/env bash
# Download, here, the wheels a bare GPU box lacks to run the server and the benchmarks.
#
#   bash scripts/gpu/prepare.sh            # -> .whl/ (git-ignored), checked to stay under the size limit
#
# The GPU box has Python 3.12 with PyTorch (CUDA), transformers, grpcio, numpy, pyyaml, httpx,
# prometheus-client, safetensors and tokenizers, and no network; whatever else the project imports
# travels in .whl/ with the working tree (64 MiB per call in all, tree included). Every wheel is
# pinned and downloaded with --no-deps, so each dependency is named here: the versions are the ones
# the project's own environment is tested with. grpcio and protobuf travel too because the committed
# gRPC stubs need at least the versions that generated them, which the box's own may not be.
# av (PyAV: mp3/opus/aac/flac) is the largest; it is left out when the folder would pass the limit,
# and the box then serves pcm and wav at the model's rate only (audio/encoding.py refuses the rest with a
# clear error naming PyAV).
set -euo pipefail
cd "$(dirname "$0")/../.."

DEST=${WHL_DIR:-.whl}
LIMIT_MIB=${WHL_LIMIT_MIB:-60}
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}

# name==version, one per line (server: FastAPI + uvicorn + websockets + gRPC; codec: snac).
REQUIRED=(
  fastapi==0.165.0
  starlette==1.10.0
  annotated-doc==0.0.7
  opentelemetry-api==1.45.2
  pydantic==2.14.3
  pydantic-core==2.50.4
  annotated-types==0.8.0
  typing-inspection==0.4.5
  typing-extensions==4.16.0
  anyio==4.16.0
  sniffio==1.3.1
  uvicorn==0.54.0
  h11==0.16.0
  click==8.5.1
  websockets==17.4
  grpcio==1.85.1
  grpcio-health-checking==1.85.1
  protobuf==7.36.2
  snac==1.2.1
  einops==0.8.2
)
OPTIONAL=(av==18.1.0)

download() {
  "$PYTHON" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
    -d "$DEST" "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

size_kib() { du -sk "$DEST" | cut -f1; }

mkdir -p "$DEST"
# Wheels of another version of a pinned name would make two copies travel: start clean.
find "$DEST" -maxdepth 1 -name '*.whl' -delete
download "${REQUIRED[@]}"
for spec in "${OPTIONAL[@]}"; do
  download "$spec"
  if [ "$(size_kib)" -gt $((LIMIT_MIB * 1024)) ]; then
    name=${spec%%==*}
    find "$DEST" -maxdepth 1 -iname "${name}-*.whl" -delete
    echo "prepare: left out $spec (the folder would pass ${LIMIT_MIB} MiB): the box serves pcm and wav only" >&2
  fi
done

count=$(find "$DEST" -maxdepth 1 -type f -name '*.whl' | wc -l)
expected=$(( ${#REQUIRED[@]} ))
if [ "$count" -lt "$expected" ]; then
  echo "prepare: only $count wheels for ${expected} required packages" >&2
  exit 1
fi
kib=$(size_kib)
if [ "$kib" -gt $((LIMIT_MIB * 1024)) ]; then
  echo "prepare: $DEST is $((kib / 1024)) MiB, over the ${LIMIT_MIB} MiB limit" >&2
  exit 1
fi
echo "prepare: $count wheels in $DEST, $((kib / 1024)) MiB ($kib KiB)"
