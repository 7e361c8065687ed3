#!/usr/bin/env python3
"""bench/project.py: predict real Kimi K3's decode s/token, peak memory and first-token time per
preset from parts measured on k3-wide (the release's widths, configs/synth/k3-wide.toml).

    project.py parts RESULTS_DIR [--out parts.json]
        Reads a bench/wide.sh results directory (summary.json from bench/wide_report.py, the
        run JSONs, plan.json, the probes) and writes the measured parts: per-layer compute by
        kind, lm_head cost, DRAM and disk bandwidth, the expert read rate, the run overhead.

    project.py check PARTS.json RESULTS_DIR
        Predicts every streamed k3-wide row of RESULTS_DIR from the parts alone (its layer
        map from plan.json, its trunk plan recomputed from the packed layer sizes and the
        row's budget, its measured expert misses per token) and prints predicted vs measured.

    project.py k3 PARTS.json [--plan PLAN.json] [--disk-gbs G] [--cores N] [--dram-gbs D]
                             [--expert-gbs E] [--prompt P]
        Real K3 (layer map and per-layer bytes from `k3-run plan --config
        models/tests/data/kimi-k3-config.json --json`, PLAN.json) at every preset, on the
        measured machine or on one described by the flags.

    project.py pipeline PARTS.json --plan PLAN.json --hosts 4,8 [--host-gb 32] [--cache-gb 2]
                             [--disk-gbs 2] [--cores 8] [--net-gbps 10,25] [--net-latency-us 30]
        Real K3 split over H hosts (`k3-run --pipeline`, docs/SCALE-OUT.md "Throughput model"):
        per host its layers, trunk streamed, expert bytes, stage time; s/token at batch 1 and
        tokens/s at batch H, against one host alone at the desktop preset.

The model (docs/RELEASE-WIDTHS.md, "Projection"):
  compute(layer)  = the measured seconds of its kind (KDA + dense, KDA + MoE, MLA + MoE) at
                    these widths, plus its extra router bytes (896 vs 64 experts) at the
                    measured compute rate; lm_head + final norm: `head`.
  on another machine: compute scales by max(cores_here / cores, dram_here / dram) when the
                    parts were CPU-bound here (rate per core well below DRAM bandwidth), which
                    is the case on the 2-core machine (see the parts' `bound`), else by dram.
  I/O per token   = streamed trunk bytes (the trunk plan at the preset's budget) / disk GB/s
                    + routed-expert misses x 17.55 MB / expert GB/s
                    (+ lm_head 2.35 GB / disk GB/s with ultra-low-memory).
  decode s/token  = ring >= 2 or shared ring: max(I/O, compute + expert read time) plus the
                    layers the shared ring reads synchronously;
                    one slot (sync):           trunk I/O + expert I/O + compute.
  expert misses   = 16 per MoE layer x (1 - hit), hit = cache experts / experts per layer /
                    MoE layers (uniform routing; real K3's routing is load-balanced); k3-wide's
                    check uses its measured misses instead.
  peak memory     = pinned + ring bytes + expert cache + lm_head (2.35 GB, not with ultra) +
                    decode state + the run's measured overhead (peak RSS minus those parts).
  first token     = start-up + one pass over the trunk for the prompt (chunk >= prompt) with
                    min(16 P, experts) experts per MoE layer read, compute P x per-token compute
                    (an upper bound: a chunk reuses each weight across its tokens).
stdlib only.
"""

import argparse
import json
import os
import statistics
import sys

EXPERT_BYTES = 17_547_264  # one MXFP4 routed expert at the release's widths (3 x 3584 x 3072)
ALIGN = 4096


def load(p):
    with open(p) as f:
        return json.load(f)


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def kind(layer):
    attn = layer["attn"].lower()
    ffn = layer["ffn"].lower()
    return ("kda" if "kda" in attn or "linear" in attn else "mla") + "_" + ("moe" if ffn == "moe" else "dense")


