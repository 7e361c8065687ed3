//! `k3-run budget MODEL_DIR`: how much of a checkpoint must stay in memory (docs/DESIGN.md §8).
//!
//! Owns: classifying every tensor of a checkpoint as routed expert / shared expert / attention
//! / embedding / other, from its **manifest role** (the spec's tensor inventory knows which
//! name is which role for every manifest-described model, so Kimi-Linear's names need no
//! heuristics of their own), and the byte totals from the shard headers (no tensor data is
//! read). The resident floor is everything but the routed experts: the shared experts run on
//! every token and are resident even though their names sit next to the routed experts' (seed
//! 002: counting them as streamable makes the floor look smaller, the dangerous direction).
//! Tensors the manifest ignores (K3's vision tower and projector) are `unused`: never loaded.
//! A tensor the manifest neither declares nor ignores is `undeclared` and counted resident
//! (the engine would refuse the checkpoint; the conservative floor is the larger one).
//! The same bytes are also split the way `k3-run plan` splits them (dense trunk, routed
//! experts, global), so the two tools can be held to each other. A directory holding only a
//! config.json (no shards) is budgeted from the manifest's inventory (dtype x shape): the
//! released K3's floor before downloading it.
//! Must not: read tensor data, decide presets (that is `doctor` / `--preset`).

use hashbrown::{HashMap, HashSet};
use std::hash::BuildHasher;
use std::path::PathBuf;

use clap::Args;
use k3_models::spec::{FfnKind, RoleScope, TensorRole};

use crate::checkpoint::{Checkpoint, INDEX_FILE, SINGLE_FILE};
use crate::cli::{Failure, checkpoint_failure, exit, load_spec_files};

/// Flags of `k3-run budget`.
#[derive(Args, Debug, Clone)]
pub struct BudgetArgs {
    /// Checkpoint directory.
    pub model_dir: PathBuf,
    /// Model manifest (default: the built-in kimi-k3 manifest).
    #[arg(long)]
    pub manifest: Option<PathBuf>,
    /// Model config (default MODEL_DIR/config.json).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Also print one line per layer (bytes per class).
    #[arg(long)]
    pub per_layer: bool,
    /// Print the budget as JSON.
    #[arg(long)]
    pub json: bool,
}

/// What a tensor is, for memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Class {
    /// Routed experts: only the top-k of each MoE layer run per token; streamable.
    RoutedExpert,
    /// Shared experts: run on every token; resident.
    SharedExpert,
    /// KDA and MLA attention; resident.
    Attention,
    /// Embedding and lm_head; resident (unless `--ultra-low-memory` streams them).
    Embedding,
    /// Norms, AttnRes, router, dense MLP, latent projections; resident.
    Other,
    /// Under one of the manifest's ignored prefixes: never loaded.
    Unused,
    /// Neither declared nor ignored by the manifest (the engine refuses such a checkpoint);
    /// counted resident.
    Undeclared,
}

impl Class {
    pub const ALL: [Class; 7] = [
        Class::RoutedExpert,
        Class::SharedExpert,
        Class::Attention,
        Class::Embedding,
        Class::Other,
        Class::Unused,
        Class::Undeclared,
    ];

    pub fn key(self) -> &'static str {
        match self {
            Class::RoutedExpert => "routed_expert",
            Class::SharedExpert => "shared_expert",
            Class::Attention => "attention",
            Class::Embedding => "embedding",
            Class::Other => "other",
            Class::Unused => "unused",
            Class::Undeclared => "undeclared",
        }
    }

    /// Part of the resident floor.
    pub fn resident(self) -> bool {
        !matches!(self, Class::RoutedExpert | Class::Unused)
    }

    fn note(self) -> &'static str {
        match self {
            Class::RoutedExpert => "no: streamed from disk (top-k per MoE layer per token)",
            Class::SharedExpert => "yes: runs on every token",
            Class::Attention => "yes: KDA and MLA",
            Class::Embedding => "yes (--ultra-low-memory streams it)",
            Class::Other => "yes: norms, AttnRes, router, dense MLP, latent projections",
            Class::Unused => "no: ignored by the manifest, never loaded",
            Class::Undeclared => "yes, counted: not in the manifest (the engine refuses it)",
        }
    }
}

/// The class of a manifest role.
pub fn classify(role: TensorRole) -> Class {
    use TensorRole::*;
    if role.scope() == RoleScope::Expert {
        return Class::RoutedExpert;
    }
    match role {
        SharedGate | SharedUp | SharedDown => Class::SharedExpert,
        KdaQ | KdaK | KdaV | KdaQConv | KdaKConv | KdaVConv | KdaFA | KdaFB | KdaDtBias
        | KdaALog | KdaBeta | KdaGate | KdaGateA | KdaGateB | KdaONorm | KdaO | MlaQ | MlaQA
        | MlaQANorm | MlaQB | MlaKvA | MlaKvANorm | MlaKvB | MlaGate | MlaO => Class::Attention,
        Embed | LmHead => Class::Embedding,
        _ => Class::Other,
    }
}

