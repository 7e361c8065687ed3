//! Run configs and the one layering of every run setting (docs/CONFIG.md).
//!
//! Owns: the run-config schema ([`Settings`]: the model, memory, I/O, threads and the mode with
//! its own section, `schema_version = 1`), the layering done with figment (built-in defaults <
//! preset < run config < `K3RUN_*` environment < command-line flags), where a preset, an I/O
//! policy or a manifest named by a bare name is looked for ([`find_named`]), the check that a
//! file holds no unknown key (naming the file, the key and the nearest valid key), and where
//! each merged value came from ([`Layered::explain`], for `k3-run config show`).
//! Must not: decide budgets itself (presets do) or touch weights.
//!
//! Paths inside a run config are relative to the file's directory; paths from the environment
//! or flags are relative to the current directory.

use std::path::{Path, PathBuf};

use figment::providers::{Env, Format, Serialized, Toml};
use figment::value::{Dict, Map};
use figment::{Figment, Metadata, Profile, Provider, Source};
use serde::{Deserialize, Serialize};

/// The schema version this build reads.
pub const SCHEMA_VERSION: u32 = 1;

/// What a job does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Generate from a prompt and write the JSON result.
    Generate,
    /// The chat REPL.
    Chat,
    /// The OpenAI-compatible HTTP server.
    Serve,
}

/// `expert_prefetch`: on/off, or the guess margin.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Prefetch {
    /// `true`: margin 0; `false`: off.
    On(bool),
    /// A margin (0..=4096).
    Margin(usize),
}

/// `[generate]`: the prompt and how long to generate.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenerateSettings {
    /// Prompt text (needs a tokenizer; default: the model directory's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt: Option<String>,
    /// Prompt file (UTF-8 text).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_file: Option<PathBuf>,
    /// Prompt token ids.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ids: Option<Vec<u32>>,
    /// Tokens to generate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[serde(rename = "gen")]
    pub tokens: Option<usize>,
    /// Keep the KV cache and recurrent state between tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub incremental: Option<bool>,
    /// Speculative decoding: up to K guessed tokens verified per pass.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub speculate: Option<usize>,
    /// Stop ids.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_ids: Option<Vec<u32>>,
    /// The JSON result file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub out: Option<PathBuf>,
}

/// `[chat]`: the REPL's transcript and sampling.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatSettings {
    /// A JSONL transcript to continue.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub history: Option<PathBuf>,
    /// System prompt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system: Option<String>,
    /// Thinking on (default) or off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thinking: Option<bool>,
    /// Thinking effort.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thinking_effort: Option<String>,
    /// Sampling temperature.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    /// Nucleus sampling mass.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    /// Sampling seed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// Greedy decoding.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub greedy: Option<bool>,
}

/// `[plugins]`: the plugins a run loads (docs/PLUGINS.md).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PluginsSettings {
    /// Expert-cache policy: a path, or a bare name found on the plugin search path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache: Option<PathBuf>,
    /// Draft provider for `[generate] speculate`: a path or a bare name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub draft: Option<PathBuf>,
    /// `KEY=VALUE` options handed to the plugins' `create`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub options: Option<Vec<String>>,
}

/// `[serve]`: the HTTP server.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServeSettings {
    /// Listen address (`HOST:PORT`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub listen: Option<String>,
    /// Requests decoded together.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch: Option<usize>,
    /// Milliseconds to wait for a batch to fill.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_window_ms: Option<u64>,
    /// Bearer API key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key: Option<String>,
    /// Requests waiting beyond the running ones before 429.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_queue: Option<usize>,
    /// One log line per request (default true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_log: Option<bool>,
}

