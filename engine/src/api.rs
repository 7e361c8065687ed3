//! The embedding API: open a model directory with memory settings, generate greedy tokens from
//! prompt ids (each token handed to a callback as soon as it is known), save and load the decode
//! state, and read the run's report.
//!
//! This module is the stable surface of the engine; everything else in the crate is internal
//! (used by the `k3-run` binary, the tests and the benches) and may change. It is a facade over
//! the same functions the command line runs (`k3-run MODEL_DIR --ids ...`): the spec and
//! checkpoint ([`crate::model`], [`crate::checkpoint`]), the memory settings and providers
//! ([`crate::session`]), the plan ([`crate::plan`]), the executor ([`crate::exec`]) and the
//! decode loop ([`crate::run`]). The ids are the same bits at every memory budget and thread
//! count.
//!
//! ```
//! use k3_engine::api::{Model, Request, Settings};
//!
//! // The small synthetic model shipped with the repository (a directory of safetensors shards).
//! let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures/models/A/ckpt");
//! let model = Model::open(dir, &Settings::default())?;
//! let mut streamed = Vec::new();
//! let run = model.generate(&Request::new(vec![11, 22, 33], 4), None, |t| {
//!     streamed.push(t.id); // called once per token, as it is generated
//!     true // keep going
//! })?;
//! assert_eq!(run.report.generated_ids, streamed);
//! assert_eq!(run.report.generated_ids.len(), 4);
//! # Ok::<(), k3_engine::api::Error>(())
//! ```

use std::path::{Path, PathBuf};
use std::time::Instant;

use k3_models::spec::ModelSpec;

use crate::checkpoint::{Checkpoint, OpenOptions};
use crate::exec::{Executor, SeqState};
use crate::plan::Plan;
use crate::resident::ResidentMode;
use crate::run::{GenOptions, GenRequest};
use crate::session::MemorySettings;
use crate::stream::{gb_to_bytes, io_policy, presets};

/// What went wrong, by kind. The message says what and where, in the command line's words.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The settings cannot be used: unknown preset, a budget that is not a number of GB, a
    /// thread count out of range, budgets for a packed trunk without one.
    #[error("settings: {0}")]
    Settings(String),
    /// The model directory cannot be read as a model: config.json, shards, index, tensors.
    #[error("model: {0}")]
    Model(String),
    /// The request cannot be run: empty prompt, an id outside the vocabulary, a state from
    /// another model.
    #[error("request: {0}")]
    Request(String),
    /// The weights or the decode state do not fit the memory budgets or the memory available.
    #[error("memory: {0}")]
    Memory(String),
    /// The forward pass failed (a read error, non-finite logits).
    #[error("forward pass: {0}")]
    Forward(String),
    /// A routed expert could not be loaded: the run stopped, and the ids generated so far (in
    /// the message's count) are not trustworthy. Nothing is replaced by zeros.
    #[error("expert load failed after {generated} tokens: {msg}")]
    ExpertLoad {
        /// Tokens generated before the failure.
        generated: usize,
        /// What failed.
        msg: String,
    },
    /// A decode-state file could not be written or read, or does not belong to this model.
    #[error("state file: {0}")]
    State(String),
}

/// How much memory the weights may take.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum Memory {
    /// Everything resident: the trunk and the routed experts are served from the checkpoint's
    /// memory maps (the page cache). Right for models that fit in RAM.
    #[default]
    Resident,
    /// A memory preset by name (`ultra`, `laptop`, `desktop`, `workstation`, `server`, `max`)
    /// or the path of a preset TOML file. Its trunk budget applies with
    /// [`Settings::trunk_dir`]; without it only its expert-cache budget does.
    Preset(String),
    /// Explicit budgets in GB (1e9 bytes; fractions allowed). `trunk_gb` applies with
    /// [`Settings::trunk_dir`] (`None`: pin the whole trunk); `cache_gb` bounds the routed-expert
    /// cache (`None`: experts resident; `Some(0.0)`: read on every use).
    Budgets {
        /// Trunk budget: pinned prefix plus ring slots.
        trunk_gb: Option<f64>,
        /// Routed-expert cache budget.
        cache_gb: Option<f64>,
    },
}

