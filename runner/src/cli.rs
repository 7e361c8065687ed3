//! Command-line interface of `k3-run`: flags, subcommands, exit codes, the printed report.
//!
//! Owns: argument parsing (clap), wiring flags to the library, what is printed, exit codes
//! (SYSTEM.md §6): 0 success; 1 tensor binding or forward failure; 2 usage error or a config
//! that cannot be read with confidence; 3 run finished but `--out` could not be written; 4 run
//! finished but a routed expert failed to load; 5 stopped early by Ctrl-C.
//! Must not: contain model math or storage logic.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};
use k3_models::spec::{ModelSpec, TensorRole};

use crate::checkpoint::Checkpoint;
use crate::exec::{ExecError, Executor};
use crate::plan::Plan;
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
    /// Check the machine: memory, the preset to use, disk read bandwidth as the engine reads.
    Doctor(crate::doctor::DoctorArgs),
    /// Pack the dense trunk into one file (trunk.bin + trunk.json) for streaming, once (--check: compare a pack with the checkpoint).
    PackTrunk(PackCli),
    /// Replay an expert-request trace under LRU and Belady's optimum at several capacities.
    SimCache(SimCli),
    /// Plugins: `plugins list [PLUGIN...]` shows name, kind and ABI version of each.
    Plugins(crate::plugins_cmd::PluginsCli),
    /// Print exactly what the model will see for a transcript plus the generation prompt.
    RenderChat(crate::chat::RenderChatArgs),
    /// Check a download: shard count, exact total bytes, every shard's size (headers only);
    /// names the shards to fetch again.
    Verify(crate::verify::VerifyArgs),
    /// Classify every tensor (routed expert, shared expert, attention, embedding, other) and
    /// print the resident floor.
    Budget(crate::budget::BudgetArgs),
}

#[derive(Args, Debug)]
pub struct PackCli {
    /// Checkpoint directory.
    pub model_dir: PathBuf,
    /// Output directory for trunk.bin + trunk.json (with --check: the packed trunk to check).
    pub trunk_dir: PathBuf,
    /// Model manifest (default: the built-in kimi-k3 manifest).
    #[arg(long)]
    pub manifest: Option<PathBuf>,
    /// Store the layers compressed, losslessly (byte planes; the bf16 sign/exponent bytes as
    /// 4-bit codes): ~25% fewer bytes read per pass over the trunk, decoded in place by the
    /// reader threads back to the same bytes, at no extra memory (docs/STREAMING.md,
    /// "Compressed trunk").
    #[arg(long)]
    pub compress: bool,
    /// With --compress: raw KiB per record (a multiple of 4; default 512). Smaller chunks
    /// only cost a little more index; for testing several records per layer on small models.
    #[arg(long, value_name = "KIB", requires = "compress")]
    pub chunk_kib: Option<u64>,
    /// Do not pack: read the packed trunk in TRUNK_DIR as a run reads it (compressed records
    /// decoded) and compare every tensor with the checkpoint's bytes. Exit 0 when all equal,
    /// 1 naming the layers and tensors that differ (pack again), 5 on Ctrl-C.
    #[arg(long, conflicts_with_all = ["compress", "chunk_kib"])]
    pub check: bool,
}

#[derive(Args, Debug)]
pub struct SimCli {
    /// expert_trace.bin written by --dump-cache-trace.
    pub trace: PathBuf,
    /// Capacities to simulate, in experts (comma-separated).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "8,16,32,64,128,256,512,1024"
    )]
    pub capacities: Vec<usize>,
    /// Bytes of one expert (to print capacities in GB).
    #[arg(long)]
    pub expert_bytes: Option<u64>,
    /// Also replay the trace through this cache-policy plugin (repeatable): its hit rate and
    /// the share of the LRU-to-Belady gap it closes. A bare name is looked for in the current
    /// directory, configs/plugins and next to k3-run.
    #[arg(long = "plugin", value_name = "PLUGIN")]
    pub plugins: Vec<PathBuf>,
    /// KEY=VALUE for the plugins' create (repeatable; `trace=` is set to TRACE).
    #[arg(long = "plugin-opt", value_name = "KEY=VALUE")]
    pub plugin_opts: Vec<String>,
}

/// Memory and I/O flags (SYSTEM.md §5). For the two budgets, the later of `--preset` and the
/// explicit flag on the command line wins.
#[derive(Args, Debug, Default, Clone)]
pub struct MemArgs {
    /// Packed trunk directory (from `k3-run pack-trunk`): stream the dense trunk.
    #[arg(long)]
    pub trunk: Option<PathBuf>,
    /// Memory preset: ultra, laptop, desktop, workstation, server, max, or a preset TOML file.
    #[arg(long)]
    pub preset: Option<String>,
    /// Trunk budget in GB (pinned prefix + ring slots); fractions allowed.
    #[arg(long)]
    pub trunk_gb: Option<f64>,
    /// Routed-expert cache budget in GB; fractions allowed (0 = no caching).
    #[arg(long)]
    pub cache_gb: Option<f64>,
    /// Ring slots for streamed layers (default 2; the budget wins).
    #[arg(long, default_value_t = 2)]
    pub trunk_ring: usize,
    /// Stream embedding rows and lm_head chunks instead of keeping them resident.
    #[arg(long)]
    pub ultra_low_memory: bool,
    /// I/O policy: direct (default), page-cache (the pinned prefix held in trunk.bin's page
    /// cache), mmap, or a policy TOML file.
    #[arg(long)]
    pub io: Option<String>,
    /// Where the resident weights live: mmap (default: the checkpoint's memory maps, page
    /// cache) or arena (loaded at start into 2 MiB-page RAM with O_DIRECT reads; falls back to
    /// mmap when it does not fit). Same bits either way. Default from K3_RESIDENT, else mmap.
    #[arg(long, value_name = "mmap|arena")]
    pub resident: Option<String>,
    /// Write every (layer, expert) request (expert_trace.bin) and a histogram here; the same
    /// requests whether the experts are resident or cached (also with --batch-ids).
    #[arg(long)]
    pub dump_cache_trace: Option<PathBuf>,
    /// Expert-cache policy plugin (a library speaking plugins/abi; default: built-in LRU). A
    /// bare name (e.g. `lfu`) is looked for in the current directory, $K3_PLUGIN_DIR,
    /// configs/plugins and next to k3-run (`k3-run plugins list`).
    #[arg(long)]
    pub eviction_plugin: Option<PathBuf>,
    /// KEY=VALUE given to the plugins' create (repeatable), e.g. `trace=t/expert_trace.bin`
    /// for the belady plugin, `out=run.json` for the replay drafter.
    #[arg(long = "plugin-opt", value_name = "KEY=VALUE")]
    pub plugin_opts: Vec<String>,
    /// Speculative expert prefetch with a streamed expert cache: guess each MoE layer's
    /// top-(k + margin) experts ahead of its routing and read them meanwhile. `true` (or no
    /// value): margin 0; a number: that margin; `false`: off. Default: on (margin 0) when the
    /// cache holds 3 layers of guesses, else off.
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL|MARGIN",
          value_parser = parse_prefetch)]
    pub expert_prefetch: Option<PrefetchArg>,
    /// Print the preset table and exit.
    #[arg(long)]
    pub list_presets: bool,
}

/// `--expert-prefetch` value: the guess margin, or `None` for off.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefetchArg(pub Option<usize>);

fn parse_prefetch(v: &str) -> Result<PrefetchArg, String> {
    match v {
        "true" | "on" => Ok(PrefetchArg(Some(crate::session::DEFAULT_PREFETCH_MARGIN))),
        "false" | "off" => Ok(PrefetchArg(None)),
        n => n
            .parse::<usize>()
            .ok()
            .filter(|&m| m <= 4096)
            .map(|m| PrefetchArg(Some(m)))
            .ok_or_else(|| format!("expected true, false or a margin (0..=4096), got {n:?}")),
    }
}

#[derive(Args, Debug)]
pub struct PlanCli {
    /// Checkpoint directory.
    pub model_dir: PathBuf,
    /// Model manifest (default: the built-in kimi-k3 manifest).
    #[arg(long)]
    pub manifest: Option<PathBuf>,
    /// The model's config.json (JSON; default MODEL_DIR/config.json). Not a run config
    /// (.toml): plan takes a run config's manifest with --manifest.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Context length to plan the KV cache for.
    #[arg(long, default_value_t = 4096)]
    pub positions: usize,
    /// Print the plan as JSON.
    #[arg(long)]
    pub json: bool,
    /// Also plan this packed trunk (pack-trunk's output) at `--trunk-gb` or a preset's trunk
    /// budget: pinned layers, ring slots or shared ring, layers read ahead. Nothing is read
    /// but trunk.json.
    #[arg(long)]
    pub trunk: Option<PathBuf>,
    /// Trunk budget in GB for `--trunk` (fractions allowed; wins over `--preset`).
    #[arg(long, requires = "trunk")]
    pub trunk_gb: Option<f64>,
    /// A preset whose trunk budget to plan `--trunk` at.
    #[arg(long, requires = "trunk")]
    pub preset: Option<String>,
    /// Ring slots asked for (default 2; the budget wins).
    #[arg(long, requires = "trunk", default_value_t = 2)]
    pub trunk_ring: usize,
}