/// Every layered setting of a run; each layer gives some of them (docs/CONFIG.md).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// Must be 1 in a run config.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schema_version: Option<u32>,
    /// The config's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// One line on what the config is for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// Checkpoint directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<PathBuf>,
    /// Packed trunk directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trunk: Option<PathBuf>,
    /// Tokenizer directory (default: the model directory).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<PathBuf>,
    /// Model manifest: a path or a name looked up like presets (`kimi-k3`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub manifest: Option<String>,
    /// Memory preset: a name or a path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preset: Option<String>,
    /// I/O policy: a name or a path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub io: Option<String>,
    /// Trunk budget (GB).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trunk_gb: Option<f64>,
    /// Expert-cache budget (GB).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_gb: Option<f64>,
    /// Ring slots for streamed trunk layers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trunk_ring: Option<usize>,
    /// Stream embedding rows and lm_head chunks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ultra_low_memory: Option<bool>,
    /// Where resident weights live: `mmap` or `arena`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resident: Option<String>,
    /// Speculative expert prefetch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expert_prefetch: Option<Prefetch>,
    /// Worker threads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub threads: Option<usize>,
    /// Context positions to plan the decode state for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_context: Option<usize>,
    /// Prompt tokens per pass over the weights.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_chunk: Option<usize>,
    /// generate, chat or serve.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<Mode>,
    /// `[generate]`.
    #[serde(default, skip_serializing_if = "is_default")]
    pub generate: GenerateSettings,
    /// `[chat]`.
    #[serde(default, skip_serializing_if = "is_default")]
    pub chat: ChatSettings,
    /// `[serve]`.
    #[serde(default, skip_serializing_if = "is_default")]
    pub serve: ServeSettings,
    /// `[plugins]`.
    #[serde(default, skip_serializing_if = "is_default")]
    pub plugins: PluginsSettings,
}

fn is_default<T: Default + PartialEq>(t: &T) -> bool {
    *t == T::default()
}

/// Every key a run config may hold, with the flag (or argument) that sets it on the command
/// line. The one list behind unknown-key errors and `config show`.
pub const KEYS: &[(&str, &str)] = &[
    ("schema_version", "-"),
    ("name", "-"),
    ("note", "-"),
    ("model", "MODEL_DIR"),
    ("trunk", "--trunk"),
    ("tokenizer", "--tok"),
    ("manifest", "--manifest"),
    ("preset", "--preset"),
    ("io", "--io"),
    ("trunk_gb", "--trunk-gb"),
    ("cache_gb", "--cache-gb"),
    ("trunk_ring", "--trunk-ring"),
    ("ultra_low_memory", "--ultra-low-memory"),
    ("resident", "--resident"),
    ("expert_prefetch", "--expert-prefetch"),
    ("threads", "--threads"),
    ("max_context", "--max-context"),
    ("prefill_chunk", "--prefill-chunk"),
    ("mode", "--chat / --serve"),
    ("generate.prompt", "--prompt"),
    ("generate.prompt_file", "--prompt-file"),
    ("generate.ids", "--ids"),
    ("generate.gen", "--gen"),
    ("generate.incremental", "--incremental"),
    ("generate.speculate", "--speculate"),
    ("generate.stop_ids", "--stop-id"),
    ("generate.out", "--out"),
    ("chat.history", "--history"),
    ("chat.system", "--system"),
    ("chat.thinking", "--no-think"),
    ("chat.thinking_effort", "--thinking-effort"),
    ("chat.temperature", "--temperature"),
    ("chat.top_p", "--top-p"),
    ("chat.seed", "--seed"),
    ("chat.greedy", "--greedy"),
    ("serve.listen", "--serve"),
    ("serve.batch", "--serve-batch"),
    ("serve.batch_window_ms", "--batch-window"),
    ("serve.api_key", "--api-key"),
    ("serve.max_queue", "--max-queue"),
    ("serve.request_log", "--no-request-log"),
    ("plugins.cache", "--eviction-plugin"),
    ("plugins.draft", "--draft-plugin"),
    ("plugins.options", "--plugin-opt"),
];

/// Keys a run config no longer takes, with the key that replaced each: an old config is told
/// what to write instead rather than "unknown key".
const RENAMED: &[(&str, &str)] = &[
    ("eviction_plugin", "plugins.cache"),
    ("plugin_opts", "plugins.options"),
    ("generate.draft_plugin", "plugins.draft"),
];

/// `plugins.cache` as a TOML table line (`[plugins] cache`), for messages.
fn in_section(key: &str) -> String {
    match key.split_once('.') {
        Some((s, l)) => format!("[{s}] {l}"),
        None => key.to_string(),
    }
}

/// The message for a renamed key found in `origin`.
fn renamed_error(origin: &str, old: &str, new: &str) -> ConfigError {
    ConfigError(format!(
        "{origin}: `{old}` was replaced by the [plugins] table: write `{}` instead \
         (docs/CONFIG.md)",
        in_section(new)
    ))
}

/// Keys whose value is a file or directory (resolved against the config file's directory).
const PATH_KEYS: &[&str] = &[
    "model",
    "trunk",
    "tokenizer",
    "generate.prompt_file",
    "generate.out",
    "chat.history",
    "plugins.cache",
    "plugins.draft",
];

