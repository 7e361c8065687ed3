//! Routed experts from disk: the expert store (positional reads) and the expert cache.
//!
//! Owns: [`ExpertStore`] — where each routed expert's six tensors (w1/w3/w2 packed + E8M0
//! scale) live in the shards, one positional read per contiguous run, a layer's misses issued
//! together in disk-offset order on a small read pool, and the E8M0 0xFF check on every read
//! (the error names the tensor); [`ExpertCache`] — the `ExpertSource` with a byte budget,
//! slot states (empty / in flight / ready), a pluggable [`EvictionPolicy`] ([`Lru`] default)
//! and the counters, including the TRUE resident hit rate (served from RAM that was resident
//! before the token asked; [`ExpertSource::begin_token`] marks the boundary). A budget of 0
//! caches nothing and serves each call from a scratch area. Speculative prefetch
//! ([`ExpertSource::prefetch`]): guessed experts are read on a background thread into claimed
//! slots (state in flight, buffer handed to the thread) while the executor computes; a later
//! request waits for them instead of reading twice. Prefetch-served requests count as raw hits,
//! never as resident hits, and are counted apart (prefetched / prefetch hits / wasted).
//! Must not: decode or zero anything: a failed read is returned as `WeightError::Expert` (the
//! run finishes and exits 4), never replaced by zeros.
//! Follows upstream: docs/DESIGN.md §4 and the seeds (expert LRU cache, true resident hit rate
//! reported apart from raw hits).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, mpsc};
use std::time::Instant;

use k3_models::spec::{ExpertFormat, ModelSpec, TensorRole};

use super::StreamError;
use super::aligned::{AlignedBuf, IO_ALIGN, align_up};
use super::direct::{DirectFile, ReadPool, ReadReq};
use crate::checkpoint::Checkpoint;
use crate::weights::{ExpertSource, ExpertStats, ExpertWeights, WeightError};

/// (layer, expert).
pub type ExpertKey = (usize, usize);

/// The six tensors of one expert, in this order.
pub const EXPERT_ROLES: [TensorRole; 6] = [
    TensorRole::ExpertW1Packed,
    TensorRole::ExpertW1Scale,
    TensorRole::ExpertW3Packed,
    TensorRole::ExpertW3Scale,
    TensorRole::ExpertW2Packed,
    TensorRole::ExpertW2Scale,
];

fn is_scale(i: usize) -> bool {
    i % 2 == 1
}

/// The slot (index into [`EXPERT_ROLES`] order) of an expert tensor role: MXFP4 roles map to
/// their own slot, a BF16 expert's `ExpertW1/W3/W2` to the packed slots 0/2/4 (its scale
/// slots stay empty).
pub fn expert_slot(role: TensorRole) -> Option<usize> {
    match role {
        TensorRole::ExpertW1 => Some(0),
        TensorRole::ExpertW3 => Some(2),
        TensorRole::ExpertW2 => Some(4),
        r => EXPERT_ROLES.iter().position(|&x| x == r),
    }
}

/// Whether slot `k` is absent by design: the scale slots of BF16 experts.
fn slot_absent(format: ExpertFormat, k: usize) -> bool {
    format == ExpertFormat::Bf16 && is_scale(k)
}

/// The routed experts' storage format of `spec` (MXFP4 when it has no MoE).
pub fn expert_format(spec: &ModelSpec) -> ExpertFormat {
    spec.moe
        .as_ref()
        .map_or(ExpertFormat::Mxfp4, |m| m.expert_format)
}

/// Chooses which resident expert to evict. Implementations must be deterministic.
pub trait EvictionPolicy: Send {
    fn name(&self) -> &str;
    /// A request was served from `slot`.
    fn on_access(&mut self, key: ExpertKey, slot: usize);
    /// `key` was loaded into `slot`.
    fn on_insert(&mut self, key: ExpertKey, slot: usize);
    /// `key` left `slot` (evicted or failed).
    fn on_remove(&mut self, _key: ExpertKey, _slot: usize) {}
    /// Pick the victim among `candidates` (resident, not needed by the current call; never
    /// empty); returns an index into `candidates`.
    fn choose_victim(&mut self, candidates: &[(ExpertKey, usize)]) -> usize;
    /// Why the policy stopped working as configured (e.g. a plugin fell back), if it did.
    fn failure(&self) -> Option<&str> {
        None
    }
    /// `key` was asked for (before its hit or miss).
    fn on_request(&mut self, _key: ExpertKey) {}
    /// A token (one forward pass) starts.
    fn on_token(&mut self) {}
    /// Whether the policy asked to keep `key` (never offered as a victim while others are).
    fn is_pinned(&self, _key: ExpertKey) -> bool {
        false
    }
}

/// Least recently used; ties (never touched) go to the lowest slot.
#[derive(Debug, Default)]
pub struct Lru {
    clock: u64,
    /// Last access time by slot (slots are dense `0..capacity`); 0 = never touched or removed.
    last_use: Vec<u64>,
}

impl EvictionPolicy for Lru {
    fn name(&self) -> &str {
        "lru"
    }
    fn on_access(&mut self, _key: ExpertKey, slot: usize) {
        self.clock += 1;
        if slot >= self.last_use.len() {
            self.last_use.resize(slot + 1, 0);
        }
        self.last_use[slot] = self.clock;
    }
    fn on_insert(&mut self, key: ExpertKey, slot: usize) {
        self.on_access(key, slot);
    }
    fn on_remove(&mut self, _key: ExpertKey, slot: usize) {
        if let Some(t) = self.last_use.get_mut(slot) {
            *t = 0;
        }
    }
    fn choose_victim(&mut self, candidates: &[(ExpertKey, usize)]) -> usize {
        candidates
            .iter()
            .enumerate()
            .min_by_key(|(_, (_, slot))| (self.last_use.get(*slot).copied().unwrap_or(0), *slot))
            .map_or(0, |(i, _)| i)
    }
}

/// Where one expert tensor lives: 12 bytes (the offset as a 48-bit number in two parts, the
/// length as a u32). [`TensorLoc::new`] refuses what does not fit; it never truncates.
#[derive(Clone, Copy, Debug, Default)]
struct TensorLoc {
    off_lo: u32,
    off_hi: u16,
    file: u16,
    len: u32,
}

/// Largest tensor offset a [`TensorLoc`] holds, plus one (256 TiB).
const LOC_OFFSET_LIMIT: u64 = 1 << 48;

impl TensorLoc {
    /// The location, or why it does not fit (the caller names the tensor).
    fn new(file: u16, offset: u64, len: u64) -> Result<Self, String> {
        let len = u32::try_from(len).map_err(|_| {
            format!(
                "{len} bytes long; the expert store holds tensors of at most {} bytes",
                u32::MAX
            )
        })?;
        if offset >= LOC_OFFSET_LIMIT {
            return Err(format!(
                "at byte offset {offset} of its shard; the expert store addresses offsets \
                 below 2^48"
            ));
        }
        Ok(Self {
            off_lo: offset as u32,
            off_hi: (offset >> 32) as u16,
            file,
            len,
        })
    }

    fn offset(&self) -> u64 {
        (u64::from(self.off_hi) << 32) | u64::from(self.off_lo)
    }

    fn len(&self) -> u64 {
        u64::from(self.len)
    }
}

/// `decl` of a slot no tensor fills.
const NO_DECL: u32 = u32::MAX;

