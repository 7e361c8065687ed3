//! Speculative expert prefetch (`--expert-prefetch`, issue 4): it only warms the expert cache.
//! Proves (1) identical generated ids and first-step logit bits resident, streamed without
//! prefetch and streamed with prefetch at several cache sizes; (2) the counters: a request
//! served by a prefetched expert is a raw hit and a prefetch hit, never a TRUE resident hit,
//! and nothing is read twice; (3) tiny caches (fewer slots than k + margin, one slot, budget
//! 0) neither deadlock nor read twice, and budget 0 prefetches nothing. Models are synthetic,
//! written under target/ (not tmpfs).

use std::path::{Path, PathBuf};

use k3_conformance::{open_model, run_with, synth_and_pack, trunk_layer_sizes};
use k3_engine::session::{DEFAULT_PREFETCH_MARGIN, MemorySettings};
use k3_engine::stream::experts::{ExpertCache, ExpertCacheOptions, SlotState};
use k3_engine::weights::ExpertSource;

const PROMPT: [u32; 6] = [3, 14, 15, 92, 65, 35];
const N_GEN: usize = 6;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("prefetch")
}

/// Buffer bytes of one cached expert of `model` (the cache budget unit).
/// The six tensors of one served expert, concatenated in field order.
fn expert_bytes(e: &k3_engine::weights::ExpertWeights<'_>) -> Vec<u8> {
    [
        e.w1_packed,
        e.w1_scale,
        e.w3_packed,
        e.w3_scale,
        e.w2_packed,
        e.w2_scale,
    ]
    .concat()
}

/// A streamed expert cache of `budget` bytes over `ckpt`.
fn cache_with<'c>(
    spec: &'c k3_models::spec::ModelSpec,
    ckpt: &k3_engine::checkpoint::Checkpoint,
    budget: u64,
) -> ExpertCache<'c> {
    ExpertCache::new(
        spec,
        ckpt,
        &ExpertCacheOptions {
            budget_bytes: budget,
            ..ExpertCacheOptions::default()
        },
    )
    .expect("cache")
}

/// (expert id, its six tensors' bytes) of every expert `src` serves for `ids` of `layer`.
fn served(src: &mut dyn ExpertSource, layer: usize, ids: &[u32]) -> Vec<(usize, Vec<u8>)> {
    src.experts(layer, ids)
        .unwrap_or_else(|e| panic!("layer {layer} ids {ids:?}: {e}"))
        .iter()
        .map(|e| (e.expert, expert_bytes(e)))
        .collect()
}

fn expert_buf_bytes(model: &Path) -> u64 {
    let (spec, ckpt) = open_model(model);
    let c = ExpertCache::new(&spec, &ckpt, &ExpertCacheOptions::default()).expect("cache");
    c.store().expert_buf_bytes() as u64
}

