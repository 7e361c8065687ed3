//! Every run config in `configs/*.toml` runs through the CLI (`k3-run --config FILE`) on a
//! synthetic checkpoint with its packed trunk, and one insta snapshot per config locks what the
//! run gave: the generated ids, the first-step logit-bits hash and a summary of the compiled
//! plan (pinned layers, ring, expert-cache budget, I/O). A config edit that changes tokens fails
//! with the snapshot's diff; an edit that changes only the plan shows up as a plan diff.
//!
//! Budgets do not change output (docs/NUMERICS.md §1): the ids and the hash of every config are
//! compared with each other, so a config that computes differently fails even if its own
//! snapshot were re-recorded.
//!
//! The presets' budgets are sized for real K3 (108.81 GB trunk, 1447 GB routed experts); on the
//! small synthetic model they are scaled by the same proportion (passed as `--trunk-gb` /
//! `--cache-gb`, which win over the preset's), so "laptop" pins about the same fraction of
//! layers and caches about the same fraction of experts as on real K3 (never less than one
//! ring slot). Everything else of the config (its preset's ultra-low-memory setting, ring, I/O
//! policy, resident choice) applies as written; the mode is set to generate through the
//! environment layer (`K3RUN_MODE`), so the server's config is exercised too.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

const REAL_K3_TRUNK_BYTES: f64 = 108.81e9;
const REAL_K3_EXPERT_BYTES: f64 = 1447.0e9;

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_k3-run")
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

fn k3(args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    let mut c = Command::new(bin());
    c.args(args);
    for (k, _) in std::env::vars() {
        if k.starts_with("K3RUN_") {
            c.env_remove(k);
        }
    }
    c.envs(env.iter().copied());
    c.output().expect("run k3-run")
}

fn ok(o: &std::process::Output, what: &str) -> String {
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(
        o.status.success(),
        "{what}: exit {:?}\nstdout:\n{}\nstderr:\n{stderr}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout)
    );
    stderr
}

/// A synthetic model (spec `tiny`, seed 1) and its packed trunk, written with the CLI.
fn model(dir: &Path) -> (PathBuf, PathBuf) {
    let model = dir.join("tiny-s1");
    let trunk = dir.join("tiny-s1-trunk");
    if !trunk.join("trunk.json").is_file() {
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir).expect("test dir");
        let spec = repo().join("configs/synth/tiny.toml");
        let o = k3(
            &[
                "synth",
                "--spec",
                spec.to_str().unwrap(),
                "--seed",
                "1",
                "--out",
                model.to_str().unwrap(),
                "--quiet",
            ],
            &[],
        );
        ok(&o, "synth");
        let o = k3(
            &[
                "pack-trunk",
                model.to_str().unwrap(),
                trunk.to_str().unwrap(),
            ],
            &[],
        );
        ok(&o, "pack-trunk");
    }
    (model, trunk)
}

fn run_configs() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(repo().join("configs"))
        .expect("configs/ exists")
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    v.sort();
    v
}

/// Trunk bytes, routed-expert bytes and the largest trunk layer (4 KiB-aligned) of `model`,
/// from the plan the CLI prints.
fn model_bytes(model: &Path) -> (u64, u64, u64) {
    let (spec, _) = k3_run::cli::load_spec_files(model, None, None).expect("spec");
    let plan = k3_engine::plan::Plan::new(&spec, 16);
    let largest = plan
        .layers
        .iter()
        .map(|l| l.trunk_bytes.next_multiple_of(4096))
        .max()
        .expect("layers");
    (plan.trunk_bytes(), plan.expert_bytes(), largest)
}

#[derive(serde::Serialize)]
struct Snapshot {
    generated_ids: Value,
    first_logits_hash: Value,
    plan: PlanSummary,
}

#[derive(serde::Serialize)]
struct PlanSummary {
    trunk: String,
    pinned_layers: Value,
    n_layers: Value,
    ring_slots: Value,
    o_direct: Value,
    expert_cache_budget_bytes: Value,
}

#[test]
fn every_run_config_has_its_snapshot_and_all_give_the_same_tokens() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("run_configs");
    let (model_dir, trunk) = model(&dir);
    let (trunk_bytes, expert_bytes, largest) = model_bytes(&model_dir);
    let configs = run_configs();
    assert!(
        configs.len() >= 9,
        "expected the six presets' configs + mmap + resident + server, found {configs:?}"
    );
    let mut seen: Vec<(String, Value, Value)> = Vec::new();
    for path in &configs {
        let stem = path.file_stem().unwrap().to_string_lossy().into_owned();
        let layered = k3_run::runconfig::layer(Some(path), Default::default())
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let out = dir.join(format!("{stem}.json"));
        let mut args: Vec<String> = vec![
            "--config".into(),
            path.display().to_string(),
            model_dir.display().to_string(),
            "--ids".into(),
            "5,6,7,8,9".into(),
            "--gen".into(),
            "6".into(),
            "--incremental".into(),
            "--threads".into(),
            "2".into(),
            "--out".into(),
            out.display().to_string(),
        ];
        if let Some(p) = &layered.settings.preset {
            let p = k3_engine::stream::presets::load_preset(p)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let t = (p.trunk_gb * 1e9 * trunk_bytes as f64 / REAL_K3_TRUNK_BYTES) as u64;
            let c = (p.cache_gb * 1e9 * expert_bytes as f64 / REAL_K3_EXPERT_BYTES) as u64;
            args.extend([
                "--trunk".into(),
                trunk.display().to_string(),
                "--trunk-gb".into(),
                format!("{:.9}", t.max(largest) as f64 / 1e9),
                "--cache-gb".into(),
                format!("{:.9}", c as f64 / 1e9),
            ]);
        }
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = k3(&argv, &[("K3RUN_MODE", "generate")]);
        let stderr = ok(&o, &stem);
        assert!(
            stderr.contains(&format!("run config {}", path.display())),
            "{stem}: the run does not say it used its config:\n{stderr}"
        );
        let v: Value =
            serde_json::from_slice(&std::fs::read(&out).expect("the run's JSON")).expect("JSON");
        let trunk_line = v["memory_plan"]
            .as_array()
            .and_then(|l| l.first())
            .and_then(Value::as_str)
            .unwrap_or("")
            .split(" (")
            .next()
            .unwrap_or("")
            .to_string();
        let snap = Snapshot {
            generated_ids: v["generated_ids"].clone(),
            first_logits_hash: v["first_logits_hash"].clone(),
            plan: PlanSummary {
                trunk: trunk_line,
                pinned_layers: v["trunk"]["pinned_layers"].clone(),
                n_layers: v["trunk"]["n_layers"].clone(),
                ring_slots: v["trunk"]["ring_slots"].clone(),
                o_direct: v["trunk"]["o_direct"].clone(),
                expert_cache_budget_bytes: v["experts"]["budget_bytes"].clone(),
            },
        };
        assert_eq!(
            snap.generated_ids.as_array().map(Vec::len),
            Some(6),
            "{stem}: {v}"
        );
        insta::assert_yaml_snapshot!(format!("run_config_{stem}"), snap);
        seen.push((stem, snap.generated_ids, snap.first_logits_hash));
    }
    let (first, ids, hash) = &seen[0];
    for (stem, i, h) in &seen[1..] {
        assert_eq!(
            (i, h),
            (ids, hash),
            "{stem} gave other tokens or logit bits than {first}: budgets must not change output"
        );
    }
}
