#!/usr/bin/env bash
# bench/startup.sh: what scales with the tensor count, on k3-counts (configs/synth/k3-counts.toml:
# the released K3's 93 layers, 896 routed experts top-16 and 497,056 tensors at toy widths).
#
# Per round, binaries in turn (A then B, the order swapped every round), page cache warm:
# `verify`, `budget`, `plan`, `pack-trunk`, a resident run and a streamed run (`--gen 1`; the
# start-up = time to first token - prefill and first token, from `--out`), then both runs again
# with the page cache dropped. Writes startup.tsv (round, binary, what, seconds) and prints
# medians per binary.
#
# Usage: bench/startup.sh [ROUNDS=5]   (environment: see lib.sh; K3B_BIN_B = a second binary)
source "$(dirname "$0")/lib.sh"
k3b_need_bin
k3b_need_root "startup.sh"
ROUNDS="${1:-5}"
MODEL="$K3B_WORK/k3-counts"
TRUNK="$K3B_WORK/k3-counts-trunk"
if [ ! -f "$MODEL/config.json" ]; then
    "$K3B_BIN" synth --spec "$K3B_ROOT/configs/synth/k3-counts.toml" --seed 3 --quiet --out "$MODEL"
fi
[ -f "$TRUNK/trunk.json" ] || "$K3B_BIN" pack-trunk "$MODEL" "$TRUNK" > /dev/null
out="$(k3b_outdir startup)"
k3b_machine > "$out/machine.txt"
bins=("$K3B_BIN")
[ -n "${K3B_BIN_B:-}" ] && bins+=("$K3B_BIN_B")
printf 'round\tbinary\twhat\tseconds\n' > "$out/startup.tsv"
secs() { # command... -> wall seconds
    local s e
    s=$(date +%s.%N)
    "$@" > /dev/null 2>&1 || k3b_die "failed: $*"
    e=$(date +%s.%N)
    awk -v a="$s" -v b="$e" 'BEGIN {printf "%.3f", b - a}'
}
startup_of() { # json -> start-up seconds
    jq -r '.time_to_first_token_seconds - .first_token_seconds | . * 1000 | round / 1000' "$1"
}
ids=(--ids 1,2,3,4,5,6,7,8 --gen 1)
stream=(--trunk "$TRUNK" --trunk-gb 0.02 --cache-gb 0.01)
for r in $(seq 1 "$ROUNDS"); do
    order=("${bins[@]}")
    if [ $((r % 2)) = 0 ] && [ "${#bins[@]}" = 2 ]; then order=("${bins[1]}" "${bins[0]}"); fi
    for b in "${order[@]}"; do
        row() { printf '%s\t%s\t%s\t%s\n' "$r" "$b" "$1" "$2" >> "$out/startup.tsv"; }
        k3b_warm "$MODEL" "$TRUNK"
        row verify "$(secs "$b" verify "$MODEL")"
        row budget "$(secs "$b" budget "$MODEL")"
        row plan "$(secs "$b" plan "$MODEL" --trunk "$TRUNK" --trunk-gb 0.02)"
        rm -rf "$out/pack"
        row pack-trunk "$(secs "$b" pack-trunk "$MODEL" "$out/pack")"
        rm -rf "$out/pack"
        for cache in warm cold; do
            [ "$cache" = cold ] && k3b_drop_caches
            "$b" "$MODEL" "${ids[@]}" --out "$out/run.json" > /dev/null 2>&1 || k3b_die "resident run failed ($b)"
            row "resident-startup-$cache" "$(startup_of "$out/run.json")"
            [ "$cache" = cold ] && k3b_drop_caches
            "$b" "$MODEL" "${ids[@]}" "${stream[@]}" --out "$out/run.json" > /dev/null 2>&1 || k3b_die "streamed run failed ($b)"
            row "streamed-startup-$cache" "$(startup_of "$out/run.json")"
        done
        k3b_log "round $r $b done (load $(k3b_load))"
    done
done
awk -F'\t' 'NR > 1 {v[$2 "\t" $3] = v[$2 "\t" $3] " " $4} END {for (k in v) print k "\t" v[k]}' "$out/startup.tsv" |
    sort | while IFS=$'\t' read -r b what vals; do
        med="$(tr ' ' '\n' <<< "$vals" | grep . | sort -n | awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}')"
        printf '%-40s %-26s median %s s  (%s)\n' "$b" "$what" "$med" "$(echo $vals)"
    done | tee "$out/summary.txt"
echo "results: $out"
