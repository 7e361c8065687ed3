//! Resident weight providers: every tensor held in RAM for the whole run.
//!
//! Owns: the [`TrunkSource`], [`ExpertSource`] and [`GlobalSource`] used when no packed trunk
//! is given (docs/DESIGN.md §3: "without a packed trunk the whole trunk loads resident"), and which
//! bytes each of them serves ([`ResidentMode`]): the checkpoint's own memory maps (page cache,
//! 4 KiB pages; the default, and always under the `--io mmap` policy) or a [`ResidentArena`]
//! (the checkpoint's tensors loaded once at start-up into 2 MiB-page anonymous memory; opt-in,
//! `K3_RESIDENT=arena`: on k3-mini it decoded 2-7% faster but cost 3-16 s of start-up, see
//! docs/history/PERFORMANCE-LOG.md §3.1). Every tensor is bound once at construction, including a
//! (layer, expert) -> tensors index, so a request does no name lookup.
//! Must not: convert weights (the executor widens exactly from the checkpoint's own bytes;
//! the arena holds a byte copy of them, so both sources give identical bits).

use std::sync::Arc;

use k3_kernels::{matvec, par::Pool};
use k3_models::spec::{ExpertFormat, ModelSpec, TensorDecl, TensorRole};

use crate::arena::{Arena, ArenaOptions, ArenaStats};
use crate::checkpoint::Checkpoint;
use crate::stream::StreamError;
use crate::weights::{
    ExpertSource, ExpertStats, ExpertWeights, GlobalSource, LayerWeights, TensorBytes, TrunkSource,
    TrunkStats, WeightError,
};

/// Which part of the model a declared tensor belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    /// Per-layer tensors that are not routed experts.
    Trunk,
    /// Routed-expert tensors.
    Experts,
    /// Tensors of no layer (embedding, lm_head, final norms).
    Global,
}

impl Part {
    pub fn of(decl: &TensorDecl) -> Part {
        match (decl.layer, decl.expert) {
            (_, Some(_)) => Part::Experts,
            (Some(_), None) => Part::Trunk,
            (None, None) => Part::Global,
        }
    }
}

/// Declared tensors of the chosen parts, loaded into one huge-page arena.
#[derive(Debug)]
pub struct ResidentArena {
    arena: Arena,
    /// Position in `spec.tensors` -> index in `arena`.
    slot: Vec<Option<u32>>,
}

impl ResidentArena {
    /// Load every tensor of `spec` whose [`Part`] is in `parts` from `ckpt`.
    pub fn load(
        spec: &ModelSpec,
        ckpt: &Checkpoint,
        parts: &[Part],
        opts: &ArenaOptions,
    ) -> Result<ResidentArena, StreamError> {
        let mut slot = vec![None; spec.tensors.len()];
        let mut decls = Vec::new();
        for (i, d) in spec.tensors.iter().enumerate() {
            if parts.contains(&Part::of(d)) {
                slot[i] =
                    Some(u32::try_from(decls.len()).map_err(|_| {
                        StreamError::Invalid("more than 2^32 resident tensors".into())
                    })?);
                decls.push(d);
            }
        }
        let arena = Arena::load(ckpt, &decls, opts)?;
        Ok(ResidentArena { arena, slot })
    }

    /// Bytes the arena would take for `parts` (tensor bytes; the arena adds < 0.1% padding).
    pub fn planned_bytes(spec: &ModelSpec, ckpt: &Checkpoint, parts: &[Part]) -> u64 {
        spec.tensors
            .iter()
            .filter(|d| parts.contains(&Part::of(d)))
            .filter_map(|d| ckpt.try_location(&d.name))
            .map(|l| l.n_bytes)
            .sum()
    }

    /// The bytes of `spec.tensors[i]` if the arena holds it.
    pub fn tensor_bytes(&self, i: usize) -> Option<&[u8]> {
        self.slot
            .get(i)
            .copied()
            .flatten()
            .map(|k| self.arena.bytes(k as usize))
    }

    pub fn stats(&self) -> &ArenaStats {
        self.arena.stats()
    }

    pub fn startup_line(&self) -> String {
        self.arena.startup_line()
    }

    fn get(&self, spec_index: usize) -> Option<u32> {
        self.slot.get(spec_index).copied().flatten()
    }
}

