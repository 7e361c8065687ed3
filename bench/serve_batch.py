#!/usr/bin/env python3
"""bench/serve_batch.py: N chat requests sent at once to `k3-run --serve`, served one at a
time (--serve-batch 1) and decoded together (--serve-batch N), alternating; prints the wall
time from the first request to the last reply, completion tokens and tokens/s per variant.

usage: serve_batch.py ROUNDS N MAX_TOKENS K3RUN MODEL [server flags...]
The page cache is dropped before each server starts (root). Stdlib only."""
import json, os, subprocess, sys, threading, time, urllib.request

rounds, n, max_tokens = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
binary, model, flags = sys.argv[4], sys.argv[5], sys.argv[6:]
prompts = [f"Question {i}: tell me something about the number {i * 7}." for i in range(n)]


def one_run(batch):
    subprocess.run("sync; echo 3 > /proc/sys/vm/drop_caches", shell=True)
    cmd = [binary, model, "--serve", "127.0.0.1:0", "--serve-batch", str(batch),
           "--batch-window", "2000", "--no-think"] + flags
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = p.stdout.readline()
    port = int(line.split("http://127.0.0.1:")[1].split(" ")[0])
    out = [None] * n

    def ask(i):
        body = json.dumps({"messages": [{"role": "user", "content": prompts[i]}],
                           "max_tokens": max_tokens}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})
        out[i] = json.load(urllib.request.urlopen(req, timeout=3600))

    t0 = time.time()
    ts = [threading.Thread(target=ask, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.time() - t0
    p.terminate()
    p.wait()
    toks = sum(o["usage"]["completion_tokens"] for o in out)
    ids = [o["choices"][0]["message"]["content"] for o in out]
    batch_seen = max(o["k3"]["batch"] for o in out)
    return wall, toks, ids, batch_seen


results = {1: [], n: []}
replies = {}
for r in range(rounds):
    for b in (1, n):
        wall, toks, texts, seen = one_run(b)
        results[b].append(wall)
        replies.setdefault(b, texts)
        print(f"round {r + 1} serve-batch {b}: {wall:.2f} s for {toks} tokens "
              f"({toks / wall:.3f} tokens/s), largest batch {seen}", flush=True)
for b in (1, n):
    w = sorted(results[b])
    print(f"serve-batch {b}: median {w[len(w) // 2]:.2f} s over {len(w)} rounds")
print("replies identical:", replies[1] == replies[n])
