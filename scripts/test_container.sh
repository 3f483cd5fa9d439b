#!/usr/bin/env bash
# Build the CPU image from the Dockerfile and run it for real (README "Run in a container").
#
#   bash scripts/test_container.sh
#
# Opt-in, not part of scripts/test.sh (CI): about 15 minutes on 2 cores, most of it the image build. Needs
# root, podman and debootstrap (apt-get install podman debootstrap), a Debian mirror and PyPI. No Docker
# daemon and no registry: the base image is made here, and the built image runs without `podman run`.
#
#  1. base   debootstrap a minimal Debian with python3 -> `podman import` -> localhost/orpheus-serve-base
#            (it trusts this machine's CA bundle, so pip works behind a TLS-inspecting proxy)
#  2. wheel  this machine's CPU torch wheel (the pin of scripts/setup.sh) into docker/wheels/
#  3. build  `podman build --isolation chroot` of the Dockerfile FROM that base
#  4. start  the image's files (`podman image mount`) run by chroot, with /proc, /dev and /tmp bound, as the
#            image's USER, in its WORKDIR, with its ENV and ENTRYPOINT, on the host network; waits for /ready
#  5. serve  the image's HEALTHCHECK command, a REST speech request, gRPC Synthesize and gRPC health
#  6. drain  SIGTERM during a WebSocket and a gRPC stream (sized to the measured speed): /ready 503, both streams
#            end whole, exit code 0
# The checks (scripts/container_check.py) run inside the image too, with its Python and packages.
#
# Everything lives in a work folder under /tmp, with a podman store of its own (nothing is added to the
# machine's images); mounts are undone and the folder removed at the end, also on failure.
# KEEP_WORK=1 keeps the folder (images included) for a look; DEBIAN_MIRROR picks the mirror.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

SUITE=bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
BASE_IMAGE=localhost/orpheus-serve-base:$SUITE
IMAGE=localhost/orpheus-serve:0.1.0-cpu
HOST_CA_BUNDLE=${HOST_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}

[ "$(id -u)" = 0 ] || { echo "run as root (debootstrap, chroot, mounts)" >&2; exit 2; }
for tool in podman debootstrap chroot mount; do
  command -v "$tool" >/dev/null || { echo "needs $tool (apt-get install podman debootstrap)" >&2; exit 2; }
done

WORK=$(mktemp -d /tmp/orpheus-container-test.XXXXXX)
PODMAN=(podman --root "$WORK/storage" --runroot "$WORK/run")
MNT=""
SERVER_PID=""
T0=$(date +%s.%N)
PHASE_T0=$T0
TIMES=()

elapsed() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }
phase() {  # phase NAME: the previous phase ends, NAME begins
  if [ -n "${PHASE:-}" ]; then
    TIMES+=("$(printf '%-6s %7ss' "$PHASE" "$(elapsed "$PHASE_T0")")")
    echo "--- $PHASE: $(elapsed "$PHASE_T0") s"
  fi
  PHASE=$1
  PHASE_T0=$(date +%s.%N)
  [ "$PHASE" = end ] || echo "=== $PHASE ($(date -u +%H:%M:%S))"
}