/// Where the resident parts of the model live (output bits never depend on it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ResidentMode {
    /// Served from the checkpoint's memory maps (page cache, 4 KiB pages). Default.
    #[default]
    Mmap,
    /// Loaded at start-up into 2 MiB-page anonymous memory ([`ResidentArena`]) with O_DIRECT
    /// reads; falls back to `Mmap` (reported) when it does not fit in the memory available.
    /// The `--io mmap` policy always means `Mmap`.
    Arena,
}

/// Environment variable choosing [`ResidentMode`] for [`crate::session::build`]: `mmap` or `arena`.
pub const RESIDENT_ENV: &str = "K3_RESIDENT";

impl ResidentMode {
    /// Parse `mmap` / `arena`.
    pub fn parse(v: &str) -> Result<ResidentMode, StreamError> {
        match v {
            "mmap" => Ok(ResidentMode::Mmap),
            "arena" => Ok(ResidentMode::Arena),
            v => Err(StreamError::Config(format!(
                "unknown resident mode {v:?} (--resident or {RESIDENT_ENV}); expected mmap or arena"
            ))),
        }
    }

    /// [`RESIDENT_ENV`] if set, else the default.
    pub fn from_env() -> Result<ResidentMode, StreamError> {
        match std::env::var(RESIDENT_ENV) {
            Ok(v) => Self::parse(v.trim()),
            Err(_) => Ok(ResidentMode::default()),
        }
    }
}

/// With [`ResidentMode::Arena`], load the resident parts (trunk without `--trunk`, experts
/// without `--cache-gb`, globals without `--ultra-low-memory`) into a 2 MiB-page arena, unless
/// the I/O policy is `mmap` or they do not fit in the memory available; otherwise they are
/// served from the checkpoint's memory maps. Returns the arena and the words saying where the
/// resident bytes live.
pub fn load_resident(
    spec: &ModelSpec,
    ckpt: &Checkpoint,
    m: &crate::session::MemorySettings,
    mode: ResidentMode,
    startup: &mut Vec<String>,
) -> Result<(Option<Arc<ResidentArena>>, &'static str), StreamError> {
    const MAPPED: &str = "memory-mapped checkpoint shards";
    let mut parts = Vec::new();
    if m.trunk_dir.is_none() {
        parts.push(Part::Trunk);
    }
    if m.cache_budget_bytes.is_none() {
        parts.push(Part::Experts);
    }
    if !m.ultra_low_memory {
        parts.push(Part::Global);
    }
    // Resident experts whose scales were not checked at open (the arena mode defers it to
    // here) are checked where they will be served from.
    let check_mapped = |ckpt: &Checkpoint| -> Result<(), StreamError> {
        if parts.contains(&Part::Experts) && !ckpt.scales_checked() {
            ckpt.check_all_scales(spec)
                .map_err(|e| StreamError::Invalid(e.to_string()))?;
        }
        Ok(())
    };
    let mmap_policy = m.io.trunk == crate::stream::io_policy::TrunkIo::Mmap;
    // An arena asked for and not loaded is said, not dropped silently.
    if mode == ResidentMode::Arena && (parts.is_empty() || mmap_policy) {
        startup.push(
            if parts.is_empty() {
                "resident weights: none (trunk, routed experts, embedding and lm_head all \
                 streamed), so --resident arena (or K3_RESIDENT=arena) has nothing to load"
            } else {
                "resident weights: the I/O policy `mmap` serves them from the checkpoint's \
                 memory maps, so --resident arena (or K3_RESIDENT=arena) is not used"
            }
            .to_string(),
        );
    }
    if parts.is_empty() || mode == ResidentMode::Mmap || mmap_policy {
        check_mapped(ckpt)?;
        return Ok((None, MAPPED));
    }
    let need = ResidentArena::planned_bytes(spec, ckpt, &parts);
    // The reserved huge-page pool is outside MemAvailable: an arena it can hold fits.
    let in_pool = m.io.reserved_huge_pages
        && m.io.huge_pages
        && crate::platform::memory::reserved_pool_free_bytes().is_some_and(|f| f >= need);
    if !in_pool
        && let Some(avail) = crate::platform::memory::memory_limit_bytes()
        && need > avail
    {
        startup.push(format!(
            "resident weights: {} do not fit in the {} of memory available; served from the checkpoint's memory maps instead",
            crate::stream::fmt_bytes(need),
            crate::stream::fmt_bytes(avail)
        ));
        check_mapped(ckpt)?;
        return Ok((None, MAPPED));
    }
    let opts = crate::arena::ArenaOptions {
        o_direct: m.io.o_direct,
        huge_pages: m.io.huge_pages,
        pages: m.io.page_source(),
        read_threads: m.io.read_threads,
        progress: true,
    };
    // The open-time checks touched ~1/4 of the shards through the maps (scale pages and
    // their fault-around neighbours); let those go first so peak RSS is the arena, not both.
    crate::arena::release_mapped_pages(ckpt);
    let a = ResidentArena::load(spec, ckpt, &parts, &opts)?;
    if parts.contains(&Part::Experts) && !ckpt.scales_checked() {
        // From RAM: through the maps this read most of the experts a second time (the scale
        // pages' read-ahead windows), 2.7 s of a 7 s start on k3-mini.
        for (i, d) in spec.tensors.iter().enumerate() {
            if Checkpoint::is_scale(d)
                && let Some(bytes) = a.tensor_bytes(i)
            {
                ckpt.check_scale_bytes(d, bytes)
                    .map_err(|e| StreamError::Invalid(e.to_string()))?;
            }
        }
    }
    startup.push(a.startup_line());
    let words = if a.stats().huge_pages {
        "in RAM, 2 MiB pages"
    } else {
        "in RAM"
    };
    Ok((Some(Arc::new(a)), words))
}