/// Environment variables read besides `K3RUN_<KEY>` (sections joined by `__`, e.g.
/// `K3RUN_SERVE__LISTEN`): the server's key keeps its short name.
const ENV_ALIASES: &[(&str, &str)] = &[("api_key", "serve.api_key")];

/// The built-in defaults (the lowest layer).
pub fn defaults() -> Settings {
    Settings {
        io: Some("direct".into()),
        trunk_ring: Some(2),
        mode: Some(Mode::Generate),
        generate: GenerateSettings {
            tokens: Some(8),
            out: Some(PathBuf::from("k3_run.json")),
            ..Default::default()
        },
        ..Default::default()
    }
}

/// A configuration problem: the file (or variable, or flag) and why.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

/// What a TOML or JSON file given as a config holds, judged from its text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileKind {
    /// A run config (`configs/*.toml`).
    Run,
    /// A memory preset (`configs/presets/*.toml`).
    Preset,
    /// An I/O policy (`configs/io/*.toml`).
    IoPolicy,
    /// A model manifest (`configs/models/*.toml`).
    Manifest,
    /// A model's config.json.
    ModelJson,
    /// Unreadable or anything else.
    Other,
}

/// Classify a config file from its text.
pub fn file_kind(path: &Path) -> FileKind {
    let Ok(text) = k3_models::load::read_regular_file(path) else {
        return FileKind::Other;
    };
    if serde_json::from_str::<serde_json::Value>(&text).is_ok_and(|v| v.is_object()) {
        return FileKind::ModelJson;
    }
    let Ok(t) = text.parse::<toml::Table>() else {
        return FileKind::Other;
    };
    let has = |k: &[&str]| k.iter().any(|k| t.contains_key(*k));
    if has(&["family", "config", "pins", "tensors"]) {
        FileKind::Manifest
    } else if has(&[
        "o_direct",
        "read_threads",
        "huge_pages",
        "reserved_huge_pages",
    ]) {
        FileKind::IoPolicy
    } else if has(&[
        "schema_version",
        "model",
        "mode",
        "manifest",
        "io",
        "preset",
    ]) {
        FileKind::Run
    } else if has(&["trunk_gb", "cache_gb"]) {
        FileKind::Preset
    } else {
        FileKind::Other
    }
}

/// Levenshtein distance (for "did you mean").
fn distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1];
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != *cb);
            cur.push(sub.min(prev[j + 1] + 1).min(cur[j] + 1));
        }
        prev = cur;
    }
    prev[b.len()]
}

/// The valid key nearest to `key` (dotted), for an error message.
pub fn nearest_key(key: &str) -> &'static str {
    KEYS.iter()
        .map(|(k, _)| *k)
        .min_by_key(|k| {
            let leaf = k.rsplit('.').next().unwrap_or(k);
            let kl = key.rsplit('.').next().unwrap_or(key);
            distance(key, k).min(distance(kl, leaf) + 1)
        })
        .unwrap_or("model")
}

/// Every key in `table` (dotted for sections) that the schema does not know, with the
/// nearest valid key: `file: unknown key `trunk_gbb` (did you mean `trunk_gb`?)`.
fn check_keys(table: &toml::Table, origin: &str) -> Result<(), ConfigError> {
    let mut bad = Vec::new();
    for (k, v) in table {
        let is_section = ["generate", "chat", "serve", "plugins"].contains(&k.as_str());
        match (is_section, v) {
            (true, toml::Value::Table(t)) => {
                for sk in t.keys() {
                    let full = format!("{k}.{sk}");
                    if !KEYS.iter().any(|(key, _)| *key == full) {
                        bad.push(full);
                    }
                }
            }
            (true, _) => {
                return Err(ConfigError(format!(
                    "{origin}: `{k}` must be a table ([{k}] with its keys)"
                )));
            }
            (false, _) => {
                if !KEYS.iter().any(|(key, _)| key == k) {
                    bad.push(k.clone());
                }
            }
        }
    }
    if let Some((old, new)) = bad
        .iter()
        .find_map(|b| RENAMED.iter().find(|(o, _)| o == b))
    {
        return Err(renamed_error(origin, old, new));
    }
    match bad.first() {
        None => Ok(()),
        Some(k) => Err(ConfigError(format!(
            "{origin}: unknown key `{k}` (did you mean `{}`?); the keys: docs/CONFIG.md",
            nearest_key(k)
        ))),
    }
}

