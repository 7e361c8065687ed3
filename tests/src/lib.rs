//! Shared helpers for the cross-crate conformance tests in `tests/tests/`.
//!
//! Owns: locating the committed fixtures (`fixtures/models/<name>/`), reading the independent
//! reference's `summary.json` and raw f32 logits, and running the engine resident on a
//! checkpoint. Must not: compute any reference value itself (the reference is the numpy
//! oracle under `fixtures/oracle/`, see `fixtures/README.md`).

use std::path::{Path, PathBuf};

use k3_engine::checkpoint::Checkpoint;
use k3_engine::exec::{Executor, Providers};
use k3_engine::plan::Plan;
use k3_engine::resident::{ResidentExperts, ResidentGlobal, ResidentTrunk};
use k3_models::spec::ModelSpec;

/// Repository root (the parent of this crate's directory).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ lives inside the repository")
        .to_path_buf()
}

/// The reference outputs of one model fixture (`fixtures/models/<name>/ref/summary.json`).
#[derive(Debug, serde::Deserialize)]
pub struct RefSummary {
    pub name: String,
    pub n_vocab: usize,
    pub prompt_ids: Vec<u32>,
    pub generated_ids: Vec<u32>,
    pub tf_sequence: Vec<u32>,
    pub tf_argmax: Vec<u32>,
    pub stable: Vec<bool>,
    pub greedy_stable_steps: Vec<bool>,
    pub first_unstable_step: Option<usize>,
    pub logit_tolerance: f32,
}

/// One committed model fixture: checkpoint + reference.
pub struct Fixture {
    pub name: String,
    pub ckpt_dir: PathBuf,
    pub summary: RefSummary,
    /// [n_positions][vocab] teacher-forced reference logits.
    pub tf_logits: Vec<Vec<f32>>,
}

fn read_f32(path: &Path) -> Vec<f32> {
    let b = std::fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

impl Fixture {
    pub fn load(name: &str) -> Fixture {
        let dir = repo_root().join("fixtures/models").join(name);
        let sp = dir.join("ref/summary.json");
        let text =
            std::fs::read_to_string(&sp).unwrap_or_else(|e| panic!("read {}: {e}", sp.display()));
        let summary: RefSummary =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("parse {}: {e}", sp.display()));
        let flat = read_f32(&dir.join("ref/tf_logits.f32"));
        let v = summary.n_vocab;
        assert_eq!(flat.len(), summary.tf_sequence.len() * v, "tf_logits shape");
        let tf_logits = flat.chunks_exact(v).map(|c| c.to_vec()).collect();
        Fixture {
            name: name.to_string(),
            ckpt_dir: dir.join("ckpt"),
            summary,
            tf_logits,
        }
    }
}

/// Load spec (built-in kimi-k3 manifest + the checkpoint's config.json) and open the checkpoint.
pub fn open_model(dir: &Path) -> (ModelSpec, Checkpoint) {
    let spec = k3_engine::model::load_spec(dir, None, None)
        .unwrap_or_else(|e| panic!("load spec for {}: {e}", dir.display()));
    let ckpt =
        Checkpoint::open(dir, &spec).unwrap_or_else(|e| panic!("open {}: {e}", dir.display()));
    (spec, ckpt)
}

/// Resident providers over an open checkpoint.
pub fn resident<'c>(spec: &'c ModelSpec, ckpt: &'c Checkpoint) -> Providers<'c> {
    Providers {
        trunk: Box::new(ResidentTrunk::with_arena(spec, ckpt, None).expect("bind trunk")),
        experts: Box::new(ResidentExperts::new(spec, ckpt)),
        global: Box::new(ResidentGlobal::with_arena(spec, ckpt, None).expect("bind globals")),
    }
}

/// An executor for `positions` positions with `threads` threads.
pub fn executor(spec: &ModelSpec, positions: usize, threads: usize) -> Executor<'_> {
    Executor::new(spec, Plan::new(spec, positions), threads)
}

