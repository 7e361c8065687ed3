//! Bit-exact with itself (docs/NUMERICS.md §1) on the committed fixtures A and B: the same token ids
//! and the same logit BITS for every available instruction-set path x thread count {1, 2, 4},
//! and full recompute == incremental decode at every step.
//!
//! Owns: the ISA x threads matrix. The ISA override (`k3_kernels::isa::set_active`) is
//! process-wide, so every test in this binary takes [`ISA_LOCK`] and all switching happens in
//! one test function; nothing else in the workspace switches ISA inside this process.
//! Must not: compare against the reference (that is `gates.rs`); here the engine is compared only
//! with itself, so equality is exact (`f32::to_bits`), never a tolerance.

use std::sync::Mutex;

use k3_conformance::{Fixture, executor, open_model, resident};
use k3_engine::exec::SeqState;
use k3_engine::run::{self, GenRequest};
use k3_kernels::isa::{self, Isa};

/// Serialises the tests of this binary: the active ISA is process-wide state.
static ISA_LOCK: Mutex<()> = Mutex::new(());

const THREADS: [usize; 3] = [1, 2, 4];
const N_GEN: usize = 6;

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Everything one (ISA, threads) cell produced.
#[derive(PartialEq)]
struct Cell {
    gen_ids: Vec<u32>,
    first_bits: Vec<u32>,
    first_hash: String,
    tf_argmax: Vec<u32>,
    /// [position][vocab] teacher-forced logit bits.
    tf_bits: Vec<Vec<u32>>,
}

fn run_cell(fx: &Fixture, threads: usize) -> Cell {
    let s = &fx.summary;
    let (spec, ckpt) = open_model(&fx.ckpt_dir);
    let mut prov = resident(&spec, &ckpt);
    let mut exec = executor(
        &spec,
        s.tf_sequence.len().max(s.prompt_ids.len() + N_GEN),
        threads,
    );
    let req = GenRequest {
        prompt_ids: s.prompt_ids.clone(),
        n_gen: N_GEN,
        incremental: true,
        stop_ids: vec![],
    };
    let g = run::generate(&spec, &mut exec, &mut prov, &req, &mut |_, _, _| true)
        .unwrap_or_else(|e| panic!("fixture {}: generate: {e}", fx.name));
    assert_eq!(g.generated_ids.len(), N_GEN, "no early stop expected");
    assert_eq!(
        g.first_logits_hash,
        run::logits_hash(&g.first_logits),
        "first_logits_hash is the hash of first_logits"
    );
    let (tf_argmax, tf) = run::teacher_forced(&spec, &mut exec, &mut prov, &s.tf_sequence, true)
        .unwrap_or_else(|e| panic!("fixture {}: teacher forcing: {e}", fx.name));
    Cell {
        gen_ids: g.generated_ids,
        first_bits: bits(&g.first_logits),
        first_hash: g.first_logits_hash,
        tf_argmax,
        tf_bits: tf.iter().map(|r| bits(r)).collect(),
    }
}

/// First difference between two cells, for a readable failure.
fn describe_diff(a: &Cell, b: &Cell) -> String {
    if a.gen_ids != b.gen_ids {
        return format!("generated ids {:?} vs {:?}", a.gen_ids, b.gen_ids);
    }
    if let Some(i) = (0..a.first_bits.len()).find(|&i| a.first_bits[i] != b.first_bits[i]) {
        return format!(
            "first-step logit {i}: {:e} ({:#010x}) vs {:e} ({:#010x}); hashes {} vs {}",
            f32::from_bits(a.first_bits[i]),
            a.first_bits[i],
            f32::from_bits(b.first_bits[i]),
            b.first_bits[i],
            a.first_hash,
            b.first_hash
        );
    }
    if a.tf_argmax != b.tf_argmax {
        return format!(
            "teacher-forced argmax {:?} vs {:?}",
            a.tf_argmax, b.tf_argmax
        );
    }
    for (p, (ra, rb)) in a.tf_bits.iter().zip(&b.tf_bits).enumerate() {
        if let Some(i) = (0..ra.len()).find(|&i| ra[i] != rb[i]) {
            return format!(
                "teacher-forced logits at position {p}, index {i}: {:e} vs {:e}",
                f32::from_bits(ra[i]),
                f32::from_bits(rb[i])
            );
        }
    }
    "first_logits_hash differs with equal bits (hash bug)".into()
}

