//! Every available ISA path (and every thread count for row/head-parallel kernels) gives the
//! same bits as the scalar reference, on random shapes with ragged tails and edge values.

mod common;

use common::{Rng, assert_same, pools, same_bits, views, views_mut};
use k3_kernels::attn::{MlaCache, MlaShape, mla_attend_with};
use k3_kernels::attnres::attnres_mix_with;
use k3_kernels::isa::{Isa, available};
use k3_kernels::kda::{KdaGate, KdaStep, conv_step_with, kda_gate_with, kda_step_with};
use k3_kernels::matvec::{
    dot_f32_with, matvec_bf16_many_with, matvec_bf16_with, matvec_f32_with, matvec_mxfp4_with,
    mxfp4_dequant_row, rows_bf16_many_with, rows_mxfp4_many_with,
};
use k3_kernels::ops::*;
use k3_kernels::router::{RouterCfg, Scoring, route_with};
use proptest::prelude::*;

fn paths() -> Vec<Isa> {
    available()
}

/// Run a several-input kernel (`many`) on every path and check each output against the
/// one-input scalar reference (`one`); returns the references.
fn check_many(
    label: &str,
    rows: usize,
    xs: &[Vec<f32>],
    many: impl Fn(Isa, &[&[f32]], &mut [&mut [f32]]),
    one: impl Fn(&[f32], &mut [f32]),
) -> Vec<Vec<f32>> {
    let wants: Vec<Vec<f32>> = xs
        .iter()
        .map(|x| {
            let mut want = vec![0.0f32; rows];
            one(x, &mut want);
            want
        })
        .collect();
    let xr = views(xs);
    for isa in paths() {
        let mut outs = vec![vec![f32::NAN; rows]; xs.len()];
        many(isa, &xr, &mut views_mut(&mut outs));
        for (got, want) in outs.iter().zip(&wants) {
            assert_same(&format!("{label} {isa:?}"), got, want);
        }
    }
    wants
}