/// How to open a model: memory budgets, where the packed trunk is, how many threads.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Settings {
    /// Memory budgets (default: everything resident).
    pub memory: Memory,
    /// A packed trunk directory (written by `k3-run pack-trunk`): the dense trunk is streamed
    /// from it within the trunk budget. `None`: the trunk is resident.
    pub trunk_dir: Option<PathBuf>,
    /// Worker threads (1..=1024); `None`: the physical cores.
    pub threads: Option<usize>,
}

impl Settings {
    /// Settings with a memory preset (see [`Memory::Preset`]).
    pub fn preset(name: impl Into<String>) -> Settings {
        Settings {
            memory: Memory::Preset(name.into()),
            ..Settings::default()
        }
    }
}

/// What to generate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    /// Prompt token ids (at least one; each below the vocabulary size).
    pub prompt_ids: Vec<u32>,
    /// Tokens to generate (greedy). 0 feeds the prompt only (to save the state after it).
    pub max_tokens: usize,
    /// Stop after generating one of these ids (it is included in the output).
    pub stop_ids: Vec<u32>,
}

impl Request {
    /// `max_tokens` greedy tokens after `prompt_ids`, no stop ids.
    pub fn new(prompt_ids: Vec<u32>, max_tokens: usize) -> Request {
        Request {
            prompt_ids,
            max_tokens,
            stop_ids: Vec::new(),
        }
    }
}

/// One generated token, as handed to the callback.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Token {
    /// 0 for the first generated token.
    pub index: usize,
    /// The token id.
    pub id: u32,
    /// Seconds since the request started (prompt included).
    pub seconds: f64,
}

/// Timings of one request, in wall-clock seconds.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct Timings {
    /// Building the weight providers for the request (pinned prefix, resident arena).
    pub startup_seconds: f64,
    /// Feeding the prompt.
    pub prefill_seconds: f64,
    /// From the start of the prompt until the first generated token was known.
    pub first_token_seconds: f64,
    /// Mean per generated token after the first.
    pub seconds_per_token: f64,
    /// The whole decode loop (prompt and tokens; start-up not included).
    pub total_seconds: f64,
}

/// I/O and cache counters of one request.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct Counters {
    /// Bytes of the streamed trunk read from disk (0 with a resident trunk).
    pub trunk_bytes_read: u64,
    /// Seconds spent reading the trunk.
    pub trunk_read_seconds: f64,
    /// Routed-expert requests (one per selected expert per token and layer).
    pub expert_requests: u64,
    /// Expert requests served from memory.
    pub expert_hits: u64,
    /// Expert requests read from disk.
    pub expert_misses: u64,
    /// Bytes of routed experts read from disk.
    pub expert_bytes_read: u64,
    /// Seconds the forward pass waited for expert reads.
    pub expert_read_seconds: f64,
    /// Peak resident set size of the process so far (getrusage).
    pub peak_rss_bytes: u64,
}

/// What one request produced.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct Report {
    /// The request's prompt ids (after any state it continued from).
    pub prompt_ids: Vec<u32>,
    /// The generated ids, in order.
    pub generated_ids: Vec<u32>,
    /// FNV-1a 64 of the first generated token's logit bits (hex): equal hashes, equal bits.
    pub first_logits_hash: String,
    /// Why the request stopped before `max_tokens` (`stop id N`, `interrupted` when the
    /// callback returned false); `None` when it ran to the end.
    pub stopped_by: Option<String>,
    /// Timings.
    pub timings: Timings,
    /// I/O and cache counters.
    pub counters: Counters,
}

/// A request's report and the decode state after it.
#[derive(Clone, Debug)]
pub struct Generation {
    /// What the request produced.
    pub report: Report,
    /// The state after every token fed: the prompt and every generated id but the last, which
    /// the next request should start with to continue the same sequence.
    pub state: DecodeState,
}

