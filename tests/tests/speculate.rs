//! Speculative decoding (`--speculate K`, `k3_engine::speculate`): the verify pass
//! (`Executor::prefill_each`) gives every position's logits bit-identical to one-token steps;
//! `SeqState::rewind` undoes fed tokens exactly; and generation with guesses gives the same
//! ids, first-step logits and final state as plain greedy decoding, resident and with a
//! streamed trunk (shared ring, two slots), at several guess counts and stop ids, with guesses
//! both accepted and rejected along the way.

use std::path::PathBuf;

use k3_conformance::{open_model, repo_root, resident, synth_and_pack, trunk_layer_sizes};
use k3_engine::exec::{Executor, LayerState, Providers, SeqState};
use k3_engine::plan::Plan;
use k3_engine::run::{GenOptions, GenRequest, generate_from, generate_with};
use k3_engine::session::MemorySettings;
use k3_engine::speculate::{SpecStats, Speculation};

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Every float of a state, as bits, with the MLA cache lengths (so equal states compare equal).
fn state_bits(s: &SeqState) -> (usize, Vec<Vec<u32>>) {
    let layers = s
        .layers
        .iter()
        .map(|l| match l {
            LayerState::Kda(k) => [&k.conv_q, &k.conv_k, &k.conv_v, &k.s]
                .iter()
                .flat_map(|v| bits(v))
                .collect(),
            LayerState::Mla(m) => [&m.k_nope, &m.k_rope, &m.v]
                .iter()
                .flat_map(|v| {
                    let mut b = vec![v.len() as u32];
                    b.extend(bits(v));
                    b
                })
                .collect(),
        })
        .collect();
    (s.n_pos, layers)
}

#[test]
fn prefill_each_matches_steps_and_rewind_undoes_a_detour() {
    let (spec, ckpt) = open_model(&repo_root().join("fixtures/models/A/ckpt"));
    let mut w: Providers<'_> = resident(&spec, &ckpt);
    let mut exec = Executor::new(&spec, Plan::new(&spec, 32), 2);
    let v = spec.vocab_size;
    let prompt = [11u32, 22, 33];
    let more = [44u32, 55, 66, 77];
    // Stepwise: the logits after each of `more`.
    let mut st = SeqState::new(&spec);
    let mut lg = vec![0.0f32; v];
    exec.prefill(&prompt, &mut st, &mut w, &mut lg)
        .expect("prefill");
    let after_prompt = state_bits(&st);
    let mut stepwise = Vec::new();
    for &t in &more {
        exec.step(t, &mut st, &mut w, &mut lg).expect("step");
        stepwise.push(bits(&lg));
    }
    let after_all = state_bits(&st);
    // One pass with every position's logits.
    let mut st2 = SeqState::new(&spec);
    exec.prefill(&prompt, &mut st2, &mut w, &mut lg)
        .expect("prefill");
    let mark = st2.mark();
    let mut each = vec![vec![0.0f32; v]; more.len()];
    exec.prefill_each(&more, &mut st2, &mut w, &mut each)
        .expect("prefill_each");
    for (t, (a, b)) in each.iter().zip(&stepwise).enumerate() {
        assert!(
            bits(a) == *b,
            "position {t}: prefill_each logits differ from a step"
        );
    }
    assert!(state_bits(&st2) == after_all, "state after prefill_each");
    // The logits of the last two tokens only: the same bits, the same state.
    let mut st3 = SeqState::new(&spec);
    exec.prefill(&prompt, &mut st3, &mut w, &mut lg)
        .expect("prefill");
    let mut last2 = vec![vec![0.0f32; v]; 2];
    exec.prefill_each(&more, &mut st3, &mut w, &mut last2)
        .expect("prefill_each, last two");
    assert!(bits(&last2[0]) == stepwise[2] && bits(&last2[1]) == stepwise[3]);
    assert!(
        state_bits(&st3) == after_all,
        "state after prefill_each (last two)"
    );
    // Rewind to before the pass: exactly the state after the prompt; feeding again gives the
    // same bits as the first time.
    st2.rewind(&mark);
    assert_eq!(mark.n_pos(), prompt.len());
    assert!(state_bits(&st2) == after_prompt, "rewound state");
    exec.step(more[0], &mut st2, &mut w, &mut lg).expect("step");
    assert!(bits(&lg) == stepwise[0], "a step after the rewind");
}

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("speculate")
}

