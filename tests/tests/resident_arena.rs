//! The resident arena (checkpoint tensors loaded into 2 MiB-page anonymous memory) against the
//! checkpoint's memory maps: the same bytes at the same alignment, and identical generated ids
//! and logit bits at every step (docs/NUMERICS.md §1: where the bytes live never changes a bit).
//! Models are synthetic, written under target/ (not tmpfs, where O_DIRECT alignment bugs hide).

use std::path::PathBuf;

use k3_conformance::{open_model, synth_and_pack};
use k3_engine::arena::{Arena, ArenaOptions};
use k3_engine::exec::{Executor, SeqState};
use k3_engine::plan::Plan;
use k3_engine::resident::ResidentMode;
use k3_engine::session::{MemorySettings, build_with};
use k3_engine::stream::io_policy::IoPolicy;

const PROMPT: [u32; 5] = [3, 14, 15, 92, 65];
const N_GEN: usize = 6;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("resident_arena")
}

fn argmax(x: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, v) in x.iter().enumerate() {
        if *v > x[best] {
            best = i;
        }
    }
    best as u32
}

#[test]
fn arena_holds_the_checkpoint_bytes_at_the_same_alignment() {
    let (model, _) = synth_and_pack("tiny", 11, &dir());
    let (spec, ckpt) = open_model(&model);
    let decls: Vec<_> = spec.tensors.iter().collect();
    for opts in [
        ArenaOptions {
            progress: false,
            ..ArenaOptions::default()
        },
        // buffered reads, 4 KiB pages, one reader
        ArenaOptions {
            o_direct: false,
            huge_pages: false,
            read_threads: 1,
            progress: false,
            ..ArenaOptions::default()
        },
        // the reserved huge-page pool when the system has one (else as the first)
        ArenaOptions {
            pages: k3_engine::stream::aligned::PageSource::ReservedFirst,
            progress: false,
            ..ArenaOptions::default()
        },
    ] {
        let a = Arena::load(&ckpt, &decls, &opts).expect("load arena");
        assert_eq!(a.len(), decls.len());
        let mut total = 0u64;
        for (i, d) in decls.iter().enumerate() {
            let want = ckpt.bytes(d);
            let got = a.bytes(i);
            assert_eq!(got, want, "{} ({opts:?})", d.name);
            assert_eq!(
                got.as_ptr() as usize % 4096,
                want.as_ptr() as usize % 4096,
                "{}: alignment differs from the mmap's",
                d.name
            );
            total += want.len() as u64;
        }
        let s = a.stats();
        assert_eq!(s.tensor_bytes, total);
        assert!(s.arena_bytes >= total && s.bytes_read >= total, "{s:?}");
        if opts.o_direct && s.fallback.is_none() {
            assert!(s.o_direct, "{s:?}");
        }
        if !opts.o_direct {
            assert!(!s.o_direct && !s.huge_pages, "{s:?}");
        }
        assert!(
            a.startup_line()
                .contains(&format!("{} tensors", decls.len()))
        );
    }
}

#[test]
fn a_tensor_missing_from_the_checkpoint_is_named() {
    let (model, _) = synth_and_pack("tiny", 11, &dir());
    let (spec, ckpt) = open_model(&model);
    let mut bogus = spec.tensors[0].clone();
    bogus.name = "language_model.model.no_such_tensor.weight".into();
    let decls = vec![&spec.tensors[1], &bogus];
    let e = Arena::load(&ckpt, &decls, &ArenaOptions::default()).expect_err("missing tensor");
    assert!(e.to_string().contains("no_such_tensor"), "{e}");
}

