#!/usr/bin/env bash
# Builds the berth image without pulling anything from an image registry:
# both base images come from Debian's packages (debootstrap), the build base
# also carries the Rust toolchain of this machine (rustup's, as the project
# builds with). Needs root (debootstrap), debootstrap, and podman or docker
# with a running engine.
set -euo pipefail
cd "$(dirname "$0")/../.."
engine=${ENGINE:-$(command -v podman || command -v docker || true)}
[ -n "$engine" ] || { echo "build.sh: neither podman nor docker is installed" >&2; exit 1; }
suite=${SUITE:-bookworm}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

base() { # name, extra packages
  debootstrap --variant=minbase --include="$2" "$suite" "$work/$1" >/dev/null
  tar -C "$work/$1" -c . | "$engine" import - "localhost/$1:$suite"
}
base berth-runtime-base "ca-certificates,python3,python3-pip,passwd"
base berth-build-base "ca-certificates,gcc,libc6-dev,make,pkg-config,python3,python3-pip"
# The toolchain: the same rustc and cargo as this machine's.
rustup_home=${RUSTUP_HOME:-$HOME/.rustup}
cargo_home=${CARGO_HOME:-$HOME/.cargo}
cat > "$work/Containerfile.toolchain" <<TOOLCHAIN
FROM localhost/berth-build-base:$suite
COPY rustup /opt/rustup
COPY cargo /opt/cargo
ENV RUSTUP_HOME=/opt/rustup CARGO_HOME=/opt/cargo PATH=/opt/cargo/bin:/usr/bin:/bin
TOOLCHAIN
mkdir -p "$work/ctx" && cp -a "$rustup_home" "$work/ctx/rustup" && cp -a "$cargo_home" "$work/ctx/cargo"
"$engine" build -f "$work/Containerfile.toolchain" -t "localhost/berth-build-base:$suite" "$work/ctx"
"$engine" build -f deploy/container/Containerfile -t berth .
echo "built image berth"