fn cfg() -> ProptestConfig {
    ProptestConfig {
        cases: 48,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(cfg())]

    #[test]
    fn dot(seed: u64, n in 0usize..300, special in 0u32..2) {
        let mut r = Rng::new(seed);
        let mut a = r.f32s(n, 10.0);
        let b = r.f32s(n, 10.0);
        if special == 1 { r.spice(&mut a, 20); }
        let want = dot_f32_with(Isa::Scalar, &a, &b);
        for isa in paths() {
            let got = dot_f32_with(isa, &a, &b);
            prop_assert!(same_bits(got, want), "{isa:?}: {got:e} vs {want:e}");
        }
    }

    /// Several inputs through one weight read: each output equals the one-input matvec's
    /// bits, on every path, for shapes that span several cache blocks and ragged tails.
    #[test]
    fn bf16_many_inputs(seed: u64, rows in 1usize..300, cols in 1usize..400, n in 1usize..11) {
        let mut r = Rng::new(seed);
        let w = r.bf16s(rows * cols, 1.0);
        let xs: Vec<Vec<f32>> = (0..n).map(|_| r.f32s(cols, 4.0)).collect();
        let p1 = &pools()[0];
        let label = format!("bf16 many {rows}x{cols} of {n}");
        let wants = check_many(&label, rows, &xs,
            |isa, xr, or| rows_bf16_many_with(isa, &w, xr, or),
            |x, want| matvec_bf16_with(Isa::Scalar, p1, &w, x, want));
        // rows split across threads
        let xr = views(&xs);
        for isa in paths() {
            for pool in pools() {
                let mut outs = vec![vec![f32::NAN; rows]; n];
                let mut or = views_mut(&mut outs);
                matvec_bf16_many_with(isa, pool, &w, &xr, &mut or);
                for (got, want) in outs.iter().zip(&wants) {
                    let what = format!("{label} {isa:?} {} threads", pool.n_threads());
                    assert_same(&what, got, want);
                }
            }
        }
    }

    /// MXFP4 rows decoded once for several inputs: each output equals the one-input matvec's
    /// bits, on every path (including the subnormal scale byte 0).
    #[test]
    fn mxfp4_many_inputs(seed: u64, rows in 1usize..40, blocks in 1usize..9, n in 1usize..11) {
        let mut r = Rng::new(seed);
        let cols = blocks * 32;
        let packed = r.bytes(rows * cols / 2);
        let mut scales = r.scales(rows * cols / 32);
        scales[0] = 0;
        let xs: Vec<Vec<f32>> = (0..n).map(|_| r.f32s(cols, 4.0)).collect();
        let p1 = &pools()[0];
        check_many(&format!("mxfp4 many {rows}x{cols} of {n}"), rows, &xs,
            |isa, xr, or| rows_mxfp4_many_with(isa, &packed, &scales, xr, or),
            |x, want| matvec_mxfp4_with(Isa::Scalar, p1, &packed, &scales, x, want));
    }

    #[test]
    fn matvecs(seed: u64, rows in 1usize..40, cols in 0usize..200, blocks in 1usize..6, special in 0u32..2) {
        let mut r = Rng::new(seed);
        let mut x = r.f32s(cols, 4.0);
        if special == 1 { r.spice(&mut x, 25); }
        let w = r.bf16s(rows * cols, 1.0);
        let mut wf = r.f32s(rows * cols, 1.0);
        if special == 1 { r.spice(&mut wf, 25); }
        let mut want = vec![0.0f32; rows];
        let mut got = vec![0.0f32; rows];
        let p1 = &pools()[0];
        matvec_bf16_with(Isa::Scalar, p1, &w, &x, &mut want);
        for isa in paths() {
            for pool in pools() {
                matvec_bf16_with(isa, pool, &w, &x, &mut got);
                assert_same(&format!("bf16 {isa:?} {} threads", pool.n_threads()), &got, &want);
            }
        }
        matvec_f32_with(Isa::Scalar, p1, &wf, &x, &mut want);
        for isa in paths() {
            for pool in pools() {
                matvec_f32_with(isa, pool, &wf, &x, &mut got);
                assert_same(&format!("f32 {isa:?} {} threads", pool.n_threads()), &got, &want);
            }
        }
        let cols4 = blocks * 32;
        let mut x4 = r.f32s(cols4, 4.0);
        if special == 1 { r.spice(&mut x4, 25); }
        let packed = r.bytes(rows * cols4 / 2);
        let mut scales = r.scales(rows * cols4 / 32);
        if special == 1 { scales[0] = 254; }
        matvec_mxfp4_with(Isa::Scalar, p1, &packed, &scales, &x4, &mut want);
        // The reference itself equals the dequantised f32 matvec.
        let mut deq = vec![0.0f32; rows * cols4];
        for (rw, d) in deq.chunks_exact_mut(cols4).enumerate() {
            mxfp4_dequant_row(&packed[rw * cols4 / 2..(rw + 1) * cols4 / 2], &scales[rw * blocks..(rw + 1) * blocks], d);
        }
        matvec_f32_with(Isa::Scalar, p1, &deq, &x4, &mut got);
        assert_same("mxfp4 == dequant + f32", &got, &want);
        for isa in paths() {
            for pool in pools() {
                matvec_mxfp4_with(isa, pool, &packed, &scales, &x4, &mut got);
                assert_same(&format!("mxfp4 {isa:?} {} threads", pool.n_threads()), &got, &want);
            }
        }
    }

    #[test]
    fn norms_and_softmax(seed: u64, n in 1usize..200, heads in 1usize..5, special in 0u32..2) {
        let mut r = Rng::new(seed);
        let mut x = r.f32s(n, 30.0);
        if special == 1 { r.spice(&mut x, 30); }
        let w = r.f32s(n, 2.0);
        let want = rms_inv_with(Isa::Scalar, &x, 1e-5);
        for isa in paths() {
            prop_assert!(same_bits(rms_inv_with(isa, &x, 1e-5), want));
        }
        for weight in [Some(&w[..]), None] {
            let mut a = vec![0.0; n];
            let mut b = vec![0.0; n];
            rmsnorm_with(Isa::Scalar, &x, weight, 1e-6, &mut a);
            for isa in paths() {
                rmsnorm_with(isa, &x, weight, 1e-6, &mut b);
                assert_same(&format!("rmsnorm {isa:?}"), &b, &a);
            }
        }
        let mut a = x.clone();
        softmax_inplace_with(Isa::Scalar, &mut a);
        for isa in paths() {
            let mut b = x.clone();
            softmax_inplace_with(isa, &mut b);
            assert_same(&format!("softmax {isa:?}"), &b, &a);
        }
        let mut hx = r.f32s(n * heads, 5.0);
        if special == 1 { r.spice(&mut hx, 30); }
        let mut a = hx.clone();
        l2norm_heads_with(Isa::Scalar, &mut a, n, 1e-6, 0.088);
        for isa in paths() {
            let mut b = hx.clone();
            l2norm_heads_with(isa, &mut b, n, 1e-6, 0.088);
            assert_same(&format!("l2norm {isa:?}"), &b, &a);
        }
    }

    #[test]
    fn elementwise(seed: u64, n in 0usize..300, special in 0u32..2) {
        let mut r = Rng::new(seed);
        // magnitudes spread over 1e-3 .. 1e3 (SiTU-GLU sees 0.1..1000)
        let mut g: Vec<f32> = (0..n).map(|_| r.unit() * [1e-3f32, 1.0, 30.0, 1000.0][r.next_u32() as usize % 4]).collect();
        let mut u = r.f32s(n, 300.0);
        if special == 1 { r.spice(&mut g, 15); r.spice(&mut u, 15); }
        let a0 = r.unit();
        type Kernel = fn(Isa, &[f32], &[f32], f32, &mut [f32]);
        let kernels: [(&str, Kernel); 6] = [
            ("situ_glu", |i, g, u, _, o| situ_glu_with(i, g, u, 4.0, Some(25.0), o)),
            ("situ_glu_nolin", |i, g, u, _, o| situ_glu_with(i, g, u, 4.0, None, o)),
            ("silu_glu", |i, g, u, _, o| silu_glu_with(i, g, u, o)),
            ("add_inplace", |i, g, u, _, o| { o.copy_from_slice(u); add_inplace_with(i, o, g) }),
            ("axpy", |i, g, u, a, o| { o.copy_from_slice(u); axpy_with(i, o, a, g) }),
            ("mul_sigmoid", |i, g, u, _, o| { o.copy_from_slice(u); mul_sigmoid_inplace_with(i, o, g) }),
        ];
        for (name, k) in kernels {
            let mut want = vec![0.0; n];
            k(Isa::Scalar, &g, &u, a0, &mut want);
            for isa in paths() {
                let mut got = vec![0.0; n];
                k(isa, &g, &u, a0, &mut got);
                assert_same(&format!("{name} {isa:?}"), &got, &want);
            }
        }
    }

    #[test]
    fn kda(seed: u64, heads in 1usize..5, dk in 1usize..40, dv in 1usize..150, steps in 1usize..4, kernel in 1usize..5) {
        let mut r = Rng::new(seed);
        let ch = heads * dk;
        // conv
        let x = r.f32s(ch, 3.0);
        let taps = r.f32s(ch * kernel, 1.0);
        let hist0 = r.f32s(ch * (kernel - 1), 3.0);
        let (mut ha, mut oa) = (hist0.clone(), vec![0.0; ch]);
        conv_step_with(Isa::Scalar, &mut ha, &x, &taps, kernel, &mut oa);
        for isa in paths() {
            let (mut hb, mut ob) = (hist0.clone(), vec![0.0; ch]);
            conv_step_with(isa, &mut hb, &x, &taps, kernel, &mut ob);
            assert_same(&format!("conv out {isa:?}"), &ob, &oa);
            assert_same(&format!("conv hist {isa:?}"), &hb, &ha);
        }
        // gate
        let graw = r.f32s(ch, 8.0);
        let a_log = r.f32s(heads + 2, 2.0);
        let dt = r.f32s(ch, 1.0);
        for gate in [KdaGate::LowerBound(-5.0), KdaGate::Softplus] {
            let mut ga = vec![0.0; ch];
            kda_gate_with(Isa::Scalar, &graw, &a_log, &dt, dk, gate, &mut ga);
            for isa in paths() {
                let mut gb = vec![0.0; ch];
                kda_gate_with(isa, &graw, &a_log, &dt, dk, gate, &mut gb);
                assert_same(&format!("kda_gate {gate:?} {isa:?}"), &gb, &ga);
            }
        }
        // multi-step recurrence
        let s0 = r.f32s(heads * dk * dv, 0.5);
        let mut want_s = s0.clone();
        let mut want_o = vec![0.0; heads * dv];
        let inputs: Vec<_> = (0..steps).map(|_| {
            let g: Vec<f32> = r.f32s(ch, 1.0).iter().map(|v| -2.5 * (v + 1.0)).collect();
            (r.f32s(ch, 0.3), r.f32s(ch, 0.3), r.f32s(heads * dv, 2.0), g, r.f32s(heads, 0.5).iter().map(|b| b + 0.5).collect::<Vec<_>>())
        }).collect();
        let run = |isa: Isa, pool, s: &mut [f32], o: &mut [f32]| {
            for (q, k, v, g, b) in &inputs {
                let step = KdaStep { q, k, v, log_decay: g, beta: b, n_heads: heads, head_dim_k: dk, head_dim_v: dv };
                kda_step_with(isa, pool, &step, s, o);
            }
        };
        run(Isa::Scalar, &pools()[0], &mut want_s, &mut want_o);
        for isa in paths() {
            for pool in pools() {
                let mut s = s0.clone();
                let mut o = vec![0.0; heads * dv];
                run(isa, pool, &mut s, &mut o);
                assert_same(&format!("kda state {isa:?} {}", pool.n_threads()), &s, &want_s);
                assert_same(&format!("kda out {isa:?} {}", pool.n_threads()), &o, &want_o);
            }
        }
    }

    #[test]
    fn mla(seed: u64, heads in 1usize..6, d_nope in 0usize..40, d_rope in 0usize..20, d_v in 1usize..40, kv_lora in 1usize..70, n_pos in 0usize..30) {
        let mut r = Rng::new(seed);
        let shape = MlaShape { n_heads: heads, d_nope, d_rope, d_v, kv_lora, n_pos, scale: 0.0722 };
        let q = r.f32s(heads * (d_nope + d_rope), 3.0);
        let w = r.bf16s(heads * (d_nope + d_v) * kv_lora, 0.3);
        let c_kv = r.f32s(n_pos * kv_lora, 3.0);
        let k_rope = r.f32s(n_pos * d_rope, 3.0);
        let cache = MlaCache { c_kv: &c_kv, k_rope: &k_rope };
        let mut sa = vec![0.0; shape.work_len()];
        let mut oa = vec![0.0; heads * d_v];
        mla_attend_with(Isa::Scalar, &pools()[0], &shape, &q, &w, &cache, &mut sa, &mut oa);
        for isa in paths() {
            for pool in pools() {
                let mut sb = vec![0.0; shape.work_len()];
                let mut ob = vec![0.0; heads * d_v];
                mla_attend_with(isa, pool, &shape, &q, &w, &cache, &mut sb, &mut ob);
                if n_pos > 0 {
                    assert_same(&format!("mla work {isa:?} {}", pool.n_threads()), &sb, &sa);
                }
                assert_same(&format!("mla out {isa:?} {}", pool.n_threads()), &ob, &oa);
            }
        }
    }

    #[test]
    fn router_and_attnres(seed: u64, n in 1usize..120, k_frac in 0.0f64..1.0, softmax in 0u32..2, n_src in 1usize..10, d in 1usize..100) {
        let mut r = Rng::new(seed);
        let top_k = ((n as f64 * k_frac) as usize).max(1);
        let logits = r.f32s(n, 4.0);
        let bias = r.f32s(n, 0.5);
        let cfg = RouterCfg { top_k, scoring: if softmax == 1 { Scoring::Softmax } else { Scoring::Sigmoid }, renormalize: true, scale: 2.5 };
        let (mut ia, mut wa) = (vec![0u32; top_k], vec![0.0; top_k]);
        route_with(Isa::Scalar, &logits, Some(&bias), &cfg, &mut ia, &mut wa);
        prop_assert!(ia.windows(2).all(|p| p[0] < p[1]), "ids ascending and distinct");
        for isa in paths() {
            let (mut ib, mut wb) = (vec![0u32; top_k], vec![0.0; top_k]);
            route_with(isa, &logits, Some(&bias), &cfg, &mut ib, &mut wb);
            prop_assert_eq!(&ib, &ia);
            assert_same(&format!("route {isa:?}"), &wb, &wa);
        }
        let srcs: Vec<Vec<f32>> = (0..n_src).map(|_| r.f32s(d, 20.0)).collect();
        let refs: Vec<&[f32]> = srcs.iter().map(|s| &s[..]).collect();
        let query = r.f32s(d, 1.0);
        let (mut la, mut oa) = (vec![0.0; n_src], vec![0.0; d]);
        attnres_mix_with(Isa::Scalar, &refs, &query, 1e-5, &mut la, &mut oa);
        for isa in paths() {
            let (mut lb, mut ob) = (vec![0.0; n_src], vec![0.0; d]);
            attnres_mix_with(isa, &refs, &query, 1e-5, &mut lb, &mut ob);
            assert_same(&format!("attnres p {isa:?}"), &lb, &la);
            assert_same(&format!("attnres out {isa:?}"), &ob, &oa);
        }
    }
}