fn bits_identical(spec: &str, seed: u64) {
    let (model, trunk) = synth_and_pack(spec, seed, &dir());
    let (want, _, _) = run_with(&model, &MemorySettings::default(), &PROMPT, N_GEN, 2);
    let per = expert_buf_bytes(&model);
    let (s, _) = open_model(&model);
    let moe = s.moe.as_ref().expect("synthetic K3 has MoE layers");
    let all = (moe.n_experts * s.n_layers) as u64;
    let k = moe.n_experts_active as u64;
    let largest = trunk_layer_sizes(&trunk)
        .into_iter()
        .max()
        .expect("layers")
        .next_multiple_of(4096);
    for (label, slots) in [
        ("cache 0", 0),
        ("1 slot", 1),
        (
            "k + margin - 1 slots",
            k + DEFAULT_PREFETCH_MARGIN as u64 - 1,
        ),
        ("3 layers' worth", 3 * k),
        ("everything", all),
    ] {
        // Trunk placements: two ring slots (guesses before each layer's attention only), every
        // layer pinned and resident (look-ahead guesses from the previous MoE layer). With
        // `expert_prefetch: None` the automatic prefetch is on when the cache is large enough.
        let ring = Some(2 * largest);
        for (trunk_label, pf, auto, trunk_dir, trunk_budget) in [
            ("ring", None, true, Some(trunk.clone()), ring),
            (
                "ring",
                Some(DEFAULT_PREFETCH_MARGIN),
                true,
                Some(trunk.clone()),
                ring,
            ),
            ("pinned", None, false, Some(trunk.clone()), None),
            ("pinned", Some(0), true, Some(trunk.clone()), None),
            ("resident", Some(DEFAULT_PREFETCH_MARGIN), true, None, None),
            ("resident", None, true, None, None),
        ] {
            let m = MemorySettings {
                trunk_dir,
                trunk_budget_bytes: trunk_budget,
                cache_budget_bytes: Some(slots * per),
                expert_prefetch: pf,
                expert_prefetch_auto: auto,
                ..MemorySettings::default()
            };
            // The automatic prefetch: room for 3 layers of guesses (any trunk placement).
            let auto_on = pf.is_none() && auto && slots >= 3 * (k + DEFAULT_PREFETCH_MARGIN as u64);
            let pf = pf.or(auto_on.then_some(DEFAULT_PREFETCH_MARGIN));
            let (got, _, e) = run_with(&model, &m, &PROMPT, N_GEN, 2);
            let label = format!("{label}, {trunk_label} trunk");
            assert_eq!(
                got, want,
                "{spec}: {label}, prefetch {pf:?}: output differs from resident"
            );
            assert_eq!(e.requests, e.hits + e.misses, "{spec}: {label}: requests");
            if pf.is_none() || slots == 0 {
                assert_eq!(e.prefetched, 0, "{spec}: {label}, {pf:?}: prefetched");
                assert_eq!(e.prefetch_hits, 0);
            } else if slots < 3 * k {
                // Fewer slots than three layers' guesses: a decode guess never evicts the last
                // request's experts nor those of the layers before the guessed one, so it may
                // find no free slot and read nothing (prompts guessed token by token before
                // they were fed expert-major, which kept these small caches prefetching).
                assert!(e.prefetch_hits + e.prefetch_wasted <= e.prefetched);
                assert!(e.resident_hits + e.prefetch_hits <= e.hits);
            } else {
                assert!(e.prefetched > 0, "{spec}: {label}: nothing prefetched");
                assert!(e.guessed_requests > 0, "{spec}: {label}: no guesses");
                // A request is served by a prefetch at most once per prefetched expert.
                assert!(e.prefetch_hits + e.prefetch_wasted <= e.prefetched);
                assert!(e.resident_hits + e.prefetch_hits <= e.hits);
            }
            if slots >= 3 * k && pf.is_some() {
                assert!(
                    e.prefetch_hits > 0,
                    "{spec}: {label}: no request was served by a prefetch: {e:?}"
                );
                // Guesses made with the right layer's router on a sensible input cover most
                // routed ids (random guesses would cover about k / n_experts).
                assert!(
                    e.guess_accuracy() >= 0.8,
                    "{spec}: {label}: guesses covered only {:.2} of the routed ids: {e:?}",
                    e.guess_accuracy()
                );
            }
            println!(
                "{spec}: {label}, prefetch {pf:?}: req {} hits {} resident {} misses {} prefetched {} served {} wasted {} guess {:.2} -> identical",
                e.requests,
                e.hits,
                e.resident_hits,
                e.misses,
                e.prefetched,
                e.prefetch_hits,
                e.prefetch_wasted,
                e.guess_accuracy()
            );
        }
    }
}

#[test]
fn identical_bits_with_and_without_prefetch_tiny() {
    bits_identical("tiny", 1);
}

#[test]
fn identical_bits_with_and_without_prefetch_odd9() {
    bits_identical("odd9", 9);
}