#[derive(Clone, Copy, Debug)]
struct ExpertEntry {
    /// Indices into `spec.tensors`, in [`EXPERT_ROLES`] order; [`NO_DECL`] where the spec
    /// declares no tensor (all six for an expert the model does not have).
    decl: [u32; 6],
    loc: [TensorLoc; 6],
}

impl ExpertEntry {
    const ABSENT: ExpertEntry = ExpertEntry {
        decl: [NO_DECL; 6],
        loc: [TensorLoc {
            off_lo: 0,
            off_hi: 0,
            file: 0,
            len: 0,
        }; 6],
    };

    fn present(&self) -> bool {
        self.decl.iter().any(|&d| d != NO_DECL)
    }
}

/// Every routed expert's [`ExpertEntry`] in one dense table, layer-major: layer `l`'s experts
/// `0..w` are slots `base[l]..base[l + 1]`, `w` its largest declared expert id plus one (0 for
/// a layer without routed experts). Ids the spec skips are [`ExpertEntry::ABSENT`].
#[derive(Debug, Default)]
struct ExpertTable {
    /// `n_layers + 1` slot offsets.
    base: Vec<usize>,
    entries: Vec<ExpertEntry>,
    /// Present experts.
    count: usize,
}

impl ExpertTable {
    fn slot(&self, (layer, expert): ExpertKey) -> Option<usize> {
        let lo = *self.base.get(layer)?;
        let hi = *self.base.get(layer + 1)?;
        let i = lo.checked_add(expert)?;
        (i < hi).then_some(i)
    }

    fn get(&self, key: ExpertKey) -> Option<&ExpertEntry> {
        self.slot(key)
            .map(|i| &self.entries[i])
            .filter(|e| e.present())
    }

    /// The present experts in (layer, expert) order.
    fn iter(&self) -> impl Iterator<Item = (ExpertKey, &ExpertEntry)> {
        self.base.windows(2).enumerate().flat_map(move |(l, w)| {
            self.entries[w[0]..w[1]]
                .iter()
                .enumerate()
                .filter(|(_, e)| e.present())
                .map(move |(x, e)| ((l, x), e))
        })
    }
}

/// One positional read of an expert layout.
#[derive(Clone, Copy, Debug)]
struct RunRead {
    file: u16,
    offset: u64,
    len: usize,
    /// Where the rounded-out read lands in the expert buffer.
    buf_off: usize,
    buf_len: usize,
}

/// Where an expert's bytes go in its buffer.
#[derive(Clone, Debug)]
struct Layout {
    runs: Vec<RunRead>,
    /// (position, length) of each tensor in the buffer, [`EXPERT_ROLES`] order.
    tensors: [(usize, usize); 6],
}

/// Reads routed experts from the checkpoint shards.
pub struct ExpertStore<'c> {
    spec: &'c ModelSpec,
    /// Shared with the prefetch thread.
    files: Arc<Vec<DirectFile>>,
    entries: ExpertTable,
    /// Buffer bytes one expert needs (max over experts).
    expert_buf_bytes: usize,
    /// Exact payload bytes of one expert (max over experts).
    expert_bytes: u64,
    /// Shared with the prefetch thread (the blocking reader threads and the io_uring mutex
    /// allow callers on several threads).
    pool: Arc<ReadPool>,
    /// MXFP4 (six tensors per expert) or BF16 (three; the scale slots empty).
    format: ExpertFormat,
}

impl std::fmt::Debug for ExpertStore<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertStore")
            .field("experts", &self.entries.count)
            .field("files", &self.files.len())
            .field("expert_buf_bytes", &self.expert_buf_bytes)
            .finish_non_exhaustive()
    }
}

impl<'c> ExpertStore<'c> {
    /// Index every routed expert of `spec` in `ckpt` and open the shards that hold them.
    pub fn new(
        spec: &'c ModelSpec,
        ckpt: &Checkpoint,
        o_direct: bool,
        read_threads: usize,
    ) -> Result<Self, StreamError> {
        Self::with_pool(spec, ckpt, o_direct, ReadPool::new(read_threads)?)
    }

    /// Like [`ExpertStore::new`] with a given read pool (e.g. [`ReadPool::for_policy`]).
    pub fn with_pool(
        spec: &'c ModelSpec,
        ckpt: &Checkpoint,
        o_direct: bool,
        pool: ReadPool,
    ) -> Result<Self, StreamError> {
        let format = expert_format(spec);
        let (files, entries) = Self::index(spec, ckpt, format, o_direct)?;
        let mut store = Self {
            spec,
            files: Arc::new(files),
            entries,
            expert_buf_bytes: 0,
            expert_bytes: 0,
            pool: Arc::new(pool),
            format,
        };
        let mut buf = 0usize;
        let mut bytes = 0u64;
        for (_, e) in store.entries.iter() {
            buf = buf.max(
                store
                    .layout(e)
                    .runs
                    .iter()
                    .map(|r| r.buf_off + r.buf_len)
                    .max()
                    .unwrap_or(0),
            );
            bytes = bytes.max(e.loc.iter().map(|l| l.len()).sum());
        }
        store.expert_buf_bytes = align_up(buf.max(1) as u64, IO_ALIGN as u64) as usize;
        store.expert_bytes = bytes;
        Ok(store)
    }

