//! Proof of identical output at every memory setting (docs/NUMERICS.md §1, issue 4): the same
//! request resident, with a packed trunk at several budgets (0 pinned, some pinned, all
//! pinned), 1 and 2+ ring slots, expert-cache sizes from zero to everything, ultra-low-memory,
//! the pinned prefix in the page cache and the plain-mmap I/O policy gives identical generated ids and identical first-step logit
//! bits. Models are synthetic, written under target/ (not tmpfs, where O_DIRECT alignment bugs
//! hide).

use std::path::{Path, PathBuf};

use k3_conformance::{RunBits, pack_compressed, run_with, synth_and_pack, trunk_layer_sizes};
use k3_engine::session::MemorySettings;
use k3_engine::stream::io_policy::IoPolicy;

const PROMPT: [u32; 6] = [3, 14, 15, 92, 65, 35];
const N_GEN: usize = 6;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("budgets")
}

fn check(name: &str, spec: &str, seed: u64) {
    let (model, trunk) = synth_and_pack(spec, seed, &dir());
    check_trunk(name, &model, &trunk, false);
}

/// Every budget case on `trunk` (raw, or compressed: the mmap policy is left out).
fn check_trunk(name: &str, model: &Path, trunk: &Path, compressed: bool) {
    let model = model.to_path_buf();
    let trunk = trunk.to_path_buf();
    let base = MemorySettings::default();
    let (want, _, _) = run_with(&model, &base, &PROMPT, N_GEN, 2);
    let sizes = trunk_layer_sizes(&trunk);
    let total: u64 = sizes.iter().map(|s| s.next_multiple_of(4096)).sum();
    let largest = sizes
        .iter()
        .max()
        .copied()
        .expect("layers")
        .next_multiple_of(4096);
    let expert_cache_all = 1u64 << 40;
    let mut cases: Vec<(String, MemorySettings)> = Vec::new();
    let streamed = |budget: u64, ring: usize, cache: Option<u64>| MemorySettings {
        trunk_dir: Some(trunk.clone()),
        trunk_budget_bytes: Some(budget),
        cache_budget_bytes: cache,
        ring_slots: ring,
        ..MemorySettings::default()
    };
    cases.push((
        "0 pinned, ring 2, cache 0".into(),
        streamed(2 * largest, 2, Some(0)),
    ));
    cases.push((
        "0 pinned, ring 1 (sync), no cache budget".into(),
        streamed(largest, 1, None),
    ));
    cases.push((
        "some pinned, ring 2, small cache".into(),
        streamed(total / 2 + 2 * largest, 2, Some(20_000)),
    ));
    cases.push((
        "some pinned, ring 3, cache 1 expert".into(),
        streamed(total / 3 + 3 * largest, 3, Some(1)),
    ));
    cases.push((
        "all pinned, cache everything".into(),
        streamed(total + largest, 2, Some(expert_cache_all)),
    ));
    // Two slots do not fit, but some layer fits beside the one before it: the one slot is
    // widened to a shared ring and the reader reads those layers ahead.
    let al: Vec<u64> = sizes.iter().map(|s| s.next_multiple_of(4096)).collect();
    let pair_min = (0..al.len())
        .map(|i| al[(i + al.len() - 1) % al.len()] + al[i])
        .min()
        .expect("layers");
    let shared_budget = pair_min.max(largest);
    assert!(
        shared_budget < 2 * largest,
        "{name}: layer sizes {al:?} leave no budget between one slot and two"
    );
    cases.push((
        "shared ring (one slot widened), cache 0".into(),
        streamed(shared_budget, 2, Some(0)),
    ));
    let mut ulm = streamed(2 * largest, 2, Some(50_000));
    ulm.ultra_low_memory = true;
    cases.push(("ultra-low-memory".into(), ulm));
    if !compressed {
        let mut mm = streamed(0, 2, Some(30_000));
        mm.io = IoPolicy::mmap();
        cases.push(("mmap I/O policy".into(), mm));
    }
    // The pinned prefix in the page cache (raw trunks; a compressed one keeps buffers).
    for (label, budget, ring) in [
        (
            "page-cache pinned prefix, some pinned, ring 2",
            total / 2 + 2 * largest,
            2,
        ),
        (
            "page-cache pinned prefix, some pinned, ring 1",
            total / 2 + largest,
            1,
        ),
        ("page-cache pinned prefix, all pinned", total + largest, 2),
    ] {
        let mut pc = streamed(budget, ring, Some(20_000));
        pc.io = IoPolicy::page_cache();
        cases.push((label.into(), pc));
    }
    let mut seen_pins = Vec::new();
    for (label, s) in &cases {
        let (got, tstats, estats) = run_with(&model, s, &PROMPT, N_GEN, 2);
        assert_eq!(got, want, "{name}: {label}: output differs from resident");
        if s.ring_slots == 1 {
            assert!(
                !tstats.reader_thread,
                "{name}: {label}: one ring slot must never start the reader thread"
            );
        }
        if s.trunk_dir.is_some()
            && s.io.trunk == k3_engine::stream::io_policy::TrunkIo::Direct
            && s.ring_slots >= 2
            && tstats.pinned_layers < tstats.n_layers
        {
            assert!(
                tstats.reader_thread,
                "{name}: {label}: >= 2 ring slots should prefetch with the reader thread"
            );
        }
        if label.starts_with("shared ring") {
            assert!(
                tstats.shared_ring_bytes > 0 && tstats.ring_slots == 1 && tstats.reader_thread,
                "{name}: {label}: expected a shared ring read ahead by the reader thread: {tstats:?}"
            );
        }
        if label.starts_with("page-cache") {
            assert!(tstats.pinned_layers > 0, "{name}: {label}: {tstats:?}");
            assert_eq!(
                tstats.pinned_page_cache, !compressed,
                "{name}: {label}: {tstats:?}"
            );
        }
        if s.cache_budget_bytes == Some(0) {
            assert_eq!(
                estats.resident_hits, 0,
                "{name}: {label}: a zero cache has no resident hits"
            );
            assert!(estats.misses > 0);
        }
        seen_pins.push(tstats.pinned_layers);
        println!(
            "{name}: {label}: pinned {}/{} ring {} shared {} reader {} | experts req {} hits {} resident {} misses {} evictions {} -> identical",
            tstats.pinned_layers,
            tstats.n_layers,
            tstats.ring_slots,
            tstats.shared_ring_bytes,
            tstats.reader_thread,
            estats.requests,
            estats.hits,
            estats.resident_hits,
            estats.misses,
            estats.evictions
        );
    }
    // the cases really span the budget range
    let n_layers = sizes.len();
    assert!(
        seen_pins.contains(&0),
        "{name}: no case had 0 pinned layers: {seen_pins:?}"
    );
    assert!(
        seen_pins.contains(&n_layers),
        "{name}: no case pinned everything: {seen_pins:?}"
    );
    assert!(
        seen_pins.iter().any(|&p| p > 0 && p < n_layers),
        "{name}: no case pinned some: {seen_pins:?}"
    );
}

