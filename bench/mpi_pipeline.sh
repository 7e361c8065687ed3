#!/usr/bin/env bash
# bench/mpi_pipeline.sh: k3-mini, `mpirun -np 3 ... --pipeline` with each rank in its own
# cgroup v1 memory cap against one process at the sum of those caps (docs/SCALE-OUT.md "Measured").
#
# For batch 1, 2 and 4 (prompts 1,2,3,4 / 5,6,7 / 8,9 / 10,11,12,13,14; --gen $K3B_GEN), REPS
# rounds, alternating, the page cache dropped before every run:
#   single  one process under a cap of TOTAL_GB, the trunk streamed from the packed trunk at
#           the desktop preset's budgets scaled to k3-mini (as bench/ladder.sh scales them)
#   pinned  (K3B_MPI_PINNED=1) one process under the same cap with the largest trunk budget
#           it can pin there (PINNED_TRUNK_GB)
#   pipe    mpirun -np 3 (shared memory, --oversubscribe), rank r in a cgroup capped at
#           TOTAL_GB / 3, --host-gb TOTAL_GB/3 x 3 (each rank's layers pinned when they fit),
#           each rank an expert cache of a third of the single run's (O_DIRECT reads, as the
#           single run's: the memory-mapped experts would thrash the page cache under the cap)
# and checks that every run gives the same ids and first-step logits hash. Root (caps,
# drop_caches), jq, python3, GNU time; a k3-run built with --features mpi; MPI.
#
# Env: K3B_BIN, K3B_MODEL, K3B_TRUNK, K3B_OUT (bench/lib.sh); TOTAL_GB [3.3]; REPS [3];
#      K3B_GEN [16]; BATCHES ["1 2 4"]; K3B_MPI_PINNED [0]; PINNED_TRUNK_GB [2.2]
# Output: $out/rows.tsv (one line per run), $out/summary.md (medians), every run's JSON/log.

# shellcheck source=bench/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
k3b_k3mini_setup mpi_pipeline.sh
command -v mpirun > /dev/null || k3b_die "needs mpirun (apt-get install -y libopenmpi-dev openmpi-bin)"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

TOTAL_GB="${TOTAL_GB:-3.3}"
REPS="${REPS:-3}"
GEN="${K3B_GEN:-16}"
BATCHES="${BATCHES:-1 2 4}"
PINNED_TRUNK_GB="${PINNED_TRUNK_GB:-2.2}"
RANK_GB="$(awk -v t="$TOTAL_GB" 'BEGIN {printf "%.4f", t/3}')"
out="$(k3b_outdir mpi_pipeline)"

declare -A P=([1]="1,2,3,4" [2]="1,2,3,4;5,6,7" [4]="1,2,3,4;5,6,7;8,9;10,11,12,13,14")

"$K3B_BIN" plan "$MODEL" --json > "$out/plan.json"
read -r TRUNK_B EXP_B < <(jq -r '[([.layers[].trunk_bytes]|add), ([.layers[].expert_bytes]|add)] | @tsv' "$out/plan.json")
DT="$(awk -v v="$TRUNK_B" 'BEGIN {printf "%.4f", 16.00*v/108.81e9}')"
DC="$(awk -v v="$EXP_B" 'BEGIN {printf "%.4f", 10.00*v/1446.46e9}')"
RC="$(awk -v c="$DC" 'BEGIN {printf "%.4f", c/3}')"
"$K3B_BIN" plan "$MODEL" --host-gb "$RANK_GB,$RANK_GB,$RANK_GB" --cache-gb "$RC" > "$out/split.txt"

{
    k3b_machine
    echo "mpi: $(mpirun --version | head -1)"
    echo "model: $MODEL (trunk $TRUNK_B B, experts $EXP_B B); packed trunk: $TRUNK"
    echo "total cap $TOTAL_GB GB: single process capped at it; 3 ranks capped at $RANK_GB GB each"
    echo "single: --trunk $TRUNK --trunk-gb $DT --cache-gb $DC --incremental --threads 2 (desktop preset scaled)"
    echo "pipe: --pipeline --host-gb $RANK_GB x 3 --cache-gb $RC (a third of the single's cache) --threads 1 per rank"
    echo "gen $GEN; reps $REPS; batches $BATCHES"
    cat "$out/split.txt"
} > "$out/machine.txt"
cat "$out/machine.txt" >&2

# One rank of the pipeline in its own memory cgroup: mpirun starts this per rank.
cat > "$out/rank.sh" << 'EOF'
#!/usr/bin/env bash
echo "$$" > "$K3B_RANK_CG/rank$OMPI_COMM_WORLD_RANK/cgroup.procs" || exit 97
exec "$@"
EOF
chmod +x "$out/rank.sh"

# ids/s, steps, seconds per step, ids + first hashes (one string), trunk bytes read per rank
summ() { # out.json
    python3 - "$1" << 'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
g = sum(len(s["generated_ids"]) for s in d["sequences"])
ids = "|".join(",".join(map(str, s["generated_ids"])) + ":" + s["first_logits_hash"] for s in d["sequences"])
p = d.get("pipeline")
if p:
    ranks = p["ranks"]
    extra = "tps=%.3f hop_us=%.1f hop_bytes=%d carry_hop_us=%.1f carry_hop_bytes=%d trunk_read=%s compute=%s wait=%s send=%s items=%s rss=%s" % (
        p["tokens_per_second"], p["hop_seconds"] * 1e6, p["hop_bytes"],
        p.get("carry_hop_seconds", 0) * 1e6, p.get("carry_hop_bytes", 0),
        ",".join(str(r["trunk_bytes_read"]) for r in ranks),
        ",".join("%.3f" % r["compute_seconds"] for r in ranks),
        ",".join("%.3f" % r["wait_seconds"] for r in ranks),
        ",".join("%.4f" % r["send_seconds"] for r in ranks),
        ",".join(str(r["items"]) for r in ranks),
        ",".join("%.3f" % (r["peak_rss_bytes"] / 1e9) for r in ranks))
else:
    extra = "tps=%.3f" % (g / d["total_seconds"])
print("%.3f\t%s\t%s" % (g / d["total_seconds"], ids, extra))
EOF
}

