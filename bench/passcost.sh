#!/usr/bin/env bash
# bench/passcost.sh: what one layer-major pass over n tokens costs against a one-token step, at
# a streaming budget: the bound on what speculative decoding (--speculate) gains when its
# guesses hold (docs/PERFORMANCE.md, "Batching, prompt passes and speculation").
#
# Usage: sudo bench/passcost.sh
#   Env: K3B_MODEL [$K3B_WORK/k3-mini]  K3B_TRUNK [$K3B_WORK/k3-mini-trunk]
#        K3B_REPS [3]  K3B_FLAGS [--trunk-gb 0.1 --cache-gb 0.0017]  (the ring2 row)
#
# Per round and n in 1 2 4 8: page cache dropped, then `k3-run MODEL --ids 1..n --gen 2
# --incremental --trunk TRUNK FLAGS`: its prefill_seconds is one pass over n tokens (the first
# pass of the run), its seconds_per_token one single-token step. Prints "round n pass step".
source "$(dirname "$0")/lib.sh"
k3b_k3mini_setup "bench/passcost.sh"
REPS="${K3B_REPS:-3}"
read -r -a FLAGS <<< "${K3B_FLAGS:---trunk-gb 0.1 --cache-gb 0.0017}"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
echo "round n pass_s step_s"
for rep in $(seq 1 "$REPS"); do
    for n in 1 2 4 8; do
        ids="$(seq -s, 1 "$n")"
        k3b_drop_caches
        "$K3B_BIN" "$MODEL" --ids "$ids" --gen 2 --incremental --trunk "$TRUNK" "${FLAGS[@]}" \
            --out "$out/run.json" > /dev/null 2>&1 || k3b_die "run failed: n=$n"
        echo "$rep $n $(jq -r '"\(.prefill_seconds) \(.seconds_per_token)"' "$out/run.json")"
    done
done