#[test]
fn paths_cover_this_machine() {
    let av = paths();
    assert_eq!(av[0], Isa::Scalar);
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") {
        assert!(
            av.contains(&Isa::Avx2) && av.contains(&Isa::Avx512),
            "{av:?}"
        );
    }
    #[cfg(target_arch = "aarch64")]
    assert!(av.contains(&Isa::Neon), "{av:?}");
    println!("paths compared: {av:?}");
}

/// K3-sized shapes, every path and thread count (the proptest shapes are small).
#[test]
fn k3_sized_rows_thread_invariant() {
    let mut r = Rng::new(7);
    let (rows, cols) = (203, 7168);
    let x = r.f32s(cols, 2.0);
    let w = r.bf16s(rows * cols, 0.05);
    let packed = r.bytes(rows * cols / 2);
    let scales = r.scales(rows * cols / 32);
    let mut want = vec![0.0f32; rows];
    let mut want4 = vec![0.0f32; rows];
    matvec_bf16_with(Isa::Scalar, &pools()[0], &w, &x, &mut want);
    matvec_mxfp4_with(Isa::Scalar, &pools()[0], &packed, &scales, &x, &mut want4);
    for isa in paths() {
        for pool in pools() {
            let mut got = vec![0.0f32; rows];
            matvec_bf16_with(isa, pool, &w, &x, &mut got);
            assert_same(&format!("bf16 {isa:?} {}", pool.n_threads()), &got, &want);
            matvec_mxfp4_with(isa, pool, &packed, &scales, &x, &mut got);
            assert_same(&format!("mxfp4 {isa:?} {}", pool.n_threads()), &got, &want4);
        }
        // several inputs (7: a group of 4, one of 2, one alone), x among them as the 6th
        let mut xs: Vec<Vec<f32>> = (0..7).map(|_| r.f32s(cols, 2.0)).collect();
        xs[5] = x.clone();
        let xr = views(&xs);
        let mut outs = vec![vec![f32::NAN; rows]; 7];
        let mut or = views_mut(&mut outs);
        rows_bf16_many_with(isa, &w, &xr, &mut or);
        assert_same(&format!("bf16 many {isa:?}"), &outs[5], &want);
        let mut or = views_mut(&mut outs);
        rows_mxfp4_many_with(isa, &packed, &scales, &xr, &mut or);
        assert_same(&format!("mxfp4 many {isa:?}"), &outs[5], &want4);
    }
}
