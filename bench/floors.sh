#!/usr/bin/env bash
# bench/floors.sh: the two floors every end-to-end figure is compared with, via `k3-run doctor`.
#
#   DRAM streaming-read bandwidth (all threads and one thread; reference = the larger)
#   O_DIRECT random-read bandwidth of the disk at queue depth 1 and 16, 8 MiB reads
#     (a test file written under $K3B_WORK and deleted), plus expert-sized reads
#     (408 KiB = one k3-mini routed expert) at queue depth 1 and 8 (the expert pool's depth)
#
# Usage: bench/floors.sh [SIZE_GB]        (default 4; results in $K3B_OUT or $K3B_WORK/results)
# Output: floors.json (the doctor's JSON), floors-expert.json, floors.txt (what was printed).
source "$(dirname "$0")/lib.sh"
k3b_need_bin
size="${1:-4}"
out="$(k3b_outdir floors)"
{
    k3b_machine
    echo
    echo "\$ k3-run doctor --dir $K3B_WORK --size-gb $size --json floors.json"
    "$K3B_BIN" doctor --dir "$K3B_WORK" --size-gb "$size" --json "$out/floors.json" || true
    echo
    echo "\$ k3-run doctor --dir $K3B_WORK --size-gb $size --block-kib 408 --qd 1,8 --no-dram --json floors-expert.json"
    "$K3B_BIN" doctor --dir "$K3B_WORK" --size-gb "$size" --block-kib 408 --qd 1,8 --no-dram \
        --json "$out/floors-expert.json" || true
    echo "load after: $(cat /proc/loadavg)"
} 2>&1 | tee "$out/floors.txt"
jq -r '"floors: DRAM reference \(.dram.reference_gb_per_s*100|round/100) GB/s; O_DIRECT 8 MiB: " + ([.disk.reads[] | "\(.order) QD\(.qd) \(.mb_per_s|round) MB/s"] | join(", ")) + "; I/O floor bandwidth \(.disk_floor_mb_per_s|round) MB/s"' \
    "$out/floors.json"
echo "results: $out"
