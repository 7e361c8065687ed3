//! Committed bit patterns: fixed kernel outputs on deterministic inputs, stored as hex in
//! `tests/golden/*.json`, checked on every available ISA path. Because the files are
//! committed, an x86-64 run and an aarch64 run (`kernels/cross-test.sh`) are held to the SAME
//! bits, not only to agreement between paths on one machine.
//!
//! Regenerate (only after an intentional change of a canonical order, and say so in the
//! commit): `K3_BLESS=1 cargo test -p k3-kernels --test golden`.
//! Inputs come from the xorshift generator in `common` (integer arithmetic only).
//! NaN outputs are stored as "nan" and compared as "any NaN".

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;

use common::{Rng, pools};
use k3_kernels::attn::{MlaCache, MlaShape, mla_attend_with};
use k3_kernels::attnres::attnres_mix_with;
use k3_kernels::isa::{Isa, available};
use k3_kernels::kda::{KdaGate, KdaStep, conv_step_with, kda_gate_with, kda_step_with};
use k3_kernels::math;
use k3_kernels::matvec::{
    dot_f32_with, matvec_bf16_with, matvec_f32_with, matvec_mxfp4_with, mxfp4_dequant_row,
};
use k3_kernels::ops::*;
use k3_kernels::router::{RouterCfg, Scoring, route_with};
use serde_json::{Value, json};

const FORMAT: &str = "k3-kernels golden bits v1";

type Cases = BTreeMap<String, Vec<String>>;

fn hex(v: &[f32]) -> Vec<String> {
    v.iter()
        .map(|x| {
            if x.is_nan() {
                "nan".to_string()
            } else {
                format!("{:08x}", x.to_bits())
            }
        })
        .collect()
}

fn put(cases: &mut Cases, name: &str, v: &[f32]) {
    cases.insert(name.to_string(), hex(v));
}

