use super::*;

/// Load and validate the model spec (manifest + config.json). Exit code 2 on any problem.
pub fn load_spec(
    model_dir: &Path,
    manifest: Option<&Path>,
    config: Option<&Path>,
) -> Result<ModelSpec, Failure> {
    k3_engine::model::load_spec(model_dir, manifest, config)
        .map_err(|e| Failure::usage(e.to_string()))
}

/// [`load_spec`], and the checkpoint's files when they opened.
pub fn load_spec_files(
    model_dir: &Path,
    manifest: Option<&Path>,
    config: Option<&Path>,
) -> Result<(ModelSpec, Option<Checkpoint>), Failure> {
    k3_engine::model::load_spec_files(model_dir, manifest, config)
        .map_err(|e| Failure::usage(e.to_string()))
}

/// Memory and I/O flags (docs/DESIGN.md §5). For the two budgets, the later of `--preset` and the
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

pub(crate) fn parse_prefetch(v: &str) -> Result<PrefetchArg, String> {
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
    /// below what the request needs is a usage error. With --chat / --serve: default the
    /// longest context the memory left after the weights holds for --serve-batch sequences,
    /// at most 131072 (8192 when the memory limit is unknown). Above what the memory holds is
    /// refused, naming the longest that fits.
    #[arg(long)]
    pub max_context: Option<usize>,
    #[command(flatten)]
    pub mem: MemArgs,
    #[command(flatten)]
    pub chat: crate::chat::ChatArgs,
    #[command(flatten)]
    pub pipe: super::pipeline::PipelineArgs,
    /// Whether --trunk-gb / --trunk-ring (or a run config's, an environment variable's) was
    /// given rather than a preset's or the default (filled by the layering).
    #[arg(skip)]
    pub trunk_flags_given: bool,
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

pub fn default_threads() -> usize {
    let avail = std::thread::available_parallelism().map_or(1, |n| n.get());
    num_cpus::get_physical().min(avail).max(1)
}

/// The prompt ids from exactly one of --ids, --prompt (with --tok), --prompt-file (with --tok).
pub fn prompt_ids(
    a: &RunArgs,
    tok: Option<&k3_text::tokenizer::Tokenizer>,
) -> Result<Vec<u32>, Failure> {
    let given = [a.ids.is_some(), a.prompt.is_some(), a.prompt_file.is_some()];
    if given.iter().filter(|&&g| g).count() != 1 {
        return Err(Failure::usage(
            "exactly one of --ids, --prompt, --prompt-file is required",
        ));
    }
    if let Some(ids) = &a.ids {
        return Ok(ids.clone());
    }
    let tok = tok.ok_or_else(|| Failure::usage("--prompt and --prompt-file need a tokenizer"))?;
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

/// The tokenizer of a `--ids` / `--prompt` run: `--tok DIR`, else (for a text prompt) the
/// model directory when it holds the tokenizer, as `--chat` does. `None` for an ids run
/// without `--tok` (the output is ids only).
pub fn run_tokenizer(a: &RunArgs) -> Result<Option<k3_text::tokenizer::Tokenizer>, Failure> {
    use k3_text::tokenizer::{MODEL_FILE, Tokenizer};
    let load = |dir: &Path| Tokenizer::load(dir).map_err(|e| Failure::usage(e.to_string()));
    let given = [a.ids.is_some(), a.prompt.is_some(), a.prompt_file.is_some()];
    if given.iter().filter(|&&g| g).count() != 1 {
        return Err(Failure::usage(
            "exactly one of --ids, --prompt, --prompt-file is required",
        ));
    }
    if let Some(t) = &a.tok {
        return load(t).map(Some);
    }
    if a.prompt.is_none() && a.prompt_file.is_none() {
        return Ok(None);
    }
    match &a.model_dir {
        Some(m) if m.join(MODEL_FILE).is_file() => load(m).map(Some),
        Some(m) => Err(Failure::usage(format!(
            "--prompt and --prompt-file need a tokenizer: {} has no {MODEL_FILE}; pass --tok DIR",
            m.display()
        ))),
        None => Err(Failure::usage(
            "--prompt and --prompt-file need --tok DIR (or a model directory holding the tokenizer)",
        )),
    }
}

/// The memory settings of a run. The preset's budgets are already merged into `a.mem` by the
/// layering (runconfig.rs: a flag or a run config wins over the preset); the preset is read
/// again here only for its note.
pub fn memory_settings(
    a: &RunArgs,
) -> Result<(crate::session::MemorySettings, Vec<String>), Failure> {
    use crate::stream::{gb_to_bytes, io_policy, presets};
    let m = &a.mem;
    let mut notes = Vec::new();
    if let (Some(c), Ok(Some(_))) = (&a.config, super::layering::run_config_path(a)) {
        notes.push(format!("run config {}", c.display()));
    }
    let preset = match &m.preset {
        Some(p) => Some(presets::load_preset(p).map_err(|e| Failure::usage(e.to_string()))?),
        None => None,
    };
    let (trunk_gb, cache_gb) = (m.trunk_gb, m.cache_gb);
    // Decimal GB as bytes, printed at the scale that keeps a small preset readable.
    let gb = |v: f64| crate::stream::fmt_bytes((v * 1e9).round() as u64);
    if let Some(p) = &preset {
        let streamed = m.trunk.is_some();
        notes.push(format!(
            "preset {}: trunk {}, expert cache {}{} (effective: trunk {}, cache {}{})",
            p.name,
            gb(p.trunk_gb),
            gb(p.cache_gb),
            if p.ultra_low_memory {
                ", ultra-low-memory"
            } else {
                ""
            },
            match trunk_gb {
                Some(v) if streamed => gb(v),
                _ => "resident".into(),
            },
            cache_gb.map_or("-".into(), gb),
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
                 without it the trunk is resident, so the preset's trunk budget ({}){} \
                 not applied; only the expert cache ({}) is",
                p.name,
                gb(p.trunk_gb),
                if p.ultra_low_memory {
                    " and its ultra-low-memory setting (streamed embedding rows and lm_head \
                     chunks, which needs --trunk: --ultra-low-memory without --trunk is \
                     refused) are"
                } else {
                    " is"
                },
                gb(cache_gb.unwrap_or(p.cache_gb)),
            ));
        }
    }
    let to_bytes = |v: Option<f64>, what: &str| -> Result<Option<u64>, Failure> {
        v.map(|g| gb_to_bytes(g, what))
            .transpose()
            .map_err(|e| Failure::usage(e.to_string()))
    };
    let io_name = m.io.clone().unwrap_or_else(|| "direct".to_string());
    let io = io_policy::load_io_policy(&io_name).map_err(|e| Failure::usage(e.to_string()))?;
    let settings = crate::session::MemorySettings {
        trunk_dir: m.trunk.clone(),
        trunk_budget_bytes: if m.trunk.is_some() {
            to_bytes(trunk_gb, "--trunk-gb")?
        } else {
            None
        },
        cache_budget_bytes: to_bytes(cache_gb, "--cache-gb")?,
        ring_slots: match m.trunk_ring {
            0 => {
                return Err(Failure::usage(
                    "trunk_ring 0 (--trunk-ring or a run config): it must be at least 1",
                ));
            }
            n => n,
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
    if settings.trunk_dir.is_none() && a.trunk_flags_given {
        return Err(Failure::usage(
            "--trunk-gb and --trunk-ring size a packed trunk's memory: add --trunk DIR (from \
             `k3-run pack-trunk`); without it the trunk is resident",
        ));
    }
    if settings.cache_budget_bytes.is_none()
        && (m.eviction_plugin.is_some() || m.expert_prefetch.is_some())
    {
        return Err(Failure::usage(
            "--eviction-plugin ([plugins] cache) and --expert-prefetch act on the expert cache: \
             add --cache-gb (or a --preset); without it the routed experts are resident",
        ));
    }
    if !m.plugin_opts.is_empty() && m.eviction_plugin.is_none() && a.draft_plugin.is_none() {
        return Err(Failure::usage(
            "--plugin-opt ([plugins] options) configures a plugin: add --eviction-plugin or \
             --draft-plugin ([plugins] cache or draft)",
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

/// The model spec for a run: manifest from --manifest, else the run config's, else built in;
/// config.json from --config FILE.json, else MODEL_DIR/config.json.
/// The checkpoint's files come with the spec (see [`load_spec_files`]).
pub(crate) fn run_spec_files(
    a: &RunArgs,
    model_dir: &Path,
) -> Result<(ModelSpec, Option<Checkpoint>), Failure> {
    let manifest = a.manifest.clone();
    // --config names the model's config.json unless it is a run config (already merged)
    let config = match super::layering::run_config_path(a)? {
        Some(_) => None,
        None => a.config.as_deref(),
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
pub(crate) fn check_states_and_chunk(
    a: &RunArgs,
    plan: &mut Plan,
    session: &crate::session::Session<'_>,
    (positions, sequences): (usize, usize),
    limit: Option<u64>,
) -> Result<String, Failure> {
    let check = |plan: &Plan| {
        crate::session::check_states(
            plan,
            positions,
            sequences,
            session.planned_bytes,
            session.mapped_embedding,
            limit,
        )
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
pub(crate) fn with_prefill_chunk(a: &RunArgs, mut plan: Plan) -> Result<Plan, Failure> {
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
    let Some(n) = a.threads else {
        return Ok(default_threads().max(1));
    };
    let from = "threads (--threads, K3RUN_THREADS or a run config)";
    if !(1..=MAX_THREADS).contains(&n) {
        return Err(Failure::usage(format!(
            "{from}: {n} threads; must be in 1..={MAX_THREADS} (this machine has {} CPUs)",
            default_threads()
        )));
    }
    let cpus = std::thread::available_parallelism().map_or(1, |c| c.get());
    if n > cpus {
        eprintln!(
            "warning: {n} threads on {cpus} CPUs: the extra threads wait for a CPU (the output \
             is the same; the time is not better than with {cpus})"
        );
    }
    Ok(n)
}

/// The most compute threads a run takes (each needs a stack; far more than any CPU here).
pub(crate) const MAX_THREADS: usize = 1024;

/// Open the checkpoint. Routed-expert scales are validated here only when the experts are
/// resident; streamed experts are validated as they are read (real K3: 85 GB of scales).
/// `files`: the checkpoint's files opened while the spec was read ([`load_spec_files`]), else
/// they are opened here.
/// With the arena resident mode the check waits for the arena, which holds the scales in RAM
/// (`resident::load_resident` checks them there, or through the maps if the arena does not
/// fit).
pub(crate) fn open_checkpoint(
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
pub(crate) fn resident_mode(m: &MemArgs) -> Result<crate::resident::ResidentMode, Failure> {
    match &m.resident {
        Some(v) => crate::resident::ResidentMode::parse(v.trim()),
        None => crate::resident::ResidentMode::from_env(),
    }
    .map_err(stream_failure)
}

/// The providers and the executor for `--chat`, `--serve` and `--batch-ids`, with the
/// start-up report on stderr: the plan for `positions` positions, the memory plan, and the
/// decode state of `sequences` sequences checked against the memory limit.
pub(crate) fn load_model<'c>(
    a: &RunArgs,
    spec: &'c ModelSpec,
    ckpt: &'c Checkpoint,
    settings: &crate::session::MemorySettings,
    notes: &[String],
    positions: Option<usize>,
    sequences: usize,
) -> Result<(crate::session::Session<'c>, Executor<'c>), Failure> {
    let threads = run_threads(a)?;
    let mut plan = with_prefill_chunk(
        a,
        Plan::new(spec, positions.unwrap_or(CONTEXT_DEFAULT_UNKNOWN)),
    )?;
    for n in notes {
        eprintln!("{n}");
    }
    // measured before the session allocates: afterwards its own pages count as used
    let mem_limit = crate::platform::memory::memory_limit();
    let session = crate::session::build_with(spec, ckpt, &plan, settings, resident_mode(&a.mem)?)
        .map_err(stream_failure)?;
    eprintln!("memory plan:");
    for l in &session.startup {
        eprintln!("  {l}");
    }
    eprintln!("  {}", mem_limit.report_line());
    // features this platform lacks (huge pages, memory caps) are said, not silently skipped
    if let Some(l) = crate::platform::absent_line() {
        eprintln!("  {l}");
    }
    // no --max-context: the longest context the memory left after the weights holds
    let positions = match (positions, mem_limit.bytes()) {
        (Some(n), _) => n,
        (None, None) => CONTEXT_DEFAULT_UNKNOWN,
        (None, Some(limit)) => {
            let longest = crate::session::longest_context(
                &plan,
                sequences,
                session.planned_bytes,
                session.mapped_embedding,
                limit,
            );
            let n = longest.clamp(1, CONTEXT_DEFAULT_MAX);
            eprintln!(
                "  context: {n} positions (no --max-context: the longest the memory left after \
                 the weights holds{}, at most {CONTEXT_DEFAULT_MAX})",
                if sequences > 1 {
                    format!(" for {sequences} sequences")
                } else {
                    String::new()
                }
            );
            n
        }
    };
    plan.max_positions = positions;
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

/// `--chat` / `--serve` without `--max-context`: the context when the memory limit is unknown.
pub(crate) const CONTEXT_DEFAULT_UNKNOWN: usize = 8192;
/// `--chat` / `--serve` without `--max-context`: the most positions planned from the budget.
pub(crate) const CONTEXT_DEFAULT_MAX: usize = 131_072;

/// The positions to plan the KV cache for: `--max-context N`, else `needed` (`why` says what it
/// is made of). Below `needed` is a usage error stating the number, not a silent raise.
pub(crate) fn context_positions(
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

/// The most `--prompt-file` bytes read: far beyond any context (a token is several bytes), and
/// a bound on what a mistaken `/dev/zero` or endless pipe can take.
pub(crate) const PROMPT_FILE_MAX: u64 = 64 << 20;

/// `--prompt-file FILE`: a file, or a pipe (`/dev/stdin`, `<(cmd)`) read to its end, up to
/// [`PROMPT_FILE_MAX`] bytes; a directory is refused by name.
pub(crate) fn read_prompt_file(f: &Path) -> Result<Vec<u8>, Failure> {
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

/// Every prompt's ids inside the vocabulary; the error names the prompt (1-based) after
/// `label` (e.g. "--batch-ids: ").
pub(crate) fn check_prompts_in_vocab(
    prompts: &[Vec<u32>],
    vocab: usize,
    label: &str,
) -> Result<(), Failure> {
    for (i, p) in prompts.iter().enumerate() {
        if let Some(bad) = p.iter().find(|&&t| t as usize >= vocab) {
            return Err(Failure::usage(format!(
                "{label}prompt {}: token {bad} is outside the vocabulary (size {vocab})",
                i + 1
            )));
        }
    }
    Ok(())
}
