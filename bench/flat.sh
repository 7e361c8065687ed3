#!/usr/bin/env bash
# bench/flat.sh: expert-cache hit rates on k3-mini-flat (flat routing, like real K3's balanced
# router) at several cache sizes, one --dump-cache-trace, and `k3-run sim-cache` (LRU vs
# Belady's optimum at the same capacities).
#
# Usage: sudo bench/flat.sh
#   Env: K3B_FLAT [$K3B_WORK/k3-mini-flat]  K3B_FLAT_TRUNK [$K3B_WORK/k3-mini-flat-trunk]
#        K3B_IDS [1,2,3,4]  K3B_FLAT_GEN [32]
#        K3B_CACHES ["0.0017 0.017 0.051 0.185 0.5 1.0 2.5"] (GB; the first four are the
#        laptop, desktop, workstation and max presets' caches scaled by 2.46 GB / 1446.46 GB)
#
# The trunk is pinned whole (its budget is not what is measured), experts go through the
# cache with O_DIRECT reads; the page cache is dropped before each run. Every cache size must
# give the same ids. Output: flat.md (bench/report.py flat), sim-cache.txt, expert_hist.json.
source "$(dirname "$0")/lib.sh"
k3b_need_bin
k3b_need_root "bench/flat.sh"
MODEL="${K3B_FLAT:-$K3B_WORK/k3-mini-flat}"
TRUNK="${K3B_FLAT_TRUNK:-$K3B_WORK/k3-mini-flat-trunk}"
IDS="${K3B_IDS:-1,2,3,4}"
GEN="${K3B_FLAT_GEN:-32}"
CACHES="${K3B_CACHES:-0.0017 0.017 0.051 0.185 0.5 1.0 2.5}"
[ -f "$MODEL/config.json" ] || k3b_die "no model at $MODEL (k3-run synth --spec configs/synth/k3-mini-flat.toml --seed 7 --out $MODEL)"
[ -f "$TRUNK/trunk.json" ] || k3b_die "no packed trunk at $TRUNK (k3-run pack-trunk $MODEL $TRUNK)"
out="$(k3b_outdir flat)"
k3b_log "results in $out"
"$K3B_BIN" plan "$MODEL" --json > "$out/plan.json"
EXPERT_B="$(jq '[.layers[] | select(.bytes_per_expert > 0) | .bytes_per_expert] | max' "$out/plan.json")"
TRUNK_ALL="$(jq '([.layers[].trunk_bytes] | add) + 93*4096 + 1e7 | . / 1e9' "$out/plan.json")"
{
    k3b_machine
    echo "model: $MODEL; request --ids $IDS --gen $GEN --incremental --trunk $TRUNK --trunk-gb $TRUNK_ALL --cache-gb C"
} > "$out/machine.txt"
: > "$out/rows.tsv"
for c in $CACHES; do
    key="cache-$c"
    printf '%s\t%s\n' "$key" "$c" >> "$out/rows.tsv"
    k3b_drop_caches
    cmd=("$K3B_BIN" "$MODEL" --ids "$IDS" --gen "$GEN" --incremental --trunk "$TRUNK"
        --trunk-gb "$TRUNK_ALL" --cache-gb "$c" --out "$out/$key.json")
    echo "${cmd[*]}" > "$out/$key.cmd"
    k3b_run_capped none "$out/$key.meta.json" "$out/$key.log" -- "${cmd[@]}" || true
    k3b_log "$key: $(jq -r '"resident hit \(.experts.resident_hit_rate*1000|round/10)%, \(.seconds_per_token|.*1000|round/1000) s/token"' "$out/$key.json" 2>/dev/null || echo failed)"
done
# one trace (the trace does not depend on the cache: routing never does)
k3b_drop_caches
"$K3B_BIN" "$MODEL" --ids "$IDS" --gen "$GEN" --incremental --trunk "$TRUNK" --trunk-gb "$TRUNK_ALL" \
    --cache-gb 0.0017 --dump-cache-trace "$out/trace" --out "$out/trace.json" > "$out/trace.log" 2>&1
# the capacities the runs had, in experts, from their start-up lines
caps=""
for c in $CACHES; do
    n="$(jq -r '.memory_plan[] | select(startswith("expert cache:"))' "$out/cache-$c.json" 2>/dev/null |
        sed -n 's/.*= \([0-9][0-9]*\) experts.*/\1/p')"
    if [ -n "$n" ] && [ "$n" != 0 ]; then caps="$caps,$n"; fi
done
echo "\$ k3-run sim-cache trace/expert_trace.bin --capacities ${caps#,} --expert-bytes $EXPERT_B" > "$out/sim-cache.txt"
"$K3B_BIN" sim-cache "$out/trace/expert_trace.bin" --capacities "${caps#,}" --expert-bytes "$EXPERT_B" >> "$out/sim-cache.txt"
cp "$out/trace/expert_hist.json" "$out/expert_hist.json" 2>/dev/null || true
echo "end load: $(cat /proc/loadavg)" >> "$out/machine.txt"
python3 "$(dirname "$0")/report.py" flat "$out" | tee "$out/flat.md"