/// Where one bound tensor's bytes are.
#[derive(Clone, Copy, Debug)]
enum Src<'c> {
    Mapped(&'c [u8]),
    Arena(u32),
}

/// The source of every resident tensor: the arena when it holds the tensor, else the map.
#[derive(Clone, Debug)]
struct Binder<'c> {
    spec: &'c ModelSpec,
    ckpt: &'c Checkpoint,
    arena: Option<Arc<ResidentArena>>,
}

impl<'c> Binder<'c> {
    fn bind(&self, i: usize) -> Result<Src<'c>, WeightError> {
        if let Some(s) = self.arena.as_ref().and_then(|a| a.get(i)) {
            return Ok(Src::Arena(s));
        }
        let decl = &self.spec.tensors[i];
        let bytes = self
            .ckpt
            .try_bytes(&decl.name)
            .ok_or_else(|| WeightError::Invalid {
                name: decl.name.clone(),
                msg: format!(
                    "not present in the checkpoint at {}",
                    self.ckpt.dir().display()
                ),
            })?;
        Ok(Src::Mapped(bytes))
    }
}

/// Resolve a bound source against its arena.
fn resolve<'a>(arena: Option<&'a Arc<ResidentArena>>, src: Src<'a>) -> &'a [u8] {
    match (src, arena) {
        (Src::Mapped(b), _) => b,
        (Src::Arena(s), Some(a)) => a.arena.bytes(s as usize),
        (Src::Arena(_), None) => {
            unreachable!("invariant: Src::Arena is only bound when the provider holds an arena")
        }
    }
}

/// The whole dense trunk, resident.
pub struct ResidentTrunk<'c> {
    layers: Vec<Vec<(&'c TensorDecl, Src<'c>)>>,
    arena: Option<Arc<ResidentArena>>,
    stats: TrunkStats,
    /// `advised[layer]`: its mapped tensors were given `MADV_WILLNEED` (on the first pass
    /// only: the advice walks the page cache, too slow to repeat every token).
    advised: Vec<bool>,
}

/// Layers past the requested one whose mapped tensors [`ResidentTrunk`] advises on the first
/// pass: their reads run while this layer computes.
const TRUNK_ADVISE_AHEAD: usize = 2;

impl<'c> ResidentTrunk<'c> {
    /// Served from `arena` for the tensors it holds, the rest (everything with `None`) from
    /// the checkpoint's memory maps.
    pub fn with_arena(
        spec: &'c ModelSpec,
        ckpt: &'c Checkpoint,
        arena: Option<Arc<ResidentArena>>,
    ) -> Result<Self, WeightError> {
        let b = Binder { spec, ckpt, arena };
        let mut layers: Vec<Vec<(&'c TensorDecl, Src<'c>)>> = vec![Vec::new(); spec.n_layers];
        let mut pinned_bytes = 0u64;
        for (i, t) in spec.tensors.iter().enumerate() {
            if let (Some(l), None) = (t.layer, t.expert) {
                let src = b.bind(i)?;
                pinned_bytes += resolve(b.arena.as_ref(), src).len() as u64;
                layers
                    .get_mut(l)
                    .ok_or_else(|| WeightError::Invalid {
                        name: t.name.clone(),
                        msg: format!("layer {l} is past the model's {} layers", spec.n_layers),
                    })?
                    .push((t, src));
            }
        }
        let stats = TrunkStats {
            n_layers: spec.n_layers,
            pinned_layers: spec.n_layers,
            pinned_bytes,
            ..TrunkStats::default()
        };
        Ok(ResidentTrunk {
            advised: vec![false; layers.len()],
            layers,
            arena: b.arena,
            stats,
        })
    }