/// The same cases on a compressed trunk (`pack-trunk --compress`), packed with 12 KiB chunks
/// so every layer spans several records and ends in a partial one: ids and first-step logit
/// bits equal resident; the page-cache policy refuses it by name.
#[test]
fn identical_output_from_a_compressed_trunk_odd9() {
    let (model, _) = synth_and_pack("odd9", 3, &dir());
    // The codec in the name: a cached pack of an older format is not reused.
    let trunk = pack_compressed(
        &model,
        12 << 10,
        &dir().join(format!(
            "odd9-s3-trunk-{}-c12k",
            k3_engine::stream::compress::CODEC
        )),
    );
    let j: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(trunk.join("trunk.json")).expect("trunk.json"),
    )
    .expect("JSON");
    let records: usize = j["layers"]
        .as_array()
        .expect("layers")
        .iter()
        .map(|l| l["stored"]["chunks"].as_array().expect("chunks").len())
        .sum();
    assert!(
        records > 2 * j["n_layers"].as_u64().expect("n") as usize,
        "{records} records"
    );
    check_trunk("odd9 compressed", &model, &trunk, true);

    let (spec, _ck) = k3_conformance::open_model(&model);
    let err = k3_engine::stream::trunk::MmapTrunk::open(&trunk, &spec)
        .map(|_| ())
        .expect_err("a compressed trunk cannot be mapped");
    assert!(
        err.to_string().contains("compressed")
            && err.to_string().contains(&trunk.display().to_string()),
        "{err}"
    );
}

#[test]
fn identical_output_at_every_budget_tiny() {
    check("tiny", "tiny", 1);
}

#[test]
fn identical_output_at_every_budget_odd9() {
    check("odd9", "odd9", 9);
}

/// Baseline sanity: the comparison above is not vacuous (a different seed gives other bits).
#[test]
fn different_model_gives_different_bits() {
    let (a, _) = synth_and_pack("tiny", 1, &dir());
    let (b, _) = synth_and_pack("tiny", 2, &dir());
    let (ra, _, _) = run_with(&a, &MemorySettings::default(), &PROMPT, 3, 1);
    let (rb, _, _) = run_with(&b, &MemorySettings::default(), &PROMPT, 3, 1);
    assert_ne!(ra.first_logits_hash, rb.first_logits_hash);
    let _: RunBits = ra;
}

