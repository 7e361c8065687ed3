#!/usr/bin/env bash
# bench/pinload.sh: the first-token pinned-prefix load against the disk's queue-depth-16 read
# bandwidth, with the guest memory the load populates "warm" (touched a moment before, so the
# host backs it) and "cold" (left alone for COLD_WAIT seconds after the page cache was
# dropped, so free page reporting can hand it back to the host).
#
# Per round and condition: drop the page cache; `k3-run doctor` QD16 probe of trunk.bin;
# (warm: bench/touch_memory.py of the trunk's size | cold: sleep COLD_WAIT); then
# `k3-run MODEL --gen 1 --trunk TRUNK --trunk-gb ALL --cache-gb 0.017 --out`. Writes
# pinload.tsv (round, condition, probe MB/s, load MB/s, load/probe) and prints medians.
#
# Usage: bench/pinload.sh [ROUNDS=5]   (environment: see lib.sh; COLD_WAIT [12])
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
printf 'round\tcondition\tprobe_mb_s\tload_mb_s\tratio\n' > "$out/pinload.tsv"
for r in $(seq 1 "$ROUNDS"); do
    for cond in warm cold; do
        k3b_drop_caches
        probe="$(k3b_probe_disk "$TRUNK/trunk.bin" "$out/$r.$cond.probe.json")"
        if [ "$cond" = warm ]; then
            python3 "$K3B_ROOT/bench/touch_memory.py" "$all" > "$out/$r.$cond.touch.log"
        else
            sleep "$COLD_WAIT"
        fi
        # The load alone (in the session build): a run's default background load shares
        # the disk with the prompt's expert reads (bench/README.md: time to first token).
        K3_PIN_SYNC=1 "$K3B_BIN" "$MODEL" --ids 1,2,3,4 --gen 1 --trunk "$TRUNK" --trunk-gb "$all" \
            --cache-gb 0.017 --out "$out/$r.$cond.json" > "$out/$r.$cond.log" 2>&1
        load="$(jq -r '.trunk.bytes_read / .pinned_load_seconds / 1e6 | round' "$out/$r.$cond.json")"
        ratio="$(awk -v a="$load" -v b="$probe" 'BEGIN {printf "%.3f", a / b}')"
        printf '%s\t%s\t%s\t%s\t%s\n' "$r" "$cond" "$probe" "$load" "$ratio" >> "$out/pinload.tsv"
        k3b_log "round $r $cond: probe $probe MB/s, load $load MB/s, ratio $ratio (load $(k3b_load))"
    done
done
for cond in warm cold; do
    awk -F'\t' -v c="$cond" '$2 == c {print $5}' "$out/pinload.tsv" | sort -n |
        awk -v c="$cond" '{v[NR] = $1} END {printf "%s: median load/probe %.3f over %d rounds (min %.3f, max %.3f)\n", c, v[int((NR + 1) / 2)], NR, v[1], v[NR]}'
done | tee "$out/summary.txt"
echo "results: $out"
