//! The expert cache: exact counters on a scripted LRU sequence, zero budget, scratch overflow,
//! read errors and E8M0 0xFF surfacing as WeightError::Expert (never zeros).

mod stream_support;

use k3_engine::checkpoint::Checkpoint;
use k3_engine::resident::ResidentExperts;
use k3_engine::stream::experts::{ExpertCache, ExpertCacheOptions, SlotState};
use k3_engine::stream::trace::{TOKEN_MARK, TRACE_FILE, read_trace, simulate};
use k3_engine::weights::{ExpertSource, ExpertWeights, WeightError};
use k3_models::spec::{ModelSpec, TensorDecl, TensorRole};
use stream_support::*;

fn cache<'c>(spec: &'c ModelSpec, ck: &Checkpoint, n_experts: u64) -> ExpertCache<'c> {
    // Learn the per-expert buffer size from a zero-budget cache, then size the real one.
    let probe = ExpertCache::new(spec, ck, &ExpertCacheOptions::default()).expect("store");
    let per = probe.store().expert_buf_bytes() as u64;
    drop(probe);
    let c = ExpertCache::new(
        spec,
        ck,
        &ExpertCacheOptions {
            budget_bytes: n_experts * per + per / 2,
            o_direct: true,
            read_threads: 4,
        },
    )
    .expect("cache");
    assert_eq!(c.capacity() as u64, n_experts);
    c
}

