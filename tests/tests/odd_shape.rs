//! A shape no other test uses (issue 3, "Done means"): `configs/synth/odd9.toml` — 9 layers
//! (KKKMKKKMM), AttnRes block 2, 8 experts top-3, one shared expert, vocab 384 — written by
//! `k3_engine::synth` at test time, loaded through the strict loader, and decoded with full
//! recompute and incremental decode at 1 and 3 threads.
//!
//! Owns: the odd-shape checks (loads; full == incremental ids and logit bits at every step;
//! teacher-forced argmax == greedy ids; thread independence). Must not: compare with the
//! numpy reference (no reference exists for this shape; gates.rs does that on fixtures A/B/C)
//! or switch the ISA (invariance.rs owns that).
//!
//! The checkpoint is written once per process to `$CARGO_TARGET_TMPDIR/odd9-seed9` (removed
//! and rewritten at the first use, so a stale directory from an older synth never counts).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use k3_conformance::{executor, open_model, repo_root, resident};
use k3_engine::exec::SeqState;
use k3_engine::run::{self, GenRequest, GenResult};
use k3_engine::synth::{self, SynthArgs};
use k3_models::spec::AttnKind;

const SEED: u64 = 9;
const PROMPT: [u32; 7] = [3, 141, 59, 265, 35, 383, 97];
const N_GEN: usize = 8;

fn odd9_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("odd9-seed{SEED}"));
        if out.exists() {
            std::fs::remove_dir_all(&out)
                .unwrap_or_else(|e| panic!("remove stale {}: {e}", out.display()));
        }
        let args = SynthArgs {
            spec: repo_root().join("configs/synth/odd9.toml"),
            seed: SEED,
            out: out.clone(),
            manifest: None,
            quiet: true,
        };
        let rep = synth::run(&args).unwrap_or_else(|e| panic!("synth odd9: {e}"));
        assert!(rep.n_tensors > 0 && rep.expert_bytes > 0);
        out
    })
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn generate(threads: usize, incremental: bool) -> GenResult {
    let (spec, ckpt) = open_model(odd9_dir());
    let mut prov = resident(&spec, &ckpt);
    let mut exec = executor(&spec, PROMPT.len() + N_GEN, threads);
    let req = GenRequest {
        prompt_ids: PROMPT.to_vec(),
        n_gen: N_GEN,
        incremental,
        stop_ids: vec![],
    };
    run::generate(&spec, &mut exec, &mut prov, &req, &mut |_, _, _| true).unwrap_or_else(|e| {
        panic!("odd9 generate (threads {threads}, incremental {incremental}): {e}")
    })
}

#[test]
fn odd9_loads_with_the_declared_shape() {
    let (spec, ckpt) = open_model(odd9_dir());
    assert_eq!(spec.n_layers, 9);
    assert_eq!(spec.vocab_size, 384);
    let map: String = spec
        .layers
        .iter()
        .map(|l| match l.attn {
            AttnKind::Kda => 'K',
            AttnKind::Mla => 'M',
        })
        .collect();
    assert_eq!(map, "KKKMKKKMM", "K3's layer-map rule on 9 layers");
    let ar = spec.attn_res.as_ref().expect("K3 family has Block AttnRes");
    assert_eq!(ar.block_size, 2);
    let moe = spec.moe.as_ref().expect("K3 family has MoE layers");
    assert_eq!((moe.n_experts, moe.n_experts_active), (8, 3));
    assert_eq!(moe.n_shared_experts, 1);
    // binds every tensor resident (the forward pass would fail otherwise, but say so here)
    let _ = resident(&spec, &ckpt);
}

#[test]
fn odd9_full_and_incremental_identical_at_1_and_3_threads() {
    let mut results = Vec::new();
    for threads in [1, 3] {
        for incremental in [false, true] {
            results.push(((threads, incremental), generate(threads, incremental)));
        }
    }
    let (_, base) = &results[0];
    assert_eq!(base.generated_ids.len(), N_GEN, "no early stop expected");
    assert!(
        base.first_logits.iter().all(|v| v.is_finite()),
        "odd9 first-step logits are finite"
    );
    let (lo, hi) = base
        .first_logits
        .iter()
        .fold((f32::MAX, f32::MIN), |(a, b), &v| (a.min(v), b.max(v)));
    assert!(hi > lo, "odd9 logits are not constant");
    for ((threads, incremental), r) in &results[1..] {
        assert_eq!(
            r.generated_ids, base.generated_ids,
            "odd9: ids with {threads} threads, incremental={incremental} differ from 1 thread full recompute"
        );
        assert_eq!(
            bits(&r.first_logits),
            bits(&base.first_logits),
            "odd9: first-step logit bits with {threads} threads, incremental={incremental} differ"
        );
    }
    println!(
        "odd9 (9 layers, block 2, 8 experts top-3): full == incremental at 1 and 3 threads: ids {:?}, \
         first-step logits hash {}",
        base.generated_ids, base.first_logits_hash
    );
}

#[test]
fn odd9_every_step_bits_and_teacher_forced_argmax_match_generate() {
    let g = generate(3, true);
    let (spec, ckpt) = open_model(odd9_dir());
    let mut prov = resident(&spec, &ckpt);
    let seq: Vec<u32> = PROMPT.iter().chain(&g.generated_ids).copied().collect();
    for threads in [1, 3] {
        let mut exec = executor(&spec, seq.len(), threads);
        let (am, rows) =
            run::teacher_forced(&spec, &mut exec, &mut prov, &seq, true).expect("teacher forcing");
        let p = PROMPT.len();
        assert_eq!(
            am[p - 1..p - 1 + N_GEN],
            g.generated_ids[..],
            "odd9, {threads} threads: teacher-forced argmax after each position != generated ids"
        );
        assert_eq!(
            bits(&rows[p - 1]),
            bits(&g.first_logits),
            "odd9, {threads} threads: teacher-forced row {} != generate's first-step logits",
            p - 1
        );
        // full recompute of every prefix from a fresh state == the carried state, bit for bit
        let mut logits = vec![0.0f32; spec.vocab_size];
        for end in 1..=seq.len() {
            let mut st = SeqState::new(&spec);
            for &t in &seq[..end] {
                exec.step(t, &mut st, &mut prov, &mut logits)
                    .expect("full recompute step");
            }
            assert_eq!(
                bits(&logits),
                bits(&rows[end - 1]),
                "odd9, {threads} threads: logits after position {} differ between full recompute and incremental",
                end - 1
            );
        }
    }
}