cleanup() {
  local status=$?
  set +e
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -KILL "$SERVER_PID"
    wait "$SERVER_PID" 2>/dev/null
  fi
  if [ -n "$MNT" ]; then
    for dir in tmp dev proc; do
      mountpoint -q "$MNT/$dir" && umount -R "$MNT/$dir"
    done
    "${PODMAN[@]}" image unmount "$IMAGE" >/dev/null
  fi
  if grep -q " $WORK" /proc/mounts; then
    echo "still mounted under $WORK:" >&2
    grep " $WORK" /proc/mounts >&2
    status=1
  elif [ "${KEEP_WORK:-0}" = 1 ]; then
    echo "kept $WORK (podman --root $WORK/storage --runroot $WORK/run images)"
  else
    local t0
    t0=$(date +%s.%N)
    rm -rf "$WORK"
    echo "removed $WORK in $(elapsed "$t0") s"
  fi
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

TORCH_PIN=$(grep -o 'torch==[0-9][0-9.]*' scripts/setup.sh | head -n 1 | cut -d= -f3)
[ -n "$TORCH_PIN" ] || { echo "no torch==X pin in scripts/setup.sh" >&2; exit 1; }

phase base
debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
  "$SUITE" "$WORK/rootfs" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 \
  || { tail -n 30 "$WORK/debootstrap.log" >&2; exit 1; }
# A TLS-inspecting proxy's CA lives in this machine's bundle only; pip in the build must trust it too.
cp "$HOST_CA_BUNDLE" "$WORK/rootfs/etc/ssl/certs/ca-certificates.crt"
tar -C "$WORK/rootfs" -c . | "${PODMAN[@]}" import \
  --change "ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt" \
  --change "ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt" - "$BASE_IMAGE" >/dev/null
rm -rf "$WORK/rootfs"
"${PODMAN[@]}" image inspect --format '{{.Id}} {{.Size}} bytes' "$BASE_IMAGE"

phase wheel
# The CPU build of the pinned torch: from a local wheel cache (pip's find-links) when there is one,
# otherwise PyTorch's CPU index. Never PyPI's default build, which is the CUDA one.
PY=${PYTHON:-python3}
if ! ls docker/wheels/torch-"$TORCH_PIN"+cpu-*.whl >/dev/null 2>&1; then
  rm -f docker/wheels/torch-*.whl
  "$PY" -m pip download -q --no-deps --no-index -d docker/wheels "torch==$TORCH_PIN" 2>/dev/null \
    || "$PY" -m pip download -q --no-deps -d docker/wheels "torch==$TORCH_PIN" \
         --index-url https://download.pytorch.org/whl/cpu
fi
ls docker/wheels/torch-"$TORCH_PIN"+cpu-*.whl \
  || { echo "no CPU build of torch $TORCH_PIN in docker/wheels/" >&2; exit 1; }

phase build
"${PODMAN[@]}" build --isolation chroot --format docker --network host \
  --build-arg BASE_IMAGE="$BASE_IMAGE" -t "$IMAGE" . >"$WORK/build.log" 2>&1 \
  || { tail -n 40 "$WORK/build.log" >&2; exit 1; }
grep -E '^(Successfully installed|torch )' "$WORK/build.log" | cut -c1-300
"${PODMAN[@]}" image inspect --format '{{.Id}} {{.Size}} bytes' "$IMAGE"

phase start
inspect() { "${PODMAN[@]}" image inspect --format "$1" "$IMAGE"; }
lines() { sed '/^$/d'; }
mapfile -t IMAGE_ENV < <(inspect '{{range .Config.Env}}{{println .}}{{end}}' | lines)
mapfile -t ENTRYPOINT < <(inspect '{{range .Config.Entrypoint}}{{println .}}{{end}}' | lines)
mapfile -t CMD < <(inspect '{{range .Config.Cmd}}{{println .}}{{end}}' | lines)
WORKDIR=$(inspect '{{.Config.WorkingDir}}')
USER_SPEC=$(inspect '{{.Config.User}}')
HEALTHCHECK=$("${PODMAN[@]}" inspect --type image --format '{{json .Config.Healthcheck}}' "$IMAGE")
echo "user $USER_SPEC, workdir $WORKDIR, entrypoint ${ENTRYPOINT[*]} ${CMD[*]:-}"
echo "healthcheck $HEALTHCHECK"
[ -n "$USER_SPEC" ] && [ "${USER_SPEC%%:*}" != 0 ] && [ "${USER_SPEC%%:*}" != root ] \
  || { echo "the image's USER is root or unset: $USER_SPEC" >&2; exit 1; }

MNT=$("${PODMAN[@]}" image mount "$IMAGE")
mount --bind /proc "$MNT/proc"
mount --rbind /dev "$MNT/dev"
mount --bind /tmp "$MNT/tmp"

# "${IN_IMAGE[@]}" ARGS...: run ARGS in the image as its USER, in its WORKDIR, with its ENV (and ports that are free
# on this shared machine, through the server's own settings, which the HEALTHCHECK reads too).
# Each step execs the next, so the server's pid is the one started here.
in_image_prefix() {
  IN_IMAGE=(chroot --userspec="$USER_SPEC" "$MNT" /usr/bin/env -i "${IMAGE_ENV[@]}" "$@"
            /bin/sh -c 'cd "$0" && exec "$@"' "$WORKDIR")
}
check() { "${IN_IMAGE[@]}" python3 - "$@" <scripts/container_check.py; }
in_image_prefix
read -r HTTP_PORT GRPC_PORT < <(check free-ports)
# admission=slots: the drain's two streams start together, not one after the other while the server
# measures its capacity (a fresh server admits by what it has measured). The drain keeps the image's
# server.shutdown_grace_s (10 s); its streams are sized from the server's speed measured just before
# (container_check.py drain), so that they need at most half of that window on a slow or busy machine too.
in_image_prefix "ORPHEUS_SERVE__SERVER__HTTP_PORT=$HTTP_PORT" "ORPHEUS_SERVE__SERVER__GRPC_PORT=$GRPC_PORT" \
  "ORPHEUS_SERVE__SCHEDULER__ADMISSION=slots"
[ -n "${GRPC_PORT:-}" ] || { echo "no free ports (is python3 in the image?)" >&2; exit 1; }
URL=http://127.0.0.1:$HTTP_PORT
GRPC=127.0.0.1:$GRPC_PORT
echo "ports: HTTP $HTTP_PORT, gRPC $GRPC_PORT"

check unhealthy --healthcheck "$HEALTHCHECK"

"${IN_IMAGE[@]}" "${ENTRYPOINT[@]}" "${CMD[@]}" >"$WORK/server.log" 2>&1 &
SERVER_PID=$!
check ready --url "$URL" --server-pid "$SERVER_PID" --timeout-s 300 || { tail -n 40 "$WORK/server.log" >&2; exit 1; }
grep -q "USING TINY RANDOM-WEIGHT MODELS" "$WORK/server.log" \
  || { echo "the server did not say it serves the tiny models" >&2; exit 1; }
echo "  ok  the log says: $(grep -m1 -o 'USING TINY RANDOM-WEIGHT MODELS: [^.]*' "$WORK/server.log")"

phase serve
check serve --url "$URL" --grpc "$GRPC" --server-pid "$SERVER_PID" --healthcheck "$HEALTHCHECK" \
  || { tail -n 40 "$WORK/server.log" >&2; exit 1; }

phase drain
check drain --url "$URL" --grpc "$GRPC" --server-pid "$SERVER_PID" --healthcheck "$HEALTHCHECK" \
  || { tail -n 40 "$WORK/server.log" >&2; exit 1; }
status=0
wait "$SERVER_PID" || status=$?
SERVER_PID=""
[ "$status" = 0 ] || { echo "the server exited with $status after SIGTERM" >&2; tail -n 40 "$WORK/server.log" >&2; exit 1; }
echo "  ok  the server exited with code 0"
tail -n 3 "$WORK/server.log"

phase end
echo "=== times"
printf '%s\n' "${TIMES[@]}"
echo "total  $(elapsed "$T0")s"
echo "PASS: the CPU image builds, serves audio as uid ${USER_SPEC%%:*} and drains on SIGTERM"
