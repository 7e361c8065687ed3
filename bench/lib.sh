# shellcheck shell=bash
# bench/lib.sh: shared helpers of the k3-run benchmark scripts (sourced, not run).
#
# Owns: where the binary, the models and the results live (environment overrides below),
# the machine line, dropping the page cache, and running one command under a cgroup v1 memory
# cap (memory.limit_in_bytes, memsw = the same value: swap 0) under GNU time, whose %I
# (getrusage ru_inblock: every block read the process caused, O_DIRECT or page faults or
# readahead, all threads) gives the bytes read from the disk.
# Must not: generate models inside the git tree, or touch any cgroup it did not create.
#
# Environment (defaults in brackets):
#   K3B_BIN    k3-run binary            [$CARGO_TARGET_DIR or /work/targets/bench]/release/k3-run
#   K3B_WORK   models + results root    [/work/bench]     (outside git; must be a real disk)
#   K3B_OUT    results directory        [$K3B_WORK/results/<script>-<UTC time>]
#   K3B_COMMIT the commit the binary was built from (recorded in machine.txt)
#   K3B_MEMCG  parent memory cgroup     [this shell's own v1 memory cgroup: the caps nest
#              inside it, so no limit the caller is under is escaped]

set -euo pipefail

K3B_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
K3B_BIN="${K3B_BIN:-${CARGO_TARGET_DIR:-/work/targets/bench}/release/k3-run}"
K3B_WORK="${K3B_WORK:-/work/bench}"

k3b_die() { echo "bench: error: $*" >&2; exit 2; }
k3b_log() { echo "[$(date -u +%H:%M:%S)] $*" >&2; }

# The common start of a k3-mini benchmark run as root: the binary, root, jq, and MODEL / TRUNK
# (K3B_MODEL [$K3B_WORK/k3-mini], K3B_TRUNK [$K3B_WORK/k3-mini-trunk]) checked to exist.
k3b_k3mini_setup() { # script name
    k3b_need_bin
    k3b_need_root "$1"
    command -v jq > /dev/null || k3b_die "needs jq"
    MODEL="${K3B_MODEL:-$K3B_WORK/k3-mini}"
    TRUNK="${K3B_TRUNK:-$K3B_WORK/k3-mini-trunk}"
    [ -f "$MODEL/config.json" ] || k3b_die "no model at $MODEL (k3-run synth --spec configs/synth/k3-mini.toml --seed 7 --out $MODEL)"
    [ -f "$TRUNK/trunk.json" ] || k3b_die "no packed trunk at $TRUNK (k3-run pack-trunk $MODEL $TRUNK)"
}

k3b_need_bin() {
    [ -x "$K3B_BIN" ] || k3b_die "no k3-run binary at $K3B_BIN (cargo build --release -p k3-run, or set K3B_BIN)"
}

k3b_need_root() {
    [ "$(id -u)" = 0 ] || k3b_die "$1 needs root (cgroup memory caps and drop_caches)"
}

# Results directory for script $1.
k3b_outdir() {
    local d="${K3B_OUT:-$K3B_WORK/results/$1-$(date -u +%Y%m%dT%H%M%SZ)}"
    mkdir -p "$d"
    echo "$d"
}

# The 1-minute load average.
k3b_load() { cut -d' ' -f1 /proc/loadavg; }

# Machine description: CPU, cores, RAM, disk, kernel, date, load.
k3b_machine() {
    local model cores mem dev
    model="$(lscpu | sed -n 's/^Model name: *//p' | head -1)"
    cores="$(nproc)"
    mem="$(awk '/MemTotal/ {printf "%.1f GB", $2*1024/1e9}' /proc/meminfo)"
    dev="$(df -P "$K3B_WORK" | awk 'NR==2 {print $1" ("$6", "$2/1e6" GB)"}')"
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "cpu: $model, $cores CPUs, hypervisor: $(lscpu | sed -n 's/^Hypervisor vendor: *//p')"
    echo "ram: $mem; swap: $(awk '/SwapTotal/ {print $2" kB"}' /proc/meminfo)"
    echo "disk: $dev"
    echo "kernel: $(uname -r)"
    echo "k3-run: $K3B_BIN ($("$K3B_BIN" --version 2>/dev/null || echo '?'), built $(date -u -r "$K3B_BIN" +%Y-%m-%dT%H:%MZ)); source commit: ${K3B_COMMIT:-not given (K3B_COMMIT); this checkout is at $(git -C "$K3B_ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')}"
    echo "load: $(cat /proc/loadavg)"
}

k3b_drop_caches() {
    sync
    echo 3 > /proc/sys/vm/drop_caches
}

