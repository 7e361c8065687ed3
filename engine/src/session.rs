//! Session assembly: memory settings (preset, budgets, I/O policy) -> weight providers.
//!
//! Owns: the decision of which provider serves the trunk (resident, streamed with pinned
//! prefix + ring slots, or plain mmap), the routed experts (resident or the budgeted cache) and
//! the global tensors (resident or ultra-low-memory), and the start-up lines that say so.
//! Must not: compute, or change any byte the executor sees (docs/NUMERICS.md §1: output bits do not
//! depend on any setting chosen here).

use std::path::PathBuf;

use k3_models::spec::ModelSpec;

use crate::checkpoint::Checkpoint;
use crate::exec::Providers;
use crate::plan::Plan;
use crate::resident::{
    ResidentExperts, ResidentGlobal, ResidentMode, ResidentTrunk, load_resident,
};
use crate::stream::experts::{ExpertCache, ExpertCacheOptions};
use crate::stream::global::{GlobalOptions, StreamedGlobal};
use crate::stream::io_policy::{IoPolicy, TrunkIo};
use crate::stream::plan::{PlanError, StateMemory, check_state_memory};
use crate::stream::trunk::{MmapTrunk, StreamedTrunk, TrunkOptions};
use crate::stream::{StreamError, fmt_bytes};

/// Everything that decides where the weights live. Output bits never depend on it.
#[derive(Clone, Debug)]
pub struct MemorySettings {
    /// Packed trunk directory (`pack-trunk` output); `None` = resident trunk.
    pub trunk_dir: Option<PathBuf>,
    /// Trunk budget (pinned prefix + ring slots); `None` with a trunk = pin everything.
    pub trunk_budget_bytes: Option<u64>,
    /// Expert-cache budget; `None` = experts resident (memory-mapped).
    pub cache_budget_bytes: Option<u64>,
    pub ring_slots: usize,
    pub ultra_low_memory: bool,
    pub io: IoPolicy,
    /// Record every (layer, expert) request (`--dump-cache-trace`).
    pub trace_experts: bool,
    /// Expert-cache eviction policy plugin (a cdylib implementing the k3-plugin-abi vtable).
    pub eviction_plugin: Option<PathBuf>,
    /// `KEY=VALUE` options for the plugin's create (`--plugin-opt`).
    pub plugin_options: Vec<String>,
    /// Speculative expert prefetch (`--expert-prefetch`): `Some(margin)` makes the executor
    /// guess the top-(k + margin) experts of each MoE layer ahead of its routing (from the
    /// previous MoE layer's input when the next layer's router is in RAM, else before the
    /// layer's attention) and the cache read them in the background. Only warms the cache;
    /// never changes a bit.
    pub expert_prefetch: Option<usize>,
    /// With `expert_prefetch: None`: turn prefetch on anyway (margin
    /// [`DEFAULT_PREFETCH_MARGIN`]) when the cache holds at least [`AUTO_PREFETCH_LAYERS`]
    /// layers' worth of guesses. `--expert-prefetch false` clears it. (Until guessed experts
    /// were read one task each and computed as they land, ring-slot trunks were left out: the
    /// desktop row was 1.330 with vs 1.212 s/token without, in ladder-s10; now 1.139 with vs
    /// 1.161 without, medians of 7 alternating runs.)
    pub expert_prefetch_auto: bool,
}

/// Layers' worth of guesses (k + margin experts each) the cache must hold for automatic
/// prefetch: the layer being computed, the next layer's guess, and slack.
pub const AUTO_PREFETCH_LAYERS: usize = 3;

/// Extra guessed experts per MoE layer when `--expert-prefetch` is on.
pub const DEFAULT_PREFETCH_MARGIN: usize = 0;

impl Default for MemorySettings {
    fn default() -> Self {
        MemorySettings {
            trunk_dir: None,
            trunk_budget_bytes: None,
            cache_budget_bytes: None,
            ring_slots: 2,
            ultra_low_memory: false,
            io: IoPolicy::direct(),
            trace_experts: false,
            eviction_plugin: None,
            plugin_options: Vec::new(),
            expert_prefetch: None,
            expert_prefetch_auto: true,
        }
    }
}