    /// On the first pass, ask the kernel to read layer `layer` and the next
    /// [`TRUNK_ADVISE_AHEAD`] layers (cyclically) from the maps: whole tensors in large
    /// requests, ahead of the compute, instead of a fault at a time, whose read-around window
    /// also pulls in the routed experts stored next to the layer. Tensors in the arena need
    /// nothing.
    fn advise(&mut self, layer: usize) {
        let n = self.layers.len();
        for l in (0..=TRUNK_ADVISE_AHEAD).map(|d| (layer + d) % n.max(1)) {
            let Some(done) = self.advised.get_mut(l) else {
                return;
            };
            if std::mem::replace(done, true) {
                continue;
            }
            for (_, src) in &self.layers[l] {
                if let Src::Mapped(b) = src {
                    crate::checkpoint::advise_willneed(b);
                }
            }
        }
    }
}

impl ResidentTrunk<'_> {
    fn view_of(&self, layer: usize) -> Result<LayerWeights<'_>, WeightError> {
        let arena = self.arena.as_ref();

        let tensors = self
            .layers
            .get(layer)
            .ok_or_else(|| WeightError::Invalid {
                name: format!("layer {layer}"),
                msg: format!("past the model's {} layers", self.layers.len()),
            })?
            .iter()
            .map(|&(decl, src)| TensorBytes {
                decl,
                bytes: resolve(arena, src),
            })
            .collect();
        Ok(LayerWeights { tensors })
    }
}

impl TrunkSource for ResidentTrunk<'_> {
    fn layer(&mut self, layer: usize) -> Result<LayerWeights<'_>, WeightError> {
        self.advise(layer);
        self.view_of(layer)
    }
    fn layer_and_peek(
        &mut self,
        layer: usize,
        peek: usize,
    ) -> Result<(LayerWeights<'_>, Option<LayerWeights<'_>>), WeightError> {
        self.advise(layer);
        Ok((self.view_of(layer)?, self.view_of(peek).ok()))
    }
    fn stats(&self) -> TrunkStats {
        self.stats.clone()
    }
}

// The six MXFP4 roles of a routed expert, in `ExpertWeights` field order (the same order the
// expert store reads them in).
use crate::stream::experts::{EXPERT_ROLES, expert_format, expert_slot};

/// One expert's bound tensors; `None` where the spec declares no such role (reported on use).
type ExpertSlots<'c> = [Option<Src<'c>>; 6];

/// Every routed expert, resident.
pub struct ResidentExperts<'c> {
    /// `index[layer]`: that layer's experts by id (empty for layers without routed experts).
    index: Vec<Vec<ExpertSlots<'c>>>,
    /// `advised[layer][expert]`: its mapped tensors were given `MADV_WILLNEED` (once per
    /// expert: the advice walks the page cache, too slow to repeat every token).
    advised: Vec<Vec<bool>>,
    /// First tensor that could not be bound, reported on the first request for it.
    unbound: Vec<((usize, usize), String)>,
    arena: Option<Arc<ResidentArena>>,
    stats: ExpertStats,
    /// MXFP4 (six tensors per expert) or BF16 (three; no scale slots).
    format: ExpertFormat,
    /// Every `(layer, expert)` request and a token mark per `begin_token`
    /// (`--dump-cache-trace`), the same records the expert cache keeps.
    trace: Option<Vec<(u32, u32)>>,
    /// `begin_token` calls so far (the token marks' numbers).
    token: usize,
}

impl<'c> ResidentExperts<'c> {
    /// Served from the checkpoint's memory maps.
    pub fn new(spec: &'c ModelSpec, ckpt: &'c Checkpoint) -> Self {
        Self::with_arena(spec, ckpt, None)
    }

