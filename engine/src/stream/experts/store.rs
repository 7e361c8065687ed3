//! [`ExpertStore`]: where every routed expert's tensors are in the shard files (a compact
//! table), how one expert is laid out in a buffer, and batched O_DIRECT reads of experts.

use super::*;

/// Where one expert tensor lives: 12 bytes (the offset as a 48-bit number in two parts, the
/// length as a u32). [`TensorLoc::new`] refuses what does not fit; it never truncates.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct TensorLoc {
    pub(super) off_lo: u32,
    pub(super) off_hi: u16,
    pub(super) file: u16,
    pub(super) len: u32,
}

/// Largest tensor offset a [`TensorLoc`] holds, plus one (256 TiB).
pub(super) const LOC_OFFSET_LIMIT: u64 = 1 << 48;

impl TensorLoc {
    /// The location, or why it does not fit (the caller names the tensor).
    pub(super) fn new(file: u16, offset: u64, len: u64) -> Result<Self, String> {
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

    pub(super) fn offset(&self) -> u64 {
        (u64::from(self.off_hi) << 32) | u64::from(self.off_lo)
    }

    pub(super) fn len(&self) -> u64 {
        u64::from(self.len)
    }
}

/// `decl` of a slot no tensor fills.
pub(super) const NO_DECL: u32 = u32::MAX;

#[derive(Clone, Copy, Debug)]
pub(super) struct ExpertEntry {
    /// Indices into `spec.tensors`, in [`EXPERT_ROLES`] order; [`NO_DECL`] where the spec
    /// declares no tensor (all six for an expert the model does not have).
    pub(super) decl: [u32; 6],
    pub(super) loc: [TensorLoc; 6],
}

impl ExpertEntry {
    pub(super) const ABSENT: ExpertEntry = ExpertEntry {
        decl: [NO_DECL; 6],
        loc: [TensorLoc {
            off_lo: 0,
            off_hi: 0,
            file: 0,
            len: 0,
        }; 6],
    };

    pub(super) fn present(&self) -> bool {
        self.decl.iter().any(|&d| d != NO_DECL)
    }
}

/// Every routed expert's [`ExpertEntry`] in one dense table, layer-major: layer `l`'s experts
/// `0..w` are slots `base[l]..base[l + 1]`, `w` its largest declared expert id plus one (0 for
/// a layer without routed experts). Ids the spec skips are [`ExpertEntry::ABSENT`].
#[derive(Debug, Default)]
pub(super) struct ExpertTable {
    /// `n_layers + 1` slot offsets.
    pub(super) base: Vec<usize>,
    pub(super) entries: Vec<ExpertEntry>,
    /// Present experts.
    pub(super) count: usize,
}

impl ExpertTable {
    pub(super) fn slot(&self, (layer, expert): ExpertKey) -> Option<usize> {
        let lo = *self.base.get(layer)?;
        let hi = *self.base.get(layer + 1)?;
        let i = lo.checked_add(expert)?;
        (i < hi).then_some(i)
    }

    pub(super) fn get(&self, key: ExpertKey) -> Option<&ExpertEntry> {
        self.slot(key)
            .map(|i| &self.entries[i])
            .filter(|e| e.present())
    }

    /// The present experts in (layer, expert) order.
    pub(super) fn iter(&self) -> impl Iterator<Item = (ExpertKey, &ExpertEntry)> {
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
pub(super) struct RunRead {
    pub(super) file: u16,
    pub(super) offset: u64,
    pub(super) len: usize,
    /// Where the rounded-out read lands in the expert buffer.
    pub(super) buf_off: usize,
    pub(super) buf_len: usize,
}

/// Where an expert's bytes go in its buffer.
#[derive(Clone, Debug)]
pub(super) struct Layout {
    pub(super) runs: Vec<RunRead>,
    /// (position, length) of each tensor in the buffer, [`EXPERT_ROLES`] order.
    pub(super) tensors: [(usize, usize); 6],
}

/// Reads routed experts from the checkpoint shards.
pub struct ExpertStore<'c> {
    pub(super) spec: &'c ModelSpec,
    /// Shared with the prefetch thread.
    pub(super) files: Arc<Vec<DirectFile>>,
    pub(super) entries: ExpertTable,
    /// Buffer bytes one expert needs (max over experts).
    pub(super) expert_buf_bytes: usize,
    /// Exact payload bytes of one expert (max over experts).
    pub(super) expert_bytes: u64,
    /// Shared with the prefetch thread (the blocking reader threads and the io_uring mutex
    /// allow callers on several threads).
    pub(super) pool: Arc<ReadPool>,
    /// MXFP4 (six tensors per expert) or BF16 (three; the scale slots empty).
    pub(super) format: ExpertFormat,
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
    pub(super) fn index(
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

    pub(super) fn layout(&self, e: &ExpertEntry) -> Layout {
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
    pub(super) fn read_batch(
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
    pub(super) fn check_scales(
        &self,
        key: ExpertKey,
        lay: &Layout,
        buf: &[u8],
    ) -> Result<(), String> {
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
pub(super) fn expert_view<'b>(
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