/// Assembled providers and the memory-plan lines to print at start.
pub struct Session<'c> {
    pub providers: Providers<'c>,
    pub startup: Vec<String>,
    /// Bytes the plan holds in RAM (pinned + ring + cache + resident globals + the
    /// ultra-low-memory lm_head chunk buffer), for the state check. Memory-mapped resident
    /// weights are not counted (the page cache can drop them), except lm_head and the final
    /// norms, read whole every token. A memory-mapped embedding is not in this figure either:
    /// a run reads only its tokens' rows, added per request by [`check_states`]
    /// ([`Plan::embed_touched_bytes`]; see `mapped_embedding`).
    pub planned_bytes: u64,
    /// The embedding is served row by row from the checkpoint's map (resident globals without
    /// an arena): [`check_states`] plans the pages of the rows a request can touch. `false`
    /// when the embedding is in the arena (counted whole in `planned_bytes`) or streamed
    /// (`--ultra-low-memory`: rows read into a buffer, page cache only).
    pub mapped_embedding: bool,
    /// Seconds spent loading the resident arena ([`ResidentMode::Arena`]; start-up cost), if any.
    pub resident_load_seconds: f64,
    /// Bytes of the resident arena on the reserved huge-page pool (`vm.nr_hugepages`): not in
    /// the peak RSS getrusage reports (the trunk's are in its stats, `hugetlb_bytes`).
    pub arena_hugetlb_bytes: u64,
    /// No trunk layer is read from disk per token: the whole trunk is in RAM (resident, or
    /// every layer pinned). Routed experts may still stream.
    pub trunk_in_ram: bool,
}

/// Build the providers for `settings`, resident parts placed by [`ResidentMode::from_env`].
pub fn build<'c>(
    spec: &'c ModelSpec,
    ckpt: &'c Checkpoint,
    plan: &Plan,
    m: &MemorySettings,
) -> Result<Session<'c>, StreamError> {
    build_with(spec, ckpt, plan, m, ResidentMode::from_env()?)
}