    /// The table of every routed expert's tensors, filled straight from `spec.tensors`, and
    /// the shards that hold them, opened in first-use order walking experts in (layer, expert)
    /// order (deterministic file numbering).
    fn index(
        spec: &ModelSpec,
        ckpt: &Checkpoint,
        format: ExpertFormat,
        o_direct: bool,
    ) -> Result<(Vec<DirectFile>, ExpertTable), StreamError> {
        let expert_tensors = || {
            spec.tensors.iter().enumerate().filter_map(|(i, d)| {
                let (Some(layer), Some(expert)) = (d.layer, d.expert) else {
                    return None;
                };
                expert_slot(d.role).map(|slot| (i, layer, expert, slot))
            })
        };
        let n_experts = spec.moe.as_ref().map_or(0, |m| m.n_experts);
        // Layers up to the last one with routed experts (lookups past it find nothing).
        let mut n_tensors = 0usize;
        let mut n_layers = 0usize;
        for (_, layer, _, _) in expert_tensors() {
            n_tensors += 1;
            n_layers = n_layers.max(layer.saturating_add(1));
        }
        // At most the spec's grid, or one slot per declared expert tensor if ids lie outside
        // it: the table never outgrows the spec itself, however sparse a hand-made spec's ids.
        let limit = spec.n_layers.saturating_mul(n_experts).max(n_tensors);
        let out_of_range = || {
            let (i, layer, expert, _) = expert_tensors()
                .find(|&(_, l, e, _)| l >= spec.n_layers || e >= n_experts)
                .expect("invariant: a table over the limit has an id outside the spec's grid");
            StreamError::Invalid(format!(
                "routed expert {expert} of layer {layer} (tensor {}) is outside the model's \
                 {} layers of {n_experts} routed experts",
                spec.tensors[i].name, spec.n_layers
            ))
        };
        if n_layers > spec.n_layers.max(n_tensors) {
            return Err(out_of_range());
        }
        let mut width = vec![0usize; n_layers];
        for (_, layer, expert, _) in expert_tensors() {
            width[layer] = width[layer].max(expert.saturating_add(1));
        }
        let mut base = Vec::with_capacity(n_layers + 1);
        let mut total = 0usize;
        base.push(0);
        for w in width {
            total = total.saturating_add(w);
            if total > limit {
                return Err(out_of_range());
            }
            base.push(total);
        }
        let mut table = ExpertTable {
            base,
            entries: vec![ExpertEntry::ABSENT; total],
            count: 0,
        };
        for (i, layer, expert, slot) in expert_tensors() {
            let idx = u32::try_from(i)
                .ok()
                .filter(|&x| x != NO_DECL)
                .ok_or_else(|| StreamError::Invalid("more than 2^32 tensors".to_string()))?;
            table.entries[table.base[layer] + expert].decl[slot] = idx;
        }
        let mut files: Vec<DirectFile> = Vec::new();
        // shard index -> file number, files opened in first-use order
        let mut file_idx: Vec<Option<u16>> = vec![None; ckpt.shards().len()];
        for layer in 0..n_layers {
            let first = table.base[layer];
            for x in first..table.base[layer + 1] {
                let e = &mut table.entries[x];
                if !e.present() {
                    continue;
                }
                table.count += 1;
                for (k, role) in EXPERT_ROLES.iter().enumerate() {
                    if slot_absent(format, k) {
                        continue; // loc stays empty; decl unused
                    }
                    let di = e.decl[k];
                    if di == NO_DECL {
                        return Err(StreamError::Invalid(format!(
                            "routed expert {} of layer {layer} declares no {role:?} tensor",
                            x - first
                        )));
                    }
                    let d = &spec.tensors[di as usize];
                    let (shard, offset, len) = ckpt.shard_span(&d.name).ok_or_else(|| {
                        StreamError::Invalid(format!(
                            "tensor {} is not in the checkpoint {}",
                            d.name,
                            ckpt.dir().display()
                        ))
                    })?;
                    let f = match file_idx[shard] {
                        Some(f) => f,
                        None => {
                            let f = u16::try_from(files.len()).map_err(|_| {
                                StreamError::Invalid("more than 65536 shard files".to_string())
                            })?;
                            files.push(DirectFile::open(&ckpt.shards()[shard].path, o_direct)?);
                            file_idx[shard] = Some(f);
                            f
                        }
                    };
                    e.loc[k] = TensorLoc::new(f, offset, len).map_err(|why| {
                        StreamError::Invalid(format!(
                            "tensor {} in {}: {why}",
                            d.name,
                            ckpt.shards()[shard].path.display()
                        ))
                    })?;
                }
            }
        }
        Ok((files, table))
    }

    /// Number of routed experts indexed.
    pub fn n_experts(&self) -> usize {
        self.entries.count
    }

    /// Exact payload bytes of one expert (the largest).
    pub fn expert_bytes(&self) -> u64 {
        self.expert_bytes
    }

    /// Buffer bytes one cached expert occupies (rounded-out reads, 4096-aligned).
    pub fn expert_buf_bytes(&self) -> usize {
        self.expert_buf_bytes
    }

    /// Whether every shard is read with O_DIRECT; otherwise the first fallback reason.
    pub fn io_line(&self) -> String {
        match self.files.iter().find_map(|f| f.fallback_reason()) {
            None if !self.files.is_empty() => {
                "expert reads use O_DIRECT (page cache bypassed)".to_string()
            }
            None => "no routed experts".to_string(),
            Some(r) => format!("expert reads are buffered: {r}"),
        }
    }

    /// Read queue depth.
    pub fn read_threads(&self) -> usize {
        self.pool.depth()
    }

    /// The read backend (pread threads or io_uring) for reports.
    pub fn backend_line(&self) -> String {
        self.pool.backend_line()
    }

    fn layout(&self, e: &ExpertEntry) -> Layout {
        // Tensors in disk order; adjacent tensors of one file form one run.
        let mut order: Vec<usize> = (0..6).filter(|&k| !slot_absent(self.format, k)).collect();
        order.sort_by_key(|&k| (e.loc[k].file, e.loc[k].offset()));
        let mut runs: Vec<(u16, u64, u64, Vec<usize>)> = Vec::new();
        for k in order {
            let l = e.loc[k];
            match runs.last_mut() {
                Some(r) if r.0 == l.file && r.1 + r.2 == l.offset() => {
                    r.2 += l.len();
                    r.3.push(k);
                }
                _ => runs.push((l.file, l.offset(), l.len(), vec![k])),
            }
        }
        let mut out = Vec::with_capacity(runs.len());
        let mut tensors = [(0usize, 0usize); 6];
        let mut pos = 0usize;
        for (file, offset, len, members) in runs {
            let span = self.files[file as usize].span(offset, len as usize);
            for k in members {
                let l = e.loc[k];
                tensors[k] = (
                    pos + span.lead + (l.offset() - offset) as usize,
                    l.len() as usize,
                );
            }
            out.push(RunRead {
                file,
                offset,
                len: len as usize,
                buf_off: pos,
                buf_len: span.len,
            });
            pos = align_up((pos + span.len) as u64, IO_ALIGN as u64) as usize;
        }
        Layout { runs: out, tensors }
    }

    /// Read the given experts into their buffers: all runs issued together, sorted by
    /// (file, offset), in parallel. Returns per expert `Ok(layout)` or the error message, and
    /// the bytes read.
    fn read_batch(
        &self,
        keys: &[ExpertKey],
        bufs: Vec<&mut AlignedBuf>,
    ) -> (Vec<Result<Layout, String>>, u64) {
        let mut layouts: Vec<Result<Layout, String>> = keys
            .iter()
            .map(|&key| match self.entries.get(key) {
                Some(e) => Ok(self.layout(e)),
                None => Err(format!(
                    "routed expert {} of layer {} is not declared by the model",
                    key.1, key.0
                )),
            })
            .collect();
        let mut idx = Vec::with_capacity(keys.len());
        let mut jobs = Vec::with_capacity(keys.len());
        for (i, (lay, buf)) in layouts.iter().zip(bufs).enumerate() {
            if let Ok(lay) = lay {
                idx.push(i);
                jobs.push((lay.runs.as_slice(), buf.full_mut()));
            }
        }
        let (results, bytes) = read_runs(&self.files, &self.pool, jobs, true);
        for (i, r) in idx.into_iter().zip(results) {
            if let Err(e) = r {
                layouts[i] = Err(e);
            }
        }
        (layouts, bytes)
    }

    /// The E8M0 check of one loaded expert: no scale byte may be 0xFF (NaN).
    fn check_scales(&self, key: ExpertKey, lay: &Layout, buf: &[u8]) -> Result<(), String> {
        let e = self
            .entries
            .get(key)
            .expect("invariant: only declared experts are checked");
        for (k, &(pos, len)) in lay.tensors.iter().enumerate() {
            if !is_scale(k) || slot_absent(self.format, k) {
                continue;
            }
            if let Some(i) = crate::checkpoint::e8m0_nan_at(&buf[pos..pos + len]) {
                let d = &self.spec.tensors[e.decl[k] as usize];
                return Err(format!(
                    "tensor {} in {}: E8M0 scale byte 0xFF (NaN) at index {i}",
                    d.name,
                    self.files[e.loc[k].file as usize].path().display()
                ));
            }
        }
        Ok(())
    }
}

