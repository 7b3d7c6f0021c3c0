#!/usr/bin/env bash
# Builds the berth image without pulling anything from an image registry:
# both base images come from Debian's packages (debootstrap), the build base
# also carries the Rust toolchain this machine builds with (only the active
# one, not every toolchain rustup has). Needs root (debootstrap),
# debootstrap, and podman or docker with a running engine.
#
# Settings (environment):
#   ENGINE      podman or docker (default: whichever is installed, podman first)
#   SUITE       Debian suite of both bases (default: bookworm)
#   RUNTIME     podman's OCI runtime (default: runc where the host's cgroups
#               are not unified v2, where crun refuses to run containers)
#   CA_BUNDLE   a CA file the build needs to reach the crate registry (a
#               TLS-intercepting proxy's); passed as a build secret, never
#               kept in the image. Default: $SSL_CERT_FILE when it is set.
#   IMAGE       the image's name (default: berth)
set -euo pipefail
cd "$(dirname "$0")/../.."
engine=${ENGINE:-$(command -v podman || command -v docker || true)}
[ -n "$engine" ] || { echo "build.sh: neither podman nor docker is installed" >&2; exit 1; }
suite=${SUITE:-bookworm}
image=${IMAGE:-berth}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# What each engine needs on a host like a CI VM: podman builds in Docker's
# format (the OCI format silently drops HEALTHCHECK); limits.sh picks the
# runtime and keeps the limits within the host's.
. deploy/container/limits.sh
build_flags=()
[ "$(basename "$engine")" != podman ] || build_flags+=(--format docker)
host_runtime build_flags
host_limits build_flags
ca_bundle=${CA_BUNDLE:-${SSL_CERT_FILE:-}}
[ -z "$ca_bundle" ] || [ ! -s "$ca_bundle" ] || build_flags+=(--secret "id=ca_bundle,src=$ca_bundle")

base() { # name, extra packages
  debootstrap --variant=minbase --include="$2" "$suite" "$work/$1" >/dev/null
  tar -C "$work/$1" -c . | "$engine" import - "localhost/$1:$suite"
}
base berth-runtime-base "ca-certificates,python3,python3-pip,passwd"
base berth-build-base "ca-certificates,gcc,libc6-dev,make,pkg-config,binutils"
# The toolchain: the same rustc and cargo as this machine's, the active
# toolchain alone (rustup's proxies are not needed inside).
rustup_home=${RUSTUP_HOME:-$HOME/.rustup}
toolchain=$(rustup show active-toolchain | awk '{print $1}')
[ -d "$rustup_home/toolchains/$toolchain" ] || { echo "build.sh: no toolchain $toolchain in $rustup_home" >&2; exit 1; }
cat > "$work/Containerfile.toolchain" <<TOOLCHAIN
FROM localhost/berth-build-base:$suite
COPY rust /opt/rust
ENV CARGO_HOME=/opt/cargo PATH=/opt/rust/bin:/usr/bin:/bin
TOOLCHAIN
mkdir -p "$work/ctx" && cp -a "$rustup_home/toolchains/$toolchain" "$work/ctx/rust"
rm -rf "$work/ctx/rust/share/doc"
"$engine" build "${build_flags[@]}" -f "$work/Containerfile.toolchain" -t "localhost/berth-build-base:$suite" "$work/ctx"
"$engine" build "${build_flags[@]}" -f deploy/container/Containerfile -t "$image" .
echo "built image $image"