# --- the trunk plan (runner/src/stream/plan.rs, docs/STREAMING.md "The trunk plan") ---------
def trunk_plan(sizes, budget, ring=2):
    """(pinned n, ring slots r, slot bytes, shared ring bytes, sync layers) for packed layer
    sizes at `budget` bytes with `ring` requested slots."""
    al = [(s + ALIGN - 1) // ALIGN * ALIGN for s in sizes]
    L = len(al)
    if sum(al) <= budget:
        return dict(pinned=L, ring=0, slot=0, shared=0, sync=[])
    for r in range(ring, 0, -1):
        best = None
        for n in range(L):
            need = sum(al[:n]) + r * max(al[n:])
            if need <= budget:
                best = n
        if best is None:
            continue
        n = best
        streamed = list(range(n, L))
        if r >= 2:
            return dict(pinned=n, ring=r, slot=max(al[n:]), shared=0, sync=[])
        if ring == 1 or len(streamed) < 2:
            return dict(pinned=n, ring=1, slot=max(al[n:]), shared=0, sync=streamed)
        left = budget - sum(al[:n])
        pairs = [al[streamed[i - 1]] + al[streamed[i]] for i in range(1, len(streamed))]
        fitting = [p for p in pairs if p <= left]
        shared = max([max(al[n:])] + fitting)
        # a layer is read ahead when it fits beside the one before it (the first streamed
        # layer beside the last one of the previous pass when nothing is pinned)
        sync = []
        for i, l in enumerate(streamed):
            prev = streamed[i - 1] if i > 0 else (n - 1 if n > 0 else streamed[-1])
            if prev >= n and al[prev] + al[l] > shared:
                sync.append(l)
        if not fitting:  # no pair fits: one plain slot
            return dict(pinned=n, ring=1, slot=max(al[n:]), shared=0, sync=streamed)
        return dict(pinned=n, ring=1, slot=max(al[n:]), shared=shared, sync=sync)
    raise ValueError(f"budget {budget} below one slot of {max(al)} bytes")


# --- parts ------------------------------------------------------------------------------------
def parts(d, out):
    summ = {e["key"]: e for e in load(os.path.join(d, "summary.json"))}
    plan = load(os.path.join(d, "plan.json"))
    layers = plan["layers"]

    def spt(name):
        e = [v for v in summ.values() if v["name"] == name and v.get("spt_med")]
        return e[0]["spt_med"] if e else None

    t = {n: spt(f"m-res-L{n}") for n in (1, 2, 3, 4)}
    if None in t.values():
        sys.exit(f"parts: need the m-res-L1..L4 rows in {d}: {t}")
    active = plan["active_expert_bytes_per_layer"]
    lm_head = plan["global_bytes"] // 2
    b = {}
    for l in layers:
        b.setdefault(kind(l), l["trunk_bytes"] + (active if l["ffn"] == "Moe" else 0))
    # --layers 1 = layer 0 (KDA + dense MLP, bf16) + lm_head (bf16): both bf16 matvecs, split
    # by bytes; the bf16 rate also prices the router bytes another expert count adds
    rate = (b["kda_dense"] + lm_head) / t[1]
    head = lm_head / rate
    kda_dense = t[1] - head
    kda_moe = t[2] - t[1]  # layer 1
    mla_moe = (t[4] - t[2]) - kda_moe  # layers 2 (KDA + MoE) and 3 (MLA + MoE)
    dram = med([e.get("dram_bw") for e in summ.values()])
    probes = []
    for f in sorted(os.listdir(d)):
        if f.endswith(".probe.json") or f == "disk-end.json":
            try:
                probes.append(load(os.path.join(d, f))["disk_floor_mb_per_s"] * 1e6)
            except (KeyError, TypeError, ValueError):
                pass
    exp_probe = None
    p = os.path.join(d, "floors-expert.json")
    if os.path.exists(p):
        j = load(p)
        exp_probe = max(r["mb_per_s"] for r in j["disk"]["reads"]) * 1e6
    # run overhead: the laptop row's peak RSS minus its trunk buffers, expert cache and lm_head
    lap = [v for v in summ.values() if v["name"] == "m-laptop" and v.get("rss")]
    overhead = None
    if lap:
        r = load(os.path.join(d, f"{lap[0]['key']}.r1.json"))
        tr = r["trunk"]
        ring = tr.get("shared_ring_bytes") or tr["ring_slots"] * tr["ring_slot_bytes"]
        used = tr["pinned_bytes"] + ring + r["experts"]["budget_bytes"] + lm_head
        overhead = lap[0]["rss"] - used
    cores = os.cpu_count()
    res = dict(
        source=d,
        cores=cores,
        dram_bytes_per_s=dram,
        disk_bytes_per_s=med(probes),
        disk_probes=probes,
        expert_bytes_per_s=exp_probe or med(probes),
        compute_seconds=dict(kda_dense=kda_dense, kda_moe=kda_moe, mla_moe=mla_moe, head=head),
        compute_bytes=b,
        compute_rate_bytes_per_s=rate,
        l3_check_seconds=t[3] - t[2],
        resident_layers_seconds=t,
        run_overhead_bytes=overhead,
        lm_head_bytes=lm_head,
    )
    js = json.dumps(res, indent=1)
    if out:
        with open(out, "w") as f:
            f.write(js + "\n")
    print(js)


# --- the model ----------------------------------------------------------------------------
def compute_seconds(P, plan, scale=1.0):
    """Per-token compute of a whole model's layers + head, from the parts; extra router bytes
    (a different expert count) at the measured rate."""
    c = P["compute_seconds"]
    rate = P["compute_rate_bytes_per_s"]
    active = plan["active_expert_bytes_per_layer"]
    tot = c["head"] * (plan["global_bytes"] // 2) / P["lm_head_bytes"]
    per = []
    for l in plan["layers"]:
        k = kind(l)
        base = c.get(k)
        if base is None:
            raise ValueError(f"no measured part for layer kind {k}")
        extra = (l["trunk_bytes"] + (active if l["ffn"] == "Moe" else 0)) - P["compute_bytes"][k]
        per.append(base + extra / rate)
    tot += sum(per)
    return tot * scale, [p * scale for p in per]


def machine_scale(P, cores=None):
    """Compute-time factor on a machine with `cores` cores: the parts were measured with
    P["cores"] threads; decode's matvecs are split by rows across threads, so the time scales
    with the core count until DRAM bandwidth binds (decode() takes the max with
    touched bytes / DRAM when a DRAM figure is given)."""
    return P["cores"] / cores if cores else 1.0


def n_experts(plan):
    return plan["buffers"]["n_experts"], plan["buffers"]["n_experts_active"]


def state_bytes(plan, positions=4096):
    return sum(l["state_bytes"] + l["kv_bytes_per_position"] * positions for l in plan["layers"])


def decode(P, plan, sizes, budget, cache_bytes, ultra, disk, exp_bw, misses_per_token=None,
           ring=2, scale=1.0, dram=None):
    tp = trunk_plan(sizes, budget, ring)
    al = [(s + ALIGN - 1) // ALIGN * ALIGN for s in sizes]
    streamed = sum(al[tp["pinned"]:])
    sync_b = sum(al[i] for i in tp["sync"])
    n_moe = sum(1 for l in plan["layers"] if l["ffn"] == "Moe")
    n_exp, k = n_experts(plan)
    if misses_per_token is None:
        cap = cache_bytes // EXPERT_BYTES
        hit = min(1.0, cap / (n_exp * n_moe)) if n_moe else 0.0
        misses_per_token = k * n_moe * (1 - hit)
    exp_b = misses_per_token * EXPERT_BYTES
    cpu, _ = compute_seconds(P, plan, scale)
    if dram:
        touched = sum(l["trunk_bytes"] for l in plan["layers"]) + n_moe * plan["active_expert_bytes_per_layer"] + plan["global_bytes"] // 2
        cpu = max(cpu, touched / dram)
    ulm_b = plan["global_bytes"] // 2 if ultra else 0
    io = (streamed + ulm_b) / disk + exp_b / exp_bw
    t_exp = exp_b / exp_bw
    if tp["ring"] == 0:
        t = cpu + t_exp
    elif tp["ring"] == 1 and tp["shared"] == 0:
        t = streamed / disk + t_exp + cpu + ulm_b / disk
    else:
        t = max(io, cpu + t_exp + ulm_b / disk) + sync_b / disk
    return dict(s_per_token=t, io_floor=io, compute=cpu, plan=tp, streamed_bytes=streamed,
                expert_bytes=exp_b, misses=misses_per_token)


def row_budget(args):
    """The trunk budget in bytes a wide.sh row's arguments give (--trunk-gb wins, else the
    preset's trunk_gb)."""
    a = args.split()
    if "--trunk-gb" in a:
        return int(float(a[a.index("--trunk-gb") + 1]) * 1e9)
    if "--preset" in a:
        name = a[a.index("--preset") + 1]
        return int(dict((p[0], p[1]) for p in PRESETS)[name] * 1e9)
    return None


def check(pp, d, disk_gbs=None):
    P = load(pp)
    plan = load(os.path.join(d, "plan.json"))
    summ = load(os.path.join(d, "summary.json"))
    trunk = None
    for e in summ:
        if "--trunk " in e["args"]:
            trunk = e["args"].split("--trunk ")[1].split()[0]
            break
    sizes = [l["size"] for l in load(os.path.join(trunk, "trunk.json"))["layers"]]
    disk = disk_gbs * 1e9 if disk_gbs else P["disk_bytes_per_s"]
    print(f"disk {disk/1e9:.2f} GB/s, compute from the parts\n")
    print("| row | budget | plan | predicted s/token | measured s/token | error |")
    print("|---|---|---|---|---|---|")
    errs = []
    for e in summ:
        if not e["name"].startswith("m-") or "--trunk " not in e["args"] or not e.get("spt_med"):
            continue
        r = load(os.path.join(d, f"{e['key']}.r1.json"))
        tr = r["trunk"]
        budget = row_budget(e["args"])
        ring = 1 if "--trunk-ring 1" in e["args"] else 2
        n_dec = len(r["generated_ids"]) - 1
        g1 = load(os.path.join(d, f"{e['key']}.gen1.json"))
        misses = (r["experts"]["misses"] - g1["experts"]["misses"]) / n_dec
        ultra = "ultra" in e["args"]
        p = decode(P, plan, sizes, budget, r["experts"]["budget_bytes"], ultra, disk, disk, misses, ring)
        err = p["s_per_token"] / e["spt_med"] - 1
        errs.append(abs(err))
        tp = p["plan"]
        print(f"| {e['name']} | {budget/1e9:.3f} GB | {tp['pinned']} pinned, ring {tp['ring']}"
              f"{', shared' if tp['shared'] else ''}, {len(tp['sync'])} sync | {p['s_per_token']:.3f} "
              f"| {e['spt_med']:.3f} | {100*err:+.1f}% |")
    if errs:
        print(f"\nmean |error| {100*statistics.mean(errs):.1f}%, max {100*max(errs):.1f}%")


PRESETS = [("ultra", 2.5, 0.31, True), ("laptop", 3.0, 1.0, False), ("desktop", 16.0, 10.0, False),
           ("workstation", 60.0, 30.0, False), ("server", 110.0, 13.0, False),
           ("max", 110.0, 109.0, False)]


def k3(pp, plan_path, disk_gbs, cores, dram_gbs, exp_gbs, prompt):
    P = load(pp)
    plan = load(plan_path)
    sizes = [l["trunk_bytes"] for l in plan["layers"]]
    disk = disk_gbs * 1e9 if disk_gbs else P["disk_bytes_per_s"]
    exp_bw = exp_gbs * 1e9 if exp_gbs else (disk if disk_gbs else P["expert_bytes_per_s"])
    dram = dram_gbs * 1e9 if dram_gbs else None
    scale = machine_scale(P, cores)
    n_moe = sum(1 for l in plan["layers"] if l["ffn"] == "Moe")
    lm = plan["global_bytes"] // 2
    state = state_bytes(plan, prompt + 64)  # the request's positions: prompt + 64 generated
    over = P.get("run_overhead_bytes") or 0
    cpu, _ = compute_seconds(P, plan, scale)
    where = (f"disk {disk/1e9:.2f} GB/s, experts {exp_bw/1e9:.2f} GB/s, "
             f"{cores or P['cores']} cores (compute x{scale:.3f})"
             + (f", DRAM {dram/1e9:.1f} GB/s" if dram else ""))
    print(f"real K3 ({len(sizes)} layers, {n_moe} MoE, trunk {sum(sizes)/1e9:.2f} GB, "
          f"lm_head {lm/1e9:.2f} GB) on: {where}; compute {cpu:.2f} s/token; prompt {prompt} tokens\n")
    print("| preset | trunk plan | streamed GB/token | expert GB/token | I/O floor s | compute s | "
          "predicted s/token | predicted peak GB | first token s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, tg, cg, ultra in PRESETS:
        budget = int(tg * 1e9)
        p = decode(P, plan, sizes, budget, int(cg * 1e9), ultra, disk, exp_bw, None, 2, scale, dram)
        tp = p["plan"]
        ring_b = tp["shared"] or tp["ring"] * tp["slot"]
        al = [(s + ALIGN - 1) // ALIGN * ALIGN for s in sizes]
        peak = sum(al[:tp["pinned"]]) + ring_b + cg * 1e9 + (0 if ultra else lm) + state + over
        n_exp, k = n_experts(plan)
        pre_exp = n_moe * min(k * prompt, n_exp) * EXPERT_BYTES
        pre_io = (p["streamed_bytes"] + (lm if ultra else 0)) / disk + pre_exp / exp_bw
        first = max(pre_io, cpu * prompt) if tp["ring"] != 1 or tp["shared"] else pre_io + cpu * prompt
        print(f"| {name} ({tg:g} / {cg:g} GB{', ultra' if ultra else ''}) | {tp['pinned']} pinned, "
              f"ring {tp['ring']}{' shared' if tp['shared'] else ''}, {len(tp['sync'])} sync | "
              f"{p['streamed_bytes']/1e9:.2f} | {p['expert_bytes']/1e9:.2f} | {p['io_floor']:.2f} | "
              f"{p['compute']:.2f} | {p['s_per_token']:.2f} | {peak/1e9:.2f} | {first:.1f} |")


def split_hosts(plan, budgets):
    """The contiguous split minimising the largest trunk bytes / budget (engine/src/pipeline/
    split.rs): every host at least one layer."""
    b = [-(-l["trunk_bytes"] // ALIGN) * ALIGN for l in plan["layers"]]
    n, h = len(b), len(budgets)
    pre = [0]
    for x in b:
        pre.append(pre[-1] + x)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(h + 1)]
    cut = [[0] * (n + 1) for _ in range(h + 1)]
    best[0][0] = 0.0
    for k in range(1, h + 1):
        for j in range(k, n - (h - k) + 1):
            for i in range(k - 1, j):
                v = max(best[k - 1][i], (pre[j] - pre[i]) / budgets[k - 1])
                if v < best[k][j]:
                    best[k][j], cut[k][j] = v, i
    ranges, j = [], n
    for k in range(h, 0, -1):
        i = cut[k][j]
        ranges.append((i, j))
        j = i
    return ranges[::-1], pre


def pipeline(pp, plan_path, hosts_list, host_gb, cache_gb, disk_gbs, cores, nets, lat_us):
    P = load(pp)
    plan = load(plan_path)
    scale = machine_scale(P, cores)
    _, per = compute_seconds(P, plan, scale)
    head = P["compute_seconds"]["head"] * (plan["global_bytes"] // 2) / P["lm_head_bytes"] * scale
    lm = plan["global_bytes"] - plan["embed_bytes"]
    active = plan["active_expert_bytes_per_layer"]
    disk = disk_gbs * 1e9
    d_model = 7168
    block = 12
    n_exp = plan["layers"][-1]["expert_bytes"] // EXPERT_BYTES
    print(f"real K3 over H hosts of {host_gb:g} GB each (expert cache {cache_gb:g} GB each), "
          f"disk {disk_gbs:g} GB/s, {cores or P['cores']} cores per host (compute x{scale:.3f}), "
          f"network latency {lat_us:g} us one way\n")
    rows = []
    for H in hosts_list:
        budgets = [(host_gb - cache_gb) * 1e9] * H
        budgets[-1] -= lm
        ranges, pre = split_hosts(plan, budgets)
        print(f"H = {H}:")
        print("| host | layers | trunk GB (budget) | trunk GB streamed / token | expert GB / token "
              "| compute s | expert read s | stage s | carry KB out |")
        print("|---|---|---|---|---|---|---|---|---|")
        stages, hops_kb = [], []
        for h, (i, j) in enumerate(ranges):
            trunk = pre[j] - pre[i]
            streamed = max(0.0, trunk - budgets[h])
            moe = sum(1 for l in plan["layers"][i:j] if l["ffn"] == "Moe")
            # misses: uniform routing over this host's experts, the cache split over its layers
            cache_experts = cache_gb * 1e9 / EXPERT_BYTES
            hit = min(1.0, cache_experts / max(1, moe) / n_exp) if moe else 0.0
            exp_b = moe * active * (1 - hit)
            comp = sum(per[i:j]) + (head if h == H - 1 else 0.0)
            io = exp_b / disk + streamed / disk
            stage = comp + io
            stages.append(stage)
            vectors = 1 + -(-j // block)  # partial sum + the block sums up to layer j (upper bound)
            carry = 4 * d_model * vectors if h < H - 1 else 0
            hops_kb.append(carry / 1e3)
            print(f"| {h} | {i}..{j} | {trunk/1e9:.2f} ({budgets[h]/1e9:.2f}) | {streamed/1e9:.2f} | "
                  f"{exp_b/1e9:.2f} | {comp:.2f} | {io:.2f} | {stage:.2f} | "
                  f"{carry/1e3:.0f} |")
        for g in nets:
            bw = g * 1e9 / 8
            hop = [lat_us * 1e-6 + kb * 1e3 / bw for kb in hops_kb[:-1]] + [lat_us * 1e-6]
            one = sum(stages) + sum(hop)
            cycle = max(one, H * max(stages))
            rows.append((H, g, sum(stages), sum(hop), one, H / cycle, one + (H - 1) * max(stages)))
        print()
    print("| hosts | network | stages s (sum) | hops s (sum, incl. the id back) | batch 1: s/token "
          "| batch = hosts: tokens/s | batch = hosts: first id of the last sequence s |")
    print("|---|---|---|---|---|---|---|")
    for H, g, st, hp, one, tps, fill in rows:
        print(f"| {H} | {g:g} GbE | {st:.2f} | {hp*1e3:.2f} ms | {one:.2f} | {tps:.3f} | {fill:.2f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("parts")
    a.add_argument("dir")
    a.add_argument("--out")
    c = sub.add_parser("check")
    c.add_argument("parts")
    c.add_argument("dir")
    c.add_argument("--disk-gbs", type=float)
    k = sub.add_parser("k3")
    k.add_argument("parts")
    k.add_argument("--plan", default=None)
    k.add_argument("--disk-gbs", type=float)
    k.add_argument("--expert-gbs", type=float)
    k.add_argument("--cores", type=int)
    k.add_argument("--dram-gbs", type=float)
    k.add_argument("--prompt", type=int, default=4)
    q = sub.add_parser("pipeline")
    q.add_argument("parts")
    q.add_argument("--plan", required=True)
    q.add_argument("--hosts", default="4,8")
    q.add_argument("--host-gb", type=float, default=32.0)
    q.add_argument("--cache-gb", type=float, default=2.0)
    q.add_argument("--disk-gbs", type=float, default=2.0)
    q.add_argument("--cores", type=int, default=8)
    q.add_argument("--net-gbps", default="10,25")
    q.add_argument("--net-latency-us", type=float, default=30.0)
    x = ap.parse_args()
    if x.cmd == "parts":
        parts(x.dir, x.out)
    elif x.cmd == "check":
        check(x.parts, x.dir, x.disk_gbs)
    elif x.cmd == "pipeline":
        pipeline(x.parts, x.plan, [int(v) for v in x.hosts.split(",")], x.host_gb, x.cache_gb,
                 x.disk_gbs, x.cores, [float(v) for v in x.net_gbps.split(",")], x.net_latency_us)
    else:
        k3(x.parts, x.plan, x.disk_gbs, x.cores, x.dram_gbs, x.expert_gbs, x.prompt)


if __name__ == "__main__":
    main()
