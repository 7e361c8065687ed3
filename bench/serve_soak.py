#!/usr/bin/env python3
"""Soak `k3-run --serve`: N requests (chat, streamed chat, completion, in turn) against a
running server, the server's RSS (VmRSS of PID) sampled every `--every` requests.

  k3-run /tmp/odd9 --serve 127.0.0.1:8080 --no-request-log &
  python3 bench/serve_soak.py --pid $! --n 1000

Standard library only. Prints one line per sample and a summary: first and last RSS, the
largest, and the growth after the first sample. Exit 1 if any request failed.
"""
import argparse
import http.client
import json
import time


def rss_kb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def request(host, port, path, body):
    c = http.client.HTTPConnection(host, port, timeout=120)
    c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, data


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--every", type=int, default=100)
    a = ap.parse_args()
    kinds = [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello %d"}], "max_tokens": 8}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "stream %d"}], "max_tokens": 8, "stream": True}),
        ("/v1/completions", {"prompt": "once upon %d", "max_tokens": 8}),
    ]
    samples, failed, t0 = [], 0, time.time()
    for i in range(a.n):
        path, body = kinds[i % len(kinds)]
        body = json.loads(json.dumps(body).replace("%d", str(i)))
        status, _ = request(a.host, a.port, path, body)
        failed += status != 200
        if i % a.every == 0 or i == a.n - 1:
            kb = rss_kb(a.pid)
            samples.append(kb)
            print(f"request {i + 1:5d}: RSS {kb / 1024:8.1f} MiB  ({time.time() - t0:6.1f} s)", flush=True)
    print(f"{a.n} requests, {failed} failed; RSS first {samples[0] / 1024:.1f} MiB, last "
          f"{samples[-1] / 1024:.1f} MiB, max {max(samples) / 1024:.1f} MiB, growth after the "
          f"first sample {(samples[-1] - samples[0]) / 1024:+.1f} MiB")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
