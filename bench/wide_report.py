#!/usr/bin/env python3
"""bench/wide_report.py: the table of a bench/wide.sh results directory, and the identity check.

Usage: wide_report.py DIR   (writes DIR/summary.json; prints markdown; exit 1 on any mismatch)

Identity: in every GROUP of rows.tsv, every run (--gen 1 runs: their one id must be the first
id of the full runs) gives the same generated ids and first-step logits hash; a `batch` row's
sequence 0 must equal the `short` group and sequence 1 the `short2` group.

Floors (bench/report.py's arithmetic, stdlib only):
  decode bytes/token = (engine bytes of the --gen N run - of the --gen 1 run) / (N - 1)
                       (trunk.bytes_read + experts.bytes_read; ultra-low-memory rows add the
                       disk bytes GNU time saw, which include the streamed embedding rows and
                       lm_head chunks)
  I/O floor          = decode bytes/token / QD16 O_DIRECT bandwidth probed just before the row
  memory floor       = weight bytes touched per token (bound layers' trunk + 16 active experts
                       per MoE layer + lm_head) / DRAM reference bandwidth probed before the row
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


def fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def bits(r):
    """(ids, hash) per sequence of a run JSON: one for a plain run, several for --batch-ids."""
    if "sequences" in r:
        return [(tuple(s["generated_ids"]), s["first_logits_hash"]) for s in r["sequences"]]
    return [(tuple(r["generated_ids"]), r["first_logits_hash"])]


def spt(r):
    return r.get("seconds_per_token", r.get("seconds_per_step"))


def main(d):
    plan = load(os.path.join(d, "plan.json"))
    layers = plan["layers"]
    active = plan["active_expert_bytes_per_layer"]
    lm_head = plan["global_bytes"] // 2  # embedding and lm_head are equal halves (+ norms)
    rows = []
    with open(os.path.join(d, "rows.tsv")) as f:
        for line in f:
            key, name, cap, group, args = (line.rstrip("\n").split("\t") + [""])[:5]
            rows.append(dict(key=key, name=name, cap=cap, group=group, args=args))
    groups = {}
    bad = []
    res = []
    for e in rows:
        key = e["key"]
        g1 = load(os.path.join(d, f"{key}.gen1.json"))
        g1m = load(os.path.join(d, f"{key}.gen1.meta.json"))
        reps = []
        i = 1
        while (m := load(os.path.join(d, f"{key}.r{i}.meta.json"))) is not None:
            reps.append((load(os.path.join(d, f"{key}.r{i}.json")), m))
            i += 1
        ok = [(r, m) for r, m in reps if r is not None and m["rc"] == 0]
        e["rcs"] = [m["rc"] for _, m in reps] + ([g1m["rc"]] if g1m else [])
        if not ok or (g1m and g1m["rc"] != 0):
            bad.append(f"{key}: a run failed (rc {e['rcs']})")
            res.append(e)
            continue
        for r, _ in ok:
            b = bits(r)
            if e["group"] == "batch":
                groups.setdefault("short", []).append((key + " seq0", b[0]))
                groups.setdefault("short2", []).append((key + " seq1", b[1]))
            else:
                groups.setdefault(e["group"], []).append((key, b[0]))
        if g1 is not None:
            first = bits(g1)[0]
            if first[0] != bits(ok[0][0])[0][0][:1] or first[1] != bits(ok[0][0])[0][1]:
                bad.append(f"{key}: --gen 1 run {first} is not the start of {bits(ok[0][0])[0]}")
        r0 = ok[0][0]
        e["spt"] = [spt(r) for r, _ in ok]
        e["spt_med"] = med(e["spt"])
        e["first"] = med([r.get("first_token_seconds", r.get("prefill_seconds")) for r, _ in ok])
        e["ttft"] = med([r.get("time_to_first_token_seconds") for r, _ in ok])
        e["rss"] = max(r["peak_rss_bytes"] for r, _ in ok)
        e["cg_peak"] = max((m["cgroup_peak_bytes"] or 0) for _, m in ok) or None
        e["failcnt"] = max((m["cgroup_failcnt"] or 0) for _, m in ok) if e["cap"] != "none" else None
        e["load"] = med([m["load_before"] for _, m in ok])
        t = r0.get("trunk") or {}
        e["pinned"] = f"{t.get('pinned_layers', '-')}/{t.get('n_layers', '-')}"
        e["ring"] = t.get("ring_slots", "-")
        e["shared"] = t.get("shared_ring_bytes", 0)
        e["ids"] = bits(r0)
        nl = r0.get("layers_bound", len(layers))
        moe = sum(1 for l in layers[:nl] if l["ffn"] == "Moe")
        e["touched"] = sum(l["trunk_bytes"] for l in layers[:nl]) + moe * active + lm_head
        n_dec = len(r0.get("generated_ids", [])) - 1
        if g1 is not None and n_dec > 0 and "trunk" in r0:
            def per(f):
                return med([(f(r, m) - f(g1, g1m)) / n_dec for r, m in ok])
            e["trunk_b"] = per(lambda r, m: r["trunk"]["bytes_read"])
            e["exp_b"] = per(lambda r, m: r["experts"]["bytes_read"])
            e["disk_b"] = per(lambda r, m: m["disk_read_bytes"] or 0)
            e["cpu"] = per(lambda r, m: (m["user_seconds"] or 0) + (m["sys_seconds"] or 0))
            e["eread"] = per(lambda r, m: r["experts"]["read_seconds"])
            e["wait"] = per(lambda r, m: r["trunk"]["wait_seconds"])
        probe = load(os.path.join(d, f"{key}.probe.json"))
        dram = load(os.path.join(d, f"{key}.dram.json"))
        if "--trunk" in e["args"] and probe and probe.get("disk_floor_mb_per_s"):
            e["bw"] = probe["disk_floor_mb_per_s"] * 1e6
            io_b = e.get("trunk_b", 0) + e.get("exp_b", 0)
            if "ultra" in e["args"] or "--ultra-low-memory" in e["args"]:
                io_b = max(io_b, e.get("disk_b") or 0)
            e["io_b"] = io_b if "trunk_b" in e else None
            if e["io_b"]:
                e["floor"] = e["io_b"] / e["bw"]
                e["floor_kind"] = "I/O"
        elif dram and dram.get("dram"):
            e["dram_bw"] = dram["dram"]["reference_gb_per_s"] * 1e9
            e["floor"] = e["touched"] / e["dram_bw"]
            e["floor_kind"] = "memory"
        if e.get("floor") and e["spt_med"]:
            e["ratio"] = e["spt_med"] / e["floor"]
        res.append(e)

    for g, items in groups.items():
        ref = items[0][1]
        for key, b in items:
            if b != ref:
                bad.append(f"group {g}: {key} gave {b}, {items[0][0]} gave {ref}")

    out = ["```", open(os.path.join(d, "machine.txt")).read().strip(), "```", ""]
    out.append("| row | group | cap GB | decode s/token | first token s | TTFT s | pinned, ring | "
               "read GB/token trunk + experts | floor bw | floor s/token | ratio | peak RSS GB | "
               "cgroup peak GB | failcnt | load |")
    out.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for e in res:
        if "spt" not in e:
            out.append(f"| {e['name']} | {e['group']} | {e['cap']} | FAILED rc {e['rcs']} |" + " |" * 11)
            continue
        ring = f"{e['ring']}" + (f" (shared {e['shared']/1e9:.2f} GB)" if e["shared"] else "")
        rd = f"{e['trunk_b']/1e9:.3f} + {e['exp_b']/1e9:.3f}" if "trunk_b" in e else "-"
        if e.get("bw"):
            bw = f"{e['bw']/1e6:.0f} MB/s"
        elif e.get("dram_bw"):
            bw = f"{e['dram_bw']/1e9:.2f} GB/s DRAM"
        else:
            bw = "-"
        spts = ", ".join(f"{x:.2f}" for x in e["spt"])
        out.append(
            f"| {e['name']} | {e['group']} | {e['cap']} | {e['spt_med']:.3f} ({spts}) | {fmt(e['first'], '.2f')} "
            f"| {fmt(e['ttft'], '.2f')} | {e['pinned']}, {ring} | {rd} | {bw} "
            f"| {fmt(e.get('floor'))} {e.get('floor_kind', '')} | {fmt(e.get('ratio'), '.2f')}x "
            f"| {e['rss']/1e9:.2f} | {fmt(e['cg_peak'] and e['cg_peak']/1e9, '.2f')} "
            f"| {fmt(e['failcnt'], 'd')} | {fmt(e['load'], '.1f')} |")
    out.append("")
    for g, items in sorted(groups.items()):
        out.append(f"- group `{g}`: {len(items)} runs, ids {list(items[0][1][0])}, hash {items[0][1][1]}")
    out.append("")
    out.append("IDENTITY: " + ("FAIL\n  " + "\n  ".join(bad) if bad else
                               "every group identical (ids and first-step logit hash)"))
    print("\n".join(out))
    with open(os.path.join(d, "summary.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1]))
