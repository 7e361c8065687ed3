#!/usr/bin/env python3
"""bench/oracle_tf_sweep.py: `--dump-prompt-logits` (teacher forcing over the prompt) against
the independent reference on 48 synthetic shapes no committed test uses (the shape table of the
regression sweep of 2026-12-01, sweep16 in docs/TESTING.md).

Per shape, one process at a time: fixtures/oracle/synth_k3.py writes the checkpoint; ref_k3.py
--envelope runs the reference; the engine runs the plain request, the teacher-forced run on
ref.json's `teacher_forced_sequence` (resident), and the same streamed through a packed trunk
at two ring slots' budget in prompt chunks of 5; compare_k3.py --tokens --tf-logits --tf-argmax
judges. Checked besides the verdict: the rows file is [positions, vocab] f32, its last row is
the `--dump-logits` bytes, the streamed rows are the same bytes.

usage: python3 bench/oracle_tf_sweep.py [--bin target/release/k3-run] [--work DIR] [--py PY]
       [SHAPE ...]   (default: every shape; PY: the oracle's venv, fixtures/setup-venv.sh)
Writes DIR/summary.json and prints one JSON line per shape and a last summary line; exit 1 if
any shape fails. About 3 minutes and 330 MB here.
"""
import argparse, json, os, random, subprocess, sys, time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
O = os.path.join(REPO, "fixtures/oracle")
ap = argparse.ArgumentParser()
ap.add_argument("--bin", default=os.path.join(REPO, "target/release/k3-run"))
ap.add_argument("--work", default=os.path.join(REPO, "target/oracle-tf-sweep"))
ap.add_argument("--py", default=os.path.join(REPO, ".venv/bin/python"))
ap.add_argument("shapes", nargs="*")
A = ap.parse_args()
K, W, PY = A.bin, A.work, A.py

# name: (synth_k3.py flags, seed, prompt length, tokens to generate)
SHAPES = {
 "s01": ("--hidden 40 --layers 1 --block 1 --kda-heads 2 --kda-head-dim 5 --conv-k 2 --mla-heads 1 --q-lora 8 --kv-lora 8 --qk-nope 3 --qk-rope 2 --v-head 5 --experts 2 --topk 1 --shared 1 --moe-inter 32 --latent 32 --dense-inter 24 --first-dense 0 --vocab 50 --shards 2", 101, 1, 12),
 "s02": ("--hidden 67 --layers 2 --block 3 --kda-heads 1 --kda-head-dim 16 --conv-k 5 --mla-heads 2 --q-lora 24 --kv-lora 10 --qk-nope 5 --qk-rope 6 --v-head 9 --experts 3 --topk 3 --shared 2 --moe-inter 64 --latent 32 --dense-inter 33 --first-dense 1 --vocab 777 --shards 2", 202, 17, 16),
 "s03": ("--hidden 130 --layers 3 --block 2 --kda-heads 12 --kda-head-dim 8 --conv-k 4 --mla-heads 4 --q-lora 48 --kv-lora 32 --qk-nope 16 --qk-rope 8 --v-head 16 --experts 40 --topk 6 --shared 3 --moe-inter 32 --latent 64 --dense-inter 200 --first-dense 3 --vocab 1300 --shards 3", 303, 40, 8),
 "s04": ("--hidden 81 --layers 4 --block 4 --kda-heads 5 --kda-head-dim 24 --conv-k 3 --mla-heads 3 --q-lora 17 --kv-lora 23 --qk-nope 7 --qk-rope 2 --v-head 11 --experts 9 --topk 9 --shared 1 --moe-inter 96 --latent 32 --dense-inter 70 --first-dense 2 --vocab 1500 --shards 7", 404, 5, 14),
 "s05": ("--hidden 100 --layers 5 --block 1 --kda-heads 7 --kda-head-dim 16 --conv-k 2 --mla-heads 6 --q-lora 30 --kv-lora 16 --qk-nope 8 --qk-rope 4 --v-head 8 --experts 16 --topk 4 --shared 2 --moe-inter 32 --latent 96 --dense-inter 64 --first-dense 0 --vocab 1024 --shards 4", 505, 23, 10),
 "s06": ("--hidden 53 --layers 6 --block 5 --kda-heads 4 --kda-head-dim 5 --conv-k 5 --mla-heads 1 --q-lora 9 --kv-lora 11 --qk-nope 13 --qk-rope 10 --v-head 3 --experts 7 --topk 1 --shared 3 --moe-inter 64 --latent 32 --dense-inter 29 --first-dense 1 --vocab 501 --shards 5", 606, 2, 16),
 "s07": ("--hidden 64 --layers 7 --block 3 --kda-heads 8 --kda-head-dim 8 --conv-k 4 --mla-heads 2 --q-lora 32 --kv-lora 12 --qk-nope 4 --qk-rope 4 --v-head 16 --experts 24 --topk 5 --shared 1 --moe-inter 32 --latent 32 --dense-inter 128 --first-dense 3 --vocab 333 --shards 3", 707, 31, 9),
 "s08": ("--hidden 127 --layers 8 --block 8 --kda-heads 10 --kda-head-dim 16 --conv-k 3 --mla-heads 5 --q-lora 40 --kv-lora 24 --qk-nope 12 --qk-rope 6 --v-head 10 --experts 31 --topk 2 --shared 2 --moe-inter 64 --latent 64 --dense-inter 99 --first-dense 2 --vocab 1234 --shards 6", 808, 12, 12),
 "s09": ("--hidden 42 --layers 9 --block 10 --kda-heads 6 --kda-head-dim 24 --conv-k 2 --mla-heads 4 --q-lora 14 --kv-lora 7 --qk-nope 9 --qk-rope 8 --v-head 13 --experts 12 --topk 11 --shared 1 --moe-inter 32 --latent 32 --dense-inter 41 --first-dense 1 --vocab 64 --shards 2", 909, 8, 15),
 "s10": ("--hidden 96 --layers 11 --block 2 --kda-heads 3 --kda-head-dim 16 --conv-k 4 --mla-heads 8 --q-lora 20 --kv-lora 20 --qk-nope 2 --qk-rope 2 --v-head 4 --experts 40 --topk 40 --shared 3 --moe-inter 32 --latent 32 --dense-inter 50 --first-dense 0 --vocab 900 --shards 7", 1010, 27, 11),
 "s11": ("--hidden 75 --layers 12 --block 5 --kda-heads 9 --kda-head-dim 5 --conv-k 5 --mla-heads 3 --q-lora 25 --kv-lora 15 --qk-nope 10 --qk-rope 12 --v-head 6 --experts 20 --topk 3 --shared 2 --moe-inter 32 --latent 64 --dense-inter 60 --first-dense 2 --vocab 1499 --shards 5", 1111, 14, 13),
 "s12": ("--hidden 110 --layers 14 --block 4 --kda-heads 11 --kda-head-dim 8 --conv-k 3 --mla-heads 7 --q-lora 27 --kv-lora 19 --qk-nope 5 --qk-rope 4 --v-head 12 --experts 6 --topk 2 --shared 1 --moe-inter 64 --latent 32 --dense-inter 111 --first-dense 3 --vocab 1111 --shards 4", 1212, 36, 16),
}