#[test]
fn arena_and_mmap_give_identical_ids_and_logit_bits_every_step() {
    let (model, _) = synth_and_pack("tiny", 11, &dir());
    let (spec, ckpt) = open_model(&model);
    let n = PROMPT.len() + N_GEN;
    let plan = Plan::new(&spec, n);
    let m = MemorySettings::default();
    let mut mapped = build_with(&spec, &ckpt, &plan, &m, ResidentMode::Mmap).expect("mmap");
    let mut arena = build_with(&spec, &ckpt, &plan, &m, ResidentMode::Arena).expect("arena");
    assert!(
        mapped.startup.iter().any(|l| l.contains("memory-mapped")),
        "{:?}",
        mapped.startup
    );
    assert!(
        arena
            .startup
            .iter()
            .any(|l| l.starts_with("resident weights:")),
        "{:?}",
        arena.startup
    );
    if arena.arena_hugetlb_bytes == 0 {
        assert!(
            arena.planned_bytes > mapped.planned_bytes,
            "the arena is counted in the plan"
        );
    } else {
        // on the reserved huge-page pool (vm.nr_hugepages): outside the memory limit the
        // plan is checked against, so not planned against it; said at start-up instead
        assert!(arena.planned_bytes <= mapped.planned_bytes);
        assert!(arena.planned_bytes + arena.arena_hugetlb_bytes > mapped.planned_bytes);
        assert!(
            arena.startup.iter().any(|l| l.contains("reserved")),
            "{:?}",
            arena.startup
        );
    }
    assert!(arena.resident_load_seconds > 0.0 && mapped.resident_load_seconds == 0.0);
    for threads in [1, 2] {
        let mut exec = Executor::new(&spec, plan.clone(), threads);
        let (mut sa, mut sb) = (SeqState::new(&spec), SeqState::new(&spec));
        let (mut la, mut lb) = (vec![0f32; spec.vocab_size], vec![0f32; spec.vocab_size]);
        let (mut ids_a, mut ids_b) = (Vec::new(), Vec::new());
        let (mut ta, mut tb) = (PROMPT[0], PROMPT[0]);
        for step in 0..n - 1 {
            exec.step(ta, &mut sa, &mut mapped.providers, &mut la)
                .expect("mmap step");
            exec.step(tb, &mut sb, &mut arena.providers, &mut lb)
                .expect("arena step");
            let differ = la
                .iter()
                .zip(&lb)
                .position(|(a, b)| a.to_bits() != b.to_bits());
            assert_eq!(
                differ, None,
                "logit bits differ at step {step}, {threads} threads"
            );
            if step + 1 < PROMPT.len() {
                (ta, tb) = (PROMPT[step + 1], PROMPT[step + 1]);
            } else {
                (ta, tb) = (argmax(&la), argmax(&lb));
                ids_a.push(ta);
                ids_b.push(tb);
            }
        }
        assert_eq!(ids_a, ids_b, "{threads} threads");
        assert_eq!(ids_a.len(), N_GEN);
    }
    let (ea, eb) = (
        mapped.providers.experts.stats(),
        arena.providers.experts.stats(),
    );
    assert!(
        ea.requests > 0 && ea.requests == eb.requests,
        "{ea:?} {eb:?}"
    );
}

#[test]
fn the_mmap_io_policy_keeps_resident_weights_mapped() {
    let (model, _) = synth_and_pack("tiny", 11, &dir());
    let (spec, ckpt) = open_model(&model);
    let plan = Plan::new(&spec, 4);
    let m = MemorySettings {
        io: IoPolicy::mmap(),
        ..MemorySettings::default()
    };
    let s = build_with(&spec, &ckpt, &plan, &m, ResidentMode::Arena).expect("build");
    // no arena loaded, and the arena asked for is said not to be used
    assert_eq!(s.resident_load_seconds, 0.0);
    let resident: Vec<&String> = s
        .startup
        .iter()
        .filter(|l| l.starts_with("resident weights:"))
        .collect();
    assert!(
        resident.len() == 1
            && resident[0].contains("--resident arena (or K3_RESIDENT=arena) is not used"),
        "{:?}",
        s.startup
    );
    assert!(s.startup.iter().any(|l| l.contains("memory-mapped")));
}

#[test]
fn an_undeclared_expert_is_an_error_naming_it() {
    let (model, _) = synth_and_pack("tiny", 11, &dir());
    let (spec, ckpt) = open_model(&model);
    let layer = spec
        .tensors
        .iter()
        .find_map(|t| t.expert.and(t.layer))
        .expect("tiny has routed experts");
    for mode in [ResidentMode::Mmap, ResidentMode::Arena] {
        let plan = Plan::new(&spec, 4);
        let mut s =
            build_with(&spec, &ckpt, &plan, &MemorySettings::default(), mode).expect("build");
        let e = s
            .providers
            .experts
            .experts(layer, &[9999])
            .expect_err("no expert 9999");
        assert!(e.to_string().contains("9999"), "{e}");
        let ok = s.providers.experts.experts(layer, &[0, 1]).expect("0, 1");
        assert_eq!(ok.iter().map(|w| w.expert).collect::<Vec<_>>(), [0, 1]);
        assert!(
            ok.iter()
                .all(|w| !w.w1_packed.is_empty() && !w.w2_scale.is_empty())
        );
    }
}
