#!/usr/bin/env bash
# Runs the k3-kernels test suite on aarch64 (NEON path + committed golden bits) under
# qemu-user, from an x86-64 Debian/Ubuntu machine (natively on an aarch64 one). Installs what
# is missing (apt: gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user; rustup: aarch64 std).
# The same script CI runs (.ci/neon.sh), except that by hand a missing toolchain that cannot
# be installed is an error, not a skip.
# Extra arguments go to `cargo test` (e.g. `--release`, `--test golden`).
set -euo pipefail
K3_NEON_REQUIRED=1 exec "$(dirname "$0")/../.ci/neon.sh" "$@"