fn check_bytes(
    spec: &ModelSpec,
    ck: &Checkpoint,
    layer: usize,
    got: &[ExpertWeights<'_>],
    ids: &[u32],
) {
    assert_eq!(got.len(), ids.len());
    for (w, &id) in got.iter().zip(ids) {
        assert_eq!(w.expert, id as usize);
        let want = |role: TensorRole| {
            let d = spec
                .tensor(role, Some(layer), Some(id as usize))
                .expect("declared expert tensor");
            ck.try_bytes(&d.name).expect("in checkpoint")
        };
        assert!(
            w.w1_packed == want(TensorRole::ExpertW1Packed),
            "L{layer} E{id} w1"
        );
        assert!(
            w.w1_scale == want(TensorRole::ExpertW1Scale),
            "L{layer} E{id} w1s"
        );
        assert!(
            w.w3_packed == want(TensorRole::ExpertW3Packed),
            "L{layer} E{id} w3"
        );
        assert!(
            w.w3_scale == want(TensorRole::ExpertW3Scale),
            "L{layer} E{id} w3s"
        );
        assert!(
            w.w2_packed == want(TensorRole::ExpertW2Packed),
            "L{layer} E{id} w2"
        );
        assert!(
            w.w2_scale == want(TensorRole::ExpertW2Scale),
            "L{layer} E{id} w2s"
        );
    }
}

fn req(c: &mut ExpertCache<'_>, spec: &ModelSpec, ck: &Checkpoint, layer: usize, ids: &[u32]) {
    let got = c.experts(layer, ids).expect("experts");
    check_bytes(spec, ck, layer, &got, ids);
}

#[test]
fn lru_capacity_two_scripted_counters() {
    let (model, spec, ck) = tiny_opened("experts_lru", 21);
    let mut c = cache(&spec, &ck, 2);
    assert_eq!(c.policy_name(), "lru");
    c.enable_trace();
    // token 1
    c.begin_token();
    req(&mut c, &spec, &ck, 1, &[0, 1]); // 2 misses
    req(&mut c, &spec, &ck, 2, &[0]); // miss, evicts (1,0) (least recently used)
    // token 2
    c.begin_token();
    req(&mut c, &spec, &ck, 1, &[1]); // hit, resident (loaded in token 1)
    req(&mut c, &spec, &ck, 1, &[0, 1]); // (1,1) resident hit; (1,0) miss evicts (2,0)
    req(&mut c, &spec, &ck, 1, &[0]); // hit, but loaded during this token: not resident
    let s = c.stats();
    assert_eq!(
        (s.requests, s.hits, s.misses, s.evictions, s.resident_hits),
        (7, 3, 4, 2, 2),
        "{s:?}"
    );
    assert_eq!(s.load_failures, 0);
    assert!((s.resident_hit_rate() - 2.0 / 7.0).abs() < 1e-12);
    let mut keys: Vec<_> = c
        .slot_states()
        .into_iter()
        .map(|(st, k)| {
            assert_eq!(st, SlotState::Ready);
            k.expect("ready slot has a key")
        })
        .collect();
    keys.sort();
    assert_eq!(keys, vec![(1, 0), (1, 1)]);
    assert!(s.bytes_read >= 4 * c.store().expert_bytes());
    let lines = c.report_lines().join("\n");
    assert!(lines.contains("TRUE resident hit rate 28.57%"), "{lines}");
    // The trace replays to the same LRU hits (no call here needs more than the capacity).
    let trace = c.trace().expect("trace enabled").to_vec();
    assert_eq!(trace.iter().filter(|r| r.0 == TOKEN_MARK).count(), 2);
    assert_eq!(trace.len(), 7 + 2);
    let sim = simulate(&trace, 2);
    assert_eq!((sim.requests, sim.lru_hits), (7, 3));
    assert!(sim.belady_hits >= sim.lru_hits);
    let tdir = model.with_file_name("trace"); // beside the model, in its test directory
    c.write_trace(&tdir).expect("write trace");
    assert_eq!(
        read_trace(&tdir.join(TRACE_FILE)).expect("read trace"),
        trace
    );
}

#[test]
fn zero_budget_serves_every_call_from_scratch() {
    let (_, spec, ck) = tiny_opened("experts_zero", 22);
    let mut c = ExpertCache::new(&spec, &ck, &ExpertCacheOptions::default()).expect("cache");
    assert_eq!(c.capacity(), 0);
    for _ in 0..2 {
        c.begin_token();
        req(&mut c, &spec, &ck, 3, &[0, 3, 5, 15]);
        req(&mut c, &spec, &ck, 12, &[1, 2]);
    }
    let s = c.stats();
    assert_eq!((s.requests, s.hits, s.misses, s.evictions), (12, 0, 12, 0));
    assert!(c.slot_states().is_empty());
    // Not ascending: refused.
    assert!(matches!(
        c.experts(3, &[5, 3]),
        Err(WeightError::Invalid { .. })
    ));
}

#[test]
fn capacity_smaller_than_one_call_overflows_to_scratch() {
    let (_, spec, ck) = tiny_opened("experts_overflow", 23);
    let mut c = cache(&spec, &ck, 1);
    c.begin_token();
    req(&mut c, &spec, &ck, 4, &[1, 2, 3, 4]);
    req(&mut c, &spec, &ck, 4, &[1, 2, 3, 4]);
    let s = c.stats();
    // Call 1: 4 misses, (4,1) cached. Call 2: (4,1) hit, 3 misses; the only slot is in use by
    // this call, so nothing is evicted.
    assert_eq!(
        (s.requests, s.hits, s.misses, s.evictions),
        (8, 1, 7, 0),
        "{s:?}"
    );
}

/// Smallest file offset of an expert's tensors, and one of its scale tensors' offset.
fn expert_offsets(ck: &Checkpoint, spec: &ModelSpec, layer: usize, e: usize) -> (u64, u64, String) {
    let mut min = u64::MAX;
    for d in spec
        .tensors
        .iter()
        .filter(|d| d.layer == Some(layer) && d.expert == Some(e))
    {
        min = min.min(ck.try_location(&d.name).expect("loc").file_offset);
    }
    let sd = spec
        .tensor(TensorRole::ExpertW3Scale, Some(layer), Some(e))
        .expect("scale decl");
    let sl = ck.try_location(&sd.name).expect("loc");
    (min, sl.file_offset, sd.name.clone())
}

#[test]
fn a_failed_read_is_weight_error_expert() {
    let (model, spec, ck) = tiny_opened("experts_read_error", 24);
    let (start, _, name) = expert_offsets(&ck, &spec, 5, 3);
    let shard = shard_of(&model, &name);
    // Cut the shard inside expert 3 of layer 5 (the checkpoint is already open and never
    // touches expert bytes through its mapping).
    std::fs::OpenOptions::new()
        .write(true)
        .open(&shard)
        .expect("open shard")
        .set_len(start + 10)
        .expect("truncate");
    let mut c = ExpertCache::new(
        &spec,
        &ck,
        &ExpertCacheOptions {
            budget_bytes: 1 << 30,
            o_direct: true,
            read_threads: 2,
        },
    )
    .expect("cache");
    c.begin_token();
    match c.experts(5, &[0, 3]) {
        Err(WeightError::Expert { layer, expert, msg }) => {
            assert_eq!((layer, expert), (5, 3));
            assert!(msg.contains("model-0000"), "{msg}");
        }
        Err(e) => panic!("wrong error kind: {e}"),
        Ok(_) => panic!("a truncated expert must not load"),
    }
    let s = c.stats();
    assert_eq!(s.load_failures, 1);
    // The expert that did load is cached; the failed one is not resident.
    let ready: Vec<_> = c
        .slot_states()
        .into_iter()
        .filter(|s| s.0 == SlotState::Ready)
        .collect();
    assert_eq!(ready, vec![(SlotState::Ready, Some((5, 0)))]);
    req(&mut c, &spec, &ck, 5, &[0]);
}

#[test]
fn e8m0_nan_scale_is_refused_naming_the_tensor() {
    let (model, spec, ck) = tiny_opened("experts_e8m0", 25);
    let (_, scale_off, name) = expert_offsets(&ck, &spec, 4, 2);
    let shard = shard_of(&model, &name);
    let poke = std::fs::OpenOptions::new()
        .write(true)
        .open(&shard)
        .expect("open shard");
    k3_engine::platform::write_all_at(&poke, &[0xFF], scale_off + 5).expect("poke 0xFF");
    drop(poke);
    let mut c = ExpertCache::new(&spec, &ck, &ExpertCacheOptions::default()).expect("cache");
    match c.experts(4, &[2]) {
        Err(WeightError::Expert { layer, expert, msg }) => {
            assert_eq!((layer, expert), (4, 2));
            assert!(msg.contains(&name), "{msg}");
            assert!(msg.contains("0xFF") && msg.contains("index 5"), "{msg}");
        }
        Err(e) => panic!("wrong error kind: {e}"),
        Ok(_) => panic!("a NaN scale must not load"),
    }
    req(&mut c, &spec, &ck, 4, &[1, 3]);
}

#[test]
fn io_uring_pool_serves_the_same_experts() {
    use k3_engine::stream::direct::ReadPool;
    let (_, spec, ck) = tiny_opened("experts_uring", 26);
    let pool = ReadPool::with_io_uring(4).expect("pool");
    let mut c = ExpertCache::new_with_pool(&spec, &ck, &ExpertCacheOptions::default(), pool)
        .expect("cache");
    assert!(
        c.startup_line().contains("io_uring"),
        "{}",
        c.startup_line()
    );
    for layer in [1usize, 6, 12] {
        c.begin_token();
        req(&mut c, &spec, &ck, layer, &[0, 2, 7, 11, 15]);
    }
    assert_eq!(c.stats().misses, 15);
}

/// The resident provider on the memory maps (an expert's pages advised `MADV_WILLNEED` on its
/// first request) serves every expert's exact checkpoint bytes, on the first request (advice)
/// and later ones (none), in any order of ids.
#[test]
fn resident_maps_serve_exact_bytes_with_and_without_advice() {
    let (_, spec, ck) = tiny_opened("resident_advised_maps", 41);
    let n = spec
        .moe
        .as_ref()
        .expect("tiny has routed experts")
        .n_experts;
    let all: Vec<u32> = (0..n as u32).collect();
    let mut r = ResidentExperts::new(&spec, &ck);
    let mut layers = 0;
    for layer in 0..spec.n_layers {
        if spec
            .tensor(TensorRole::ExpertW1Packed, Some(layer), Some(0))
            .is_none()
        {
            continue; // a dense layer
        }
        layers += 1;
        for ids in [&all[..2], &all[..], &all[1..3], &all[..]] {
            let got = r.experts(layer, ids).expect("resident experts");
            check_bytes(&spec, &ck, layer, &got, ids);
        }
    }
    assert!(layers > 0, "tiny has MoE layers");
}

/// `spec` without the tensors `cut` selects (index rebuilt).
fn without(spec: &ModelSpec, cut: impl Fn(&TensorDecl) -> bool) -> ModelSpec {
    let mut s = spec.clone();
    s.tensors.retain(|d| !cut(d));
    s.rebuild_index();
    s
}

fn expect_undeclared(c: &mut ExpertCache<'_>, layer: usize, id: u32) {
    match c.experts(layer, &[id]) {
        Err(WeightError::Expert {
            layer: l,
            expert,
            msg,
        }) => {
            assert_eq!((l, expert), (layer, id as usize));
            assert!(msg.contains("is not declared by the model"), "{msg}");
        }
        Err(e) => panic!("wrong error kind: {e}"),
        Ok(_) => panic!("L{layer} E{id} is not declared and must not load"),
    }
}

#[test]
fn sparse_ids_and_short_layers_are_absent_not_misread() {
    let (_, spec, ck) = tiny_opened("experts_sparse", 27);
    let full = ExpertCache::new(&spec, &ck, &ExpertCacheOptions::default()).expect("cache");
    assert_eq!(full.store().n_experts(), 12 * 16, "layer 0 is dense");
    drop(full);
    // Layer 2 skips expert 5, layer 4 declares only experts 0..10, layer 6 none.
    let cut = without(&spec, |d| match (d.layer, d.expert) {
        (Some(l), Some(e)) => (l, e) == (2, 5) || (l == 4 && e >= 10) || l == 6,
        _ => false,
    });
    let opts = ExpertCacheOptions {
        budget_bytes: 1 << 30,
        o_direct: true,
        read_threads: 2,
    };
    let mut c = ExpertCache::new(&cut, &ck, &opts).expect("cache");
    assert_eq!(c.store().n_experts(), 12 * 16 - 1 - 6 - 16);
    c.begin_token();
    req(&mut c, &cut, &ck, 2, &[0, 4, 6, 15]);
    req(&mut c, &cut, &ck, 4, &[0, 9]);
    req(&mut c, &cut, &ck, 5, &[0, 15]);
    req(&mut c, &cut, &ck, 12, &[15]);
    for (layer, id) in [(2, 5), (4, 10), (4, 15), (6, 0), (0, 0), (3, 16), (13, 0)] {
        expect_undeclared(&mut c, layer, id);
    }
    // A guess at an undeclared expert is skipped, not read.
    c.prefetch(4, &[12, 1]);
    req(&mut c, &cut, &ck, 4, &[1]);
    expect_undeclared(&mut c, 4, 12);
    drop(c);
    // No routed experts at all (and no MoE section): an empty store.
    let mut none = without(&spec, |d| d.expert.is_some());
    none.moe = None;
    let mut c = ExpertCache::new(&none, &ck, &opts).expect("an empty store");
    assert_eq!(c.store().n_experts(), 0);
    assert!(c.store().io_line().contains("no routed experts"));
    expect_undeclared(&mut c, 1, 0);
}

#[test]
fn an_expert_missing_a_role_or_a_tensor_is_refused_naming_it() {
    let (_, spec, ck) = tiny_opened("experts_missing", 28);
    let opts = ExpertCacheOptions::default();
    let cut = without(&spec, |d| {
        (d.layer, d.expert, d.role) == (Some(3), Some(2), TensorRole::ExpertW3Scale)
    });
    let err = ExpertCache::new(&cut, &ck, &opts)
        .expect_err("a role is missing")
        .to_string();
    assert!(
        err.contains("routed expert 2 of layer 3 declares no ExpertW3Scale tensor"),
        "{err}"
    );

    let mut renamed = spec.clone();
    let i = renamed
        .tensors
        .iter()
        .position(|d| (d.layer, d.expert, d.role) == (Some(5), Some(7), TensorRole::ExpertW2Packed))
        .expect("declared");
    renamed.tensors[i].name.push_str(".absent");
    let name = renamed.tensors[i].name.clone();
    let err = ExpertCache::new(&renamed, &ck, &opts)
        .expect_err("a tensor is missing")
        .to_string();
    assert!(
        err.contains(&format!("tensor {name} is not in the checkpoint")),
        "{err}"
    );

    // An id far outside the spec's grid is refused (no table sized by it).
    let mut far = spec.clone();
    far.tensors[i].expert = Some(1 << 40);
    far.rebuild_index();
    let err = ExpertCache::new(&far, &ck, &opts)
        .expect_err("an id outside the grid")
        .to_string();
    assert!(
        err.contains("routed expert 1099511627776 of layer 5")
            && err.contains(&spec.tensors[i].name)
            && err.contains("13 layers of 16 routed experts"),
        "{err}"
    );
}