    /// Served from `arena` for the tensors it holds (the rest from the memory maps).
    pub fn with_arena(
        spec: &'c ModelSpec,
        ckpt: &'c Checkpoint,
        arena: Option<Arc<ResidentArena>>,
    ) -> Self {
        let b = Binder { spec, ckpt, arena };
        let mut index: Vec<Vec<ExpertSlots<'c>>> = vec![Vec::new(); spec.n_layers];
        let mut unbound = Vec::new();
        for (i, t) in spec.tensors.iter().enumerate() {
            let (Some(l), Some(e)) = (t.layer, t.expert) else {
                continue;
            };
            let Some(r) = expert_slot(t.role) else {
                continue;
            };
            let Some(experts) = index.get_mut(l) else {
                continue; // a layer past n_layers is never requested
            };
            if experts.len() <= e {
                experts.resize(e + 1, [None; 6]);
            }
            match b.bind(i) {
                Ok(src) => experts[e][r] = Some(src),
                Err(err) => unbound.push(((l, e), err.to_string())),
            }
        }
        let advised = index.iter().map(|x| vec![false; x.len()]).collect();
        ResidentExperts {
            index,
            advised,
            unbound,
            arena: b.arena,
            stats: ExpertStats::default(),
            format: expert_format(spec),
            trace: None,
            token: 0,
        }
    }

    /// Start recording every (layer, expert) request (`--dump-cache-trace`): the same records
    /// as [`crate::stream::experts::ExpertCache::enable_trace`] for the same request (the
    /// routing does not depend on where the experts live).
    pub fn enable_trace(&mut self) {
        self.trace.get_or_insert_with(Vec::new);
    }

    /// Ask the kernel to read the mapped tensors of the experts in `ids` not advised before,
    /// all of them before the first fault: their reads are then in flight together instead
    /// of one page fault at a time. Experts in the arena need nothing.
    fn advise(&mut self, layer: usize, ids: &[u32]) {
        let (Some(slots), Some(done)) = (self.index.get(layer), self.advised.get_mut(layer)) else {
            return;
        };
        for &e in ids {
            let e = e as usize;
            let (Some(s), Some(d)) = (slots.get(e), done.get_mut(e)) else {
                continue; // reported by `one`
            };
            if std::mem::replace(d, true) {
                continue;
            }
            for src in s.iter().flatten() {
                if let Src::Mapped(b) = src {
                    crate::checkpoint::advise_willneed(b);
                }
            }
        }
    }

    fn one(&self, layer: usize, e: usize) -> Result<ExpertWeights<'_>, WeightError> {
        if let Some((_, msg)) = self.unbound.iter().find(|(k, _)| *k == (layer, e)) {
            return Err(WeightError::Expert {
                layer,
                expert: e,
                msg: msg.clone(),
            });
        }
        let slots = self
            .index
            .get(layer)
            .and_then(|x| x.get(e))
            .ok_or_else(|| WeightError::Expert {
                layer,
                expert: e,
                msg: "not declared by the model spec".into(),
            })?;
        let arena = self.arena.as_ref();
        let bf16 = self.format == ExpertFormat::Bf16;
        let get = |r: usize| -> Result<&[u8], WeightError> {
            if bf16 && r % 2 == 1 {
                return Ok(&[]); // BF16 experts have no scales
            }
            slots[r]
                .map(|src| resolve(arena, src))
                .ok_or_else(|| WeightError::Expert {
                    layer,
                    expert: e,
                    msg: format!("{:?} is not declared by the model spec", EXPERT_ROLES[r]),
                })
        };
        Ok(ExpertWeights {
            expert: e,
            format: self.format,
            w1_packed: get(0)?,
            w1_scale: get(1)?,
            w3_packed: get(2)?,
            w3_scale: get(3)?,
            w2_packed: get(4)?,
            w2_scale: get(5)?,
        })
    }
}

impl ExpertSource for ResidentExperts<'_> {
    fn begin_token(&mut self) {
        self.token += 1;
        if let Some(t) = &mut self.trace {
            t.push((crate::stream::trace::TOKEN_MARK, self.token as u32));
        }
    }

    fn trace(&self) -> Option<&[(u32, u32)]> {
        self.trace.as_deref()
    }

    fn experts(
        &mut self,
        layer: usize,
        ids: &[u32],
    ) -> Result<Vec<ExpertWeights<'_>>, WeightError> {
        if let Some(t) = &mut self.trace {
            t.extend(ids.iter().map(|&e| (layer as u32, e)));
        }
        self.stats.requests += ids.len() as u64;
        self.stats.hits += ids.len() as u64;
        self.stats.resident_hits += ids.len() as u64;
        self.advise(layer, ids);
        let mut out = Vec::with_capacity(ids.len());
        for &e in ids {
            out.push(self.one(layer, e as usize)?);
        }
        Ok(out)
    }
    fn stats(&self) -> ExpertStats {
        self.stats.clone()
    }
}

