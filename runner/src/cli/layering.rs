//! The command line as the top layer of [`crate::runconfig`]: the flags given (not clap's
//! defaults) become a [`Settings`] layer, and the merged settings are written back into
//! [`RunArgs`], which the run reads. `k3-run config show` prints the merge.

use clap::ArgMatches;
use clap::parser::ValueSource;

use super::*;
use crate::runconfig::{self, Layered, Mode, Prefetch, Settings};

/// The address `mode = "serve"` listens on when none is given.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8080";

/// Whether clap saw `id` on the command line (a default value is not "given").
fn given_in(m: &ArgMatches, id: &str) -> bool {
    m.try_get_raw(id).is_ok() && m.value_source(id) == Some(ValueSource::CommandLine)
}

/// The flags given on the command line, as a layer.
pub(crate) fn flags_of(a: &RunArgs, m: &ArgMatches) -> Settings {
    let g = |id: &str| given_in(m, id);
    let pick = |id: &str, v: Option<String>| v.filter(|_| g(id));
    let mut s =
        Settings {
            model: a.model_dir.clone().filter(|_| g("model_dir")),
            trunk: a.mem.trunk.clone().filter(|_| g("trunk")),
            tokenizer: a.tok.clone().filter(|_| g("tok")),
            manifest: pick(
                "manifest",
                a.manifest.as_ref().map(|p| p.display().to_string()),
            ),
            preset: pick("preset", a.mem.preset.clone()),
            io: pick("io", a.mem.io.clone()),
            trunk_gb: a.mem.trunk_gb.filter(|_| g("trunk_gb")),
            cache_gb: a.mem.cache_gb.filter(|_| g("cache_gb")),
            trunk_ring: g("trunk_ring").then_some(a.mem.trunk_ring),
            ultra_low_memory: g("ultra_low_memory").then_some(a.mem.ultra_low_memory),
            resident: pick("resident", a.mem.resident.clone()),
            expert_prefetch: a.mem.expert_prefetch.filter(|_| g("expert_prefetch")).map(
                |p| match p.0 {
                    None => Prefetch::On(false),
                    Some(m) => Prefetch::Margin(m),
                },
            ),
            threads: a.threads.filter(|_| g("threads")),
            max_context: a.max_context.filter(|_| g("max_context")),
            prefill_chunk: a.prefill_chunk.filter(|_| g("prefill_chunk")),
            ..Default::default()
        };
    if g("serve") {
        s.mode = Some(Mode::Serve);
        s.serve.listen = a.chat.serve.clone();
    } else if g("chat") {
        s.mode = Some(Mode::Chat);
    }
    let gs = &mut s.generate;
    gs.prompt = pick("prompt", a.prompt.clone());
    gs.prompt_file = a.prompt_file.clone().filter(|_| g("prompt_file"));
    gs.ids = a.ids.clone().filter(|_| g("ids"));
    gs.tokens = g("n_gen").then_some(a.n_gen);
    gs.incremental = g("incremental").then_some(a.incremental);
    gs.speculate = a.speculate.filter(|_| g("speculate"));
    gs.stop_ids = g("stop_ids").then(|| a.stop_ids.clone());
    gs.out = g("out").then(|| a.out.clone());
    let c = &a.chat;
    let chat = &mut s.chat;
    chat.history = c.history.clone().filter(|_| g("history"));
    chat.system = pick("system", c.system.clone());
    chat.thinking = g("no_think").then_some(!c.no_think);
    chat.thinking_effort = pick("thinking_effort", c.thinking_effort.clone());
    chat.temperature = c.temperature.filter(|_| g("temperature"));
    chat.top_p = c.top_p.filter(|_| g("top_p"));
    chat.seed = c.seed.filter(|_| g("seed"));
    chat.greedy = g("greedy").then_some(c.greedy);
    let serve = &mut s.serve;
    serve.batch = c.serve_batch.filter(|_| g("serve_batch"));
    serve.batch_window_ms = c.batch_window.filter(|_| g("batch_window"));
    serve.api_key = pick("api_key", c.api_key.clone());
    serve.max_queue = c.max_queue.filter(|_| g("max_queue"));
    serve.request_log = g("no_request_log").then_some(!c.no_request_log);
    let p = &mut s.plugins;
    p.cache = a
        .mem
        .eviction_plugin
        .clone()
        .filter(|_| g("eviction_plugin"));
    p.draft = a.draft_plugin.clone().filter(|_| g("draft_plugin"));
    p.options = g("plugin_opts").then(|| a.mem.plugin_opts.clone());
    s
}