/// Indices of the `k` largest values (ties to the lower index).
pub fn top_k(x: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..x.len()).collect();
    idx.sort_by(|&a, &b| x[b].total_cmp(&x[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// A synthetic checkpoint written by `k3_engine::synth` from `configs/synth/<spec>.toml` with
/// `seed`, plus its packed trunk, under `dir` (on disk under target/, never tmpfs: O_DIRECT
/// alignment bugs hide on tmpfs). Written once; later calls reuse it. Returns (model, trunk).
pub fn synth_and_pack(spec: &str, seed: u64, dir: &Path) -> (PathBuf, PathBuf) {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _g = LOCK.lock().unwrap_or_else(|p| p.into_inner());
    let model = dir.join(format!("{spec}-s{seed}"));
    let trunk = dir.join(format!("{spec}-s{seed}-trunk"));
    if !model.join("config.json").is_file() {
        let _ = std::fs::remove_dir_all(&model);
        let args = k3_engine::synth::SynthArgs {
            spec: repo_root()
                .join("configs/synth")
                .join(format!("{spec}.toml")),
            seed,
            out: model.clone(),
            manifest: None,
            quiet: true,
        };
        k3_engine::synth::run(&args).unwrap_or_else(|e| panic!("synth {spec}: {e}"));
    }
    if !trunk.join("trunk.json").is_file() {
        let _ = std::fs::remove_dir_all(&trunk);
        let (spec_m, _ck) = open_model(&model);
        k3_engine::stream::pack::run(&model, &spec_m, &trunk, None)
            .unwrap_or_else(|e| panic!("pack {spec}: {e}"));
    }
    (model, trunk)
}

/// The trunk of `model` packed compressed (`pack-trunk --compress`) with `chunk_bytes`-byte
/// chunks into `out` (written once; later calls reuse it).
pub fn pack_compressed(model: &Path, chunk_bytes: u64, out: &Path) -> PathBuf {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _g = LOCK.lock().unwrap_or_else(|p| p.into_inner());
    if !out.join("trunk.json").is_file() {
        let _ = std::fs::remove_dir_all(out);
        let (spec_m, _ck) = open_model(model);
        k3_engine::stream::pack::pack_trunk_with(model, &spec_m, out, false, Some(chunk_bytes))
            .unwrap_or_else(|e| panic!("pack --compress {}: {e}", model.display()));
    }
    out.to_path_buf()
}

/// What a run produced, for bit-identity comparisons and snapshots.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct RunBits {
    pub generated_ids: Vec<u32>,
    /// FNV-1a 64 of the first-step logit bits.
    pub first_logits_hash: String,
}

/// Run `prompt` + `n_gen` greedy incremental tokens with the given memory settings.
/// Returns the bits and the trunk/expert stats.
/// Packed size of each layer of a packed trunk (from its trunk.json).
pub fn trunk_layer_sizes(trunk: &Path) -> Vec<u64> {
    let j: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(trunk.join("trunk.json")).expect("trunk.json"),
    )
    .expect("trunk.json is JSON");
    j["layers"]
        .as_array()
        .expect("trunk.json has layers")
        .iter()
        .map(|l| l["size"].as_u64().expect("layer size"))
        .collect()
}

pub fn run_with(
    model: &Path,
    settings: &k3_engine::session::MemorySettings,
    prompt: &[u32],
    n_gen: usize,
    threads: usize,
) -> (
    RunBits,
    k3_engine::weights::TrunkStats,
    k3_engine::weights::ExpertStats,
) {
    let (spec, ckpt) = open_model(model);
    let plan = Plan::new(&spec, prompt.len() + n_gen);
    let mut session = k3_engine::session::build(&spec, &ckpt, &plan, settings)
        .unwrap_or_else(|e| panic!("build providers for {settings:?}: {e}"));
    let mut exec = Executor::new(&spec, plan, threads);
    // as the CLI does: workers spin only when every weight is in RAM
    session.configure_pool(exec.pool());
    let req = k3_engine::run::GenRequest {
        prompt_ids: prompt.to_vec(),
        n_gen,
        incremental: true,
        stop_ids: vec![],
    };
    let r = k3_engine::run::generate(
        &spec,
        &mut exec,
        &mut session.providers,
        &req,
        &mut |_, _, _| true,
    )
    .unwrap_or_else(|e| panic!("generate with {settings:?}: {e}"));
    (
        RunBits {
            generated_ids: r.generated_ids,
            first_logits_hash: r.first_logits_hash,
        },
        session.providers.trunk.stats(),
        session.providers.experts.stats(),
    )
}