/// Embedding, lm_head and the final small tensors, resident.
pub struct ResidentGlobal<'c> {
    embed: (&'c TensorDecl, Src<'c>),
    lm_head: (&'c TensorDecl, Src<'c>),
    small: Vec<(&'c TensorDecl, Src<'c>)>,
    arena: Option<Arc<ResidentArena>>,
    d_model: usize,
    /// The lm_head's pages were given `MADV_WILLNEED` (on the first call only).
    lm_head_advised: bool,
}

impl<'c> ResidentGlobal<'c> {
    /// Served from `arena` for the tensors it holds, the rest (everything with `None`) from
    /// the checkpoint's memory maps.
    pub fn with_arena(
        spec: &'c ModelSpec,
        ckpt: &'c Checkpoint,
        arena: Option<Arc<ResidentArena>>,
    ) -> Result<Self, WeightError> {
        let b = Binder { spec, ckpt, arena };
        let find = |role: TensorRole| -> Result<(&'c TensorDecl, Src<'c>), WeightError> {
            let i = spec
                .tensors
                .iter()
                .position(|t| t.role == role && t.layer.is_none() && t.expert.is_none())
                .ok_or_else(|| WeightError::Invalid {
                    name: format!("{role:?}"),
                    msg: "not declared by the model spec".into(),
                })?;
            Ok((&spec.tensors[i], b.bind(i)?))
        };
        let mut small = vec![find(TensorRole::FinalNorm)?];
        if spec.attn_res.is_some() {
            small.push(find(TensorRole::OutputResProj)?);
            small.push(find(TensorRole::OutputResNorm)?);
        }
        let embed = find(TensorRole::Embed)?;
        let lm_head = find(TensorRole::LmHead)?;
        Ok(ResidentGlobal {
            embed,
            lm_head,
            small,
            arena: b.arena,
            d_model: spec.d_model,
            lm_head_advised: false,
        })
    }
}

impl GlobalSource for ResidentGlobal<'_> {
    fn embed_row(&mut self, token: u32, out: &mut [f32]) -> Result<(), WeightError> {
        let d = self.d_model;
        let row = 2 * d * token as usize;
        let (decl, src) = self.embed;
        let bytes = resolve(self.arena.as_ref(), src)
            .get(row..row + 2 * d)
            .ok_or_else(|| WeightError::Invalid {
                name: decl.name.clone(),
                msg: format!("token {token} is past the end of the embedding"),
            })?;
        if let Src::Mapped(_) = src {
            // Read the row alone: a fault on it would read the window around it (8 MiB here).
            crate::checkpoint::advise_willneed(bytes);
        }
        crate::weights::widen_bf16_le(bytes, out);
        Ok(())
    }

    fn lm_head_many(
        &mut self,
        pool: &Pool,
        xs: &[&[f32]],
        logits: &mut [&mut [f32]],
    ) -> Result<(), WeightError> {
        let bytes = resolve(self.arena.as_ref(), self.lm_head.1);
        if let (Src::Mapped(_), false) = (self.lm_head.1, self.lm_head_advised) {
            // The first pass reads the whole matrix (2.3 GB in real K3) in large requests
            // ahead of the matvec's faults.
            crate::checkpoint::advise_willneed(bytes);
            self.lm_head_advised = true;
        }
        let w: std::borrow::Cow<'_, [u16]> = match bytemuck::try_cast_slice::<u8, u16>(bytes) {
            Ok(s) if cfg!(target_endian = "little") => std::borrow::Cow::Borrowed(s),
            _ => std::borrow::Cow::Owned(
                bytes
                    .chunks_exact(2)
                    .map(|c| u16::from_le_bytes([c[0], c[1]]))
                    .collect(),
            ),
        };
        matvec::matvec_bf16_many(pool, &w, xs, logits);
        Ok(())
    }

    fn small(&self, role: TensorRole) -> Option<TensorBytes<'_>> {
        let arena = self.arena.as_ref();
        self.small
            .iter()
            .find(|(d, _)| d.role == role)
            .map(|&(decl, src)| TensorBytes {
                decl,
                bytes: resolve(arena, src),
            })
    }
}