/// Tensors and bytes of one class.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct Tally {
    pub tensors: u64,
    pub bytes: u64,
}

impl Tally {
    fn add(&mut self, bytes: u64) {
        self.tensors += 1;
        self.bytes += bytes;
    }
}

/// The budget of a checkpoint.
#[derive(Debug)]
pub struct Budget {
    pub model: String,
    /// Shards of the checkpoint; `None`: no checkpoint, the manifest's inventory.
    pub n_shards: Option<usize>,
    pub classes: Vec<(Class, Tally)>,
    /// Per layer: bytes per class (index = position in [`Class::ALL`]).
    pub layers: Vec<[u64; 7]>,
    /// `k3-run plan`'s split of the declared tensors.
    pub trunk_bytes: u64,
    pub global_bytes: u64,
    pub routed_bytes: u64,
    /// Routed-expert bytes one token reads (top-k of every MoE layer).
    pub active_expert_bytes_per_token: u64,
    pub n_experts_active: usize,
    pub n_experts: usize,
    pub n_moe_layers: usize,
    /// Why the floor is not the engine's (missing / mis-sized / undeclared tensors).
    pub problems: Vec<String>,
}

impl Budget {
    pub fn tally(&self, c: Class) -> Tally {
        self.classes
            .iter()
            .find(|(k, _)| *k == c)
            .map_or_else(Tally::default, |(_, t)| *t)
    }
    pub fn total_bytes(&self) -> u64 {
        self.classes.iter().map(|(_, t)| t.bytes).sum()
    }
    pub fn resident_floor(&self) -> u64 {
        self.classes
            .iter()
            .filter(|(c, _)| c.resident())
            .map(|(_, t)| t.bytes)
            .sum()
    }
}

/// Classify the tensors `(name, bytes)` by the spec's roles. `n_shards`: the checkpoint's
/// shard count, `None` when the tensors are the spec's own inventory (no checkpoint).
pub fn compute(
    spec: &k3_models::spec::ModelSpec,
    tensors: &[(&str, u64)],
    n_shards: Option<usize>,
) -> Budget {
    // Declarations by name: positions in `spec.tensors` (4 bytes a slot, not a map of
    // (name, declaration) pairs: 24 bytes a slot at the release's 497,056 declarations).
    let hasher = hashbrown::DefaultHashBuilder::default();
    let decl_name = |i: u32| spec.tensors[i as usize].name.as_str();
    let mut by_name: hashbrown::HashTable<u32> =
        hashbrown::HashTable::with_capacity(spec.tensors.len());
    for i in 0..u32::try_from(spec.tensors.len()).expect("invariant: fewer than 2^32 tensors") {
        let name = decl_name(i);
        // A name declared twice finds its last declaration, as a map collected from
        // them did.
        match by_name.entry(
            hasher.hash_one(name),
            |&j| decl_name(j) == name,
            |&j| hasher.hash_one(decl_name(j)),
        ) {
            hashbrown::hash_table::Entry::Occupied(mut o) => *o.get_mut() = i,
            hashbrown::hash_table::Entry::Vacant(v) => {
                v.insert(i);
            }
        }
    }
    let lookup = |name: &str| -> Option<usize> {
        by_name
            .find(hasher.hash_one(name), |&j| decl_name(j) == name)
            .map(|&j| j as usize)
    };
    // Declarations found, each counted once: all are present exactly when all are found
    // (else the missing ones are listed below).
    let mut found = vec![false; spec.tensors.len()];
    let mut matched = 0usize;
    let mut tallies: HashMap<Class, Tally> = HashMap::new();
    let mut layers = vec![[0u64; 7]; spec.n_layers];
    let (mut trunk, mut global, mut routed) = (0u64, 0u64, 0u64);
    let mut problems = Vec::new();
    let mut undeclared: Vec<&str> = Vec::new();
    let mut mis_sized: Vec<&str> = Vec::new();
    // bytes of one routed expert (expert 0) per layer
    let mut expert0 = vec![0u64; spec.n_layers];
    for &(name, bytes) in tensors {
        let class = match lookup(name) {
            Some(j) => {
                let d = &spec.tensors[j];
                if !std::mem::replace(&mut found[j], true) {
                    matched += 1;
                }
                if bytes != d.n_bytes() as u64 {
                    mis_sized.push(name);
                }
                match (d.layer, d.expert) {
                    (Some(l), Some(e)) => {
                        routed += bytes;
                        if e == 0 {
                            expert0[l] += bytes;
                        }
                    }
                    (Some(_), None) => trunk += bytes,
                    (None, _) => global += bytes,
                }
                let c = classify(d.role);
                if let Some(l) = d.layer {
                    layers[l][c as usize] += bytes;
                }
                c
            }
            None if spec
                .ignored_tensor_prefixes
                .iter()
                .any(|p| name.starts_with(p.as_str())) =>
            {
                Class::Unused
            }
            None => {
                undeclared.push(name);
                Class::Undeclared
            }
        };
        tallies.entry(class).or_default().add(bytes);
    }
    drop(by_name);
    drop(found);
    let missing: Vec<&str> = if matched == spec.tensors.len() {
        Vec::new()
    } else {
        let present: HashSet<&str> = tensors.iter().map(|t| t.0).collect();
        spec.tensors
            .iter()
            .map(|d| d.name.as_str())
            .filter(|n| !present.contains(n))
            .collect()
    };
    for (what, list) in [
        (
            "declared by the manifest but not in the checkpoint",
            &missing,
        ),
        (
            "in the checkpoint but not declared by the manifest",
            &undeclared,
        ),
        ("of another size than the manifest declares", &mis_sized),
    ] {
        if let Some(first) = list.first() {
            problems.push(format!("{} tensors {what} (first: {first})", list.len()));
        }
    }
    let (k, n) = spec
        .moe
        .as_ref()
        .map_or((0, 0), |m| (m.n_experts_active, m.n_experts));
    let moe_layers: Vec<usize> = spec
        .layers
        .iter()
        .filter(|l| l.ffn == FfnKind::Moe)
        .map(|l| l.index)
        .collect();
    let active = moe_layers.iter().map(|&l| expert0[l] * k as u64).sum();
    Budget {
        model: spec.name.clone(),
        n_shards,
        classes: Class::ALL
            .iter()
            .map(|&c| (c, tallies.get(&c).copied().unwrap_or_default()))
            .collect(),
        layers,
        trunk_bytes: trunk,
        global_bytes: global,
        routed_bytes: routed,
        active_expert_bytes_per_token: active,
        n_experts_active: k,
        n_experts: n,
        n_moe_layers: moe_layers.len(),
        problems,
    }
}