/// The exact decode state of one sequence (KV cache, recurrent state) and the ids it consumed.
/// Continuing from it gives the same bits as feeding its ids again.
#[derive(Clone, Debug)]
pub struct DecodeState {
    state: SeqState,
    ids: Vec<u32>,
}

impl DecodeState {
    /// The token ids the state has consumed, in order.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// Positions consumed (the length of [`DecodeState::ids`]).
    pub fn positions(&self) -> usize {
        self.state.n_pos
    }
}

/// An opened model: the checkpoint's files mapped, the spec bound, the settings resolved.
/// Each [`Model::generate`] builds the weight providers for its request (a streamed trunk's
/// pinned prefix is read again, a cache starts empty) and runs it on the calling thread.
pub struct Model {
    spec: ModelSpec,
    ckpt: Checkpoint,
    memory: MemorySettings,
    threads: usize,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("name", &self.spec.name)
            .field("layers", &self.spec.n_layers)
            .field("vocab_size", &self.spec.vocab_size)
            .field("threads", &self.threads)
            .finish_non_exhaustive()
    }
}

/// The most worker threads a model takes.
const MAX_THREADS: usize = 1024;

impl Model {
    /// Open the checkpoint in `dir` (config.json, safetensors shards and index) with the
    /// built-in Kimi manifest, and resolve `settings` (the same rules as the command line's
    /// `--preset`, `--trunk-gb`, `--cache-gb`, `--trunk`, `--threads`).
    pub fn open(dir: impl AsRef<Path>, settings: &Settings) -> Result<Model, Error> {
        let dir = dir.as_ref();
        let memory = memory_settings(settings)?;
        let threads = match settings.threads {
            None => default_threads(),
            Some(n) if (1..=MAX_THREADS).contains(&n) => n,
            Some(n) => {
                return Err(Error::Settings(format!(
                    "{n} threads; must be in 1..={MAX_THREADS}"
                )));
            }
        };
        let (spec, files) = crate::model::load_spec_files(dir, None, None)
            .map_err(|e| Error::Model(e.to_string()))?;
        // Streamed experts are checked as they are read; resident ones here.
        let opts = OpenOptions {
            validate_expert_scales: memory.cache_budget_bytes.is_none(),
        };
        let ckpt = match files {
            Some(f) => f.checked(&spec, &opts),
            None => Checkpoint::open_with(dir, &spec, &opts),
        }
        .map_err(|e| Error::Model(e.to_string()))?;
        Ok(Model {
            spec,
            ckpt,
            memory,
            threads,
        })
    }

    /// The model's name (from its config).
    pub fn name(&self) -> &str {
        &self.spec.name
    }

    /// Vocabulary size: every token id is below it.
    pub fn vocab_size(&self) -> usize {
        self.spec.vocab_size
    }

    /// Decoder layers.
    pub fn n_layers(&self) -> usize {
        self.spec.n_layers
    }

