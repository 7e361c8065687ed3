#!/usr/bin/env python3
"""bench/report.py: turn a bench/ladder.sh or bench/flat.sh results directory into tables.

Usage: report.py ladder DIR   |   report.py flat DIR

Owns the arithmetic of the floors (stdlib only, no numpy):
  decode bytes/token = (bytes of the --gen N run - bytes of the --gen 1 run) / (N - 1)
      (the --gen 1 run is the prefill + first token of the same request; counters are
      deterministic, so the difference is exactly the N - 1 decode steps)
  I/O floor          = decode bytes/token / QD16 O_DIRECT bandwidth probed just before the row
      (engine counters trunk.bytes_read + experts.bytes_read; for --io mmap rows, whose trunk
      counter counts bytes served from the mapping, the blkio cgroup's disk bytes instead)
  memory floor       = weight bytes touched per token / DRAM read bandwidth (reference)
      touched = trunk (every layer) + active experts (plan: active_expert_bytes_per_layer x
      MoE layers) + lm_head and final norms (global_bytes minus the embedding table, of
      which one row is read)
  overlap goal       = s/token / max(compute, expert I/O floor), compute = fastest resident row's s/token
Exits 1 when the generated ids differ between rows (they must be identical everywhere).
"""

import json
import os
import statistics
import sys


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(x, spec=".3f", none="-"):
    return none if x is None else format(x, spec)


def touched_bytes(plan):
    layers = plan["layers"]
    trunk = sum(l["trunk_bytes"] for l in layers)
    n_moe = sum(1 for l in layers if l["ffn"] == "Moe")
    experts = plan["active_expert_bytes_per_layer"] * n_moe
    # embedding and lm_head are equal halves of global_bytes up to the final norms: count
    # lm_head + norms fully and one embedding row (negligible)
    glob = plan["global_bytes"]
    return trunk + experts + glob // 2, trunk, experts


def run_bytes(run, meta):
    eng = run["trunk"]["bytes_read"] + run["experts"]["bytes_read"]
    disk = meta.get("disk_read_bytes") if meta else None
    return eng, disk