/// Read and check a run config file: it must be a run config (another kind of file names the
/// flag it belongs to), hold only known keys, and say `schema_version = 1` if it says any.
pub fn read_run_config(path: &Path) -> Result<toml::Table, ConfigError> {
    let shown = path.display();
    let text = k3_models::load::read_regular_file(path)
        .map_err(|e| ConfigError(format!("--config {shown}: cannot read: {e}")))?;
    let kind = file_kind(path);
    let wrong = |what: &str, flag: &str| {
        ConfigError(format!(
            "--config {shown}: this is {what}, not a run config; use `{flag} {shown}` (a run \
             config names a model, a preset, an I/O policy and a mode: docs/CONFIG.md)"
        ))
    };
    match kind {
        FileKind::Preset => return Err(wrong("a memory preset", "--preset")),
        FileKind::IoPolicy => return Err(wrong("an I/O policy", "--io")),
        FileKind::Manifest => return Err(wrong("a model manifest", "--manifest")),
        FileKind::ModelJson => {
            return Err(ConfigError(format!(
                "--config {shown}: this is JSON (a model config.json) but the name ends in .toml; \
                 rename it to .json"
            )));
        }
        _ => {}
    }
    let table: toml::Table = text
        .parse()
        .map_err(|e| ConfigError(format!("run config {shown}: {e}")))?;
    check_keys(&table, &format!("run config {shown}"))?;
    if let Some(v) = table.get("schema_version")
        && v.as_integer() != Some(i64::from(SCHEMA_VERSION))
    {
        return Err(ConfigError(format!(
            "run config {shown}: schema_version = {v} but this build reads {SCHEMA_VERSION}"
        )));
    }
    Ok(table)
}

/// Where a bare name of `kind` (`presets`, `io`, `models`) is looked for, in order: the run
/// config's directory, its `KIND/` subdirectory, `./configs/KIND/`,
/// `$XDG_CONFIG_HOME/k3-run/KIND/` (else `~/.config/k3-run/KIND/`). The built-in copies come
/// after these.
pub fn search_dirs(config_dir: Option<&Path>, kind: &str) -> Vec<PathBuf> {
    let mut v = Vec::new();
    if let Some(d) = config_dir {
        v.push(d.to_path_buf());
        v.push(d.join(kind));
    }
    v.push(Path::new("configs").join(kind));
    let xdg = std::env::var_os("XDG_CONFIG_HOME")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config")));
    if let Some(x) = xdg {
        v.push(x.join("k3-run").join(kind));
    }
    v
}

/// A preset, I/O policy or manifest value as the loaders take it: a path (relative ones against
/// `base`) stays a path; a bare name found as `NAME.toml` in [`search_dirs`] becomes that file;
/// a bare name found nowhere stays the name (the built-in copy, or the loader's error).
pub fn find_named(value: &str, base: Option<&Path>, kind: &str) -> String {
    if value.contains('/') || value.ends_with(".toml") {
        return match base {
            Some(b) if Path::new(value).is_relative() => b.join(value).display().to_string(),
            _ => value.to_string(),
        };
    }
    for d in search_dirs(base, kind) {
        let p = d.join(format!("{value}.toml"));
        if p.is_file() {
            return p.display().to_string();
        }
    }
    value.to_string()
}

/// A figment provider with a name of its own (shown by `config show`).
struct Named {
    name: String,
    source: Option<PathBuf>,
    data: Settings,
}

impl Provider for Named {
    fn metadata(&self) -> Metadata {
        let m = Metadata::named(self.name.clone());
        match &self.source {
            Some(p) => m.source(Source::File(p.clone())),
            None => m,
        }
    }

    fn data(&self) -> Result<Map<Profile, Dict>, figment::Error> {
        Serialized::defaults(&self.data).data()
    }
}

/// The merged settings and where each came from.
pub struct Layered {
    figment: Figment,
    /// The merged values (paths resolved, named presets / I/O policies / manifests found).
    pub settings: Settings,
    /// The run config file, if any.
    pub config: Option<PathBuf>,
}

/// The environment layer: `K3RUN_<KEY>` for every key (sections joined by `__`).
fn env_layer() -> Env {
    Env::prefixed("K3RUN_").map(|k| {
        let k = k.as_str().to_ascii_lowercase();
        let k = k.as_str();
        match ENV_ALIASES.iter().find(|(a, _)| *a == k) {
            Some((_, to)) => (*to).into(),
            None => k.replace("__", ".").into(),
        }
    })
}