    /// Worker threads a request uses.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Generate greedily: feed `request.prompt_ids` after `state` (or from the start), then
    /// generate up to `request.max_tokens` ids, calling `on_token` with each as soon as it is
    /// known (return `false` from it to stop; the report then says `interrupted`).
    pub fn generate(
        &self,
        request: &Request,
        state: Option<&DecodeState>,
        mut on_token: impl FnMut(&Token) -> bool,
    ) -> Result<Generation, Error> {
        let spec = &self.spec;
        if request.prompt_ids.is_empty() {
            return Err(Error::Request("the prompt is empty".into()));
        }
        if let Some(bad) = request
            .prompt_ids
            .iter()
            .find(|&&t| t as usize >= spec.vocab_size)
        {
            return Err(Error::Request(format!(
                "token {bad} is outside the vocabulary (size {})",
                spec.vocab_size
            )));
        }
        let (start, prefix) = match state {
            Some(s) => (s.state.clone(), s.ids.clone()),
            None => (SeqState::new(spec), Vec::new()),
        };
        let positions = prefix.len() + request.prompt_ids.len() + request.max_tokens;
        let t0 = Instant::now();
        let plan = Plan::new(spec, positions);
        // measured before the session allocates: afterwards its own pages count as used
        let limit = crate::platform::memory::memory_limit_bytes();
        let mut session =
            crate::session::build_with(spec, &self.ckpt, &plan, &self.memory, ResidentMode::Mmap)
                .map_err(|e| Error::Memory(e.to_string()))?;
        crate::session::check_states(
            &plan,
            positions,
            1,
            session.planned_bytes,
            session.mapped_embedding,
            limit,
        )
        .map_err(|e| Error::Memory(e.to_string()))?;
        let mut exec = Executor::new(spec, plan, self.threads);
        session.configure_pool(exec.pool());
        let startup_seconds = t0.elapsed().as_secs_f64();
        let req = GenRequest {
            prompt_ids: request.prompt_ids.clone(),
            n_gen: request.max_tokens,
            incremental: true,
            stop_ids: request.stop_ids.clone(),
        };
        let providers = &mut session.providers;
        let mut cb = |index: usize, id: u32, seconds: f64| on_token(&Token { index, id, seconds });
        let (res, _, end) = crate::run::generate_with(
            spec,
            &mut exec,
            providers,
            &req,
            start,
            GenOptions::default(),
            &mut cb,
        )
        .map_err(|e| Error::Forward(e.to_string()))?;
        let trunk = providers.trunk.stats();
        let experts = providers.experts.stats();
        if let Some(why) = res
            .stopped_by
            .as_deref()
            .filter(|s| s.starts_with("expert load failed"))
        {
            return Err(Error::ExpertLoad {
                generated: res.generated_ids.len(),
                msg: why.to_string(),
            });
        }
        // Every id but the last generated one has been fed.
        let fed = res.generated_ids.len().saturating_sub(1);
        let ids: Vec<u32> = prefix
            .iter()
            .chain(&req.prompt_ids)
            .chain(&res.generated_ids[..fed])
            .copied()
            .collect();
        debug_assert_eq!(ids.len(), end.n_pos, "the state's positions and its ids");
        let report = Report {
            prompt_ids: res.prompt_ids,
            generated_ids: res.generated_ids,
            first_logits_hash: res.first_logits_hash,
            stopped_by: res.stopped_by,
            timings: Timings {
                startup_seconds,
                prefill_seconds: res.prefill_seconds,
                first_token_seconds: res.first_token_seconds,
                seconds_per_token: res.seconds_per_token,
                total_seconds: res.total_seconds,
            },
            counters: Counters {
                trunk_bytes_read: trunk.bytes_read,
                trunk_read_seconds: trunk.read_seconds,
                expert_requests: experts.requests,
                expert_hits: experts.hits,
                expert_misses: experts.misses,
                expert_bytes_read: experts.bytes_read,
                expert_read_seconds: experts.read_seconds,
                peak_rss_bytes: crate::run::peak_rss_bytes(),
            },
        };
        Ok(Generation {
            report,
            state: DecodeState { state: end, ids },
        })
    }

    /// Write `state` to `path` (the format of `k3-run --save-state`), with fingerprints of this
    /// model's tensor inventory and weights.
    pub fn save_state(&self, state: &DecodeState, path: impl AsRef<Path>) -> Result<(), Error> {
        let fp = self.ckpt.weights_fingerprint(&self.spec);
        crate::statefile::save(path.as_ref(), &self.spec, fp, &state.state, &state.ids)
            .map_err(|e| Error::State(e.to_string()))
    }

