//! The streamed trunk at several budgets serves exactly the checkpoint's bytes; one ring slot
//! never starts the reader thread; two slots start exactly one.

mod stream_support;

use k3_engine::checkpoint::Checkpoint;
use k3_engine::stream::aligned::align_up;
use k3_engine::stream::pack::{TrunkManifest, pack_trunk};
use k3_engine::stream::trunk::{MmapTrunk, PINNED_LOAD_DEPTH, StreamedTrunk, TrunkOptions};
use k3_engine::weights::TrunkSource;
use k3_models::spec::ModelSpec;
use stream_support::*;

/// Ask for `layers` in this order and compare every tensor with the checkpoint.
fn check_layers(t: &mut dyn TrunkSource, ck: &Checkpoint, layers: &[usize]) {
    for &l in layers {
        let lw = t.layer(l).expect("layer");
        for tb in &lw.tensors {
            assert!(
                tb.bytes == ck.try_bytes(&tb.decl.name).expect("tensor"),
                "layer {l}"
            );
        }
    }
}

struct Fixture {
    _dir: std::path::PathBuf,
    model: std::path::PathBuf,
    trunk: std::path::PathBuf,
    spec: ModelSpec,
    sizes: Vec<u64>,
}

impl Fixture {
    /// The largest (4096-rounded) layer from layer `k` on: one ring slot for layers `k..`.
    fn max_from(&self, k: usize) -> u64 {
        self.sizes[k..].iter().copied().max().unwrap_or(0)
    }

    /// Bytes of the first `k` (4096-rounded) layers: a pinned prefix of `k` layers.
    fn prefix(&self, k: usize) -> u64 {
        self.sizes[..k].iter().sum()
    }

