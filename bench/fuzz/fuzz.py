#!/usr/bin/env python3
"""Robustness fuzzer for k3-run (stdlib only; a manual tool, not part of cargo test or .ci/run).

Derives ~1054 damaged variants of small synthetic checkpoints, packed trunks (raw and
compressed), state files and CLI flags, and runs the k3-run binary on each (one process at a
time, `timeout 60`, address space capped at 12 GiB), recording the exit code, the tail of
stderr and a classification (see bench/fuzz/README.md).

Usage: python3 bench/fuzz/fuzz.py [--bin PATH] [--work DIR] [--setup] [--only SUBSTR] [--list]
  --bin PATH    the k3-run binary (default: target/release/k3-run in this repository)
  --work DIR    the work directory (default: target/fuzz in this repository); it holds the
                inputs (made by the binary itself: synth, pack-trunk, --save-state), the
                variants and the results
  --setup       remake the inputs even if present (done anyway when they are missing or were
                made by another binary)
  --only SUBSTR run only the variants whose name contains SUBSTR (results_only.jsonl)
  --list        print the variant names and exit
Outputs in the work dir: variants/<name>/ (the damaged copies; unchanged files are hard links
to the originals; output.txt holds the command and the whole output), results.jsonl (one
record per variant), summary.txt. Exit code 1 if any variant panicked, timed out, died of a
signal, ran although it should fail, or a baseline failed / gave other ids; 0 otherwise.
"""
import copy
import hashlib
import json
import os
import random
import re
import resource
import shutil
import stat
import struct
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# set by set_paths() from --bin / --work before the variants are defined
BIN = None
ROOT = None
BASE = TRUNK_RAW = TRUNK_Z = TRUNK_Z2M = OTHER_ODD9 = TRUNK_ODD9 = TRUNK_TINY2 = None
OTHER_TINY2 = STATES = VAR = None
RUN = ["--ids", "1,2,3", "--gen", "4", "--incremental"]
BASE_IDS = None  # the base model's ids for RUN, computed by running it (compute_base_ids)
SHARD = ["model-0000%d-of-00004.safetensors" % i for i in range(1, 5)]
IDX = "model.safetensors.index.json"
AS_LIMIT = 12 << 30  # address-space guard so a runaway allocation cannot take the machine
# classes that make the exit code 1 (a gate by hand)
FAILING = ("panic", "timeout", "ran_but_should_fail", "signal", "wrong_output", "unexpected_error")


def set_paths(bin_path, work):
    global BIN, ROOT, BASE, TRUNK_RAW, TRUNK_Z, TRUNK_Z2M, OTHER_ODD9, TRUNK_ODD9, TRUNK_TINY2
    global OTHER_TINY2, STATES, VAR
    BIN = os.path.abspath(bin_path)
    ROOT = os.path.abspath(work)
    BASE = ROOT + "/base"  # synth tiny.toml seed 1
    TRUNK_RAW = ROOT + "/trunk_raw"
    TRUNK_Z = ROOT + "/trunk_z16"  # compressed, 16 KiB chunks: several records per layer
    TRUNK_Z2M = ROOT + "/trunk_z"  # compressed, default 2 MiB chunks
    OTHER_ODD9 = ROOT + "/other_odd9"  # synth odd9.toml seed 9
    TRUNK_ODD9 = ROOT + "/trunk_odd9"
    OTHER_TINY2 = ROOT + "/other_tiny2"  # synth tiny.toml seed 2: same shapes, other weights
    TRUNK_TINY2 = ROOT + "/trunk_tiny2"
    STATES = ROOT + "/states"
    VAR = ROOT + "/variants"


VARIANTS = []


def V(name, cat, setup, args, expect="error", kw=(), note=""):
    """setup(vdir) -> dict of placeholders; args may use {M} {T} {V} {S}."""
    VARIANTS.append(dict(name=name, cat=cat, setup=setup, args=args, expect=expect,
                         kw=list(kw), note=note))


# ---------------------------------------------------------------- file helpers
def link_tree(src, dst):
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        s = os.path.join(src, f)
        if os.path.isfile(s):
            os.link(s, os.path.join(dst, f))


def replace(path, content):
    """Break the hard link, then write (never modifies the original)."""
    if os.path.lexists(path):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    if content is None:
        return
    if isinstance(content, str):
        content = content.encode()
    with open(path, "wb") as f:
        f.write(content)


def special(path, kind):
    replace(path, None)
    if kind == "dir":
        os.mkdir(path)
    elif kind == "symloop":
        os.symlink(os.path.basename(path), path)
    elif kind == "symloop2":
        os.symlink(os.path.basename(path) + ".b", path)
        os.symlink(os.path.basename(path), path + ".b")
    elif kind == "dangling":
        os.symlink("/nonexistent/nowhere.safetensors", path)
    elif kind == "devzero":
        os.symlink("/dev/zero", path)
    elif kind == "devnull":
        os.symlink("/dev/null", path)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "empty":
        open(path, "wb").close()
    elif kind == "delete":
        pass
    else:
        raise ValueError(kind)


def rd(path):
    with open(path, "rb") as f:
        return f.read()


def model_with(changes):
    """changes: {filename: bytes|str|('special', kind)|callable(orig_bytes)->bytes}"""
    def setup(vdir):
        m = os.path.join(vdir, "model")
        link_tree(BASE, m)
        for fn, c in changes.items():
            p = os.path.join(m, fn)
            if isinstance(c, tuple) and c[0] == "special":
                special(p, c[1])
            elif callable(c):
                replace(p, c(rd(os.path.join(BASE, fn))))
            else:
                replace(p, c)
        return {"M": m}
    return setup


def trunk_with(src, changes, model=None):
    def setup(vdir):
        d = {}
        if model is not None:
            d.update(model(vdir))
        else:
            d["M"] = BASE
        t = os.path.join(vdir, "trunk")
        link_tree(src, t)
        for fn, c in changes.items():
            p = os.path.join(t, fn)
            if isinstance(c, tuple) and c[0] == "special":
                special(p, c[1])
            elif callable(c):
                replace(p, c(rd(os.path.join(src, fn))))
            else:
                replace(p, c)
        d["T"] = t
        return d
    return setup


def plain(extra=None):
    def setup(vdir):
        d = {"M": BASE, "S": STATES}
        if extra:
            d.update(extra(vdir))
        return d
    return setup


# ---------------------------------------------------------------- JSON helpers
def jmut(fn):
    """bytes -> json -> fn(obj) (mutate in place or return new) -> bytes"""
    def f(b):
        o = json.loads(b)
        r = fn(o)
        if isinstance(r, tuple) and len(r) == 2 and r[0] == "ROOT":
            o = r[1]
        return json.dumps(o, indent=1).encode()
    return f


def getp(o, path):
    for k in path:
        o = o[k]
    return o


def setp(o, path, v):
    getp(o, path[:-1])[path[-1]] = v


def delp(o, path):
    del getp(o, path[:-1])[path[-1]]


def numeric_leaves(o, path=()):
    if isinstance(o, bool):
        return
    if isinstance(o, (int, float)):
        yield path, o
    elif isinstance(o, dict):
        for k, v in o.items():
            yield from numeric_leaves(v, path + (k,))
    elif isinstance(o, list):
        for i, v in enumerate(o):
            yield from numeric_leaves(v, path + (i,))


# ---------------------------------------------------------------- safetensors helpers
def st_parse(b):
    n = struct.unpack("<Q", b[:8])[0]
    h = json.loads(b[8:8 + n])
    return n, h, b[8 + n:]


def st_build(h, data, pad=True):
    hb = json.dumps(h).encode()
    if pad:
        hb += b" " * ((-len(hb)) % 8)
    return struct.pack("<Q", len(hb)) + hb + data


def st_mut(fn):
    """fn(header_dict, data) -> (header, data) or None (mutates header in place)."""
    def f(b):
        n, h, data = st_parse(b)
        r = fn(h, data)
        if isinstance(r, tuple) and len(r) == 2:
            h, data = r
        return st_build(h, data)
    return f


def st_raw(fn):
    """fn(n, header_bytes, data_bytes) -> whole new file bytes"""
    def f(b):
        n = struct.unpack("<Q", b[:8])[0]
        return fn(n, b[8:8 + n], b[8 + n:])
    return f


EMB = "language_model.model.embed_tokens.weight"
L0Q = None  # filled below (first BF16 2-D trunk tensor of layer 0)
ALOG = "language_model.model.layers.0.self_attn.A_log"
EXP_P = "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed"
EXP_S = "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_scale"
LMH = "language_model.lm_head.weight"


def first_bf16_2d(shard, prefix):
    _, h, _ = st_parse(rd(os.path.join(BASE, shard)))
    for k, v in h.items():
        if k.startswith(prefix) and isinstance(v, dict) and v.get("dtype") == "BF16" \
                and len(v["shape"]) == 2 and "experts" not in k:
            return k
    raise KeyError(prefix)