/// First MoE layer of the synthetic model.
fn moe_layer(spec: &k3_models::spec::ModelSpec) -> usize {
    spec.layers
        .iter()
        .position(|l| l.ffn == k3_models::spec::FfnKind::Moe)
        .expect("a MoE layer")
}

/// The "tiny" synthetic model (directory, spec, checkpoint), its first MoE layer and the buffer bytes of
/// one expert: the set-up of the cache-level tests below.
fn tiny_moe() -> (
    PathBuf,
    k3_models::spec::ModelSpec,
    k3_engine::checkpoint::Checkpoint,
    usize,
    u64,
) {
    let (model, _) = synth_and_pack("tiny", 1, &dir());
    let (spec, ckpt) = open_model(&model);
    let l = moe_layer(&spec);
    let per = expert_buf_bytes(&model);
    (model, spec, ckpt, l, per)
}

/// Bytes one expert read costs (every synthetic expert has the same shapes), measured with a
/// plain demand read.
fn bytes_per_read(
    spec: &k3_models::spec::ModelSpec,
    ckpt: &k3_engine::checkpoint::Checkpoint,
    l: usize,
) -> u64 {
    let mut c = ExpertCache::new(spec, ckpt, &ExpertCacheOptions::default()).expect("cache");
    c.begin_token();
    c.experts(l, &[5]).expect("read");
    let one = c.stats().bytes_read;
    assert!(one > 0);
    one
}

#[test]
fn prefetch_served_requests_are_not_resident_hits() {
    let (model, spec, ckpt, l, per) = tiny_moe();
    let one = bytes_per_read(&spec, &ckpt, l);
    let mut c = cache_with(&spec, &ckpt, 8 * per);
    // Token 1: guess {1, 2, 3}; routing picks {1, 3, 7}.
    c.begin_token();
    c.prefetch(l, &[1, 2, 3]);
    let want: Vec<Vec<u8>> = {
        let (s2, ck2) = open_model(&model);
        let mut r = k3_engine::resident::ResidentExperts::new(&s2, &ck2);
        r.experts(l, &[1, 3, 7])
            .expect("resident")
            .iter()
            .map(expert_bytes)
            .collect()
    };
    let got: Vec<Vec<u8>> = c
        .experts(l, &[1, 3, 7])
        .expect("served")
        .iter()
        .map(expert_bytes)
        .collect();
    assert_eq!(
        got, want,
        "prefetched experts must hold the checkpoint's bytes"
    );
    let s = c.stats();
    assert_eq!(s.prefetched, 3);
    assert_eq!(s.requests, 3);
    assert_eq!(s.hits, 2, "1 and 3 were fetched by the guess: raw hits");
    assert_eq!(s.prefetch_hits, 2);
    assert_eq!(
        s.resident_hits, 0,
        "fetched a moment earlier is not resident"
    );
    assert_eq!(s.misses, 1, "7 was not guessed");
    assert_eq!(s.prefetch_wasted, 1, "2 was guessed but not routed");
    assert_eq!(s.guessed_requests, 3);
    assert_eq!(s.guess_covered, 2);
    assert_eq!(s.bytes_read, 4 * one, "each expert read exactly once");
    // Token 2: 1 and 3 were in RAM before this token asked -> resident hits; the wasted 2
    // was dropped, so it is read again by this token's guess and served by it.
    c.begin_token();
    c.prefetch(l, &[1, 2, 3]);
    c.experts(l, &[1, 2, 3]).expect("served");
    let s = c.stats();
    assert_eq!(s.prefetched, 4, "resident experts are not prefetched again");
    assert_eq!(s.resident_hits, 2);
    assert_eq!(s.prefetch_hits, 3);
    assert_eq!(s.hits, 5);
    assert_eq!(s.misses, 1);
    assert_eq!(s.bytes_read, 5 * one, "each read exactly once");
    assert!(
        c.slot_states()
            .iter()
            .all(|(st, _)| *st != SlotState::InFlight),
        "nothing left in flight after a request"
    );
}

