//! Command-line interface of `k3-run`: flags, subcommands, exit codes, the printed report.
//!
//! Owns: argument parsing (clap), wiring flags to the library, what is printed, exit codes
//! (docs/DESIGN.md §6): 0 success; 1 tensor binding or forward failure; 2 usage error or a config
//! that cannot be read with confidence; 3 run finished but `--out` could not be written; 4 run
//! finished but a routed expert failed to load; 5 stopped early by Ctrl-C.
//! Must not: contain model math or storage logic.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};
use k3_models::spec::ModelSpec;

use crate::checkpoint::Checkpoint;
use crate::exec::{ExecError, Executor};
use crate::plan::Plan;
use crate::run::{self, GenRequest};
use crate::weights::WeightError;

pub use k3_engine::model::KIMI_K3_MANIFEST;

mod failure;
mod generate;
pub mod layering;
mod pack_trunk;
mod pipeline;
pub mod plugins_cmd;
mod settings;
mod show_plan;
mod sim_cache;
mod synth_cli;
mod util;

pub use failure::*;
use generate::*;
pub use pack_trunk::*;
use pipeline::*;
pub use settings::*;
pub use show_plan::*;
pub use sim_cache::*;
pub use synth_cli::*;
pub use util::*;

#[derive(Parser, Debug)]
#[command(
    name = "k3-run",
    version,
    about = "Run Kimi K3 on one CPU by streaming weights from disk; identical tokens at every memory budget.",
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub run: RunArgs,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Write a random checkpoint in the exact layout of the real release.
    Synth(SynthCli),
    /// Print the execution plan for a checkpoint (layers, bytes, state, scratch), or for a run
    /// config (`plan --config FILE.toml`) without running it.
    Plan(PlanCli),
    /// `config show`: the merged settings of a run, each with where it came from.
    Config(layering::ConfigCli),
    /// Check the machine: memory, the preset to use, disk read bandwidth as the engine reads.
    Doctor(crate::doctor::DoctorArgs),
    /// Pack the dense trunk into one file (trunk.bin + trunk.json) for streaming, once (--check: compare a pack with the checkpoint).
    PackTrunk(PackCli),
    /// Replay an expert-request trace under LRU and Belady's optimum at several capacities.
    SimCache(SimCli),
    /// Plugins: `plugins list [PLUGIN...]` shows name, kind and ABI version of each.
    Plugins(plugins_cmd::PluginsCli),
    /// Print exactly what the model will see for a transcript plus the generation prompt.
    RenderChat(crate::chat::RenderChatArgs),
    /// Check a download: shard count, exact total bytes, every shard's size (headers only);
    /// names the shards to fetch again.
    Verify(crate::verify::VerifyArgs),
    /// Classify every tensor (routed expert, shared expert, attention, embedding, other) and
    /// print the resident floor.
    Budget(crate::budget::BudgetArgs),
    /// Fetch a model repository from the Hugging Face hub into a directory (resumable), then
    /// verify it.
    Download(crate::download::DownloadArgs),
}