/// The run config named by `--config`, when the file is one (`--config FILE.json` is the
/// model's config.json and is left to the spec loader).
pub(crate) fn run_config_path(a: &RunArgs) -> Result<Option<PathBuf>, Failure> {
    let Some(p) = &a.config else {
        return Ok(None);
    };
    let toml_name = p.extension().is_some_and(|e| e == "toml");
    match (toml_name, runconfig::file_kind(p)) {
        (false, runconfig::FileKind::Run) => Err(Failure::usage(format!(
            "--config {}: this is a run config (TOML) but the name does not end in .toml, so it \
             would be read as the model's config.json; rename it to .toml",
            p.display()
        ))),
        (false, _) => Ok(None),
        (true, _) => Ok(Some(p.clone())),
    }
}

/// Merge the layers for a run and write the result into `a`.
pub(crate) fn layer_run(a: &mut RunArgs, m: &ArgMatches) -> Result<Layered, Failure> {
    let config = run_config_path(a)?;
    let flags = flags_of(a, m);
    let flag_prompt = flags.generate.prompt.is_some()
        || flags.generate.prompt_file.is_some()
        || flags.generate.ids.is_some()
        || given_in(m, "batch_ids");
    let l = runconfig::layer(config.as_deref(), flags).map_err(|e| Failure::usage(e.0))?;
    apply(&l, a, flag_prompt);
    Ok(l)
}

/// The merged settings into the run's arguments.
fn apply(l: &Layered, a: &mut RunArgs, flag_prompt: bool) {
    let s = &l.settings;
    a.model_dir = s.model.clone();
    a.mem.trunk = s.trunk.clone();
    a.tok = s.tokenizer.clone();
    a.manifest = s.manifest.as_ref().map(PathBuf::from);
    a.mem.preset = s.preset.clone();
    a.mem.io = s.io.clone();
    a.mem.trunk_gb = s.trunk_gb;
    a.mem.cache_gb = s.cache_gb;
    a.mem.trunk_ring = s.trunk_ring.unwrap_or(2);
    a.trunk_flags_given =
        (s.trunk_gb.is_some() && !l.from_preset("trunk_gb")) || !l.is_default("trunk_ring");
    // A preset's ultra-low-memory needs a packed trunk; without one the preset's note says it
    // is not applied (memory_settings), rather than refusing the run.
    a.mem.ultra_low_memory =
        s.ultra_low_memory.unwrap_or(false) && !l.from_preset("ultra_low_memory");
    a.mem.resident = s.resident.clone();
    a.mem.expert_prefetch = s.expert_prefetch.map(|p| match p {
        Prefetch::On(false) => PrefetchArg(None),
        Prefetch::On(true) => PrefetchArg(Some(crate::session::DEFAULT_PREFETCH_MARGIN)),
        Prefetch::Margin(m) => PrefetchArg(Some(m)),
    });
    a.mem.eviction_plugin = s.plugins.cache.clone();
    a.mem.plugin_opts = s.plugins.options.clone().unwrap_or_default();
    a.threads = s.threads;
    a.max_context = s.max_context;
    a.prefill_chunk = s.prefill_chunk;
    match s.mode.unwrap_or(Mode::Generate) {
        Mode::Generate => {
            a.chat.chat = false;
            a.chat.serve = None;
        }
        Mode::Chat => {
            a.chat.chat = true;
            a.chat.serve = None;
        }
        Mode::Serve => {
            a.chat.chat = false;
            a.chat.serve = Some(
                s.serve
                    .listen
                    .clone()
                    .unwrap_or_else(|| DEFAULT_LISTEN.into()),
            );
        }
    }
    let g = &s.generate;
    if !flag_prompt {
        a.prompt = g.prompt.clone();
        a.prompt_file = g.prompt_file.clone();
        a.ids = g.ids.clone();
    }
    a.n_gen = g.tokens.unwrap_or(8);
    a.incremental = g.incremental.unwrap_or(false);
    a.speculate = g.speculate;
    a.draft_plugin = s.plugins.draft.clone();
    a.stop_ids = g.stop_ids.clone().unwrap_or_default();
    a.out = g
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from("k3_run.json"));
    let c = &s.chat;
    a.chat.history = c.history.clone();
    a.chat.system = c.system.clone();
    a.chat.no_think = c.thinking == Some(false);
    a.chat.thinking_effort = c.thinking_effort.clone();
    a.chat.temperature = c.temperature;
    a.chat.top_p = c.top_p;
    a.chat.seed = c.seed;
    a.chat.greedy = c.greedy.unwrap_or(false);
    let v = &s.serve;
    a.chat.serve_batch = v.batch;
    a.chat.batch_window = v.batch_window_ms;
    a.chat.api_key = v.api_key.clone();
    a.chat.max_queue = v.max_queue;
    a.chat.no_request_log = v.request_log == Some(false);
}

