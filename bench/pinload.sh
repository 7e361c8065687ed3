#!/usr/bin/env bash
# bench/pinload.sh: the first-token pinned-prefix load against the disk's queue-depth-16 read
# bandwidth, with the guest memory the load populates "warm" (touched a moment before, so the
# host backs it) and "cold" (left alone for COLD_WAIT seconds after the page cache was
# dropped, so free page reporting can hand it back to the host), and with POOL_PAGES set a
# third condition "pool": cold, with the pinned buffers on a reserved huge-page pool
# (`vm.nr_hugepages`, I/O policy `reserved_huge_pages`), whose pages the host keeps backed.
# Always also "pagecache": cold, with the pinned prefix held in trunk.bin's page cache (I/O
# policy configs/io/page-cache.toml: mapped, read in with MADV_POPULATE_READ, locked), which
# allocates no buffer for the guest to zero and the host to back.
#
# Per round and condition: drop the page cache; `k3-run doctor` QD16 probe of trunk.bin;
# (warm: bench/touch_memory.py of the trunk's size | cold, pool: sleep COLD_WAIT); then
# `k3-run MODEL --gen 1 --trunk TRUNK --trunk-gb ALL --cache-gb 0.017 --out`. Writes
# pinload.tsv (round, condition, probe MB/s, load MB/s, load/probe) and prints medians.
# warm and cold run with a policy that leaves the pool alone (configs/io/direct.toml with
# reserved_huge_pages = false); with POOL_PAGES the pool is set to that many 2 MiB pages, used
# once before the rounds (a pool's first use faults its pages in on the host) and put back to
# its old size at the end.
#
# PAGE_REPORTING_ORDER=N sets /sys/module/page_reporting/parameters/page_reporting_order for the
# rounds (a value above the kernel's largest page order, e.g. 11 where the kernel accepts it,
# stops free page reporting) after touching MemAvailable less 2 GB once, so that memory the
# guest had handed back is backed again; the old value is put back at the end. CAP_GB=G runs
# every engine run in its own cgroup v1 memory cap of G GB, swap 0 (lib.sh k3b_run_capped),
# and logs the cgroup's peak and failcnt.
#
# Usage: bench/pinload.sh [ROUNDS=5]   (environment: see lib.sh; COLD_WAIT [12]; POOL_PAGES;
#        PAGE_REPORTING_ORDER; CAP_GB; CONDS: the conditions, default "warm cold pagecache")
source "$(dirname "$0")/lib.sh"
k3b_need_bin
k3b_need_root "pinload.sh"
ROUNDS="${1:-5}"
COLD_WAIT="${COLD_WAIT:-12}"
MODEL="$K3B_WORK/k3-mini"
TRUNK="$K3B_WORK/k3-mini-trunk"
[ -f "$TRUNK/trunk.json" ] || k3b_die "no packed trunk at $TRUNK (see bench/README.md)"
out="$(k3b_outdir pinload)"
k3b_machine > "$out/machine.txt"
all="$(jq -r '[.layers[].size] | add / 1e9 + 0.001' "$TRUNK/trunk.json")"
nopool="$out/direct-no-pool.toml"
sed 's/^reserved_huge_pages = true/reserved_huge_pages = false/' "$K3B_ROOT/configs/io/direct.toml" > "$nopool"
grep -q '^reserved_huge_pages = false' "$nopool" || k3b_die "configs/io/direct.toml has no reserved_huge_pages = true"
conds="${CONDS:-warm cold pagecache}"
restore=""
if [ -n "${PAGE_REPORTING_ORDER:-}" ]; then
    pro=/sys/module/page_reporting/parameters/page_reporting_order
    [ -w "$pro" ] || k3b_die "PAGE_REPORTING_ORDER: no writable $pro"
    old_order="$(cat "$pro")"
    restore="echo $old_order > $pro"
    trap 'eval "$restore"' EXIT
    echo "$PAGE_REPORTING_ORDER" > "$pro" || k3b_die "the kernel refused page_reporting_order $PAGE_REPORTING_ORDER"
    avail_gb="$(awk '/^MemAvailable:/ {printf "%.1f", $2 * 1024 / 1e9 - 2}' /proc/meminfo)"
    k3b_log "page_reporting_order $PAGE_REPORTING_ORDER (was $old_order); backing $avail_gb GB once: $(python3 "$K3B_ROOT/bench/touch_memory.py" "$avail_gb")"
