#!/usr/bin/env bash
# bench/ladder.sh: the memory ladder on k3-mini — the same request under cgroup memory caps,
# with the floors measured in the same run, every row checked for identical ids.
#
# Usage: sudo bench/ladder.sh [ROWS_FILE]
#   Env: K3B_MODEL [$K3B_WORK/k3-mini]  K3B_TRUNK [$K3B_WORK/k3-mini-trunk]
#        K3B_IDS [1,2,3,4]  K3B_GEN [8]  K3B_REPS [3]  K3B_THREADS [unset: k3-run's default]
#
# Rows (default table below; ROWS_FILE has the same format): NAME CAP_GB ARGS...
#   CAP_GB "none" = no cap beyond the machine's RAM. ARGS go after
#   `k3-run MODEL --ids IDS --gen N --incremental`; @TRUNK@ is replaced by the packed trunk dir,
#   @LT@/@LC@ by the laptop preset's trunk/cache budgets scaled to the model, @DT@/@DC@ by
#   the desktop preset's, @ALL@ by a trunk budget that pins every layer. Rows whose NAME
#   starts with "pinned" are checked against the overlap and first-token goals; "resident"
#   against the memory floor; rows with --io mmap are compared with resident; the others
#   against the I/O floor.
#
# For every row: a QD16 O_DIRECT probe of trunk.bin (the I/O floor's bandwidth, measured just
# before the row; the resident row probes DRAM instead), one --gen 1 run (prefill + first
# token: its byte counters are subtracted so decode bytes are exact), then K3B_REPS runs of
# --gen N. Before each run the page cache is dropped (streaming rows) or the model is read
# into it (the resident row). Every run is in its own memory cgroup (limit = memsw = CAP),
# under GNU time (disk bytes read, CPU seconds). bench/report.py turns the results into
# ladder.md (and summary.json).
source "$(dirname "$0")/lib.sh"
k3b_k3mini_setup "bench/ladder.sh"
IDS="${K3B_IDS:-1,2,3,4}"
GEN="${K3B_GEN:-8}"
REPS="${K3B_REPS:-3}"
out="$(k3b_outdir ladder)"
k3b_log "results in $out"

rows_default() {
    cat << 'ROWS'
resident  none
laptop    1     --trunk @TRUNK@ --trunk-gb @LT@ --cache-gb @LC@
laptop    1.5   --trunk @TRUNK@ --trunk-gb @LT@ --cache-gb @LC@
laptop    2     --trunk @TRUNK@ --trunk-gb @LT@ --cache-gb @LC@
laptop    3     --trunk @TRUNK@ --trunk-gb @LT@ --cache-gb @LC@
ring2     1     --trunk @TRUNK@ --trunk-gb 0.1 --cache-gb @LC@
ring4     1     --trunk @TRUNK@ --trunk-gb 0.2 --trunk-ring 4 --cache-gb @LC@
desktop   2     --trunk @TRUNK@ --trunk-gb @DT@ --cache-gb @DC@
pinned    3.5   --trunk @TRUNK@ --trunk-gb @ALL@ --cache-gb @LC@
pinned-dc 3.5   --trunk @TRUNK@ --trunk-gb @ALL@ --cache-gb @DC@
pinned-dc-noprefetch 3.5 --trunk @TRUNK@ --trunk-gb @ALL@ --cache-gb @DC@ --expert-prefetch false
pinned-dc-prefetch1 3.5 --trunk @TRUNK@ --trunk-gb @ALL@ --cache-gb @DC@ --expert-prefetch 1
mmap      1     --io mmap --trunk @TRUNK@ --trunk-gb @LT@ --cache-gb @LC@
mmap      1.5   --io mmap --trunk @TRUNK@ --trunk-gb @LT@ --cache-gb @LC@
mmap      2     --io mmap --trunk @TRUNK@ --trunk-gb @LT@ --cache-gb @LC@
mmap      3     --io mmap --trunk @TRUNK@ --trunk-gb @LT@ --cache-gb @LC@
ROWS
}