# extra shapes drawn at random (fixed seed 16016; sweep15 used 15015), slightly wider ranges
_g = random.Random(16016)
for _i in range(1, 17):
    L = _g.randint(1, 18); E = _g.randint(2, 48)
    SHAPES[f"r{_i:02d}"] = (
        f"--hidden {_g.randint(33, 131)} --layers {L} --block {_g.randint(1, L + 3)} "
        f"--kda-heads {_g.randint(1, 12)} --kda-head-dim {_g.choice([4, 5, 8, 12, 16, 24])} --conv-k {_g.randint(2, 5)} "
        f"--mla-heads {_g.randint(1, 8)} --q-lora {_g.randint(5, 48)} --kv-lora {_g.randint(3, 40)} "
        f"--qk-nope {_g.randint(1, 17)} --qk-rope {_g.choice([2, 4, 6, 8, 10, 14])} --v-head {_g.randint(1, 19)} "
        f"--experts {E} --topk {_g.randint(1, E)} --shared {_g.randint(1, 3)} --moe-inter {32 * _g.randint(1, 3)} "
        f"--latent {32 * _g.randint(1, 3)} --dense-inter {_g.randint(7, 150)} --first-dense {_g.randint(0, min(3, L))} "
        f"--vocab {_g.randint(20, 2000)} --shards {_g.randint(2, 12)}",
        _g.randint(1, 10**6), _g.randint(1, 40), _g.randint(8, 16))