fi
if [ -n "${POOL_PAGES:-}" ]; then
    old_pool="$(cat /proc/sys/vm/nr_hugepages)"
    restore="$restore; echo $old_pool > /proc/sys/vm/nr_hugepages"
    trap 'eval "$restore"' EXIT
    echo "$POOL_PAGES" > /proc/sys/vm/nr_hugepages
    k3b_log "reserved pool: $(grep HugePages_Free /proc/meminfo) (was $old_pool pages)"
    conds="$conds pool"
    "$K3B_BIN" "$MODEL" --ids 1,2,3,4 --gen 1 --trunk "$TRUNK" --trunk-gb "$all" --cache-gb 0.017 \
        --out "$out/pool-first-use.json" > "$out/pool-first-use.log" 2>&1 || k3b_die "pool first use failed"
    [ "$(jq -r '.trunk.hugetlb_bytes' "$out/pool-first-use.json")" -gt 0 ] ||
        k3b_die "the pool did not take the pinned prefix (POOL_PAGES too small?)"
fi
printf 'round\tcondition\tprobe_mb_s\tload_mb_s\tratio\n' > "$out/pinload.tsv"
for r in $(seq 1 "$ROUNDS"); do
    for cond in $conds; do
        k3b_drop_caches
        probe="$(k3b_probe_disk "$TRUNK/trunk.bin" "$out/$r.$cond.probe.json")"
        if [ "$cond" = warm ]; then
            python3 "$K3B_ROOT/bench/touch_memory.py" "$all" > "$out/$r.$cond.touch.log"
        else
            sleep "$COLD_WAIT"
        fi
        # The load alone (in the session build): a run's default background load shares
        # the disk with the prompt's expert reads (bench/README.md: time to first token).
        io="$nopool"
        [ "$cond" = pool ] && io=direct
        [ "$cond" = pagecache ] && io="$K3B_ROOT/configs/io/page-cache.toml"
        run=(env K3_PIN_SYNC=1 "$K3B_BIN" "$MODEL" --ids 1,2,3,4 --gen 1 --trunk "$TRUNK"
            --trunk-gb "$all" --cache-gb 0.017 --io "$io" --out "$out/$r.$cond.json")
        capped=""
        if [ -n "${CAP_GB:-}" ]; then
            k3b_run_capped "$CAP_GB" "$out/$r.$cond.cap.json" "$out/$r.$cond.log" -- "${run[@]}" ||
                k3b_die "round $r $cond failed under the cap (see $out/$r.$cond.log)"
            capped=", cap $CAP_GB GB: peak $(jq -r '.cgroup_peak_bytes / 1e9 | . * 100 | round / 100' "$out/$r.$cond.cap.json") GB, failcnt $(jq -r .cgroup_failcnt "$out/$r.$cond.cap.json")"
        else
            "${run[@]}" > "$out/$r.$cond.log" 2>&1
        fi
        load="$(jq -r '.trunk.bytes_read / .pinned_load_seconds / 1e6 | round' "$out/$r.$cond.json")"
        ratio="$(awk -v a="$load" -v b="$probe" 'BEGIN {printf "%.3f", a / b}')"
        printf '%s\t%s\t%s\t%s\t%s\n' "$r" "$cond" "$probe" "$load" "$ratio" >> "$out/pinload.tsv"
        k3b_log "round $r $cond: probe $probe MB/s, load $load MB/s, ratio $ratio (load $(k3b_load))$capped"
    done
done
for cond in $conds; do
    awk -F'\t' -v c="$cond" '$2 == c {print $5}' "$out/pinload.tsv" | sort -n |
        awk -v c="$cond" '{v[NR] = $1} END {printf "%s: median load/probe %.3f over %d rounds (min %.3f, max %.3f)\n", c, v[int((NR + 1) / 2)], NR, v[1], v[NR]}'
done | tee "$out/summary.txt"
echo "results: $out"