    /// Read a state written by [`Model::save_state`] (or `k3-run --save-state`); refused when
    /// it was computed by another model or other weights.
    pub fn load_state(&self, path: impl AsRef<Path>) -> Result<DecodeState, Error> {
        let fp = self.ckpt.weights_fingerprint(&self.spec);
        let (state, ids) = crate::statefile::load(path.as_ref(), &self.spec, fp.as_deref())
            .map_err(|e| Error::State(e.to_string()))?;
        Ok(DecodeState { state, ids })
    }
}

/// Physical cores, at most the CPUs this process may run on.
fn default_threads() -> usize {
    let avail = std::thread::available_parallelism().map_or(1, |n| n.get());
    num_cpus::get_physical().min(avail).max(1)
}

/// [`Settings`] into the engine's memory settings (the command line's rules: a preset's trunk
/// budget and ultra-low-memory setting need a packed trunk; its cache budget applies anyway).
fn memory_settings(s: &Settings) -> Result<MemorySettings, Error> {
    let cfg = |e: crate::stream::StreamError| Error::Settings(e.to_string());
    let streamed = s.trunk_dir.is_some();
    let (trunk_gb, cache_gb, ultra) = match &s.memory {
        Memory::Resident => (None, None, false),
        Memory::Preset(name) => {
            let p = presets::load_preset(name).map_err(cfg)?;
            (Some(p.trunk_gb), Some(p.cache_gb), p.ultra_low_memory)
        }
        Memory::Budgets { trunk_gb, cache_gb } => {
            if trunk_gb.is_some() && !streamed {
                return Err(Error::Settings(
                    "a trunk budget sizes a packed trunk's memory: set trunk_dir (from \
                     `k3-run pack-trunk`); without it the trunk is resident"
                        .into(),
                ));
            }
            (*trunk_gb, *cache_gb, false)
        }
    };
    let bytes = |v: Option<f64>, what: &str| v.map(|g| gb_to_bytes(g, what)).transpose();
    if let Some(dir) = &s.trunk_dir
        && !dir.join(crate::stream::pack::TRUNK_JSON).is_file()
    {
        return Err(Error::Settings(format!(
            "trunk_dir {}: no {}: not a packed trunk (write one with `k3-run pack-trunk`)",
            dir.display(),
            crate::stream::pack::TRUNK_JSON
        )));
    }
    Ok(MemorySettings {
        trunk_dir: s.trunk_dir.clone(),
        trunk_budget_bytes: if streamed {
            bytes(trunk_gb, "the trunk budget").map_err(cfg)?
        } else {
            None
        },
        cache_budget_bytes: bytes(cache_gb, "the expert-cache budget").map_err(cfg)?,
        ultra_low_memory: ultra && streamed,
        io: io_policy::load_io_policy("direct").map_err(cfg)?,
        ..MemorySettings::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_resolve_like_the_command_line() {
        let m = memory_settings(&Settings::default()).expect("resident");
        assert_eq!((m.trunk_budget_bytes, m.cache_budget_bytes), (None, None));
        // a preset without a packed trunk: only its cache budget applies
        let p = presets::load_preset("laptop").expect("shipped preset");
        let m = memory_settings(&Settings::preset("laptop")).expect("laptop");
        assert_eq!(m.trunk_budget_bytes, None);
        assert_eq!(
            m.cache_budget_bytes,
            Some(gb_to_bytes(p.cache_gb, "x").expect("bytes"))
        );
        assert!(!m.ultra_low_memory);
        let budgets = |trunk_gb, cache_gb| Settings {
            memory: Memory::Budgets { trunk_gb, cache_gb },
            ..Settings::default()
        };
        assert!(matches!(
            memory_settings(&budgets(Some(1.0), None)),
            Err(Error::Settings(_))
        ));
        assert!(matches!(
            memory_settings(&budgets(None, Some(-1.0))),
            Err(Error::Settings(_))
        ));
        assert!(matches!(
            memory_settings(&Settings::preset("no-such-preset")),
            Err(Error::Settings(_))
        ));
        let m = memory_settings(&budgets(None, Some(0.5))).expect("cache only");
        assert_eq!(m.cache_budget_bytes, Some(500_000_000));
    }
}
