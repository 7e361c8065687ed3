#!/usr/bin/env bash
# The macOS and Windows builds, checked on a Linux machine: `cargo clippy --workspace
# --all-targets -- -D warnings` for aarch64-apple-darwin and x86_64-pc-windows-gnu. Compiled
# and linted only: nothing is linked or run for those targets here (no Apple SDK, no Windows);
# the Linux suite and .ci/neon.sh run the code.
#
# Installs what is missing: the rustup targets (rust-std for each), and apt `clang` (ring, under
# rustls under the `download` subcommand's HTTP client, compiles C in its build script even
# for `cargo check`; clang cross-compiles it for both targets). ring's C needs only a handful of
# libc declarations, and the SDK headers for them are not on a Linux machine: the script writes
# stand-ins for `TargetConditionals.h`, `assert.h` and `string.h` into a temporary directory
# and compiles with `-ffreestanding -nostdlibinc` against them. Those objects are never
# linked; a real macOS or Windows build uses the platform's own compiler and headers.
#
# If a target or clang cannot be installed (no network to the rustup server, no apt, no root)
# it prints `SKIPPED: <reason>` and exits 0, unless K3_CROSS_REQUIRED=1 (then exit 1). Once the
# tools are there, any compile error or lint fails the script. Builds land in target/<triple>/.
set -euo pipefail
cd "$(dirname "$0")/.."

TARGETS=(aarch64-apple-darwin x86_64-pc-windows-gnu)

skip() {
    echo "cross: SKIPPED: $*"
    if [ "${K3_CROSS_REQUIRED:-0}" = 1 ]; then exit 1; fi
    exit 0
}

start=$(date +%s)
command -v rustup >/dev/null || skip "no rustup to add the ${TARGETS[*]} standard libraries"
for t in "${TARGETS[@]}"; do
    if ! rustup target list --installed | grep -qx "$t"; then
        echo "cross: rustup target add $t"
        log=$(mktemp)
        if ! timeout 600 rustup target add "$t" >"$log" 2>&1; then
            why=$(grep -m1 -E '^error' "$log" || tail -1 "$log")
            rm -f "$log"
            skip "rustup target add $t failed (the rustup server is not reachable from here?): $why"
        fi
        rm -f "$log"
    fi
done

if ! command -v clang >/dev/null; then
    command -v apt-get >/dev/null || skip "clang missing (ring's C for the foreign targets) and no apt-get to install it"
    SUDO=()
    if [ "$(id -u)" -ne 0 ]; then
        sudo -n true 2>/dev/null || skip "clang missing; installing it needs root or passwordless sudo"
        SUDO=(sudo -n)
    fi
    echo "cross: installing clang (apt)"
    export DEBIAN_FRONTEND=noninteractive
    apt_opts=(-o DPkg::Lock::Timeout=300 -o Acquire::Retries=2 -o Acquire::http::Timeout=30)
    log=$(mktemp)
    timeout 300 "${SUDO[@]}" apt-get "${apt_opts[@]}" -q update >"$log" 2>&1 || true
    if ! timeout 600 "${SUDO[@]}" apt-get "${apt_opts[@]}" -q install -y --no-install-recommends clang >>"$log" 2>&1; then
        why=$(grep -m1 -E 'Failed to fetch|Could not|Unable to|^E: ' "$log" || true)
        rm -f "$log"
        skip "apt-get install clang failed: $why"
    fi
    rm -f "$log"
fi

inc=$(mktemp -d)
trap 'rm -rf "$inc"' EXIT
cat >"$inc/TargetConditionals.h" <<'EOF'
#pragma once
#define TARGET_OS_MAC 1
#define TARGET_OS_OSX 1
#define TARGET_OS_IPHONE 0
#define TARGET_OS_IOS 0
#define TARGET_OS_WATCH 0
#define TARGET_OS_TV 0
#define TARGET_OS_SIMULATOR 0
EOF
cat >"$inc/assert.h" <<'EOF'
#pragma once
#define assert(x) ((void)0)
EOF
cat >"$inc/string.h" <<'EOF'
#pragma once
#include <stddef.h>
void *memcpy(void *, const void *, size_t);
void *memmove(void *, const void *, size_t);
void *memset(void *, int, size_t);
int memcmp(const void *, const void *, size_t);
EOF
flags="-ffreestanding -nostdlibinc -I$inc"
export CC_aarch64_apple_darwin=clang CFLAGS_aarch64_apple_darwin="$flags"
export CC_x86_64_pc_windows_gnu=clang CFLAGS_x86_64_pc_windows_gnu="--target=x86_64-pc-windows-gnu $flags"

for t in "${TARGETS[@]}"; do
    t0=$(date +%s)
    echo "cross: cargo clippy --workspace --all-targets --target $t -- -D warnings"
    if ! cargo clippy --workspace --all-targets --target "$t" -- -D warnings; then
        echo "cross: FAILED: $t does not compile or lint clean"
        exit 1
    fi
    echo "cross: $t clean in $(($(date +%s) - t0)) s"
done
echo "cross: PASSED: ${TARGETS[*]} compile and lint clean (not linked, not run) in $(($(date +%s) - start)) s"
