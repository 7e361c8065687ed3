//! The streamed trunk: a pinned prefix of layers plus ring slots, read from a packed trunk.
//!
//! Owns: [`StreamedTrunk`] (the default `TrunkSource` with `--trunk DIR`): the plan from
//! `plan::plan_trunk`, exact-size pinned buffers loaded at start with parallel reads (timed
//! and reported), ring slots of the largest unpinned layer, O_DIRECT reads (buffered fallback,
//! reported), and — only with at least two ring slots — one reader thread that reads the next
//! streamed layer while the executor computes the current one. With one slot every read is
//! synchronous and no reader thread is ever started (it would overwrite the layer being
//! computed: wrong tokens, no error). Every layer read is split into 4 MiB pieces issued in
//! parallel on a read pool (queue depth `read_threads`), used only by whoever is reading: the
//! caller inside `layer()` with one slot, the reader thread with two or more. With the I/O
//! policy's `pinned = "page-cache"` the pinned layers are trunk.bin's own page-cache pages
//! instead of buffers: mapped read-only, read in with `MADV_POPULATE_READ`, locked with `mlock`
//! (docs/STREAMING.md, "The pinned prefix in the page cache"). Also [`MmapTrunk`], the
//! page-cache comparison policy.
//! Must not: change bytes (views are the packed bytes), or keep a view alive past the next
//! `layer()` call (the trait's contract; buffers move between threads only by ownership
//! transfer through channels, so the reader can never write a buffer the executor reads).
//! Follows upstream: docs/DESIGN.md §3 and the Chinese seed article §3-§5 (pinned prefix, ring
//! slots, prefetch only with >= 2 slots, the start-up lines and the deterministic hit rate).
//!
//! Files: this one opens the trunk, plans it, reports it and serves layers (`TrunkSource`);
//! `pinned.rs` loads the pinned prefix (at start or in the background); `page_cache.rs` holds
//! it in trunk.bin's page cache instead; `ring.rs` reads streamed layers into the ring slots
//! (reader thread with two or more); `mmap.rs` is [`MmapTrunk`].

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Instant;

use k3_models::spec::{ModelSpec, TensorDecl};

use super::aligned::{AlignedBuf, EndsRing, PageSource};
use super::compress;
use super::direct::{DirectFile, ReadPool};
use super::pack::{TRUNK_BIN, TrunkManifest, trunk_decls_by_layer};
use super::plan::{TrunkPlan, plan_trunk};
use super::{StreamError, fmt_bytes};
use crate::weights::{LayerWeights, TensorBytes, TrunkSource, TrunkStats, WeightError};

mod mmap;
mod page_cache;
mod pinned;
mod ring;

pub use mmap::MmapTrunk;
use page_cache::*;
use pinned::*;

/// Options of [`StreamedTrunk::open`].
#[derive(Clone, Debug)]
pub struct TrunkOptions {
    /// `--trunk-gb` in bytes.
    pub budget_bytes: u64,
    /// `--trunk-ring` (default 2; the budget wins).
    pub ring_slots: usize,
    /// Read with O_DIRECT (I/O policy); falls back to buffered if the filesystem refuses.
    pub o_direct: bool,
    /// Queue depth of trunk reads: every layer read (pinned load, ring slot) is split into
    /// [`READ_PIECE`] pieces read by this many pool threads.
    pub read_threads: usize,
    /// Load the pinned prefix in `open` (true) or each pinned layer on its first use.
    pub preload_pinned: bool,
    /// With `preload_pinned`: start the load in `open` on background threads and return at
    /// once; a pinned layer not read yet is waited for when it is asked for, so the load
    /// overlaps the rest of start-up and the first token's prefill. Either way the pinned
    /// load reads on its own pool of pread threads (at least [`PINNED_LOAD_DEPTH`]), also when
    /// the trunk's ring reads use io_uring.
    pub background_pinned: bool,
    /// Only the first N layers are used (`--layers N`); `None` = all.
    pub active_layers: Option<usize>,
    /// Where the pinned and ring buffers' pages come from (I/O policy `reserved_huge_pages`).
    pub pages: PageSource,
    /// Hold the pinned prefix in trunk.bin's page-cache pages, mapped, populated and locked,
    /// instead of buffers (I/O policy `pinned = "page-cache"`; see [`PinnedPages`]).
    ///
    /// [`PinnedPages`]: super::io_policy::PinnedPages
    pub pinned_page_cache: bool,
}