# edge round: prompts crossing the 64-token prefill chunk, gen 1, odd sizes
SHAPES.update({
 "e01": ("--hidden 61 --layers 6 --block 4 --kda-heads 3 --kda-head-dim 12 --conv-k 4 --mla-heads 2 --q-lora 13 --kv-lora 9 --qk-nope 3 --qk-rope 2 --v-head 5 --experts 10 --topk 3 --shared 1 --moe-inter 32 --latent 32 --dense-inter 45 --first-dense 1 --vocab 400 --shards 3", 31, 65, 8),
 "e02": ("--hidden 88 --layers 9 --block 2 --kda-heads 5 --kda-head-dim 8 --conv-k 5 --mla-heads 3 --q-lora 21 --kv-lora 17 --qk-nope 6 --qk-rope 4 --v-head 7 --experts 8 --topk 2 --shared 2 --moe-inter 32 --latent 32 --dense-inter 70 --first-dense 2 --vocab 700 --shards 4", 32, 130, 12),
 "e03": ("--hidden 49 --layers 4 --block 1 --kda-heads 2 --kda-head-dim 16 --conv-k 2 --mla-heads 4 --q-lora 10 --kv-lora 6 --qk-nope 4 --qk-rope 6 --v-head 8 --experts 4 --topk 2 --shared 3 --moe-inter 32 --latent 32 --dense-inter 30 --first-dense 0 --vocab 256 --shards 2", 33, 40, 1),
 "e04": ("--hidden 72 --layers 13 --block 13 --kda-heads 4 --kda-head-dim 4 --conv-k 3 --mla-heads 1 --q-lora 12 --kv-lora 12 --qk-nope 8 --qk-rope 8 --v-head 8 --experts 33 --topk 32 --shared 1 --moe-inter 32 --latent 32 --dense-inter 64 --first-dense 3 --vocab 1500 --shards 7 --a-log-len 64", 34, 64, 16),
})

# round 3: bigger layers (multi-record compressed trunk), stressed conditioning, extra checks
SHAPES.update({
 "x01": ("--hidden 130 --layers 14 --block 3 --kda-heads 12 --kda-head-dim 24 --conv-k 4 --mla-heads 8 --q-lora 48 --kv-lora 40 --qk-nope 16 --qk-rope 8 --v-head 16 --experts 40 --topk 8 --shared 3 --moe-inter 96 --latent 96 --dense-inter 1500 --first-dense 3 --vocab 1500 --shards 7", 41, 33, 12),
 "x02": ("--hidden 117 --layers 8 --block 6 --kda-heads 9 --kda-head-dim 16 --conv-k 5 --mla-heads 6 --q-lora 35 --kv-lora 29 --qk-nope 11 --qk-rope 6 --v-head 9 --experts 36 --topk 36 --shared 2 --moe-inter 96 --latent 64 --dense-inter 1100 --first-dense 2 --vocab 1200 --shards 5", 42, 19, 14),
 "x03": ("--hidden 57 --layers 7 --block 2 --kda-heads 6 --kda-head-dim 8 --conv-k 3 --mla-heads 3 --q-lora 15 --kv-lora 11 --qk-nope 5 --qk-rope 4 --v-head 6 --experts 12 --topk 3 --shared 1 --moe-inter 32 --latent 32 --dense-inter 40 --first-dense 1 --vocab 600 --shards 3 --out-gain 1.0 --bias-std 0.3 --qk-corr 0.0", 43, 21, 16),
 "x04": ("--hidden 90 --layers 10 --block 4 --kda-heads 4 --kda-head-dim 16 --conv-k 4 --mla-heads 4 --q-lora 22 --kv-lora 18 --qk-nope 7 --qk-rope 4 --v-head 9 --experts 20 --topk 4 --shared 2 --moe-inter 64 --latent 32 --dense-inter 80 --first-dense 2 --vocab 900 --shards 4 --out-gain 0.6 --bias-std 0.5 --router-gain 4 --res-gain 3.0", 44, 29, 16),
 "x05": ("--hidden 33 --layers 3 --block 1 --kda-heads 1 --kda-head-dim 4 --conv-k 2 --mla-heads 1 --q-lora 3 --kv-lora 2 --qk-nope 1 --qk-rope 2 --v-head 1 --experts 2 --topk 2 --shared 1 --moe-inter 32 --latent 32 --dense-inter 7 --first-dense 0 --vocab 50 --shards 7", 45, 3, 16),
})

