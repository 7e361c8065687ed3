#!/usr/bin/env bash
# k3-mini: single process (resident, 2 threads) vs mpirun -np 3 --pipeline (1 thread per rank), batch 1/2/4, 3 runs each
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
B=${K3B_BIN:-target/release/k3-run}
M=${K3B_MODEL:-/work/bench/k3-mini}
declare -A P=([1]="1,2,3,4" [2]="1,2,3,4;5,6,7" [4]="1,2,3,4;5,6,7;8,9;10,11,12,13,14")
for batch in 1 2 4; do
  for rep in 1 2 3; do
    $B $M --batch-ids "${P[$batch]}" --gen 16 --incremental --threads 2 --out ${TMPDIR:-/tmp}/k3b-mpi-single.json > /dev/null 2>&1
    s=$(python3 -c "import json;d=json.load(open('${TMPDIR:-/tmp}/k3b-mpi-single.json'));g=sum(len(x['generated_ids']) for x in d['sequences']);print(f\"{g/d['total_seconds']:.3f} {d['seconds_per_step']:.4f}\")")
    mpirun -np 3 --oversubscribe --mca btl self,vader $B $M --pipeline --batch-ids "${P[$batch]}" --gen 16 --threads 1 --out ${TMPDIR:-/tmp}/k3b-mpi-pipe.json > ${TMPDIR:-/tmp}/k3b-mpi-pipe.out 2>&1
    p=$(python3 -c "import json;d=json.load(open('${TMPDIR:-/tmp}/k3b-mpi-pipe.json'));print(f\"{d['pipeline']['tokens_per_second']:.3f} {d['pipeline']['hop_seconds']*1e6:.1f}\")")
    same=$(python3 -c "import json;a=json.load(open('${TMPDIR:-/tmp}/k3b-mpi-single.json'));b=json.load(open('${TMPDIR:-/tmp}/k3b-mpi-pipe.json'));print(all(x['generated_ids']==y['generated_ids'] and x['first_logits_hash']==y['first_logits_hash'] for x,y in zip(a['sequences'],b['sequences'])))")
    echo "batch $batch rep $rep single_ids_per_s,s_per_step $s pipeline_ids_per_s,hop_us $p same $same"
  done
done
