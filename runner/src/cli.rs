//! Command-line interface of `k3-run`: flags, subcommands, exit codes, the printed report.
//!
//! Owns: argument parsing (clap), wiring flags to the library, what is printed, exit codes
//! (SYSTEM.md §6): 0 success; 1 tensor binding or forward failure; 2 usage error or a config
//! that cannot be read with confidence; 3 run finished but `--out` could not be written; 4 run
//! finished but a routed expert failed to load; 5 stopped early by Ctrl-C.
//! Must not: contain model math or storage logic.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use k3_models::spec::ModelSpec;

use crate::checkpoint::Checkpoint;
use crate::exec::{ExecError, Executor, Providers};
use crate::plan::Plan;
use crate::resident::{ResidentExperts, ResidentGlobal, ResidentTrunk};
use crate::run::{self, GenRequest};
use crate::weights::WeightError;

/// The built-in manifest for Kimi K3 and every synthetic K3-family checkpoint.
pub const KIMI_K3_MANIFEST: &str = include_str!("../../configs/models/kimi-k3.toml");

/// Exit codes (SYSTEM.md §6).
pub mod exit {
    pub const OK: u8 = 0;
    pub const FORWARD: u8 = 1;
    pub const USAGE: u8 = 2;
    pub const OUT_WRITE: u8 = 3;
    pub const EXPERT_LOAD: u8 = 4;
    pub const INTERRUPTED: u8 = 5;
}

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
    Synth(crate::synth::SynthArgs),
    /// Print the execution plan for a checkpoint (layers, bytes, state, scratch).
    Plan(PlanCli),
    /// Print exactly what the model will see for a transcript plus the generation prompt.
    RenderChat(crate::chat::RenderChatArgs),
}