/// Every `K3RUN_*` variable must name a known key.
fn check_env() -> Result<(), ConfigError> {
    for (name, _) in std::env::vars_os() {
        let Some(name) = name.to_str() else { continue };
        let Some(rest) = name.strip_prefix("K3RUN_") else {
            continue;
        };
        let key = rest.to_ascii_lowercase();
        let key = match ENV_ALIASES.iter().find(|(a, _)| *a == key) {
            Some((_, to)) => (*to).to_string(),
            None => key.replace("__", "."),
        };
        if let Some((old, new)) = RENAMED.iter().find(|(o, _)| *o == key) {
            return Err(ConfigError(format!(
                "environment variable {name}: `{old}` was replaced by the [plugins] table: set \
                 K3RUN_{} instead (docs/CONFIG.md)",
                new.to_ascii_uppercase().replace('.', "__")
            )));
        }
        if !KEYS.iter().any(|(k, _)| *k == key) {
            let near = nearest_key(&key);
            return Err(ConfigError(format!(
                "environment variable {name}: no setting `{key}` (did you mean K3RUN_{}?)",
                near.to_ascii_uppercase().replace('.', "__")
            )));
        }
    }
    Ok(())
}

/// Build the layers: defaults < preset < run config (`config`) < `K3RUN_*` < `flags`.
pub fn layer(config: Option<&Path>, flags: Settings) -> Result<Layered, ConfigError> {
    check_env()?;
    let config_dir = config.map(|c| c.parent().unwrap_or(Path::new(".")).to_path_buf());
    let mut upper = Figment::new();
    if let Some(c) = config {
        read_run_config(c)?;
        upper = upper.merge(Toml::file_exact(c));
    }
    let flags_layer = Named {
        name: "flag".into(),
        source: None,
        data: flags,
    };
    upper = upper.merge(env_layer()).merge(flags_layer);
    let extract_err = |e: figment::Error| ConfigError(describe(&e));
    // The preset first (it is named by an upper layer), then the whole stack.
    let preset_value: Option<String> = match upper.extract_inner::<Option<String>>("preset") {
        Ok(v) => v,
        Err(e) if matches!(e.kind, figment::error::Kind::MissingField(_)) => None,
        Err(e) => return Err(extract_err(e)),
    };
    let preset_base = |key: &str| source_dir(&upper, key).or_else(|| config_dir.clone());
    let mut figment = Figment::new().merge(Named {
        name: "default".into(),
        source: None,
        data: defaults(),
    });
    let mut preset_found = None;
    if let Some(v) = &preset_value {
        let found = find_named(v, preset_base("preset").as_deref(), "presets");
        let p = k3_engine::stream::presets::load_preset(&found)
            .map_err(|e| ConfigError(format!("preset {v:?}: {e}")))?;
        let file = Path::new(&found);
        figment = figment.merge(Named {
            name: format!("preset {}", p.name),
            source: file.is_file().then(|| file.to_path_buf()),
            data: Settings {
                trunk_gb: Some(p.trunk_gb),
                cache_gb: Some(p.cache_gb),
                ultra_low_memory: Some(p.ultra_low_memory),
                ..Default::default()
            },
        });
        preset_found = Some(found);
    }
    let figment = figment.merge(upper);
    let mut settings: Settings = figment.extract().map_err(extract_err)?;
    // Paths from a file are relative to that file's directory.
    for key in PATH_KEYS {
        if let Some(dir) = source_dir(&figment, key) {
            resolve_path(&mut settings, key, &dir);
        }
    }
    settings.preset = preset_found;
    if let Some(io) = &settings.io {
        settings.io = Some(find_named(io, source_dir(&figment, "io").as_deref(), "io"));
    }
    if let Some(m) = &settings.manifest {
        settings.manifest = Some(find_named(
            m,
            source_dir(&figment, "manifest").as_deref(),
            "models",
        ));
    }
    Ok(Layered {
        figment,
        settings,
        config: config.map(Path::to_path_buf),
    })
}