/// Levenshtein distance of two short words (subcommand names).
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, &cb) in b.iter().enumerate() {
            cur[j + 1] = (prev[j] + usize::from(ca != cb))
                .min(prev[j + 1] + 1)
                .min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

/// Output piped into a reader that stops early (`k3-run plan M | head`) ends the process
/// quietly, as in other Unix tools, instead of `println!`'s "failed printing to stdout" panic
/// (exit 101 with a backtrace): the signal's default action. Sockets are not affected (the
/// standard library sends with `MSG_NOSIGNAL`: a `--serve` client that hangs up is an error
/// of that request only).
fn quiet_broken_pipe() {
    // At start-up, before any thread exists. Windows has no SIGPIPE (nothing to restore).
    crate::platform::default_sigpipe();
}

/// The subcommand `word` was probably meant to be: within edit distance 2 of a subcommand
/// name, or a prefix of one (the closest; ties to the first in `--help` order). `None` for an
/// exact name, a path (with `/`) or a flag.
pub fn near_subcommand(word: &str, names: &[&str]) -> Option<String> {
    if word.is_empty() || word.starts_with('-') || word.contains('/') || names.contains(&word) {
        return None;
    }
    let w = word.to_lowercase();
    names
        .iter()
        .filter_map(|&n| {
            let d = edit_distance(&w, n);
            (d <= 2 || n.starts_with(&w)).then_some((d, n))
        })
        .min_by_key(|&(d, _)| d)
        .map(|(_, n)| n.to_string())
}

/// A first argument that is not an existing path but looks like a mistyped subcommand: clap
/// would take it as MODEL_DIR and complain about the next argument. The usage error to print.
fn mistyped_subcommand() -> Option<String> {
    let first = std::env::args_os().nth(1)?;
    let word = first.to_str()?;
    if Path::new(word).exists() {
        return None;
    }
    let cmd = Cli::command();
    // clap adds `help` when it builds the command
    let names: Vec<&str> = cmd
        .get_subcommands()
        .map(|c| c.get_name())
        .chain(["help"])
        .collect();
    let sub = near_subcommand(word, &names)?;
    Some(format!(
        "no model directory '{word}' (did you mean the subcommand `{sub}`?)"
    ))
}

/// Entry point used by `main`.
pub fn main() -> ExitCode {
    quiet_broken_pipe();
    if let Some(msg) = mistyped_subcommand() {
        say!("k3-run: error: {msg}");
        return ExitCode::from(exit::USAGE);
    }
    let matches = Cli::command().get_matches();
    let mut cli = match Cli::from_arg_matches(&matches) {
        Ok(c) => c,
        Err(e) => e.exit(),
    };
    // One layering of every run setting (runconfig.rs): defaults < preset < --config <
    // K3RUN_* < the flags given.
    if cli.command.is_none()
        && let Err(f) = layering::layer_run(&mut cli.run, &matches)
            .and_then(|l| layering::check_plugins(&l, &cli.run))
    {
        say!("k3-run: error: {}", f.msg);
        return ExitCode::from(f.code);
    }
    // K3_ISA naming an unknown or unavailable path is a usage error, not a silent fallback.
    if let Err(e) = k3_kernels::isa::env_override() {
        say!("k3-run: error: K3_ISA: {e}");
        return ExitCode::from(exit::USAGE);
    }
    let r = match &mut cli.command {
        Some(Command::Plan(p)) => match matches.subcommand_matches("plan") {
            Some(m) => layering::layer_run(&mut p.run, m).and_then(|_| plan_main(p)),
            None => Err(Failure::usage("plan: no arguments")),
        },
        Some(Command::Config(c)) => match matches.subcommand_matches("config") {
            Some(m) => layering::config_main(c, m),
            None => Err(Failure::usage("config: expected `config show`")),
        },
        Some(Command::Synth(s)) => match crate::synth::run(&s.clone().into()) {
            Ok(r) => {
                println!(
                    "synth: wrote {} ({} tensors in {} shards; trunk {:.3} GB, experts {:.3} GB, global {:.3} GB)",
                    r.out.display(),
                    r.n_tensors,
                    r.n_shards,
                    r.trunk_bytes as f64 / 1e9,
                    r.expert_bytes as f64 / 1e9,
                    r.global_bytes as f64 / 1e9
                );
                Ok(exit::OK)
            }
            Err(e) => Err(Failure::usage(e.to_string())),
        },
        Some(Command::RenderChat(r)) => crate::chat::render_chat_main(r),
        Some(Command::PackTrunk(p)) => pack_main(p),
        Some(Command::Doctor(d)) => crate::doctor::main(d),
        Some(Command::SimCache(p)) => sim_main(p),
        Some(Command::Plugins(p)) => plugins_cmd::main(p),
        Some(Command::Verify(v)) => crate::verify::main(v),
        Some(Command::Budget(b)) => crate::budget::main(b),
        Some(Command::Download(d)) => crate::download::main(d),
        None => run_main(&cli.run),
    };
    match r {
        Ok(c) => ExitCode::from(c),
        Err(f) => {
            say!("k3-run: error: {}", f.msg);
            ExitCode::from(f.code)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn near_subcommand_takes_small_edits_and_prefixes_only() {
        let names = [
            "synth",
            "plan",
            "doctor",
            "pack-trunk",
            "sim-cache",
            "render-chat",
        ];
        let near = |w: &str| near_subcommand(w, &names);
        assert_eq!(near("pack-trnk").as_deref(), Some("pack-trunk"));
        assert_eq!(near("sim-cash").as_deref(), Some("sim-cache"));
        assert_eq!(near("plna").as_deref(), Some("plan"));
        assert_eq!(near("Doctr").as_deref(), Some("doctor"));
        assert_eq!(near("render").as_deref(), Some("render-chat"));
        assert_eq!(near("plan"), None, "an exact name is the subcommand");
        assert_eq!(near("models/A"), None, "a path is a path");
        assert_eq!(near("--ids"), None);
        assert_eq!(near("checkpoint-dir"), None);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("", "abc"), 3);
    }
}