/// Plain greedy vs speculative generation under `settings`: ids, first-step hash and final
/// state must match; returns the speculation counters summed over the cases.
fn compare(model: &std::path::Path, settings: &MemorySettings, label: &str) -> SpecStats {
    let (spec, ckpt) = open_model(model);
    let prompts: [&[u32]; 3] = [&[1, 2, 3, 4], &[200, 201, 200, 201, 200, 201], &[9, 9, 9]];
    let n_gen = 60;
    let plan = Plan::new(&spec, 6 + n_gen);
    let mut session = k3_engine::session::build(&spec, &ckpt, &plan, settings).expect("providers");
    let mut exec = Executor::new(&spec, plan, 2);
    session.configure_pool(exec.pool());
    let w = &mut session.providers;
    let mut total = SpecStats::default();
    for p in prompts {
        let p: Vec<u32> = p.iter().map(|&t| t % spec.vocab_size as u32).collect();
        let req = GenRequest {
            prompt_ids: p.clone(),
            n_gen,
            incremental: true,
            stop_ids: vec![],
        };
        let start = SeqState::new(&spec);
        let (plain, plain_state) =
            generate_from(&spec, &mut exec, w, &req, start.clone(), &mut |_, _, _| {
                true
            })
            .expect("plain");
        // Stop ids taken from the plain output, so a stop can land on an accepted guess.
        let mut stops: Vec<Option<u32>> = vec![None];
        stops.extend([7, 23, 41].map(|i| plain.generated_ids.get(i).copied()));
        for k in [1usize, 3, 8] {
            for &stop in &stops {
                let req = GenRequest {
                    stop_ids: stop.into_iter().collect(),
                    ..req.clone()
                };
                let (want, want_state) = if stop.is_none() {
                    (plain.clone(), plain_state.clone())
                } else {
                    generate_from(&spec, &mut exec, w, &req, start.clone(), &mut |_, _, _| {
                        true
                    })
                    .expect("plain with a stop id")
                };
                let (got, stats, got_state) = generate_with(
                    &spec,
                    &mut exec,
                    w,
                    &req,
                    start.clone(),
                    GenOptions {
                        speculate: Some(Speculation::with_max_draft(k)),
                        layer_logits: false,
                        prompt_logits: false,
                    },
                    &mut |_, _, _| true,
                )
                .expect("speculative");
                let stats = stats.expect("an incremental request speculates");
                let what = format!("{label}: prompt {p:?}, K {k}, stop {stop:?}");
                assert_eq!(got.generated_ids, want.generated_ids, "{what}: ids");
                assert_eq!(got.first_logits_hash, want.first_logits_hash, "{what}");
                assert_eq!(got.stopped_by, want.stopped_by, "{what}");
                assert!(
                    state_bits(&got_state) == state_bits(&want_state),
                    "{what}: final state"
                );
                assert!(stats.accepted <= stats.drafted);
                total.passes += stats.passes;
                total.drafted += stats.drafted;
                total.accepted += stats.accepted;
                total.rewinds += stats.rewinds;
            }
        }
    }
    println!("{label}: {total:?}");
    total
}

#[test]
fn speculative_generation_equals_greedy_resident_and_streamed() {
    let fixture_a = repo_root().join("fixtures/models/A/ckpt");
    let t = compare(&fixture_a, &MemorySettings::default(), "fixture A resident");
    // Both paths ran: guesses accepted (tokens gained) and rejected (state rewound).
    assert!(t.accepted > 0 && t.rewinds > 0, "{t:?}");
    assert!(t.accepted < t.drafted, "{t:?}");

    let (model, trunk) = synth_and_pack("tiny", 5, &dir());
    let al: Vec<u64> = trunk_layer_sizes(&trunk)
        .iter()
        .map(|s| s.next_multiple_of(4096))
        .collect();
    let largest = *al.iter().max().expect("layers");
    let smallest = *al.iter().min().expect("layers");
    let streamed = |budget: u64, cache: Option<u64>| MemorySettings {
        trunk_dir: Some(trunk.clone()),
        trunk_budget_bytes: Some(budget),
        cache_budget_bytes: cache,
        ring_slots: 2,
        ..MemorySettings::default()
    };
    compare(&model, &MemorySettings::default(), "tiny resident");
    compare(
        &model,
        &streamed(largest + smallest, Some(0)),
        "tiny shared ring, no cache",
    );
    compare(
        &model,
        &streamed(2 * largest, Some(20_000)),
        "tiny two slots, small cache",
    );
}