fn gb(b: u64) -> f64 {
    b as f64 / 1e9
}

fn pct(a: u64, b: u64) -> f64 {
    100.0 * a as f64 / b.max(1) as f64
}

impl Budget {
    /// The text report.
    pub fn report(&self, dir: &std::path::Path, per_layer: bool) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        let n_tensors: u64 = self.classes.iter().map(|(_, t)| t.tensors).sum();
        let total = self.total_bytes();
        let source = match self.n_shards {
            Some(n) => format!("{n_tensors} tensors in {n} shards; bytes from the headers"),
            None => format!(
                "no checkpoint: the manifest's {n_tensors} tensors for its config.json, bytes \
                 from dtype x shape; tensors the manifest ignores are not counted"
            ),
        };
        let _ = writeln!(s, "budget for {}: {} ({source})", self.model, dir.display());
        let _ = writeln!(
            s,
            "  class          tensors             bytes           GB  resident"
        );
        for (c, t) in &self.classes {
            if t.tensors == 0 && matches!(c, Class::Unused | Class::Undeclared) {
                continue;
            }
            let _ = writeln!(
                s,
                "  {:<13} {:>8} {:>17} {:>12.3}  {}",
                c.key(),
                t.tensors,
                t.bytes,
                gb(t.bytes),
                c.note()
            );
        }
        let _ = writeln!(
            s,
            "  {:<13} {:>8} {:>17} {:>12.3}",
            "total",
            n_tensors,
            total,
            gb(total)
        );
        let floor = self.resident_floor();
        let _ = writeln!(
            s,
            "resident floor : {floor} bytes ({:.3} GB, {:.1}% of the checkpoint): everything but \
             the routed experts, shared experts included",
            gb(floor),
            pct(floor, total)
        );
        let routed = self.tally(Class::RoutedExpert).bytes;
        let _ = writeln!(
            s,
            "streaming saves: {routed} bytes ({:.3} GB, {:.1}%): the routed experts stay on disk; \
             a token reads {} of {} experts in each of {} MoE layers, {} bytes ({:.3} GB)",
            gb(routed),
            pct(routed, total),
            self.n_experts_active,
            self.n_experts,
            self.n_moe_layers,
            self.active_expert_bytes_per_token,
            gb(self.active_expert_bytes_per_token)
        );
        let _ = writeln!(
            s,
            "plan split     : dense trunk {} + global {} bytes resident, routed experts {} bytes \
             (as `k3-run plan`; a packed trunk, --trunk, streams the dense trunk too)",
            self.trunk_bytes, self.global_bytes, self.routed_bytes
        );
        if per_layer {
            let _ = writeln!(
                s,
                "  layer      attention  shared_expert          other  routed_expert"
            );
            for (i, l) in self.layers.iter().enumerate() {
                let _ = writeln!(
                    s,
                    "  {i:>5}  {:>13}  {:>13}  {:>13}  {:>13}",
                    l[Class::Attention as usize],
                    l[Class::SharedExpert as usize],
                    l[Class::Other as usize],
                    l[Class::RoutedExpert as usize]
                );
            }
        }
        s
    }

    /// The JSON report.
    pub fn json(&self, dir: &std::path::Path, per_layer: bool) -> serde_json::Value {
        let mut classes = serde_json::Map::new();
        for (c, t) in &self.classes {
            classes.insert(
                c.key().to_string(),
                serde_json::json!({
                    "tensors": t.tensors,
                    "bytes": t.bytes,
                    "resident": c.resident(),
                }),
            );
        }
        let mut v = serde_json::json!({
            "model": self.model,
            "dir": dir.display().to_string(),
            "shards": self.n_shards,
            "source": if self.n_shards.is_some() { "headers" } else { "manifest" },
            "tensors": self.classes.iter().map(|(_, t)| t.tensors).sum::<u64>(),
            "classes": classes,
            "total_bytes": self.total_bytes(),
            "resident_floor_bytes": self.resident_floor(),
            "streamed_bytes": self.tally(Class::RoutedExpert).bytes,
            "active_expert_bytes_per_token": self.active_expert_bytes_per_token,
            "plan": {
                "trunk_bytes": self.trunk_bytes,
                "routed_expert_bytes": self.routed_bytes,
                "global_bytes": self.global_bytes,
            },
            "problems": self.problems,
        });
        if per_layer {
            v["layers"] = self
                .layers
                .iter()
                .enumerate()
                .map(|(i, l)| {
                    serde_json::json!({
                        "index": i,
                        "attention": l[Class::Attention as usize],
                        "shared_expert": l[Class::SharedExpert as usize],
                        "other": l[Class::Other as usize],
                        "routed_expert": l[Class::RoutedExpert as usize],
                    })
                })
                .collect();
        }
        v
    }
}