# sweep16 edge shapes (from docs: shards vs layers, 1-element dims, odd vocab, L not a multiple of block)
SHAPES.update({
 "g01": ("--hidden 45 --layers 3 --block 2 --kda-heads 3 --kda-head-dim 8 --conv-k 3 --mla-heads 2 --q-lora 12 --kv-lora 9 --qk-nope 4 --qk-rope 4 --v-head 6 --experts 6 --topk 2 --shared 1 --moe-inter 32 --latent 32 --dense-inter 30 --first-dense 1 --vocab 301 --shards 40", 1601, 1, 12),
 "g02": ("--hidden 58 --layers 17 --block 5 --kda-heads 4 --kda-head-dim 5 --conv-k 4 --mla-heads 3 --q-lora 14 --kv-lora 10 --qk-nope 6 --qk-rope 2 --v-head 7 --experts 11 --topk 3 --shared 2 --moe-inter 32 --latent 32 --dense-inter 41 --first-dense 0 --vocab 997 --shards 18", 1602, 19, 12),
 "g03": ("--hidden 16 --layers 2 --block 1 --kda-heads 1 --kda-head-dim 4 --conv-k 1 --mla-heads 1 --q-lora 1 --kv-lora 1 --qk-nope 1 --qk-rope 2 --v-head 1 --experts 1 --topk 1 --shared 1 --moe-inter 32 --latent 32 --dense-inter 1 --first-dense 1 --vocab 2 --shards 3", 1603, 5, 10),
 "g04": ("--hidden 1 --layers 2 --block 1 --kda-heads 1 --kda-head-dim 1 --conv-k 2 --mla-heads 1 --q-lora 1 --kv-lora 1 --qk-nope 1 --qk-rope 2 --v-head 1 --experts 2 --topk 1 --shared 1 --moe-inter 32 --latent 32 --dense-inter 1 --first-dense 1 --vocab 1 --shards 2", 1604, 3, 6),
 "g05": ("--hidden 97 --layers 23 --block 7 --kda-heads 5 --kda-head-dim 12 --conv-k 3 --mla-heads 4 --q-lora 19 --kv-lora 13 --qk-nope 7 --qk-rope 6 --v-head 11 --experts 13 --topk 5 --shared 1 --moe-inter 64 --latent 32 --dense-inter 77 --first-dense 2 --vocab 1999 --shards 11 --a-log-len 100", 1605, 23, 10),
 "g06": ("--hidden 70 --layers 9 --block 20 --kda-heads 6 --kda-head-dim 8 --conv-k 2 --mla-heads 2 --q-lora 16 --kv-lora 12 --qk-nope 8 --qk-rope 4 --v-head 8 --experts 4 --topk 2 --shared 1 --moe-inter 32 --latent 32 --dense-inter 90 --first-dense 9 --vocab 513 --shards 12", 1606, 9, 12),
 "g07": ("--hidden 64 --layers 2 --block 2 --kda-heads 2 --kda-head-dim 16 --conv-k 4 --mla-heads 4 --q-lora 16 --kv-lora 16 --qk-nope 8 --qk-rope 8 --v-head 8 --experts 48 --topk 48 --shared 3 --moe-inter 96 --latent 96 --dense-inter 64 --first-dense 0 --vocab 4096 --shards 2", 1607, 15, 10),
 "g08": ("--hidden 37 --layers 1 --block 1 --kda-heads 2 --kda-head-dim 4 --conv-k 2 --mla-heads 1 --q-lora 5 --kv-lora 4 --qk-nope 2 --qk-rope 2 --v-head 3 --experts 2 --topk 1 --shared 1 --moe-inter 32 --latent 32 --dense-inter 9 --first-dense 1 --vocab 3 --shards 9", 1608, 4, 16),
})

# g03/g04 with vocab 3 (synth writes media_placeholder_token_id = vocab-3 and eos 2: vocab < 3 is an invalid config the engine refuses)
SHAPES["g03b"] = (SHAPES["g03"][0].replace("--vocab 2 ", "--vocab 3 "), 1603, 5, 10)
SHAPES["g04b"] = (SHAPES["g04"][0].replace("--vocab 1 ", "--vocab 3 "), 1604, 3, 6)
SHAPES["g09"] = ("--hidden 1 --layers 5 --block 2 --kda-heads 1 --kda-head-dim 1 --conv-k 1 --mla-heads 1 --q-lora 1 --kv-lora 1 --qk-nope 1 --qk-rope 2 --v-head 1 --experts 3 --topk 3 --shared 1 --moe-inter 32 --latent 32 --dense-inter 1 --first-dense 0 --vocab 5 --shards 8", 1609, 7, 12)

# layers above 2 MiB (pinned layers / ring slots 2 MiB-aligned: the reserved huge-page pool path)
SHAPES["h01"] = ("--hidden 131 --layers 5 --block 2 --kda-heads 4 --kda-head-dim 16 --conv-k 3 --mla-heads 3 --q-lora 20 --kv-lora 16 --qk-nope 6 --qk-rope 4 --v-head 8 --experts 6 --topk 2 --shared 1 --moe-inter 32 --latent 32 --dense-inter 5000 --first-dense 3 --vocab 1000 --shards 3", 1701, 13, 8)