/// Math functions on a fixed set of inputs spanning every branch.
fn math_cases(_isa: Isa) -> Cases {
    let mut r = Rng::new(1);
    let mut xs: Vec<f32> = vec![
        0.0,
        -0.0,
        1.0,
        -1.0,
        0.5,
        0.625,
        -0.625,
        2.0,
        10.0,
        -10.0,
        20.0,
        88.7,
        88.8,
        -87.0,
        -100.0,
        -103.9,
        -104.5,
        1e-30,
        1e-40,
        3e38,
        f32::INFINITY,
        f32::NEG_INFINITY,
    ];
    for i in 0..200i32 {
        // log-spread magnitudes 2^-20 .. 2^12 of both signs, exact construction
        let e = i % 33 - 20;
        let m = 1.0 + (r.next_u32() >> 9) as f32 / 8_388_608.0;
        let v = m * f32::from_bits(((e + 127) as u32) << 23);
        xs.push(if i % 2 == 0 { v } else { -v });
    }
    let mut c = Cases::new();
    type MathFn = (&'static str, fn(f32) -> f32);
    let fns: [MathFn; 7] = [
        ("exp", math::exp),
        ("tanh", math::tanh),
        ("sigmoid", math::sigmoid),
        ("silu", math::silu),
        ("softplus", math::softplus),
        ("ln", math::ln),
        ("rsqrt", math::rsqrt),
    ];
    for (name, f) in fns {
        let ys: Vec<f32> = xs.iter().map(|&x| f(x)).collect();
        put(&mut c, name, &ys);
    }
    c
}

fn matvec_cases(isa: Isa) -> Cases {
    let mut r = Rng::new(2);
    let mut c = Cases::new();
    let pool = &pools()[2];
    let a = r.f32s(1003, 3.0);
    let b = r.f32s(1003, 3.0);
    put(&mut c, "dot_f32_1003", &[dot_f32_with(isa, &a, &b)]);
    let (rows, cols) = (9, 333);
    let x = r.f32s(cols, 2.0);
    let w = r.bf16s(rows * cols, 0.5);
    let mut out = vec![0.0; rows];
    matvec_bf16_with(isa, pool, &w, &x, &mut out);
    put(&mut c, "matvec_bf16_9x333", &out);
    let wf = r.f32s(rows * cols, 0.5);
    matvec_f32_with(isa, pool, &wf, &x, &mut out);
    put(&mut c, "matvec_f32_9x333", &out);
    let (rows, cols) = (7, 160);
    let x = r.f32s(cols, 2.0);
    let packed = r.bytes(rows * cols / 2);
    let mut scales = r.scales(rows * cols / 32);
    scales[3] = 0; // 2^-127 (subnormal scale)
    scales[9] = 200; // 2^73: large but finite products
    let mut out = vec![0.0; rows];
    matvec_mxfp4_with(isa, pool, &packed, &scales, &x, &mut out);
    put(&mut c, "matvec_mxfp4_7x160", &out);
    let mut deq = vec![0.0; cols];
    mxfp4_dequant_row(&packed[..cols / 2], &scales[..cols / 32], &mut deq);
    put(&mut c, "mxfp4_dequant_row0", &deq);
    c
}

fn ops_cases(isa: Isa) -> Cases {
    let mut r = Rng::new(3);
    let mut c = Cases::new();
    let n = 301;
    let x = r.f32s(n, 20.0);
    let w = r.f32s(n, 2.0);
    let mut out = vec![0.0; n];
    rmsnorm_with(isa, &x, Some(&w), 1e-5, &mut out);
    put(&mut c, "rmsnorm_w", &out);
    rmsnorm_with(isa, &x, None, 1e-6, &mut out);
    put(&mut c, "rmsnorm_nw", &out);
    let mut s = x.clone();
    softmax_inplace_with(isa, &mut s);
    put(&mut c, "softmax", &s);
    // SiTU-GLU over magnitudes 0.1 .. 1000 of both signs
    let g: Vec<f32> = (0..n)
        .map(|i| {
            (if i % 2 == 0 { 1.0 } else { -1.0 })
                * 0.1
                * 10f32.powi(i as i32 % 5)
                * (1.0 + r.unit().abs())
        })
        .collect();
    let u = r.f32s(n, 1000.0);
    situ_glu_with(isa, &g, &u, 4.0, Some(25.0), &mut out);
    put(&mut c, "situ_glu", &out);
    silu_glu_with(isa, &g, &u, &mut out);
    put(&mut c, "silu_glu", &out);
    let mut h = r.f32s(4 * 64, 3.0);
    l2norm_heads_with(isa, &mut h, 64, 1e-6, 0.125);
    put(&mut c, "l2norm_heads", &h);
    let mut acc = r.f32s(n, 1.0);
    axpy_with(isa, &mut acc, 0.3, &x);
    mul_sigmoid_inplace_with(isa, &mut acc, &g);
    add_inplace_with(isa, &mut acc, &w);
    put(&mut c, "axpy_mulsig_add", &acc);
    // conv + gates
    let (heads, dk, dv) = (3, 24, 40);
    let ch = heads * dk;
    let mut hist = r.f32s(ch * 3, 2.0);
    let taps = r.f32s(ch * 4, 0.7);
    let mut co = vec![0.0; ch];
    for _ in 0..3 {
        let xin = r.f32s(ch, 2.0);
        conv_step_with(isa, &mut hist, &xin, &taps, 4, &mut co);
    }
    put(&mut c, "conv_out", &co);
    put(&mut c, "conv_hist", &hist);
    let graw = r.f32s(ch, 6.0);
    let a_log = r.f32s(heads + 1, 1.5);
    let dt = r.f32s(ch, 1.0);
    let mut lb = vec![0.0; ch];
    let mut sp = vec![0.0; ch];
    kda_gate_with(
        isa,
        &graw,
        &a_log,
        &dt,
        dk,
        KdaGate::LowerBound(-5.0),
        &mut lb,
    );
    kda_gate_with(isa, &graw, &a_log, &dt, dk, KdaGate::Softplus, &mut sp);
    put(&mut c, "kda_gate_lb", &lb);
    put(&mut c, "kda_gate_softplus", &sp);
    // KDA recurrence, 4 steps
    let mut state = r.f32s(heads * dk * dv, 0.2);
    let mut ko = vec![0.0; heads * dv];
    for t in 0..4 {
        let mut q = r.f32s(ch, 1.0);
        let mut k = r.f32s(ch, 1.0);
        l2norm_heads_with(isa, &mut q, dk, 1e-6, 1.0 / (dk as f32).sqrt());
        l2norm_heads_with(isa, &mut k, dk, 1e-6, 1.0);
        let v = r.f32s(heads * dv, 2.0);
        let beta: Vec<f32> = r
            .f32s(heads, 4.0)
            .iter()
            .map(|&b| math::sigmoid(b))
            .collect();
        let gate = if t % 2 == 0 { &lb } else { &sp };
        let step = KdaStep {
            q: &q,
            k: &k,
            v: &v,
            log_decay: gate,
            beta: &beta,
            n_heads: heads,
            head_dim_k: dk,
            head_dim_v: dv,
        };
        kda_step_with(isa, &pools()[1], &step, &mut state, &mut ko);
    }
    put(&mut c, "kda_out", &ko);
    put(
        &mut c,
        "kda_state_head2_row5",
        &state[(2 * dk + 5) * dv..(2 * dk + 6) * dv],
    );
    // MLA (latent cache, absorbed attention)
    let shape = MlaShape {
        n_heads: 4,
        d_nope: 32,
        d_rope: 16,
        d_v: 24,
        kv_lora: 40,
        n_pos: 11,
        scale: 1.0 / 48f32.sqrt(),
    };
    // the same draws from `r` as the expanded-cache inputs took before (q, 11x4x32, k_rope,
    // 11x4x24), so the cases after this one keep their inputs; kv_b has its own generator
    let q = r.f32s(4 * 48, 2.0);
    let ckv = r.f32s(11 * 4 * 32, 2.0)[..11 * 40].to_vec();
    let kr = r.f32s(11 * 16, 2.0);
    let _ = r.f32s(11 * 4 * 24, 2.0);
    let w = Rng::new(0x4d4c_4131).bf16s(4 * (32 + 24) * 40, 0.3);
    let cache = MlaCache {
        c_kv: &ckv,
        k_rope: &kr,
    };
    let mut wk = vec![0.0; shape.work_len()];
    let mut mo = vec![0.0; 4 * 24];
    mla_attend_with(isa, &pools()[3], &shape, &q, &w, &cache, &mut wk, &mut mo);
    put(&mut c, "mla_work", &wk);
    put(&mut c, "mla_out", &mo);
    // router
    let logits = r.f32s(96, 4.0);
    let bias = r.f32s(96, 1.0);
    for (name, scoring) in [
        ("route_sigmoid", Scoring::Sigmoid),
        ("route_softmax", Scoring::Softmax),
    ] {
        let cfg = RouterCfg {
            top_k: 8,
            scoring,
            renormalize: true,
            scale: 2.5,
        };
        let (mut ids, mut rw) = ([0u32; 8], [0.0f32; 8]);
        route_with(isa, &logits, Some(&bias), &cfg, &mut ids, &mut rw);
        put(&mut c, &format!("{name}_w"), &rw);
        c.insert(
            format!("{name}_ids"),
            ids.iter().map(|i| i.to_string()).collect(),
        );
    }
    // AttnRes
    let srcs: Vec<Vec<f32>> = (0..5).map(|_| r.f32s(200, 30.0)).collect();
    let refs: Vec<&[f32]> = srcs.iter().map(|s| &s[..]).collect();
    let qy = r.f32s(200, 0.2);
    let (mut lg, mut ao) = (vec![0.0; 5], vec![0.0; 200]);
    attnres_mix_with(isa, &refs, &qy, 1e-5, &mut lg, &mut ao);
    put(&mut c, "attnres_p", &lg);
    put(&mut c, "attnres_out", &ao);
    c
}

fn golden_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(format!("{name}.json"))
}

