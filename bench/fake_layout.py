#!/usr/bin/env python3
"""A checkpoint with the released Kimi K3's NUMBER of tensors and shards, each tensor 4 bytes:
for timing what scales with the tensor count (index and header parsing, the name tables),
not the weights. 93 layers x 896 experts x (w1, w2, w3) x (packed, scale) + 6 per layer =
500,526 tensors in 96 shards; a 46 MB index, 96 MB on disk. Not a model: `k3-run verify DIR`
passes, `k3-run budget DIR` (with a K3 config.json copied in) reports it is not the manifest's
model.

usage: python3 bench/fake_layout.py OUT_DIR    (Python stdlib only)
"""
import json
import os
import struct
import sys

if len(sys.argv) != 2:
    sys.exit(__doc__)
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
n_layers, n_exp, n_shards = 93, 896, 96
names = []
for l in range(n_layers):
    for e in range(n_exp):
        for w in ("w1", "w2", "w3"):
            for suf in ("weight_packed", "weight_scale"):
                names.append(f"model.layers.{l}.mlp.experts.{e}.{w}.{suf}")
    for t in ("self_attn.q_proj.weight", "self_attn.o_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate.weight", "mlp.shared_experts.gate_proj.weight"):
        names.append(f"model.layers.{l}.{t}")
per = (len(names) + n_shards - 1) // n_shards
wm = {}
for s in range(n_shards):
    chunk = names[s*per:(s+1)*per]
    fn = f"model-{s+1:05d}-of-{n_shards:05d}.safetensors"
    hdr = {}
    off = 0
    for nm in chunk:
        hdr[nm] = {"dtype": "U8", "shape": [4], "data_offsets": [off, off + 4]}
        off += 4
        wm[nm] = fn
    h = json.dumps(hdr, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(os.path.join(out, fn), "wb") as f:
        f.write(struct.pack("<Q", len(h))); f.write(h); f.write(b"\0" * off)
with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": 4 * len(names)}, "weight_map": wm}, f, indent=2)
print(len(names))
