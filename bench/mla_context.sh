#!/usr/bin/env bash
# bench/mla_context.sh: decode s/token after a long prompt, for two builds side by side (the
# MLA cache before and after a change), on k3-mini with every weight in RAM through the map.
#
# The prompt: ids 10-99 from Python's random.Random(32), the first N of one 32,768-id sequence,
# so every context length is a prefix of the same text. Each run is
#   k3-run MODEL --ids <N ids> --gen 4 --incremental --max-context N+16 --out run.json
# and its s/token is the run's decode figure (3 incremental steps after the first). The two
# builds run one after the other for each N, the before build first.
#
# Usage: bench/mla_context.sh BEFORE_BIN AFTER_BIN N...        (e.g. 1024 8192)
#
# Long contexts (32k): the prompt pass attends to every earlier position, so its cost grows
# with N^2 (a 32k prompt: hours on 2 cores). For decode figures at such N, build both sides
# with bench/mla-window/*.patch applied (`git apply`; before-da8789a.patch on da8789a,
# after.patch on the latent build) and set K3_BENCH_PREFILL_WINDOW=W: the prompt pass then
# attends to its last W positions only, every layer still runs on every prompt token and the
# cache still holds all N positions, and the decode steps (the figure) attend to all of them.
# The ids then differ from an unpatched run's; the decode work per step does not.
#
# K3B_STATE_REPS=R (decode medians without repeating the prompt pass): each side prefills the
# first N-1 ids once with `--gen 0 --save-state`, then R runs per side, the sides alternating,
# each `--load-state` + the N-th id `--gen 4 --incremental` (its s/token as above). The state
# files (N x the cache bytes per position; 6.5 GB for the expanded cache at 32k) are deleted
# at the end.
# Environment: K3B_MODEL [$K3B_WORK/k3-mini], K3B_WORK [/work/bench], K3B_OUT.
# Output: <label>-<N>.json and .log per run, summary.txt (one row per N).
source "$(dirname "$0")/lib.sh"
[ $# -ge 3 ] || k3b_die "usage: bench/mla_context.sh BEFORE_BIN AFTER_BIN N..."
before="$1"; after="$2"; shift 2
for b in "$before" "$after"; do [ -x "$b" ] || k3b_die "no executable at $b"; done
command -v jq > /dev/null || k3b_die "needs jq"
MODEL="${K3B_MODEL:-$K3B_WORK/k3-mini}"
[ -f "$MODEL/config.json" ] || k3b_die "no model at $MODEL (k3-run synth --spec configs/synth/k3-mini.toml --seed 7 --out $MODEL)"
out="$(k3b_outdir mla-context)"
K3B_BIN="$after" k3b_machine > "$out/machine.txt"
echo "before: $before ($("$before" --version))" >> "$out/machine.txt"
if [ -n "${K3_BENCH_PREFILL_WINDOW:-}" ]; then echo "K3_BENCH_PREFILL_WINDOW=$K3_BENCH_PREFILL_WINDOW (patched builds)" >> "$out/machine.txt"; fi
row() { # row N SIDE LOAD0 T0 JSON
    jq -r --arg side "$2" --arg n "$1" --arg t0 "$4" --arg l "$3, $(k3b_load)" \
        '"\($n) \($side) s/token \(.seconds_per_token) prefill_s \(.prefill_seconds) ids \(.generated_ids|map(tostring)|join(",")) hash \(.first_logits_hash) start \($t0) load \($l)"' \
        "$5" | tee -a "$out/summary.txt"
}
for n in "$@"; do
    ids="$(python3 -c "import random; r = random.Random(32); s = [r.randint(10, 99) for _ in range(32768)]; print(','.join(map(str, s[:$n])))")"
    if [ -n "${K3B_STATE_REPS:-}" ]; then
        head="${ids%,*}"; last="${ids##*,}"
        for side in before after; do
            bin="$before"; [ "$side" = after ] && bin="$after"
            l0="$(k3b_load)"; t0="$(date -u +%H:%M:%S)"
            k3b_log "$side, prompt pass of $((n - 1)) ids, saving the state (load $l0)"
            "$bin" "$MODEL" --ids "$head" --gen 0 --incremental --max-context $((n + 16)) \
                --save-state "$out/$side-$n.state" --out "$out/$side-$n-prefill.json" \
                > "$out/$side-$n-prefill.log" 2>&1 \
                || k3b_die "$side prompt pass at $n failed: see $out/$side-$n-prefill.log"
            echo "$n $side prompt pass $(jq -r .prefill_seconds "$out/$side-$n-prefill.json") s, start $t0, load $l0, $(k3b_load)" \
                | tee -a "$out/summary.txt"
        done
        for r in $(seq "$K3B_STATE_REPS"); do
            for side in before after; do
                bin="$before"; [ "$side" = after ] && bin="$after"
                l0="$(k3b_load)"; t0="$(date -u +%H:%M:%S)"
                k3b_log "$side, context $n from the saved state, round $r (load $l0)"
                "$bin" "$MODEL" --load-state "$out/$side-$n.state" --ids "$last" --gen 4 \
                    --incremental --max-context $((n + 16)) --out "$out/$side-$n-r$r.json" \
                    > "$out/$side-$n-r$r.log" 2>&1 \
                    || k3b_die "$side run at $n failed: see $out/$side-$n-r$r.log"
                row "$n" "$side" "$l0" "$t0" "$out/$side-$n-r$r.json"
            done
        done
        rm -f "$out"/*-"$n".state
        continue
    fi
    for side in before after; do
        bin="$before"; [ "$side" = after ] && bin="$after"
        l0="$(k3b_load)"; t0="$(date -u +%H:%M:%S)"
        k3b_log "$side, context $n (load $l0)"
        "$bin" "$MODEL" --ids "$ids" --gen 4 --incremental --max-context $((n + 16)) \
            --out "$out/$side-$n.json" > "$out/$side-$n.log" 2>&1 \
            || k3b_die "$side run at $n failed: see $out/$side-$n.log"
        row "$n" "$side" "$l0" "$t0" "$out/$side-$n.json"
    done
done
echo "results: $out"