#[test]
fn tiny_caches_neither_deadlock_nor_read_twice() {
    let (model, spec, ckpt, l, per) = tiny_moe();
    // Bytes each expert's read costs (rounded-out runs differ by a few KB between experts).
    let mut sizes = Vec::new();
    for layer in [l, l + 1] {
        for id in 0..16u32 {
            let mut c =
                ExpertCache::new(&spec, &ckpt, &ExpertCacheOptions::default()).expect("cache");
            c.experts(layer, &[id]).expect("read");
            sizes.push(c.stats().bytes_read);
        }
    }
    let (lo, hi) = (
        *sizes.iter().min().expect("sizes"),
        *sizes.iter().max().expect("sizes"),
    );
    let (s2, ck2) = open_model(&model);
    let mut resident = k3_engine::resident::ResidentExperts::new(&s2, &ck2);
    for slots in [0u64, 1, 2, 3] {
        let mut c = cache_with(&spec, &ckpt, slots * per);
        c.set_prefetch_margin(Some(DEFAULT_PREFETCH_MARGIN));
        assert_eq!(
            c.prefetch_margin().is_some(),
            slots > 0,
            "budget 0 wants no guesses"
        );
        for t in 0..4u32 {
            c.begin_token();
            // Guess of 8 (> capacity) overlapping the real 4.
            let guess: Vec<u32> = (0..8).map(|i| (i + 2 * t) % 16).collect::<Vec<_>>();
            let mut guess = guess;
            guess.sort_unstable();
            c.prefetch(l, &guess);
            c.prefetch(l + 1, &guess); // a second pending guess for another layer
            let mut real: Vec<u32> = vec![(2 * t) % 16, (2 * t + 3) % 16, (2 * t + 9) % 16, 15];
            real.sort_unstable();
            real.dedup();
            for layer in [l, l + 1] {
                let got = served(&mut c, layer, &real);
                let want = served(&mut resident, layer, &real);
                assert_eq!(got, want, "{slots} slots, token {t}, layer {layer}");
            }
        }
        let s = c.stats();
        assert!(c.slot_states().len() as u64 <= slots, "capacity respected");
        if slots == 0 {
            assert_eq!(s.prefetched, 0, "budget 0: prefetch does nothing");
            assert_eq!(s.hits, 0);
        } else {
            assert!(s.prefetched > 0, "{slots} slots: nothing prefetched");
        }
        assert!(s.prefetch_hits + s.prefetch_wasted <= s.prefetched);
        assert_eq!(s.requests, s.hits + s.misses);
        // No duplicate reads: bytes read = (demand misses + prefetched) expert reads.
        let n = s.misses + s.prefetched;
        assert!(
            lo * n <= s.bytes_read && s.bytes_read <= hi * n,
            "{slots} slots: {} bytes for {n} reads of {lo}..={hi}: {s:?}",
            s.bytes_read
        );
        assert_eq!(s.load_failures, 0);
        assert_eq!(s.prefetch_failures, 0);
    }
}

