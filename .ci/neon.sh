#!/usr/bin/env bash
# The NEON paths of k3-kernels, checked on an x86-64 machine: cross-build the crate's tests for
# aarch64-unknown-linux-gnu and run them under qemu-user. Every test compares every available
# path with the scalar reference bit for bit (isa_equivalence.rs) and with the hex patterns
# committed on x86-64 (golden.rs), so a green run means NEON == scalar == x86-64 bits.
#
# Installs what is missing: apt `gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user`
# (root or passwordless sudo), rustup target `aarch64-unknown-linux-gnu`.
# If one of those cannot be installed (no apt/rustup, registry unreachable, no root) it prints
# `SKIPPED: <reason>` and exits 0, unless K3_NEON_REQUIRED=1 (then exit 1). If the tests build
# and run, any failure (compile error, test failure, NEON not among the compared paths,
# timeout after K3_NEON_TIMEOUT seconds, default 900) exits non-zero.
#
# Linker and runner are passed through CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_{LINKER,RUNNER};
# the build lands in target/aarch64-unknown-linux-gnu/ (override with CARGO_TARGET_DIR).
# Extra arguments go to `cargo test` (cargo options only, e.g. `--release`, `--test golden`).
# On an aarch64 host the tests run natively (no qemu, no cross linker).
set -euo pipefail
cd "$(dirname "$0")/.."

TRIPLE=aarch64-unknown-linux-gnu
SYSROOT=/usr/aarch64-linux-gnu
APT_PACKAGES=(gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user)
# Upper bound for the whole build + qemu run (the .ci/run total must stay well under 30 min).
TEST_TIMEOUT=${K3_NEON_TIMEOUT:-900}

skip() {
    echo "SKIPPED: $*"
    if [ "${K3_NEON_REQUIRED:-0}" = 1 ]; then exit 1; fi
    exit 0
}

start=$(date +%s)
host=$(uname -m)
runner=""
if [ "$host" != aarch64 ]; then
    [ "$host" = x86_64 ] || skip "host is $host (only x86_64 cross-runs or aarch64 native runs are set up)"
    [ "$(uname -s)" = Linux ] || skip "host OS is $(uname -s), qemu-user needs Linux"

    exe() { # path of an executable command, or nothing
        local p
        p=$(command -v "$1" 2>/dev/null) && [ -x "$p" ] && echo "$p"
        return 0
    }
    find_qemu() { exe qemu-aarch64; [ -n "$(exe qemu-aarch64)" ] || exe qemu-aarch64-static; }
    have_tools() {
        [ -n "$(exe aarch64-linux-gnu-gcc)" ] && [ -n "$(find_qemu)" ] \
            && [ -e "$SYSROOT/lib/libc.so.6" ] && [ -e "$SYSROOT/lib/ld-linux-aarch64.so.1" ]
    }
    if ! have_tools; then
        command -v apt-get >/dev/null || skip "aarch64 linker/qemu missing and no apt-get to install them"
        SUDO=()
        if [ "$(id -u)" -ne 0 ]; then
            sudo -n true 2>/dev/null || skip "aarch64 linker/qemu missing; installing needs root or passwordless sudo (or install ${APT_PACKAGES[*]} first)"
            SUDO=(sudo -n)
        fi
        echo "neon: installing ${APT_PACKAGES[*]} (apt)"
        export DEBIAN_FRONTEND=noninteractive
        apt_opts=(-o DPkg::Lock::Timeout=300 -o Acquire::Retries=2 -o Acquire::http::Timeout=30)
        apt_log=$(mktemp)
        apt_why() { # the first fetch error (the cause), else apt's last error
            { grep -m1 -E 'Failed to fetch|Could not (connect|resolve)|Unable to connect|Temporary failure' "$apt_log" \
                || grep -E '^(E|W): ' "$apt_log" | tail -1; } | sed 's/^ *//' || true
        }
        # `update` only warns when a mirror is unreachable; the install below is the real test.
        timeout 300 "${SUDO[@]}" apt-get "${apt_opts[@]}" -q update >"$apt_log" 2>&1 \
            || skip "apt-get update failed: $(apt_why)"
        timeout 600 "${SUDO[@]}" apt-get "${apt_opts[@]}" -q install -y --no-install-recommends \
            "${APT_PACKAGES[@]}" >>"$apt_log" 2>&1 \
            || skip "apt-get install ${APT_PACKAGES[*]} failed: $(apt_why)"
        rm -f "$apt_log"
        have_tools || skip "apt installed the packages but aarch64-linux-gnu-gcc / qemu-aarch64 / $SYSROOT libc are still missing"
    fi
    qemu=$(find_qemu)
    runner="$qemu -L $SYSROOT"
    export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
    export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="$runner"

    command -v rustup >/dev/null || skip "no rustup to add the $TRIPLE standard library"
    if ! rustup target list --installed | grep -qx "$TRIPLE"; then
        echo "neon: rustup target add $TRIPLE"
        rustup_log=$(mktemp)
        if ! timeout 600 rustup target add "$TRIPLE" >"$rustup_log" 2>&1; then
            # `error: ...` and its innermost cause (rustup may append a backtrace).
            why=$(awk '/^error:/ && !e {e = $0} /Stack backtrace/ {exit} /^ *[0-9]+: / {c = $0}
                END {sub(/^ */, "", c); print e (c ? " (" c ")" : "")}' "$rustup_log")
            skip "rustup target add $TRIPLE failed: $why"
        fi
        rm -f "$rustup_log"
    fi
    target_args=(--target "$TRIPLE")
    echo "neon: $(rustc --version), runner: $runner ($($qemu --version | head -1))"
else
    target_args=()
    echo "neon: aarch64 host, running natively: $(rustc --version)"
fi

# The ISA comparison must not be narrowed by the caller's environment.
unset K3_ISA

log=$(mktemp)
trap 'rm -f "$log"' EXIT
set +e
# Build and run the whole k3-kernels suite: unit tests, adversarial, golden, isa_equivalence
# (and the doc tests, which cargo also cross-runs through the runner).
timeout "$TEST_TIMEOUT" cargo test -p k3-kernels "${target_args[@]}" "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" = 124 ]; then
    echo "neon: FAILED: timed out after ${TEST_TIMEOUT}s"
    exit 1
elif [ "$rc" != 0 ]; then
    echo "neon: FAILED: cargo test -p k3-kernels ${target_args[*]} exited $rc"
    exit "$rc"
fi

# A green run proves nothing if only the scalar path ran: the suite compares the paths
# `isa::available()` returns, so require Neon among them in the binary that just ran.
# (`paths_cover_this_machine` asserts it too; this makes the evidence visible in the log.)
paths=$(cargo test -q -p k3-kernels "${target_args[@]}" "$@" --test isa_equivalence \
    paths_cover_this_machine -- --nocapture 2>&1 | grep '^paths compared:' || true)
echo "neon: $paths"
case "$paths" in
    *Scalar*Neon*) ;;
    *) echo "neon: FAILED: the NEON path was not among the compared paths ('$paths')"; exit 1 ;;
esac

passed=$(grep -Eo '^test result: ok\. [0-9]+ passed' "$log" | awk '{s += $4} END {print s + 0}')
suites=$(grep -c '^test result: ok\.' "$log" || true)
echo "neon: PASSED: $passed tests in $suites suites on $TRIPLE (NEON vs scalar vs committed x86-64 bits) in $(($(date +%s) - start)) s"