/// The view of expert `id` in `buf`, whose six tensors are at `t` (offset, length; the scale
/// slots of a BF16 expert are empty).
fn expert_view<'b>(
    id: u32,
    format: ExpertFormat,
    buf: &'b [u8],
    t: &[(usize, usize); 6],
) -> ExpertWeights<'b> {
    let part = |k: usize| &buf[t[k].0..t[k].0 + t[k].1];
    ExpertWeights {
        expert: id as usize,
        format,
        w1_packed: part(0),
        w1_scale: part(1),
        w3_packed: part(2),
        w3_scale: part(3),
        w2_packed: part(4),
        w2_scale: part(5),
    }
}

/// One expert a prefetch reads: its slot, key, layout and the slot's buffer (owned by its
/// read task until the read is done).
struct PrefetchItem {
    slot: usize,
    key: ExpertKey,
    layout: Layout,
    buf: AlignedBuf,
}

/// One prefetched expert back from its reader thread: the item (buffer filled), its read
/// result, the bytes requested and when the read started and ended.
struct PrefetchDone {
    item: PrefetchItem,
    result: Result<(), String>,
    bytes: u64,
    started: Instant,
    finished: Instant,
}

/// Prefetch reads: every guessed expert is one owned task on the store's reader threads that
/// reads the expert's runs into its slot buffer and sends it back, so an expert is usable as
/// soon as ITS read has landed, not when the whole guess of its layer has
/// ([`ExpertSource::experts_split`] computes those first).
struct Prefetcher {
    files: Arc<Vec<DirectFile>>,
    pool: Arc<ReadPool>,
    tx: mpsc::Sender<PrefetchDone>,
    done: mpsc::Receiver<PrefetchDone>,
    /// The layer of every item sent and not yet received back.
    in_flight: Vec<usize>,
    /// End of the latest read received, to add up the time with a prefetch read in flight.
    busy_until: Option<Instant>,
}

impl Prefetcher {
    fn new(files: Arc<Vec<DirectFile>>, pool: Arc<ReadPool>) -> Self {
        let (tx, done) = mpsc::channel();
        Self {
            files,
            pool,
            tx,
            done,
            in_flight: Vec::new(),
            busy_until: None,
        }
    }

    /// Queue one read task per item, in disk order, behind the reads already queued.
    fn send(&mut self, mut items: Vec<PrefetchItem>) {
        items.sort_by_key(|it| it.layout.runs.first().map(|r| (r.file, r.offset)));
        let mut tasks: Vec<super::blocking::Task> = Vec::with_capacity(items.len());
        for mut item in items {
            self.in_flight.push(item.key.0);
            let (files, tx) = (Arc::clone(&self.files), self.tx.clone());
            tasks.push(Box::new(move || {
                let started = Instant::now();
                let (result, bytes) =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        read_item(&files, &mut item)
                    }))
                    .unwrap_or_else(|_| (Err("the read task panicked".to_string()), 0));
                // The cache may be gone (end of run): nothing waits for this item then.
                let _ = tx.send(PrefetchDone {
                    item,
                    result,
                    bytes,
                    started,
                    finished: Instant::now(),
                });
            }));
        }
        self.pool.spawn(tasks);
    }
}

/// Read one item's runs into its buffer (each run at its `buf_off`), one after another on
/// the calling thread. Returns `Ok(())` or the first error message, and the bytes requested.
fn read_item(files: &[DirectFile], item: &mut PrefetchItem) -> (Result<(), String>, u64) {
    let buf = item.buf.full_mut();
    let mut bytes = 0u64;
    for r in &item.layout.runs {
        let Some(dst) = buf.get_mut(r.buf_off..r.buf_off + r.buf_len) else {
            return (
                Err("expert buffer too small (internal error)".to_string()),
                bytes,
            );
        };
        bytes += r.buf_len as u64;
        if let Err(e) = files[r.file as usize].read_into(r.offset, r.len, dst) {
            return (Err(e.to_string()), bytes);
        }
    }
    (Ok(()), bytes)
}

/// Read every job's runs into its buffer (each run at its `buf_off`): all runs issued
/// together, sorted by (file, offset), on `pool`. Returns per job `Ok(())` or the first error
/// message, and the bytes requested. `urgent`: ahead of other queued reads (demand misses).
fn read_runs(
    files: &[DirectFile],
    pool: &ReadPool,
    jobs: Vec<(&[RunRead], &mut [u8])>,
    urgent: bool,
) -> (Vec<Result<(), String>>, u64) {
    let mut results: Vec<Result<(), String>> = vec![Ok(()); jobs.len()];
    let mut bytes = 0u64;
    let mut tagged: Vec<(usize, u16, u64, ReadReq<'_>)> = Vec::new();
    for (i, (runs, buf)) in jobs.into_iter().enumerate() {
        let mut rest: &mut [u8] = buf;
        let mut at = 0usize;
        for r in runs {
            let tail = std::mem::take(&mut rest);
            if r.buf_off < at || r.buf_off - at + r.buf_len > tail.len() {
                results[i] = Err("expert buffer too small (internal error)".to_string());
                break;
            }
            let (_, tail) = tail.split_at_mut(r.buf_off - at);
            let (mine, tail) = tail.split_at_mut(r.buf_len);
            rest = tail;
            at = r.buf_off + r.buf_len;
            bytes += r.buf_len as u64;
            tagged.push((
                i,
                r.file,
                r.offset,
                ReadReq {
                    file: &files[r.file as usize],
                    offset: r.offset,
                    len: r.len,
                    buf: mine,
                },
            ));
        }
    }
    tagged.sort_by_key(|t| (t.1, t.2));
    let (tags, mut reqs): (Vec<usize>, Vec<ReadReq<'_>>) =
        tagged.into_iter().map(|(i, _, _, r)| (i, r)).unzip();
    let done = if urgent {
        pool.read_all_first(&mut reqs)
    } else {
        pool.read_all(&mut reqs)
    };
    for (i, r) in tags.into_iter().zip(done) {
        if let Err(e) = r
            && results[i].is_ok()
        {
            results[i] = Err(e.to_string());
        }
    }
    (results, bytes)
}

/// Slot states of the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotState {
    Empty,
    InFlight,
    Ready,
}

#[derive(Debug)]
struct Slot {
    state: SlotState,
    key: Option<ExpertKey>,
    buf: Option<AlignedBuf>,
    tensors: [(usize, usize); 6],
    loaded_token: u64,
    /// Loaded (or being loaded) by a prefetch and not requested since.
    from_prefetch: bool,
}

/// Where one requested expert is served from during a call.
#[derive(Clone, Copy, Debug)]
enum Place {
    Slot(usize),
    Scratch(usize),
}

/// Options of [`ExpertCache::new`].
#[derive(Clone, Debug)]
pub struct ExpertCacheOptions {
    /// `--cache-gb` in bytes (0 = no caching).
    pub budget_bytes: u64,
    pub o_direct: bool,
    /// Queue depth of expert reads.
    pub read_threads: usize,
}

impl Default for ExpertCacheOptions {
    fn default() -> Self {
        Self {
            budget_bytes: 0,
            o_direct: true,
            read_threads: 8,
        }
    }
}

/// The streamed `ExpertSource`: a byte-budgeted cache in front of an [`ExpertStore`].
pub struct ExpertCache<'c> {
    store: ExpertStore<'c>,
    capacity: usize,
    slots: Vec<Slot>,
    map: HashMap<ExpertKey, usize>,
    policy: Box<dyn EvictionPolicy + 'c>,
    scratch: Vec<(AlignedBuf, [(usize, usize); 6])>,
    token: u64,
    stats: ExpertStats,
    trace: Option<Vec<(u32, u32)>>,
    /// Extra ids the executor should guess per MoE layer (`None`: no guesses wanted).
    prefetch_margin: Option<usize>,
    prefetcher: Option<Prefetcher>,
    /// Why prefetching stopped (the thread could not start or died); prefetch is then a no-op.
    prefetch_off: Option<String>,
    /// The pending guesses (layer, ids), to measure how much of the real routing they covered.
    guesses: Vec<(usize, Vec<u32>)>,
    /// A look-ahead guess to start after the next `experts` call's own reads.
    deferred: Option<(usize, Vec<u32>)>,
    /// Slots the last `experts` call served from (a prefetch never evicts them).
    last_slots: Vec<usize>,
    /// The layer of the last `experts` call.
    last_layer: Option<usize>,
    /// Expert buffers carved (huge-page regions) but not yet handed to a slot or scratch.
    spare: Vec<AlignedBuf>,
    /// Buffers carved so far (slots + scratch + spare).
    carved: usize,
}