/// A look-ahead guess (`prefetch_after_next`) starts only after the next request has read its
/// own misses, never evicts what that request uses, and serves the guessed layer's request
/// without a second read.
#[test]
fn look_ahead_guess_waits_for_the_current_request_and_serves_the_next() {
    let (model, _) = synth_and_pack("tiny", 1, &dir());
    let (spec, ckpt) = open_model(&model);
    let l = moe_layer(&spec);
    let next = (l + 1..spec.n_layers)
        .find(|&n| spec.layers[n].ffn == k3_models::spec::FfnKind::Moe)
        .expect("two MoE layers");
    let per = expert_buf_bytes(&model);
    // What reading each expert costs on its own (rounded-out runs differ by a few KB).
    let cost = |layer: usize, id: u32| {
        let mut c = ExpertCache::new(&spec, &ckpt, &ExpertCacheOptions::default()).expect("cache");
        c.experts(layer, &[id]).expect("read");
        c.stats().bytes_read
    };
    let once: u64 = [
        (l, 1),
        (l, 2),
        (l, 5),
        (next, 0),
        (next, 4),
        (next, 6),
        (next, 7),
    ]
    .iter()
    .map(|&(layer, id)| cost(layer, id))
    .sum();
    let (s2, ck2) = open_model(&model);
    let mut resident = k3_engine::resident::ResidentExperts::new(&s2, &ck2);
    // Room for exactly the current request (3) and the guess (3).
    let mut c = cache_with(&spec, &ckpt, 6 * per);
    c.begin_token();
    c.prefetch_after_next(next, &[0, 4, 6]);
    assert_eq!(c.stats().prefetched, 0, "deferred until the next request");
    assert!(
        c.slot_states().is_empty(),
        "nothing claimed before the request"
    );
    c.experts(l, &[1, 2, 5]).expect("served");
    let s = c.stats();
    assert_eq!(s.misses, 3, "the current request reads its own experts");
    assert_eq!(s.prefetched, 3, "the guess starts after them");
    let got = served(&mut c, next, &[0, 4, 7]);
    let want = served(&mut resident, next, &[0, 4, 7]);
    assert_eq!(got, want, "guessed experts hold the checkpoint's bytes");
    let s = c.stats();
    assert_eq!(s.prefetch_hits, 2, "0 and 4 came from the guess");
    assert_eq!(s.misses, 4, "7 was not guessed");
    assert_eq!(s.prefetch_wasted, 1, "6 was guessed but not routed");
    assert_eq!(s.guessed_requests, 3);
    assert_eq!(s.guess_covered, 2);
    assert_eq!(s.bytes_read, once, "every expert read once");
    // A guess for a later layer never evicts an expert of the layers in between: with the
    // cache full of layer `l`'s experts, a look-ahead guess for `next` issued after a request
    // of an EARLIER layer finds no victim among `l`'s experts.
    let mut c = cache_with(&spec, &ckpt, 3 * per);
    c.begin_token();
    c.experts(l, &[1, 2, 3]).expect("served");
    c.begin_token();
    c.prefetch_after_next(next, &[0, 4, 6]);
    c.experts(0, &[]).expect("an empty request of layer 0");
    assert_eq!(c.stats().prefetched, 0, "layer {l}'s experts are protected");
    c.experts(l, &[1, 2, 3]).expect("served");
    assert_eq!(c.stats().resident_hits, 3, "all three still resident");
}