impl Default for TrunkOptions {
    fn default() -> Self {
        Self {
            budget_bytes: 16_000_000_000,
            ring_slots: 2,
            o_direct: true,
            read_threads: 8,
            preload_pinned: true,
            background_pinned: false,
            active_layers: None,
            pages: PageSource::Anonymous,
            pinned_page_cache: false,
        }
    }
}

/// Layers are read in pieces of this size, in parallel on the read pool (one large pread runs
/// at queue depth 1: measured 1.1 GB/s for 32 MiB reads vs 2.8 GB/s for 4 MiB pieces at depth 8
/// on the development VM's disk).
pub const READ_PIECE: usize = 4 << 20;

/// Queue depth (reader threads) of the pinned-prefix load at start, the first-token cost:
/// the goal is the disk's queue-depth-16 bandwidth. Measured on k3-mini (2.51 GB
/// pinned, page cache dropped, alternating): 2462-2548 MB/s at 16 vs 1903-2315 MB/s with the
/// trunk's 8 reader threads, against 2587 MB/s for the QD16 probe (docs/history/PERFORMANCE-LOG.md §5.4).
pub const PINNED_LOAD_DEPTH: usize = 16;

/// Piece size of a background pinned load (raw trunk). Smaller than [`READ_PIECE`]: the
/// load shares the disk with the expert reads of the prompt it runs beside, and each of those
/// waits behind the load's reads in flight (depth x piece: 16 MiB here, not 64). k3-mini, all
/// pinned, `--gen 1`, page cache dropped, 3-4 runs each: time to first token median 2.26 s
/// with 1 MiB pieces vs 2.38 s with 4 MiB, 2.60-2.69 s loading in the session build
/// (docs/history/PERFORMANCE-LOG.md §8.5).
pub const PINNED_BACKGROUND_PIECE: usize = 1 << 20;

/// Queue depth of a background pinned load into the page cache (in [`READ_PIECE`]s). Each
/// fault of a mapping advised `MADV_HUGEPAGE` reads a 4 MiB window, and the load shares the
/// disk with the prompt's expert reads. k3-mini, all pinned, `--gen 1`, page cache dropped and
/// 12 s idle before each run, 5 rounds: time to first token median 2.58 s at depth 4, 3.05 s
/// at 2, 3.40 s at 16, and 2.94 s for buffers (docs/history/PERFORMANCE-LOG.md §8.7).
pub const PAGE_CACHE_BACKGROUND_DEPTH: usize = 4;

/// A loaded layer: the buffer and where the layer's first byte sits in it.
#[derive(Debug)]
struct Loaded {
    buf: AlignedBuf,
    lead: usize,
}

/// A pinned layer: a buffer, or (`TrunkOptions::pinned_page_cache`) trunk.bin's page-cache
/// pages of the layer, mapped read-only.
#[derive(Debug)]
enum Pinned {
    Buf(Loaded),
    Mapped(memmap2::Mmap),
}

impl Pinned {
    /// The bytes and where the layer's first byte sits in them.
    fn bytes(&self) -> (&[u8], usize) {
        match self {
            Pinned::Buf(l) => (l.buf.full(), l.lead),
            Pinned::Mapped(m) => (&m[..], 0),
        }
    }
}

/// Where the reader puts streamed layers.
enum Slots {
    /// Uniform slots of the largest streamed layer: the free ones.
    Uniform(Vec<AlignedBuf>),
    /// One shared ring (the plan's `shared_ring_bytes`): layers alternate between its two
    /// ends, so a layer is read while the one before it computes whenever both fit.
    Ends { ring: EndsRing, next_at_start: bool },
}

impl Slots {
    /// A buffer for a read of `len` bytes, or `None` until one is given back.
    fn take(&mut self, len: usize) -> Option<AlignedBuf> {
        match self {
            Slots::Uniform(free) => free.pop(),
            Slots::Ends {
                ring,
                next_at_start,
            } => {
                let b = ring.lend(len, *next_at_start)?;
                *next_at_start = !*next_at_start;
                Some(b)
            }
        }
    }

    fn give_back(&mut self, buf: AlignedBuf) {
        match self {
            Slots::Uniform(free) => free.push(buf),
            // Dropping a lent buffer returns its range to the ring.
            Slots::Ends { .. } => drop(buf),
        }
    }
}