/// `k3-run budget`: exit 0; 1 when the checkpoint's files cannot be read (a missing, truncated
/// or malformed index or shard, as in a run) or are not the manifest's model (the report is
/// still printed; the engine would refuse to run it); 2 on a usage error.
pub fn main(a: &BudgetArgs) -> Result<u8, Failure> {
    let (spec, files) = load_spec_files(&a.model_dir, a.manifest.as_deref(), a.config.as_deref())?;
    let dir = &a.model_dir;
    let has_checkpoint = dir.join(INDEX_FILE).exists() || dir.join(SINGLE_FILE).exists();
    let b = if has_checkpoint {
        let ck = match files {
            Some(f) => f,
            None => Checkpoint::open_unchecked(dir).map_err(checkpoint_failure)?,
        };
        let tensors: Vec<(&str, u64)> = ck
            .tensor_names()
            .map(|n| {
                // headers are range-checked at open: dtype x shape is the stored span
                let bytes = ck
                    .info(n)
                    .and_then(|(dt, sh)| crate::checkpoint::header::expected_bytes(dt, sh))
                    .unwrap_or(0);
                (n, bytes)
            })
            .collect();
        compute(&spec, &tensors, Some(ck.shards().len()))
    } else {
        let tensors: Vec<(&str, u64)> = spec
            .tensors
            .iter()
            .map(|d| (d.name.as_str(), d.n_bytes() as u64))
            .collect();
        compute(&spec, &tensors, None)
    };
    if a.json {
        let text = serde_json::to_string_pretty(&b.json(&a.model_dir, a.per_layer))
            .map_err(|e| Failure::usage(e.to_string()))?;
        println!("{text}");
    } else {
        print!("{}", b.report(&a.model_dir, a.per_layer));
    }
    if b.problems.is_empty() {
        return Ok(exit::OK);
    }
    for p in &b.problems {
        eprintln!("k3-run: budget: {p}");
    }
    let source = if dir.join(INDEX_FILE).exists() {
        format!(" as {} lists it", dir.join(INDEX_FILE).display())
    } else if dir.join(SINGLE_FILE).exists() {
        format!(" in {}", dir.join(SINGLE_FILE).display())
    } else {
        String::new()
    };
    eprintln!(
        "k3-run: budget: the checkpoint{source} is not the manifest's model (the engine would \
         refuse it); the floor above counts what is there"
    );
    Ok(crate::verify::MISMATCH)
}