/// `ready` is true only when every asked expert is in a ready slot (the executor then serves the
/// layer without the overlap thread); a guess still being read is not ready until it lands.
#[test]
fn ready_only_when_every_expert_is_in_a_ready_slot() {
    let (_, spec, ckpt, l, per) = tiny_moe();
    let mut c = cache_with(&spec, &ckpt, 8 * per);
    c.begin_token();
    assert!(!c.ready(l, &[1, 2]), "nothing cached yet");
    c.experts(l, &[1, 2]).expect("served");
    assert!(c.ready(l, &[1, 2]));
    assert!(c.ready(l, &[2]));
    assert!(!c.ready(l, &[1, 2, 3]), "3 was never read");
    assert!(
        !c.ready(l + 1, &[1]),
        "another layer's expert 1 is not layer {l}'s"
    );
    c.prefetch(l, &[3]);
    // In flight or landed: `ready` reports it only once the read has finished.
    let mut spins = 0;
    while !c.ready(l, &[1, 2, 3]) {
        spins += 1;
        assert!(spins < 10_000, "a prefetched expert never became ready");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    c.experts(l, &[1, 2, 3]).expect("served");
    let s = c.stats();
    assert_eq!((s.misses, s.prefetch_hits), (2, 1), "{s:?}");
    // A cache without room serves from scratch: never ready.
    let mut none = ExpertCache::new(&spec, &ckpt, &ExpertCacheOptions::default()).expect("cache");
    none.experts(l, &[1]).expect("served");
    assert!(!none.ready(l, &[1]), "budget 0 keeps nothing");
}

/// `experts_split` hands the experts already in ready slots to `early` first and returns the
/// others after their reads (in flight or on demand): every position exactly once, the same
/// bytes as a cache without room, and the same counters as one `experts` call on a twin cache.
#[test]
fn split_hands_out_ready_experts_first_and_the_rest_after() {
    let (_, spec, ckpt, l, per) = tiny_moe();
    let mut reference = cache_with(&spec, &ckpt, 0);
    assert!(!reference.reads_ahead(), "no room: nothing is read ahead");
    let ids = [1u32, 2, 3, 4, 5];
    let want = served(&mut reference, l, &ids);
    let (mut split, mut twin) = (
        cache_with(&spec, &ckpt, 16 * per),
        cache_with(&spec, &ckpt, 16 * per),
    );
    for c in [&mut split, &mut twin] {
        c.set_prefetch_margin(Some(0));
        assert!(c.reads_ahead());
        c.begin_token();
        c.experts(l, &[1, 2]).expect("served");
        c.prefetch(l, &[3, 4]); // in flight or landed; 5 is read on demand
    }
    let mut early: Vec<(usize, usize, Vec<u8>)> = Vec::new();
    let (rest_at, rest) = split
        .experts_split(l, &ids, &mut |at, ws| {
            for (&i, w) in at.iter().zip(ws) {
                early.push((i, w.expert, expert_bytes(w)));
            }
        })
        .expect("served");
    let early_at: Vec<usize> = early.iter().map(|e| e.0).collect();
    assert!(
        early_at.starts_with(&[0, 1]),
        "1 and 2 were ready: {early_at:?}"
    );
    assert!(!early_at.contains(&4), "5 is not read before the call");
    let mut got: Vec<(usize, usize, Vec<u8>)> = early;
    got.extend(
        rest_at
            .iter()
            .zip(&rest)
            .map(|(&i, w)| (i, w.expert, expert_bytes(w))),
    );
    got.sort_by_key(|g| g.0);
    assert_eq!(
        got.iter().map(|g| g.0).collect::<Vec<_>>(),
        (0..ids.len()).collect::<Vec<_>>(),
        "every position exactly once"
    );
    for ((i, id, bytes), (want_id, want_bytes)) in got.iter().zip(&want) {
        assert_eq!((id, bytes), (want_id, want_bytes), "position {i}");
    }
    drop(rest);
    twin.experts(l, &ids).expect("served");
    let (s, t) = (split.stats(), twin.stats());
    assert_eq!(
        (
            s.requests,
            s.hits,
            s.misses,
            s.prefetch_hits,
            s.prefetch_wasted
        ),
        (
            t.requests,
            t.hits,
            t.misses,
            t.prefetch_hits,
            t.prefetch_wasted
        ),
        "{s:?} vs {t:?}"
    );
    assert_eq!((s.requests, s.misses, s.prefetch_hits), (7, 3, 2), "{s:?}");
    // Nothing in RAM yet: `early` still runs first (with no expert), so the caller can work
    // while the reads land; everything comes back afterwards.
    let mut calls = Vec::new();
    let (rest_at, rest) = split
        .experts_split(l + 1, &[7, 8], &mut |at, ws| {
            calls.push((at.to_vec(), ws.len()))
        })
        .expect("served");
    assert_eq!(calls, vec![(vec![], 0)]);
    assert_eq!(rest_at, vec![0, 1]);
    assert_eq!(
        rest.iter().map(|w| w.expert).collect::<Vec<_>>(),
        vec![7, 8]
    );
    drop(rest);
    // Everything in RAM: nothing to wait for, `early` is not called.
    let mut called = false;
    let (rest_at, _) = split
        .experts_split(l + 1, &[7, 8], &mut |_, _| called = true)
        .expect("served");
    assert!(!called);
    assert_eq!(rest_at, vec![0, 1]);
}

/// Records the executor's expert calls around resident experts that ask for guesses.
struct Recorder<'c> {
    inner: Box<dyn ExpertSource + 'c>,
    /// ("guess" | "ahead" | "serve", layer) in call order.
    calls: std::sync::Arc<std::sync::Mutex<Vec<(&'static str, usize)>>>,
}

impl ExpertSource for Recorder<'_> {
    fn experts(
        &mut self,
        layer: usize,
        ids: &[u32],
    ) -> Result<Vec<k3_engine::weights::ExpertWeights<'_>>, k3_engine::weights::WeightError> {
        self.calls.lock().unwrap().push(("serve", layer));
        self.inner.experts(layer, ids)
    }
    fn stats(&self) -> k3_engine::weights::ExpertStats {
        self.inner.stats()
    }
    fn prefetch(&mut self, layer: usize, _ids: &[u32]) {
        self.calls.lock().unwrap().push(("guess", layer));
    }
    fn prefetch_after_next(&mut self, layer: usize, _ids: &[u32]) {
        self.calls.lock().unwrap().push(("ahead", layer));
    }
    fn prefetch_margin(&self) -> Option<usize> {
        Some(DEFAULT_PREFETCH_MARGIN)
    }
}

