//! Adversarial fixtures from the independent numpy reference (`fixtures/kernels/`, generator
//! `gen_kernels.py`, format in `fixtures/kernels/README.md`): every case must agree within the
//! per-element tolerance written next to it, on every available ISA path. Ids and the conv
//! history must be equal.

mod common;

use std::path::PathBuf;

use common::pools;
use k3_kernels::attn::{MlaCache, MlaShape, mla_attend_with};
use k3_kernels::attnres::attnres_mix_with;
use k3_kernels::isa::available;
use k3_kernels::kda::{KdaGate, KdaStep, conv_step_with, kda_gate_with, kda_step_with};
use k3_kernels::math;
use k3_kernels::ops::{l2norm_heads_with, situ, situ_glu_with, soft_clip};
use k3_kernels::router::{RouterCfg, Scoring, route_with};
use serde_json::Value;

fn load(name: &str) -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/kernels")
        .join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (regenerate: bash fixtures/regenerate.sh)",
            path.display()
        )
    });
    let doc: Value = serde_json::from_str(&text).expect("fixture is JSON");
    assert_eq!(
        doc["format_version"],
        1,
        "{}: format_version",
        path.display()
    );
    doc
}

/// Float tensor: decimal values are exact f32 values (parse as f64, cast).
fn t(case: &Value, key: &str) -> Vec<f32> {
    case[key]["data"]
        .as_array()
        .unwrap_or_else(|| panic!("{}: missing tensor {key}", case["name"]))
        .iter()
        .map(|v| v.as_f64().expect("number") as f32)
        .collect()
}

fn t64(case: &Value, key: &str) -> Vec<f64> {
    t(case, key).iter().map(|&v| v as f64).collect()
}

fn tol(case: &Value, key: &str) -> Vec<f64> {
    case[key]["data"]
        .as_array()
        .unwrap_or_else(|| panic!("{}: missing tol {key}", case["name"]))
        .iter()
        .map(|v| v.as_f64().expect("number"))
        .collect()
}

fn n(case: &Value, key: &str) -> usize {
    case[key]
        .as_u64()
        .unwrap_or_else(|| panic!("{}: missing {key}", case["name"])) as usize
}