def ladder(d):
    plan = load(os.path.join(d, "plan.json"))
    touched, trunk_b, active_b = touched_bytes(plan)
    rows = []
    with open(os.path.join(d, "rows.tsv")) as f:
        for line in f:
            key, name, cap, args = (line.rstrip("\n").split("\t") + [""])[:4]
            rows.append((key, name, cap, args))
    machine = open(os.path.join(d, "machine.txt")).read().strip()
    out = []
    res = {}
    all_ids = {}
    for key, name, cap, args in rows:
        g1 = load(os.path.join(d, f"{key}.gen1.json"))
        g1m = load(os.path.join(d, f"{key}.gen1.meta.json"))
        reps = []
        i = 1
        while True:
            r = load(os.path.join(d, f"{key}.r{i}.json"))
            m = load(os.path.join(d, f"{key}.r{i}.meta.json"))
            if m is None:
                break
            reps.append((r, m))
            i += 1
        ok = [(r, m) for r, m in reps if r is not None and m and m["rc"] == 0]
        probe = load(os.path.join(d, f"{key}.probe.json"))
        dram = load(os.path.join(d, f"{key}.dram.json"))
        bw = probe["disk_floor_mb_per_s"] * 1e6 if probe and probe.get("disk_floor_mb_per_s") else None
        if probe and probe.get("disk"):
            e_bw = {r["order"]: r["mb_per_s"] for r in probe["disk"]["reads"]}
        else:
            e_bw = {}
        dram_bw = dram["dram"]["reference_gb_per_s"] * 1e9 if dram and dram.get("dram") else None
        # The VM's DRAM probe has two phases (docs/history/PERFORMANCE-LOG.md §1.5): two threads
        # usually share ~30 GB/s, sometimes each gets its own (~55); show both figures.
        dram_1t = dram["dram"].get("one_thread_gb_per_s") if dram and dram.get("dram") else None
        e = {"key": key, "name": name, "cap": cap, "args": args, "n_ok": len(ok),
             "n_runs": len(reps), "rcs": [m["rc"] for _, m in reps], "bw": bw, "dram_bw": dram_bw,
             "dram_1t": dram_1t,
             "bw_orders": e_bw}
        if ok:
            n_dec = len(ok[0][0]["generated_ids"]) - 1
            for r, _ in ok:
                all_ids.setdefault(tuple(r["generated_ids"]), []).append(key)
            # the --gen 1 run's single id must be the first id of the full runs
            if g1 is not None and g1["generated_ids"] != ok[0][0]["generated_ids"][:1]:
                all_ids.setdefault(tuple(g1["generated_ids"]), []).append(key + " (gen1)")
            e["spt"] = [r["seconds_per_token"] for r, _ in ok]
            e["first"] = [r["first_token_seconds"] for r, _ in ok]
            e["pinned_load"] = med([r["pinned_load_seconds"] for r, _ in ok])
            e["pinned_layers"] = ok[0][0]["trunk"]["pinned_layers"]
            e["n_layers"] = ok[0][0]["trunk"]["n_layers"]
            e["pinned_bytes"] = ok[0][0]["trunk"]["pinned_bytes"]
            e["ring"] = ok[0][0]["trunk"]["ring_slots"]
            e["hit"] = med([r["experts"]["resident_hit_rate"] for r, _ in ok])
            e["rss"] = max(r["peak_rss_bytes"] for r, _ in ok)
            e["cg_peak"] = max((m["cgroup_peak_bytes"] or 0) for _, m in ok) or None
            e["load"] = med([m["load_before"] for _, m in ok])
            e["ids"] = ok[0][0]["generated_ids"]
            if g1 is not None and n_dec > 0:
                per = lambda f: med([(f(r, m) - f(g1, g1m)) / n_dec for r, m in ok])
                e["trunk_b"] = per(lambda r, m: r["trunk"]["bytes_read"])
                e["exp_b"] = per(lambda r, m: r["experts"]["bytes_read"])
                if all(m.get("disk_read_bytes") is not None for _, m in ok) and g1m and \
                        g1m.get("disk_read_bytes") is not None:
                    e["disk_b"] = per(lambda r, m: m["disk_read_bytes"])
                # the pinned-prefix load is in both counters (in wait_seconds: the whole load
                # when it ran in the session build, the run's waits for it when it ran in the
                # background); take it out before differencing
                def pin_wait(r):
                    t = r["trunk"]
                    return t.get("pinned_wait_seconds", 0.0) if t.get("pinned_background") \
                        else r["pinned_load_seconds"]
                e["wait"] = per(lambda r, m: r["trunk"]["wait_seconds"] - pin_wait(r))
                e["tread"] = per(lambda r, m: r["trunk"]["read_seconds"] - r["pinned_load_seconds"])
                e["eread"] = per(lambda r, m: r["experts"]["read_seconds"])
                if all(m.get("user_seconds") is not None for _, m in ok) and g1m and \
                        g1m.get("user_seconds") is not None:
                    e["cpu"] = per(lambda r, m: m["user_seconds"] + m["sys_seconds"])
        res[key] = e

    # floors and ratios
    # compute = the FASTEST resident row of the run (strictest: the resident rows of one ladder
    # differ by up to 25% with their position in it)
    resident = [e for e in res.values() if e["name"].startswith("resident") and e.get("spt")]
    compute = min(med(e["spt"]) for e in resident) if resident else None
    for e in res.values():
        if not e.get("spt"):
            continue
        s = med(e["spt"])
        e["spt_med"] = s
        if e["name"].startswith("resident"):
            if e["dram_bw"]:
                e["floor"] = touched / e["dram_bw"]
                e["floor_kind"] = "memory"
        else:
            mmap = "--io mmap" in e["args"]
            b = e.get("disk_b") if mmap else (
                (e["trunk_b"] + e["exp_b"]) if e.get("trunk_b") is not None else None)
            e["io_b"] = b
            if b is not None and e["bw"]:
                e["floor"] = b / e["bw"]
                e["floor_kind"] = "I/O" + (" (disk bytes)" if mmap else "")
        if e.get("floor"):
            e["ratio"] = s / e["floor"]

    out.append("```\n" + machine + "\n```\n")
    out.append(f"Weight bytes touched per token (memory floor numerator): {touched/1e9:.4f} GB "
               f"(trunk {trunk_b/1e9:.4f} + active experts {active_b/1e9:.4f} + lm_head/norms).\n")
    out.append("| row | cap GB | decode s/token (median; min-max) | first token s | pinned | "
               "read GB/token (trunk + experts) | disk GB/token | floor bw | floor s/token | "
               "ratio | resident hit | peak RSS MB | cgroup peak MB | load |")
    out.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for key, *_ in rows:
        e = res[key]
        if not e.get("spt"):
            out.append(f"| {key} | {e['cap']} | FAILED (rc {e['rcs']}) | | | | | | | | | | | |")
            continue
        bo = e.get("bw_orders", {})
        bw = (f"{e['dram_bw']/1e9:.2f} GB/s DRAM (1 thread {e['dram_1t'] or 0:.1f})"
              if e["name"].startswith("resident")
              else (f"{e['bw']/1e6:.0f} MB/s QD16 (rnd {bo.get('random', 0):.0f} / seq "
                    f"{bo.get('sequential', 0):.0f})" if e["bw"] else "-"))
        tb = e.get("trunk_b")
        rd = f"{tb/1e9:.3f} + {e['exp_b']/1e9:.3f}" if tb is not None else "-"
        out.append(
            f"| {e['name']} | {e['cap']} | {e['spt_med']:.3f} ({min(e['spt']):.3f}-{max(e['spt']):.3f}, n={len(e['spt'])}) "
            f"| {med(e['first']):.2f} | {e['pinned_layers']}/{e['n_layers']}, ring {e['ring']} | {rd} "
            f"| {fmt(e.get('disk_b') and e['disk_b']/1e9)} | {bw} "
            f"| {fmt(e.get('floor'))} {e.get('floor_kind','')} | {fmt(e.get('ratio'), '.2f')}x "
            f"| {100*e['hit']:.1f}% | {e['rss']/1e6:.0f} | {fmt(e['cg_peak'] and e['cg_peak']/1e6, '.0f')} "
            f"| {fmt(e['load'], '.1f')} |")
    out.append("")
    out.append("Where decode time goes (per decode token, medians; trunk wait = executor blocked on "
               "the trunk, trunk read = reader busy, expert read = expert misses, in the executor's "
               "path; CPU = (user+sys of --gen N - --gen 1) / (N-1), '-' when start-up noise "
               "(e.g. huge-page compaction in the pinned load) makes it negative):\n")
    out.append("| row | s/token | trunk wait | trunk read | expert read | rest (compute + other) | CPU s/token (user+sys, all threads) |")
    out.append("|---|---|---|---|---|---|---|")
    for key, *_ in rows:
        e = res[key]
        if not e.get("spt") or e.get("wait") is None:
            continue
        rest = e["spt_med"] - e["wait"] - e["eread"]
        out.append(f"| {key} | {e['spt_med']:.3f} | {e['wait']:.3f} | {e['tread']:.3f} | "
                   f"{e['eread']:.3f} | {rest:.3f} | {fmt(e['cpu'] if (e.get('cpu') or -1) > 0 else None)} |")
    out.append("")

    # goals
    out.append("Goals:\n")
    out.append("| goal | row | measured | target | verdict |")
    out.append("|---|---|---|---|---|")
    for e in res.values():
        if not e.get("ratio"):
            continue
        if e["name"].startswith("resident"):
            out.append(f"| resident decode <= 1.3x memory floor | {e['key']} | {e['ratio']:.2f}x "
                       f"({e['spt_med']:.3f} vs {e['floor']:.3f} s) | 1.30x | "
                       f"{'met' if e['ratio'] <= 1.3 else 'MISSED'} |")
        elif e["name"].startswith("pinned"):
            eb = e["exp_b"] / e["bw"] if e["bw"] else None
            if compute and eb:
                bound = max(compute, eb)
                r = e["spt_med"] / bound
                out.append(f"| trunk pinned, experts streaming <= 1.2x max(compute, expert I/O) | "
                           f"{e['key']} | {r:.2f}x ({e['spt_med']:.3f} vs max({compute:.3f}, {eb:.3f}) s) "
                           f"| 1.20x | {'met' if r <= 1.2 else 'MISSED'} |")
            if e["pinned_load"] and e["bw"]:
                rate = e["pinned_bytes"] / e["pinned_load"]
                out.append(f"| first token loads the pinned prefix at QD16 bandwidth | {e['key']} | "
                           f"{rate/1e6:.0f} MB/s ({e['pinned_bytes']/1e9:.2f} GB in {e['pinned_load']:.2f} s) "
                           f"vs QD16 {e['bw']/1e6:.0f} MB/s = {rate/e['bw']:.2f}x | >= 1.0x | "
                           f"{'met' if rate >= e['bw'] else 'MISSED'} |")
        elif "--io mmap" not in e["args"]:
            out.append(f"| streaming decode <= 1.10x I/O floor | {e['key']} | {e['ratio']:.2f}x "
                       f"({e['spt_med']:.3f} vs {e['floor']:.3f} s) | 1.10x | "
                       f"{'met' if e['ratio'] <= 1.1 else 'MISSED'} |")
    if compute:
        for e in res.values():
            if "--io mmap" in e["args"] and e.get("spt_med"):
                out.append(f"| (comparison) mmap policy vs resident | {e['key']} | "
                           f"{e['spt_med']/compute:.1f}x resident s/token | - | - |")
    out.append("")
    ok = len(all_ids) == 1
    if ok:
        ids = next(iter(all_ids))
        out.append(f"ids: identical on every row and run ({sum(e['n_ok'] for e in res.values())} runs "
                   f"of --gen N, first id checked on every --gen 1 run): "
                   f"{','.join(map(str, ids))}")
    else:
        out.append("ids: DIFFER between rows:")
        for ids, keys in all_ids.items():
            out.append(f"  {','.join(map(str, ids))}: {', '.join(keys)}")
    failed = [e["key"] for e in res.values() if e["n_ok"] < e["n_runs"]]
    if failed:
        out.append(f"runs that failed (rc != 0): {', '.join(failed)}")
    print("\n".join(out))
    with open(os.path.join(d, "summary.json"), "w") as f:
        json.dump({"touched_bytes": touched, "rows": res, "ids_identical": ok}, f, indent=1,
                  default=str)
    return 0 if ok else 1