/// In decode, the look-ahead guess made during MoE layer L is for the SECOND MoE layer after L
/// (`exec::DEFAULT_LOOKAHEAD_DEPTH`), so about two layers of reads are queued; only the MoE
/// layers no earlier layer guessed get a guess before their own attention. A prompt of several
/// tokens guesses no layer ahead.
#[test]
fn look_ahead_guesses_two_moe_layers_ahead_in_decode() {
    assert_eq!(k3_engine::exec::DEFAULT_LOOKAHEAD_DEPTH, 2);
    let (model, _) = synth_and_pack("tiny", 1, &dir());
    let (spec, ckpt) = open_model(&model);
    let moe: Vec<usize> = (0..spec.n_layers)
        .filter(|&l| spec.layers[l].ffn == k3_models::spec::FfnKind::Moe)
        .collect();
    assert!(moe.len() >= 4, "the fixture needs 4 MoE layers: {moe:?}");
    let mut w = k3_conformance::resident(&spec, &ckpt);
    let calls = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    w.experts = Box::new(Recorder {
        inner: std::mem::replace(
            &mut w.experts,
            Box::new(k3_engine::resident::ResidentExperts::new(&spec, &ckpt)),
        ),
        calls: std::sync::Arc::clone(&calls),
    });
    let mut exec = k3_conformance::executor(&spec, 8, 2);
    let mut state = k3_engine::exec::SeqState::new(&spec);
    let mut logits = vec![0.0f32; spec.vocab_size];
    exec.prefill(&[3, 14], &mut state, &mut w, &mut logits)
        .expect("prompt");
    let prompt: Vec<_> = calls.lock().unwrap().drain(..).collect();
    assert!(
        !prompt.iter().any(|c| c.0 == "ahead"),
        "no look-ahead in a prompt chunk: {prompt:?}"
    );
    exec.step(15, &mut state, &mut w, &mut logits)
        .expect("decode");
    let got: Vec<_> = calls.lock().unwrap().clone();
    // expected: guesses before attention for the first two MoE layers, then at every MoE
    // layer L (before serving it) a look-ahead for the MoE layer two after it
    let mut want = Vec::new();
    for (i, &l) in moe.iter().enumerate() {
        if i < 2 {
            want.push(("guess", l));
        }
        if let Some(&ahead) = moe.get(i + 2) {
            want.push(("ahead", ahead));
        }
        want.push(("serve", l));
    }
    assert_eq!(got, want);
}