run_single() { # name batch rep args...
    local name="$1" batch="$2" rep="$3" tag
    shift 3
    tag="$name-b$batch-r$rep"
    k3b_drop_caches
    echo "$K3B_BIN $MODEL --batch-ids ${P[$batch]} --gen $GEN --incremental --threads 2 --out $out/$tag.json $*" > "$out/$tag.cmd"
    k3b_run_capped "$TOTAL_GB" "$out/$tag.meta.json" "$out/$tag.log" -- \
        "$K3B_BIN" "$MODEL" --batch-ids "${P[$batch]}" --gen "$GEN" --incremental --threads 2 \
        --out "$out/$tag.json" "$@" || true
    row "$name" "$batch" "$rep" "$tag"
}

run_pipe() { # batch rep
    local batch="$1" rep="$2" tag cg r
    tag="pipe-b$batch-r$rep"
    cg="$K3B_MEMCG/k3bench-mpi-$$-$RANDOM"
    mkdir "$cg"
    for r in 0 1 2; do
        mkdir "$cg/rank$r"
        echo "$(awk -v g="$RANK_GB" 'BEGIN {printf "%.0f", g*1e9}')" > "$cg/rank$r/memory.limit_in_bytes"
        if [ -e "$cg/rank$r/memory.memsw.limit_in_bytes" ]; then
            cat "$cg/rank$r/memory.limit_in_bytes" > "$cg/rank$r/memory.memsw.limit_in_bytes"
        fi
    done
    k3b_drop_caches
    local cmd=(mpirun -np 3 --oversubscribe --mca btl self,vader -x K3B_RANK_CG="$cg" "$out/rank.sh"
        "$K3B_BIN" "$MODEL" --pipeline --host-gb "$RANK_GB,$RANK_GB,$RANK_GB" --cache-gb "$RC" --batch-ids "${P[$batch]}"
        --gen "$GEN" --threads 1 --out "$out/$tag.json")
    echo "${cmd[*]}" > "$out/$tag.cmd"
    k3b_run_capped none "$out/$tag.meta.json" "$out/$tag.log" -- "${cmd[@]}" || true
    for r in 0 1 2; do
        echo "rank $r: cap $RANK_GB GB, cgroup peak $(cat "$cg/rank$r/memory.max_usage_in_bytes") B, failcnt $(cat "$cg/rank$r/memory.failcnt"), oom_kill $(awk '/oom_kill / {print $2}' "$cg/rank$r/memory.oom_control")" >> "$out/$tag.caps"
        rmdir "$cg/rank$r" 2>/dev/null || { sleep 1; rmdir "$cg/rank$r" 2>/dev/null || true; }
    done
    rmdir "$cg" 2>/dev/null || true
    row pipe "$batch" "$rep" "$tag"
}

row() { # name batch rep tag
    local s="-	-	-"
    if [ -s "$out/$4.json" ]; then s="$(summ "$out/$4.json")"; fi
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$s" \
        "$(jq -r '"rc=\(.rc) wall=\(.wall_seconds) disk_read=\(.disk_read_bytes) peak=\(.cgroup_peak_bytes) load=\(.load_before)"' "$out/$4.meta.json")" \
        "$([ -f "$out/$4.caps" ] && tr '\n' ';' < "$out/$4.caps")" | tee -a "$out/rows.tsv" >&2
}

: > "$out/rows.tsv"
for rep in $(seq "$REPS"); do
    for batch in $BATCHES; do
        run_single single "$batch" "$rep" --trunk "$TRUNK" --trunk-gb "$DT" --cache-gb "$DC"
        run_pipe "$batch" "$rep"
        if [ "${K3B_MPI_PINNED:-0}" = 1 ]; then
            run_single pinned "$batch" "$rep" --trunk "$TRUNK" --trunk-gb "$PINNED_TRUNK_GB" --cache-gb "$DC"
        fi
    done
done

# medians per (name, batch); every run's ids must equal the batch's first single run's
rc=0
python3 - "$out/rows.tsv" > "$out/summary.md" << 'EOF' || rc=$?
import statistics, sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
want, bad, by = {}, [], {}
for name, batch, rep, tps, ids, extra, meta, caps in rows:
    if ids == "-" or "rc=0" not in meta:
        bad.append(f"{name} batch {batch} rep {rep}: failed ({meta})")
        continue
    want.setdefault(batch, ids)
    if ids != want[batch]:
        bad.append(f"{name} batch {batch} rep {rep}: ids differ")
    by.setdefault((name, batch), []).append(float(tps))
print("| run | batch | ids/s (median) | runs |")
print("|---|---|---|---|")
for (name, batch), v in sorted(by.items(), key=lambda kv: (int(kv[0][1]), kv[0][0])):
    print(f"| {name} | {batch} | {statistics.median(v):.3f} | {', '.join(f'{x:.3f}' for x in v)} |")
print()
print("ids and first-step hashes: " + ("all equal" if not bad else "; ".join(bad)))
sys.exit(1 if bad else 0)
EOF
cat "$out/summary.md" >&2
k3b_log "results in $out"
exit "$rc"