/// A figment error in one line, naming where the bad value came from.
fn describe(e: &figment::Error) -> String {
    let mut out = Vec::new();
    for e in e.clone() {
        let at = match (&e.metadata, e.path.is_empty()) {
            (Some(m), _) => match &m.source {
                Some(Source::File(p)) => format!("{} ", p.display()),
                _ if m.name.contains("environment") => "environment: ".into(),
                _ => format!("{}: ", m.name),
            },
            _ => String::new(),
        };
        let key = if e.path.is_empty() {
            String::new()
        } else {
            format!("key `{}`: ", e.path.join("."))
        };
        out.push(format!("{at}{key}{}", e.kind));
    }
    out.join("; ")
}

/// The directory of the file a key's value came from (`None`: not from a file).
fn source_dir(f: &Figment, key: &str) -> Option<PathBuf> {
    match f.find_metadata(key)?.source.as_ref()? {
        Source::File(p) => Some(p.parent().unwrap_or(Path::new(".")).to_path_buf()),
        _ => None,
    }
}

fn resolve_path(s: &mut Settings, key: &str, dir: &Path) {
    let slot = match key {
        "model" => &mut s.model,
        "trunk" => &mut s.trunk,
        "tokenizer" => &mut s.tokenizer,
        "generate.prompt_file" => &mut s.generate.prompt_file,
        "plugins.cache" => &mut s.plugins.cache,
        "plugins.draft" => &mut s.plugins.draft,
        "generate.out" => &mut s.generate.out,
        "chat.history" => &mut s.chat.history,
        _ => return,
    };
    if let Some(p) = slot.as_mut() {
        // a plugin given by bare name is found on the plugin search path, not here
        let bare = p.components().count() == 1;
        if p.is_relative() && !(bare && key.starts_with("plugins.")) {
            *p = dir.join(&*p);
        }
    }
}

/// One merged value and where it came from.
#[derive(Clone, Debug, Serialize)]
pub struct Explained {
    /// Dotted key.
    pub key: String,
    /// The merged value.
    pub value: serde_json::Value,
    /// `default`, `preset NAME (FILE:LINE)`, `run config FILE:LINE`, `environment K3RUN_X`,
    /// `flag --x`.
    pub source: String,
}

impl Layered {
    /// Whether `key`'s merged value is the preset's.
    pub fn from_preset(&self, key: &str) -> bool {
        self.figment
            .find_metadata(key)
            .is_some_and(|m| m.name.starts_with("preset"))
    }

    /// Whether `key`'s merged value is the built-in default (or unset).
    pub fn is_default(&self, key: &str) -> bool {
        self.figment
            .find_metadata(key)
            .is_none_or(|m| m.name == "default")
    }

    /// Where `key`'s merged value came from: `default`, `preset NAME (FILE:LINE)`,
    /// `run config FILE:LINE`, `environment K3RUN_X`, `flag --x`.
    pub fn source_of(&self, key: &str) -> String {
        let flag = KEYS
            .iter()
            .find(|(k, _)| *k == key)
            .map_or("-", |(_, f)| *f);
        match self.figment.find_metadata(key) {
            None => "default".to_string(),
            Some(m) => match (&m.source, m.name.as_ref()) {
                (Some(Source::File(p)), name) => {
                    let line = line_of(p, key).map_or(String::new(), |l| format!(":{l}"));
                    if name.starts_with("preset") {
                        format!("{name} ({}{line})", p.display())
                    } else {
                        format!("run config {}{line}", p.display())
                    }
                }
                (_, "flag") => format!("flag {flag}"),
                (_, n) if n.contains("environment") => {
                    let alias = ENV_ALIASES.iter().find(|(_, to)| *to == key);
                    match alias {
                        Some((a, _)) => format!("environment K3RUN_{}", a.to_uppercase()),
                        None => format!(
                            "environment K3RUN_{}",
                            key.to_uppercase().replace('.', "__")
                        ),
                    }
                }
                (_, n) => n.to_string(),
            },
        }
    }

    /// Every set value with its source, in schema order (an API key shown as `"<set>"`).
    pub fn explain(&self) -> Vec<Explained> {
        let v = serde_json::to_value(&self.settings).unwrap_or_default();
        let mut out = Vec::new();
        for (key, _) in KEYS {
            let value = key
                .split('.')
                .try_fold(&v, |v, k| v.get(k))
                .cloned()
                .unwrap_or(serde_json::Value::Null);
            if value.is_null() {
                continue;
            }
            let value = if *key == "serve.api_key" {
                serde_json::Value::String("<set>".into())
            } else {
                value
            };
            let source = self.source_of(key);
            out.push(Explained {
                key: key.to_string(),
                value,
                source,
            });
        }
        out
    }
}