/// The ring of a trunk with >= 2 slots or a shared ring: a reader thread reads ahead in the
/// cyclic order.
struct Prefetch {
    jobs: Option<mpsc::Sender<ReadJob>>,
    done: mpsc::Receiver<ReadDone>,
    handle: Option<JoinHandle<()>>,
    /// The streamed layer the executor is computing (returned to `slots` on the next call).
    current: Option<(usize, Loaded)>,
    slots: Slots,
    in_flight: VecDeque<usize>,
    /// Index into `streamed` of the next layer to issue.
    cursor: usize,
}

impl Prefetch {
    /// A reader ring over `slots`; the thread is started on the first streamed read (see
    /// `StreamedTrunk::start_reader`).
    fn ring(slots: Slots) -> Ring {
        let (_tx, done) = mpsc::channel();
        Ring::Prefetch(Box::new(Prefetch {
            jobs: None,
            done,
            handle: None,
            current: None,
            slots,
            in_flight: VecDeque::new(),
            cursor: 0,
        }))
    }
}

enum Ring {
    /// Every active layer is pinned.
    None,
    /// One slot, synchronous reads, no prefetch thread (the read pool only works while
    /// `layer()` blocks the caller).
    Sync {
        slot: AlignedBuf,
        holds: Option<(usize, usize)>,
    },
    Prefetch(Box<Prefetch>),
}

/// Pinned prefix + ring slots over a packed trunk (see the module doc).
pub struct StreamedTrunk {
    dir: PathBuf,
    manifest: Arc<TrunkManifest>,
    decls: Vec<Vec<(TensorDecl, usize)>>,
    plan: TrunkPlan,
    file: Arc<DirectFile>,
    pool: Arc<ReadPool>,
    pinned: Vec<Option<Pinned>>,
    /// Pinned buffers the background load is filling (moved to `pinned` when reported).
    loading: Vec<Option<Pinned>>,
    /// A background load's error for a pinned layer, returned when the layer is asked for.
    pin_errors: Vec<Option<StreamError>>,
    /// Buffers of layers whose background load failed, kept until the load thread is joined.
    retired: Vec<Pinned>,
    /// The pinned prefix is held in trunk.bin's page cache (mapped, populated, locked).
    page_cache: bool,
    /// Why a requested page-cache prefix is in buffers instead (compressed trunk, old kernel).
    page_cache_note: Option<String>,
    /// The page-cache mappings are advised `MADV_HUGEPAGE` (see [`populate_read`]).
    page_cache_huge: bool,
    /// Page-cache layers loaded on first use: each pinned layer's bytes not cached when the
    /// first of them was asked for (empty before that).
    lazy_uncached: Vec<u64>,
    /// The first reason a page-cache layer could not be locked in RAM.
    lock_error: Option<String>,
    bg: Option<PinLoad>,
    /// Seconds the executor waited for the background load.
    pinned_wait_seconds: f64,
    /// The pinned prefix was given to a background load.
    background: bool,
    /// Unpinned active layers, in order.
    streamed: Vec<usize>,
    ring: Ring,
    stats: TrunkStats,
    pinned_load_seconds: f64,
    /// Queue depth of the last pinned-prefix load (the trunk pool's depth, at least
    /// [`PINNED_LOAD_DEPTH`]).
    pinned_load_depth: usize,
    reader_threads_spawned: usize,
    out_of_order: u64,
    /// Ring reads issued for a layer other than the one being asked for (read ahead).
    reads_ahead: u64,
    huge_pages: bool,
    /// Where new pinned buffers' pages come from.
    pages: PageSource,
}

impl std::fmt::Debug for StreamedTrunk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamedTrunk")
            .field("dir", &self.dir)
            .field("plan", &self.plan)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

fn layer_decls(spec: &ModelSpec, m: &TrunkManifest) -> Vec<Vec<(TensorDecl, usize)>> {
    let by_layer = trunk_decls_by_layer(spec);
    (0..m.n_layers)
        .map(|l| {
            let decls = by_layer.get(l).map_or(&[][..], Vec::as_slice);
            m.layers[l]
                .tensors
                .iter()
                .filter_map(|t| {
                    let d = decls.iter().find(|d| d.name == t.name)?;
                    Some(((*d).clone(), t.offset as usize))
                })
                .collect()
        })
        .collect()
}