# Read every file of a model (and trunk) directory once so it is in the page cache.
k3b_warm() {
    local d
    for d in "$@"; do
        find "$d" -type f -print0 | xargs -0 cat > /dev/null
    done
}

k3b_cg_parent() { # controller
    local p
    p="$(awk -F: -v c="$1" '{n=split($2,a,","); for(i=1;i<=n;i++) if (a[i]==c) print $3}' /proc/self/cgroup | head -1)"
    echo "/sys/fs/cgroup/$1${p%/}"
}

K3B_MEMCG="${K3B_MEMCG:-$(k3b_cg_parent memory)}"

# k3b_run_capped CAP_GB|none META_JSON LOG -- CMD...
# Runs CMD in a fresh memory cgroup capped at CAP_GB (decimal GB; memsw = same value, so no
# swap) under GNU time; writes META_JSON with the exit code, wall seconds, user/system CPU
# seconds, bytes read from the disk (ru_inblock x 512), the cgroup's peak usage, failcnt and
# OOM kills, and the load average before and after.
k3b_run_capped() {
    local cap="$1" meta="$2" log="$3"
    shift 4
    local tag mcg="" bytes="null" t0 t1 rc load0 tf
    tag="k3bench-$$-$RANDOM"
    tf="$meta.time"
    if [ "$cap" != none ]; then
        bytes="$(awk -v g="$cap" 'BEGIN {printf "%.0f", g*1e9}')"
        mcg="$K3B_MEMCG/$tag"
        mkdir "$mcg"
        echo "$bytes" > "$mcg/memory.limit_in_bytes"
        if [ -e "$mcg/memory.memsw.limit_in_bytes" ]; then
            echo "$bytes" > "$mcg/memory.memsw.limit_in_bytes"
        fi
    fi
    load0="$(k3b_load)"
    t0="$(date +%s.%N)"
    set +e
    (
        if [ -n "$mcg" ]; then echo "$BASHPID" > "$mcg/cgroup.procs"; fi
        exec /usr/bin/time -o "$tf" -f '%x %I %U %S %M' "$@" < /dev/null
    ) > "$log" 2>&1
    rc=$?
    set -e
    t1="$(date +%s.%N)"
    local peak=null failcnt=null oom=null rd=null usr=null sys=null
    if [ -s "$tf" ]; then
        # the last line is the format (a first line may say "Command terminated by signal 9")
        read -r _ rd usr sys _ < <(tail -n 1 "$tf")
        rd=$((rd * 512))
    fi
    if [ -n "$mcg" ]; then
        peak="$(cat "$mcg/memory.max_usage_in_bytes")"
        failcnt="$(cat "$mcg/memory.failcnt")"
        oom="$(awk '/oom_kill / {print $2}' "$mcg/memory.oom_control")"
        oom="${oom:-null}"
        # the process has exited: the cgroup is empty and can go (page cache charges move up)
        rmdir "$mcg" 2>/dev/null || { sleep 1; rmdir "$mcg" 2>/dev/null || true; }
    fi
    printf '{"cap_gb": %s, "cap_bytes": %s, "rc": %s, "wall_seconds": %s, "user_seconds": %s, "sys_seconds": %s, "disk_read_bytes": %s, "cgroup_peak_bytes": %s, "cgroup_failcnt": %s, "oom_kills": %s, "load_before": %s, "load_after": %s}\n' \
        "$([ "$cap" = none ] && echo null || echo "$cap")" "$bytes" "$rc" \
        "$(awk -v a="$t0" -v b="$t1" 'BEGIN {printf "%.3f", b-a}')" \
        "$usr" "$sys" "$rd" "$peak" "$failcnt" "$oom" "$load0" "$(k3b_load)" > "$meta"
    return "$rc"
}

# k3b_probe_disk FILE JSON: O_DIRECT 8 MiB reads of FILE at queue depth 16, random and
# sequential order (one pass each at most, <= 4 s each), by `k3-run doctor --json`; prints
# the floor bandwidth (the faster of the two) in MB/s.
k3b_probe_disk() {
    "$K3B_BIN" doctor --file "$1" --no-dram --qd 16 --order random,sequential --seconds 4 \
        --json "$2" < /dev/null > "$2.log" 2>&1 || true
    jq -r '.disk_floor_mb_per_s // "null"' "$2"
}

# k3b_probe_dram JSON: DRAM streaming-read reference (GB/s) by `k3-run doctor --json`.
k3b_probe_dram() {
    "$K3B_BIN" doctor --no-disk --dram-reps 5 --json "$1" < /dev/null > "$1.log" 2>&1 || true
    jq -r '.dram.reference_gb_per_s // "null"' "$1"
}
