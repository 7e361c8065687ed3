#!/usr/bin/env bash
# bench/wide.sh: k3-wide (configs/synth/k3-wide.toml: the released K3's widths on 13 layers,
# 64 experts) end to end at every memory setting, with identical ids and logit bits checked.
#
# Usage: sudo bench/wide.sh [ROWS_FILE]
#   Env: K3B_WORK [/work/k3wide-data]  K3B_MODEL [$K3B_WORK/k3-wide]
#        K3B_TRUNK [$K3B_WORK/k3-wide-trunk]  K3B_IDS [1,2,3,4]  K3B_GEN [4]  K3B_REPS [1]
#        K3B_THREADS [unset]  K3B_LONG [64: tokens of the long prompt]
#
# Rows (default table below, or ROWS_FILE in the same format): NAME CAP_GB GROUP ARGS...
#   CAP_GB "none" = no cgroup cap. GROUP names what must be identical: every row of a group
#   must give the same generated ids and first-step logits hash (`short`: the prompt K3B_IDS;
#   `long`: a K3B_LONG-token prompt; `batch`: --batch-ids whose sequence 0 is K3B_IDS and is
#   compared with the `short` group, sequence 1 with the `short2` group). ARGS go after
#   `k3-run MODEL`; placeholders: @IDS@ (--ids K3B_IDS --gen K3B_GEN --incremental),
#   @IDS2@ (the second prompt), @LONG@ (the long prompt, --gen 2), @BATCH@ (both short prompts
#   as --batch-ids), @TRUNK@, @SLOT@ (one ring slot: the largest layer), @SLOT2@ (two
#   slots), @PIN0@ (layer 0 pinned + one slot), @HALF@ (about half the trunk pinned + two
#   slots), @ALL@ (every layer pinned).
#   A NAME starting with "m-" is a measured row: a --gen 1 run of the same request first (its
#   byte counters are subtracted so decode bytes per token are exact) and a QD16 O_DIRECT
#   probe of trunk.bin just before (the I/O floor's bandwidth; resident rows probe DRAM).
#
# The whole model resident (33.9 GB) does not fit this machine's 24 GB of RAM; a row without
# --layers and --trunk can still be given in ROWS_FILE (`m-resident none short @IDS@`).
# Streaming rows start with the page cache dropped; resident rows (no --trunk) warm with their
# own --gen 1 run. The `--layers N --resident arena` rows time the first N layers in RAM
# (2 MiB-page arena): the differences between them are the per-layer compute by kind. Every run is under GNU time (disk bytes, CPU) and, with a cap, in its own
# v1 memory cgroup (lib.sh). bench/wide_report.py writes wide.md and exits 1 when any group's
# ids or hashes differ.
K3B_WORK="${K3B_WORK:-/work/k3wide-data}"
source "$(dirname "$0")/lib.sh"
k3b_need_bin
k3b_need_root "bench/wide.sh"
command -v jq > /dev/null || k3b_die "needs jq"
MODEL="${K3B_MODEL:-$K3B_WORK/k3-wide}"
TRUNK="${K3B_TRUNK:-$K3B_WORK/k3-wide-trunk}"
[ -f "$MODEL/config.json" ] || k3b_die "no model at $MODEL (k3-run synth --spec configs/synth/k3-wide.toml --seed 1 --out $MODEL)"
[ -f "$TRUNK/trunk.json" ] || k3b_die "no packed trunk at $TRUNK (k3-run pack-trunk $MODEL $TRUNK)"
IDS="${K3B_IDS:-1,2,3,4}"
IDS2="${K3B_IDS2:-5,6,7,8}"
GEN="${K3B_GEN:-4}"
REPS="${K3B_REPS:-1}"
NLONG="${K3B_LONG:-64}"
LONG="$(python3 -c "print(','.join(str((i * 7919 + 13) % 160000 + 300) for i in range($NLONG)))")"
out="$(k3b_outdir wide)"
k3b_log "results in $out"

rows_default() {
    cat << 'ROWS'
m-res-L1        none  L1     @IDS@ --layers 1 --resident arena
m-res-L2        none  L2     @IDS@ --layers 2 --resident arena
m-res-L3        none  L3     @IDS@ --layers 3 --resident arena
m-res-L4        none  L4     @IDS@ --layers 4 --resident arena
m-one-slot      none  short  @IDS@ --trunk @TRUNK@ --trunk-gb @SLOT@ --trunk-ring 1 --cache-gb 0
m-shared-ring   none  short  @IDS@ --trunk @TRUNK@ --trunk-gb @SLOT@ --cache-gb 0
m-laptop        none  short  @IDS@ --trunk @TRUNK@ --preset laptop
m-ring2         none  short  @IDS@ --trunk @TRUNK@ --trunk-gb @SLOT2@ --cache-gb 0
m-pin0          none  short  @IDS@ --trunk @TRUNK@ --trunk-gb @PIN0@ --trunk-ring 1 --cache-gb 0
m-half          none  short  @IDS@ --trunk @TRUNK@ --trunk-gb @HALF@ --cache-gb 0
m-pinned        none  short  @IDS@ --trunk @TRUNK@ --trunk-gb @ALL@ --cache-gb 0
pinned-c2       none  short  @IDS@ --trunk @TRUNK@ --trunk-gb @ALL@ --cache-gb 2
ring2-c1        none  short  @IDS@ --trunk @TRUNK@ --trunk-gb @SLOT2@ --cache-gb 1
ring2-c8        none  short  @IDS@ --trunk @TRUNK@ --trunk-gb @SLOT2@ --cache-gb 8
m-ultra         none  short  @IDS@ --trunk @TRUNK@ --preset ultra
ring2-p2        none  short2 @IDS2@ --trunk @TRUNK@ --trunk-gb @SLOT2@ --cache-gb 0
batch-laptop    none  batch  @BATCH@ --trunk @TRUNK@ --preset laptop
long-laptop-c16 none  long   @LONG@ --trunk @TRUNK@ --preset laptop --prefill-chunk 16
long-ring2-c64  none  long   @LONG@ --trunk @TRUNK@ --trunk-gb @SLOT2@ --cache-gb 1 --prefill-chunk 64
long-pinned     none  long   @LONG@ --trunk @TRUNK@ --trunk-gb @ALL@ --cache-gb 1
ROWS
}

