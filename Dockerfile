# syntax=docker/dockerfile:1
# orpheus-serve: HTTP + WebSocket on 8000, gRPC on 50051 (README "Run in a container").
#
# GPU (the default base: PyTorch's CUDA runtime image; pip keeps its torch when it is the pinned release,
# and replaces it with PyPI's CUDA build of the pin otherwise):
#   docker build -t orpheus-serve:0.1.0-gpu .
# CPU (any Debian/Python base; put the CPU torch wheel in docker/wheels/ first, see docker/wheels/README.md):
#   docker build -t orpheus-serve:0.1.0-cpu --build-arg BASE_IMAGE=python:3.11-slim-bookworm .
# Ray Serve / KubeRay (deploy/kuberay/rayservice.yaml; not built in this repository's tests):
#   docker build -t orpheus-serve:0.1.0-ray2.60.0-gpu --build-arg BASE_IMAGE=rayproject/ray:2.60.0-py311-gpu \
#       --build-arg EXTRAS=ray .
# TensorRT-LLM (docs/TENSORRT.md, option B in an image; needs NVIDIA's index and its own torch; not built
# in this repository's tests):
#   docker build -t orpheus-serve:0.1.0-trtllm --build-arg BASE_IMAGE=nvidia/cuda:13.0.2-cudnn-runtime-ubuntu24.04 \
#       --build-arg APT_PACKAGES="python3 python3-pip python3-venv libopenmpi-dev" --build-arg TORCH_VERSION=2.9.1 \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130 --build-arg EXTRAS=tensorrt \
#       --build-arg PIP_EXTRA_INDEX_URL=https://pypi.nvidia.com .
#
# Models: mount real weights at /models (/models/orpheus, /models/snac_24khz; a TensorRT engine at
# /models/engines/orpheus-fp8). Without them the server serves the tiny random-weight models built into
# the image and says so in its log and in /v1/models, as scripts/serve.sh does.
ARG BASE_IMAGE=pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime
FROM ${BASE_IMAGE}
# Installing needs root (some bases, Ray's among them, end as another user); the server runs as 10001 below.
USER root

# The pin of scripts/setup.sh (tests/test_container_files.py keeps the two equal); empty: the base's torch.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=
# Extras of pyproject.toml to install with the package: "ray", "tensorrt" (comma-separated).
ARG EXTRAS=
ARG PIP_EXTRA_INDEX_URL=
# System packages for bases that lack Python (apt-get bases only).
ARG APT_PACKAGES=

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN if [ -n "$APT_PACKAGES" ]; then \
      apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $APT_PACKAGES \
      && rm -rf /var/lib/apt/lists/*; \
    fi

# The image is the environment: the package goes into the base's own Python (PIP_BREAK_SYSTEM_PACKAGES
# lets pip do that on a Debian base), so that a base's torch (PyTorch's image) or ray (Ray's image, whose
# `ray start` KubeRay runs) is the one the server imports. The wheel folder is bound, not copied: no layer
# keeps the CPU wheel.
COPY docker/install_torch.sh /usr/local/lib/orpheus-serve/install_torch.sh
RUN --mount=type=bind,source=docker/wheels,target=/wheels \
    PIP_BREAK_SYSTEM_PACKAGES=1 TORCH_VERSION="$TORCH_VERSION" TORCH_INDEX_URL="$TORCH_INDEX_URL" \
    sh /usr/local/lib/orpheus-serve/install_torch.sh

# Installed editable from /app, as scripts/setup.sh does: the server finds config/ and models/ beside its
# sources, so /app is laid out like a checkout.
WORKDIR /app
COPY pyproject.toml README.md production_server.py build_engine.py client.py benchmark.py ./
COPY src/ src/
COPY config/ config/
COPY scripts/ scripts/
COPY docker/healthcheck.py docker/healthcheck.py
RUN PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install ${PIP_EXTRA_INDEX_URL:+--extra-index-url "$PIP_EXTRA_INDEX_URL"} \
        -e "/app${EXTRAS:+[$EXTRAS]}" \
    && python3 -c "import orpheus_serve.api.server" \
    && python3 -m compileall -q /app/src  # uid 10001 cannot write bytecode beside the sources at run time

# The tiny random-weight models, written once here so that a container without /models starts at once and
# needs no writable file system (they are what the server falls back to: models.ensure_tiny_models).
RUN python3 scripts/make_tiny_models.py --out /app/models && chmod -R a+rX /app/models

# Non-root. Its home holds caches (torch, Hugging Face) when the root file system is writable.
RUN (groupadd --gid 10001 orpheus && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/orpheus \
        --shell /usr/sbin/nologin orpheus) \
    && mkdir -p /models && chmod 0755 /models
USER 10001:10001
ENV HOME=/home/orpheus \
    ORPHEUS_SERVE__ENGINE__MODEL_PATH=/models/orpheus \
    ORPHEUS_SERVE__CODEC__PATH=/models/snac_24khz \
    ORPHEUS_SERVE__ENGINE__TENSORRT__ENGINE_DIR=/models/engines/orpheus-fp8 \
    ORPHEUS_SERVE__SERVER__HOST=0.0.0.0 \
    ORPHEUS_SERVE__SERVER__HTTP_PORT=8000 \
    ORPHEUS_SERVE__SERVER__GRPC_PORT=50051
EXPOSE 8000 50051

# /ready, on the port the server listens on (docker/healthcheck.py). The start period covers model loading
# and warm-up (minutes for the 3B model on a cold disk).
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 CMD ["python3", "/app/docker/healthcheck.py"]

# SIGTERM (docker stop, Kubernetes) drains: no new requests, /ready 503, open streams run to their end within
# server.shutdown_grace_s (10 s), then exit 0. Give the container longer than that to stop
# (docker run --stop-timeout 30; compose's stop_grace_period; Kubernetes' terminationGracePeriodSeconds).
STOPSIGNAL SIGTERM
ENTRYPOINT ["python3", "/app/production_server.py"]
CMD []