impl std::fmt::Debug for ExpertCache<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertCache")
            .field("capacity", &self.capacity)
            .field("policy", &self.policy.name())
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl<'c> ExpertCache<'c> {
    pub fn new(
        spec: &'c ModelSpec,
        ckpt: &Checkpoint,
        opts: &ExpertCacheOptions,
    ) -> Result<Self, StreamError> {
        let store = ExpertStore::new(spec, ckpt, opts.o_direct, opts.read_threads)?;
        Ok(Self::with_store(store, opts.budget_bytes))
    }

    /// Like [`ExpertCache::new`] with a given read pool (`opts.read_threads` is ignored), e.g.
    /// `ReadPool::for_policy(&policy)` for io_uring.
    pub fn new_with_pool(
        spec: &'c ModelSpec,
        ckpt: &Checkpoint,
        opts: &ExpertCacheOptions,
        pool: ReadPool,
    ) -> Result<Self, StreamError> {
        let store = ExpertStore::with_pool(spec, ckpt, opts.o_direct, pool)?;
        Ok(Self::with_store(store, opts.budget_bytes))
    }

    /// A cache over an existing store with an LRU policy.
    pub fn with_store(store: ExpertStore<'c>, budget_bytes: u64) -> Self {
        let per = store.expert_buf_bytes().max(1) as u64;
        let capacity = usize::try_from(budget_bytes / per).unwrap_or(usize::MAX);
        let capacity = capacity.min(store.n_experts());
        Self {
            store,
            capacity,
            slots: Vec::new(),
            map: HashMap::new(),
            policy: Box::new(Lru::default()),
            scratch: Vec::new(),
            token: 0,
            stats: ExpertStats {
                budget_bytes,
                ..ExpertStats::default()
            },
            trace: None,
            prefetch_margin: None,
            prefetcher: None,
            prefetch_off: None,
            guesses: Vec::new(),
            deferred: None,
            last_slots: Vec::new(),
            last_layer: None,
            spare: Vec::new(),
            carved: 0,
        }
    }

    /// One expert buffer: from the spare list, else from a newly carved huge-page region.
    /// Buffers are carved in batches (the cache's slots plus one layer's scratch, at most
    /// 64 MiB per region) because a read into 4 KiB pages runs at under half the speed of
    /// one into 2 MiB pages on a virtio disk (docs/history/PERFORMANCE-LOG.md §4.3).
    fn take_buf(&mut self, at_least: usize) -> std::io::Result<AlignedBuf> {
        if let Some(b) = self.spare.pop() {
            return Ok(b);
        }
        let need = self.store.expert_buf_bytes();
        let stride = align_up(need.max(1) as u64, IO_ALIGN as u64) as usize;
        let per_region = ((64usize << 20) / stride).max(1);
        // Slots not yet backed, plus room for one call's scratch.
        let wanted = (self.capacity + at_least).saturating_sub(self.carved);
        let count = wanted.clamp(at_least.max(1), per_region.max(at_least.max(1)));
        let mut bufs = AlignedBuf::carve(count, need)?;
        self.carved += bufs.len();
        let b = bufs.pop().expect("carve(count >= 1) returns count buffers");
        self.spare = bufs;
        Ok(b)
    }

    /// Ask the executor for guesses of top-(k + `margin`) experts before each MoE layer
    /// (`None`: no guesses). [`ExpertSource::prefetch`] works either way; this only sets
    /// [`ExpertSource::prefetch_margin`].
    pub fn set_prefetch_margin(&mut self, margin: Option<usize>) {
        self.prefetch_margin = margin;
    }

    /// Why prefetching was switched off during the run, if it was.
    pub fn prefetch_failure(&self) -> Option<&str> {
        self.prefetch_off.as_deref()
    }

    /// Take a finished prefetch read back: buffer into its slot, E8M0 check, Ready.
    /// A failed read or check only frees the slot (a later request reads again and reports).
    fn finish_prefetch(&mut self, done: PrefetchDone) {
        self.stats.prefetch_bytes += done.bytes;
        self.stats.bytes_read += done.bytes;
        // Time with at least one prefetch read in flight (reads overlap: each stretch once).
        if let Some(p) = self.prefetcher.as_mut() {
            let from = p.busy_until.map_or(done.started, |b| b.max(done.started));
            if done.finished > from {
                self.stats.prefetch_read_seconds += (done.finished - from).as_secs_f64();
            }
            p.busy_until = Some(p.busy_until.map_or(done.finished, |b| b.max(done.finished)));
        }
        let PrefetchDone {
            item: it, result, ..
        } = done;
        let ok = result.and_then(|()| self.store.check_scales(it.key, &it.layout, it.buf.full()));
        let slot = &mut self.slots[it.slot];
        slot.buf = Some(it.buf);
        if slot.state != SlotState::InFlight || slot.key != Some(it.key) {
            return;
        }
        match ok {
            Ok(()) => {
                slot.state = SlotState::Ready;
                slot.tensors = it.layout.tensors;
                self.policy.on_insert(it.key, it.slot);
            }
            Err(_) => {
                slot.state = SlotState::Empty;
                slot.key = None;
                slot.from_prefetch = false;
                self.stats.prefetch_failures += 1;
                if self.map.get(&it.key) == Some(&it.slot) {
                    self.map.remove(&it.key);
                }
            }
        }
    }

    /// Collect finished prefetch reads; with `until = Some(layer)`, wait until no read for
    /// `layer` or an earlier layer is in flight (look-ahead reads for later layers go on).
    fn poll_prefetches(&mut self, until: Option<usize>) {
        loop {
            let Some(p) = self.prefetcher.as_mut() else {
                return;
            };
            if p.in_flight.is_empty() {
                return;
            }
            let block = until.is_some_and(|l| p.in_flight.iter().any(|&b| b <= l));
            let got = if block {
                let t0 = Instant::now();
                let r = p.done.recv().map_err(|_| ());
                let waited = t0.elapsed().as_secs_f64();
                self.stats.prefetch_wait_seconds += waited;
                self.stats.read_seconds += waited;
                r
            } else {
                match p.done.try_recv() {
                    Ok(d) => Ok(d),
                    Err(mpsc::TryRecvError::Empty) => return,
                    Err(mpsc::TryRecvError::Disconnected) => Err(()),
                }
            };
            match got {
                Ok(d) => {
                    if let Some(p) = self.prefetcher.as_mut()
                        && let Some(i) = p.in_flight.iter().position(|&l| l == d.item.key.0)
                    {
                        p.in_flight.swap_remove(i);
                    }
                    self.finish_prefetch(d);
                }
                Err(()) => {
                    self.abandon_prefetches("the expert prefetch thread stopped".to_string());
                    return;
                }
            }
        }
    }

    /// Switch prefetching off and free every slot a prefetch still holds.
    fn abandon_prefetches(&mut self, why: String) {
        self.prefetcher = None;
        self.prefetch_off.get_or_insert(why);
        for (i, slot) in self.slots.iter_mut().enumerate() {
            if slot.state == SlotState::InFlight && slot.from_prefetch {
                if let Some(k) = slot.key
                    && self.map.get(&k) == Some(&i)
                {
                    self.map.remove(&k);
                }
                slot.state = SlotState::Empty;
                slot.key = None;
                slot.from_prefetch = false;
            }
        }
    }

    /// Replace the eviction policy (before the first request).
    pub fn set_policy(&mut self, policy: Box<dyn EvictionPolicy + 'c>) {
        self.policy = policy;
    }

    /// Experts the budget holds.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn store(&self) -> &ExpertStore<'c> {
        &self.store
    }

    pub fn policy_name(&self) -> &str {
        self.policy.name()
    }

    /// The state of every allocated slot (for tests and reports).
    pub fn slot_states(&self) -> Vec<(SlotState, Option<ExpertKey>)> {
        self.slots.iter().map(|s| (s.state, s.key)).collect()
    }

    /// Start recording every (layer, expert) request (`--dump-cache-trace`).
    pub fn enable_trace(&mut self) {
        self.trace.get_or_insert_with(Vec::new);
    }

    /// The recorded requests, in order (token starts marked, see `stream::trace`).
    pub fn trace(&self) -> Option<&[(u32, u32)]> {
        self.trace.as_deref()
    }

    /// Write `dir/expert_trace.bin` + `dir/expert_hist.json` (needs [`Self::enable_trace`]).
    pub fn write_trace(&self, dir: &std::path::Path) -> Result<(), StreamError> {
        let t = self.trace.as_deref().ok_or_else(|| {
            StreamError::Invalid("expert trace was not enabled for this run".to_string())
        })?;
        super::trace::write_trace(dir, t)
    }

    /// One line for the start-up report.
    pub fn startup_line(&self) -> String {
        format!(
            "expert cache: {} budget = {} experts of {} ({} policy); {}; {}",
            super::fmt_bytes(self.stats.budget_bytes),
            self.capacity,
            super::fmt_bytes(self.store.expert_buf_bytes() as u64),
            self.policy.name(),
            self.store.io_line(),
            self.store.backend_line()
        )
    }

    /// The end-of-run summary lines (seed format).
    pub fn report_lines(&self) -> Vec<String> {
        let s = &self.stats;
        let pct = |a: u64| {
            if s.requests == 0 {
                0.0
            } else {
                100.0 * a as f64 / s.requests as f64
            }
        };
        vec![
            format!(
                "requests : {} hits {} ({:.2}%) misses {} evictions {}",
                s.requests,
                s.hits,
                pct(s.hits),
                s.misses,
                s.evictions
            ),
            format!(
                "TRUE resident hit rate {:.2}%",
                100.0 * s.resident_hit_rate()
            ),
            format!(
                "prefetch: {} experts read ahead ({} in {:.2} s, waited {:.2} s), {} requests served by them, {} wasted; guesses covered {:.2}% of routed ids{}",
                s.prefetched,
                super::fmt_bytes(s.prefetch_bytes),
                s.prefetch_read_seconds,
                s.prefetch_wait_seconds,
                s.prefetch_hits,
                s.prefetch_wasted,
                100.0 * s.guess_accuracy(),
                self.prefetch_off
                    .as_deref()
                    .map_or_else(String::new, |f| format!(" (STOPPED: {f})"))
            ),
            format!(
                "eviction policy {}{}",
                self.policy.name(),
                self.policy
                    .failure()
                    .map_or_else(String::new, |f| format!(" (FELL BACK: {f})"))
            ),
            format!(
                "read {} in {:.2} s{}",
                super::fmt_bytes(s.bytes_read),
                s.read_seconds,
                if s.load_failures > 0 {
                    format!("; {} experts FAILED to load", s.load_failures)
                } else {
                    String::new()
                }
            ),
        ]
    }

    /// Find a slot for a miss: an empty one, a new one within capacity, or a victim that the
    /// current call does not use.
    fn claim_slot(&mut self, protected: &HashSet<usize>) -> Option<usize> {
        if let Some(i) = self.slots.iter().position(|s| s.state == SlotState::Empty) {
            return Some(i);
        }
        if self.slots.len() < self.capacity {
            self.slots.push(Slot {
                state: SlotState::Empty,
                key: None,
                buf: None,
                tensors: [(0, 0); 6],
                loaded_token: 0,
                from_prefetch: false,
            });
            return Some(self.slots.len() - 1);
        }
        let mut candidates: Vec<(ExpertKey, usize)> = self
            .slots
            .iter()
            .enumerate()
            .filter(|(i, s)| s.state == SlotState::Ready && !protected.contains(i))
            .filter_map(|(i, s)| s.key.map(|k| (k, i)))
            .collect();
        // Experts the policy pinned are not offered, unless nothing else could go.
        if candidates.iter().any(|&(k, _)| !self.policy.is_pinned(k)) {
            candidates.retain(|&(k, _)| !self.policy.is_pinned(k));
        }
        if candidates.is_empty() {
            return None;
        }
        let pick = self
            .policy
            .choose_victim(&candidates)
            .min(candidates.len() - 1);
        let (old, i) = candidates[pick];
        self.map.remove(&old);
        self.policy.on_remove(old, i);
        self.stats.evictions += 1;
        let s = &mut self.slots[i];
        if s.from_prefetch {
            self.stats.prefetch_wasted += 1;
        }
        s.state = SlotState::Empty;
        s.key = None;
        s.from_prefetch = false;
        Some(i)
    }
}