/// A cache budget larger than every expert of the model is planned at what the cache can use
/// (its capacity), not at the budget: otherwise `--preset workstation` (30 GB of cache) on a
/// small model is refused by the up-front state check although it fits.
#[test]
fn cache_budget_above_the_model_is_planned_at_its_capacity() {
    let (model, _) = synth_and_pack("tiny", 1, &dir());
    let (spec, ckpt) = k3_conformance::open_model(&model);
    let plan = k3_engine::plan::Plan::new(&spec, 8);
    let planned = |cache: u64| {
        let m = MemorySettings {
            cache_budget_bytes: Some(cache),
            ..MemorySettings::default()
        };
        k3_engine::session::build(&spec, &ckpt, &plan, &m)
            .expect("providers build")
            .planned_bytes
    };
    let huge = 1u64 << 40;
    let all_experts = planned(huge);
    assert!(
        all_experts < 1 << 30,
        "a 1 TB budget on a tiny model planned {all_experts} bytes"
    );
    assert_eq!(
        planned(huge / 2),
        all_experts,
        "any budget above the model plans the same"
    );
    assert!(
        planned(0) < all_experts,
        "a budget of 0 plans no cache bytes"
    );
}

/// A memory-mapped embedding is planned at the rows a request reads, not at the whole
/// table (a run reads one row per token through the map): the session plans lm_head and the
/// final norms whole and leaves the embedding to the per-request check. An arena holds the
/// whole table (planned whole); `--ultra-low-memory` streams it (its lm_head chunk buffer is
/// planned instead).
#[test]
fn mapped_embedding_is_planned_per_request_not_whole() {
    let (model, trunk) = synth_and_pack("tiny", 1, &dir());
    let (spec, ckpt) = k3_conformance::open_model(&model);
    let plan = k3_engine::plan::Plan::new(&spec, 8);
    assert!(plan.embed_bytes > 0 && plan.embed_bytes < plan.global_bytes);
    let mapped = k3_engine::session::build(&spec, &ckpt, &plan, &MemorySettings::default())
        .expect("resident, mapped");
    assert!(mapped.mapped_embedding);
    // trunk and experts mapped (not planned); lm_head + norms planned; the embedding not
    assert_eq!(mapped.planned_bytes, plan.global_bytes - plan.embed_bytes);
    let line = k3_engine::session::check_states(&plan, 8, 1, mapped.planned_bytes, true, None)
        .expect("no limit");
    assert!(line.contains("embedding rows through the map"), "{line}");
    let ultra = MemorySettings {
        trunk_dir: Some(trunk.clone()),
        ultra_low_memory: true,
        ..MemorySettings::default()
    };
    let u = k3_engine::session::build(&spec, &ckpt, &plan, &ultra).expect("ultra");
    assert!(!u.mapped_embedding);
    let streamed_trunk = MemorySettings {
        trunk_dir: Some(trunk),
        ..MemorySettings::default()
    };
    let t = k3_engine::session::build(&spec, &ckpt, &plan, &streamed_trunk).expect("trunk");
    // the same trunk plan; ultra holds a chunk buffer instead of lm_head
    let lm_head_and_norms = plan.global_bytes - plan.embed_bytes;
    assert!(u.planned_bytes > t.planned_bytes - lm_head_and_norms);
}

/// The kernel workers spin between dispatches only when no trunk layer is read per token
/// (resident trunk, or every layer pinned; experts resident or streamed); with ring slots they
/// sleep, leaving the CPUs to the trunk's reader threads. The bits never depend on it: `check`
/// above runs every budget through `run_with`, which configures the pool this way.
#[test]
fn kernel_workers_spin_only_when_the_trunk_is_in_ram() {
    use k3_kernels::par::DEFAULT_SPIN;
    use std::time::Duration;
    let (model, trunk) = synth_and_pack("tiny", 1, &dir());
    let (spec, ckpt) = k3_conformance::open_model(&model);
    let plan = k3_engine::plan::Plan::new(&spec, 8);
    let total: u64 = trunk_layer_sizes(&trunk)
        .iter()
        .map(|s| s.next_multiple_of(4096))
        .sum();
    let spin = |m: MemorySettings| {
        let session = k3_engine::session::build(&spec, &ckpt, &plan, &m).expect("providers build");
        let pool = k3_kernels::Pool::new(2);
        pool.set_spin(Duration::from_micros(7));
        let line = session
            .configure_pool(&pool)
            .expect("a 2-thread pool gets a line");
        assert_eq!(session.kernel_spin(), pool.spin(), "{line}");
        assert!(
            session.configure_pool(&k3_kernels::Pool::new(1)).is_none(),
            "a one-thread pool has no workers to configure"
        );
        pool.spin()
    };
    let pinned = |cache: Option<u64>| MemorySettings {
        trunk_dir: Some(trunk.clone()),
        trunk_budget_bytes: Some(total),
        cache_budget_bytes: cache,
        ..MemorySettings::default()
    };
    assert_eq!(spin(MemorySettings::default()), DEFAULT_SPIN, "resident");
    assert_eq!(spin(pinned(None)), DEFAULT_SPIN, "every layer pinned");
    assert_eq!(
        spin(pinned(Some(1 << 20))),
        DEFAULT_SPIN,
        "pinned, experts streamed"
    );
    for cache in [None, Some(1 << 20)] {
        let ring = MemorySettings {
            trunk_budget_bytes: Some(total / 4),
            ..pinned(cache)
        };
        assert_eq!(spin(ring), Duration::ZERO, "ring slots, cache {cache:?}");
    }
}
