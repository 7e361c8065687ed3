#!/usr/bin/env python3
"""Alternating A/B of whole k3-run processes (the A/B tables of docs/PERFORMANCE.md).

usage: bench/ab.py REPS "LABEL [ENV=VAL ...] BIN [FLAGS ...]" ... -- ARGS...

Each variant is a label, optional environment assignments, the binary and its own flags; ARGS
(model, prompt, budgets) are appended to every variant, plus `--out`. The variants run in turn,
REPS rounds, the page cache dropped before each run (root; set AB_NODROP=1 to keep it warm).
Prints each run's decode s/token (`seconds_per_token`), the expert read seconds and the first
ids, then the median and minimum per variant. AB_FIELD=NAME reports another figure of the
`--out` JSON instead (e.g. `first_token_seconds` for prompt passes). AB_SLEEP=S waits S seconds
before each run (after the drop): on a VM with free page reporting, the memory the previous run
freed is then handed back to the host, as for a run after idle time. Python stdlib only.
"""
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time


def main():
    if "--" not in sys.argv or len(sys.argv) < 4:
        sys.exit(__doc__)
    reps = int(sys.argv[1])
    i = sys.argv.index("--")
    variants, args = sys.argv[2:i], sys.argv[i + 1:]
    res = {v: [] for v in variants}
    out = os.path.join(tempfile.mkdtemp(prefix="k3-ab-"), "run.json")
    for _ in range(reps):
        for v in variants:
            parts = shlex.split(v)
            label, env, cmd = parts[0], dict(os.environ), []
            for p in parts[1:]:
                if not cmd and "=" in p and not p.startswith("/"):
                    k, val = p.split("=", 1)
                    env[k] = val
                else:
                    cmd.append(p)
            if not os.environ.get("AB_NODROP"):
                subprocess.run("sync; echo 3 > /proc/sys/vm/drop_caches", shell=True, check=False)
            time.sleep(float(os.environ.get("AB_SLEEP", "0")))
            p = subprocess.run(cmd + args + ["--out", out], env=env, capture_output=True, text=True)
            if p.returncode != 0:
                print(label, "FAILED", p.returncode, p.stderr[-500:], flush=True)
                continue
            with open(out) as f:
                d = json.load(f)
            e = d.get("experts", {})
            x = d[os.environ.get("AB_FIELD", "seconds_per_token")]
            res[v].append(x)
            print(label, round(x, 4), round(e.get("read_seconds", 0), 3),
                  d.get("generated_ids", [s.get("generated_ids", [])[:2]
                                          for s in d.get("sequences", [])])[:3], flush=True)
    for v in variants:
        xs = res[v]
        if xs:
            print("MEDIAN", shlex.split(v)[0], round(statistics.median(xs), 4),
                  "min", round(min(xs), 4), "n", len(xs))


if __name__ == "__main__":
    main()