    /// (what, budget, ring slots) with a pinned prefix: all layers, and 4 beside 2 and 1 slots.
    fn pinned_cases(&self) -> [(&'static str, u64, usize); 3] {
        let n = self.sizes.len();
        [
            ("all pinned", self.prefix(n), 2),
            (
                "some pinned, 2 slots",
                self.prefix(4) + 2 * self.max_from(4),
                2,
            ),
            ("some pinned, 1 slot", self.prefix(4) + self.max_from(4), 1),
        ]
    }
}

fn fixture(name: &str) -> Fixture {
    let dir = test_dir(name);
    let (model, spec) = synth_tiny(&dir, 11);
    let trunk = dir.join("trunk");
    pack_trunk(&model, &spec, &trunk, false).expect("pack");
    let sizes = TrunkManifest::load(&trunk, &spec)
        .expect("manifest")
        .layer_sizes()
        .iter()
        .map(|&s| align_up(s, 4096))
        .collect();
    Fixture {
        _dir: dir,
        model,
        trunk,
        spec,
        sizes,
    }
}

fn opts(budget: u64, ring: usize) -> TrunkOptions {
    TrunkOptions {
        budget_bytes: budget,
        ring_slots: ring,
        o_direct: true,
        read_threads: 4,
        preload_pinned: true,
        background_pinned: false,
        active_layers: None,
        // as the default I/O policy: the reserved pool when the system has one
        pages: k3_engine::stream::aligned::PageSource::ReservedFirst,
        pinned_page_cache: false,
    }
}

/// Drop trunk.bin's pages from the page cache (written back first, so they are clean).
fn evict(trunk: &std::path::Path) {
    use k3_engine::platform::{FileAdvice, advise_file};
    let f = std::fs::File::open(trunk.join("trunk.bin")).expect("trunk.bin");
    f.sync_all().expect("sync");
    // Drops only clean cached pages (Linux posix_fadvise; the tests run on Linux).
    advise_file(&f, FileAdvice::DontNeed { offset: 0, len: 0 }).expect("posix_fadvise(DONTNEED)");
}

#[test]
fn one_slot_reads_synchronously_without_a_reader_thread() {
    let f = fixture("trunk_one_slot");
    let ck = open_ckpt(&f.model, &f.spec);
    let largest = *f.sizes.iter().max().expect("layers");
    // Two slots of the largest layer do not fit: the plan falls back to one slot.
    let mut t = StreamedTrunk::open(&f.trunk, &f.spec, &opts(largest + 4096, 2)).expect("open");
    let p = t.plan().clone();
    assert_eq!(p.ring_slots, 1);
    check_passes(&mut t, &f.spec, &ck, 3);
    assert_eq!(
        t.reader_threads_spawned(),
        0,
        "one slot must never start a reader thread"
    );
    let s = t.stats();
    assert!(!s.reader_thread);
    assert_eq!(s.ring_slots, 1);
    assert!(s.bytes_read > 0);
    let lines = t.startup_lines().join("\n");
    assert!(lines.contains("ONE slot, synchronous"), "{lines}");
    assert!(lines.contains("no reader thread"), "{lines}");
    assert!(lines.contains("deterministic hit rate"), "{lines}");
    assert!(
        lines.contains("reads use O_DIRECT (page cache bypassed)") || lines.contains("buffered"),
        "{lines}"
    );
}

#[test]
fn two_slots_prefetch_with_one_reader_thread_at_several_budgets() {
    let f = fixture("trunk_budgets");
    let ck = open_ckpt(&f.model, &f.spec);
    let n = f.sizes.len();
    let (max_from, prefix) = (|k| f.max_from(k), |k| f.prefix(k));
    let total = prefix(n);
    let cases = [
        ("0 pinned, 2 slots", 2 * max_from(0), 0usize),
        ("some pinned, 2 slots", prefix(4) + 2 * max_from(4), 4),
        ("all pinned", total, n),
    ];
    for (what, budget, min_pinned) in cases {
        let mut t = StreamedTrunk::open(&f.trunk, &f.spec, &opts(budget, 2)).expect("open");
        let p = t.plan().clone();
        assert!(p.pinned_layers >= min_pinned, "{what}: {p:?}");
        assert!(p.planned_bytes() <= budget, "{what}");
        check_passes(&mut t, &f.spec, &ck, 3);
        let s = t.stats();
        if p.pinned_layers < n {
            assert_eq!(p.ring_slots, 2, "{what}");
            assert_eq!(t.reader_threads_spawned(), 1, "{what}");
            assert!(s.reader_thread);
        } else {
            assert_eq!(p.ring_slots, 0, "{what}");
            assert_eq!(t.reader_threads_spawned(), 0, "{what}");
        }
        assert_eq!(t.out_of_order_requests(), 0, "{what}");
        assert_eq!(s.pinned_layers, p.pinned_layers);
        assert!(s.wait_seconds <= s.read_seconds + 1.0);
        if p.pinned_layers > 0 {
            // the prefix loads at queue depth 16 although the trunk's pool has 4 threads
            let lines = t.startup_lines().join("\n");
            assert!(
                lines.contains(&format!("queue depth {PINNED_LOAD_DEPTH})")),
                "{what}: {lines}"
            );
        }
    }
}

/// The smallest sum of two cyclic neighbours' sizes: the budget of a shared ring that reads
/// at least one layer ahead.
fn smallest_neighbour_pair(sizes: &[u64]) -> u64 {
    (0..sizes.len())
        .map(|i| sizes[(i + sizes.len() - 1) % sizes.len()] + sizes[i])
        .min()
        .expect("layers")
}

#[test]
fn shared_ring_reads_ahead_exactly_where_two_layers_fit() {
    let f = fixture("trunk_shared_ring");
    let ck = open_ckpt(&f.model, &f.spec);
    let largest = *f.sizes.iter().max().expect("layers");
    // Budgets between one slot and two: the smallest neighbour pair, and the largest layer
    // plus the smallest one (more pairs fit).
    let smallest = *f.sizes.iter().min().expect("layers");
    let budgets = [smallest_neighbour_pair(&f.sizes), largest + smallest];
    let mut ahead_counts = Vec::new();
    for budget in budgets {
        assert!(budget >= largest && budget < 2 * largest, "{:?}", f.sizes);
        let mut t = StreamedTrunk::open(&f.trunk, &f.spec, &opts(budget, 2)).expect("open");
        let p = t.plan().clone();
        assert_eq!((p.pinned_layers, p.ring_slots), (0, 1), "budget {budget}");
        assert!(p.planned_bytes() <= budget);
        // The plan's count, by its rule: a layer fits beside the layer before it; the ring is
        // the largest layer or the widest neighbour pair that fits.
        let n = f.sizes.len();
        let pairs: Vec<u64> = (0..n)
            .map(|i| f.sizes[(i + n - 1) % n] + f.sizes[i])
            .collect();
        let want = pairs.iter().filter(|&&p| p <= budget).count();
        let widest = pairs.iter().copied().filter(|&p| p <= budget).max();
        assert_eq!(
            p.shared_ring_bytes,
            largest.max(widest.expect("a pair fits"))
        );
        assert_eq!(p.read_ahead_layers, want);
        assert!(want >= 1 && want < n);
        check_passes(&mut t, &f.spec, &ck, 1);
        let after_one = t.reads_issued_ahead();
        check_passes(&mut t, &f.spec, &ck, 3);
        assert_eq!(
            t.reads_issued_ahead() - after_one,
            3 * want as u64,
            "budget {budget}: reads ahead per pass"
        );
        assert_eq!(t.reader_threads_spawned(), 1);
        let s = t.stats();
        assert!(s.reader_thread);
        assert_eq!(s.shared_ring_bytes, p.shared_ring_bytes);
        // Four passes, each layer once (the spans are rounded to the device's block size, and
        // the next pass's first read may still be in flight).
        let pass: u64 = f.sizes.iter().sum();
        assert!(
            s.bytes_read > 3 * pass && s.bytes_read <= 4 * pass,
            "{} bytes read in 4 passes of {pass}",
            s.bytes_read
        );
        let lines = t.startup_lines().join("\n");
        assert!(lines.contains("ONE SHARED ring"), "{lines}");
        assert!(lines.contains("shared ring's free end"), "{lines}");
        // Out of the cyclic order: drained and restarted, still the right bytes.
        check_layers(&mut t, &ck, &[5, 2, 9, 9, 12, 0, 7, 8]);
        assert!(t.out_of_order_requests() > 0);
        check_passes(&mut t, &f.spec, &ck, 1);
        ahead_counts.push(want);
    }
    assert!(ahead_counts[1] > ahead_counts[0], "{ahead_counts:?}");
}

#[test]
fn two_slots_read_every_streamed_layer_ahead() {
    let f = fixture("trunk_two_slots_ahead");
    let ck = open_ckpt(&f.model, &f.spec);
    let largest = *f.sizes.iter().max().expect("layers");
    let budget = f.sizes[0] + f.sizes[1] + 2 * largest;
    let mut t = StreamedTrunk::open(&f.trunk, &f.spec, &opts(budget, 2)).expect("open");
    let p = t.plan().clone();
    assert_eq!(p.ring_slots, 2);
    assert_eq!(p.shared_ring_bytes, 0);
    assert_eq!(p.read_ahead_layers, f.sizes.len() - p.pinned_layers);
    check_passes(&mut t, &f.spec, &ck, 1);
    let after_one = t.reads_issued_ahead();
    check_passes(&mut t, &f.spec, &ck, 2);
    assert_eq!(
        t.reads_issued_ahead() - after_one,
        2 * p.read_ahead_layers as u64
    );
}

#[test]
fn three_slots_and_out_of_order_requests_still_serve_the_right_bytes() {
    let f = fixture("trunk_out_of_order");
    let ck = open_ckpt(&f.model, &f.spec);
    let budget = 3 * f.sizes.iter().max().expect("layers");
    let mut t = StreamedTrunk::open(&f.trunk, &f.spec, &opts(budget, 3)).expect("open");
    assert_eq!(t.plan().ring_slots, 3);
    check_layers(&mut t, &ck, &[5, 2, 9, 9, 12, 0, 7]);
    assert!(t.out_of_order_requests() > 0);
    check_passes(&mut t, &f.spec, &ck, 2);
    assert!(
        t.layer(f.spec.n_layers).is_err(),
        "out of range layer is an error"
    );
}

/// The pinned prefix loaded on background threads (the runs' default): every layer, asked in
/// any order while the load runs, is the checkpoint's bytes; the disk bytes equal a load in
/// `open`; a trunk dropped mid-load stops it.
#[test]
fn background_pinned_load_serves_the_same_bytes() {
    let f = fixture("trunk_background");
    let ck = open_ckpt(&f.model, &f.spec);
    let n = f.sizes.len();
    for (what, budget, ring) in f.pinned_cases() {
        let mut read = Vec::new();
        for background in [false, true] {
            let mut o = opts(budget, ring);
            o.background_pinned = background;
            let mut t = StreamedTrunk::open(&f.trunk, &f.spec, &o).expect("open");
            let pinned = t.plan().pinned_layers;
            assert!(pinned >= 4, "{what}: {:?}", t.plan());
            assert_eq!(t.pinned_in_background(), background, "{what}");
            let lines = t.startup_lines().join("\n");
            assert_eq!(
                lines.contains("loading in the background"),
                background,
                "{what}: {lines}"
            );
            // The last pinned layer first, then the rest backwards, then cyclic passes.
            let backwards: Vec<usize> = (0..pinned).rev().collect();
            check_layers(&mut t, &ck, &backwards);
            check_passes(&mut t, &f.spec, &ck, 2);
            let s = t.stats();
            assert_eq!(s.pinned_background, background, "{what}");
            assert!(s.pinned_load_seconds > 0.0, "{what}: {s:?}");
            assert!(s.pinned_wait_seconds <= s.wait_seconds, "{what}: {s:?}");
            read.push(s.bytes_read);
        }
        assert_eq!(
            read[0], read[1],
            "{what}: disk bytes, in open vs in the background"
        );
    }
    for _ in 0..3 {
        let mut o = opts(f.prefix(n), 2);
        o.background_pinned = true;
        let t = StreamedTrunk::open(&f.trunk, &f.spec, &o).expect("open");
        drop(t);
    }
}

/// The I/O policy's `pinned = "page-cache"`: the pinned layers are trunk.bin's page-cache
/// pages, mapped read-only. At every budget, loaded in `open`, in the background or on first
/// use, every layer asked in any order is the checkpoint's bytes; the disk bytes are the
/// pinned layers' pages that were not cached (all of them after an eviction, none while
/// another trunk holds them); the ring still reads with O_DIRECT.
#[test]
fn page_cache_pinned_prefix_serves_the_same_bytes() {
    let f = fixture("trunk_page_cache");
    let ck = open_ckpt(&f.model, &f.spec);
    let n = f.sizes.len();
    let mut cases = f.pinned_cases().to_vec();
    cases.push(("none pinned, 2 slots", 2 * f.max_from(0), 2));
    for (what, budget, ring) in cases {
        for (how, background, preload) in [
            ("in open", false, true),
            ("in the background", true, true),
            ("on first use", false, false),
        ] {
            evict(&f.trunk);
            let mut o = opts(budget, ring);
            o.pinned_page_cache = true;
            o.background_pinned = background;
            o.preload_pinned = preload;
            let mut t = StreamedTrunk::open(&f.trunk, &f.spec, &o).expect("open");
            let pinned = t.plan().pinned_layers;
            let lines = t.startup_lines().join("\n");
            assert_eq!(
                lines.contains("the pinned prefix is trunk.bin's own page cache"),
                pinned > 0,
                "{what}, {how}: {lines}"
            );
            // The last pinned layer first, then the rest backwards, then cyclic passes.
            let backwards: Vec<usize> = (0..pinned).rev().collect();
            check_layers(&mut t, &ck, &backwards);
            let s = t.stats();
            assert_eq!(s.pinned_page_cache, pinned > 0, "{what}, {how}");
            // The eviction may leave a few pages (the kernel skips pages it has in per-CPU
            // batches): at least 90% and never more than the pinned layers' pages.
            // The pinned layers' pages (they start 4096-aligned in the pack).
            let want = f.prefix(pinned);
            assert!(
                s.bytes_read <= want && s.bytes_read * 10 >= want * 9,
                "{what}, {how}: disk bytes {} for {want} bytes of pinned pages after an eviction",
                s.bytes_read
            );
            assert_eq!(
                s.pinned_lock_error.is_some(),
                s.pinned_unlocked_bytes > 0,
                "{what}, {how}: {s:?}"
            );
            check_passes(&mut t, &f.spec, &ck, 2);
            if pinned > 0 {
                // A second trunk while this one holds the pages reads none of them.
                let mut o2 = opts(budget, ring);
                o2.pinned_page_cache = true;
                let mut t2 = StreamedTrunk::open(&f.trunk, &f.spec, &o2).expect("open again");
                assert_eq!(t2.stats().bytes_read, 0, "{what}, {how}: cached prefix");
                check_passes(&mut t2, &f.spec, &ck, 1);
            }
            if pinned < n {
                assert!(
                    t.stats().bytes_read > s.bytes_read,
                    "{what}, {how}: the ring reads"
                );
            }
        }
    }
}

#[test]
fn lazy_pinned_load_and_partial_layers() {
    let f = fixture("trunk_lazy");
    let ck = open_ckpt(&f.model, &f.spec);
    let mut o = opts(f.sizes.iter().sum::<u64>(), 2);
    o.preload_pinned = false;
    o.active_layers = Some(6);
    let mut t = StreamedTrunk::open(&f.trunk, &f.spec, &o).expect("open");
    assert_eq!(t.plan().n_layers, 6);
    assert_eq!(t.plan().pinned_layers, 6);
    assert_eq!(t.stats().bytes_read, 0, "nothing read before first use");
    for l in 0..6 {
        let lw = t.layer(l).expect("layer");
        for tb in &lw.tensors {
            assert!(tb.bytes == ck.try_bytes(&tb.decl.name).expect("tensor"));
        }
    }
    assert!(t.layer(6).is_err(), "layers past --layers are not served");
}

#[test]
fn budget_below_the_largest_layer_is_refused_with_numbers() {
    let f = fixture("trunk_too_small");
    let largest = *f.sizes.iter().max().expect("layers");
    let e =
        StreamedTrunk::open(&f.trunk, &f.spec, &opts(largest - 4096, 2)).expect_err("too small");
    let msg = e.to_string();
    assert!(msg.contains("cannot fit even one ring slot"), "{msg}");
    assert!(msg.contains(&largest.to_string()), "{msg}");
}

#[test]
fn the_pack_report_names_the_smallest_budget_that_streams() {
    let dir = test_dir("trunk_min_slot");
    let (model, spec) = synth_tiny(&dir, 13);
    let trunk = dir.join("trunk");
    let r = pack_trunk(&model, &spec, &trunk, false).expect("pack");
    assert!(r.min_slot_bytes >= r.largest_layer_bytes && r.min_slot_bytes.is_multiple_of(4096));
    assert!(
        r.summary().contains(&r.min_slot_bytes.to_string()),
        "{}",
        r.summary()
    );
    // Exactly that budget opens (one slot); one byte less is refused.
    let t = StreamedTrunk::open(&trunk, &spec, &opts(r.min_slot_bytes, 2)).expect("min budget");
    assert_eq!(t.plan().ring_slots, 1, "{:?}", t.plan());
    drop(t);
    StreamedTrunk::open(&trunk, &spec, &opts(r.min_slot_bytes - 1, 2)).expect_err("one byte less");
}

#[test]
fn mmap_policy_serves_the_same_bytes() {
    let f = fixture("trunk_mmap");
    let ck = open_ckpt(&f.model, &f.spec);
    let mut t = MmapTrunk::open(&f.trunk, &f.spec).expect("open");
    check_passes(&mut t, &f.spec, &ck, 2);
    let s = t.stats();
    assert!(!s.o_direct && !s.reader_thread);
    assert_eq!(s.pinned_layers, 0);
    assert!(t.startup_lines()[0].contains("page cache"));
}

#[test]
fn io_uring_pool_serves_the_same_bytes() {
    use k3_engine::stream::direct::ReadPool;
    let f = fixture("trunk_uring");
    let ck = open_ckpt(&f.model, &f.spec);
    let n = f.sizes.len();
    let (max_from, prefix) = (|k| f.max_from(k), |k| f.prefix(k));
    for ring in [1usize, 2] {
        let budget = prefix(3) + ring as u64 * max_from(3);
        let pool = ReadPool::with_io_uring(4).expect("pool");
        let mut t = StreamedTrunk::open_with_pool(&f.trunk, &f.spec, &opts(budget, ring), pool)
            .expect("open");
        assert!(t.plan().pinned_layers >= 3 && t.plan().pinned_layers < n);
        check_passes(&mut t, &f.spec, &ck, 2);
        let lines = t.startup_lines().join("\n");
        assert!(
            lines.contains("io_uring") || lines.contains("buffered"),
            "{lines}"
        );
    }
}