/// Build the providers for `settings` with the resident parts placed by `resident`.
pub fn build_with<'c>(
    spec: &'c ModelSpec,
    ckpt: &'c Checkpoint,
    plan: &Plan,
    m: &MemorySettings,
    resident: ResidentMode,
) -> Result<Session<'c>, StreamError> {
    let mut startup = Vec::new();
    let mut planned = 0u64;
    if m.ultra_low_memory && m.trunk_dir.is_none() {
        return Err(StreamError::Config(
            "--ultra-low-memory streams embedding rows and lm_head chunks and needs a packed trunk (--trunk DIR)"
                .into(),
        ));
    }
    let bind = |e: crate::weights::WeightError| StreamError::Invalid(e.to_string());
    let (arena, resident_where) = load_resident(spec, ckpt, m, resident, &mut startup)?;
    let resident_load_seconds = arena.as_ref().map_or(0.0, |a| a.stats().seconds);
    let arena_hugetlb_bytes = arena
        .as_ref()
        .filter(|a| a.stats().hugetlb)
        .map_or(0, |a| a.stats().arena_bytes);
    // Pages of the reserved huge-page pool are not part of the limit the state check uses
    // (MemAvailable and the cgroup leave them out), so they are not planned against it.
    if let Some(a) = arena.as_ref().filter(|a| !a.stats().hugetlb) {
        planned += a.stats().arena_bytes;
    }
    // Whether the whole trunk is in RAM (no layer read per token): kernel workers spin.
    let mut trunk_in_ram = m.trunk_dir.is_none();
    if let Some(dir) = &m.trunk_dir {
        check_trunk_source(dir, spec, ckpt, &mut startup)?;
    }
    let trunk: Box<dyn crate::weights::TrunkSource + 'c> = match &m.trunk_dir {
        None => {
            startup.push(format!(
                "trunk: resident ({}, {resident_where})",
                fmt_bytes(plan.trunk_bytes())
            ));
            Box::new(ResidentTrunk::with_arena(spec, ckpt, arena.clone()).map_err(bind)?)
        }
        Some(dir) => match m.io.trunk {
            TrunkIo::Direct => {
                let opts = TrunkOptions {
                    // no budget: every layer pinned (each rounded up to the 4096-byte I/O alignment)
                    budget_bytes: m
                        .trunk_budget_bytes
                        .unwrap_or(plan.trunk_bytes() + 4096 * plan.layers.len() as u64),
                    ring_slots: m.ring_slots,
                    o_direct: m.io.o_direct,
                    read_threads: m.io.read_threads,
                    preload_pinned: true,
                    // K3_PIN_SYNC=1: load it in the session build, before the run (for A/B).
                    background_pinned: std::env::var_os("K3_PIN_SYNC").is_none(),
                    active_layers: None,
                    pages: m.io.page_source(),
                    pinned_page_cache: m.io.pinned
                        == crate::stream::io_policy::PinnedPages::PageCache,
                };
                if m.trunk_budget_bytes.is_none() {
                    startup.push(
                        "trunk: no --trunk-gb or --preset given: budget = the whole trunk".into(),
                    );
                }
                let pool = crate::stream::direct::ReadPool::for_policy(&m.io)?;
                let t = StreamedTrunk::open_with_pool(dir, spec, &opts, pool)?;
                startup.extend(t.startup_lines());
                planned += t
                    .plan()
                    .planned_bytes()
                    .saturating_sub(crate::weights::TrunkSource::stats(&t).hugetlb_bytes);
                trunk_in_ram = t.plan().pinned_layers == t.plan().n_layers;
                Box::new(t)
            }
            TrunkIo::Mmap => {
                let t = MmapTrunk::open(dir, spec)?;
                startup.extend(t.startup_lines());
                Box::new(t)
            }
        },
    };
    let experts: Box<dyn crate::weights::ExpertSource + 'c> = match m.cache_budget_bytes {
        None => {
            startup.push(format!(
                "experts: resident ({}, {resident_where})",
                fmt_bytes(plan.expert_bytes())
            ));
            let mut r = ResidentExperts::with_arena(spec, ckpt, arena.clone());
            if m.trace_experts {
                r.enable_trace();
            }
            Box::new(r)
        }
        Some(budget) => {
            let opts = ExpertCacheOptions {
                budget_bytes: budget,
                o_direct: m.io.o_direct,
                read_threads: m.io.read_threads,
            };
            let pool = crate::stream::direct::ReadPool::for_policy(&m.io)?;
            let mut c = ExpertCache::new_with_pool(spec, ckpt, &opts, pool)?;
            if m.trace_experts {
                c.enable_trace();
            }
            let k = spec.moe.as_ref().map_or(0, |p| p.n_experts_active);
            let auto_margin = DEFAULT_PREFETCH_MARGIN;
            let auto = m.expert_prefetch.is_none()
                && m.expert_prefetch_auto
                && k > 0
                && c.capacity() >= AUTO_PREFETCH_LAYERS * (k + auto_margin);
            if auto {
                c.set_prefetch_margin(Some(auto_margin));
                startup.push(format!(
                    "expert prefetch: on (automatic: the cache holds >= {AUTO_PREFETCH_LAYERS} layers of top-{} guesses; --expert-prefetch false turns it off)",
                    k + auto_margin
                ));
            } else {
                c.set_prefetch_margin(m.expert_prefetch);
            }
            if let Some(p) = &m.eviction_plugin {
                let shape = crate::plugins::CacheShape {
                    capacity: c.capacity(),
                    expert_bytes: c.store().expert_buf_bytes() as u64,
                    n_layers: spec.n_layers,
                    n_experts: spec.moe.as_ref().map_or(0, |p| p.n_experts),
                    top_k: k,
                };
                c.set_policy(crate::plugins::cache_policy(p, &shape, &m.plugin_options)?);
            }
            startup.push(c.startup_line());
            // A budget above every expert of the model is never allocated.
            planned += budget.min(c.capacity() as u64 * c.store().expert_buf_bytes() as u64);
            Box::new(c)
        }
    };
    let mut mapped_embedding = false;
    let global: Box<dyn crate::weights::GlobalSource + 'c> = if m.ultra_low_memory {
        let g = StreamedGlobal::new(
            spec,
            ckpt,
            &GlobalOptions {
                o_direct: m.io.o_direct,
                ..GlobalOptions::default()
            },
        )?;
        startup.push(g.startup_line());
        planned += g.buffer_bytes();
        Box::new(g)
    } else {
        if arena.is_none() {
            // lm_head and the final norms are read whole every token: planned whole. The
            // embedding is read row by row through the map: planned per request.
            planned += plan.global_bytes.saturating_sub(plan.embed_bytes);
            mapped_embedding = true;
            startup.push(format!(
                "embedding + lm_head: memory-mapped ({resident_where}); lm_head and final norms \
                 planned whole ({}), the {} embedding at the rows a request touches ({} per \
                 token)",
                fmt_bytes(plan.global_bytes.saturating_sub(plan.embed_bytes)),
                fmt_bytes(plan.embed_bytes),
                fmt_bytes(plan.embed_touched_bytes(1))
            ));
        } else {
            startup.push(format!(
                "embedding + lm_head: resident ({}, {resident_where})",
                fmt_bytes(plan.global_bytes)
            ));
        }
        Box::new(ResidentGlobal::with_arena(spec, ckpt, arena.clone()).map_err(bind)?)
    };
    Ok(Session {
        providers: Providers {
            trunk,
            experts,
            global,
        },
        startup,
        planned_bytes: planned,
        mapped_embedding,
        resident_load_seconds,
        arena_hugetlb_bytes,
        trunk_in_ram,
    })
}