# ================================================================ VARIANT DEFINITIONS
def define():
    global L0Q
    L0Q = first_bf16_2d(SHARD[0], "language_model.model.layers.0.")
    M = ["{M}"] + RUN
    cfg = json.loads(rd(BASE + "/config.json"))

    # ---------------- config.json: every numeric key
    for path, val in numeric_leaves(cfg):
        key = ".".join(str(p) for p in path)
        leaf = [str(p) for p in path if not isinstance(p, int)][-1]
        isint = isinstance(val, int)
        muts = [("zero", 0), ("neg", -1 if isint else -1.0),
                ("huge", 10 ** 12 if isint else 1e12), ("string", str(val)), ("null", None),
                ("removed", KeyError)]
        if isint:
            muts.append(("frac", val + 0.5))
        for mname, mv in muts:
            if mname == "removed" and isinstance(path[-1], int):
                continue  # list element: removing it is a different test below

            def mut(o, path=path, mv=mv):
                if mv is KeyError:
                    delp(o, path)
                else:
                    setp(o, path, mv)
            V("cfg.%s.%s" % (key, mname), "config", model_with({"config.json": jmut(mut)}),
              M, expect="any", kw=[leaf, "config.json"])

    # ---------------- config.json: other damage
    T = ("text_config",)
    LA = T + ("linear_attn_config",)

    def cfgv(name, fn, expect="error", kw=("config.json",), note=""):
        V("cfg." + name, "config", model_with({"config.json": jmut(fn)}), M, expect=expect,
          kw=kw, note=note)

    cfgv("extra_root_key", lambda o: o.update({"zz_unknown": 1, "yy": {"a": [1]}}), "ok")
    cfgv("extra_text_key", lambda o: o["text_config"].update({"zz_unknown": "x"}), "ok")
    cfgv("extra_la_key", lambda o: o["text_config"]["linear_attn_config"].update(
        {"zz_unknown": 3}), "ok")
    for k, v in [("hidden_size", 64), ("hidden_size", 256), ("num_hidden_layers", 12),
                 ("num_hidden_layers", 14), ("vocab_size", 255), ("vocab_size", 512),
                 ("num_experts", 8), ("num_experts", 32), ("num_experts_per_token", 17),
                 ("num_experts_per_token", 16), ("moe_intermediate_size", 32),
                 ("routed_expert_hidden_size", 32), ("intermediate_size", 128),
                 ("kv_lora_rank", 16), ("q_lora_rank", 32), ("qk_nope_head_dim", 16),
                 ("qk_rope_head_dim", 8), ("qk_rope_head_dim", 15), ("v_head_dim", 16),
                 ("num_attention_heads", 8), ("num_shared_experts", 3),
                 ("first_k_dense_replace", 2), ("first_k_dense_replace", 13),
                 ("attn_res_block_size", 2), ("attn_res_block_size", 13),
                 ("num_key_value_heads", 2), ("num_nextn_predict_layers", 1),
                 ("moe_layer_freq", 2), ("num_expert_group", 2), ("topk_group", 2)]:
        cfgv("dims.%s=%s" % (k, v), lambda o, k=k, v=v: setp(o, T + (k,), v),
             "any", kw=[k, "config.json", "shape"])
    for k, v in [("head_dim", 16), ("num_heads", 8), ("short_conv_kernel_size", 3),
                 ("full_attn_layers", [4, 8, 12]), ("full_attn_layers", [4, 8, 12, 13, 14]),
                 ("full_attn_layers", [1, 4, 8, 12, 13]), ("full_attn_layers", []),
                 ("kda_layers", [1, 2, 3, 5, 6, 7, 9, 10]), ("kda_layers", []),
                 ("kda_layers", [1, 2, 3, 5, 6, 7, 9, 10, 11, 99]),
                 ("full_attn_layers", [0, 4, 8, 12]),
                 ("full_attn_layers", [13, 12, 8, 4]), ("full_attn_layers", [4, 4, 8, 12, 13]),
                 ("full_attn_layers", "4,8"), ("kda_layers", None),
                 ("full_attn_layers", [4.5, 8, 12, 13]), ("full_attn_layers", [-1, 4, 8, 12, 13]),
                 ("full_attn_layers", [4, 8, 12, 10 ** 20])]:
        cfgv("la.%s=%s" % (k, json.dumps(v)), lambda o, k=k, v=v: setp(o, LA + (k,), v),
             "any", kw=[k, "config.json"])
    for k, v in [("model_type", "llama"), ("hidden_act", "gelu"), ("dtype", "float16"),
                 ("tie_word_embeddings", True), ("tie_word_embeddings", "yes"),
                 ("moe_router_activation_func", "softmax"), ("topk_method", "greedy"),
                 ("use_grouped_topk", False), ("mla_use_nope", False),
                 ("mla_use_output_gate", False), ("latent_moe_use_norm", False),
                 ("moe_renormalize", False), ("quantization_config", None),
                 ("linear_attn_config", None), ("linear_attn_config", []),
                 ("rms_norm_eps", "NaN"), ("rms_norm_eps", 1e309)]:
        cfgv("t.%s=%s" % (k, json.dumps(v) if v != 1e309 else "inf"),
             lambda o, k=k, v=v: setp(o, T + (k,), v), "any", kw=[k, "config.json"])
    cfgv("t.quant.format=nvfp4", lambda o: setp(
        o, T + ("quantization_config", "format"), "nvfp4-pack-quantized"), "any",
         kw=["format", "quant"])
    cfgv("t.quant.group_size=16", lambda o: setp(
        o, T + ("quantization_config", "config_groups", "group_0", "weights", "group_size"),
        16), "any", kw=["group_size"])
    cfgv("t.quant.num_bits=8", lambda o: setp(
        o, T + ("quantization_config", "config_groups", "group_0", "weights", "num_bits"),
        8), "any", kw=["num_bits"])
    cfgv("text_config_removed", lambda o: delp(o, T), "error", kw=["text_config", "config.json"])
    cfgv("text_config_null", lambda o: setp(o, T, None), "error", kw=["text_config", "config.json"])
    cfgv("text_config_array", lambda o: setp(o, T, [1, 2]), "error", kw=["text_config", "config.json"])
    cfgv("root_is_array", lambda o: ("ROOT", [o]), "error")
    cfgv("root_model_type=llama", lambda o: setp(o, ("model_type",), "llama"), "any",
         kw=["model_type"])
    cb = rd(BASE + "/config.json")
    for name, content in [
            ("invalid.truncated", cb[:len(cb) // 2]),
            ("invalid.trailing_comma", cb.rstrip()[:-1].rstrip() + b",\n}"),
            ("invalid.empty", b""),
            ("invalid.garbage", bytes(random.Random(1).randrange(256) for _ in range(3000))),
            ("invalid.nan_literal", cb.replace(b'"rms_norm_eps": 0.00001', b'"rms_norm_eps": NaN')),
            ("invalid.bom", b"\xef\xbb\xbf" + cb),
            ("invalid.utf16", cb.decode().encode("utf-16")),
            ("invalid.dup_hidden_size", cb.replace(b'"hidden_size": 128,',
                                                   b'"hidden_size": 128,\n "hidden_size": 64,')),
            ("invalid.deep_nesting", b"[" * 100000 + b"]" * 100000),
            ("invalid.huge_number", cb.replace(b'"hidden_size": 128', b'"hidden_size": 1' + b"0" * 400)),
            ("invalid.neg_zero", cb.replace(b'"hidden_size": 128', b'"hidden_size": -0')),
            ("invalid.exp_form", cb.replace(b'"hidden_size": 128', b'"hidden_size": 1.28e2')),
    ]:
        exp = "any" if name in ("invalid.bom", "invalid.dup_hidden_size", "invalid.exp_form") else "error"
        V("cfg." + name, "config", model_with({"config.json": content}), M, expect=exp,
          kw=["config.json"])
    V("cfg.missing", "config", model_with({"config.json": ("special", "delete")}), M,
      kw=["config.json"])
    V("cfg.is_dir", "config", model_with({"config.json": ("special", "dir")}), M,
      kw=["config.json"])
    V("cfg.symloop", "config", model_with({"config.json": ("special", "symloop")}), M,
      kw=["config.json"])
    V("cfg.fifo", "config", model_with({"config.json": ("special", "fifo")}), M,
      expect="any", kw=["config.json"], note="FIFO: blocks on open if unguarded")

    # ---------------- index json
    def idxv(name, fn, expect="error", kw=(IDX,), extra=None):
        ch = {IDX: jmut(fn) if callable(fn) else fn}
        if extra:
            ch.update(extra)
        V("idx." + name, "index", model_with(ch), M, expect=expect, kw=kw)

    W = ("weight_map",)
    for t in [EMB, L0Q, ALOG, EXP_P, EXP_S, LMH, "language_model.model.norm.weight",
              "language_model.model.layers.12.input_layernorm.weight",
              "vision_tower.patch_embed.proj.weight"]:
        idxv("missing_entry." + t.replace("language_model.model.", ""),
             lambda o, t=t: delp(o, W + (t,)),
             "any" if t.startswith("vision") else "error", kw=[t])
        idxv("missing_shard." + t.replace("language_model.model.", ""),
             lambda o, t=t: setp(o, W + (t,), "model-00009-of-00004.safetensors"),
             "any" if t.startswith("vision") else "error",
             kw=["model-00009-of-00004", t])
        idxv("wrong_shard." + t.replace("language_model.model.", ""),
             lambda o, t=t: setp(o, W + (t,), SHARD[2]),
             "any" if t.startswith("vision") else "error", kw=[t, SHARD[2]])
    idxv("extra_entry_nonexistent", lambda o: setp(o, W + ("language_model.bogus.weight",), SHARD[0]),
         "any", kw=["bogus"])
    idxv("shard_abs_path", lambda o: setp(o, W + (EMB,), "/etc/passwd"), "error",
         kw=["/etc/passwd", EMB])
    idxv("shard_traversal", lambda o: setp(o, W + (EMB,), "../../base/" + SHARD[0]), "any",
         kw=["..", EMB], )
    idxv("shard_traversal_other", lambda o: setp(o, W + (EMB,), "../../other_tiny2/" + SHARD[0]),
         "error", kw=["..", EMB])
    idxv("shard_empty_name", lambda o: setp(o, W + (EMB,), ""), "error", kw=[EMB])
    idxv("shard_is_number", lambda o: setp(o, W + (EMB,), 7), "error", kw=[EMB, IDX])
    idxv("shard_is_config", lambda o: setp(o, W + (EMB,), "config.json"), "error",
         kw=["config.json", EMB])
    idxv("weight_map_missing", lambda o: delp(o, W), "error", kw=["weight_map"])
    idxv("weight_map_array", lambda o: setp(o, W, []), "error", kw=["weight_map"])
    idxv("weight_map_empty", lambda o: setp(o, W, {}), "error", kw=["weight_map", IDX])
    idxv("total_size_wrong", lambda o: setp(o, ("metadata", "total_size"), 1), "any",
         kw=["total_size"])
    idxv("total_size_string", lambda o: setp(o, ("metadata", "total_size"), "x"), "any",
         kw=["total_size"])
    idxv("metadata_removed", lambda o: delp(o, ("metadata",)), "any", kw=["metadata"])
    idxv("root_array", lambda o: ("ROOT", [o]), "error")
    ib = rd(BASE + "/" + IDX)
    idxv("invalid.truncated", ib[:len(ib) // 2])
    idxv("invalid.empty", b"")
    idxv("invalid.garbage", b"\x00\xff" * 100)
    idxv("invalid.dup_key", ib.replace(b'"weight_map": {', b'"weight_map": {\n "%s": "%s",' %
                                       (EMB.encode(), SHARD[3].encode()), 1), "any",
         kw=[EMB])
    idxv("missing_file", ("special", "delete"), "error", kw=[IDX])
    idxv("is_dir", ("special", "dir"), "error", kw=[IDX])
    idxv("symloop", ("special", "symloop"), "error", kw=[IDX])
    # shard 2's entries moved to shard 1 and shard 2 deleted: shard 1 lacks those tensors, so
    # the message names shard 1 (and a tensor the index wrongly puts there)
    idxv("unreferenced_shard_deleted", lambda o: [setp(o, W + (k,), SHARD[0]) for k, v in
                                                  list(o["weight_map"].items()) if v == SHARD[1]] and None,
         "error", kw=[SHARD[0]], extra={SHARD[1]: ("special", "delete")})

    # ---------------- safetensors shards
    def shv(name, fn, shard=0, expect="error", kw=None, args=None, cat="shard"):
        s = SHARD[shard]
        ch = {s: fn if (callable(fn) or isinstance(fn, tuple)) else fn}
        V("st%d.%s" % (shard + 1, name), cat, model_with(ch), args or M, expect=expect,
          kw=kw if kw is not None else [s])

    b1 = rd(BASE + "/" + SHARD[0])
    n1, h1, d1 = st_parse(b1)
    for cut_name, cut in [("0", 0), ("4", 4), ("8", 8), ("hdr_mid", 8 + n1 // 2),
                          ("hdr_end", 8 + n1), ("data_1k", 8 + n1 + 1000),
                          ("data_mid", 8 + n1 + len(d1) // 2), ("minus1", len(b1) - 1)]:
        for si in (0, 3):
            bb = rd(BASE + "/" + SHARD[si])
            nn = struct.unpack("<Q", bb[:8])[0]
            c = {"hdr_mid": 8 + nn // 2, "hdr_end": 8 + nn, "data_1k": 8 + nn + 1000,
                 "data_mid": 8 + nn + (len(bb) - 8 - nn) // 2, "minus1": len(bb) - 1}.get(cut_name, cut)
            shv("trunc_" + cut_name, lambda b, c=c: b[:c], si)
    # truncated in expert data, experts streamed through the cache (documented: exit 4 at run)
    for si in (0, 1):
        shv("trunc_data_mid.cache", lambda b: b[:len(b) * 3 // 4], si,
            args=["{M}", "--cache-gb", "0.00005"] + RUN)
        shv("trunc_data_mid.trunk", lambda b: b[:len(b) * 3 // 4], si,
            args=["{M}", "--trunk", TRUNK_RAW, "--trunk-gb", "0.001", "--cache-gb", "0.00005"] + RUN)
    for hv_name, hv in [("u64max", 2 ** 64 - 1), ("2^63", 2 ** 63), ("2^40", 2 ** 40),
                        ("plus1", n1 + 1), ("minus1", n1 - 1), ("zero", 0), ("one", 1),
                        ("filelen", len(b1)), ("filelen_minus8", len(b1) - 8)]:
        shv("hdrlen_" + hv_name, lambda b, hv=hv: struct.pack("<Q", hv) + b[8:], 0)
    hb1 = b1[8:8 + n1]
    shv("hdr_json_brace", lambda b: b[:8] + b"X" + b[9:])
    shv("hdr_json_mid_garbage", lambda b: b[:8 + n1 // 2] + b"\x00\xff\"]}" + b[8 + n1 // 2 + 5:])
    shv("hdr_non_utf8", lambda b: b[:8 + 20] + b"\xff\xfe" + b[8 + 22:])
    shv("hdr_is_array", st_raw(lambda n, h, d: st_build([1, 2], d)))
    shv("hdr_is_null", st_raw(lambda n, h, d: st_build(None, d)))
    shv("hdr_empty_obj", st_raw(lambda n, h, d: st_build({}, d)))
    shv("hdr_trailing_junk", st_raw(lambda n, h, d: struct.pack("<Q", n + 8) + h + b"garbage!" + d))
    shv("hdr_metadata_bad", st_mut(lambda h, d: h.update({"__metadata__": [1]})), expect="any")
    shv("hdr_metadata_nested", st_mut(lambda h, d: h.update({"__metadata__": {"a": {"b": 1}}})),
        expect="any")
    def dup_tensor(n, h, d):
        hb = h.rstrip()
        assert hb.endswith(b"}")  # drop only the header object's closing brace
        hb = hb[:-1] + b',"%s":{"dtype":"BF16","shape":[1],"data_offsets":[0,2]}}' % EMB.encode()
        return struct.pack("<Q", len(hb)) + hb + d
    shv("hdr_dup_tensor", st_raw(dup_tensor), expect="any", kw=[EMB])
    shv("hdr_extra_tensor", st_mut(lambda h, d: h.update(
        {"language_model.extra.weight": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}})),
        expect="any")
    shv("hdr_missing_tensor.embed", st_mut(lambda h, d: h.pop(EMB)), kw=[EMB])
    shv("hdr_missing_tensor.l0", st_mut(lambda h, d: h.pop(L0Q)), kw=[L0Q])
    shv("hdr_missing_tensor.expert", st_mut(lambda h, d: h.pop(EXP_P)), kw=[EXP_P])

    def tmod(t, **kv):
        def f(h, d):
            for k, v in kv.items():
                if v is KeyError:
                    h[t].pop(k)
                else:
                    h[t][k] = v
        return st_mut(f)

    emb_shape = h1[EMB]["shape"]
    l0 = h1[L0Q]
    for t, tag in [(EMB, "embed"), (L0Q, "l0"), (ALOG, "alog"), (EXP_P, "exp_packed"),
                   (EXP_S, "exp_scale")]:
        dt = h1[t]["dtype"]
        shp = h1[t]["shape"]
        alt_same = {"BF16": "F16", "F32": "I32", "U8": "I8"}[dt]
        alt_diff = {"BF16": "F32", "F32": "BF16", "U8": "BF16"}[dt]
        shv("dtype_same_size.%s.%s" % (tag, alt_same), tmod(t, dtype=alt_same), kw=[t])
        shv("dtype_diff_size.%s.%s" % (tag, alt_diff), tmod(t, dtype=alt_diff), kw=[t])
        shv("dtype_bogus.%s" % tag, tmod(t, dtype="Q7"), kw=[t])
        shv("dtype_removed.%s" % tag, tmod(t, dtype=KeyError), kw=[t])
        shv("dtype_lower.%s" % tag, tmod(t, dtype=dt.lower()), expect="any", kw=[t])
        if len(shp) == 2:
            shv("shape_swapped.%s" % tag, tmod(t, shape=[shp[1], shp[0]]), kw=[t])
            shv("shape_plus1.%s" % tag, tmod(t, shape=[shp[0], shp[1] + 1]), kw=[t])
            shv("shape_flat.%s" % tag, tmod(t, shape=[shp[0] * shp[1]]), kw=[t])
            shv("shape_3d.%s" % tag, tmod(t, shape=[shp[0], shp[1], 1]), kw=[t])
        else:
            shv("shape_2d.%s" % tag, tmod(t, shape=[1] + shp), kw=[t])
        shv("shape_empty.%s" % tag, tmod(t, shape=[]), kw=[t])
        shv("shape_neg.%s" % tag, tmod(t, shape=[-1] + shp[1:]), kw=[t])
        shv("shape_overflow.%s" % tag, tmod(t, shape=[2 ** 32, 2 ** 32] + shp[2:]), kw=[t])
        shv("shape_overflow2.%s" % tag, tmod(t, shape=[2 ** 63, 2] + shp[2:]), kw=[t])
        shv("shape_zero.%s" % tag, tmod(t, shape=[0] + shp[1:]), kw=[t])
        shv("shape_string.%s" % tag, tmod(t, shape="x"), kw=[t])
        b0, e0 = h1[t]["data_offsets"]
        shv("off_end_beyond.%s" % tag, tmod(t, data_offsets=[len(d1) - (e0 - b0) + 2, len(d1) + 2]), kw=[t])
        shv("off_way_beyond.%s" % tag, tmod(t, data_offsets=[2 ** 40, 2 ** 40 + e0 - b0]), kw=[t])
        shv("off_u64_wrap.%s" % tag, tmod(t, data_offsets=[2 ** 64 - 2, (2 ** 64 - 2 + e0 - b0) % 2 ** 64]), kw=[t])
        shv("off_begin_gt_end.%s" % tag, tmod(t, data_offsets=[e0, b0]), kw=[t])
        shv("off_short.%s" % tag, tmod(t, data_offsets=[b0, e0 - 1]), kw=[t])
        shv("off_long.%s" % tag, tmod(t, data_offsets=[b0, e0 + 1]), kw=[t])
        shv("off_overlap_shift.%s" % tag, tmod(t, data_offsets=[b0 + 2, e0 + 2]), expect="any", kw=[t],
            )
        shv("off_alias_other.%s" % tag, tmod(t, data_offsets=[0, e0 - b0]) if b0 != 0 else
            tmod(t, data_offsets=[e0, 2 * e0]), expect="any", kw=[t])
        shv("off_negative.%s" % tag, tmod(t, data_offsets=[-2, e0 - b0 - 2]), kw=[t])
        shv("off_three.%s" % tag, tmod(t, data_offsets=[b0, e0, e0]), kw=[t])
        shv("off_float.%s" % tag, tmod(t, data_offsets=[float(b0), float(e0)]), expect="any", kw=[t])
        shv("off_removed.%s" % tag, tmod(t, data_offsets=KeyError), kw=[t])
    # NaN/inf in the bytes of weights (legit file, numerically bad): run quietly or refuse?
    def expscale_ff(h, d):
        b0, e0 = h[EXP_S]["data_offsets"]
        d = bytearray(d)
        d[b0] = 0xFF
        return h, bytes(d)
    shv("exp_scale_0xFF", st_mut(expscale_ff), expect="error", kw=[EXP_S])
    shv("exp_scale_0xFF.cache", st_mut(expscale_ff), expect="error", kw=[EXP_S],
        args=["{M}", "--cache-gb", "0.00005"] + RUN)
    # a NaN / inf inside bf16 weight DATA (valid file, numerically poisoned)
    def poison(tname, val):
        def f(h, d):
            b0 = h[tname]["data_offsets"][0]
            d = bytearray(d)
            d[b0:b0 + 2] = val
            return h, bytes(d)
        return st_mut(f)
    shv("nan_final_norm", poison("language_model.model.norm.weight", b"\xc0\x7f"), 3, expect="error",
        kw=["nan", "norm"])
    shv("inf_lm_head", poison(LMH, b"\x80\x7f"), 3, expect="error", kw=["inf", "lm_head"])
    shv("nan_embed_row0", poison(EMB, b"\xc0\x7f"), 0, expect="any", kw=["nan", "embed"])
    shv("nan_l0_weight", poison(L0Q, b"\xc0\x7f"), 0, expect="error", kw=["nan", L0Q])
    for kind in ["empty", "dir", "symloop", "symloop2", "dangling", "devzero", "devnull", "delete", "fifo"]:
        for si in (0, 3):
            shv("special_" + kind, ("special", kind), si, kw=[SHARD[si]],
                expect="any" if kind == "fifo" else "error")
    # shards swapped
    V("st.swapped_1_2", "shard", model_with({SHARD[0]: lambda b: rd(BASE + "/" + SHARD[1]),
                                             SHARD[1]: lambda b: rd(BASE + "/" + SHARD[0])}), M,
      kw=["safetensors"])
    V("st.other_model_shard1", "shard", model_with({SHARD[0]: lambda b: rd(OTHER_TINY2 + "/" + SHARD[0])}),
      M, expect="any", note="same layout, other weights: cannot be detected without checksums")
    # pack-trunk on damaged shards
    for nm, fn, si in [("trunc_data_mid", lambda b: b[:len(b) // 2], 0),
                       ("hdrlen_u64max", lambda b: struct.pack("<Q", 2 ** 64 - 1) + b[8:], 0),
                       ("dtype_same_size.l0", tmod(L0Q, dtype="F16"), 0),
                       ("shape_swapped.l0", tmod(L0Q, shape=[l0["shape"][1], l0["shape"][0]]), 0),
                       ("off_overlap_shift.l0", tmod(L0Q, data_offsets=[l0["data_offsets"][0] + 2,
                                                                        l0["data_offsets"][1] + 2]), 0),
                       ("special_dir", ("special", "dir"), 1)]:
        def setup(vdir, fn=fn, si=si):
            d = model_with({SHARD[si]: fn})(vdir)
            d["T"] = os.path.join(vdir, "packed")
            return d
        V("pack." + nm, "pack", setup, ["pack-trunk", "{M}", "{T}"], expect="error",
          kw=[SHARD[si]])
    V("pack.out_is_file", "pack", lambda vd: (open(vd + "/f", "w").close(), {"M": BASE, "T": vd + "/f"})[1],
      ["pack-trunk", "{M}", "{T}"], kw=["f"])
    V("pack.chunk_kib_0", "pack", lambda vd: {"M": BASE, "T": vd + "/p"},
      ["pack-trunk", "--compress", "--chunk-kib", "0", "{M}", "{T}"], kw=["chunk-kib"])
    V("pack.chunk_kib_3", "pack", lambda vd: {"M": BASE, "T": vd + "/p"},
      ["pack-trunk", "--compress", "--chunk-kib", "3", "{M}", "{T}"], kw=["chunk-kib"])
    V("pack.chunk_kib_huge", "pack", lambda vd: {"M": BASE, "T": vd + "/p"},
      ["pack-trunk", "--compress", "--chunk-kib", "4294967292", "{M}", "{T}"], expect="any",
      kw=["chunk-kib"])
    V("pack.chunk_kib_no_compress", "pack", lambda vd: {"M": BASE, "T": vd + "/p"},
      ["pack-trunk", "--chunk-kib", "16", "{M}", "{T}"], expect="any", kw=["chunk-kib", "compress"])

    # ---------------- trunk dirs
    for tname, tsrc in [("raw", TRUNK_RAW), ("z", TRUNK_Z)]:
        tj = json.loads(rd(tsrc + "/trunk.json"))
        TR = ["{M}", "--trunk", "{T}", "--trunk-gb", "0.001"] + RUN
        TP = ["{M}", "--trunk", "{T}", "--trunk-gb", "1"] + RUN

        def trv(name, ch, expect="error", kw=("trunk",), args=TR, model=None, tsrc=tsrc, tname=tname):
            V("trunk_%s.%s" % (tname, name), "trunk", trunk_with(tsrc, ch, model), args,
              expect=expect, kw=kw)

        def tjv(name, fn, expect="error", kw=("trunk.json",), args=TR):
            trv(name, {"trunk.json": jmut(fn)}, expect, kw, args)

        tjv("version_0", lambda o: setp(o, ("version",), 0), kw=["version"])
        tjv("version_99", lambda o: setp(o, ("version",), 99), kw=["version"])
        tjv("version_str", lambda o: setp(o, ("version",), "1"), kw=["version"])
        tjv("version_swap", lambda o: setp(o, ("version",), 2 if o["version"] == 1 else 1),
            kw=["version", "compress"])
        tjv("format_other", lambda o: setp(o, ("format",), "k4-trunk"), kw=["format"])
        tjv("model_other", lambda o: setp(o, ("model",), "kimi-linear"), expect="any", kw=["model"])
        tjv("n_layers_12", lambda o: setp(o, ("n_layers",), 12), kw=["n_layers", "layer"])
        tjv("n_layers_14", lambda o: setp(o, ("n_layers",), 14), kw=["n_layers", "layer"])
        tjv("n_layers_0", lambda o: setp(o, ("n_layers",), 0), kw=["n_layers", "layer"])
        tjv("n_layers_neg", lambda o: setp(o, ("n_layers",), -1), kw=["n_layers"])
        tjv("n_layers_huge", lambda o: setp(o, ("n_layers",), 2 ** 64 - 1), kw=["n_layers"])
        tjv("align_0", lambda o: setp(o, ("align",), 0), kw=["align"])
        tjv("align_1", lambda o: setp(o, ("align",), 1), expect="any", kw=["align"])
        tjv("align_3000", lambda o: setp(o, ("align",), 3000), kw=["align"])
        tjv("align_huge", lambda o: setp(o, ("align",), 2 ** 63), kw=["align"])
        tjv("packed_bytes_wrong", lambda o: setp(o, ("packed_bytes",), o["packed_bytes"] + 1),
            kw=["packed_bytes"])
        tjv("file_bytes_wrong", lambda o: setp(o, ("file_bytes",), o["file_bytes"] + 4096),
            kw=["file_bytes", "trunk.bin"])
        tjv("file_bytes_huge", lambda o: setp(o, ("file_bytes",), 2 ** 64 - 1),
            kw=["file_bytes", "trunk.bin"])
        tjv("layers_drop_last", lambda o: o["layers"].pop(), kw=["layer"])
        tjv("layers_dup", lambda o: o["layers"].insert(1, copy.deepcopy(o["layers"][1])),
            kw=["layer"])
        tjv("layers_swap_1_2", lambda o: o["layers"].__setitem__(slice(1, 3), o["layers"][2:0:-1]),
            kw=["layer"])
        tjv("layers_empty", lambda o: setp(o, ("layers",), []), kw=["layer"])
        tjv("layers_missing", lambda o: delp(o, ("layers",)), kw=["layers"])
        L = ("layers", 2)
        tjv("layer_index_wrong", lambda o: setp(o, L + ("layer",), 5), kw=["layer"])
        tjv("layer_offset_plus4096", lambda o: setp(o, L + ("offset",), o["layers"][2]["offset"] + 4096),
            kw=["layer 2", "offset"])
        tjv("layer_offset_plus1", lambda o: setp(o, L + ("offset",), o["layers"][2]["offset"] + 1),
            kw=["layer 2", "offset", "align"])
        tjv("layer_offset_neg", lambda o: setp(o, L + ("offset",), -4096), kw=["layer 2", "offset"])
        tjv("layer_offset_eof", lambda o: setp(o, L + ("offset",), o["file_bytes"]), kw=["layer 2", "offset"])
        tjv("layer_offset_huge", lambda o: setp(o, L + ("offset",), 2 ** 64 - 4096), kw=["layer 2", "offset"])
        tjv("layer_offset_overlap_prev", lambda o: setp(o, L + ("offset",), o["layers"][1]["offset"]),
            kw=["layer 2", "offset", "overlap"])
        tjv("layer_size_plus1", lambda o: setp(o, L + ("size",), o["layers"][2]["size"] + 1),
            kw=["layer 2", "size"])
        tjv("layer_size_minus1", lambda o: setp(o, L + ("size",), o["layers"][2]["size"] - 1),
            kw=["layer 2", "size"])
        tjv("layer_size_0", lambda o: setp(o, L + ("size",), 0), kw=["layer 2", "size"])
        tjv("layer_size_huge", lambda o: setp(o, L + ("size",), 2 ** 63), kw=["layer 2", "size"])
        tjv("layer_size_missing", lambda o: delp(o, L + ("size",)), kw=["size"])
        tjv("layer_source_shard_other", lambda o: setp(o, L + ("source_shard",), SHARD[3]),
            expect="any", kw=["layer 2", "source"])
        tjv("layer_source_offset_other", lambda o: setp(o, L + ("source_offset",), 0),
            expect="any", kw=["layer 2", "source"])
        TT = L + ("tensors", 3)
        tjv("tensor_offset_plus2", lambda o: setp(o, TT + ("offset",), getp(o, TT)["offset"] + 2),
            kw=["layer 2", "offset"])
        tjv("tensor_offset_beyond", lambda o: setp(o, TT + ("offset",), o["layers"][2]["size"]),
            kw=["layer 2", "offset"])
        tjv("tensor_offset_huge", lambda o: setp(o, TT + ("offset",), 2 ** 64 - 2),
            kw=["layer 2", "offset"])
        tjv("tensor_offset_swap", lambda o: [setp(o, L + ("tensors", i, "offset"), v) for i, v in
                                             [(3, getp(o, L + ("tensors", 4, "offset"))),
                                              (4, getp(o, L + ("tensors", 3, "offset")))]] and None,
            kw=["layer 2", "offset"])
        tjv("tensor_size_wrong", lambda o: setp(o, TT + ("size",), getp(o, TT)["size"] + 2), kw=["layer 2", "size"])
        tjv("tensor_dtype_wrong", lambda o: setp(o, TT + ("dtype",), "F16"), kw=["dtype", "layer 2"])
        tjv("tensor_shape_swapped", lambda o: setp(o, TT + ("shape",), getp(o, TT)["shape"][::-1]),
            kw=["shape", "layer 2"])
        tjv("tensor_name_wrong", lambda o: setp(o, TT + ("name",), "language_model.bogus"), kw=["bogus", "layer 2"])
        tjv("tensor_name_other_layer", lambda o: setp(o, TT + ("name",), getp(o, TT)["name"].replace(
            "layers.2.", "layers.3.")), kw=["layer"])
        tjv("tensor_role_wrong", lambda o: setp(o, TT + ("role",), "Router"), expect="any", kw=["role"])
        tjv("tensor_removed", lambda o: getp(o, L + ("tensors",)).pop(3), kw=["layer 2"])
        tjv("tensor_dup", lambda o: getp(o, L + ("tensors",)).append(copy.deepcopy(getp(o, TT))),
            kw=["layer 2"])
        tjv("globals_removed", lambda o: delp(o, ("globals",)), expect="any", kw=["globals"])
        tjv("globals_garbage", lambda o: setp(o, ("globals",), [{"name": 1}]), expect="any", kw=["globals"])
        tjv("extra_key", lambda o: setp(o, ("zz_unknown",), 1), expect="any")
        tb = rd(tsrc + "/trunk.json")
        trv("json_truncated", {"trunk.json": tb[:len(tb) // 2]}, kw=["trunk.json"])
        trv("json_empty", {"trunk.json": b""}, kw=["trunk.json"])
        trv("json_missing", {"trunk.json": ("special", "delete")}, kw=["trunk.json"])
        trv("bin_missing", {"trunk.bin": ("special", "delete")}, kw=["trunk.bin"])
        trv("bin_is_dir", {"trunk.bin": ("special", "dir")}, kw=["trunk.bin"])
        trv("bin_symloop", {"trunk.bin": ("special", "symloop")}, kw=["trunk.bin"])
        trv("bin_devzero", {"trunk.bin": ("special", "devzero")}, kw=["trunk.bin"])
        trv("bin_fifo", {"trunk.bin": ("special", "fifo")}, expect="any", kw=["trunk.bin"])
        trv("bin_empty", {"trunk.bin": b""}, kw=["trunk.bin"])
        trv("bin_trunc_minus1", {"trunk.bin": lambda b: b[:-1]}, kw=["trunk.bin"])
        trv("bin_trunc_half", {"trunk.bin": lambda b: b[:len(b) // 2]}, kw=["trunk.bin"])
        trv("bin_extended", {"trunk.bin": lambda b: b + b"\0" * 4096}, expect="any", kw=["trunk.bin"])
        # same length, zero the last layer's bytes / flip bits in weight data
        off2 = tj["layers"][2]["offset"]
        if tname == "raw":
            flips = [("l2_start", off2), ("l2_mid", off2 + tj["layers"][2]["size"] // 2),
                     ("l12_last", tj["layers"][12]["offset"] + tj["layers"][12]["size"] - 1)]
        else:
            c2 = tj["layers"][2]["stored"]["chunks"]
            c12 = tj["layers"][12]["stored"]["chunks"][-1]
            flips = [("l2_start", off2), ("l2_mid", off2 + c2[len(c2) // 2]["at"] + 5),
                     ("l12_last", tj["layers"][12]["offset"] + c12["at"] + c12["len"] - 1)]
        for tag, pos in flips:
            for mode, args in [("ring", TR), ("pinned", TP)]:
                trv("bitflip_%s.%s" % (tag, mode),
                    {"trunk.bin": lambda b, pos=pos: b[:pos] + bytes([b[pos] ^ 0x40]) + b[pos + 1:]},
                    expect="any", args=args, kw=["layer", "trunk"])
        trv("zero_layer2.ring", {"trunk.bin": lambda b: b[:off2] + b"\0" * tj["layers"][2]["size"]
                                 + b[off2 + tj["layers"][2]["size"]:]}, expect="any",
            kw=["layer"])
        # another model's trunk
        V("trunk_%s.other_model_odd9" % tname, "trunk", lambda vd: {"M": BASE, "T": TRUNK_ODD9}, TR,
          kw=["trunk", "layer", "odd9"])
        V("trunk_%s.other_model_tiny2_same_shape" % tname, "trunk",
          lambda vd: {"M": BASE, "T": TRUNK_TINY2}, TR, kw=["packed trunk", "other weights"],
          note="same spec, other weights: refused by the layer weights fingerprint (the inputs are packed by the binary under test)")
        V("trunk_%s.model_odd9_with_this_trunk" % tname, "trunk", lambda vd, t=tsrc: {"M": OTHER_ODD9, "T": t},
          ["{M}", "--trunk", "{T}", "--trunk-gb", "0.001"] + RUN, kw=["trunk", "layer"])
        V("trunk_%s.trunk_is_model_dir" % tname, "trunk", lambda vd: {"M": BASE, "T": BASE}, TR,
          kw=["trunk"])
        V("trunk_%s.trunk_nonexistent" % tname, "trunk", lambda vd: {"M": BASE, "T": vd + "/nope"}, TR,
          kw=["nope", "trunk"])
        V("trunk_%s.trunk_is_file" % tname, "trunk", lambda vd: {"M": BASE, "T": BASE + "/config.json"}, TR,
          kw=["trunk"])

        if tname == "z":
            C = ("compression",)
            tjv("codec_unknown", lambda o: setp(o, C + ("codec",), "zstd"), kw=["codec"])
            tjv("compression_removed", lambda o: delp(o, C), kw=["compression"])
            tjv("chunk_bytes_0", lambda o: setp(o, C + ("chunk_bytes",), 0), kw=["chunk_bytes"])
            tjv("chunk_bytes_3", lambda o: setp(o, C + ("chunk_bytes",), 3), kw=["chunk_bytes"])
            tjv("chunk_bytes_double", lambda o: setp(o, C + ("chunk_bytes",), 32768), kw=["chunk"])
            tjv("chunk_bytes_half", lambda o: setp(o, C + ("chunk_bytes",), 8192), kw=["chunk"])
            tjv("chunk_bytes_huge", lambda o: setp(o, C + ("chunk_bytes",), 2 ** 64 - 1), kw=["chunk"])
            tjv("stored_bytes_wrong", lambda o: setp(o, C + ("stored_bytes",), 5), kw=["stored_bytes"])
            CH = L + ("stored", "chunks")
            tjv("chunk_at_unaligned", lambda o: setp(o, CH + (2, "at"), getp(o, CH + (2, "at")) + 1),
                kw=["layer 2", "chunk"])
            tjv("chunk_at_overlap", lambda o: setp(o, CH + (2, "at"), getp(o, CH + (1, "at"))),
                kw=["layer 2", "chunk"])
            tjv("chunk_at_huge", lambda o: setp(o, CH + (2, "at"), 2 ** 64 - 4096), kw=["layer 2", "chunk"])
            tjv("chunk_at_beyond_layer", lambda o: setp(o, CH + (-1, "at"), o["layers"][2]["size"] + 4096),
                kw=["layer 2", "chunk"])
            tjv("chunk_len_0", lambda o: setp(o, CH + (2, "len"), 0), kw=["layer 2", "chunk"])
            tjv("chunk_len_plus1", lambda o: setp(o, CH + (2, "len"), getp(o, CH + (2, "len")) + 1),
                kw=["layer 2", "chunk"])
            tjv("chunk_len_minus1", lambda o: setp(o, CH + (2, "len"), getp(o, CH + (2, "len")) - 1),
                kw=["layer 2", "chunk"])
            tjv("chunk_len_gt_chunk", lambda o: setp(o, CH + (2, "len"), 16385), kw=["layer 2", "chunk"])
            tjv("chunk_len_huge", lambda o: setp(o, CH + (2, "len"), 2 ** 64 - 1), kw=["layer 2", "chunk"])
            tjv("chunk_z_true_to_false", lambda o: setp(o, CH + (2, "z"), False), kw=["layer 2", "chunk"])
            tjv("chunk_raw_to_z", lambda o: setp(o, L + ("stored", "chunks", 0, "z"), True),
                kw=["layer 2", "chunk"])
            tjv("chunk_removed", lambda o: getp(o, CH).pop(3), kw=["layer 2", "chunk"])
            tjv("chunk_extra", lambda o: getp(o, CH).append({"at": getp(o, CH)[-1]["at"] + 4096, "len": 10, "z": True}),
                kw=["layer 2", "chunk"])
            tjv("chunks_empty", lambda o: setp(o, CH, []), kw=["layer 2", "chunk"])
            tjv("stored_removed", lambda o: delp(o, L + ("stored",)), kw=["layer 2", "stored"])
            tjv("stored_bytes_layer_wrong", lambda o: setp(o, L + ("stored", "bytes"), 7),
                kw=["layer 2", "stored"])
            # record-level damage inside trunk.bin: layer 2, chunk 2 (a coded record)
            l2 = tj["layers"][2]
            ck = l2["stored"]["chunks"][2]
            assert ck["z"]
            rec = l2["offset"] + ck["at"]
            rl = ck["len"]
            foot = rec + rl - 20

            def patch(pos, newb):
                return lambda b: b[:pos] + newb + b[pos + len(newb):]
            nexc = struct.unpack("<I", rd(tsrc + "/trunk.bin")[foot:foot + 4])[0]
            for mode, args in [("ring", TR), ("pinned", TP)]:
                trv("rec_exc_count_ffff.%s" % mode, {"trunk.bin": patch(foot, struct.pack("<I", 0xFFFFFFFF))},
                    args=args, kw=["layer 2", "chunk"])
                trv("rec_exc_count_plus1.%s" % mode, {"trunk.bin": patch(foot, struct.pack("<I", nexc + 1))},
                    args=args, kw=["layer 2", "chunk"])
                trv("rec_exc_count_0.%s" % mode, {"trunk.bin": patch(foot, struct.pack("<I", 0))},
                    args=args, kw=["layer 2", "chunk"], expect="error" if nexc else "any")
                trv("rec_table_flip.%s" % mode, {"trunk.bin": lambda b, p=foot + 8: b[:p] + bytes([b[p] ^ 0x80]) + b[p + 1:]},
                    args=args, expect="any", kw=["layer 2", "chunk"])
                trv("rec_code_flip.%s" % mode, {"trunk.bin": lambda b, p=rec + 16: b[:p] + bytes([b[p] ^ 0x0F]) + b[p + 1:]},
                    args=args, expect="any", kw=["layer 2", "chunk"])
                trv("rec_code_all_escape.%s" % mode, {"trunk.bin": lambda b, p=rec + 16: b[:p] + b"\xff" * 8 + b[p + 8:]},
                    args=args, kw=["layer 2", "chunk"])
                trv("rec_low_flip.%s" % mode, {"trunk.bin": lambda b, p=rec + 3: b[:p] + bytes([b[p] ^ 0x01]) + b[p + 1:]},
                    args=args, expect="any", kw=["layer 2", "chunk"])
                trv("rec_zero_whole.%s" % mode, {"trunk.bin": lambda b: b[:rec] + b"\0" * rl + b[rec + rl:]},
                    args=args, expect="any", kw=["layer 2", "chunk"])
                trv("rec_ff_whole.%s" % mode, {"trunk.bin": lambda b: b[:rec] + b"\xff" * rl + b[rec + rl:]},
                    args=args, kw=["layer 2", "chunk"])
                if nexc:
                    # exceptions: nexc u32 indices then nexc bytes before the footer
                    ex0 = foot - nexc - 4 * nexc
                    trv("rec_exc_index_huge.%s" % mode, {"trunk.bin": patch(ex0, struct.pack("<I", 0xFFFFFFF0))},
                        args=args, kw=["layer 2", "chunk"])
            # 2 MiB-chunk compressed trunk (one record per layer)
            V("trunk_z2m.baseline", "trunk", lambda vd: {"M": BASE, "T": TRUNK_Z2M}, TR, expect="ok")

    # ---------------- CLI values
    def cli(name, args, expect="error", kw=(), note="", setup=None):
        V("cli." + name, "cli", setup or plain(), args, expect=expect, kw=kw, note=note)

    base_ok = ["{M}"]
    cli("baseline", base_ok + RUN, "ok")
    cli("baseline_trunk_raw", base_ok + ["--trunk", TRUNK_RAW, "--trunk-gb", "0.001"] + RUN, "ok")
    cli("baseline_trunk_z", base_ok + ["--trunk", TRUNK_Z, "--trunk-gb", "0.001"] + RUN, "ok")
    G = ["--gen", "4", "--incremental"]
    for nm, ids, exp in [("oov_256", "1,2,256", "error"), ("oov_511", "511", "error"),
                         ("oov_u32max", "4294967295", "error"), ("u32_overflow", "4294967296", "error"),
                         ("huge_value", "1" + "0" * 30, "error"), ("neg", "-1", "error"),
                         ("neg_in_list", "1,-2,3", "error"), ("empty", "", "error"),
                         ("comma_only", ",", "error"), ("double_comma", "1,,2", "error"),
                         ("trailing_comma", "1,2,", "any"), ("spaces", "1, 2, 3", "any"),
                         ("hex", "0x10", "error"), ("float", "1.5", "error"), ("word", "abc", "error"),
                         ("last_in_vocab", "255", "ok_any"), ("zero", "0", "ok_any"),
                         ("plus", "+1", "any")]:
        cli("ids.%s" % nm, base_ok + ["--ids=" + ids] + G, "any" if exp == "ok_any" else exp,
            kw=["--ids", "id", "vocab"])
    cli("ids.long_8000", base_ok + ["--ids", ",".join(str(i % 256) for i in range(8000)), "--gen", "1",
                                    "--incremental"], "any", note="slow, legit work")
    cli("ids.missing", base_ok + ["--gen", "2"], "error", kw=["--ids", "prompt"])
    cli("batch_ids.oov", base_ok + ["--batch-ids", "1,2;3,999"] + G, "error", kw=["999", "vocab", "batch"])
    cli("batch_ids.empty_seq", base_ok + ["--batch-ids", "1,2;;3"] + G, "error", kw=["batch"])
    cli("batch_ids.empty", base_ok + ["--batch-ids="] + G, "error", kw=["batch"])
    cli("batch_ids.many", base_ok + ["--batch-ids", ";".join(["1,2"] * 2000)] + G, "any",
        kw=["batch"])
    for g, exp in [("0", "any"), ("4096", "any"), ("4097", "error"), ("-1", "error"),
                   ("1000000000", "error"), ("18446744073709551616", "error"), ("abc", "error")]:
        cli("gen." + g, base_ok + ["--ids", "1,2,3", "--gen=" + g, "--incremental"], exp, kw=["--gen", "gen"])
    cli("gen.4096_full_recompute", base_ok + ["--ids", "1,2,3", "--gen", "300"], "any",
        note="full recompute (no --incremental)")
    TRK = ["--trunk", TRUNK_RAW]
    for v, exp in [("0", "error"), ("-1", "error"), ("NaN", "error"), ("nan", "error"), ("inf", "any"),
                   ("-inf", "error"), ("1e30", "any"), ("1e-30", "error"), ("1e308", "any"),
                   ("1e309", "any"), ("0.0003", "error"), ("abc", "error"), ("", "error")]:
        cli("trunk_gb." + (v or "empty"), base_ok + TRK + ["--trunk-gb=" + v] + RUN, exp,
            kw=["--trunk-gb", "trunk budget", "budget"])
    cli("trunk_gb_without_trunk", base_ok + ["--trunk-gb", "0.001"] + RUN, "any", kw=["--trunk"])
    for v, exp in [("NaN", "error"), ("-1", "error"), ("inf", "any"), ("1e30", "any"), ("-0", "any"),
                   ("1e-300", "any"), ("abc", "error")]:
        cli("cache_gb." + v, base_ok + ["--cache-gb=" + v] + RUN, exp, kw=["--cache-gb", "cache"])
        cli("cache_gb_trunk." + v, base_ok + TRK + ["--trunk-gb", "0.001", "--cache-gb=" + v] + RUN, exp,
            kw=["--cache-gb", "cache"])
    for v, exp in [("0", "any"), ("1", "any"), ("10000", "any"), ("-1", "error"), ("1000000", "any"),
                   ("abc", "error")]:
        cli("threads." + v, base_ok + ["--threads=" + v] + RUN, exp, kw=["--threads", "thread"])
    for v, exp in [("0", "error"), ("4097", "error"), ("1", "ok"), ("-1", "error"), ("4096", "ok"),
                   ("99999999999", "error")]:
        cli("prefill_chunk." + v, base_ok + ["--prefill-chunk=" + v] + RUN, exp, kw=["--prefill-chunk"])
    for v, exp in [("0", "error"), ("33", "error"), ("1000000", "error"), ("-1", "error"), ("32", "ok"),
                   ("1", "ok")]:
        cli("speculate." + v, base_ok + ["--speculate=" + v] + RUN, exp, kw=["--speculate"])
    cli("speculate.no_incremental", base_ok + ["--speculate", "4", "--ids", "1,2,3", "--gen", "4"], "error",
        kw=["--speculate", "--incremental"])
    cli("speculate.batch", base_ok + ["--speculate", "4", "--batch-ids", "1,2;3,4", "--gen", "4", "--incremental"],
        "error", kw=["--speculate", "--batch-ids"])
    for v, exp in [("0", "error"), ("1", "ok"), ("1000000", "any"), ("-1", "error")]:
        cli("trunk_ring." + v, base_ok + TRK + ["--trunk-gb", "0.001", "--trunk-ring=" + v] + RUN, exp,
            kw=["--trunk-ring", "ring"])
    for v, exp in [("-1", "error"), ("abc", "error"), ("1000000000", "any"), ("NaN", "error")]:
        cli("expert_prefetch." + v, base_ok + ["--cache-gb", "0.00005", "--expert-prefetch=" + v] + RUN, exp,
            kw=["--expert-prefetch", "prefetch"])
    for v, exp in [("0", "error"), ("1", "any"), ("14", "error"), ("1000", "error"), ("-1", "error")]:
        cli("layers." + v, base_ok + ["--layers=" + v] + RUN, exp, kw=["--layers", "layer"])
    for v, exp in [("0", "error"), ("1", "error"), ("3", "any"), ("18446744073709551615", "error"),
                   ("1000000000000", "error")]:
        cli("max_context." + v, base_ok + ["--max-context=" + v] + RUN, exp, kw=["--max-context", "context"])
    cli("stop_id.oov", base_ok + ["--stop-id", "99999"] + RUN, "any", kw=["--stop-id"])
    cli("stop_id.too_many", base_ok + ["--stop-id", "1,2,3,4,5,6,7,8,9"] + RUN, "error", kw=["--stop-id"])
    cli("io.bogus", base_ok + TRK + ["--io", "bogus"] + RUN, "error", kw=["--io", "bogus"])
    cli("io.devnull", base_ok + TRK + ["--io", "/dev/null"] + RUN, "error", kw=["--io", "/dev/null"])
    cli("resident.bogus", base_ok + ["--resident", "bogus"] + RUN, "error", kw=["--resident"])
    cli("resident.arena", base_ok + ["--resident", "arena"] + RUN, "ok")
    cli("preset.bogus", base_ok + TRK + ["--preset", "bogus"] + RUN, "error", kw=["preset", "bogus"])
    cli("preset.devnull", base_ok + TRK + ["--preset", "/dev/null"] + RUN, "error", kw=["preset", "/dev/null"])
    cli("manifest.devnull", base_ok + ["--manifest", "/dev/null"] + RUN, "error", kw=["manifest", "/dev/null"])
    cli("manifest.config_json", base_ok + ["--manifest", BASE + "/config.json"] + RUN, "error", kw=["manifest"])
    cli("config.devnull", base_ok + ["--config", "/dev/null"] + RUN, "error", kw=["/dev/null", "config"])
    cli("model_dir.nonexistent", [ROOT + "/nope"] + RUN, "error", kw=["nope"])
    cli("model_dir.file", [BASE + "/config.json"] + RUN, "error", kw=["config.json"])
    cli("model_dir.empty_dir", ["{V}"] + RUN, "error", kw=["config.json"])
    cli("out.is_dir", base_ok + RUN + ["--out", "/tmp"], "error", kw=["/tmp", "--out"])
    cli("out.nonexistent_dir", base_ok + RUN + ["--out", "/nonexistent/x.json"], "error", kw=["/nonexistent"])
    cli("dump_logits.bad", base_ok + RUN + ["--dump-logits", "/nonexistent/x.bin"], "error", kw=["/nonexistent"])
    cli("save_state.bad_dir", base_ok + ["--ids", "1,2", "--gen", "0", "--incremental", "--save-state",
                                         "/nonexistent/s"], "error", kw=["/nonexistent"])
    cli("save_state.gen_nonzero", base_ok + ["--ids", "1,2", "--gen", "3", "--incremental", "--save-state",
                                             "{V}/s"], "error", kw=["--save-state", "--gen"])
    # --load-state
    rs = random.Random(7)

    def stfile(content):
        def ex(vdir):
            p = vdir + "/s.state"
            with open(p, "wb") as f:
                f.write(content if isinstance(content, bytes) else content(rd(STATES + "/base.state")))
            return {"S": p}
        return plain(ex)
    LS = ["{M}", "--ids", "4,5", "--gen", "3", "--incremental", "--load-state", "{S}"]
    bs = rd(STATES + "/base.state")
    hl = struct.unpack("<I", bs[12:16])[0]
    for nm, c in [("random", bytes(rs.randrange(256) for _ in range(200000))), ("empty", b""),
                  ("magic_only", b"K3STATE\0"), ("truncated_half", bs[:len(bs) // 2]),
                  ("truncated_minus1", bs[:-1]), ("trailing_junk", bs + b"junk"),
                  ("version_2", bs[:8] + struct.pack("<I", 2) + bs[12:]),
                  ("hdrlen_huge", bs[:12] + struct.pack("<I", 0xFFFFFFFF) + bs[16:]),
                  ("hdrlen_0", bs[:12] + struct.pack("<I", 0) + bs[16:]),
                  ("hdr_garbage", bs[:16] + b"\xff" * hl + bs[16 + hl:]),
                  ("count_huge", bs[:16 + hl] + struct.pack("<Q", 2 ** 62) + bs[16 + hl + 8:]),
                  ("count_u64max", bs[:16 + hl] + struct.pack("<Q", 2 ** 64 - 1) + bs[16 + hl + 8:]),
                  ("count_minus1", bs[:16 + hl] + struct.pack("<Q", struct.unpack("<Q", bs[16 + hl:24 + hl])[0] - 1)
                   + bs[16 + hl + 8:]),
                  ("nan_values", bs[:16 + hl + 8] + b"\x00\x00\xc0\x7f" * 64 + bs[16 + hl + 8 + 256:]),
                  ]:
        V("state." + nm, "state", stfile(c), LS, expect="any" if nm == "nan_values" else "error",
          kw=["state", "s.state"])
    for nm, fn in [("n_pos_wrong", lambda h: h.update(n_pos=h["n_pos"] + 1)),
                   ("ids_extra", lambda h: h.update(ids=h["ids"] + [7])),
                   ("ids_oov", lambda h: h.update(ids=[999, 2, 3])),
                   ("ids_empty", lambda h: h.update(ids=[])),
                   ("n_layers_wrong", lambda h: h.update(n_layers=12)),
                   ("fingerprint_wrong", lambda h: h.update(spec_fingerprint="0" * 16)),
                   ("model_other", lambda h: h.update(model="other")),
                   ("n_pos_huge", lambda h: h.update(n_pos=2 ** 60))]:
        def mk(b, fn=fn):
            h = json.loads(b[16:16 + hl])
            fn(h)
            hb = json.dumps(h).encode()
            return b[:12] + struct.pack("<I", len(hb)) + hb + b[16 + hl:]
        V("state." + nm, "state", stfile(mk), LS, expect="any" if nm in ("ids_extra", "model_other") else "error",
          kw=["state", "s.state"])
    V("state.other_model_odd9", "state", plain(lambda vd: {"S": STATES + "/odd9.state"}), LS,
      kw=["state", "odd9.state"])
    V("state.other_weights_tiny2", "state", plain(lambda vd: {"S": STATES + "/tiny2.state"}), LS,
      kw=["other weights"], note="same spec, other weights: refused by the weights fingerprint (the state is saved by the binary under test)")
    V("state.is_dir", "state", plain(lambda vd: {"S": STATES}), LS, kw=["state"])
    V("state.nonexistent", "state", plain(lambda vd: {"S": vd + "/nope"}), LS, kw=["nope"])
    V("state.devzero", "state", plain(lambda vd: {"S": "/dev/zero"}), LS, kw=["/dev/zero"])
    V("state.ok_baseline", "state", plain(lambda vd: {"S": STATES + "/base.state"}), LS, expect="ok_state")
    V("state.with_batch", "state", plain(lambda vd: {"S": STATES + "/base.state"}),
      ["{M}", "--batch-ids", "4,5;6", "--gen", "3", "--incremental", "--load-state", "{S}"], expect="any",
      kw=["--load-state", "--batch-ids"])


# ================================================================ RUNNER
def limit():
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


IDS_RE = re.compile(r"generated ids: \[([0-9, ]*)\]")


def classify(v, rc, out):
    panicked = "panicked" in out
    ids = None
    m = IDS_RE.search(out)
    if m:
        ids = [int(x) for x in m.group(1).split(",") if x.strip()]
    if rc in (124, 137) or rc is None:
        return "timeout", ids
    if panicked or rc == 101:
        return "panic", ids
    if rc < 0 or rc > 128:
        return "signal", ids
    exp = v["expect"]
    if rc == 0:
        if exp == "error":
            return "ran_but_should_fail", ids
        if exp == "ok" and ids is not None and ids != BASE_IDS and "--ids" in v["args"] and "1,2,3" in v["args"]:
            return "wrong_output", ids
        if exp == "any" and ids is not None and v["args"][1:6] == RUN[0:5] and ids != BASE_IDS:
            return "ran_different_ids", ids
        if exp == "any" and ids is not None and "--trunk" in v["args"] and ids != BASE_IDS \
                and "1,2,3" in v["args"]:
            return "ran_different_ids", ids
        return "ok_run", ids
    if exp in ("ok", "ok_state"):
        return "unexpected_error", ids
    tail = "\n".join(out.strip().splitlines()[-4:]).lower()
    if v["kw"] and not any(k.lower() in tail for k in v["kw"]):
        return "unclear_error", ids
    return "clean_error", ids


def run_one(v):
    vdir = os.path.join(VAR, v["name"].replace("/", "_"))
    if os.path.lexists(vdir):
        shutil.rmtree(vdir)
    os.makedirs(vdir)
    ph = {"V": vdir, "M": BASE, "T": TRUNK_RAW, "S": STATES}
    ph.update(v["setup"](vdir) or {})
    args = [a.replace("{M}", ph["M"]).replace("{T}", ph["T"]).replace("{V}", vdir).replace("{S}", ph["S"])
            for a in v["args"]]
    cmd = ["timeout", "-k", "5", "60", BIN] + args
    if args and args[0] not in ("pack-trunk", "synth", "plan"):
        cmd += ["--out", os.path.join(vdir, "run.json")] if "--out" not in args else []
    t0 = time.time()
    p = subprocess.run(cmd, cwd=vdir, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, preexec_fn=limit)
    dt = time.time() - t0
    out = p.stdout.decode(errors="replace") + "\n" + p.stderr.decode(errors="replace")
    with open(os.path.join(vdir, "output.txt"), "w") as f:
        f.write(" ".join(cmd) + "\n-----\n" + out)
    cls, ids = classify(v, p.returncode, out)
    err_tail = [l for l in p.stderr.decode(errors="replace").strip().splitlines()][-3:]
    return dict(name=v["name"], cat=v["cat"], expect=v["expect"], rc=p.returncode, cls=cls,
                secs=round(dt, 2), ids=ids, stderr_tail=err_tail, cmd=" ".join(cmd), note=v["note"])


# ================================================================ SETUP (inputs made by the binary)
def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def run_bin(args, what):
    cmd = [BIN] + args
    p = subprocess.run(cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE)
    if p.returncode != 0:
        sys.exit("fuzz.py: setup step '%s' failed (exit %d): %s\n%s" % (
            what, p.returncode, " ".join(cmd), p.stderr.decode(errors="replace")[-2000:]))
    return p


# name -> the k3-run arguments that make it (in order: later steps use earlier outputs)
def setup_steps():
    spec = lambda n: os.path.join(REPO, "configs", "synth", n)
    save = lambda m, out: [m, "--ids", "1,2,3", "--gen", "0", "--incremental", "--save-state", out]
    return [
        ("base", ["synth", "--spec", spec("tiny.toml"), "--seed", "1", "--out", BASE]),
        ("other_tiny2", ["synth", "--spec", spec("tiny.toml"), "--seed", "2", "--out", OTHER_TINY2]),
        ("other_odd9", ["synth", "--spec", spec("odd9.toml"), "--seed", "9", "--out", OTHER_ODD9]),
        ("trunk_raw", ["pack-trunk", BASE, TRUNK_RAW]),
        ("trunk_z16", ["pack-trunk", "--compress", "--chunk-kib", "16", BASE, TRUNK_Z]),
        ("trunk_z", ["pack-trunk", "--compress", BASE, TRUNK_Z2M]),
        ("trunk_odd9", ["pack-trunk", OTHER_ODD9, TRUNK_ODD9]),
        ("trunk_tiny2", ["pack-trunk", OTHER_TINY2, TRUNK_TINY2]),
        ("states/base.state", save(BASE, STATES + "/base.state")),
        ("states/odd9.state", save(OTHER_ODD9, STATES + "/odd9.state")),
        ("states/tiny2.state", save(OTHER_TINY2, STATES + "/tiny2.state")),
    ]


STAMP = "inputs.json"


def inputs_ready(bin_hash):
    """None if the inputs are there and were made by this binary, else why not."""
    try:
        st = json.loads(rd(os.path.join(ROOT, STAMP)))
    except (OSError, ValueError):
        return "no %s/%s" % (ROOT, STAMP)
    for name, _ in setup_steps():
        if not os.path.exists(os.path.join(ROOT, name)):
            return "%s missing" % name
    if st.get("bin_sha256") != bin_hash:
        return "inputs were made by another binary (%s)" % st.get("bin", "?")
    return None


def setup(bin_hash):
    t0 = time.time()
    for name, _ in setup_steps():
        p = os.path.join(ROOT, name)
        if os.path.isdir(p):
            shutil.rmtree(p)
        elif os.path.lexists(p):
            os.unlink(p)
    try:
        os.unlink(os.path.join(ROOT, STAMP))
    except FileNotFoundError:
        pass
    os.makedirs(STATES, exist_ok=True)
    for name, args in setup_steps():
        print("setup: k3-run %s" % " ".join(args), flush=True)
        run_bin(args, name)
    with open(os.path.join(ROOT, STAMP), "w") as f:
        json.dump({"bin": BIN, "bin_sha256": bin_hash, "made": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                   "steps": [["k3-run"] + a for _, a in setup_steps()]}, f, indent=1)
    print("setup: done in %.1f s" % (time.time() - t0), flush=True)


def compute_base_ids():
    """The base model's ids for RUN (what the classification compares against)."""
    out = os.path.join(ROOT, "base_run.json")
    run_bin([BASE] + RUN + ["--out", out], "base request")
    ids = json.loads(rd(out))["generated_ids"]
    if not isinstance(ids, list) or len(ids) != 4:
        sys.exit("fuzz.py: the base request gave %r, not 4 ids" % (ids,))
    return ids


def parse_args(argv):
    opts = {"bin": os.path.join(REPO, "target", "release", "k3-run"),
            "work": os.path.join(REPO, "target", "fuzz"), "setup": False, "only": None,
            "list": False}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("--bin", "--work", "--only"):
            if i + 1 >= len(argv):
                sys.exit("fuzz.py: %s needs a value" % a)
            opts[a[2:]] = argv[i + 1]
            i += 2
        elif a in ("--setup", "--list"):
            opts[a[2:]] = True
            i += 1
        elif a in ("-h", "--help"):
            print(__doc__)
            sys.exit(0)
        else:
            sys.exit("fuzz.py: unknown argument %r (see --help)" % a)
    return opts


def main():
    opts = parse_args(sys.argv[1:])
    set_paths(opts["bin"], opts["work"])
    only = opts["only"]
    if opts["list"]:
        if not os.path.isdir(BASE):
            sys.exit("fuzz.py: --list needs the inputs in %s (run once with --setup)" % ROOT)
        random.seed(1)
        define()
        for v in VARIANTS:
            print(v["name"])
        print(len(VARIANTS), "variants")
        return 0
    if not os.access(BIN, os.X_OK):
        sys.exit("fuzz.py: no executable k3-run at %s (cargo build --release -p k3-run, or --bin)" % BIN)
    os.makedirs(ROOT, exist_ok=True)
    bin_hash = sha256(BIN)
    why = "--setup" if opts["setup"] else inputs_ready(bin_hash)
    if why:
        print("setup (%s) in %s" % (why, ROOT), flush=True)
        setup(bin_hash)
    global BASE_IDS
    BASE_IDS = compute_base_ids()
    print("binary %s; work dir %s; base ids for %s: %s" % (BIN, ROOT, " ".join(RUN), BASE_IDS),
          flush=True)
    random.seed(1)
    define()
    names = [v["name"] for v in VARIANTS]
    dups = {n for n in names if names.count(n) > 1}
    assert not dups, dups
    os.makedirs(VAR, exist_ok=True)
    res_path = ROOT + ("/results.jsonl" if only is None else "/results_only.jsonl")
    results = []
    t0 = time.time()
    with open(res_path, "w") as rf:
        for i, v in enumerate(VARIANTS):
            if only and only not in v["name"]:
                continue
            r = run_one(v)
            results.append(r)
            rf.write(json.dumps(r) + "\n")
            rf.flush()
            print("%4d %-60s rc=%-4s %-20s %5.2fs %s" % (i, r["name"][:60], r["rc"], r["cls"], r["secs"],
                                                        (r["stderr_tail"][-1:] or [""])[0][:150]), flush=True)
    counts = {}
    for r in results:
        counts[r["cls"]] = counts.get(r["cls"], 0) + 1
    sum_path = ROOT + ("/summary.txt" if only is None else "/summary_only.txt")
    with open(sum_path, "w") as f:
        f.write("variants run: %d\n" % len(results))
        for k, n in sorted(counts.items()):
            f.write("%-22s %d\n" % (k, n))
        for r in results:
            if r["cls"] not in ("clean_error", "ok_run"):
                f.write("\n[%s] %s rc=%s\n  %s\n  %s\n" % (r["cls"], r["name"], r["rc"], r["cmd"],
                                                        "\n  ".join(r["stderr_tail"])))
    print(open(sum_path).read().split("\n\n")[0])
    bad = sum(n for k, n in counts.items() if k in FAILING)
    print("fuzz: %d variants in %.0f s: %s; %s (%s, %s)" % (
        len(results), time.time() - t0, ", ".join("%s %d" % kv for kv in sorted(counts.items())),
        "FAIL: %d %s" % (bad, "/".join(k for k in FAILING if k in counts)) if bad else "no failure",
        res_path, sum_path))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