# Budgets scaled from the real-K3 presets: trunk by 108.81 GB (real trunk), expert cache by
# 1446.46 GB (82,432 experts x 17,547,264 bytes), using this model's plan.
"$K3B_BIN" plan "$MODEL" --json > "$out/plan.json"
read -r TRUNK_B EXP_B < <(jq -r '[([.layers[].trunk_bytes]|add), ([.layers[].expert_bytes]|add)] | @tsv' "$out/plan.json")
scale() { awk -v v="$1" -v m="$2" -v r="$3" 'BEGIN {printf "%.4f", v*m/r}'; }
LT="$(scale 3.00 "$TRUNK_B" 108.81e9)"
LC="$(scale 1.00 "$EXP_B" 1446.46e9)"
DT="$(scale 16.00 "$TRUNK_B" 108.81e9)"
DC="$(scale 10.00 "$EXP_B" 1446.46e9)"
ALL="$(awk -v t="$TRUNK_B" 'BEGIN {printf "%.3f", (t + 93*4096)/1e9 + 0.01}')"

{
    k3b_machine
    echo "model: $MODEL (trunk $TRUNK_B B, experts $EXP_B B); packed trunk: $TRUNK"
    echo "request: --ids $IDS --gen $GEN --incremental ${K3B_THREADS:+--threads $K3B_THREADS}; reps $REPS"
    echo "scaled budgets: laptop trunk $LT GB cache $LC GB; desktop trunk $DT GB cache $DC GB; all-pinned trunk $ALL GB"
} > "$out/machine.txt"
cat "$out/machine.txt" >&2

if [ -n "${1:-}" ]; then rows="$(cat "$1")"; else rows="$(rows_default)"; fi
: > "$out/rows.tsv"

# start-of-run floors (DRAM and disk)
k3b_log "floors: DRAM + QD16 probe"
dram="$(k3b_probe_dram "$out/dram-start.json")"
disk="$(k3b_probe_disk "$TRUNK/trunk.bin" "$out/disk-start.json")"
k3b_log "DRAM reference $dram GB/s; trunk.bin QD16 $disk MB/s"

while read -r name cap args; do
    [ -z "$name" ] && continue
    case "$name" in \#*) continue ;; esac
    args="${args//@TRUNK@/$TRUNK}"
    args="${args//@LT@/$LT}"
    args="${args//@LC@/$LC}"
    args="${args//@DT@/$DT}"
    args="${args//@DC@/$DC}"
    args="${args//@ALL@/$ALL}"
    key="$name-cap$cap"
    # a row repeated in the table (e.g. resident first and last) gets its own files
    n=2
    while grep -q "^$key	" "$out/rows.tsv"; do
        key="$name-cap$cap-$n"
        n=$((n + 1))
    done
    printf '%s\t%s\t%s\t%s\n' "$key" "$name" "$cap" "$args" >> "$out/rows.tsv"
    # shellcheck disable=SC2206
    argv=($args)
    threads=()
    if [ -n "${K3B_THREADS:-}" ]; then threads=(--threads "$K3B_THREADS"); fi
    if [[ " $args " == *" --trunk "* ]]; then
        bw="$(k3b_probe_disk "$TRUNK/trunk.bin" "$out/$key.probe.json")"
        k3b_log "$key: trunk.bin QD16 $bw MB/s"
    else
        bw="$(k3b_probe_dram "$out/$key.dram.json")"
        k3b_log "$key: DRAM reference $bw GB/s"
    fi
    for run in gen1 $(seq -f 'r%g' 1 "$REPS"); do
        n="$GEN"
        [ "$run" = gen1 ] && n=1
        if [[ " $args " == *" --trunk "* ]]; then k3b_drop_caches; else k3b_warm "$MODEL"; fi
        cmd=("$K3B_BIN" "$MODEL" --ids "$IDS" --gen "$n" --incremental "${threads[@]}" "${argv[@]}" --out "$out/$key.$run.json")
        echo "${cmd[*]}" > "$out/$key.$run.cmd"
        k3b_run_capped "$cap" "$out/$key.$run.meta.json" "$out/$key.$run.log" -- "${cmd[@]}" || true
        k3b_log "$key $run: rc $(jq .rc "$out/$key.$run.meta.json"), $(jq -r '"\(.seconds_per_token|.*1000|round/1000) s/token, first \(.first_token_seconds|.*100|round/100) s, ids \(.generated_ids|map(tostring)|join(","))"' "$out/$key.$run.json" 2>/dev/null || echo 'no result') (load $(k3b_load))"
    done
done <<< "$rows"

# end-of-run floors
dram="$(k3b_probe_dram "$out/dram-end.json")"
disk="$(k3b_probe_disk "$TRUNK/trunk.bin" "$out/disk-end.json")"
k3b_log "end: DRAM reference $dram GB/s; trunk.bin QD16 $disk MB/s"
echo "end load: $(cat /proc/loadavg)" >> "$out/machine.txt"

python3 "$(dirname "$0")/report.py" ladder "$out" | tee "$out/ladder.md"