/// Environment variable overriding [`Session::kernel_spin`] (microseconds), for benchmarks.
pub const KERNEL_SPIN_ENV: &str = "K3_KERNEL_SPIN_US";

impl Session<'_> {
    /// How long the kernel pool's idle workers spin between dispatches ([`Pool::set_spin`]):
    /// [`k3_kernels::par::DEFAULT_SPIN`] when the whole trunk is in RAM (the spin saves a
    /// wake-up per dispatch: resident decode on k3-mini 0.132 vs 0.144 s/token, pinned trunk
    /// with streamed experts 0.187 vs 0.196), zero when trunk layers are read per token (the
    /// trunk's reader threads need the CPUs between their reads: a ring-slot decode ran
    /// 1.346 vs 1.260 s/token spinning). Never changes a bit.
    ///
    /// [`Pool::set_spin`]: k3_kernels::Pool::set_spin
    /// `K3_KERNEL_SPIN_US` (microseconds) overrides it, for benchmarks.
    pub fn kernel_spin(&self) -> std::time::Duration {
        if let Some(us) = std::env::var(KERNEL_SPIN_ENV)
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
        {
            return std::time::Duration::from_micros(us);
        }
        if self.trunk_in_ram {
            k3_kernels::par::DEFAULT_SPIN
        } else {
            std::time::Duration::ZERO
        }
    }

    /// Apply [`Session::kernel_spin`] to `pool`; the start-up line saying so (`None` for a
    /// one-thread pool, which has no workers).
    pub fn configure_pool(&self, pool: &k3_kernels::Pool) -> Option<String> {
        if pool.n_threads() < 2 {
            return None;
        }
        let spin = self.kernel_spin();
        pool.set_spin(spin);
        let why = if std::env::var_os(KERNEL_SPIN_ENV).is_some() {
            KERNEL_SPIN_ENV
        } else if spin.is_zero() {
            "trunk layers are read per token: the reader threads need the CPUs"
        } else {
            "the trunk is in RAM"
        };
        Some(if spin.is_zero() {
            format!("kernel workers: sleep between dispatches ({why})")
        } else {
            format!(
                "kernel workers: spin {} us between dispatches ({why})",
                spin.as_micros()
            )
        })
    }
}

/// Refuse up front a request whose decode state cannot fit (docs/DESIGN.md §5). `limit` is
/// [`crate::stream::plan::memory_limit_bytes`] measured before [`build`] (after it, the pinned prefix already counts
/// as used and would be counted twice with `planned_bytes`); `None` skips the check. Returns
/// the line to print.
/// `mapped_embedding` ([`Session::mapped_embedding`]): the embedding is read through the map,
/// and the pages of the rows of the request's `positions` tokens are planned beside
/// `planned_bytes` ([`Plan::embed_touched_bytes`]).
pub fn check_state(
    plan: &Plan,
    positions: usize,
    planned_bytes: u64,
    mapped_embedding: bool,
    limit: Option<u64>,
) -> Result<String, StreamError> {
    check_states(plan, positions, 1, planned_bytes, mapped_embedding, limit)
}

