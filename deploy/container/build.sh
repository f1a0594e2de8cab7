#!/usr/bin/env bash
# `make image`: builds the Dockerfile with podman into IMAGE (default localhost/pagoda:latest).
#
# Where no image registry can be reached (these sandboxes), the base image the Dockerfile
# names is made locally: Debian's minbase bookworm by debootstrap, imported with
# `podman import` under that name. The build runs with the host's network and, where the
# machine has them, its pip setup mounted in: the CA bundle pip trusts and the local wheel
# folder that holds torch's CPU build (/opt/wheels here); elsewhere torch comes from
# PyTorch's CPU index, as the Dockerfile says. `--isolation chroot`: these sandboxes allow
# no other.
set -euo pipefail
cd "$(dirname "$0")/../.."
IMAGE=${IMAGE:-localhost/pagoda:latest}
BASE=docker.io/library/debian:bookworm-slim
scratch=()
trap 'rm -rf "${scratch[@]}"' EXIT

if ! podman image exists "$BASE"; then
    if ! podman pull -q "$BASE" >/dev/null 2>&1; then
        echo "no registry for $BASE: making it with debootstrap (Debian bookworm, minbase)"
        root=$(mktemp -d)
        scratch+=("$root")
        debootstrap --variant=minbase bookworm "$root" http://deb.debian.org/debian >/dev/null
        tar -C "$root" -c . | podman import - "$BASE" >/dev/null
    fi
fi

args=(--isolation chroot --network host --format docker -t "$IMAGE")
cert=${PIP_CERT:-}
[ -z "$cert" ] && [ -f /etc/ssl/certs/ca-certificates.crt ] && cert=/etc/ssl/certs/ca-certificates.crt
pip_args=""
if [ -n "$cert" ]; then
    args+=(-v "$cert:/run/pagoda-build/ca.crt:ro")
    pip_args+=" --cert /run/pagoda-build/ca.crt"
fi
if ls /opt/wheels/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
    args+=(-v /opt/wheels:/opt/wheels:ro --build-arg TORCH_INDEX_URL=)
    pip_args+=" --find-links /opt/wheels"
fi
# The checkout's own kernels, where make install built them (the same sources, Python 3.11 and
# torch 2.13.0 as the image's): mounted in and copied instead of compiled again (2 minutes on 2
# cores); the image compiles its own where they do not load there.
if [ -f .venv/.installed ] && [ -z "${NO_PREBUILT_KERNELS:-}" ]; then
    kernels=$(mktemp -d)
    scratch+=("$kernels")
    if .venv/bin/python -m pagoda.ops.cpu_kernels --install "$kernels" >/dev/null 2>&1; then
        args+=(-v "$kernels:/run/pagoda-build/kernels:ro" --build-arg KERNELS_FROM=/run/pagoda-build/kernels)
    fi
fi
podman build "${args[@]}" --build-arg PIP_ARGS="$pip_args" .