fn f(case: &Value, key: &str) -> f32 {
    case[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{}: missing {key}", case["name"])) as f32
}

/// Asserts |got - want| <= tol elementwise; returns the worst err/tol.
fn within(what: &str, got: &[f32], want: &[f64], tol: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: length");
    assert_eq!(tol.len(), want.len(), "{what}: tol length");
    let mut worst: f64 = 0.0;
    for (i, ((&g, &w), &tl)) in got.iter().zip(want).zip(tol).enumerate() {
        let err = (g as f64 - w).abs();
        assert!(
            err <= tl,
            "{what}[{i}]: got {g:e}, expected {w:e}, |err| {err:e} > tol {tl:e}"
        );
        worst = worst.max(err / tl);
    }
    worst
}

fn cases(doc: &Value) -> &Vec<Value> {
    doc["cases"].as_array().expect("cases array")
}

fn report(fixture: &str, worst: f64) {
    println!(
        "{fixture}: worst |err|/tol = {worst:.3} over ISAs {:?}",
        available()
    );
}

#[test]
fn router() {
    let doc = load("router");
    let mut worst: f64 = 0.0;
    for case in cases(&doc) {
        let name = case["name"].as_str().unwrap_or("?");
        let (rows, ne, k) = (n(case, "rows"), n(case, "n_experts"), n(case, "top_k"));
        let scoring = match case["scoring"].as_str() {
            Some("sigmoid") => Scoring::Sigmoid,
            Some("softmax") => Scoring::Softmax,
            other => panic!("{name}: unknown scoring {other:?}"),
        };
        let cfg = RouterCfg {
            top_k: k,
            scoring,
            renormalize: case["renormalize"].as_bool().expect("renormalize"),
            scale: f(case, "scale"),
        };
        let logits = t(case, "logits");
        let bias = if case["bias"].is_null() {
            None
        } else {
            Some(t(case, "bias"))
        };
        let want_ids: Vec<u32> = case["expected_ids"]["data"]
            .as_array()
            .expect("ids")
            .iter()
            .map(|v| v.as_u64().expect("id") as u32)
            .collect();
        let (want_w, tol_w) = (t64(case, "expected_weights"), tol(case, "tol_weights"));
        for isa in available() {
            for r in 0..rows {
                let (mut ids, mut w) = (vec![0u32; k], vec![0.0f32; k]);
                route_with(
                    isa,
                    &logits[r * ne..(r + 1) * ne],
                    bias.as_deref(),
                    &cfg,
                    &mut ids,
                    &mut w,
                );
                assert_eq!(
                    ids,
                    want_ids[r * k..(r + 1) * k],
                    "{name} row {r} {isa:?}: ids"
                );
                let what = format!("{name} row {r} {isa:?} weights");
                worst = worst.max(within(
                    &what,
                    &w,
                    &want_w[r * k..(r + 1) * k],
                    &tol_w[r * k..(r + 1) * k],
                ));
            }
        }
    }
    report("router", worst);
}

#[test]
fn situ_glu() {
    let doc = load("situ_glu");
    let mut worst: f64 = 0.0;
    for case in cases(&doc) {
        let name = case["name"].as_str().unwrap_or("?");
        let (gate, up) = (t(case, "gate"), t(case, "up"));
        let beta = f(case, "beta");
        let beta_lin = case["beta_lin"].as_f64().map(|b| b as f32);
        let s: Vec<f32> = gate.iter().map(|&g| situ(g, beta)).collect();
        worst = worst.max(within(
            &format!("{name} situ"),
            &s,
            &t64(case, "expected_situ"),
            &tol(case, "tol_situ"),
        ));
        let c: Vec<f32> = up
            .iter()
            .map(|&u| beta_lin.map_or(u, |b| soft_clip(u, b)))
            .collect();
        let what = format!("{name} soft_clip");
        worst = worst.max(within(
            &what,
            &c,
            &t64(case, "expected_soft_clip"),
            &tol(case, "tol_soft_clip"),
        ));
        for isa in available() {
            let mut out = vec![0.0; gate.len()];
            situ_glu_with(isa, &gate, &up, beta, beta_lin, &mut out);
            let what = format!("{name} {isa:?} out");
            worst = worst.max(within(
                &what,
                &out,
                &t64(case, "expected_out"),
                &tol(case, "tol_out"),
            ));
        }
    }
    report("situ_glu", worst);
}

#[test]
fn conv() {
    let doc = load("conv");
    let mut worst: f64 = 0.0;
    for case in cases(&doc) {
        let name = case["name"].as_str().unwrap_or("?");
        let (c, k, steps) = (n(case, "channels"), n(case, "kernel"), n(case, "steps"));
        let (taps, x) = (t(case, "taps"), t(case, "x"));
        let (want, tl) = (t64(case, "expected_out"), tol(case, "tol_out"));
        for isa in available() {
            let mut hist = t(case, "history_init");
            let mut out = vec![0.0; c];
            for s in 0..steps {
                conv_step_with(isa, &mut hist, &x[s * c..(s + 1) * c], &taps, k, &mut out);
                let what = format!("{name} {isa:?} step {s}");
                worst = worst.max(within(
                    &what,
                    &out,
                    &want[s * c..(s + 1) * c],
                    &tl[s * c..(s + 1) * c],
                ));
            }
            assert_eq!(
                hist,
                t(case, "expected_history_final"),
                "{name} {isa:?}: history"
            );
        }
    }
    report("conv", worst);
}

#[test]
fn kda() {
    let doc = load("kda");
    let mut worst: f64 = 0.0;
    for case in cases(&doc) {
        let name = case["name"].as_str().unwrap_or("?");
        let (h, dk, dv, steps) = (
            n(case, "n_heads"),
            n(case, "head_dim_k"),
            n(case, "head_dim_v"),
            n(case, "steps"),
        );
        let (hk, hv) = (h * dk, h * dv);
        let (eps, q_scale, lb) = (
            f(case, "l2norm_eps"),
            f(case, "q_scale"),
            f(case, "gate_lower_bound"),
        );
        let (q_raw, k_raw, v, graw) = (
            t(case, "q_raw"),
            t(case, "k_raw"),
            t(case, "v"),
            t(case, "graw"),
        );
        let (a_log, dt_bias, beta_logit) =
            (t(case, "a_log"), t(case, "dt_bias"), t(case, "beta_logit"));
        let (eq, ek, eg, eb) = (
            t(case, "expected_q"),
            t(case, "expected_k"),
            t(case, "expected_log_decay"),
            t(case, "expected_beta"),
        );
        for isa in available() {
            for pool in [&pools()[0], &pools()[2]] {
                // chain A: our own stage outputs from the raw inputs; chain B: stored stages
                for own_stages in [true, false] {
                    let mut state = t(case, "state_init");
                    let mut out = vec![0.0; hv];
                    for s in 0..steps {
                        let r = s * hk..(s + 1) * hk;
                        let (q, k, g, beta) = if own_stages {
                            let mut q = q_raw[r.clone()].to_vec();
                            let mut k = k_raw[r.clone()].to_vec();
                            l2norm_heads_with(isa, &mut q, dk, eps, q_scale);
                            l2norm_heads_with(isa, &mut k, dk, eps, 1.0);
                            let mut g = vec![0.0; hk];
                            kda_gate_with(
                                isa,
                                &graw[r.clone()],
                                &a_log,
                                &dt_bias,
                                dk,
                                KdaGate::LowerBound(lb),
                                &mut g,
                            );
                            let beta: Vec<f32> = beta_logit[s * h..(s + 1) * h]
                                .iter()
                                .map(|&b| math::sigmoid(b))
                                .collect();
                            let tag = format!("{name} {isa:?} step {s}");
                            let w = |key: &str| t64(case, key)[r.clone()].to_vec();
                            let tw = |key: &str| tol(case, key)[r.clone()].to_vec();
                            worst = worst.max(within(
                                &format!("{tag} q"),
                                &q,
                                &w("expected_q"),
                                &tw("tol_q"),
                            ));
                            worst = worst.max(within(
                                &format!("{tag} k"),
                                &k,
                                &w("expected_k"),
                                &tw("tol_k"),
                            ));
                            worst = worst.max(within(
                                &format!("{tag} log_decay"),
                                &g,
                                &w("expected_log_decay"),
                                &tw("tol_log_decay"),
                            ));
                            let (bw, bt) = (t64(case, "expected_beta"), tol(case, "tol_beta"));
                            worst = worst.max(within(
                                &format!("{tag} beta"),
                                &beta,
                                &bw[s * h..(s + 1) * h],
                                &bt[s * h..(s + 1) * h],
                            ));
                            (q, k, g, beta)
                        } else {
                            (
                                eq[r.clone()].to_vec(),
                                ek[r.clone()].to_vec(),
                                eg[r.clone()].to_vec(),
                                eb[s * h..(s + 1) * h].to_vec(),
                            )
                        };
                        let step = KdaStep {
                            q: &q,
                            k: &k,
                            v: &v[s * hv..(s + 1) * hv],
                            log_decay: &g,
                            beta: &beta,
                            n_heads: h,
                            head_dim_k: dk,
                            head_dim_v: dv,
                        };
                        kda_step_with(isa, pool, &step, &mut state, &mut out);
                        let what = format!("{name} {isa:?} own={own_stages} step {s} out");
                        let (w, tl) = (t64(case, "expected_out"), tol(case, "tol_out"));
                        worst = worst.max(within(
                            &what,
                            &out,
                            &w[s * hv..(s + 1) * hv],
                            &tl[s * hv..(s + 1) * hv],
                        ));
                    }
                    let what = format!("{name} {isa:?} own={own_stages} final state");
                    worst = worst.max(within(
                        &what,
                        &state,
                        &t64(case, "expected_state_final"),
                        &tol(case, "tol_state_final"),
                    ));
                }
            }
        }
    }
    report("kda", worst);
}

#[test]
fn mla() {
    let doc = load("mla");
    let mut worst: f64 = 0.0;
    for case in cases(&doc) {
        let name = case["name"].as_str().unwrap_or("?");
        let shape = MlaShape {
            n_heads: n(case, "n_heads"),
            d_nope: n(case, "d_nope"),
            d_rope: n(case, "d_rope"),
            d_v: n(case, "d_v"),
            kv_lora: n(case, "kv_lora"),
            n_pos: n(case, "n_pos"),
            scale: f(case, "scale"),
        };
        let (q, ckv, kr) = (t(case, "q"), t(case, "c_kv"), t(case, "k_rope"));
        // the fixture's kv_b values are exact bf16
        let w: Vec<u16> = t(case, "w_kv_b")
            .iter()
            .map(|x| {
                assert_eq!(x.to_bits() & 0xFFFF, 0, "{name}: w_kv_b must be bf16");
                (x.to_bits() >> 16) as u16
            })
            .collect();
        let cache = MlaCache {
            c_kv: &ckv,
            k_rope: &kr,
        };
        for isa in available() {
            for pool in [&pools()[0], &pools()[2]] {
                let mut wk = vec![0.0; shape.work_len()];
                let mut out = vec![0.0; shape.n_heads * shape.d_v];
                mla_attend_with(isa, pool, &shape, &q, &w, &cache, &mut wk, &mut out);
                let tag = format!("{name} {isa:?} {} threads", pool.n_threads());
                // our work area ends each head's row with the probabilities, so check them too
                let stride = 2 * shape.kv_lora + shape.n_pos;
                let sc: Vec<f32> = wk
                    .chunks_exact(stride)
                    .flat_map(|r| r[2 * shape.kv_lora..].to_vec())
                    .collect();
                worst = worst.max(within(
                    &format!("{tag} probs"),
                    &sc,
                    &t64(case, "expected_probs"),
                    &tol(case, "tol_probs"),
                ));
                worst = worst.max(within(
                    &format!("{tag} out"),
                    &out,
                    &t64(case, "expected_out"),
                    &tol(case, "tol_out"),
                ));
            }
        }
    }
    report("mla", worst);
}

#[test]
fn attnres() {
    let doc = load("attnres");
    let mut worst: f64 = 0.0;
    for case in cases(&doc) {
        let name = case["name"].as_str().unwrap_or("?");
        let (ns, dim) = (n(case, "n_sources"), n(case, "dim"));
        let sources = t(case, "sources");
        let srcs: Vec<&[f32]> = sources.chunks_exact(dim).collect();
        assert_eq!(srcs.len(), ns, "{name}: n_sources");
        let query = t(case, "query");
        let eps = f(case, "eps");
        for isa in available() {
            let (mut p, mut out) = (vec![0.0; ns], vec![0.0; dim]);
            attnres_mix_with(isa, &srcs, &query, eps, &mut p, &mut out);
            let tag = format!("{name} {isa:?}");
            worst = worst.max(within(
                &format!("{tag} probs"),
                &p,
                &t64(case, "expected_probs"),
                &tol(case, "tol_probs"),
            ));
            worst = worst.max(within(
                &format!("{tag} out"),
                &out,
                &t64(case, "expected_out"),
                &tol(case, "tol_out"),
            ));
        }
    }
    report("attnres", worst);
}

#[test]
fn every_fixture_file_is_checked() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/kernels");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter_map(|n| n.strip_suffix(".json").map(str::to_string))
        .collect();
    names.sort();
    assert_eq!(
        names,
        ["attnres", "conv", "kda", "mla", "router", "situ_glu"],
        "new fixture file: add a test"
    );
}