fn view<'a>(decls: &'a [(TensorDecl, usize)], bytes: &'a [u8]) -> LayerWeights<'a> {
    LayerWeights {
        tensors: decls
            .iter()
            .map(|(d, off)| TensorBytes {
                decl: d,
                bytes: &bytes[*off..*off + d.n_bytes()],
            })
            .collect(),
    }
}

/// Read packed layer `layer` into `buf` on `pool`: a raw layer in [`READ_PIECE`] pieces, a
/// compressed one chunk by chunk, each decoded by the thread that read it. Returns the lead
/// offset of the layer's first byte in `buf` and the bytes read from disk.
fn read_packed(
    pool: &ReadPool,
    file: &DirectFile,
    m: &TrunkManifest,
    layer: usize,
    buf: &mut [u8],
) -> Result<(usize, u64), StreamError> {
    let pl = &m.layers[layer];
    match (&m.compression, &pl.stored) {
        (Some(c), Some(stored)) => {
            let bytes = compress::read_layers(
                pool,
                file,
                c.chunk_bytes,
                vec![compress::LayerRead {
                    layer,
                    offset: pl.offset,
                    size: pl.size,
                    stored,
                    dst: buf,
                }],
            )?;
            Ok((0, bytes))
        }
        _ => {
            let lead = pool.read_split(file, pl.offset, pl.size as usize, buf, READ_PIECE)?;
            Ok((lead, file.span(pl.offset, pl.size as usize).len as u64))
        }
    }
}

fn weight_err(layer: usize, e: StreamError) -> WeightError {
    match e {
        StreamError::Io { path, source, .. } => WeightError::Io {
            what: format!("packed trunk layer {layer}"),
            path,
            source,
        },
        // Already names the file, layer and chunk.
        e @ (StreamError::Trunk { .. } | StreamError::TrunkManifest { .. }) => {
            WeightError::Trunk(e.to_string())
        }
        other => WeightError::Trunk(format!("packed trunk layer {layer}: {other}")),
    }
}

impl StreamedTrunk {
    /// Open the packed trunk in `dir` (trunk.json checked against `spec`), plan it, allocate
    /// the buffers and (with `preload_pinned`) load the pinned prefix.
    pub fn open(dir: &Path, spec: &ModelSpec, opts: &TrunkOptions) -> Result<Self, StreamError> {
        Self::open_with_pool(dir, spec, opts, ReadPool::new(opts.read_threads)?)
    }