impl ExpertSource for ExpertCache<'_> {
    fn trace(&self) -> Option<&[(u32, u32)]> {
        self.trace.as_deref()
    }

    fn begin_token(&mut self) {
        self.token += 1;
        self.policy.on_token();
        if let Some(t) = &mut self.trace {
            t.push((super::trace::TOKEN_MARK, self.token as u32));
        }
    }

    fn experts(
        &mut self,
        layer: usize,
        ids: &[u32],
    ) -> Result<Vec<ExpertWeights<'_>>, WeightError> {
        if ids.windows(2).any(|w| w[0] >= w[1]) {
            return Err(WeightError::Invalid {
                name: format!("routed experts of layer {layer}"),
                msg: format!("ids must be ascending and unique, got {ids:?}"),
            });
        }
        if let Some(t) = &mut self.trace {
            t.extend(ids.iter().map(|&e| (layer as u32, e)));
        }
        // Every prefetch lands (or fails) before this call looks at the slots: no slot is in
        // flight below except this call's own misses, so nothing is read twice.
        let deferred = self.deferred.take();
        self.poll_prefetches(Some(layer));
        if let Some(g) = self.guesses.iter().find(|(gl, _)| *gl == layer) {
            self.stats.guessed_requests += ids.len() as u64;
            self.stats.guess_covered += ids.iter().filter(|id| g.1.contains(id)).count() as u64;
        }
        self.guesses.retain(|(gl, _)| *gl > layer);
        self.stats.requests += ids.len() as u64;
        for &id in ids {
            self.policy.on_request((layer, id as usize));
        }
        let mut places: Vec<Option<Place>> = vec![None; ids.len()];
        let mut protected: HashSet<usize> = HashSet::new();
        // Hits first, so no victim is chosen among the experts this call needs.
        for (i, &id) in ids.iter().enumerate() {
            let key = (layer, id as usize);
            if let Some(&s) = self.map.get(&key)
                && self.slots[s].state == SlotState::Ready
            {
                places[i] = Some(Place::Slot(s));
                protected.insert(s);
                self.stats.hits += 1;
                let slot = &mut self.slots[s];
                if slot.from_prefetch {
                    // Fetched by a guess, not resident before the token needed it.
                    slot.from_prefetch = false;
                    self.stats.prefetch_hits += 1;
                } else if slot.loaded_token < self.token {
                    self.stats.resident_hits += 1;
                }
                self.policy.on_access(key, s);
            }
        }
        // Guesses for this layer that the routing did not pick: dropped at once, so a wrong
        // guess never pushes a useful expert out later (with cyclic layer order, a cache just
        // above the working set would otherwise fall off the LRU cliff).
        for (i, slot) in self.slots.iter_mut().enumerate() {
            if let Some(k) = slot.key
                && slot.from_prefetch
                && k.0 == layer
            {
                slot.from_prefetch = false;
                slot.state = SlotState::Empty;
                slot.key = None;
                if self.map.get(&k) == Some(&i) {
                    self.map.remove(&k);
                }
                self.policy.on_remove(k, i);
                self.stats.prefetch_wasted += 1;
            }
        }
        // Misses: claim slots (or scratch), in ascending id order.
        let mut miss_idx = Vec::new();
        let mut n_scratch = 0usize;
        for i in 0..ids.len() {
            if places[i].is_some() {
                continue;
            }
            miss_idx.push(i);
            let key = (layer, ids[i] as usize);
            match self.claim_slot(&protected) {
                Some(s) => {
                    protected.insert(s);
                    let slot = &mut self.slots[s];
                    slot.state = SlotState::InFlight;
                    slot.key = Some(key);
                    places[i] = Some(Place::Slot(s));
                }
                None => {
                    places[i] = Some(Place::Scratch(n_scratch));
                    n_scratch += 1;
                }
            }
        }
        self.stats.misses += miss_idx.len() as u64;
        let mut first_err: Option<WeightError> = None;
        if !miss_idx.is_empty() {
            let need = self.store.expert_buf_bytes();
            let alloc_err = |e: std::io::Error| WeightError::Invalid {
                name: format!("routed experts of layer {layer}"),
                msg: format!("cannot allocate an expert buffer of {need} bytes: {e}"),
            };
            let n_miss = miss_idx.len();
            while self.scratch.len() < n_scratch {
                let b = self.take_buf(n_miss).map_err(alloc_err)?;
                self.scratch.push((b, [(0, 0); 6]));
            }
            for &i in &miss_idx {
                if let Some(Place::Slot(s)) = places[i]
                    && self.slots[s].buf.is_none()
                {
                    self.slots[s].buf = Some(self.take_buf(n_miss).map_err(alloc_err)?);
                }
            }
            // Borrow every miss buffer at once (slots and scratch are disjoint fields).
            let keys: Vec<ExpertKey> = miss_idx.iter().map(|&i| (layer, ids[i] as usize)).collect();
            let mut slot_bufs: HashMap<usize, &mut AlignedBuf> = self
                .slots
                .iter_mut()
                .enumerate()
                .filter(|(_, s)| s.state == SlotState::InFlight)
                .filter_map(|(i, s)| s.buf.as_mut().map(|b| (i, b)))
                .collect();
            let mut scratch_bufs: Vec<Option<&mut AlignedBuf>> =
                self.scratch.iter_mut().map(|(b, _)| Some(b)).collect();
            let mut bufs = Vec::with_capacity(miss_idx.len());
            for &i in &miss_idx {
                let b = match places[i] {
                    Some(Place::Slot(s)) => slot_bufs.remove(&s),
                    Some(Place::Scratch(k)) => scratch_bufs[k].take(),
                    None => None,
                };
                bufs.push(b.ok_or_else(|| WeightError::Invalid {
                    name: format!("routed experts of layer {layer}"),
                    msg: "expert buffer bookkeeping broke (internal error)".to_string(),
                })?);
            }
            let t0 = Instant::now();
            let (layouts, bytes) = self.store.read_batch(&keys, bufs);
            self.stats.read_seconds += t0.elapsed().as_secs_f64();
            self.stats.bytes_read += bytes;
            for ((&i, key), lay) in miss_idx.iter().zip(&keys).zip(layouts) {
                let place = places[i].ok_or_else(|| WeightError::Invalid {
                    name: format!("routed experts of layer {layer}"),
                    msg: "unplaced miss (internal error)".to_string(),
                })?;
                let checked = lay.and_then(|lay| {
                    let buf = match place {
                        Place::Slot(s) => self.slots[s].buf.as_ref().map(|b| b.full()),
                        Place::Scratch(k) => Some(self.scratch[k].0.full()),
                    }
                    .ok_or_else(|| "expert buffer missing (internal error)".to_string())?;
                    self.store.check_scales(*key, &lay, buf)?;
                    Ok(lay)
                });
                match (checked, place) {
                    (Ok(lay), Place::Slot(s)) => {
                        let slot = &mut self.slots[s];
                        slot.state = SlotState::Ready;
                        slot.tensors = lay.tensors;
                        slot.loaded_token = self.token;
                        self.map.insert(*key, s);
                        self.policy.on_insert(*key, s);
                    }
                    (Ok(lay), Place::Scratch(k)) => self.scratch[k].1 = lay.tensors,
                    (Err(msg), place) => {
                        self.stats.load_failures += 1;
                        if let Place::Slot(s) = place {
                            let slot = &mut self.slots[s];
                            slot.state = SlotState::Empty;
                            slot.key = None;
                        }
                        if first_err.is_none() {
                            first_err = Some(WeightError::Expert {
                                layer,
                                expert: key.1,
                                msg,
                            });
                        }
                    }
                }
            }
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        self.last_layer = Some(layer);
        self.last_slots.clear();
        for p in &places {
            if let Some(Place::Slot(s)) = p {
                self.last_slots.push(*s);
            }
        }
        // This layer's misses have landed: start the look-ahead guess (never evicts them).
        if let Some((nl, next)) = deferred {
            self.prefetch(nl, &next);
        }
        let mut out = Vec::with_capacity(ids.len());
        for (i, &id) in ids.iter().enumerate() {
            let (buf, t) = match places[i] {
                Some(Place::Slot(s)) => {
                    let slot = &self.slots[s];
                    (slot.buf.as_ref().map(|b| b.full()), slot.tensors)
                }
                Some(Place::Scratch(k)) => (Some(self.scratch[k].0.full()), self.scratch[k].1),
                None => (None, [(0, 0); 6]),
            };
            let buf = buf.ok_or_else(|| WeightError::Invalid {
                name: format!("routed expert {id} of layer {layer}"),
                msg: "not resident after its read (internal error)".to_string(),
            })?;
            out.push(expert_view(id, self.store.format, buf, &t));
        }
        Ok(out)
    }

    fn reads_ahead(&self) -> bool {
        self.capacity > 0 && self.prefetch_margin.is_some() && self.prefetch_off.is_none()
    }

    fn experts_split(
        &mut self,
        layer: usize,
        ids: &[u32],
        early: &mut dyn FnMut(&[usize], &[ExpertWeights<'_>]),
    ) -> Result<(Vec<usize>, Vec<ExpertWeights<'_>>), WeightError> {
        // Reads that landed since the last look, then what is in RAM now.
        self.poll_prefetches(None);
        let mut ready = Vec::new();
        let mut all_known = true;
        for (i, &id) in ids.iter().enumerate() {
            match self.map.get(&(layer, id as usize)) {
                Some(&s) if self.slots[s].state == SlotState::Ready => ready.push((i, s)),
                Some(_) => {}
                None => all_known = false,
            }
        }
        // Something left to wait for: `early` runs first (with the ready ones, possibly none).
        if ready.len() < ids.len() && !ids.windows(2).any(|w| w[0] >= w[1]) {
            // Nothing to read on demand (every id is ready or in flight): the look-ahead guess
            // can start now; it queues behind this layer's reads and never evicts them.
            if all_known && let Some((nl, next)) = self.deferred.take() {
                self.prefetch(nl, &next);
            }
            let at: Vec<usize> = ready.iter().map(|&(i, _)| i).collect();
            let views: Vec<ExpertWeights<'_>> = ready
                .iter()
                .filter_map(|&(i, s)| {
                    let slot = &self.slots[s];
                    // still Ready: `prefetch` above never evicts this layer's experts
                    (slot.state == SlotState::Ready)
                        .then_some(())
                        .and(slot.buf.as_ref())
                        .map(|b| expert_view(ids[i], self.store.format, b.full(), &slot.tensors))
                })
                .collect();
            if views.len() == at.len() {
                early(&at, &views);
                drop(views);
                let all = self.experts(layer, ids)?;
                let (mut rest_at, mut rest) = (Vec::new(), Vec::new());
                for (i, v) in all.into_iter().enumerate() {
                    if !at.contains(&i) {
                        rest_at.push(i);
                        rest.push(v);
                    }
                }
                return Ok((rest_at, rest));
            }
        }
        let all = self.experts(layer, ids)?;
        Ok(((0..ids.len()).collect(), all))
    }

    fn stats(&self) -> ExpertStats {
        self.stats.clone()
    }

    fn reads_block(&self) -> bool {
        true
    }

    fn ready(&mut self, layer: usize, ids: &[u32]) -> bool {
        self.poll_prefetches(None);
        ids.iter().all(|&id| {
            self.map
                .get(&(layer, id as usize))
                .is_some_and(|&s| self.slots[s].state == SlotState::Ready)
        })
    }

    fn prefetch_margin(&self) -> Option<usize> {
        if self.capacity == 0 || self.prefetch_off.is_some() {
            None
        } else {
            self.prefetch_margin
        }
    }

    fn prefetch_after_next(&mut self, layer: usize, ids: &[u32]) {
        self.deferred = Some((layer, ids.to_vec()));
    }

    fn prefetch(&mut self, layer: usize, ids: &[u32]) {
        self.guesses.retain(|(gl, _)| *gl != layer);
        self.guesses.push((layer, ids.to_vec()));
        if self.capacity == 0 || self.prefetch_off.is_some() {
            return;
        }
        self.poll_prefetches(None);
        let (files, pool) = (&self.store.files, &self.store.pool);
        self.prefetcher
            .get_or_insert_with(|| Prefetcher::new(Arc::clone(files), Arc::clone(pool)));
        // Never evicted for a guess: what the last request used, other guesses still pending,
        // slots in flight, and guessed experts already resident.
        // Nor experts of the layers between the last request and the guessed one: they may be
        // asked for before the guessed layer (a look-ahead guess skips the current layer).
        let upcoming = |k: usize| match self.last_layer {
            Some(last) if last < layer => k > last && k <= layer,
            Some(last) => k > last || k <= layer,
            None => k <= layer,
        };
        let mut protected: HashSet<usize> = self.last_slots.iter().copied().collect();
        for (i, slot) in self.slots.iter().enumerate() {
            if slot.from_prefetch
                || slot.state != SlotState::Ready
                || slot.key.is_some_and(|k| upcoming(k.0))
            {
                protected.insert(i);
            }
        }
        for &id in ids {
            if let Some(&s) = self.map.get(&(layer, id as usize)) {
                protected.insert(s);
            }
        }
        let mut items = Vec::new();
        for &id in ids {
            let key = (layer, id as usize);
            if self.map.contains_key(&key) {
                continue;
            }
            let Some(entry) = self.store.entries.get(key) else {
                continue;
            };
            let layout = self.store.layout(entry);
            let Some(s) = self.claim_slot(&protected) else {
                break;
            };
            protected.insert(s);
            let buf = match self.slots[s].buf.take() {
                Some(b) => b,
                None => match self.take_buf(1) {
                    Ok(b) => b,
                    Err(_) => break,
                },
            };
            let slot = &mut self.slots[s];
            slot.state = SlotState::InFlight;
            slot.key = Some(key);
            slot.from_prefetch = true;
            slot.loaded_token = self.token;
            self.map.insert(key, s);
            items.push(PrefetchItem {
                slot: s,
                key,
                layout,
                buf,
            });
        }
        if items.is_empty() {
            return;
        }
        self.stats.prefetched += items.len() as u64;
        if let Some(p) = self.prefetcher.as_mut() {
            p.send(items);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_loc_keeps_what_fits_and_refuses_the_rest() {
        let l = TensorLoc::new(3, (1 << 47) + 12_345, u64::from(u32::MAX)).expect("fits");
        assert_eq!(
            (l.file, l.offset(), l.len()),
            (3, (1 << 47) + 12_345, u64::from(u32::MAX))
        );
        assert_eq!(std::mem::size_of::<TensorLoc>(), 12);
        assert_eq!(std::mem::size_of::<ExpertEntry>(), 96);
        let e = TensorLoc::new(0, 0, 1 << 32).expect_err("too long");
        assert!(e.contains("4294967296 bytes long"), "{e}");
        let e = TensorLoc::new(0, LOC_OFFSET_LIMIT, 1).expect_err("too far");
        assert!(e.contains("offset 281474976710656"), "{e}");
    }

    #[test]
    fn table_lookups_stay_in_their_layer() {
        let mut t = ExpertTable {
            base: vec![0, 0, 3, 5],
            entries: vec![ExpertEntry::ABSENT; 5],
            count: 0,
        };
        for i in [0, 2, 3] {
            t.entries[i].decl[0] = i as u32;
        }
        assert!(t.get((0, 0)).is_none());
        assert_eq!(t.get((1, 0)).map(|e| e.decl[0]), Some(0));
        assert!(t.get((1, 1)).is_none(), "sparse id");
        assert_eq!(t.get((1, 2)).map(|e| e.decl[0]), Some(2));
        assert!(
            t.get((1, 3)).is_none(),
            "past the layer's width, not the next layer's"
        );
        assert_eq!(t.get((2, 0)).map(|e| e.decl[0]), Some(3));
        assert!(t.get((2, 2)).is_none() && t.get((3, 0)).is_none());
        assert!(t.get((usize::MAX, usize::MAX)).is_none());
        let keys: Vec<ExpertKey> = t.iter().map(|(k, _)| k).collect();
        assert_eq!(keys, vec![(1, 0), (1, 2), (2, 0)]);
    }
}