"$K3B_BIN" plan "$MODEL" --json > "$out/plan.json"
# layer sizes rounded to the O_DIRECT alignment, as the trunk plan counts them
read -r L0 LMAX TOTAL < <(jq -r '[.layers[].size | (. + 4095) - ((. + 4095) % 4096)] | [.[0], max, add] | @tsv' "$TRUNK/trunk.json")
gb() { awk -v b="$1" 'BEGIN {printf "%.4f", b / 1e9 + 0.0001}'; }
SLOT="$(gb "$LMAX")"
SLOT2="$(gb $((2 * LMAX)))"
PIN0="$(gb $((L0 + LMAX)))"
HALF="$(gb $((TOTAL / 2 + 2 * LMAX)))"
ALL="$(gb $((TOTAL + 13 * 4096)))"
{
    k3b_machine
    echo "model: $MODEL; packed trunk: $TRUNK ($TOTAL B in 4 KiB-rounded layers, largest $LMAX, layer 0 $L0)"
    echo "request: --ids $IDS --gen $GEN --incremental ${K3B_THREADS:+--threads $K3B_THREADS}; reps $REPS; long prompt $NLONG tokens"
    echo "budgets: one slot $SLOT GB, two slots $SLOT2 GB, layer 0 pinned + one slot $PIN0 GB, half $HALF GB, all pinned $ALL GB"
} > "$out/machine.txt"
cat "$out/machine.txt" >&2

if [ -n "${1:-}" ]; then rows="$(cat "$1")"; else rows="$(rows_default)"; fi
: > "$out/rows.tsv"
threads=()
if [ -n "${K3B_THREADS:-}" ]; then threads=(--threads "$K3B_THREADS"); fi

while read -r name cap group args; do
    [ -z "$name" ] && continue
    case "$name" in \#*) continue ;; esac
    key="$name-cap$cap"
    n=2
    while grep -q "^$key	" "$out/rows.tsv"; do
        key="$name-cap$cap-$n"
        n=$((n + 1))
    done
    for p in TRUNK SLOT SLOT2 PIN0 HALF ALL; do args="${args//@$p@/${!p}}"; done
    printf '%s\t%s\t%s\t%s\t%s\n' "$key" "$name" "$cap" "$group" "$args" >> "$out/rows.tsv"
    runs=()
    if [[ "$name" == m-* ]]; then
        runs+=(gen1)
        if [[ " $args " == *" --trunk "* ]]; then
            bw="$(k3b_probe_disk "$TRUNK/trunk.bin" "$out/$key.probe.json")"
            k3b_log "$key: trunk.bin QD16 $bw MB/s"
        else
            bw="$(k3b_probe_dram "$out/$key.dram.json")"
            k3b_log "$key: DRAM reference $bw GB/s"
        fi
    fi
    for r in $(seq 1 "$REPS"); do runs+=("r$r"); done
    for run in "${runs[@]}"; do
        g="$GEN"
        [ "$run" = gen1 ] && g=1
        a="$args"
        a="${a//@IDS@/--ids $IDS --gen $g --incremental}"
        a="${a//@IDS2@/--ids $IDS2 --gen $g --incremental}"
        a="${a//@LONG@/--ids $LONG --gen 2 --incremental}"
        a="${a//@BATCH@/--batch-ids $IDS;$IDS2 --gen $g --incremental}"
        # shellcheck disable=SC2206
        argv=($a)
        # streaming rows start cold; resident rows start with whatever the row's previous
        # run left in the page cache (k3-wide does not fit in 24 GB of RAM: warming it all
        # would only evict the first half; a measured row's --gen 1 run warms what it touches)
        if [[ " $args " == *" --trunk "* ]] || [ "$run" = gen1 ] || [ "$run" = r1 -a "$name" != m-* ]; then
            k3b_drop_caches
        fi
        cmd=("$K3B_BIN" "$MODEL" "${argv[@]}" "${threads[@]}" --out "$out/$key.$run.json")
        echo "${cmd[*]}" > "$out/$key.$run.cmd"
        k3b_run_capped "$cap" "$out/$key.$run.meta.json" "$out/$key.$run.log" -- "${cmd[@]}" || true
        k3b_log "$key $run: rc $(jq .rc "$out/$key.$run.meta.json"), $(jq -r '"\(.seconds_per_token // .seconds_per_step | .*1000|round/1000) s/token, first \(.first_token_seconds // .prefill_seconds |.*100|round/100) s, ids \(.generated_ids // [.sequences[].generated_ids] | tostring) \(.first_logits_hash // "")"' "$out/$key.$run.json" 2>/dev/null || echo 'no result') (load $(k3b_load))"
    done
done <<< "$rows"

dram="$(k3b_probe_dram "$out/dram-end.json")"
disk="$(k3b_probe_disk "$TRUNK/trunk.bin" "$out/disk-end.json")"
k3b_log "end: DRAM reference $dram GB/s; trunk.bin QD16 $disk MB/s"
echo "end load: $(cat /proc/loadavg)" >> "$out/machine.txt"
python3 "$(dirname "$0")/wide_report.py" "$out" | tee "$out/wide.md"