/// [`check_state`] for `sequences` sequences decoded together (`--batch-ids`): each holds its
/// own fixed KDA state and its own KV cache of up to `positions` positions, and reads the
/// embedding rows of its own tokens.
pub fn check_states(
    plan: &Plan,
    positions: usize,
    sequences: usize,
    planned_bytes: u64,
    mapped_embedding: bool,
    limit: Option<u64>,
) -> Result<String, StreamError> {
    let n = sequences.max(1) as u64;
    let tokens = positions.saturating_mul(n as usize);
    let embed = if mapped_embedding {
        plan.embed_touched_bytes(tokens)
    } else {
        0
    };
    let planned_bytes = planned_bytes.saturating_add(embed);
    let prefill = plan.prefill_bytes();
    let state = StateMemory {
        bytes_per_position: plan.kv_bytes_per_position() * n,
        fixed_bytes: plan.state_bytes() * n + prefill,
        positions,
    };
    let per = if n > 1 {
        format!(" for {n} sequences")
    } else {
        String::new()
    };
    let mut line = format!(
        "decode state{per}: {} fixed (KDA) + {} per position (MLA latent cache) x {} positions + {} for \
         prompt chunks of {} = {}",
        fmt_bytes(plan.state_bytes() * n),
        fmt_bytes(state.bytes_per_position),
        positions,
        fmt_bytes(prefill),
        plan.prefill_chunk,
        fmt_bytes(state.total())
    );
    if mapped_embedding {
        line.push_str(&format!(
            "; embedding rows through the map: {} for {tokens} tokens (of the {} table), \
             planned with the trunk, cache and lm_head: {}",
            fmt_bytes(embed),
            fmt_bytes(plan.embed_bytes),
            fmt_bytes(planned_bytes)
        ));
    }
    if let Some(limit) = limit {
        check_state_memory(&state, planned_bytes, limit).map_err(|e| match e {
            PlanError::StateTooBig { .. } => StreamError::Plan(e.with_longest(longest_context(
                plan,
                sequences,
                planned_bytes.saturating_sub(embed),
                mapped_embedding,
                limit,
            ))),
            e => StreamError::Plan(e),
        })?;
    }
    Ok(line)
}

/// The most positions [`check_states`] plans for: beyond it a context is "no limit" (a model
/// without MLA layers, whose state does not grow with the context).
pub const CONTEXT_SEARCH_MAX: usize = 1 << 40;

/// The longest context (positions per sequence) whose decode state [`check_states`] accepts
/// next to `planned_bytes` (without the embedding rows: they are counted here, per position,
/// when `mapped_embedding`) in `limit` bytes; 0 when not even one position fits,
/// [`CONTEXT_SEARCH_MAX`] when the state does not grow with positions.
pub fn longest_context(
    plan: &Plan,
    sequences: usize,
    planned_bytes: u64,
    mapped_embedding: bool,
    limit: u64,
) -> usize {
    let n = sequences.max(1) as u64;
    let fits = |positions: usize| {
        let embed = if mapped_embedding {
            plan.embed_touched_bytes(positions.saturating_mul(n as usize))
        } else {
            0
        };
        let state = StateMemory {
            bytes_per_position: plan.kv_bytes_per_position() * n,
            fixed_bytes: plan.state_bytes() * n + plan.prefill_bytes(),
            positions,
        };
        check_state_memory(&state, planned_bytes.saturating_add(embed), limit).is_ok()
    };
    if !fits(1) {
        return 0;
    }
    let (mut lo, mut hi) = (1usize, CONTEXT_SEARCH_MAX);
    if fits(hi) {
        return hi;
    }
    // fits(lo) and !fits(hi): the state grows monotonically with positions
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid) { lo = mid } else { hi = mid }
    }
    lo
}

/// The memory (GB, 1e9 bytes) of the machine class each built-in preset is for: the
/// `MemAvailable` at which `k3-run doctor` picks it (laptop 10, desktop 32, workstation 96,
/// server 192), the 8 GB class ultra's streamed embedding and lm_head are for, and 256 GB for
/// max (its ~224 GB peak RSS on real K3). `k3-run plan` plans each preset's longest context
/// in this memory.
pub const PRESET_MEMORY_GB: [(&str, f64); 6] = [
    ("ultra", 8.0),
    ("laptop", 10.0),
    ("desktop", 32.0),
    ("workstation", 96.0),
    ("server", 192.0),
    ("max", 256.0),
];

