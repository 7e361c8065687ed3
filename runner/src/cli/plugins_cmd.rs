//! The command-line side of plugins: `k3-run plugins list`, `k3-run sim-cache --plugin`, and
//! the run's `--draft-plugin`.
//!
//! Owns: what these print and their exit codes (2 when a named plugin cannot be used, with
//! the reason). Must not: load anything but through [`crate::plugins`].

use std::path::{Path, PathBuf};

use k3_models::spec::ModelSpec;

use super::{Failure, RunArgs, SimCli, exit};
use crate::plugins::{self, Kind};
use crate::speculate::Speculation;
use crate::stream::experts::{EvictionPolicy, Lru};
use crate::stream::policy::{replay, trace_shape};
use crate::stream::trace::simulate;

#[derive(clap::Args, Debug)]
pub struct PluginsCli {
    #[command(subcommand)]
    pub action: PluginsAction,
}

#[derive(clap::Subcommand, Debug)]
pub enum PluginsAction {
    /// Load each plugin and print its name, kind, ABI version and file, or why it cannot be
    /// used (exit 2). Without names: every k3 plugin library in the search directories (the
    /// current directory, $K3_PLUGIN_DIR, configs/plugins, next to k3-run).
    List {
        /// Plugin files or bare names (e.g. `lfu`, `libk3_plugin_lfu.so`, `./x.so`).
        plugins: Vec<PathBuf>,
    },
}

/// Libraries named like k3 plugins (`libk3_plugin_*.so`) in the search directories.
fn discover() -> Vec<PathBuf> {
    let (pre, suf) = (std::env::consts::DLL_PREFIX, std::env::consts::DLL_SUFFIX);
    let stem = format!("{pre}k3_plugin_");
    let mut seen = std::collections::BTreeSet::new();
    let mut out = Vec::new();
    for d in plugins::search_dirs() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        let mut names: Vec<PathBuf> = rd
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(&stem) && n.ends_with(suf))
            })
            .collect();
        names.sort();
        for p in names {
            let c = p.canonicalize().unwrap_or_else(|_| p.clone());
            if seen.insert(c.clone()) {
                out.push(c);
            }
        }
    }
    out
}