def flat(d):
    rows = []
    with open(os.path.join(d, "rows.tsv")) as f:
        for line in f:
            key, cache = line.rstrip("\n").split("\t")[:2]
            rows.append((key, cache))
    machine = open(os.path.join(d, "machine.txt")).read().strip()
    out = ["```\n" + machine + "\n```\n"]
    out.append("| cache GB | experts it holds | requests | hits | misses | evictions | "
               "TRUE resident hit rate | raw hit rate | expert GB read | expert read s | decode s/token | load |")
    out.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
    all_ids = {}
    for key, cache in rows:
        r = load(os.path.join(d, f"{key}.json"))
        m = load(os.path.join(d, f"{key}.meta.json"))
        if r is None:
            out.append(f"| {cache} | FAILED | | | | | | | | | | |")
            continue
        all_ids.setdefault(tuple(r["generated_ids"]), []).append(key)
        x = r["experts"]
        cap_experts = None
        for line in r.get("memory_plan", []):
            if line.startswith("expert cache:") and "=" in line:
                cap_experts = line.split("=")[1].split()[0]
        raw = x["hits"] / x["requests"] if x["requests"] else 0
        out.append(f"| {cache} | {cap_experts or '-'} | {x['requests']} | {x['hits']} | {x['misses']} | "
                   f"{x['evictions']} | {100*x['resident_hit_rate']:.2f}% | {100*raw:.2f}% | "
                   f"{x['bytes_read']/1e9:.3f} | {x['read_seconds']:.2f} | {r['seconds_per_token']:.3f} | "
                   f"{m['load_before'] if m else '-'} |")
    out.append("")
    if len(all_ids) == 1:
        out.append(f"ids: identical at every cache size: {','.join(map(str, next(iter(all_ids))))}")
    else:
        out.append("ids: DIFFER between cache sizes:")
        for ids, keys in all_ids.items():
            out.append(f"  {','.join(map(str, ids))}: {', '.join(keys)}")
    sim = os.path.join(d, "sim-cache.txt")
    if os.path.exists(sim):
        out.append("\n`k3-run sim-cache` on the trace:\n\n```\n" + open(sim).read().rstrip() + "\n```")
    print("\n".join(out))
    return 0 if len(all_ids) == 1 else 1


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("ladder", "flat"):
        print(__doc__)
        sys.exit(2)
    sys.exit(ladder(sys.argv[2]) if sys.argv[1] == "ladder" else flat(sys.argv[2]))