/// One row of `k3-run plan`'s longest-context table.
#[derive(Clone, Debug, serde::Serialize)]
pub struct PresetContext {
    pub preset: String,
    /// Memory of the preset's machine class ([`PRESET_MEMORY_GB`]).
    pub memory_bytes: u64,
    /// What the preset plans for weights: trunk (pinned prefix and ring), expert cache and
    /// global tensors (lm_head and final norms, or ultra's streaming buffers).
    pub planned_bytes: u64,
    /// Longest context of one sequence ([`longest_context`]); `None` when the preset's trunk
    /// budget cannot hold one ring slot of this model.
    pub longest: Option<usize>,
}

/// The longest context each built-in preset holds for `plan`'s model in the memory of its
/// machine class ([`PRESET_MEMORY_GB`]): [`preset_context`] for each.
pub fn preset_contexts(plan: &Plan) -> Result<Vec<PresetContext>, StreamError> {
    let mut out = Vec::new();
    for p in crate::stream::presets::builtin_presets()? {
        let Some(&(_, gb)) = PRESET_MEMORY_GB.iter().find(|(n, _)| *n == p.name) else {
            continue;
        };
        out.push(preset_context(plan, &p, (gb * 1e9) as u64)?);
    }
    Ok(out)
}

/// The longest context of one sequence `preset` holds for `plan`'s model in `memory_bytes`:
/// its budgets as a run with `--trunk` plans them ([`build_with`]: trunk plan with 2 ring
/// slots, the expert cache up to every expert, lm_head and final norms whole with the
/// embedding read through the map, or ultra's 64 MiB lm_head chunk and row buffers), and the
/// decode state [`longest_context`] accepts next to them (`k3-run plan` per machine class,
/// `k3-run doctor` in this machine's memory).
pub fn preset_context(
    plan: &Plan,
    preset: &crate::stream::presets::Preset,
    memory_bytes: u64,
) -> Result<PresetContext, StreamError> {
    let sizes: Vec<u64> = plan.layers.iter().map(|l| l.trunk_bytes).collect();
    let trunk = match crate::stream::plan::plan_trunk(&sizes, preset.trunk_bytes()?, 2) {
        Ok(t) => t.planned_bytes(),
        Err(_) => {
            return Ok(PresetContext {
                preset: preset.name.clone(),
                memory_bytes,
                planned_bytes: 0,
                longest: None,
            });
        }
    };
    let experts = preset.cache_bytes()?.min(plan.expert_bytes());
    let lm_head = plan.global_bytes.saturating_sub(plan.embed_bytes);
    let (global, mapped) = if preset.ultra_low_memory {
        let chunk = GlobalOptions::default().chunk_bytes as u64;
        (lm_head.min(chunk) + plan.embed_row_bytes, false)
    } else {
        (lm_head, true)
    };
    let planned = trunk + experts + global;
    Ok(PresetContext {
        preset: preset.name.clone(),
        memory_bytes,
        planned_bytes: planned,
        longest: Some(longest_context(plan, 1, planned, mapped, memory_bytes)),
    })
}

/// `k3-run plan`'s table of [`preset_contexts`].
pub fn preset_context_lines(plan: &Plan, rows: &[PresetContext]) -> Vec<String> {
    let mut v = vec![format!(
        "longest context per preset (planned: one sequence, the preset's budgets with --trunk, \
         in the memory of its machine class; {} per position of MLA cache, {} fixed state \
         and {} for prompt chunks):",
        fmt_bytes(plan.kv_bytes_per_position()),
        fmt_bytes(plan.state_bytes()),
        fmt_bytes(plan.prefill_bytes())
    )];
    for r in rows {
        let what = match r.longest {
            None => "the trunk budget cannot hold one ring slot of this model".to_string(),
            Some(0) => "not one position: the weights' budgets leave no room".to_string(),
            Some(CONTEXT_SEARCH_MAX) => "no limit (the state does not grow)".to_string(),
            Some(n) => format!("{n} positions"),
        };
        v.push(format!(
            "  {:<12} {:>4.0} GB machine, {:>10} planned for weights: {what}",
            r.preset,
            r.memory_bytes as f64 / 1e9,
            fmt_bytes(r.planned_bytes)
        ));
    }
    v
}