SHAPES["e05"] = (SHAPES["x01"][0], 51, 37, 10)  # x01's shape, new seed: default 512 KiB compressed chunks span layers > 512 KiB


def sh(cmd, log):
    t = time.time()
    p = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=900)
    with open(log, "a") as f:
        f.write(f"\n$ {cmd}\n# rc={p.returncode} {time.time()-t:.2f}s\n{p.stderr[-1500:]}\n")
    return p.returncode, p.stdout, p.stderr

names = A.shapes or [n for n in SHAPES if n not in ("g03", "g04")]  # vocab < 3: an invalid config
os.makedirs(W, exist_ok=True)
summary = []
for name in names:
    flags, seed, plen, gen = SHAPES[name]
    d = f"{W}/{name}"; os.makedirs(d, exist_ok=True); log = f"{d}/commands.log"; open(log, "w").close()
    ck = f"{W}/ck_{name}"
    r = {"shape": name}
    rc, _, err = sh(f"{PY} {O}/synth_k3.py --out {ck} {flags} --seed {seed}", log)
    if rc: r["error"] = "synth"; summary.append(r); print(r, flush=True); continue
    vocab = json.load(open(f"{ck}/config.json"))["text_config"]["vocab_size"]
    rng = random.Random(seed)
    ids = ",".join(str(rng.randrange(vocab)) for _ in range(plen))
    rc, _, _ = sh(f"{PY} {O}/ref_k3.py {ck} --ids {ids} --gen {gen} --precision f32 --envelope --out {d}/ref", log)
    if rc: r["error"] = "ref"; summary.append(r); print(r, flush=True); continue
    seq = json.load(open(f"{d}/ref/ref.json"))["teacher_forced_sequence"]
    tf = ",".join(map(str, seq))
    rc1, _, _ = sh(f"{K} {ck} --ids {ids} --gen {gen} --incremental --threads 2 --out {d}/run.json", log)
    rc2, _, _ = sh(f"{K} {ck} --ids {tf} --gen 1 --incremental --threads 2 --out {d}/tf.json --dump-prompt-logits {d}/tf.f32 --dump-logits {d}/tf0.f32", log)
    rc3, _, _ = sh(f"{K} pack-trunk {ck} {d}/trunk", log)
    sizes = [l["size"] for l in json.load(open(f"{d}/trunk/trunk.json"))["layers"]]
    budget = (2 * ((max(sizes) + 4095) // 4096 * 4096)) / 1e9 + 1e-9
    rc4, _, _ = sh(f"{K} {ck} --ids {tf} --gen 1 --incremental --trunk {d}/trunk --trunk-gb {budget:.9f} --cache-gb 0.000001 --prefill-chunk 5 --out {d}/tfs.json --dump-prompt-logits {d}/tfs.f32", log)
    r["engine_rc"] = [rc1, rc2, rc3, rc4]
    if any([rc1, rc2, rc3, rc4]):
        r["error"] = "engine"; summary.append(r); print(r, flush=True); continue
    rows = open(f"{d}/tf.f32", "rb").read(); last = open(f"{d}/tf0.f32", "rb").read()
    r["positions"] = len(seq)
    r["size_ok"] = len(rows) == len(seq) * vocab * 4
    r["last_row_is_dump_logits"] = rows[-vocab * 4:] == last
    r["streamed_identical"] = open(f"{d}/tfs.f32", "rb").read() == rows
    am = json.load(open(f"{d}/tf.json"))["prompt_argmax"]
    rc, out, err = sh(f"{PY} {O}/compare_k3.py {d}/ref --tokens {d}/run.json --tf-logits {d}/tf.f32 --tf-argmax {','.join(map(str, am))} --json {d}/compare.json", log)
    c = json.load(open(f"{d}/compare.json"))
    r.update({k: c.get(k) for k in ("verdict", "tokens_equal", "tf_agree", "tf_positions", "tf_stable_positions", "tf_stable_disagree", "tf_max_abs_logit_diff", "tf_positions_within_tolerance", "fails")})
    summary.append(r); print(json.dumps(r), flush=True)
json.dump(summary, open(f"{W}/summary.json", "w"), indent=1)
ok = [s for s in summary if s.get("verdict") == "PASS" and s.get("size_ok") and s.get("last_row_is_dump_logits") and s.get("streamed_identical")]
print(f"{len(ok)}/{len(summary)} shapes: PASS, rows sized, last row = --dump-logits, streamed identical", flush=True)
sys.exit(0 if len(ok) == len(summary) else 1)