#[derive(Args, Debug, Default, Clone)]
pub struct RunArgs {
    /// Checkpoint directory (config.json, safetensors shards + index).
    pub model_dir: Option<PathBuf>,
    /// Prompt token ids, comma-separated (no tokenizer needed).
    #[arg(long, value_delimiter = ',')]
    pub ids: Option<Vec<u32>>,
    /// Several prompts decoded together, id lists separated by ';' (e.g. "1,2,3;4,5"): every
    /// decode step feeds each sequence one token and reads a streamed trunk once for all of
    /// them; each sequence's ids equal generating it alone.
    #[arg(long, value_name = "IDS;IDS...", conflicts_with_all = ["ids", "prompt", "prompt_file", "chat", "serve", "save_state", "load_state"])]
    pub batch_ids: Option<String>,
    /// Prompt text (needs --tok); encoded as plain text (control-marker strings stay text).
    #[arg(long)]
    pub prompt: Option<String>,
    /// Prompt file, raw bytes (must be UTF-8; needs --tok).
    #[arg(long)]
    pub prompt_file: Option<PathBuf>,
    /// Tokenizer directory (tiktoken.model + tokenizer_config.json), e.g. the model directory.
    #[arg(long)]
    pub tok: Option<PathBuf>,
    /// With --gen 0: prefill the prompt and save the exact decode state here.
    #[arg(long)]
    pub save_state: Option<PathBuf>,
    /// Resume from a state saved with --save-state; the prompt continues after it.
    #[arg(long)]
    pub load_state: Option<PathBuf>,
    /// Maximum context (positions) to plan the KV cache for (default: prompt + --gen, plus
    /// the positions of --load-state; with --batch-ids the longest prompt + --gen). A value
    /// below what the request needs is a usage error. With --chat / --serve: default 8192.
    #[arg(long)]
    pub max_context: Option<usize>,
    #[command(flatten)]
    pub mem: MemArgs,
    #[command(flatten)]
    pub chat: crate::chat::ChatArgs,
    /// Command-line positions of --preset / --trunk-gb / --cache-gb (filled by `main`).
    #[arg(skip)]
    pub order: FlagOrder,
    /// Number of tokens to generate (max 4096).
    #[arg(long = "gen", default_value_t = 8)]
    pub n_gen: usize,
    /// Keep KV cache and recurrent state between tokens (otherwise recompute the prefix).
    #[arg(long)]
    pub incremental: bool,
    /// Speculative decoding (with --incremental, or in greedy --chat / --serve turns): verify
    /// up to K guessed next tokens, taken from where the context's last tokens occurred
    /// before, in one pass over the weights; the same ids as without it, fewer trunk reads
    /// when guesses hold (1..=32).
    #[arg(long, value_name = "K", conflicts_with = "batch_ids")]
    pub speculate: Option<usize>,
    /// With --speculate: take the guesses from this draft-provider plugin (e.g. `ngram`,
    /// `replay`) instead of the built-in prompt lookup; the same ids either way.
    #[arg(long, value_name = "PLUGIN", requires = "speculate", conflicts_with_all = ["chat", "serve"])]
    pub draft_plugin: Option<PathBuf>,
    /// Prompt tokens per pass over the weights (1..=4096; default 64, or 256 when trunk layers
    /// are read from disk on every pass and the memory allows): a streamed trunk is read once
    /// per chunk; each token of a chunk holds working memory (printed with the decode state and
    /// checked with it). The output does not depend on it.
    #[arg(long, value_name = "N")]
    pub prefill_chunk: Option<usize>,
    /// Worker threads (default: physical cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// JSON result file.
    #[arg(long, default_value = "k3_run.json")]
    pub out: PathBuf,
    /// Write the first-step f32 logits (little-endian) here. With --batch-ids: each
    /// sequence's first-step logits (vocab x 4 bytes each), concatenated in prompt order.
    #[arg(long)]
    pub dump_logits: Option<PathBuf>,
    /// Write the first step's EARLY-EXIT logits here: f32 little-endian [layers, vocab], row
    /// L-1 = what `--layers L` gives (the output AttnRes after layer L, final norm, lm_head);
    /// the last row equals --dump-logits. One extra lm_head pass per layer in the last prompt
    /// chunk. A --ids / --prompt run only (fixtures/oracle/conform_layers.py compares it).
    #[arg(long, value_name = "FILE")]
    pub dump_layer_logits: Option<PathBuf>,
    /// Write the logits after EVERY prompt token here (teacher forcing over the prompt): f32
    /// little-endian [prompt tokens, vocab], row i after prompt token i, each the bits
    /// token-by-token decoding gives; the last row equals --dump-logits. --out then also has
    /// `prompt_argmax`. The lm_head runs once per prompt token; the rows are held in memory
    /// until written (refused up front when they would take over a quarter of the memory
    /// available). A --ids / --prompt run only (fixtures/oracle/compare_k3.py --tf-logits).
    #[arg(long, value_name = "FILE")]
    pub dump_prompt_logits: Option<PathBuf>,
    /// Stop when one of these ids is generated (up to 8).
    #[arg(long = "stop-id")]
    pub stop_ids: Vec<u32>,
    /// Model manifest (default: the built-in kimi-k3 manifest).
    #[arg(long)]
    pub manifest: Option<PathBuf>,
    /// A run config (configs/*.toml: manifest + preset + I/O policy), or the model's
    /// config.json if the name does not end in .toml (default MODEL_DIR/config.json).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Bind only the first N layers (a diagnostic for partial shard sets: shards that hold
    /// only later layers may be missing). The output is not the whole model's.
    #[arg(long, value_name = "N")]
    pub layers: Option<usize>,
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

pub(crate) fn exec_failure(e: ExecError) -> Failure {
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
    load_spec_files(model_dir, manifest, config).map(|(spec, _)| spec)
}

/// [`load_spec`], and the checkpoint's files when they opened (headers parsed, shards
/// mapped, no model check yet): [`open_checkpoint`] takes them instead of opening again.
pub fn load_spec_files(
    model_dir: &Path,
    manifest: Option<&Path>,
    config: Option<&Path>,
) -> Result<(ModelSpec, Option<Checkpoint>), Failure> {
    let config = config
        .map(Path::to_path_buf)
        .unwrap_or_else(|| model_dir.join("config.json"));
    // The files first: the index's text is held while it is parsed (59 MB at the release's
    // 497,056 tensors), and the spec's declarations (81 MB there) are not yet beside it.
    let files = Checkpoint::open_unchecked(model_dir).ok();
    let spec = match manifest {
        Some(m) => k3_models::load_spec(m, &config),
        None => {
            let text = k3_models::load::read_regular_file(&config).map_err(|e| {
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
    let spec = spec.map_err(|e| Failure::usage(e.to_string()))?;
    Ok((adopt_stored_a_log_len(spec, files.as_ref()), files))
}

/// `A_log` padding is storage-only (one entry per KDA head, then zeros, checked at open), and
/// the manifest's length rule is what the released checkpoint uses. A checkpoint that pads to
/// another length (every layer's `A_log` the same length, same layout, at least one entry per
/// head) is the same model: bind its stored length. Anything else is left to the checkpoint's
/// shape check, which names the tensor. No checkpoint in `model_dir` (e.g. `plan --config`)
/// leaves the spec as it is.
fn adopt_stored_a_log_len(spec: ModelSpec, files: Option<&Checkpoint>) -> ModelSpec {
    let Some((rule_len, heads)) = spec.kda.as_ref().map(|k| (k.a_log_len, k.n_heads)) else {
        return spec;
    };
    let Some(ck) = files else {
        return spec;
    };
    let mut stored = None;
    for d in spec
        .tensors
        .iter()
        .filter(|d| d.role == TensorRole::KdaALog)
    {
        let Some((_, shape)) = ck.info(&d.name) else {
            return spec;
        };
        // the declared layout with one free dimension: `[n]` or `[1, 1, n, 1]`
        let at = if d.shape.len() == 4 { 2 } else { 0 };
        let same_layout = shape.len() == d.shape.len()
            && shape
                .iter()
                .zip(&d.shape)
                .enumerate()
                .all(|(i, (s, want))| i == at || s == want);
        if !same_layout || stored.is_some_and(|n| n != shape[at]) {
            return spec;
        }
        stored = Some(shape[at]);
    }
    match stored {
        Some(n) if n != rule_len && n >= heads => spec.with_stored_a_log_len(n).unwrap_or(spec),
        _ => spec,
    }
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
            let bytes = read_prompt_file(f)?;
            tok.encode_bytes(&bytes, &f.display().to_string())
        }
        (None, None) => unreachable!("checked above: exactly one prompt source"),
    };
    ids.map_err(|e| Failure::usage(e.to_string()))
}

/// Where --preset, --trunk-gb and --cache-gb appeared on the command line (later wins).
#[derive(Clone, Copy, Debug, Default)]
pub struct FlagOrder {
    pub trunk_ring: Option<usize>,
    pub preset: Option<usize>,
    pub trunk_gb: Option<usize>,
    pub cache_gb: Option<usize>,
}

fn later(flag: Option<(usize, f64)>, preset: Option<(usize, f64)>) -> Option<f64> {
    match (flag, preset) {
        (Some((fi, f)), Some((pi, p))) => Some(if fi > pi { f } else { p }),
        (Some((_, f)), None) => Some(f),
        (None, Some((_, p))) => Some(p),
        (None, None) => None,
    }
}

/// Resolve the memory flags into settings (budgets: the later of preset and flag wins).
pub fn memory_settings(
    a: &RunArgs,
) -> Result<(crate::session::MemorySettings, Vec<String>), Failure> {
    use crate::stream::{gb_to_bytes, io_policy, presets};
    let m = &a.mem;
    let mut notes = Vec::new();
    let rc = run_config(a)?;
    if let Some(rc) = &rc {
        notes.push(format!("run config {}: {}", rc.name, rc.note));
    }
    let preset_name = m
        .preset
        .clone()
        .or_else(|| rc.as_ref().and_then(|r| r.preset.clone()));
    let preset = match &preset_name {
        Some(p) => Some(presets::load_preset(p).map_err(|e| Failure::usage(e.to_string()))?),
        None => None,
    };
    let ord = a.order;
    let pi = ord.preset.unwrap_or(0);
    let trunk_gb = later(
        m.trunk_gb.map(|v| (ord.trunk_gb.unwrap_or(1), v)),
        preset.as_ref().map(|p| (pi, p.trunk_gb)),
    );
    let cache_gb = later(
        m.cache_gb.map(|v| (ord.cache_gb.unwrap_or(1), v)),
        preset.as_ref().map(|p| (pi, p.cache_gb)),
    );
    if let Some(p) = &preset {
        let streamed = m.trunk.is_some();
        notes.push(format!(
            "preset {}: trunk {:.2} GB, expert cache {:.2} GB{} (effective: trunk {}, cache {}{})",
            p.name,
            p.trunk_gb,
            p.cache_gb,
            if p.ultra_low_memory {
                ", ultra-low-memory"
            } else {
                ""
            },
            match trunk_gb {
                Some(v) if streamed => format!("{v:.3} GB"),
                _ => "resident".into(),
            },
            cache_gb.map_or("-".into(), |v| format!("{v:.3} GB")),
            match (p.ultra_low_memory, streamed || m.ultra_low_memory) {
                (true, true) => ", ultra-low-memory",
                (true, false) => ", ultra-low-memory off",
                _ => "",
            },
        ));
        if !streamed {
            // Everything of the preset that needs a packed trunk is named: nothing is dropped
            // silently.
            notes.push(format!(
                "warning: preset {} assumes a packed trunk (--trunk DIR from `k3-run pack-trunk`); \
                 without it the trunk is resident, so the preset's trunk budget ({:.2} GB){} \
                 not applied; only the expert cache ({:.3} GB) is",
                p.name,
                p.trunk_gb,
                if p.ultra_low_memory {
                    " and its ultra-low-memory setting (streamed embedding rows and lm_head \
                     chunks, which needs --trunk: --ultra-low-memory without --trunk is \
                     refused) are"
                } else {
                    " is"
                },
                cache_gb.unwrap_or(p.cache_gb),
            ));
        }
    }
    let to_bytes = |v: Option<f64>, what: &str| -> Result<Option<u64>, Failure> {
        v.map(|g| gb_to_bytes(g, what))
            .transpose()
            .map_err(|e| Failure::usage(e.to_string()))
    };
    let io_name =
        m.io.clone()
            .or_else(|| rc.as_ref().map(|r| r.io.clone()))
            .unwrap_or_else(|| "direct".to_string());
    let io = io_policy::load_io_policy(&io_name).map_err(|e| Failure::usage(e.to_string()))?;
    let settings = crate::session::MemorySettings {
        trunk_dir: m.trunk.clone(),
        trunk_budget_bytes: if m.trunk.is_some() {
            to_bytes(trunk_gb, "--trunk-gb")?
        } else {
            None
        },
        cache_budget_bytes: to_bytes(cache_gb, "--cache-gb")?,
        ring_slots: match (a.order.trunk_ring, rc.as_ref().and_then(|r| r.trunk_ring)) {
            (None, Some(0)) => {
                return Err(Failure::usage(
                    "the run config's trunk_ring is 0: it must be at least 1",
                ));
            }
            (None, Some(n)) => n,
            _ if m.trunk_ring == 0 => {
                return Err(Failure::usage("--trunk-ring 0: it must be at least 1"));
            }
            _ => m.trunk_ring,
        },
        ultra_low_memory: m.ultra_low_memory
            || preset
                .as_ref()
                .is_some_and(|p| p.ultra_low_memory && m.trunk.is_some()),
        io,
        trace_experts: m.dump_cache_trace.is_some(),
        eviction_plugin: m.eviction_plugin.clone(),
        plugin_options: m.plugin_opts.clone(),
        expert_prefetch: match m.expert_prefetch {
            Some(PrefetchArg(margin)) => margin,
            None => crate::session::MemorySettings::default().expert_prefetch,
        },
        expert_prefetch_auto: m.expert_prefetch.is_none(),
    };
    // Flags that would be silently ignored by these settings are refused.
    if settings.trunk_dir.is_none() && (m.trunk_gb.is_some() || a.order.trunk_ring.is_some()) {
        return Err(Failure::usage(
            "--trunk-gb and --trunk-ring size a packed trunk's memory: add --trunk DIR (from \
             `k3-run pack-trunk`); without it the trunk is resident",
        ));
    }
    if settings.cache_budget_bytes.is_none()
        && (m.eviction_plugin.is_some() || m.expert_prefetch.is_some())
    {
        return Err(Failure::usage(
            "--eviction-plugin and --expert-prefetch act on the expert cache: add --cache-gb \
             (or a --preset); without it the routed experts are resident",
        ));
    }
    if !m.plugin_opts.is_empty() && m.eviction_plugin.is_none() && a.draft_plugin.is_none() {
        return Err(Failure::usage(
            "--plugin-opt configures a plugin: add --eviction-plugin or --draft-plugin",
        ));
    }
    if let Some(dir) = &settings.trunk_dir {
        check_trunk_dir(dir)?;
    }
    Ok((settings, notes))
}

/// `--trunk DIR` (a run's or `plan`'s): the directory must exist and hold a readable
/// `trunk.json`; otherwise a usage error naming the path (exit 2 in both).
pub fn check_trunk_dir(dir: &Path) -> Result<(), Failure> {
    use crate::stream::pack::TRUNK_JSON;
    let pack = format!(
        "a packed trunk is written by `k3-run pack-trunk MODEL_DIR {}`",
        dir.display()
    );
    match std::fs::metadata(dir) {
        Err(e) => {
            return Err(Failure::usage(format!(
                "--trunk {}: cannot read the directory: {e} ({pack})",
                dir.display()
            )));
        }
        Ok(md) if !md.is_dir() => {
            return Err(Failure::usage(format!(
                "--trunk {}: not a directory ({pack})",
                dir.display()
            )));
        }
        Ok(_) => {}
    }
    let json = dir.join(TRUNK_JSON);
    match std::fs::File::open(&json) {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(Failure::usage(format!(
            "--trunk {}: no {TRUNK_JSON}: not a packed trunk, or the pack did not finish ({pack})",
            dir.display()
        ))),
        Err(e) => Err(Failure::usage(format!(
            "--trunk {}: cannot read {}: {e} ({pack})",
            dir.display(),
            json.display()
        ))),
    }
}

/// What a file given to `--config` holds, judged from its text (for the error that says which
/// flag it belongs to).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ConfigKind {
    /// JSON: a model config.json.
    ModelJson,
    /// TOML with `manifest` / `io` / `preset`: a run config (`configs/*.toml`).
    RunToml,
    /// TOML with `family` / `[config]` / `[pins]` / `[[tensors]]`: a model manifest.
    ManifestToml,
    /// Unreadable or anything else.
    Other,
}

fn config_kind(path: &Path) -> ConfigKind {
    let Ok(text) = k3_models::load::read_regular_file(path) else {
        return ConfigKind::Other;
    };
    if serde_json::from_str::<serde_json::Value>(&text).is_ok_and(|v| v.is_object()) {
        return ConfigKind::ModelJson;
    }
    let Ok(t) = text.parse::<toml::Table>() else {
        return ConfigKind::Other;
    };
    if ["manifest", "io", "preset"]
        .iter()
        .any(|k| t.contains_key(*k))
    {
        ConfigKind::RunToml
    } else if ["family", "config", "pins", "tensors"]
        .iter()
        .any(|k| t.contains_key(*k))
    {
        ConfigKind::ManifestToml
    } else {
        ConfigKind::Other
    }
}

/// `plan --config FILE`: the model's config.json. A run config or a manifest (TOML) is refused
/// up front, saying what the flag expects and which flag the file belongs to.
fn check_plan_config(path: &Path) -> Result<(), Failure> {
    let toml_name = path.extension().is_some_and(|e| e == "toml");
    let kind = config_kind(path);
    let what = match kind {
        ConfigKind::RunToml => "a run config (TOML)",
        ConfigKind::ManifestToml => "a model manifest (TOML)",
        ConfigKind::Other if toml_name => "a .toml file",
        _ => return Ok(()),
    };
    let hint = match kind {
        ConfigKind::ManifestToml => format!("give it with `plan --manifest {}`", path.display()),
        ConfigKind::RunToml => {
            let (manifest, preset) = match crate::runconfig::RunConfig::load(path) {
                Ok(rc) => (
                    rc.manifest.display().to_string(),
                    rc.preset.unwrap_or_else(|| "NAME".into()),
                ),
                Err(_) => ("MANIFEST.toml".into(), "NAME".into()),
            };
            format!(
                "a run config belongs to a run's --config (`k3-run MODEL_DIR --config FILE.toml \
                 ...`); to plan with its manifest give `plan --manifest {manifest}`, and its \
                 preset with `plan --trunk DIR --preset {preset}`"
            )
        }
        _ => "a run config (.toml) belongs to a run's --config (`k3-run MODEL_DIR --config \
              FILE.toml ...`), a model manifest to --manifest"
            .to_string(),
    };
    Err(Failure::usage(format!(
        "plan --config {}: expects the model's config.json (JSON), but this is {what}: {hint}",
        path.display()
    )))
}

/// `--config FILE.toml` is a run config (manifest + preset + I/O policy); `--config FILE.json`
/// (or any other name) is the model's config.json (SYSTEM.md §6). A file given under the
/// other kind's name (a run config not named .toml, a manifest or a config.json named .toml) is
/// refused saying what the flag expects and which flag the file belongs to.
pub fn run_config(a: &RunArgs) -> Result<Option<crate::runconfig::RunConfig>, Failure> {
    let Some(p) = &a.config else {
        return Ok(None);
    };
    let toml_name = p.extension().is_some_and(|e| e == "toml");
    let expects = "--config takes a run config named *.toml (configs/*.toml: manifest + preset + \
                   I/O policy) or the model's config.json (any other name)";
    match (toml_name, config_kind(p)) {
        (_, ConfigKind::ManifestToml) => Err(Failure::usage(format!(
            "--config {}: this is a model manifest (TOML); {expects}: give a manifest with \
             --manifest {}",
            p.display(),
            p.display()
        ))),
        (true, ConfigKind::ModelJson) => Err(Failure::usage(format!(
            "--config {}: this is JSON (a model config.json) but the name ends in .toml; \
             {expects}: rename it to .json",
            p.display()
        ))),
        (false, ConfigKind::RunToml) => Err(Failure::usage(format!(
            "--config {}: this is a run config (TOML) but the name does not end in .toml, so it \
             would be read as the model's config.json; {expects}: rename it to .toml",
            p.display()
        ))),
        (true, _) => crate::runconfig::RunConfig::load(p)
            .map(Some)
            .map_err(|e| Failure::usage(e.to_string())),
        (false, _) => Ok(None),
    }
}

/// The model spec for a run: manifest from --manifest, else the run config's, else built in;
/// config.json from --config FILE.json, else MODEL_DIR/config.json.
/// The checkpoint's files come with the spec (see [`load_spec_files`]).
fn run_spec_files(
    a: &RunArgs,
    model_dir: &Path,
) -> Result<(ModelSpec, Option<Checkpoint>), Failure> {
    let rc = run_config(a)?;
    let manifest = a
        .manifest
        .clone()
        .or_else(|| rc.as_ref().map(|r| r.manifest.clone()));
    let config = if rc.is_some() {
        None
    } else {
        a.config.as_deref()
    };
    let (spec, files) = load_spec_files(model_dir, manifest.as_deref(), config)?;
    match a.layers {
        Some(n) => Ok((spec.first_layers(n).map_err(Failure::usage)?, files)),
        None => Ok((spec, files)),
    }
}

/// Worker threads: --threads, else the run config's, else physical cores.
/// Progress of a prompt on a terminal (stderr): a bar over its token-layers (`tokens` x
/// `layers`), or a counter when the token count is not known in advance (`None`: a chat turn's
/// prompt, which depends on the reused state); `None` when stderr is not a terminal or the
/// prompt is one token. Fed by [`Executor::set_layer_hook`].
pub(crate) fn prompt_progress(
    tokens: Option<usize>,
    layers: usize,
) -> Option<indicatif::ProgressBar> {
    use std::io::IsTerminal;
    if tokens.is_some_and(|t| t < 2) || !std::io::stderr().is_terminal() {
        return None;
    }
    let (bar, template) = match tokens {
        Some(t) => (
            indicatif::ProgressBar::new((t * layers) as u64),
            format!("prompt of {t} tokens [{{bar:30}}] {{percent:>3}}% ({{elapsed}}, ETA {{eta}})"),
        ),
        None => (
            indicatif::ProgressBar::new_spinner(),
            format!(
                "{{spinner}} prompt: {{pos}} token-layers fed ({layers} per token, {{elapsed}})"
            ),
        ),
    };
    if let Ok(style) = indicatif::ProgressStyle::with_template(&template) {
        bar.set_style(style.progress_chars("=> "));
    }
    Some(bar)
}

/// Run `f` with [`prompt_progress`] fed by the executor's layer hook; the bar is cleared when
/// `f` returns (or earlier by `f` through the handle it gets).
pub(crate) fn with_prompt_progress<'s, T>(
    exec: &mut Executor<'s>,
    tokens: Option<usize>,
    f: impl FnOnce(&mut Executor<'s>, Option<&indicatif::ProgressBar>) -> T,
) -> T {
    let bar = prompt_progress(tokens, exec.spec().n_layers);
    if let Some(b) = bar.clone() {
        exec.set_layer_hook(Some(Box::new(move |n| {
            if !b.is_finished() {
                b.inc(n as u64);
            }
        })));
    }
    let r = f(exec, bar.as_ref());
    exec.set_layer_hook(None);
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    r
}

/// Prompt tokens per pass when trunk layers are read from disk on every pass and
/// `--prefill-chunk` is not given: a long prompt then costs a quarter of the trunk reads of
/// [`crate::exec::PREFILL_CHUNK`] (real K3 at the laptop preset: ~108 GB per pass).
pub const STREAMED_PREFILL_CHUNK: usize = 256;

/// The up-front decode-state check of `sequences` sequences of `positions` positions (the
/// line to print), after choosing the prompt chunk: without `--prefill-chunk`, a streamed
/// trunk takes [`STREAMED_PREFILL_CHUNK`] when its working memory fits beside the rest, else
/// the default.
fn check_states_and_chunk(
    a: &RunArgs,
    plan: &mut Plan,
    session: &crate::session::Session<'_>,
    (positions, sequences): (usize, usize),
    limit: Option<u64>,
) -> Result<String, Failure> {
    let check = |plan: &Plan| {
        crate::session::check_states(plan, positions, sequences, session.planned_bytes, limit)
    };
    if a.prefill_chunk.is_none() && !session.trunk_in_ram {
        plan.prefill_chunk = STREAMED_PREFILL_CHUNK;
        if let Ok(line) = check(plan) {
            return Ok(line);
        }
        plan.prefill_chunk = crate::exec::PREFILL_CHUNK;
    }
    check(plan).map_err(stream_failure)
}

/// `--prefill-chunk N` into the plan (1..=4096).
fn with_prefill_chunk(a: &RunArgs, mut plan: Plan) -> Result<Plan, Failure> {
    if let Some(n) = a.prefill_chunk {
        if !(1..=4096).contains(&n) {
            return Err(Failure::usage(format!(
                "--prefill-chunk {n}: 1..=4096 prompt tokens per pass"
            )));
        }
        plan.prefill_chunk = n;
    }
    Ok(plan)
}

pub fn run_threads(a: &RunArgs) -> Result<usize, Failure> {
    let rc = run_config(a)?;
    let (n, from) = match (a.threads, rc.and_then(|r| r.threads)) {
        (Some(n), _) => (n, "--threads"),
        (None, Some(n)) => (n, "the run config's threads"),
        (None, None) => return Ok(default_threads().max(1)),
    };
    if !(1..=MAX_THREADS).contains(&n) {
        return Err(Failure::usage(format!(
            "{from}: {n} threads; must be in 1..={MAX_THREADS} (this machine has {} CPUs)",
            default_threads()
        )));
    }
    Ok(n)
}

/// The most compute threads a run takes (each needs a stack; far more than any CPU here).
const MAX_THREADS: usize = 1024;

/// Open the checkpoint. Routed-expert scales are validated here only when the experts are
/// resident; streamed experts are validated as they are read (real K3: 85 GB of scales).
/// `files`: the checkpoint's files opened while the spec was read ([`load_spec_files`]), else
/// they are opened here.
/// With the arena resident mode the check waits for the arena, which holds the scales in RAM
/// (`resident::load_resident` checks them there, or through the maps if the arena does not
/// fit).
fn open_checkpoint(
    model_dir: &Path,
    spec: &ModelSpec,
    settings: &crate::session::MemorySettings,
    mem: &MemArgs,
    files: Option<Checkpoint>,
) -> Result<Checkpoint, Failure> {
    let arena = resident_mode(mem)? == crate::resident::ResidentMode::Arena
        && settings.io.trunk != crate::stream::io_policy::TrunkIo::Mmap;
    let opts = crate::checkpoint::OpenOptions {
        validate_expert_scales: settings.cache_budget_bytes.is_none() && !arena,
    };
    match files {
        Some(f) => f.checked(spec, &opts),
        None => Checkpoint::open_with(model_dir, spec, &opts),
    }
    .map_err(|e| Failure {
        code: exit::FORWARD,
        msg: e.to_string(),
    })
}

/// `--resident`, else `K3_RESIDENT`, else mmap.
fn resident_mode(m: &MemArgs) -> Result<crate::resident::ResidentMode, Failure> {
    match &m.resident {
        Some(v) => crate::resident::ResidentMode::parse(v.trim()),
        None => crate::resident::ResidentMode::from_env(),
    }
    .map_err(stream_failure)
}

fn stream_failure(e: crate::stream::StreamError) -> Failure {
    use crate::stream::StreamError;
    let code = match &e {
        StreamError::Config(_) | StreamError::Plan(_) | StreamError::TrunkManifest { .. } => {
            exit::USAGE
        }
        _ => exit::FORWARD,
    };
    Failure {
        code,
        msg: e.to_string(),
    }
}

fn run_main(a: &RunArgs) -> Result<u8, Failure> {
    // time to first token counts from here: config, checkpoint open, session build (pinned
    // prefix load), state check, prefill, first token
    let run_start = std::time::Instant::now();
    if a.mem.list_presets {
        let t =
            crate::stream::presets::list_presets().map_err(|e| Failure::usage(e.to_string()))?;
        print!("{t}");
        return Ok(exit::OK);
    }
    if a.chat.chat || a.chat.serve.is_some() {
        for (given, flag, what) in [
            (
                a.dump_logits.is_some(),
                "--dump-logits",
                "is written by a --ids / --prompt / --batch-ids run; --chat and --serve do not write it",
            ),
            (
                a.dump_layer_logits.is_some(),
                "--dump-layer-logits",
                "is written by a --ids / --prompt run; --chat and --serve do not write it",
            ),
            (
                a.dump_prompt_logits.is_some(),
                "--dump-prompt-logits",
                "is written by a --ids / --prompt run; --chat and --serve do not write it",
            ),
            (
                a.mem.dump_cache_trace.is_some(),
                "--dump-cache-trace",
                "is written by a --ids / --prompt / --batch-ids run; --chat and --serve do not write it",
            ),
            (
                a.save_state.is_some(),
                "--save-state",
                "saves the state of a --ids / --prompt prefill (--gen 0); --chat keeps its conversation with --history, --serve keeps none",
            ),
            (
                a.load_state.is_some(),
                "--load-state",
                "resumes a --ids / --prompt run; --chat resumes a conversation from --history (re-prefilled), --serve starts every request afresh",
            ),
        ] {
            if given {
                return Err(Failure::usage(format!("{flag} {what}")));
            }
        }
        return chat_main(a);
    }
    if a.chat.no_think || a.chat.thinking_effort.is_some() {
        return Err(Failure::usage(
            "--no-think and --thinking-effort shape a chat prompt: use them with --chat or \
             --serve (docs/CHAT.md)",
        ));
    }
    if a.batch_ids.is_some() {
        for (given, flag) in [
            (a.dump_layer_logits.is_some(), "--dump-layer-logits"),
            (a.dump_prompt_logits.is_some(), "--dump-prompt-logits"),
        ] {
            if given {
                return Err(Failure::usage(format!(
                    "{flag} is written by a --ids / --prompt run (one prompt); --batch-ids \
                     does not write it"
                )));
            }
        }
        return batch_main(a);
    }
    let model_dir = a
        .model_dir
        .as_deref()
        .ok_or_else(|| Failure::usage("a model directory is required (see --help)"))?;
    let prompt = prompt_ids(a)?;
    if prompt.is_empty() {
        return Err(Failure::usage("the prompt is empty"));
    }
    if prompt.len() > 32768 {
        return Err(Failure::usage(format!(
            "the prompt has {} tokens; the maximum is 32768",
            prompt.len()
        )));
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
    if a.dump_layer_logits.is_some() && a.dump_prompt_logits.is_some() {
        return Err(Failure::usage(
            "--dump-layer-logits and --dump-prompt-logits both need the last prompt chunk's \
             logits computed their own way: give one per run",
        ));
    }
    let speculation = crate::speculate::from_flag(a.speculate).map_err(Failure::usage)?;
    if speculation.is_some() && !a.incremental {
        return Err(Failure::usage(
            "--speculate verifies guesses on the incremental state: add --incremental",
        ));
    }
    let (settings, notes) = memory_settings(a)?;
    let (spec, files) = run_spec_files(a, model_dir)?;
    let mut drafter = crate::plugins_cmd::run_drafter(a, &spec, speculation)?;
    let drafter_name = drafter.as_ref().map(|d| d.name().to_string());
    if let Some(bad) = prompt.iter().find(|&&t| t as usize >= spec.vocab_size) {
        let from = if a.ids.is_some() {
            "--ids"
        } else {
            "the tokenized prompt (--tok's tokenizer does not fit this model)"
        };
        return Err(Failure::usage(format!(
            "{from}: token {bad} is outside the vocabulary (size {})",
            spec.vocab_size
        )));
    }
    if a.dump_prompt_logits.is_some() {
        // the rows are held until the run ends: refused up front if they would crowd it out
        let bytes = prompt.len() as u64 * spec.vocab_size as u64 * 4;
        if let Some(limit) = crate::stream::plan::memory_limit_bytes()
            && bytes > limit / 4
        {
            return Err(Failure::usage(format!(
                "--dump-prompt-logits: {} prompt tokens x {} vocabulary x 4 bytes = {} held in \
                 memory, over a quarter of the {} available: use a shorter prompt",
                prompt.len(),
                spec.vocab_size,
                crate::stream::fmt_bytes(bytes),
                crate::stream::fmt_bytes(limit)
            )));
        }
    }
    let ckpt = open_checkpoint(model_dir, &spec, &settings, &a.mem, files)?;
    let threads = run_threads(a)?;
    if a.save_state.is_some() && a.n_gen != 0 {
        return Err(Failure::usage(
            "--save-state saves the state after the prompt: use it with --gen 0",
        ));
    }
    let (start, prefix_ids) = match &a.load_state {
        Some(p) => crate::statefile::load(p, &spec, ckpt.weights_fingerprint(&spec).as_deref())
            .map_err(|e| Failure::usage(e.to_string()))?,
        None => (crate::exec::SeqState::new(&spec), Vec::new()),
    };
    if !prefix_ids.is_empty() {
        eprintln!(
            "resuming from {} saved positions ({})",
            prefix_ids.len(),
            a.load_state
                .as_deref()
                .map_or(String::new(), |p| p.display().to_string())
        );
    }
    let needed = prefix_ids.len() + prompt.len() + a.n_gen;
    let positions = context_positions(
        a.max_context,
        needed,
        &if prefix_ids.is_empty() {
            format!("the prompt ({}) + --gen {}", prompt.len(), a.n_gen)
        } else {
            format!(
                "{} positions of --load-state + the prompt ({}) + --gen {}",
                prefix_ids.len(),
                prompt.len(),
                a.n_gen
            )
        },
    )?;
    let mut plan = with_prefill_chunk(a, Plan::new(&spec, positions))?;
    eprintln!(
        "k3-run {}: {} ({} layers, d_model {}, vocab {}), {} threads, {} kernels",
        env!("CARGO_PKG_VERSION"),
        spec.name,
        spec.n_layers,
        spec.d_model,
        spec.vocab_size,
        threads,
        k3_kernels::isa::active().name()
    );
    if let Some(all) = spec.truncated_from {
        eprintln!(
            "--layers {}: only the first {} of {all} layers are bound (a diagnostic: the output is not the whole model's)",
            spec.n_layers, spec.n_layers
        );
    }
    for n in &notes {
        eprintln!("{n}");
    }
    // measured before the session allocates: afterwards its own pages count as used
    let mem_limit = crate::stream::plan::memory_limit();
    let mut session =
        crate::session::build_with(&spec, &ckpt, &plan, &settings, resident_mode(&a.mem)?)
            .map_err(stream_failure)?;
    eprintln!("memory plan:");
    for l in &session.startup {
        eprintln!("  {l}");
    }
    eprintln!("  {}", mem_limit.report_line());
    let state_line =
        check_states_and_chunk(a, &mut plan, &session, (positions, 1), mem_limit.bytes())?;
    eprintln!("  {state_line}");
    // first Ctrl-C: finish the step in progress and stop; second: the default action (kill)
    let interrupted = ctrl_c_flag(130);
    let mut exec = Executor::new(&spec, plan, threads);
    if let Some(l) = session.configure_pool(exec.pool()) {
        eprintln!("  {l}");
    }
    let req = GenRequest {
        prompt_ids: prompt,
        n_gen: a.n_gen,
        incremental: a.incremental,
        stop_ids: a.stop_ids.clone(),
    };
    let providers = &mut session.providers;
    let time_to_first_token = std::cell::Cell::new(None::<f64>);
    // A long prompt on a streamed trunk can take minutes per pass: progress on a terminal,
    // cleared before the first token is printed.
    let res = with_prompt_progress(&mut exec, Some(req.prompt_ids.len()), |exec, bar| {
        let mut on_token = |i: usize, id: u32, t: f64| {
            if i == 0 {
                if let Some(b) = bar {
                    b.finish_and_clear();
                }
                time_to_first_token.set(Some(run_start.elapsed().as_secs_f64()));
            }
            println!("token {i:>4}: {id:>7}  ({t:.3} s)");
            !interrupted.load(Ordering::Relaxed)
        };
        let opts = run::GenOptions {
            speculate: speculation,
            layer_logits: a.dump_layer_logits.is_some(),
            prompt_logits: a.dump_prompt_logits.is_some(),
        };
        run::generate_with_drafter(
            &spec,
            exec,
            providers,
            &req,
            start,
            opts,
            drafter.take(),
            &mut on_token,
        )
    });
    let mut spec_stats = None;
    let res = res.map(|(r, st, end)| {
        spec_stats = st;
        (r, end)
    });
    let res = match res {
        Ok((r, end_state)) => {
            // A run stopped by an expert that failed to load has no trustworthy state.
            let failed = r
                .stopped_by
                .as_deref()
                .is_some_and(|s| s.starts_with("expert load failed"));
            if let Some(p) = a.save_state.as_ref().filter(|_| !failed) {
                let ids: Vec<u32> = prefix_ids.iter().chain(&req.prompt_ids).copied().collect();
                let fp = ckpt.weights_fingerprint(&spec);
                crate::statefile::save(p, &spec, fp, &end_state, &ids).map_err(|e| Failure {
                    code: exit::OUT_WRITE,
                    msg: e.to_string(),
                })?;
                eprintln!(
                    "saved the state after {} positions to {}",
                    ids.len(),
                    p.display()
                );
            }
            r
        }
        Err(e) => {
            let expert_failures = providers.experts.stats().load_failures;
            let f = exec_failure(e);
            if expert_failures > 0 {
                return Err(Failure {
                    code: exit::EXPERT_LOAD,
                    msg: f.msg,
                });
            }
            return Err(f);
        }
    };
    let trunk = providers.trunk.stats();
    let experts = providers.experts.stats();
    let peak = run::peak_rss_bytes();
    // A pinned prefix loaded in the session build (K3_PIN_SYNC=1) is before the run's clock:
    // not in the share. A background load is counted by what the run waited for it.
    let run_trunk_seconds =
        (trunk.read_seconds - trunk.pinned_load_seconds).max(0.0) + trunk.pinned_wait_seconds;
    let total_io = run_trunk_seconds + experts.read_seconds;
    let io_share = if res.total_seconds > 0.0 {
        total_io / res.total_seconds
    } else {
        0.0
    };
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
    if let Some(st) = &spec_stats {
        println!(
            "speculation{}: {} passes for {} tokens ({:.2} per pass); {} guesses, {} accepted \
             ({:.0}%), {} rewinds",
            drafter_name
                .as_deref()
                .map_or_else(String::new, |n| format!(" ({n})")),
            st.passes,
            res.generated_ids.len(),
            if st.passes > 0 {
                // the first id comes from the prefill; each pass yields its accepted guesses
                // plus one id
                (res.generated_ids.len().saturating_sub(1)) as f64 / st.passes as f64
            } else {
                0.0
            },
            st.drafted,
            st.accepted,
            if st.drafted > 0 {
                100.0 * st.accepted as f64 / st.drafted as f64
            } else {
                0.0
            },
            st.rewinds
        );
    }
    let time_to_first_token = time_to_first_token.get();
    if let Some(ttft) = time_to_first_token {
        if trunk.pinned_background {
            println!(
                "time to first token {:.3} s (start-up {:.3} s, then prefill + first token {:.3} s; the pinned prefix loaded beside them in {:.3} s, the run waited {:.3} s for it)",
                ttft,
                ttft - res.first_token_seconds,
                res.first_token_seconds,
                trunk.pinned_load_seconds,
                trunk.pinned_wait_seconds
            );
        } else {
            // What start-up spent its time on, of the loads that apply to this run.
            let mut incl = Vec::new();
            if trunk.pinned_load_seconds > 0.0 {
                incl.push(format!(
                    "pinned prefix load {:.3} s",
                    trunk.pinned_load_seconds
                ));
            }
            if session.resident_load_seconds > 0.0 {
                incl.push(format!(
                    "resident load {:.3} s",
                    session.resident_load_seconds
                ));
            }
            println!(
                "time to first token {:.3} s (start-up {:.3} s{}, then prefill + first token {:.3} s)",
                ttft,
                ttft - res.first_token_seconds,
                if incl.is_empty() {
                    String::new()
                } else {
                    format!(" incl. {}", incl.join(" and "))
                },
                res.first_token_seconds
            );
        }
    }
    println!(
        "expert cache: requests {} hits {} misses {} evictions {} | TRUE resident hit rate {:.2}% (raw hit rate {:.2}%)",
        experts.requests,
        experts.hits,
        experts.misses,
        experts.evictions,
        100.0 * experts.resident_hit_rate(),
        if experts.requests > 0 {
            100.0 * experts.hits as f64 / experts.requests as f64
        } else {
            0.0
        }
    );
    if experts.prefetched > 0 {
        println!(
            "expert prefetch: {} read ahead in {:.3} s (waited {:.3} s), {} requests served by them, {} wasted, guesses covered {:.2}% of routed ids",
            experts.prefetched,
            experts.prefetch_read_seconds,
            experts.prefetch_wait_seconds,
            experts.prefetch_hits,
            experts.prefetch_wasted,
            100.0 * experts.guess_accuracy()
        );
    }
    println!(
        "I/O share of wall clock: {:.1}% (trunk {:.3} s + experts {:.3} s of {:.3} s; {}){}",
        100.0 * io_share,
        run_trunk_seconds,
        experts.read_seconds,
        res.total_seconds,
        if trunk.pinned_background {
            "the waits for the pinned prefix loading in the background are in it"
        } else {
            "the pinned-prefix load at start-up is not in it"
        },
        if trunk.reader_thread {
            // Reader-thread reads overlap compute: their seconds can exceed the wall clock.
            format!(
                "; trunk reads ran beside compute, the executor waited {:.3} s for them",
                if trunk.pinned_background {
                    trunk.wait_seconds
                } else {
                    (trunk.wait_seconds - trunk.pinned_load_seconds).max(0.0)
                }
            )
        } else {
            String::new()
        }
    );
    println!(
        "trunk: pinned {}/{} layers, ring {} x {}{}, {:.3} GB read in {:.3} s ({:.0} MB/s){}",
        trunk.pinned_layers,
        trunk.n_layers,
        trunk.ring_slots,
        crate::stream::fmt_bytes(trunk.ring_slot_bytes),
        if trunk.shared_ring_bytes > 0 {
            format!(
                " (shared ring {})",
                crate::stream::fmt_bytes(trunk.shared_ring_bytes)
            )
        } else {
            String::new()
        },
        trunk.bytes_read as f64 / 1e9,
        trunk.read_seconds,
        if trunk.read_seconds > 0.0 {
            trunk.bytes_read as f64 / 1e6 / trunk.read_seconds
        } else {
            0.0
        },
        match (trunk.o_direct, trunk.pinned_page_cache) {
            (true, true) => ", O_DIRECT; pinned prefix in the page cache",
            (true, false) => ", O_DIRECT",
            (false, true) => ", pinned prefix in the page cache",
            (false, false) => "",
        }
    );
    if trunk.pinned_unlocked_bytes > 0 {
        println!(
            "warning: {} of the pinned prefix in the page cache could not be locked in RAM \
             (mlock: {}; raise the locked-memory limit, `ulimit -l`): the kernel may evict \
             those pages and read them again",
            crate::stream::fmt_bytes(trunk.pinned_unlocked_bytes),
            trunk.pinned_lock_error.as_deref().unwrap_or("refused")
        );
    }
    let reserved = trunk.hugetlb_bytes + session.arena_hugetlb_bytes;
    println!(
        "PEAK RSS {:.1} MB (getrusage; quote this, not the plan){}",
        peak as f64 / 1e6,
        if reserved > 0 {
            format!(
                ", plus {:.1} MB of weight buffers on reserved huge pages (vm.nr_hugepages), \
                 which getrusage does not count",
                reserved as f64 / 1e6
            )
        } else {
            String::new()
        }
    );
    dump_logits(a, &[&res.first_logits])?;
    dump_rows(
        a.dump_layer_logits.as_deref(),
        "--dump-layer-logits",
        &res.layer_logits,
    )?;
    dump_rows(
        a.dump_prompt_logits.as_deref(),
        "--dump-prompt-logits",
        &res.prompt_logits,
    )?;
    dump_expert_trace(a, providers)?;
    let mut json = serde_json::json!({
        "model": spec.name,
        "prompt_ids": res.prompt_ids,
        "resumed_positions": prefix_ids.len(),
        "generated_ids": res.generated_ids,
        "first_logits_hash": res.first_logits_hash,
        "incremental": a.incremental,
        "threads": threads,
        "layers_bound": spec.n_layers,
        "layers_in_model": spec.truncated_from.unwrap_or(spec.n_layers),
        "isa": k3_kernels::isa::active().name(),
        "prefill_seconds": res.prefill_seconds,
        "first_token_seconds": res.first_token_seconds,
        "pinned_load_seconds": trunk.pinned_load_seconds,
        "resident_load_seconds": session.resident_load_seconds,
        "time_to_first_token_seconds": time_to_first_token,
        "seconds_per_token": res.seconds_per_token,
        "total_seconds": res.total_seconds,
        "peak_rss_bytes": peak,
        "reserved_huge_page_bytes": reserved,
        "stopped_by": res.stopped_by,
        "speculation": spec_stats,
        "memory_plan": session.startup,
        "memory_limit": {
            "bytes": mem_limit.bytes(),
            "mem_available_bytes": mem_limit.mem_available_bytes,
            "cgroup": mem_limit.cgroup,
        },
        "trunk": trunk,
        "experts": {
            "requests": experts.requests,
            "hits": experts.hits,
            "misses": experts.misses,
            "evictions": experts.evictions,
            "resident_hits": experts.resident_hits,
            "resident_hit_rate": experts.resident_hit_rate(),
            "bytes_read": experts.bytes_read,
            "read_seconds": experts.read_seconds,
            "load_failures": experts.load_failures,
            "budget_bytes": experts.budget_bytes,
            "prefetched": experts.prefetched,
            "prefetch_hits": experts.prefetch_hits,
            "prefetch_wasted": experts.prefetch_wasted,
            "prefetch_read_seconds": experts.prefetch_read_seconds,
            "prefetch_wait_seconds": experts.prefetch_wait_seconds,
            "guess_accuracy": experts.guess_accuracy(),
        },
        "io_share": io_share,
    });
    if a.dump_prompt_logits.is_some() {
        // the argmax after every prompt token (compare_k3.py --tf-argmax)
        json["prompt_argmax"] = res
            .prompt_logits
            .chunks(spec.vocab_size)
            .map(|l| k3_kernels::ops::argmax(l) as u32)
            .collect::<Vec<u32>>()
            .into();
    }
    let text = serde_json::to_string_pretty(&json).map_err(|e| Failure {
        code: exit::OUT_WRITE,
        msg: e.to_string(),
    })?;
    write_atomic(&a.out, text.as_bytes()).map_err(|e| Failure {
        code: exit::OUT_WRITE,
        msg: format!("cannot write --out {}: {e}", a.out.display()),
    })?;
    if experts.load_failures > 0 {
        if let Some(why) = res
            .stopped_by
            .as_deref()
            .filter(|s| s.starts_with("expert load failed"))
        {
            eprintln!(
                "k3-run: stopped after {} ids: {why}",
                res.generated_ids.len()
            );
        }
        eprintln!(
            "k3-run: {} routed expert loads failed: the ids are not trustworthy (report and \
             --out written)",
            experts.load_failures
        );
        return Ok(exit::EXPERT_LOAD);
    }
    if res.stopped_by.as_deref() == Some("interrupted") {
        eprintln!("k3-run: stopped by Ctrl-C; report and --out written");
        return Ok(exit::INTERRUPTED);
    }
    Ok(exit::OK)
}

/// `--dump-logits FILE`: the first-step f32 logits (little-endian), one block per sequence in
/// prompt order (one for a single prompt, one per `--batch-ids` prompt).
fn dump_logits(a: &RunArgs, blocks: &[&[f32]]) -> Result<(), Failure> {
    let Some(p) = &a.dump_logits else {
        return Ok(());
    };
    let bytes: Vec<u8> = blocks
        .iter()
        .flat_map(|b| b.iter())
        .flat_map(|v| v.to_le_bytes())
        .collect();
    std::fs::write(p, bytes).map_err(|e| Failure {
        code: exit::OUT_WRITE,
        msg: format!("cannot write --dump-logits {}: {e}", p.display()),
    })
}

/// `--dump-layer-logits FILE` / `--dump-prompt-logits FILE`: rows of f32 logits,
/// little-endian ([`run::GenResult::layer_logits`], [`run::GenResult::prompt_logits`]).
fn dump_rows(path: Option<&Path>, flag: &str, rows: &[f32]) -> Result<(), Failure> {
    use std::io::Write;
    let Some(p) = path else {
        return Ok(());
    };
    // written through a buffer, not copied whole: the prompt's rows can be large
    let write = || -> std::io::Result<()> {
        let mut f = std::io::BufWriter::new(std::fs::File::create(p)?);
        for v in rows {
            f.write_all(&v.to_le_bytes())?;
        }
        f.into_inner().map_err(|e| e.into_error())?.sync_all()
    };
    write().map_err(|e| Failure {
        code: exit::OUT_WRITE,
        msg: format!("cannot write {flag} {}: {e}", p.display()),
    })
}

/// `--dump-cache-trace DIR`: the (layer, expert) requests the expert source recorded (resident
/// experts and the expert cache both record them when the flag is given).
fn dump_expert_trace(a: &RunArgs, providers: &crate::exec::Providers<'_>) -> Result<(), Failure> {
    let Some(dir) = &a.mem.dump_cache_trace else {
        return Ok(());
    };
    let t = providers.experts.trace().ok_or_else(|| Failure {
        code: exit::FORWARD,
        msg: format!(
            "--dump-cache-trace {}: the expert source recorded no trace (internal error)",
            dir.display()
        ),
    })?;
    crate::stream::trace::write_trace(dir, t).map_err(|e| Failure {
        code: exit::OUT_WRITE,
        msg: format!("--dump-cache-trace: {e}"),
    })?;
    let requests = t
        .iter()
        .filter(|r| r.0 != crate::stream::trace::TOKEN_MARK)
        .count();
    eprintln!(
        "expert trace: {requests} requests written to {}",
        dir.display()
    );
    Ok(())
}

/// `--chat` / `--serve`: load the model (memory flags apply) and hand it to the REPL or the
/// HTTP server.
fn chat_main(a: &RunArgs) -> Result<u8, Failure> {
    crate::chat::preflight(a)?;
    let model_dir = a
        .model_dir
        .as_deref()
        .ok_or_else(|| Failure::usage("a model directory is required"))?;
    let (settings, notes) = memory_settings(a)?;
    let (spec, files) = run_spec_files(a, model_dir)?;
    let ckpt = open_checkpoint(model_dir, &spec, &settings, &a.mem, files)?;
    let positions = a.max_context.unwrap_or(8192);
    // --serve-batch N: every request in the batch holds its own decode state.
    let sequences = match a.chat.serve {
        Some(_) => crate::chat::serve::serve_batch(a)?,
        None => 1,
    };
    let (mut session, mut exec) =
        load_model(a, &spec, &ckpt, &settings, &notes, positions, sequences)?;
    crate::chat::repl_main(&spec, &mut exec, &mut session.providers, a)
}

/// The providers and the executor for `--chat`, `--serve` and `--batch-ids`, with the
/// start-up report on stderr: the plan for `positions` positions, the memory plan, and the
/// decode state of `sequences` sequences checked against the memory limit.
fn load_model<'c>(
    a: &RunArgs,
    spec: &'c ModelSpec,
    ckpt: &'c Checkpoint,
    settings: &crate::session::MemorySettings,
    notes: &[String],
    positions: usize,
    sequences: usize,
) -> Result<(crate::session::Session<'c>, Executor<'c>), Failure> {
    let threads = run_threads(a)?;
    let mut plan = with_prefill_chunk(a, Plan::new(spec, positions))?;
    for n in notes {
        eprintln!("{n}");
    }
    // measured before the session allocates: afterwards its own pages count as used
    let mem_limit = crate::stream::plan::memory_limit();
    let session = crate::session::build_with(spec, ckpt, &plan, settings, resident_mode(&a.mem)?)
        .map_err(stream_failure)?;
    eprintln!("memory plan:");
    for l in &session.startup {
        eprintln!("  {l}");
    }
    eprintln!("  {}", mem_limit.report_line());
    // every sequence holds its own decode state
    let state_line = check_states_and_chunk(
        a,
        &mut plan,
        &session,
        (positions, sequences),
        mem_limit.bytes(),
    )?;
    eprintln!("  {state_line}");
    let exec = Executor::new(spec, plan, threads);
    if let Some(l) = session.configure_pool(exec.pool()) {
        eprintln!("  {l}");
    }
    Ok((session, exec))
}

/// `--batch-ids "A;B;..."`: parse one id list per sequence.
fn batch_prompts(text: &str) -> Result<Vec<Vec<u32>>, Failure> {
    let mut out = Vec::new();
    for (i, part) in text.split(';').enumerate() {
        let ids: Result<Vec<u32>, _> = part
            .split(',')
            .map(|t| t.trim())
            .filter(|t| !t.is_empty())
            .map(str::parse::<u32>)
            .collect();
        match ids {
            Ok(v) if !v.is_empty() => out.push(v),
            Ok(_) => {
                return Err(Failure::usage(format!(
                    "--batch-ids: prompt {} is empty",
                    i + 1
                )));
            }
            Err(e) => {
                return Err(Failure::usage(format!(
                    "--batch-ids: prompt {}: {e} (ids are non-negative integers, lists \
                     separated by ';')",
                    i + 1
                )));
            }
        }
    }
    if out.len() > 64 {
        return Err(Failure::usage("--batch-ids: at most 64 prompts"));
    }
    Ok(out)
}

/// `--batch-ids`: several prompts decoded together (memory flags apply).
fn batch_main(a: &RunArgs) -> Result<u8, Failure> {
    let model_dir = a
        .model_dir
        .as_deref()
        .ok_or_else(|| Failure::usage("a model directory is required (see --help)"))?;
    let prompts = batch_prompts(a.batch_ids.as_deref().unwrap_or(""))?;
    if a.n_gen > 4096 {
        return Err(Failure::usage(format!(
            "--gen {} exceeds the maximum of 4096",
            a.n_gen
        )));
    }
    if !a.incremental {
        return Err(Failure::usage(
            "--batch-ids decodes incrementally: add --incremental",
        ));
    }
    let (settings, notes) = memory_settings(a)?;
    let (spec, files) = run_spec_files(a, model_dir)?;
    for (i, p) in prompts.iter().enumerate() {
        if let Some(bad) = p.iter().find(|&&t| t as usize >= spec.vocab_size) {
            return Err(Failure::usage(format!(
                "--batch-ids: prompt {}: token {bad} is outside the vocabulary (size {})",
                i + 1,
                spec.vocab_size
            )));
        }
    }
    let ckpt = open_checkpoint(model_dir, &spec, &settings, &a.mem, files)?;
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let positions = context_positions(
        a.max_context,
        longest + a.n_gen,
        &format!("the longest prompt ({longest}) + --gen {}", a.n_gen),
    )?;
    let (mut session, mut exec) =
        load_model(a, &spec, &ckpt, &settings, &notes, positions, prompts.len())?;
    let interrupted = Arc::new(AtomicBool::new(false));
    let _ = signal_hook::flag::register(signal_hook::consts::SIGINT, Arc::clone(&interrupted));
    let providers = &mut session.providers;
    let trunk_before = providers.trunk.stats().bytes_read;
    let mut on_step = |i: usize, chosen: &[(usize, u32)]| {
        let ids: Vec<String> = chosen.iter().map(|(b, t)| format!("{b}:{t}")).collect();
        println!("step {i:>4}: {}", ids.join(" "));
        !interrupted.load(Ordering::Relaxed)
    };
    let res = run::generate_batch(
        &spec,
        &mut exec,
        providers,
        &prompts,
        a.n_gen,
        &a.stop_ids,
        &mut on_step,
    )
    .map_err(exec_failure)?;
    let trunk_read = providers.trunk.stats().bytes_read - trunk_before;
    for (b, s) in res.sequences.iter().enumerate() {
        println!(
            "sequence {b}: generated ids {:?}{}",
            s.generated_ids,
            s.stopped_by
                .as_deref()
                .map_or(String::new(), |w| format!(" (stopped: {w})"))
        );
    }
    println!(
        "batch: {} sequences, {} decode steps, {:.4} s/step, prefill {:.3} s; trunk read {:.3} GB \
         during the run",
        prompts.len(),
        res.steps,
        res.seconds_per_step,
        res.prefill_seconds,
        trunk_read as f64 / 1e9
    );
    let firsts: Vec<&[f32]> = res
        .sequences
        .iter()
        .map(|s| s.first_logits.as_slice())
        .collect();
    dump_logits(a, &firsts)?;
    dump_expert_trace(a, providers)?;
    let mut v = serde_json::to_value(&res).map_err(|e| Failure::usage(e.to_string()))?;
    v["trunk_bytes_read"] = serde_json::json!(trunk_read);
    v["peak_rss_bytes"] = serde_json::json!(run::peak_rss_bytes());
    let bytes = serde_json::to_vec_pretty(&v).map_err(|e| Failure::usage(e.to_string()))?;
    write_atomic(&a.out, &bytes).map_err(|e| Failure {
        code: exit::OUT_WRITE,
        msg: format!("cannot write --out {}: {e}", a.out.display()),
    })?;
    if interrupted.load(Ordering::Relaxed) {
        return Ok(exit::INTERRUPTED);
    }
    Ok(exit::OK)
}

/// The positions to plan the KV cache for: `--max-context N`, else `needed` (`why` says what it
/// is made of). Below `needed` is a usage error stating the number, not a silent raise.
fn context_positions(
    max_context: Option<usize>,
    needed: usize,
    why: &str,
) -> Result<usize, Failure> {
    match max_context {
        None => Ok(needed),
        Some(n) if n >= needed => Ok(n),
        Some(n) => Err(Failure::usage(format!(
            "--max-context {n} is below what this request needs: {needed} positions ({why}); \
             give at least --max-context {needed}, or leave it out"
        ))),
    }
}

/// Write a file via a temporary name and rename, so a reader never sees half a file.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp-k3run");
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

fn pack_main(p: &PackCli) -> Result<u8, Failure> {
    let chunk = match p.chunk_kib {
        None => crate::stream::compress::CHUNK_BYTES,
        Some(k) => k
            .checked_mul(1024)
            .filter(|&b| b > 0 && b.is_multiple_of(4096))
            .ok_or_else(|| {
                Failure::usage(format!(
                    "--chunk-kib {k}: must be a positive multiple of 4 (KiB) that fits in 64 bits"
                ))
            })?,
    };
    let spec = load_spec(&p.model_dir, p.manifest.as_deref(), None)?;
    if p.check {
        return check_main(p, &spec);
    }
    let r = crate::stream::pack::run(
        &p.model_dir,
        &spec,
        &p.trunk_dir,
        p.compress.then_some(chunk),
    )
    .map_err(stream_failure)?;
    println!("{}", r.summary());
    Ok(exit::OK)
}

/// `k3-run pack-trunk --check`: every layer of the packed trunk against the checkpoint.
fn check_main(p: &PackCli, spec: &k3_models::spec::ModelSpec) -> Result<u8, Failure> {
    use std::io::IsTerminal;
    if !p.trunk_dir.is_dir() {
        return Err(Failure::usage(format!(
            "--check: no packed trunk directory {}",
            p.trunk_dir.display()
        )));
    }
    let stop = ctrl_c_flag(130);
    eprintln!(
        "pack-trunk --check: every layer of {} against {}",
        p.trunk_dir.display(),
        p.model_dir.display()
    );
    let r = crate::stream::check::check_trunk(
        &p.model_dir,
        spec,
        &p.trunk_dir,
        &stop,
        std::io::stderr().is_terminal(),
    )
    .map_err(stream_failure)?;
    let rate = r.bytes_checked as f64 / 1e6 / r.seconds.max(1e-9);
    let what = format!(
        "{} of {} layers{}, {} tensors, {:.2} GB read and compared in {:.1} s ({rate:.0} MB/s)",
        r.layers_checked,
        r.layers,
        if r.compressed {
            " (compressed records decoded)"
        } else {
            ""
        },
        r.tensors_checked,
        r.bytes_checked as f64 / 1e9,
        r.seconds
    );
    for line in &r.problems {
        println!("FAIL   : {line}");
    }
    if r.n_problems > r.problems.len() {
        println!(
            "FAIL   : ... and {} more (only the first {} are named)",
            r.n_problems - r.problems.len(),
            r.problems.len()
        );
    }
    if r.interrupted {
        println!("check  : {what}");
        println!("RESULT : INCOMPLETE: stopped by Ctrl-C");
        return Ok(exit::INTERRUPTED);
    }
    if r.n_problems == 0 {
        println!("check  : {what}: every tensor equals the checkpoint's bytes");
        println!("RESULT : the packed trunk matches the checkpoint");
        return Ok(exit::OK);
    }
    let layers: Vec<String> = r.bad_layers.iter().map(ToString::to_string).collect();
    println!("check  : {what}");
    println!(
        "RESULT : FAIL: layer{} {} {} from the checkpoint: pack again with `k3-run \
         pack-trunk {} {}`",
        if layers.len() == 1 { "" } else { "s" },
        layers.join(", "),
        if layers.len() == 1 {
            "differs"
        } else {
            "differ"
        },
        p.model_dir.display(),
        p.trunk_dir.display()
    );
    Ok(crate::verify::MISMATCH)
}

/// A flag the first Ctrl-C (SIGINT) sets, for work that stops at its next step; a second
/// Ctrl-C, with the flag already set, exits at once with `second_exit`. For the rest of the
/// process.
pub(crate) fn ctrl_c_flag(second_exit: i32) -> Arc<AtomicBool> {
    let flag = Arc::new(AtomicBool::new(false));
    let _ = signal_hook::flag::register_conditional_shutdown(
        signal_hook::consts::SIGINT,
        second_exit,
        Arc::clone(&flag),
    );
    let _ = signal_hook::flag::register(signal_hook::consts::SIGINT, Arc::clone(&flag));
    flag
}

fn sim_main(p: &SimCli) -> Result<u8, Failure> {
    let recs =
        crate::stream::trace::read_trace(&p.trace).map_err(|e| Failure::usage(e.to_string()))?;
    if !p.plugins.is_empty() {
        return crate::plugins_cmd::sim_with_plugins(p, &recs);
    }
    print!(
        "{}",
        crate::stream::trace::sim_table(&recs, &p.capacities, p.expert_bytes)
    );
    Ok(exit::OK)
}

fn plan_main(p: &PlanCli) -> Result<u8, Failure> {
    if let Some(c) = &p.config {
        check_plan_config(c)?;
    }
    let spec = load_spec(&p.model_dir, p.manifest.as_deref(), p.config.as_deref())?;
    let plan = Plan::new(&spec, p.positions);
    let trunk_plan = match &p.trunk {
        Some(dir) => Some(plan_packed_trunk(p, dir, &spec)?),
        None => None,
    };
    if p.json {
        let mut v = serde_json::to_value(&plan).map_err(|e| Failure::usage(e.to_string()))?;
        if let Some((t, m)) = &trunk_plan {
            v["trunk_plan"] = serde_json::to_value(t).map_err(|e| Failure::usage(e.to_string()))?;
            if let Some(c) = &m.compression {
                v["trunk_compression"] =
                    serde_json::to_value(c).map_err(|e| Failure::usage(e.to_string()))?;
            }
        }
        let s = serde_json::to_string_pretty(&v).map_err(|e| Failure::usage(e.to_string()))?;
        println!("{s}");
    } else {
        print!("{plan}");
        if let Some((t, m)) = &trunk_plan {
            for l in t.report_lines() {
                println!("{l}");
            }
            if let Some(c) = &m.compression {
                println!(
                    "compressed trunk ({}): a pass over the streamed layers reads {:.1}% of \
                     their bytes ({} of records for {} of layers), decoded in place",
                    c.codec,
                    100.0 * c.stored_bytes as f64 / m.packed_bytes.max(1) as f64,
                    crate::stream::fmt_bytes(c.stored_bytes),
                    crate::stream::fmt_bytes(m.packed_bytes)
                );
            }
        }
    }
    Ok(exit::OK)
}

/// `plan --trunk DIR`: the trunk memory plan at `--trunk-gb` (or the preset's budget), and
/// the packed trunk's manifest.
fn plan_packed_trunk(
    p: &PlanCli,
    dir: &Path,
    spec: &ModelSpec,
) -> Result<
    (
        crate::stream::plan::TrunkPlan,
        crate::stream::pack::TrunkManifest,
    ),
    Failure,
> {
    check_trunk_dir(dir)?;
    let gb = match (p.trunk_gb, &p.preset) {
        (Some(g), _) => g,
        (None, Some(name)) => {
            crate::stream::presets::load_preset(name)
                .map_err(|e| Failure::usage(e.to_string()))?
                .trunk_gb
        }
        (None, None) => {
            return Err(Failure::usage(
                "plan --trunk needs a budget: --trunk-gb GB or --preset NAME",
            ));
        }
    };
    let budget =
        crate::stream::gb_to_bytes(gb, "--trunk-gb").map_err(|e| Failure::usage(e.to_string()))?;
    let m = crate::stream::pack::TrunkManifest::load(dir, spec)
        .map_err(|e| Failure::usage(e.to_string()))?;
    let plan = crate::stream::plan::plan_trunk(&m.layer_sizes(), budget, p.trunk_ring)
        .map_err(|e| Failure::usage(e.to_string()))?;
    Ok((plan, m))
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

/// The most `--prompt-file` bytes read: far beyond any context (a token is several bytes), and
/// a bound on what a mistaken `/dev/zero` or endless pipe can take.
const PROMPT_FILE_MAX: u64 = 64 << 20;

/// `--prompt-file FILE`: a file, or a pipe (`/dev/stdin`, `<(cmd)`) read to its end, up to
/// [`PROMPT_FILE_MAX`] bytes; a directory is refused by name.
fn read_prompt_file(f: &Path) -> Result<Vec<u8>, Failure> {
    use std::io::Read;
    let fail = |e: &dyn std::fmt::Display| {
        Failure::usage(format!("cannot read --prompt-file {}: {e}", f.display()))
    };
    let t = std::fs::metadata(f).map_err(|e| fail(&e))?.file_type();
    if t.is_dir() {
        return Err(fail(&"is a directory"));
    }
    let mut bytes = Vec::new();
    std::fs::File::open(f)
        .map_err(|e| fail(&e))?
        .take(PROMPT_FILE_MAX + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| fail(&e))?;
    if bytes.len() as u64 > PROMPT_FILE_MAX {
        return Err(fail(&format!(
            "longer than {} MiB, far beyond any context",
            PROMPT_FILE_MAX >> 20
        )));
    }
    Ok(bytes)
}

/// Output piped into a reader that stops early (`k3-run plan M | head`) ends the process
/// quietly, as in other Unix tools, instead of `println!`'s "failed printing to stdout" panic
/// (exit 101 with a backtrace): the signal's default action. Sockets are not affected (the
/// standard library sends with `MSG_NOSIGNAL`: a `--serve` client that hangs up is an error
/// of that request only).
fn quiet_broken_pipe() {
    // SAFETY: restores a signal's default disposition at start-up, before any thread exists.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
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
        eprintln!("k3-run: error: {msg}");
        return ExitCode::from(exit::USAGE);
    }
    let matches = Cli::command().get_matches();
    let mut cli = match Cli::from_arg_matches(&matches) {
        Ok(c) => c,
        Err(e) => e.exit(),
    };
    // Where each flag was given on the command line (a default value is not "given": a run
    // config's `trunk_ring` must win over `--trunk-ring`'s default).
    let given = |id: &str| {
        (matches.value_source(id) == Some(clap::parser::ValueSource::CommandLine))
            .then(|| matches.index_of(id))
            .flatten()
    };
    cli.run.order = FlagOrder {
        trunk_ring: given("trunk_ring"),
        preset: given("preset"),
        trunk_gb: given("trunk_gb"),
        cache_gb: given("cache_gb"),
    };
    // K3_ISA naming an unknown or unavailable path is a usage error, not a silent fallback.
    if let Err(e) = k3_kernels::isa::env_override() {
        eprintln!("k3-run: error: K3_ISA: {e}");
        return ExitCode::from(exit::USAGE);
    }
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
        Some(Command::PackTrunk(p)) => pack_main(p),
        Some(Command::Doctor(d)) => crate::doctor::main(d),
        Some(Command::SimCache(p)) => sim_main(p),
        Some(Command::Plugins(p)) => crate::plugins_cmd::main(p),
        Some(Command::Verify(v)) => crate::verify::main(v),
        Some(Command::Budget(b)) => crate::budget::main(b),
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
