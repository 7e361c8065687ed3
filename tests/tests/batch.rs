//! Batched prefill and decode (`Executor::prefill_batch`, `step_batch`, docs/DESIGN.md §10):
//! several sequences share each layer's weights in one call. Every sequence's logits are
//! bit-identical to feeding it alone, after its prompt (prefilled together in two rounds of
//! uneven lengths) and at every step, resident and with a streamed trunk; and the streamed
//! trunk is read once per batch step instead of once per sequence.

use std::path::PathBuf;

use k3_conformance::{open_model, synth_and_pack, trunk_layer_sizes};
use k3_engine::exec::{Executor, SeqState};
use k3_engine::plan::Plan;
use k3_engine::session::MemorySettings;

const PROMPTS: [&[u32]; 3] = [&[3, 14, 15], &[92, 65, 35, 89, 79], &[2, 7]];
const STEPS: usize = 5;

fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in x.iter().enumerate() {
        if *v > x[best] {
            best = i;
        }
    }
    best as u32
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Per sequence, the logits bits after its prompt and after each of `STEPS` greedy steps;
/// and the trunk bytes read by the decode steps (prompts excluded).
fn decode(
    settings: &MemorySettings,
    model: &std::path::Path,
    batched: bool,
) -> (Vec<Vec<Vec<u32>>>, u64) {
    let (spec, ckpt) = open_model(model);
    let plan = Plan::new(&spec, 16);
    let mut session = k3_engine::session::build(&spec, &ckpt, &plan, settings).expect("providers");
    let mut exec = Executor::new(&spec, plan, 2);
    session.configure_pool(exec.pool());
    let w = &mut session.providers;
    let v = spec.vocab_size;
    let mut states: Vec<SeqState> = PROMPTS.iter().map(|_| SeqState::new(&spec)).collect();
    let mut logits: Vec<Vec<f32>> = PROMPTS.iter().map(|_| vec![0.0; v]).collect();
    let mut out: Vec<Vec<Vec<u32>>> = vec![Vec::new(); PROMPTS.len()];
    if batched {
        // Two rounds of prefill_batch: the first 2 tokens of every prompt, then the rest of
        // the two longer ones (prompt 2 has only 2), so positions continue across calls.
        let first: Vec<&[u32]> = PROMPTS.iter().map(|p| &p[..2]).collect();
        exec.prefill_batch(&first, &mut states, w, &mut logits)
            .expect("prefill_batch 1");
        assert_eq!(PROMPTS[2].len(), 2);
        let rest: Vec<&[u32]> = PROMPTS[..2].iter().map(|p| &p[2..]).collect();
        exec.prefill_batch(&rest, &mut states[..2], w, &mut logits[..2])
            .expect("prefill_batch 2");
    } else {
        for (b, p) in PROMPTS.iter().enumerate() {
            exec.prefill(p, &mut states[b], w, &mut logits[b])
                .expect("prefill");
        }
    }
    for b in 0..PROMPTS.len() {
        out[b].push(bits(&logits[b]));
    }
    let before = w.trunk.stats().bytes_read;
    for _ in 0..STEPS {
        let next: Vec<u32> = logits.iter().map(|l| argmax(l)).collect();
        if batched {
            exec.step_batch(&next, &mut states, w, &mut logits)
                .expect("step_batch");
        } else {
            for b in 0..PROMPTS.len() {
                exec.step(next[b], &mut states[b], w, &mut logits[b])
                    .expect("step");
            }
        }
        for b in 0..PROMPTS.len() {
            out[b].push(bits(&logits[b]));
        }
    }
    (out, w.trunk.stats().bytes_read - before)
}

#[test]
fn batched_steps_equal_single_steps_and_share_the_trunk_reads() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("batch");
    let (model, trunk) = synth_and_pack("odd9", 5, &dir);
    let resident = MemorySettings::default();
    let (alone, _) = decode(&resident, &model, false);
    let (batch, _) = decode(&resident, &model, true);
    for b in 0..PROMPTS.len() {
        for (s, (x, y)) in alone[b].iter().zip(&batch[b]).enumerate() {
            assert!(x == y, "resident: sequence {b} step {s}: logit bits differ");
        }
    }
    // The sequences really differ (a batch of copies would prove little).
    assert_ne!(alone[0][STEPS], alone[1][STEPS]);

    // Streamed trunk, no layer pinned, two ring slots, a small expert cache.
    let largest = trunk_layer_sizes(&trunk)
        .into_iter()
        .max()
        .expect("layers")
        .next_multiple_of(4096);
    let streamed = MemorySettings {
        trunk_dir: Some(trunk.clone()),
        trunk_budget_bytes: Some(2 * largest),
        cache_budget_bytes: Some(20_000),
        ring_slots: 2,
        ..MemorySettings::default()
    };
    let (s_alone, bytes_alone) = decode(&streamed, &model, false);
    let (s_batch, bytes_batch) = decode(&streamed, &model, true);
    assert_eq!(s_alone, alone, "streamed single steps differ from resident");
    assert_eq!(
        s_batch, alone,
        "streamed batched steps differ from resident"
    );
    // One pass over the streamed layers per batch step instead of one per sequence (the ring
    // reads ahead, so allow one extra layer or two at the ends).
    assert!(bytes_batch > 0 && bytes_alone > 0);
    assert!(
        bytes_batch * 2 < bytes_alone,
        "batched steps read {bytes_batch} trunk bytes vs {bytes_alone} one sequence at a time"
    );
}