#[test]
fn ids_and_logit_bits_identical_across_isa_paths_and_threads() {
    let _guard = ISA_LOCK.lock().unwrap_or_else(|p| p.into_inner());
    let paths = isa::available();
    assert_eq!(
        paths[0],
        Isa::Scalar,
        "scalar reference is always available"
    );
    let before = isa::active();
    let mut matrix = Vec::new();
    for name in ["A", "B"] {
        let fx = Fixture::load(name);
        let mut base: Option<(String, Cell)> = None;
        for &p in &paths {
            isa::set_active(p).unwrap_or_else(|e| panic!("set_active({p:?}): {e}"));
            assert_eq!(isa::active(), p);
            for t in THREADS {
                let cell = run_cell(&fx, t);
                let label = format!("{}/{t}t", p.name());
                match &base {
                    None => base = Some((label.clone(), cell)),
                    Some((bl, b)) => assert!(
                        *b == cell,
                        "fixture {name}: {label} differs from {bl}: {}",
                        describe_diff(b, &cell)
                    ),
                }
                matrix.push(format!("{name}:{label}"));
            }
        }
        let (_, b) = base.expect("at least the scalar path ran");
        // the matrix compared something non-trivial: the ids are the model's, not a constant
        assert_eq!(b.tf_bits.len(), fx.summary.tf_sequence.len());
        if fx.summary.first_unstable_step.is_none_or(|u| u >= N_GEN) {
            assert_eq!(
                b.gen_ids[..],
                fx.summary.generated_ids[..N_GEN],
                "fixture {name}: generated ids are the reference's (gates.rs checks the rest)"
            );
        }
        println!(
            "fixture {name}: ids {:?}, first-step logits hash {}",
            b.gen_ids, b.first_hash
        );
    }
    isa::set_active(before).expect("the path active before the test is available");
    println!(
        "ISA x threads matrix ({} cells, all bit-identical: generated ids, first-step logit bits, \
         teacher-forced logit bits at every position): paths {:?}, threads {:?}\n  {}",
        matrix.len(),
        paths.iter().map(|p| p.name()).collect::<Vec<_>>(),
        THREADS,
        matrix.join(" ")
    );
}

#[test]
fn full_recompute_equals_incremental_bit_for_bit_fixture_b_3_threads() {
    let _guard = ISA_LOCK.lock().unwrap_or_else(|p| p.into_inner());
    let fx = Fixture::load("B");
    let s = &fx.summary;
    let (spec, ckpt) = open_model(&fx.ckpt_dir);
    let mut prov = resident(&spec, &ckpt);
    let n_gen = 8;
    let total = s.prompt_ids.len() + n_gen;
    let mut exec = executor(&spec, total, 3);
    let req = GenRequest {
        prompt_ids: s.prompt_ids.clone(),
        n_gen,
        incremental: false,
        stop_ids: vec![],
    };
    let full = run::generate(&spec, &mut exec, &mut prov, &req, &mut |_, _, _| true)
        .expect("full recompute");
    let inc = run::generate(
        &spec,
        &mut exec,
        &mut prov,
        &GenRequest {
            incremental: true,
            ..req.clone()
        },
        &mut |_, _, _| true,
    )
    .expect("incremental");
    assert_eq!(
        full.generated_ids, inc.generated_ids,
        "ids: full vs incremental"
    );
    assert_eq!(bits(&full.first_logits), bits(&inc.first_logits));
    assert_eq!(full.generated_ids.len(), n_gen);

    // Every step, not only the first: the incremental state carried over the whole sequence
    // (teacher forcing on prompt + generated) vs a fresh state fed each prefix from scratch.
    let seq: Vec<u32> = s
        .prompt_ids
        .iter()
        .chain(&inc.generated_ids)
        .copied()
        .collect();
    let (am, inc_rows) =
        run::teacher_forced(&spec, &mut exec, &mut prov, &seq, true).expect("incremental pass");
    let mut logits = vec![0.0f32; spec.vocab_size];
    for end in 1..=seq.len() {
        let mut st = SeqState::new(&spec);
        for &t in &seq[..end] {
            exec.step(t, &mut st, &mut prov, &mut logits)
                .expect("full recompute step");
        }
        assert_eq!(
            bits(&logits),
            bits(&inc_rows[end - 1]),
            "fixture B, 3 threads: logits after position {} differ between full recompute and incremental",
            end - 1
        );
        // The same prefix fed LAYER-MAJOR in one call (each layer applied to every token
        // before the next layer; AttnRes carries swapped per token).
        let mut st = SeqState::new(&spec);
        logits.fill(f32::NAN);
        exec.prefill(&seq[..end], &mut st, &mut prov, &mut logits)
            .expect("layer-major prefill");
        assert_eq!(st.n_pos, end);
        assert_eq!(
            bits(&logits),
            bits(&inc_rows[end - 1]),
            "fixture B, 3 threads: logits after position {} differ between one layer-major \
             prefill of the prefix and token-by-token steps",
            end - 1
        );
    }
    // Layer-major chunks of 3 continuing one state: after every chunk the logits equal the
    // token-by-token row at that position.
    let mut st = SeqState::new(&spec);
    let mut fed = 0;
    for chunk in seq.chunks(3) {
        exec.prefill(chunk, &mut st, &mut prov, &mut logits)
            .expect("chunked prefill");
        fed += chunk.len();
        assert_eq!(
            bits(&logits),
            bits(&inc_rows[fed - 1]),
            "fixture B: chunked layer-major prefill differs after position {}",
            fed - 1
        );
    }
    assert_eq!(fed, seq.len());
    let p = s.prompt_ids.len();
    assert_eq!(
        am[p - 1..p - 1 + n_gen],
        inc.generated_ids[..],
        "greedy ids are the argmax of the incremental rows"
    );
    println!(
        "fixture B, 3 threads, ISA {}: full recompute == incremental at all {} positions (bits), ids {:?}",
        isa::active().name(),
        seq.len(),
        inc.generated_ids
    );
}
