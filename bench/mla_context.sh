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
for n in "$@"; do
    ids="$(python3 -c "import random; r = random.Random(32); s = [r.randint(10, 99) for _ in range(32768)]; print(','.join(map(str, s[:$n])))")"
    for side in before after; do
        bin="$before"; [ "$side" = after ] && bin="$after"
        l0="$(k3b_load)"; t0="$(date -u +%H:%M:%S)"
        k3b_log "$side, context $n (load $l0)"
        "$bin" "$MODEL" --ids "$ids" --gen 4 --incremental --max-context $((n + 16)) \
            --out "$out/$side-$n.json" > "$out/$side-$n.log" 2>&1 \
            || k3b_die "$side run at $n failed: see $out/$side-$n.log"
        l1="$(k3b_load)"
        jq -r --arg side "$side" --arg n "$n" --arg t0 "$t0" --arg l "$l0, $l1" \
            '"\($n) \($side) s/token \(.seconds_per_token) prefill_s \(.prefill_seconds) ids \(.generated_ids|map(tostring)|join(",")) hash \(.first_logits_hash) start \($t0) load \($l)"' \
            "$out/$side-$n.json" | tee -a "$out/summary.txt"
    done
done
echo "results: $out"