/// `k3-run plugins ...`.
pub fn main(p: &PluginsCli) -> Result<u8, Failure> {
    match &p.action {
        PluginsAction::List { plugins: names } => {
            let explicit = !names.is_empty();
            let list = if explicit { names.clone() } else { discover() };
            if list.is_empty() {
                println!(
                    "no plugins found in {} (build them: cargo build --release -p \
                     k3-plugin-lfu ...; or name files)",
                    plugins::search_dirs()
                        .iter()
                        .map(|d| d.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                );
                return Ok(exit::OK);
            }
            println!(
                "{:<12} {:<27} {:>3}  file / description",
                "name", "kind", "abi"
            );
            let mut failed = 0usize;
            for spec in &list {
                match plugins::load(spec) {
                    Ok(l) => println!(
                        "{:<12} {:<27} {:>3}  {}\n{:<46}{}",
                        l.name,
                        l.kind.label(),
                        l.abi_version,
                        l.path.display(),
                        "",
                        l.description
                    ),
                    Err(e) => {
                        failed += 1;
                        println!("{:<12} {e}", "(error)");
                    }
                }
            }
            if explicit && failed > 0 {
                return Err(Failure::usage(format!(
                    "{failed} of {} plugins cannot be used (see above)",
                    list.len()
                )));
            }
            Ok(exit::OK)
        }
    }
}

fn pct(h: u64, n: u64) -> f64 {
    if n == 0 {
        0.0
    } else {
        100.0 * h as f64 / n as f64
    }
}

/// `k3-run sim-cache TRACE --plugin P...`: LRU, Belady and each plugin at each capacity, with
/// the share of the LRU-to-Belady gap each plugin closes.
pub fn sim_with_plugins(p: &SimCli, recs: &[(u32, u32)]) -> Result<u8, Failure> {
    let mut loaded = Vec::new();
    for spec in &p.plugins {
        let l = plugins::load(spec).map_err(|e| Failure::usage(e.0))?;
        if !matches!(l.kind, Kind::CachePolicy | Kind::EvictionV1) {
            return Err(Failure::usage(format!(
                "plugin {} ({}) is a {}: sim-cache replays cache policies",
                l.path.display(),
                l.name,
                l.kind.label()
            )));
        }
        loaded.push(l);
    }
    // The trace itself is the belady plugin's input; a user's trace= comes later and wins.
    let mut opts = vec![format!("trace={}", p.trace.display())];
    opts.extend(p.plugin_opts.iter().cloned());
    // Each plugin is created once before anything is printed: a create error is the answer.
    let first = p.capacities.iter().copied().find(|&c| c > 0).unwrap_or(1);
    for l in &loaded {
        let shape = trace_shape(recs, first, p.expert_bytes.unwrap_or(0));
        plugins::cache_policy_from(l, &shape, &opts).map_err(|e| Failure::usage(e.0))?;
    }
    let mut head = String::from("capacity (experts)   GB       LRU hit %   Belady hit %");
    for l in &loaded {
        head.push_str(&format!(
            "   {:>14}  gap closed",
            format!("{} hit %", l.name)
        ));
    }
    println!("{head}");
    let mut fell_back = Vec::new();
    for &c in &p.capacities {
        let r = simulate(recs, c);
        let gb = p.expert_bytes.map_or_else(
            || "-".to_string(),
            |b| format!("{:.2}", (b as f64 * c as f64) / 1e9),
        );
        let (lru, bel) = (pct(r.lru_hits, r.requests), pct(r.belady_hits, r.requests));
        let mut row = format!("{c:>18}   {gb:>6}   {lru:>9.2}   {bel:>12.2}");
        for l in &loaded {
            let shape = trace_shape(recs, c, p.expert_bytes.unwrap_or(0));
            let mut pol: Box<dyn EvictionPolicy> = if c == 0 {
                Box::new(Lru::default())
            } else {
                plugins::cache_policy_from(l, &shape, &opts).map_err(|e| Failure::usage(e.0))?
            };
            let hits = replay(recs, c, pol.as_mut());
            if let Some(f) = pol.failure() {
                fell_back.push(format!("capacity {c}: {f}"));
            }
            let h = pct(hits, r.requests);
            let gap = if r.belady_hits > r.lru_hits {
                format!(
                    "{:>9.1}%",
                    100.0 * (hits as f64 - r.lru_hits as f64) / (r.belady_hits - r.lru_hits) as f64
                )
            } else {
                format!("{:>10}", "-")
            };
            let mark = if pol.failure().is_some() { "*" } else { " " };
            row.push_str(&format!("   {h:>13.2}{mark}  {gap}"));
        }
        println!("{row}");
    }
    println!(
        "gap closed = (plugin - LRU) / (Belady - LRU) hits; {} requests{}",
        simulate(recs, 0).requests,
        if fell_back.is_empty() {
            String::new()
        } else {
            "; * = the plugin FELL BACK to LRU".to_string()
        }
    );
    for f in &fell_back {
        println!("  {f}");
    }
    Ok(exit::OK)
}

/// The run's `--draft-plugin`, created for this model, or a usage error saying why not.
pub fn run_drafter(
    a: &RunArgs,
    spec: &ModelSpec,
    speculation: Option<Speculation>,
) -> Result<Option<Box<dyn crate::draft::Drafter>>, Failure> {
    let (Some(path), Some(s)) = (&a.draft_plugin, speculation) else {
        return Ok(None);
    };
    let d = plugins::drafter(path, spec.vocab_size, s.max_draft, &a.mem.plugin_opts)
        .map_err(|e| Failure::usage(e.0))?;
    eprintln!(
        "  draft provider: {} ({}), up to {} guesses per pass",
        d.name(),
        display(path),
        s.max_draft
    );
    Ok(Some(d))
}

fn display(p: &Path) -> String {
    p.display().to_string()
}