fn check(name: &str, make: fn(Isa) -> Cases) {
    let path = golden_path(name);
    let reference = make(Isa::Scalar);
    if std::env::var("K3_BLESS").is_ok_and(|v| v == "1") {
        let doc = json!({
            "format": FORMAT,
            "regenerate": "K3_BLESS=1 cargo test -p k3-kernels --test golden",
            "generated_on": std::env::consts::ARCH,
            "cases": reference,
        });
        let text = serde_json::to_string_pretty(&doc).expect("golden JSON serialises") + "\n";
        std::fs::write(&path, text).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    }
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; create it with K3_BLESS=1 cargo test -p k3-kernels --test golden",
            path.display()
        )
    });
    let doc: Value = serde_json::from_str(&text).expect("golden file is JSON");
    assert_eq!(doc["format"], FORMAT, "{}: unknown format", path.display());
    let golden: Cases = serde_json::from_value(doc["cases"].clone()).expect("cases map");
    assert_eq!(
        golden.keys().collect::<Vec<_>>(),
        reference.keys().collect::<Vec<_>>(),
        "{name}: case names differ from the golden file (re-bless if intended)"
    );
    for isa in available() {
        let got = if isa == Isa::Scalar {
            reference.clone()
        } else {
            make(isa)
        };
        for (case, want) in &golden {
            let have = &got[case];
            assert_eq!(have.len(), want.len(), "{name}/{case}: length");
            for (i, (h, w)) in have.iter().zip(want).enumerate() {
                assert_eq!(
                    h,
                    w,
                    "{name}/{case}[{i}] on {isa:?} ({}): got {h}, golden {w}",
                    std::env::consts::ARCH
                );
            }
        }
    }
}

#[test]
fn golden_math() {
    check("math", math_cases);
}

#[test]
fn golden_matvec() {
    check("matvec", matvec_cases);
}

#[test]
fn golden_ops() {
    check("ops", ops_cases);
}