/// The merged `[plugins]` of a run, checked before any weight is read: each plugin loads and
/// is of the kind its key names, and a draft provider has speculation to feed. An error names
/// where the value came from (`run config FILE:LINE`, `environment K3RUN_PLUGINS__CACHE`, or
/// the flag).
pub(crate) fn check_plugins(l: &Layered, a: &RunArgs) -> Result<(), Failure> {
    use crate::plugins::{PluginSettings, load_from_settings};
    let from = |key: &str| {
        let src = l.source_of(key);
        match src.strip_prefix("flag ") {
            Some(flag) => flag.to_string(),
            None => format!("{src} ([plugins] {})", key.trim_start_matches("plugins.")),
        }
    };
    if a.draft_plugin.is_some() {
        let at = from("plugins.draft");
        if a.chat.chat || a.chat.serve.is_some() {
            return Err(Failure::usage(format!(
                "{at}: a draft provider feeds generate runs' --speculate; chat and serve use \
                 the built-in prompt lookup"
            )));
        }
        if a.speculate.is_none() {
            return Err(Failure::usage(format!(
                "{at}: a draft provider proposes tokens for speculative decoding: add \
                 `speculate = K` to [generate] (or --speculate K)"
            )));
        }
    }
    let options = a.mem.plugin_opts.clone();
    let checks = [
        ("plugins.cache", &a.mem.eviction_plugin, true),
        ("plugins.draft", &a.draft_plugin, false),
    ];
    for (key, path, cache) in checks {
        let Some(p) = path else { continue };
        let one = PluginSettings {
            cache_policy: cache.then(|| p.clone()),
            draft: (!cache).then(|| p.clone()),
            options: options.clone(),
        };
        load_from_settings(&one).map_err(|e| Failure::usage(format!("{}: {e}", from(key))))?;
    }
    Ok(())
}

/// Arguments of `k3-run config`.
#[derive(clap::Args, Debug)]
pub struct ConfigCli {
    #[command(subcommand)]
    pub action: ConfigAction,
}

/// `k3-run config show`.
#[derive(clap::Subcommand, Debug)]
pub enum ConfigAction {
    /// The merged settings of a run (defaults < preset < --config < K3RUN_* < flags), each
    /// value with where it came from. Takes every flag a run takes.
    Show(ConfigShow),
}

/// Arguments of `k3-run config show`.
#[derive(clap::Args, Debug)]
pub struct ConfigShow {
    /// As JSON: `[{"key", "value", "source"}]`.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub run: RunArgs,
}

/// `k3-run config show`.
pub(crate) fn config_main(c: &mut ConfigCli, m: &ArgMatches) -> Result<u8, Failure> {
    let ConfigAction::Show(show) = &mut c.action;
    let m = m
        .subcommand_matches("show")
        .ok_or_else(|| Failure::usage("config: expected `config show`"))?;
    let l = layer_run(&mut show.run, m)?;
    let rows = l.explain();
    if show.json {
        let s = serde_json::to_string_pretty(&rows).map_err(|e| Failure::usage(e.to_string()))?;
        println!("{s}");
        return Ok(exit::OK);
    }
    if let Some(c) = &l.config {
        println!("run config: {}", c.display());
    }
    let width = rows.iter().map(|r| r.key.len()).max().unwrap_or(0);
    for r in rows {
        let v = match &r.value {
            serde_json::Value::String(s) => format!("{s:?}"),
            v => v.to_string(),
        };
        println!("{:<width$} = {:<28} # {}", r.key, v, r.source);
    }
    Ok(exit::OK)
}
