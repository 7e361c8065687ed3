//! Multi-token passes fetch each routed expert ONCE per layer (`Executor` expert-major MoE):
//! a prompt fed layer-major and a batch step request, per MoE layer, exactly the distinct
//! experts the same tokens ask for one by one, ascending; with the same logit bits. The
//! expert trace of the streamed expert store (cache 0: every request is a read) is the record.

use std::collections::BTreeSet;
use std::path::PathBuf;

use k3_conformance::{open_model, synth_and_pack};
use k3_engine::exec::{Executor, PREFILL_CHUNK, SeqState};
use k3_engine::plan::Plan;
use k3_engine::session::MemorySettings;
use k3_engine::stream::trace::TOKEN_MARK;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("expert_major")
}

/// The requests of a trace (token marks dropped).
fn requests(trace: &[(u32, u32)]) -> Vec<(u32, u32)> {
    trace
        .iter()
        .copied()
        .filter(|&(l, _)| l != TOKEN_MARK)
        .collect()
}

/// Requests grouped by layer, in order.
fn by_layer(trace: &[(u32, u32)], n_layers: usize) -> Vec<Vec<u32>> {
    let mut out = vec![Vec::new(); n_layers];
    for (l, e) in requests(trace) {
        out[l as usize].push(e);
    }
    out
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn a_prompt_and_a_batch_read_each_routed_expert_once_per_layer() {
    for (spec_name, seed) in [("tiny", 3), ("odd9", 5)] {
        let (model, _) = synth_and_pack(spec_name, seed, &dir());
        let (spec, ckpt) = open_model(&model);
        let settings = MemorySettings {
            cache_budget_bytes: Some(0),
            trace_experts: true,
            ..MemorySettings::default()
        };
        let prompt: Vec<u32> = (0..20u32).map(|i| (i * 37 + 11) % 200).collect();
        let plan = Plan::new(&spec, 64);
        let v = spec.vocab_size;
        let moe = spec.moe.as_ref().expect("MoE");
        let n_moe = spec
            .layers
            .iter()
            .filter(|l| l.ffn == k3_models::spec::FfnKind::Moe)
            .count();

        // One by one: every token's own top-k per MoE layer.
        let mut s1 = k3_engine::session::build(&spec, &ckpt, &plan, &settings).expect("providers");
        let mut exec = Executor::new(&spec, plan.clone(), 2);
        let mut st = SeqState::new(&spec);
        let mut want_logits = vec![0.0; v];
        for &t in &prompt {
            exec.step(t, &mut st, &mut s1.providers, &mut want_logits)
                .expect("step");
        }
        let one = requests(s1.providers.experts.trace().expect("trace"));
        assert_eq!(one.len(), prompt.len() * n_moe * moe.n_experts_active);

        // Layer-major: one call.
        assert!(prompt.len() <= PREFILL_CHUNK);
        let mut s2 = k3_engine::session::build(&spec, &ckpt, &plan, &settings).expect("providers");
        let mut st2 = SeqState::new(&spec);
        let mut got_logits = vec![0.0; v];
        exec.prefill(&prompt, &mut st2, &mut s2.providers, &mut got_logits)
            .expect("prefill");
        assert_eq!(bits(&got_logits), bits(&want_logits), "{spec_name}: logits");
        let major = requests(s2.providers.experts.trace().expect("trace"));
        let (a, b) = (
            by_layer(&one, spec.n_layers),
            by_layer(&major, spec.n_layers),
        );
        for l in 0..spec.n_layers {
            let distinct: Vec<u32> = a[l]
                .iter()
                .copied()
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect();
            assert_eq!(b[l], distinct, "{spec_name}: layer {l}");
        }
        assert!(
            major.len() < one.len(),
            "{spec_name}: tokens should share experts ({} vs {})",
            major.len(),
            one.len()
        );
        let stats = s2.providers.experts.stats();
        assert_eq!(stats.requests, major.len() as u64);
        assert_eq!(
            stats.misses, stats.requests,
            "cache 0: every request is a read"
        );

        // A batch step of three sequences: the union of their three steps.
        let prompts: [&[u32]; 3] = [&prompt[..4], &prompt[4..9], &prompt[9..11]];
        let next = [5u32, 77, 140];
        let mut alone = Vec::new();
        let mut union_per_layer: Vec<BTreeSet<u32>> = vec![BTreeSet::new(); spec.n_layers];
        for (p, &t) in prompts.iter().zip(&next) {
            let mut s =
                k3_engine::session::build(&spec, &ckpt, &plan, &settings).expect("providers");
            let mut st = SeqState::new(&spec);
            let mut lg = vec![0.0; v];
            exec.prefill(p, &mut st, &mut s.providers, &mut lg)
                .expect("prefill");
            let before = s.providers.experts.trace().expect("trace").len();
            exec.step(t, &mut st, &mut s.providers, &mut lg)
                .expect("step");
            let tr = s.providers.experts.trace().expect("trace")[before..].to_vec();
            for (l, e) in requests(&tr) {
                union_per_layer[l as usize].insert(e);
            }
            alone.push(bits(&lg));
        }
        let mut s3 = k3_engine::session::build(&spec, &ckpt, &plan, &settings).expect("providers");
        let mut states: Vec<SeqState> = prompts.iter().map(|_| SeqState::new(&spec)).collect();
        let mut logits: Vec<Vec<f32>> = prompts.iter().map(|_| vec![0.0; v]).collect();
        exec.prefill_batch(&prompts, &mut states, &mut s3.providers, &mut logits)
            .expect("prefill_batch");
        let before = s3.providers.experts.trace().expect("trace").len();
        exec.step_batch(&next, &mut states, &mut s3.providers, &mut logits)
            .expect("step_batch");
        let tr = s3.providers.experts.trace().expect("trace")[before..].to_vec();
        let got = by_layer(&tr, spec.n_layers);
        for l in 0..spec.n_layers {
            let want: Vec<u32> = union_per_layer[l].iter().copied().collect();
            assert_eq!(got[l], want, "{spec_name}: batch step, layer {l}");
        }
        for (b, lg) in logits.iter().enumerate() {
            assert_eq!(bits(lg), alone[b], "{spec_name}: sequence {b}");
        }
    }
}

/// The layer hook (prompt progress) sees every layer of every multi-token call with its token
/// count, and nothing for one-token steps; it changes no bit.
#[test]
fn layer_hook_counts_prompt_token_layers() {
    let (model, _) = synth_and_pack("tiny", 3, &dir());
    let (spec, ckpt) = open_model(&model);
    let mut plan = Plan::new(&spec, 64);
    plan.prefill_chunk = 8;
    let settings = MemorySettings::default();
    let prompt: Vec<u32> = (0..20u32).map(|i| (i * 13 + 5) % 200).collect();
    let v = spec.vocab_size;
    let run = |hooked: bool| {
        let mut s = k3_engine::session::build(&spec, &ckpt, &plan, &settings).expect("providers");
        let mut exec = Executor::new(&spec, plan.clone(), 2);
        let seen = std::rc::Rc::new(std::cell::RefCell::new(Vec::new()));
        if hooked {
            let seen = std::rc::Rc::clone(&seen);
            exec.set_layer_hook(Some(Box::new(move |n| seen.borrow_mut().push(n))));
        }
        let mut st = SeqState::new(&spec);
        let mut lg = vec![0.0; v];
        for c in prompt.chunks(exec.prefill_chunk()) {
            exec.prefill(c, &mut st, &mut s.providers, &mut lg)
                .expect("prefill");
        }
        exec.step(7, &mut st, &mut s.providers, &mut lg)
            .expect("step");
        let calls = seen.borrow().clone();
        (bits(&lg), calls)
    };
    let (plain, none) = run(false);
    let (hooked, calls) = run(true);
    assert!(none.is_empty());
    assert_eq!(plain, hooked, "the hook changes no bit");
    let l = spec.n_layers;
    let want: Vec<usize> = [8, 8, 4]
        .iter()
        .flat_map(|&n| std::iter::repeat_n(n, l))
        .collect();
    assert_eq!(
        calls, want,
        "one call per layer per chunk, none for the step"
    );
}