    /// Like [`StreamedTrunk::open`] with a given read pool (`opts.read_threads` is ignored),
    /// e.g. `ReadPool::for_policy(&policy)` for io_uring.
    pub fn open_with_pool(
        dir: &Path,
        spec: &ModelSpec,
        opts: &TrunkOptions,
        pool: ReadPool,
    ) -> Result<Self, StreamError> {
        let manifest = TrunkManifest::load(dir, spec)?;
        let active = opts
            .active_layers
            .unwrap_or(manifest.n_layers)
            .min(manifest.n_layers)
            .min(spec.n_layers);
        let sizes = manifest.layer_sizes();
        let plan = plan_trunk(&sizes[..active], opts.budget_bytes, opts.ring_slots)?;
        let file = Arc::new(DirectFile::open(&dir.join(TRUNK_BIN), opts.o_direct)?);
        let pool = Arc::new(pool);
        let decls = layer_decls(spec, &manifest);
        let streamed: Vec<usize> = (plan.pinned_layers..active).collect();

        let slot_len = streamed
            .iter()
            .map(|&l| {
                file.span(manifest.layers[l].offset, manifest.layers[l].size as usize)
                    .len
            })
            .max()
            .unwrap_or(0);
        let mut huge_pages = false;
        let mut hugetlb_bytes = 0u64;
        let pages = opts.pages;
        let mut alloc = |len: usize| -> Result<AlignedBuf, StreamError> {
            let b = AlignedBuf::new_from(len, pages).map_err(|e| {
                StreamError::Invalid(format!(
                    "cannot allocate a {} trunk buffer: {e}",
                    fmt_bytes(len as u64)
                ))
            })?;
            huge_pages |= b.huge_pages();
            if b.hugetlb() {
                hugetlb_bytes += b.capacity() as u64;
            }
            Ok(b)
        };
        // A shared ring must hold every streamed layer's span (the plan sized it from the same
        // 4096-rounded sizes; a buffered fallback's spans are never longer).
        let shared = plan.shared_ring_bytes as usize;
        let ring = match plan.ring_slots {
            0 => Ring::None,
            1 if shared >= slot_len && shared > 0 => {
                let ring = EndsRing::new_from(shared, pages).map_err(|e| {
                    StreamError::Invalid(format!(
                        "cannot allocate the {} shared trunk ring: {e}",
                        fmt_bytes(shared as u64)
                    ))
                })?;
                huge_pages |= ring.huge_pages();
                if ring.hugetlb() {
                    hugetlb_bytes += ring.mapped_bytes() as u64;
                }
                Prefetch::ring(Slots::Ends {
                    ring,
                    next_at_start: true,
                })
            }
            1 => Ring::Sync {
                slot: alloc(slot_len)?,
                holds: None,
            },
            n => Prefetch::ring(Slots::Uniform(
                (0..n).map(|_| alloc(slot_len)).collect::<Result<_, _>>()?,
            )),
        };
        let stats = TrunkStats {
            n_layers: active,
            pinned_layers: plan.pinned_layers,
            pinned_bytes: plan.pinned_bytes,
            ring_slots: plan.ring_slots,
            ring_slot_bytes: plan.ring_slot_bytes,
            shared_ring_bytes: plan.shared_ring_bytes,
            o_direct: file.is_direct(),
            hugetlb_bytes,
            ..TrunkStats::default()
        };
        // The pinned prefix in the page cache: raw layers only (a compressed trunk decodes its
        // records in place, which a read-only mapping cannot take), on a kernel that populates
        // a file mapping on request.
        let (page_cache, page_cache_note) = if !opts.pinned_page_cache || plan.pinned_layers == 0 {
            (false, None)
        } else if manifest.compression.is_some() {
            (
                false,
                Some(
                    "pinned prefix in buffers, not the page cache: the trunk is compressed and \
                     its records are decoded in place"
                        .to_string(),
                ),
            )
        } else {
            let l0 = &manifest.layers[0];
            match probe_populate_read(&file, l0.offset, l0.size as usize) {
                Ok(()) => (true, None),
                Err(e) => (
                    false,
                    Some(format!("pinned prefix in buffers, not the page cache: {e}")),
                ),
            }
        };
        let stats = TrunkStats {
            pinned_page_cache: page_cache,
            ..stats
        };
        let mut t = Self {
            dir: dir.to_path_buf(),
            manifest: Arc::new(manifest),
            decls,
            plan,
            file,
            pool,
            pinned: (0..active).map(|_| None).collect(),
            loading: (0..active).map(|_| None).collect(),
            pin_errors: (0..active).map(|_| None).collect(),
            retired: Vec::new(),
            page_cache,
            page_cache_note,
            page_cache_huge: page_cache && thp_advisable(),
            lazy_uncached: Vec::new(),
            lock_error: None,
            bg: None,
            pinned_wait_seconds: 0.0,
            background: false,
            streamed,
            ring,
            stats,
            pinned_load_seconds: 0.0,
            pinned_load_depth: 0,
            reader_threads_spawned: 0,
            out_of_order: 0,
            reads_ahead: 0,
            huge_pages,
            pages,
        };
        if opts.preload_pinned {
            if opts.background_pinned {
                t.start_background_load()?;
            } else {
                t.load_pinned()?;
            }
        }
        Ok(t)
    }

    /// The plan in use.
    pub fn plan(&self) -> &TrunkPlan {
        &self.plan
    }

    /// Seconds spent loading the pinned prefix (a background load counts once it finished).
    pub fn pinned_load_seconds(&self) -> f64 {
        self.pinned_load_seconds
    }

    /// Whether the pinned prefix is (or was) loaded on background threads.
    pub fn pinned_in_background(&self) -> bool {
        self.background
    }

    /// Reader threads this trunk has started (0 with one ring slot, at most 1 otherwise).
    pub fn reader_threads_spawned(&self) -> usize {
        self.reader_threads_spawned
    }

    /// Ring reads issued before their layer was asked for (while another layer computed): per
    /// cyclic pass, the plan's `read_ahead_layers` once the ring is running.
    pub fn reads_issued_ahead(&self) -> u64 {
        self.reads_ahead
    }

    /// Calls that asked for a streamed layer out of the cyclic order (each drains the ring).
    pub fn out_of_order_requests(&self) -> u64 {
        self.out_of_order
    }