#[derive(Args, Debug)]
pub struct PlanCli {
    /// Checkpoint directory.
    pub model_dir: PathBuf,
    /// Model manifest (default: the built-in kimi-k3 manifest).
    #[arg(long)]
    pub manifest: Option<PathBuf>,
    /// Model config (default MODEL_DIR/config.json).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Context length to plan the KV cache for.
    #[arg(long, default_value_t = 4096)]
    pub positions: usize,
    /// Print the plan as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug, Default, Clone)]
pub struct RunArgs {
    /// Checkpoint directory (config.json, safetensors shards + index).
    #[arg(required = true)]
    pub model_dir: Option<PathBuf>,
    /// Prompt token ids, comma-separated (no tokenizer needed).
    #[arg(long, value_delimiter = ',')]
    pub ids: Option<Vec<u32>>,
    /// Prompt text (needs --tok); encoded as plain text (control-marker strings stay text).
    #[arg(long)]
    pub prompt: Option<String>,
    /// Prompt file, raw bytes (must be UTF-8; needs --tok).
    #[arg(long)]
    pub prompt_file: Option<PathBuf>,
    /// Tokenizer directory (tiktoken.model + tokenizer_config.json), e.g. the model directory.
    #[arg(long)]
    pub tok: Option<PathBuf>,
    /// Maximum context (positions) to plan the KV cache for (default: prompt + --gen).
    #[arg(long)]
    pub max_context: Option<usize>,
    #[command(flatten)]
    pub chat: crate::chat::ChatArgs,
    /// Number of tokens to generate (max 4096).
    #[arg(long = "gen", default_value_t = 8)]
    pub n_gen: usize,
    /// Keep KV cache and recurrent state between tokens (otherwise recompute the prefix).
    #[arg(long)]
    pub incremental: bool,
    /// Worker threads (default: physical cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// JSON result file.
    #[arg(long, default_value = "k3_run.json")]
    pub out: PathBuf,
    /// Write the first-step f32 logits (little-endian) here.
    #[arg(long)]
    pub dump_logits: Option<PathBuf>,
    /// Stop when one of these ids is generated (up to 8).
    #[arg(long = "stop-id")]
    pub stop_ids: Vec<u32>,
    /// Model manifest (default: the built-in kimi-k3 manifest).
    #[arg(long)]
    pub manifest: Option<PathBuf>,
    /// Model config (default MODEL_DIR/config.json).
    #[arg(long)]
    pub config: Option<PathBuf>,
}

/// A failure with its exit code.
#[derive(Debug)]
pub struct Failure {
    pub code: u8,
    pub msg: String,
}

impl Failure {
    pub fn usage(msg: impl Into<String>) -> Failure {
        Failure {
            code: exit::USAGE,
            msg: msg.into(),
        }
    }
}

fn exec_failure(e: ExecError) -> Failure {
    let code = match &e {
        ExecError::Weight(WeightError::Expert { .. }) => exit::EXPERT_LOAD,
        _ => exit::FORWARD,
    };
    Failure {
        code,
        msg: e.to_string(),
    }
}

/// Load and validate the model spec (manifest + config.json). Exit code 2 on any problem.
pub fn load_spec(
    model_dir: &Path,
    manifest: Option<&Path>,
    config: Option<&Path>,
) -> Result<ModelSpec, Failure> {
    let config = config
        .map(Path::to_path_buf)
        .unwrap_or_else(|| model_dir.join("config.json"));
    let spec = match manifest {
        Some(m) => k3_models::load_spec(m, &config),
        None => {
            let text = std::fs::read_to_string(&config).map_err(|e| {
                Failure::usage(format!(
                    "cannot read model config {}: {e}",
                    config.display()
                ))
            })?;
            k3_models::load_spec_from_str(
                KIMI_K3_MANIFEST,
                "<built-in configs/models/kimi-k3.toml>",
                &text,
                &config.display().to_string(),
            )
        }
    };
    spec.map_err(|e| Failure::usage(e.to_string()))
}

pub fn default_threads() -> usize {
    let avail = std::thread::available_parallelism().map_or(1, |n| n.get());
    num_cpus::get_physical().min(avail).max(1)
}

/// The prompt ids from exactly one of --ids, --prompt (with --tok), --prompt-file (with --tok).
pub fn prompt_ids(a: &RunArgs) -> Result<Vec<u32>, Failure> {
    let given = [a.ids.is_some(), a.prompt.is_some(), a.prompt_file.is_some()];
    if given.iter().filter(|&&g| g).count() != 1 {
        return Err(Failure::usage(
            "exactly one of --ids, --prompt, --prompt-file is required",
        ));
    }
    if let Some(ids) = &a.ids {
        return Ok(ids.clone());
    }
    let tok_dir = a
        .tok
        .as_deref()
        .ok_or_else(|| Failure::usage("--prompt and --prompt-file need --tok DIR"))?;
    let tok =
        k3_text::tokenizer::Tokenizer::load(tok_dir).map_err(|e| Failure::usage(e.to_string()))?;
    let ids = match (&a.prompt, &a.prompt_file) {
        (Some(p), _) => tok.encode_text(p),
        (None, Some(f)) => {
            let bytes = std::fs::read(f).map_err(|e| {
                Failure::usage(format!("cannot read --prompt-file {}: {e}", f.display()))
            })?;
            tok.encode_bytes(&bytes, &f.display().to_string())
        }
        (None, None) => unreachable!("checked above: exactly one prompt source"),
    };
    ids.map_err(|e| Failure::usage(e.to_string()))
}

fn run_main(a: &RunArgs) -> Result<u8, Failure> {
    if a.chat.chat {
        return chat_main(a);
    }
    let model_dir = a
        .model_dir
        .as_deref()
        .ok_or_else(|| Failure::usage("a model directory is required"))?;
    let prompt = prompt_ids(a)?;
    if prompt.is_empty() {
        return Err(Failure::usage("the prompt is empty"));
    }
    if a.n_gen > 4096 {
        return Err(Failure::usage(format!(
            "--gen {} exceeds the maximum of 4096",
            a.n_gen
        )));
    }
    if a.stop_ids.len() > 8 {
        return Err(Failure::usage("at most 8 --stop-id values"));
    }
    let spec = load_spec(model_dir, a.manifest.as_deref(), a.config.as_deref())?;
    if let Some(bad) = prompt.iter().find(|&&t| t as usize >= spec.vocab_size) {
        return Err(Failure::usage(format!(
            "--ids: token {bad} is outside the vocabulary (size {})",
            spec.vocab_size
        )));
    }
    let ckpt = Checkpoint::open(model_dir, &spec).map_err(|e| Failure {
        code: exit::FORWARD,
        msg: e.to_string(),
    })?;
    let threads = a.threads.unwrap_or_else(default_threads).max(1);
    let positions = a
        .max_context
        .unwrap_or(prompt.len() + a.n_gen)
        .max(prompt.len() + a.n_gen);
    let plan = Plan::new(&spec, positions);
    eprintln!(
        "k3-run: {} ({} layers, d_model {}, vocab {}), {} threads, {} ISA",
        spec.name,
        spec.n_layers,
        spec.d_model,
        spec.vocab_size,
        threads,
        format!("{:?}", k3_kernels::isa::active()).to_lowercase()
    );
    eprintln!(
        "memory plan: trunk resident {:.3} GB, experts resident {:.3} GB, decode state {:.3} MB for {} positions",
        plan.trunk_bytes() as f64 / 1e9,
        plan.expert_bytes() as f64 / 1e9,
        plan.state_bytes_for(positions) as f64 / 1e6,
        positions
    );
    let bind = |e: WeightError| Failure {
        code: exit::FORWARD,
        msg: e.to_string(),
    };
    let mut providers = Providers {
        trunk: Box::new(ResidentTrunk::new(&spec, &ckpt).map_err(bind)?),
        experts: Box::new(ResidentExperts::new(&spec, &ckpt)),
        global: Box::new(ResidentGlobal::new(&spec, &ckpt).map_err(bind)?),
    };
    let mut exec = Executor::new(&spec, plan, threads);
    let req = GenRequest {
        prompt_ids: prompt,
        n_gen: a.n_gen,
        incremental: a.incremental,
        stop_ids: a.stop_ids.clone(),
    };
    let mut on_token = |i: usize, id: u32, t: f64| {
        println!("token {i:>4}: {id:>7}  ({t:.3} s)");
        true
    };
    let res = run::generate(&spec, &mut exec, &mut providers, &req, &mut on_token)
        .map_err(exec_failure)?;
    let trunk = providers.trunk.stats();
    let experts = providers.experts.stats();
    let peak = run::peak_rss_bytes();
    println!("generated ids: {:?}", res.generated_ids);
    println!(
        "first token {:.3} s, decode {:.4} s/token ({} mode), first-step logits hash {}",
        res.first_token_seconds,
        res.seconds_per_token,
        if a.incremental {
            "incremental"
        } else {
            "full recompute"
        },
        res.first_logits_hash
    );
    println!(
        "expert cache: requests {} hits {} misses {} evictions {} TRUE resident hit rate {:.1}%",
        experts.requests,
        experts.hits,
        experts.misses,
        experts.evictions,
        100.0 * experts.resident_hit_rate()
    );
    println!(
        "trunk: {}/{} layers pinned, {} bytes read",
        trunk.pinned_layers, trunk.n_layers, trunk.bytes_read
    );
    println!(
        "PEAK RSS {:.1} MB (getrusage; quote this, not the plan)",
        peak as f64 / 1e6
    );
    if let Some(p) = &a.dump_logits {
        let bytes: Vec<u8> = res
            .first_logits
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        std::fs::write(p, bytes).map_err(|e| Failure {
            code: exit::OUT_WRITE,
            msg: format!("cannot write --dump-logits {}: {e}", p.display()),
        })?;
    }
    let total_io = trunk.read_seconds + experts.read_seconds;
    let json = serde_json::json!({
        "model": spec.name,
        "prompt_ids": res.prompt_ids,
        "generated_ids": res.generated_ids,
        "first_logits_hash": res.first_logits_hash,
        "incremental": a.incremental,
        "threads": threads,
        "isa": format!("{:?}", k3_kernels::isa::active()).to_lowercase(),
        "prefill_seconds": res.prefill_seconds,
        "first_token_seconds": res.first_token_seconds,
        "seconds_per_token": res.seconds_per_token,
        "total_seconds": res.total_seconds,
        "peak_rss_bytes": peak,
        "stopped_by": res.stopped_by,
        "trunk": trunk,
        "experts": {
            "requests": experts.requests,
            "hits": experts.hits,
            "misses": experts.misses,
            "evictions": experts.evictions,
            "resident_hit_rate": experts.resident_hit_rate(),
            "bytes_read": experts.bytes_read,
            "read_seconds": experts.read_seconds,
            "load_failures": experts.load_failures,
        },
        "io_share": if res.total_seconds > 0.0 { total_io / res.total_seconds } else { 0.0 },
    });
    let text = serde_json::to_string_pretty(&json).map_err(|e| Failure {
        code: exit::OUT_WRITE,
        msg: e.to_string(),
    })?;
    write_atomic(&a.out, text.as_bytes()).map_err(|e| Failure {
        code: exit::OUT_WRITE,
        msg: format!("cannot write --out {}: {e}", a.out.display()),
    })?;
    Ok(exit::OK)
}

/// `--chat`: load the model resident and hand it to the REPL.
fn chat_main(a: &RunArgs) -> Result<u8, Failure> {
    let model_dir = a
        .model_dir
        .as_deref()
        .ok_or_else(|| Failure::usage("a model directory is required"))?;
    let spec = load_spec(model_dir, a.manifest.as_deref(), a.config.as_deref())?;
    let ckpt = Checkpoint::open(model_dir, &spec).map_err(|e| Failure {
        code: exit::FORWARD,
        msg: e.to_string(),
    })?;
    let threads = a.threads.unwrap_or_else(default_threads).max(1);
    let positions = a.max_context.unwrap_or(8192);
    let bind = |e: WeightError| Failure {
        code: exit::FORWARD,
        msg: e.to_string(),
    };
    let mut providers = Providers {
        trunk: Box::new(ResidentTrunk::new(&spec, &ckpt).map_err(bind)?),
        experts: Box::new(ResidentExperts::new(&spec, &ckpt)),
        global: Box::new(ResidentGlobal::new(&spec, &ckpt).map_err(bind)?),
    };
    let mut exec = Executor::new(&spec, Plan::new(&spec, positions), threads);
    crate::chat::repl_main(&spec, &mut exec, &mut providers, a)
}

/// Write a file via a temporary name and rename, so a reader never sees half a file.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp-k3run");
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

fn plan_main(p: &PlanCli) -> Result<u8, Failure> {
    let spec = load_spec(&p.model_dir, p.manifest.as_deref(), p.config.as_deref())?;
    let plan = Plan::new(&spec, p.positions);
    if p.json {
        let s = serde_json::to_string_pretty(&plan).map_err(|e| Failure::usage(e.to_string()))?;
        println!("{s}");
    } else {
        print!("{plan}");
    }
    Ok(exit::OK)
}

/// Entry point used by `main`.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match &cli.command {
        Some(Command::Plan(p)) => plan_main(p),
        Some(Command::Synth(s)) => match crate::synth::run(s) {
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
        None => run_main(&cli.run),
    };
    match r {
        Ok(c) => ExitCode::from(c),
        Err(f) => {
            eprintln!("k3-run: error: {}", f.msg);
            ExitCode::from(f.code)
        }
    }
}