/// The line of `key` (dotted: section then leaf) in a TOML file.
fn line_of(path: &Path, key: &str) -> Option<usize> {
    let text = std::fs::read_to_string(path).ok()?;
    let (section, leaf) = match key.split_once('.') {
        Some((s, l)) => (Some(s), l),
        None => (None, key),
    };
    let mut current: Option<String> = None;
    for (i, line) in text.lines().enumerate() {
        let t = line.trim();
        if let Some(s) = t.strip_prefix('[') {
            current = Some(s.trim_end_matches(']').trim().to_string());
            continue;
        }
        let in_section = match section {
            None => current.is_none(),
            Some(s) => current.as_deref() == Some(s),
        };
        if in_section
            && t.split_once('=')
                .is_some_and(|(k, _)| k.trim().trim_matches('"') == leaf)
        {
            return Some(i + 1);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, text).expect("write test file");
        p
    }

    #[test]
    fn relative_paths_resolve_against_the_config_file() {
        let d = tempfile::tempdir().expect("tempdir");
        let p = write(
            d.path(),
            "job.toml",
            "schema_version = 1\nmodel = \"m\"\ntrunk = \"t\"\n[chat]\nhistory = \"h.jsonl\"\n",
        );
        let l = layer(Some(&p), Settings::default()).expect("layers");
        assert_eq!(l.settings.model, Some(d.path().join("m")));
        assert_eq!(l.settings.trunk, Some(d.path().join("t")));
        assert_eq!(l.settings.chat.history, Some(d.path().join("h.jsonl")));
        // a flag's path is the command line's, relative to the current directory
        let flags = Settings {
            model: Some(PathBuf::from("x")),
            ..Default::default()
        };
        let l = layer(Some(&p), flags).expect("layers");
        assert_eq!(l.settings.model, Some(PathBuf::from("x")));
    }

    #[test]
    fn unknown_keys_name_file_key_and_nearest() {
        let d = tempfile::tempdir().expect("tempdir");
        let p = write(d.path(), "bad.toml", "schema_version = 1\ntrunk_gbb = 3\n");
        let e = layer(Some(&p), Settings::default())
            .err()
            .expect("unknown key")
            .to_string();
        assert!(e.contains("bad.toml") && e.contains("`trunk_gbb`"), "{e}");
        assert!(e.contains("did you mean `trunk_gb`"), "{e}");
        let p = write(
            d.path(),
            "bad2.toml",
            "mode = \"serve\"\n[serve]\nlisen = \"x\"\n",
        );
        let e = layer(Some(&p), Settings::default())
            .err()
            .expect("unknown key")
            .to_string();
        assert!(
            e.contains("`serve.lisen`") && e.contains("`serve.listen`"),
            "{e}"
        );
        let p = write(d.path(), "v2.toml", "schema_version = 2\n");
        let e = layer(Some(&p), Settings::default())
            .err()
            .expect("version")
            .to_string();
        assert!(e.contains("schema_version"), "{e}");
    }

    #[test]
    fn another_kind_of_file_names_its_flag() {
        let d = tempfile::tempdir().expect("tempdir");
        let cases = [
            (
                "p.toml",
                "name = \"p\"\ntrunk_gb = 1.0\ncache_gb = 1.0\n",
                "--preset",
            ),
            (
                "io.toml",
                "name = \"x\"\ntrunk = \"direct\"\no_direct = true\n",
                "--io",
            ),
            ("m.toml", "family = \"k3\"\n[pins]\n", "--manifest"),
        ];
        for (name, text, flag) in cases {
            let p = write(d.path(), name, text);
            let e = read_run_config(&p).expect_err("refused").to_string();
            assert!(e.contains(&format!("use `{flag} ")), "{name}: {e}");
        }
    }

    #[test]
    fn precedence_default_preset_config_flag() {
        let d = tempfile::tempdir().expect("tempdir");
        write(
            d.path(),
            "mine.toml",
            "name = \"mine\"\ntrunk_gb = 1.5\ncache_gb = 0.5\nultra_low_memory = false\n",
        );
        let p = write(d.path(), "job.toml", "preset = \"mine\"\ncache_gb = 0.75\n");
        let l = layer(Some(&p), Settings::default()).expect("layers");
        // default
        assert_eq!(l.settings.trunk_ring, Some(2));
        // preset found by bare name in the config's directory
        assert_eq!(l.settings.trunk_gb, Some(1.5));
        // the run config over the preset
        assert_eq!(l.settings.cache_gb, Some(0.75));
        let why: Vec<_> = l.explain();
        let src = |k: &str| {
            why.iter()
                .find(|e| e.key == k)
                .map(|e| e.source.clone())
                .unwrap_or_default()
        };
        assert_eq!(src("trunk_ring"), "default");
        assert!(
            src("trunk_gb").starts_with("preset mine ("),
            "{}",
            src("trunk_gb")
        );
        assert!(
            src("trunk_gb").ends_with("mine.toml:2)"),
            "{}",
            src("trunk_gb")
        );
        assert!(
            src("cache_gb").ends_with("job.toml:2"),
            "{}",
            src("cache_gb")
        );
        // a flag over all of them
        let flags = Settings {
            cache_gb: Some(2.0),
            ..Default::default()
        };
        let l = layer(Some(&p), flags).expect("layers");
        assert_eq!(l.settings.cache_gb, Some(2.0));
        assert!(
            l.explain()
                .iter()
                .any(|e| e.key == "cache_gb" && e.source == "flag --cache-gb")
        );
    }

    #[test]
    fn plugins_table_paths_renames_and_unknown_keys() {
        let d = tempfile::tempdir().expect("tempdir");
        let p = write(
            d.path(),
            "job.toml",
            "schema_version = 1\n[plugins]\ncache = \"lfu\"\ndraft = \"lib/ngram.so\"\n\
             options = [\"age_every=64\"]\n",
        );
        let l = layer(Some(&p), Settings::default()).expect("layers");
        // a bare name stays a name (the plugin search path finds it); a path is the file's
        assert_eq!(l.settings.plugins.cache, Some(PathBuf::from("lfu")));
        assert_eq!(
            l.settings.plugins.draft,
            Some(d.path().join("lib/ngram.so"))
        );
        assert_eq!(
            l.settings.plugins.options.as_deref(),
            Some(&["age_every=64".to_string()][..])
        );
        assert!(
            l.source_of("plugins.options").ends_with("job.toml:5"),
            "{}",
            l.source_of("plugins.options")
        );
        // a flag replaces the config's value
        let flags = Settings {
            plugins: PluginsSettings {
                cache: Some(PathBuf::from("./s3.so")),
                ..Default::default()
            },
            ..Default::default()
        };
        let l = layer(Some(&p), flags).expect("layers");
        assert_eq!(l.settings.plugins.cache, Some(PathBuf::from("./s3.so")));
        assert_eq!(l.source_of("plugins.cache"), "flag --eviction-plugin");
        // the old top-level keys say what replaced them
        for (text, old, new) in [
            (
                "eviction_plugin = \"lfu\"\n",
                "eviction_plugin",
                "[plugins] cache",
            ),
            (
                "plugin_opts = [\"a=1\"]\n",
                "plugin_opts",
                "[plugins] options",
            ),
            (
                "[generate]\ndraft_plugin = \"ngram\"\n",
                "generate.draft_plugin",
                "[plugins] draft",
            ),
        ] {
            let p = write(d.path(), "old.toml", &format!("schema_version = 1\n{text}"));
            let e = layer(Some(&p), Settings::default())
                .err()
                .expect("renamed key")
                .to_string();
            assert!(
                e.contains("old.toml") && e.contains(&format!("`{old}`")) && e.contains(new),
                "{e}"
            );
        }
        let p = write(
            d.path(),
            "typo.toml",
            "schema_version = 1\n[plugins]\ncahce = \"lfu\"\n",
        );
        let e = layer(Some(&p), Settings::default())
            .err()
            .expect("unknown key")
            .to_string();
        assert!(
            e.contains("typo.toml")
                && e.contains("`plugins.cahce`")
                && e.contains("did you mean `plugins.cache`"),
            "{e}"
        );
        let p = write(
            d.path(),
            "flat.toml",
            "schema_version = 1\nplugins = \"lfu\"\n",
        );
        let e = layer(Some(&p), Settings::default())
            .err()
            .expect("not a table")
            .to_string();
        assert!(e.contains("flat.toml") && e.contains("[plugins]"), "{e}");
    }

    #[test]
    fn nearest_key_suggestions() {
        assert_eq!(nearest_key("cache_gbb"), "cache_gb");
        assert_eq!(nearest_key("threds"), "threads");
        assert_eq!(nearest_key("serve.lisen"), "serve.listen");
    }
}
