#!/usr/bin/env bash
# Runs the k3-kernels test suite on aarch64 (NEON path + committed golden bits) under
# qemu-user, from an x86-64 Debian/Ubuntu machine. Installs what is missing:
#   apt: gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user; rustup: aarch64 std.
# The linker and runner come from .cargo/config.toml ([target.aarch64-unknown-linux-gnu]).
# Extra arguments go to `cargo test` (e.g. `--release`, `--test golden`).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v aarch64-linux-gnu-gcc >/dev/null || ! command -v qemu-aarch64 >/dev/null \
    || [ ! -d /usr/aarch64-linux-gnu/lib ]; then
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; fi
    $SUDO apt-get update
    $SUDO apt-get install -y gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user
fi
if ! rustup target list --installed | grep -qx aarch64-unknown-linux-gnu; then
    rustup target add aarch64-unknown-linux-gnu
fi

cargo test -p k3-kernels --target aarch64-unknown-linux-gnu "$@"