    /// Whether reads currently bypass the page cache, and if not, why (and, for a compressed
    /// trunk, how much a pass reads).
    pub fn io_line(&self) -> String {
        let mut line = self.io_mode_line();
        if self.page_cache {
            line.push_str(
                "; the pinned prefix is trunk.bin's own page cache (each layer mapped read-only, \
                 read in with MADV_POPULATE_READ, locked with mlock)",
            );
        } else if let Some(note) = &self.page_cache_note {
            line.push_str("; ");
            line.push_str(note);
        }
        if let Some(c) = &self.manifest.compression {
            let m = &self.manifest;
            line.push_str(&format!(
                "; compressed trunk ({}, {} chunks): {} stored for {} of layers ({:.1}%), \
                 each chunk decoded in place by the thread that read it",
                c.codec,
                fmt_bytes(c.chunk_bytes),
                fmt_bytes(c.stored_bytes),
                fmt_bytes(m.packed_bytes),
                100.0 * c.stored_bytes as f64 / m.packed_bytes.max(1) as f64
            ));
        }
        line
    }

    fn io_mode_line(&self) -> String {
        if self.file.is_direct() {
            format!(
                "reads use O_DIRECT (page cache bypassed); {} MiB pieces, {}",
                READ_PIECE >> 20,
                self.pool.backend_line()
            )
        } else {
            format!(
                "reads are buffered (page cache): {}",
                self.file
                    .fallback_reason()
                    .unwrap_or_else(|| "O_DIRECT unavailable".to_string())
            )
        }
    }

    /// The start-up lines: plan, ring note, I/O mode, buffers, pinned load, hit rate.
    pub fn startup_lines(&self) -> Vec<String> {
        let mut lines = self.plan.report_lines();
        let hit = lines.pop();
        lines.push(self.io_line());
        let hugetlb = self.stats.hugetlb_bytes;
        let pages = if hugetlb > 0 {
            format!(
                "{} on reserved 2 MB huge pages (the vm.nr_hugepages pool; not in the peak RSS)\
                 {}",
                fmt_bytes(hugetlb),
                if hugetlb >= self.plan.planned_bytes() {
                    ""
                } else {
                    ", the rest 2 MB transparent huge pages advised (the pool had no more room)"
                }
            )
        } else if self.huge_pages {
            "2 MB transparent huge pages advised".to_string()
        } else {
            "4 KB pages (huge pages not advised or not available for these sizes)".to_string()
        };
        let pages = if self.page_cache && self.plan.ring_slots == 0 {
            "none (every active layer is pinned in the page cache)".to_string()
        } else if self.page_cache {
            format!("ring on {pages}")
        } else {
            pages
        };
        lines.push(format!(
            "trunk buffers: {pages}; {}",
            if self.plan.shared_ring_bytes > 0 {
                "a reader thread reads the next layer into the shared ring's free end while a \
                 layer computes"
            } else if self.plan.prefetch() {
                "a reader thread reads layer L+1 while layer L computes"
            } else if self.plan.ring_slots == 1 {
                "no reader thread (one slot)"
            } else {
                "nothing streams"
            }
        ));
        if self.plan.pinned_layers > 0 {
            let loaded: u64 = (0..self.plan.pinned_layers)
                .filter(|&l| self.pinned[l].is_some())
                .map(|l| self.manifest.layers[l].size)
                .sum();
            if let Some(bg) = &self.bg {
                let bytes: u64 = (0..self.plan.pinned_layers)
                    .map(|l| self.manifest.layers[l].size)
                    .sum();
                lines.push(format!(
                    "pinned prefix: {} of {} layers loading {}in the background (queue depth \
                     {}) while start-up and the prompt run; a layer not read yet is waited for",
                    fmt_bytes(bytes),
                    self.plan.pinned_layers,
                    if self.page_cache {
                        "into the page cache "
                    } else {
                        ""
                    },
                    bg.depth
                ));
            } else if loaded > 0 && self.pinned_load_seconds > 0.0 {
                lines.push(format!(
                    "pinned prefix: {} loaded in {:.2} s ({:.0} MB/s, queue depth {}){}",
                    fmt_bytes(loaded),
                    self.pinned_load_seconds,
                    loaded as f64 / 1e6 / self.pinned_load_seconds,
                    self.pinned_load_depth,
                    if self.page_cache {
                        format!(
                            " into the page cache, {} of it from disk",
                            fmt_bytes(self.stats.bytes_read)
                        )
                    } else {
                        String::new()
                    }
                ));
            } else {
                lines.push("pinned prefix: loaded on first use".to_string());
            }
        }
        lines.extend(hit);
        lines
    }
}

