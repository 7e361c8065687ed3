//! One insta snapshot per run config in `configs/*.toml` locks the generated ids and a hash of
//! the first-step logit bits; every config (all presets, both I/O policies, resident) must
//! match the SAME expected snapshot, which is the proof that budgets do not change output
//! (docs/NUMERICS.md §1).
//!
//! The presets' budgets are sized for real K3 (108.81 GB trunk, 1447 GB routed experts); on the
//! small synthetic model they are scaled by the same proportion, so "laptop" pins about the
//! same fraction of layers and caches about the same fraction of experts as on real K3 (never
//! less than one ring slot).

use std::path::{Path, PathBuf};

use k3_conformance::{repo_root, run_with, synth_and_pack};
use k3_run::session::MemorySettings;
use k3_run::stream::{io_policy, presets};

const REAL_K3_TRUNK_BYTES: f64 = 108.81e9;
const REAL_K3_EXPERT_BYTES: f64 = 1447.0e9;

fn run_configs() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(repo_root().join("configs"))
        .expect("configs/ exists")
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    v.sort();
    v
}

fn model_bytes(model: &Path) -> (u64, u64, u64) {
    let (spec, _) = k3_conformance::open_model(model);
    let plan = k3_run::plan::Plan::new(&spec, 16);
    let largest = plan
        .layers
        .iter()
        .map(|l| l.trunk_bytes.next_multiple_of(4096))
        .max()
        .expect("layers");
    (plan.trunk_bytes(), plan.expert_bytes(), largest)
}

#[test]
fn every_run_config_gives_the_same_snapshot() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("run_configs");
    let (model, trunk) = synth_and_pack("tiny", 1, &dir);
    let (trunk_bytes, expert_bytes, largest) = model_bytes(&model);
    let configs = run_configs();
    assert!(
        configs.len() >= 7,
        "expected the six presets + mmap + resident run configs, found {configs:?}"
    );
    for path in &configs {
        let rc = k3_run::runconfig::layer(Some(path), Default::default())
            .unwrap_or_else(|e| panic!("{e}"))
            .settings;
        let io = io_policy::load_io_policy(rc.io.as_deref().unwrap_or("direct"))
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let mut s = MemorySettings {
            io,
            ring_slots: rc.trunk_ring.unwrap_or(2),
            ..MemorySettings::default()
        };
        if let Some(p) = &rc.preset {
            let p = presets::load_preset(p).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let t = (p.trunk_gb * 1e9 * trunk_bytes as f64 / REAL_K3_TRUNK_BYTES) as u64;
            let c = (p.cache_gb * 1e9 * expert_bytes as f64 / REAL_K3_EXPERT_BYTES) as u64;
            s.trunk_dir = Some(trunk.clone());
            s.trunk_budget_bytes = Some(t.max(largest));
            s.cache_budget_bytes = Some(c);
            s.ultra_low_memory = p.ultra_low_memory;
        }
        let (bits, t, e) = run_with(&model, &s, &[5, 6, 7, 8, 9], 6, 2);
        println!(
            "{:?}: pinned {}/{} ring {} | experts: req {} resident hits {} misses {} -> {:?}",
            rc.name,
            t.pinned_layers,
            t.n_layers,
            t.ring_slots,
            e.requests,
            e.resident_hits,
            e.misses,
            bits
        );
        insta::assert_yaml_snapshot!("all_run_configs", bits);
    }
}