/// Refuse a packed trunk at `dir` whose layers were not packed from `ckpt` (each bound
/// layer's `source_fingerprint` against [`Checkpoint::layer_fingerprints`]), naming the first
/// layer that differs and both fingerprints; a trunk.json without them (an older pack) is
/// accepted with a start-up note.
pub(crate) fn check_trunk_source(
    dir: &std::path::Path,
    spec: &ModelSpec,
    ckpt: &Checkpoint,
    startup: &mut Vec<String>,
) -> Result<(), StreamError> {
    let manifest = crate::stream::pack::TrunkManifest::load(dir, spec)?;
    let mut here_all = None;
    for (l, pl) in manifest.layers.iter().enumerate().take(spec.n_layers) {
        let Some(packed) = &pl.source_fingerprint else {
            startup.push(format!(
                "trunk: {} has no source fingerprints (packed by an older k3-run): not checked \
                 against {}",
                dir.display(),
                ckpt.dir().display()
            ));
            return Ok(());
        };
        let here = here_all
            .get_or_insert_with(|| ckpt.layer_fingerprints(spec))
            .get(l)
            .cloned()
            .flatten();
        if here.as_deref() != Some(packed.as_str()) {
            return Err(StreamError::Config(format!(
                "packed trunk {} was packed from other weights than {} (layer {l}: weights \
                 fingerprint {packed}, this checkpoint {}): pack it again with `k3-run \
                 pack-trunk {} {}`",
                dir.display(),
                ckpt.dir().display(),
                here.as_deref().unwrap_or("(tensors missing)"),
                ckpt.dir().display(),
                dir.display()
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stream::plan::plan_trunk;

    /// k3-wide (configs/synth/k3-wide.toml): the release's widths on 13 layers.
    fn k3_wide_plan(positions: usize) -> Plan {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/synth/k3-wide.toml");
        let synth = crate::synth::spec::SynthSpec::load(&path).expect("k3-wide spec");
        let (_, spec) = crate::synth::config_and_spec(&synth, None).expect("k3-wide model");
        Plan::new(&spec, positions)
    }

    #[test]
    fn latent_mla_cache_is_over_40x_smaller_at_release_widths() {
        let plan = k3_wide_plan(6);
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/synth/k3-wide.toml");
        let synth = crate::synth::spec::SynthSpec::load(&path).expect("k3-wide spec");
        let (_, spec) = crate::synth::config_and_spec(&synth, None).expect("k3-wide model");
        let m = spec.mla.as_ref().expect("MLA");
        let n_mla = plan
            .layers
            .iter()
            .filter(|l| l.attn == k3_models::spec::AttnKind::Mla)
            .count() as u64;
        let expanded = n_mla * 4 * (m.n_heads * (m.d_nope + m.d_v) + m.d_rope) as u64;
        let latent = plan.kv_bytes_per_position();
        assert_eq!(latent, n_mla * 4 * (m.kv_lora_rank + m.d_rope) as u64);
        assert!(expanded >= 40 * latent, "{expanded} vs {latent}");
    }

    #[test]
    fn longest_context_is_the_last_one_check_states_accepts() {
        let plan = k3_wide_plan(6);
        let planned = 5_000_000_000u64;
        for (limit, seqs, mapped) in [
            (7_000_000_000u64, 1, true),
            (7_000_000_000, 3, true),
            (9_500_000_000, 1, false),
        ] {
            let n = longest_context(&plan, seqs, planned, mapped, limit);
            assert!(n > 1000 && n < CONTEXT_SEARCH_MAX, "{n}");
            assert!(check_states(&plan, n, seqs, planned, mapped, Some(limit)).is_ok());
            let e = check_states(&plan, n + 1, seqs, planned, mapped, Some(limit))
                .expect_err("one more position does not fit");
            assert!(
                e.to_string()
                    .contains(&format!("the longest context that fits is {n} positions")),
                "{e}"
            );
        }
        assert_eq!(longest_context(&plan, 1, planned, true, planned), 0);
    }

    #[test]
    fn every_preset_plans_its_longest_context() {
        let plan = k3_wide_plan(6);
        let rows = preset_contexts(&plan).expect("presets");
        assert_eq!(rows.len(), PRESET_MEMORY_GB.len());
        for r in &rows {
            let n = r
                .longest
                .expect("every preset holds a ring slot at release widths");
            let mapped = r.preset != "ultra";
            let lim = Some(r.memory_bytes);
            assert!(check_states(&plan, n, 1, r.planned_bytes, mapped, lim).is_ok());
            assert!(check_states(&plan, n + 1, 1, r.planned_bytes, mapped, lim).is_err());
        }
        // the laptop holds a long conversation
        let at = |name: &str| rows.iter().find(|r| r.preset == name).unwrap().longest;
        assert!(at("laptop").unwrap() >= 16_384, "{rows:?}");
        let text = preset_context_lines(&plan, &rows).join("\n");
        assert!(
            text.contains(&format!("{} positions", at("server").unwrap())),
            "{text}"
        );
    }

    #[test]
    fn embedding_rows_are_planned_at_the_pages_a_request_touches() {
        let plan = k3_wide_plan(6);
        // 163,840 x 7168 bf16: a 14,336-byte row spans at most 5 pages of 4 KiB
        assert_eq!(plan.embed_row_bytes, 14_336);
        assert_eq!(plan.embed_bytes, 163_840 * 14_336);
        assert_eq!(plan.embed_touched_bytes(0), 0);
        assert_eq!(plan.embed_touched_bytes(1), 5 * 4096);
        assert_eq!(plan.embed_touched_bytes(6), 6 * 5 * 4096);
        // bounded by the table (its pages, plus one for an unaligned start)
        let table = plan.embed_bytes.div_ceil(4096) * 4096 + 4096;
        assert_eq!(plan.embed_touched_bytes(163_840), table);
        assert_eq!(plan.embed_touched_bytes(usize::MAX), table);
        assert!(plan.embed_touched_bytes(1_000) < plan.embed_bytes / 100);
    }

    /// The laptop preset (3 GB trunk, 1 GB expert cache) on k3-wide in an 8 GB memory cgroup
    /// (7.97 GB of headroom at start): the run holds the shared ring, the cache, lm_head and
    /// the rows of its tokens, and is let through; counting the whole 2.35 GB embedding table
    /// as resident refused it.
    #[test]
    fn laptop_preset_at_release_widths_passes_the_check_in_8_gb() {
        let positions = 6;
        let plan = k3_wide_plan(positions);
        let sizes: Vec<u64> = plan.layers.iter().map(|l| l.trunk_bytes).collect();
        let trunk = plan_trunk(&sizes, 3_000_000_000, 2).expect("laptop trunk plan");
        assert!(trunk.shared_ring_bytes > 0, "{trunk:?}");
        let limit = 7_970_000_000u64;
        let without_embedding =
            trunk.planned_bytes() + 1_000_000_000 + (plan.global_bytes - plan.embed_bytes);
        let line = check_states(&plan, positions, 1, without_embedding, true, Some(limit))
            .expect("the laptop preset fits an 8 GB cap");
        assert!(line.contains("embedding rows through the map"), "{line}");
        // the old accounting: the whole table planned resident
        let whole_table = without_embedding + plan.embed_bytes;
        let e = check_states(&plan, positions, 1, whole_table, false, Some(limit))
            .expect_err("whole embedding table counted");
        assert!(e.to_string().contains("already planned"), "{e}");
        // a batch reads the rows of every sequence's tokens
        let one = plan.embed_touched_bytes(positions);
        let four = plan.embed_touched_bytes(4 * positions);
        assert_eq!(four, 4 * one);
        let tight = without_embedding
            + plan.state_bytes() * 4
            + plan.prefill_bytes()
            + 4 * positions as u64 * plan.kv_bytes_per_position()
            + one;
        // enough for the state and one sequence's rows, not four sequences' rows
        assert!(check_states(&plan, positions, 4, without_embedding, true, Some(tight)).is_err());
        assert!(
            check_states(
                &plan,
                positions,
                4,
                without_embedding,
                true,
                Some(tight - one + four)
            )
            .is_ok()
        );
    }
}