impl StreamedTrunk {
    /// Make `layer` resident (pinned load, ring read or wait) so [`Self::view_of`] finds it.
    fn prepare(&mut self, layer: usize) -> Result<(), WeightError> {
        self.check_layer(layer)?;
        // The previous streamed view is dead now (trait contract): recycle its slot and keep
        // the reader busy while this layer computes.
        if let Ring::Prefetch(p) = &mut self.ring
            && let Some((_, cur)) = p.current.take()
        {
            p.slots.give_back(cur.buf);
        }
        if self.bg.is_some() {
            self.poll_background();
        }
        if self.plan.is_pinned(layer) {
            if self.pinned[layer].is_none()
                && (self.loading[layer].is_some() || self.pin_errors[layer].is_some())
            {
                self.wait_pinned(layer)?;
            }
            self.load_pinned_one(layer)?;
            // Read the next streamed layers while the pinned ones compute.
            self.start_reader()?;
            self.top_up(layer)?;
        } else {
            match self.ring {
                Ring::Sync { .. } => self.read_sync(layer)?,
                Ring::Prefetch(_) => self.read_prefetched(layer)?,
                Ring::None => {}
            }
        }
        Ok(())
    }

    /// The view of `layer` if it is in RAM now (pinned and loaded, or the current ring slot).
    fn view_of(&self, layer: usize) -> Option<LayerWeights<'_>> {
        let size = self.manifest.layers.get(layer)?.size as usize;
        let decls = &self.decls[layer];
        let loaded = if self.plan.is_pinned(layer) {
            self.pinned[layer].as_ref().map(Pinned::bytes)
        } else {
            match &self.ring {
                Ring::Sync {
                    slot,
                    holds: Some((l, lead)),
                } if *l == layer => Some((slot.full(), *lead)),
                Ring::Prefetch(p) => p
                    .current
                    .as_ref()
                    .filter(|(l, _)| *l == layer)
                    .map(|(_, c)| (c.buf.full(), c.lead)),
                _ => None,
            }
        };
        let (buf, lead) = loaded?;
        Some(view(decls, &buf[lead..lead + size]))
    }
}

impl TrunkSource for StreamedTrunk {
    fn layer(&mut self, layer: usize) -> Result<LayerWeights<'_>, WeightError> {
        self.prepare(layer)?;
        self.view_of(layer).ok_or_else(|| WeightError::Invalid {
            name: format!("trunk layer {layer}"),
            msg: "not resident after its read (internal error)".to_string(),
        })
    }

    /// The peeked layer only when it is pinned and already loaded (never a ring slot: the
    /// reader may be filling it).
    fn layer_and_peek(
        &mut self,
        layer: usize,
        peek: usize,
    ) -> Result<(LayerWeights<'_>, Option<LayerWeights<'_>>), WeightError> {
        self.prepare(layer)?;
        let lw = self.view_of(layer).ok_or_else(|| WeightError::Invalid {
            name: format!("trunk layer {layer}"),
            msg: "not resident after its read (internal error)".to_string(),
        })?;
        let next = if peek < self.pinned.len() && self.pinned[peek].is_some() {
            self.view_of(peek)
        } else {
            None
        };
        Ok((lw, next))
    }

    fn stats(&self) -> TrunkStats {
        let mut s = self.stats.clone();
        s.o_direct = self.file.is_direct();
        s.pinned_load_seconds = self.pinned_load_seconds;
        s.pinned_wait_seconds = self.pinned_wait_seconds;
        s.pinned_background = self.background;
        s.pinned_lock_error = self.lock_error.clone();
        s
    }
}

impl Drop for StreamedTrunk {
    fn drop(&mut self) {
        // The background load writes into buffers this trunk owns: stop it and wait for its
        // thread before they are freed.
        if let Some(bg) = &mut self.bg {
            bg.cancel.store(true, Ordering::Relaxed);
            if let Some(h) = bg.handle.take() {
                let _ = h.join();
            }
        }
        if let Ring::Prefetch(p) = &mut self.ring {
            p.jobs = None; // closes the channel: the reader finishes its job and exits
            if let Some(h) = p.handle.take() {
                let _ = h.join();
            }
        }
    }
}
