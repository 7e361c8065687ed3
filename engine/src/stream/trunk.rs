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

/// The system's page size (4096 when it cannot be read).
fn page_size() -> usize {
    // SAFETY: sysconf has no memory effects.
    usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
        .ok()
        .filter(|p| p.is_power_of_two())
        .unwrap_or(4096)
}

/// `[addr, addr + len)` widened to start on a page boundary.
fn page_range(addr: usize, len: usize) -> (usize, usize) {
    let start = addr & !(page_size() - 1);
    (start, len + (addr - start))
}

/// Map `len` bytes of `file` at `offset` read-only (shared: the page cache's own pages).
fn map_range(file: &DirectFile, offset: u64, len: usize) -> Result<memmap2::Mmap, StreamError> {
    // SAFETY: the mapping is read-only; a packed trunk is not modified while a run uses it
    // (the same contract as the checkpoint's shard maps and `MmapTrunk`).
    unsafe {
        memmap2::MmapOptions::new()
            .offset(offset)
            .len(len)
            .map(file.buffered_file())
    }
    .map_err(|e| StreamError::io("map", file.path(), e))
}

/// `MADV_POPULATE_READ` (Linux 5.14): read the range into the page cache and map it, or fail
/// (EFAULT on a read error, EINVAL on an older kernel).
const MADV_POPULATE_READ: libc::c_int = 22;

/// Bytes of the pages of `[addr, addr + len)` (a live file mapping) not in the page cache now:
/// what reading it in asks of the disk.
fn uncached_bytes(addr: usize, len: usize) -> u64 {
    let page = page_size();
    let (start, len) = page_range(addr, len);
    let mut resident = vec![0u8; len.div_ceil(page)];
    // SAFETY: the range lies inside a live mapping owned by the caller; mincore writes one
    // byte per page of it into `resident`, which has that many.
    if unsafe { libc::mincore(start as *mut libc::c_void, len, resident.as_mut_ptr()) } != 0 {
        return len as u64;
    }
    (resident.iter().filter(|&&v| v & 1 == 0).count() * page).min(len) as u64
}

/// `MADV_WILLNEED` steps of [`populate_read`] without huge pages: the kernel reads at most
/// max(read-ahead window, largest device request) per call, 128 KiB-8 MiB and 1280 KiB-4 MiB
/// on common systems, so a step of 1 MiB is read whole almost everywhere.
const WILLNEED_STEP: usize = 1 << 20;

/// Read `[addr, addr + len)` of a live read-only file mapping into the page cache and map it.
///
/// With `huge` (the mapping is advised `MADV_HUGEPAGE`), each fault reads an aligned 4 MiB
/// window into 2 MiB folios where the filesystem has large folios (ext4 since Linux 6.16, xfs),
/// and the populate maps them with 2 MiB entries: decode then reads the prefix with as few TLB
/// misses as from 2 MiB-page buffers (4 KiB pages cost k3-mini's all-pinned decode ~10%).
///
/// Without it, faults would read the device's read-ahead window around each of them (8 MiB
/// on the development VM, 128 KiB on many systems). So the range is first asked for with
/// `MADV_WILLNEED` in [`WILLNEED_STEP`]s, which start reads of exactly those pages (in 4 KiB
/// folios) and return; the populate then waits for them. A page the advice did not reach is
/// read by its fault, with the normal read-around.
fn populate_read(addr: usize, len: usize, huge: bool) -> std::io::Result<()> {
    let (start, len) = page_range(addr, len);
    // SAFETY: the range lies inside a live mapping owned by the caller (see `PinLoad`);
    // WILLNEED and POPULATE_READ only read the file's pages in and map them.
    unsafe {
        if !huge {
            for off in (0..len).step_by(WILLNEED_STEP) {
                let n = WILLNEED_STEP.min(len - off);
                libc::madvise((start + off) as *mut libc::c_void, n, libc::MADV_WILLNEED);
            }
        }
        if libc::madvise(start as *mut libc::c_void, len, MADV_POPULATE_READ) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// A failed [`populate_read`] of `file` (EFAULT: the read failed).
fn populate_error(file: &DirectFile, e: std::io::Error) -> StreamError {
    StreamError::io(
        "read into the page cache (MADV_POPULATE_READ)",
        file.path(),
        e,
    )
}

/// Whether transparent huge pages can back a mapping advised `MADV_HUGEPAGE` (the system's
/// setting is not `never`).
fn thp_advisable() -> bool {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .is_ok_and(|s| !s.contains("[never]"))
}

/// Map pinned layer bytes of `file` for [`populate_read`], advised `MADV_HUGEPAGE` with
/// `huge`.
fn map_pinned(
    file: &DirectFile,
    offset: u64,
    len: usize,
    huge: bool,
) -> Result<memmap2::Mmap, StreamError> {
    let map = map_range(file, offset, len)?;
    if huge {
        // Advice only: a refusal leaves 4 KiB pages, the same bytes.
        let _ = map.advise(memmap2::Advice::HugePage);
    }
    Ok(map)
}

/// A page-cache layer read in completely: `mlock` it so it stays in RAM (its pages are in:
/// nothing is read). Returns why the lock was refused.
fn keep_mapped(addr: usize, len: usize) -> Option<String> {
    let (start, len) = page_range(addr, len);
    // SAFETY: the range lies inside a live mapping owned by the caller; mlock does not change
    // the memory's contents.
    if unsafe { libc::mlock(start as *const libc::c_void, len) } == 0 {
        None
    } else {
        Some(std::io::Error::last_os_error().to_string())
    }
}

/// Whether this kernel knows `MADV_POPULATE_READ`; the error when it does not. The advice is
/// given for an empty range of a mapping of `file` (one page at `offset`): the kernel checks
/// the advice before the length, and reads nothing.
fn probe_populate_read(file: &DirectFile, offset: u64, len: usize) -> Result<(), String> {
    let map = map_range(file, offset, len.clamp(1, page_size())).map_err(|e| e.to_string())?;
    let (start, _) = page_range(map.as_ptr() as usize, 0);
    // SAFETY: an empty range at the start of a live mapping: nothing is read or changed.
    if unsafe { libc::madvise(start as *mut libc::c_void, 0, MADV_POPULATE_READ) } != 0 {
        let e = std::io::Error::last_os_error();
        return Err(format!(
            "MADV_POPULATE_READ refused ({e}; it needs Linux 5.14)"
        ));
    }
    Ok(())
}

struct ReadJob {
    layer: usize,
    buf: AlignedBuf,
}

struct ReadDone {
    layer: usize,
    buf: AlignedBuf,
    result: Result<usize, StreamError>,
    seconds: f64,
    bytes: u64,
}

/// A pinned layer's buffer handed to the background load: the load writes it through this
/// pointer, the trunk keeps the [`AlignedBuf`] (see [`PinLoad`] for why that is sound).
struct Place {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a `Place` is only a destination address; see `PinLoad`.
unsafe impl Send for Place {}

/// One pinned layer read by the background load.
struct PinDone {
    layer: usize,
    /// Disk bytes read, or the first error of the layer.
    result: Result<u64, StreamError>,
    at: Instant,
    /// A page-cache layer that could not be locked in RAM: why (the layer is served anyway).
    lock_error: Option<String>,
}

/// The pinned prefix loading in the background (`TrunkOptions::background_pinned`).
///
/// Soundness of the shared buffers: the trunk allocates every pinned buffer and keeps it in
/// `StreamedTrunk::loading`; the load thread writes each through a [`Place`] and never reads
/// or frees it. The trunk makes no reference into a buffer until the load has reported that
/// layer complete over `done` (the channel orders the writes before the reads), and then no
/// write touches it again. A layer reported failed may still have pieces in flight, so its
/// buffer moves to `StreamedTrunk::retired`, freed only after the thread has been joined (or
/// has ended: its channel disconnected). `StreamedTrunk`'s `Drop` cancels the load and joins
/// its thread before any buffer is freed.
struct PinLoad {
    done: mpsc::Receiver<PinDone>,
    cancel: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
    started: Instant,
    /// Layers not reported yet.
    outstanding: usize,
    /// The latest report's time.
    last: Instant,
    depth: usize,
}

/// What [`background_load`] reads, and with what.
struct LoadWork {
    pool: ReadPool,
    file: Arc<DirectFile>,
    manifest: Arc<TrunkManifest>,
    /// (layer, its buffer, the lead of its first byte).
    layers: Vec<(usize, Place, usize)>,
    /// Read size of raw layers.
    piece: usize,
    /// Page-cache layers (`TrunkOptions::pinned_page_cache`): every `Place` is a read-only
    /// mapping of the layer, populated piece by piece and locked once complete.
    page_cache: bool,
    /// The page-cache mappings are advised `MADV_HUGEPAGE` (see [`populate_read`]).
    huge: bool,
    /// Buffers (address, length) a helper populates ahead of the reads: the ones in fresh
    /// anonymous memory. Not those on the reserved huge-page pool: the host keeps those backed,
    /// so a reader's own fault only zeroes its page, and a helper faulting the same pages
    /// competes with the readers (pinned load on the pool with / without it, 8 alternating
    /// runs twice: 1.76 / 1.65 s and 1.84 / 1.75 s; docs/history/PERFORMANCE-LOG.md §8.6).
    populate: Vec<(usize, usize)>,
}

/// The load's thread: every piece (raw) or record (compressed) of the layers, in file order,
/// at the depth of the pool, each layer reported on `tx` once all its reads landed (or at its
/// first error). Fresh anonymous pages are zeroed by the kernel when first touched, and an
/// O_DIRECT read faults its target pages in before the device is asked, so the readers would
/// stall on zeroing: a helper populates the buffers ahead of the reads (MADV_POPULATE_WRITE
/// allocates and zeroes pages not yet present and never changes a page that is; a reader that
/// overtakes it faults its own pages).
fn background_load(work: LoadWork, cancel: Arc<AtomicBool>, tx: mpsc::Sender<PinDone>) {
    let LoadWork {
        pool,
        file,
        manifest,
        layers,
        piece,
        page_cache,
        huge,
        populate: regions,
    } = work;
    // Build the jobs of every layer: (layer slot k, job).
    enum Job<'a> {
        Raw {
            offset: u64,
            len: usize,
            buf: &'a mut [u8],
        },
        Chunk(compress::ChunkJob<'a>),
        /// A piece of a page-cache layer's mapping: (address, length).
        Populate(usize, usize),
    }
    let align = file.offset_align();
    let mut jobs: Vec<(usize, Job<'_>)> = Vec::new();
    let mut disk = vec![0u64; layers.len()];
    let mut failed_early: Vec<Option<StreamError>> = (0..layers.len()).map(|_| None).collect();
    for (k, (l, place, lead)) in layers.iter().enumerate() {
        let pl = &manifest.layers[*l];
        if page_cache {
            // Read-only mappings: never written, so no `&mut` is made of them.
            let (addr, len) = (place.ptr as usize, place.len);
            disk[k] = uncached_bytes(addr, len);
            for start in (0..len).step_by(piece.max(1)) {
                jobs.push((k, Job::Populate(addr + start, (len - start).min(piece))));
            }
            continue;
        }
        // SAFETY: see `PinLoad`: the buffer is live until this thread has been joined and
        // nothing else references it until layer `l` is reported.
        let buf: &mut [u8] = unsafe { std::slice::from_raw_parts_mut(place.ptr, place.len) };
        match (&manifest.compression, &pl.stored) {
            (Some(c), Some(stored)) => {
                let lr = compress::LayerRead {
                    layer: *l,
                    offset: pl.offset,
                    size: pl.size,
                    stored,
                    dst: buf,
                };
                match compress::chunk_jobs(c.chunk_bytes, lr) {
                    Ok(js) => {
                        for j in js {
                            disk[k] += j.disk_bytes(&file);
                            jobs.push((k, Job::Chunk(j)));
                        }
                    }
                    Err(e) => failed_early[k] = Some(e),
                }
            }
            (Some(_), None) => {
                failed_early[k] = Some(StreamError::Invalid(format!(
                    "packed trunk layer {l} has no stored records"
                )));
            }
            (None, _) => {
                let size = pl.size as usize;
                if *lead == 0 && piece.is_multiple_of(align) {
                    for (i, dst) in buf.chunks_mut(piece).enumerate() {
                        let start = i * piece;
                        if start >= size {
                            break;
                        }
                        let len = (size - start).min(piece);
                        disk[k] += file.span(pl.offset + start as u64, len).len as u64;
                        jobs.push((
                            k,
                            Job::Raw {
                                offset: pl.offset + start as u64,
                                len,
                                buf: dst,
                            },
                        ));
                    }
                } else {
                    disk[k] += file.span(pl.offset, size).len as u64;
                    jobs.push((
                        k,
                        Job::Raw {
                            offset: pl.offset,
                            len: size,
                            buf,
                        },
                    ));
                }
            }
        }
    }
    let places: Vec<(usize, usize)> = layers
        .iter()
        .map(|(_, p, _)| (p.ptr as usize, p.len))
        .collect();
    let remaining: Vec<AtomicUsize> = (0..layers.len()).map(|_| AtomicUsize::new(0)).collect();
    for (k, _) in &jobs {
        remaining[*k].fetch_add(1, Ordering::Relaxed);
    }
    let failed: Vec<AtomicBool> = (0..layers.len()).map(|_| AtomicBool::new(false)).collect();
    for (k, e) in failed_early.into_iter().enumerate() {
        if let Some(e) = e {
            failed[k].store(true, Ordering::Relaxed);
            let _ = tx.send(PinDone {
                layer: layers[k].0,
                result: Err(e),
                at: Instant::now(),
                lock_error: None,
            });
        }
    }
    let (file, tx, cancel) = (&*file, &tx, &*cancel);
    let ids: Vec<usize> = layers.iter().map(|(l, _, _)| *l).collect();
    let (remaining, failed, disk, ids, places) = (&remaining, &failed, &disk, &ids, &places);
    std::thread::scope(|sc| {
        if !regions.is_empty() {
            let regions = &regions;
            let _ = std::thread::Builder::new()
                .name("k3-pin-populate".to_string())
                .spawn_scoped(sc, move || {
                    super::aligned::populate_ahead_while(regions, || {
                        !cancel.load(Ordering::Relaxed)
                    })
                });
        }
        let tasks: Vec<Box<dyn FnOnce() + Send + '_>> = jobs
            .into_iter()
            .map(|(k, job)| {
                Box::new(move || {
                    if cancel.load(Ordering::Relaxed) || failed[k].load(Ordering::Relaxed) {
                        return;
                    }
                    let r = match job {
                        Job::Raw { offset, len, buf } => {
                            file.read_into(offset, len, buf).and_then(|lead| {
                                if lead == 0 {
                                    Ok(())
                                } else {
                                    Err(StreamError::Invalid(format!(
                                        "pinned layer {}: a piece at byte {offset} is not aligned",
                                        ids[k]
                                    )))
                                }
                            })
                        }
                        Job::Chunk(j) => j.run(file),
                        Job::Populate(addr, len) => {
                            populate_read(addr, len, huge).map_err(|e| populate_error(file, e))
                        }
                    };
                    match r {
                        Ok(()) => {
                            if remaining[k].fetch_sub(1, Ordering::AcqRel) == 1 {
                                let lock_error = if page_cache {
                                    keep_mapped(places[k].0, places[k].1)
                                } else {
                                    None
                                };
                                let _ = tx.send(PinDone {
                                    layer: ids[k],
                                    result: Ok(disk[k]),
                                    at: Instant::now(),
                                    lock_error,
                                });
                            }
                        }
                        Err(e) => {
                            if !failed[k].swap(true, Ordering::AcqRel) {
                                let _ = tx.send(PinDone {
                                    layer: ids[k],
                                    result: Err(e),
                                    at: Instant::now(),
                                    lock_error: None,
                                });
                            }
                        }
                    }
                }) as Box<dyn FnOnce() + Send + '_>
            })
            .collect();
        pool.run_tasks(tasks);
    });
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

    /// Start loading the pinned prefix on background threads (see [`PinLoad`]).
    fn start_background_load(&mut self) -> Result<(), StreamError> {
        let piece = if self.page_cache {
            READ_PIECE
        } else {
            PINNED_BACKGROUND_PIECE
        };
        self.background = self.start_load(piece, true)?;
        Ok(())
    }

    /// Allocate every pinned buffer not loaded yet and start [`background_load`] on its own
    /// thread, raw layers in `piece`-byte reads; false when nothing is left to load.
    fn start_load(&mut self, piece: usize, background: bool) -> Result<bool, StreamError> {
        let todo: Vec<usize> = (0..self.plan.pinned_layers)
            .filter(|&l| self.pinned[l].is_none() && self.loading[l].is_none())
            .collect();
        if todo.is_empty() {
            return Ok(false);
        }
        let started = Instant::now();
        let mut layers = Vec::with_capacity(todo.len());
        let mut populate = Vec::new();
        for &l in &todo {
            let pl = &self.manifest.layers[l];
            if self.page_cache {
                let map = self.map_layer(l)?;
                layers.push((
                    l,
                    Place {
                        ptr: map.as_ptr().cast_mut(),
                        len: map.len(),
                    },
                    0,
                ));
                self.loading[l] = Some(Pinned::Mapped(map));
                continue;
            }
            let span = self.file.span(pl.offset, pl.size as usize);
            let mut b = AlignedBuf::new_from(span.len, self.pages).map_err(|e| {
                StreamError::Invalid(format!(
                    "cannot allocate the pinned buffer of layer {l} ({}): {e}",
                    fmt_bytes(pl.size)
                ))
            })?;
            self.huge_pages |= b.huge_pages();
            if b.hugetlb() {
                self.stats.hugetlb_bytes += b.capacity() as u64;
            }
            // A compressed layer lands at 0 (records are decoded in place).
            let lead = if self.manifest.compression.is_some() {
                0
            } else {
                span.lead
            };
            let on_pool = b.hugetlb();
            let full = b.full_mut();
            if !on_pool {
                populate.push((full.as_mut_ptr() as usize, full.len()));
            }
            layers.push((
                l,
                Place {
                    ptr: full.as_mut_ptr(),
                    len: full.len(),
                },
                lead,
            ));
            self.loading[l] = Some(Pinned::Buf(Loaded { buf: b, lead }));
        }
        let depth = if self.page_cache && background {
            PAGE_CACHE_BACKGROUND_DEPTH
        } else {
            self.pool.depth().max(PINNED_LOAD_DEPTH)
        };
        let work = LoadWork {
            pool: ReadPool::new(depth)?,
            file: Arc::clone(&self.file),
            manifest: Arc::clone(&self.manifest),
            layers,
            piece,
            page_cache: self.page_cache,
            huge: self.page_cache_huge,
            populate: if std::env::var_os("K3_NO_PIN_POPULATE").is_none() {
                populate
            } else {
                Vec::new()
            },
        };
        let (tx, rx) = mpsc::channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let c = Arc::clone(&cancel);
        let handle = std::thread::Builder::new()
            .name("k3-pin-load".to_string())
            .spawn(move || background_load(work, c, tx))
            .map_err(|e| {
                StreamError::Invalid(format!("cannot start the pinned-load thread: {e}"))
            })?;
        self.pinned_load_depth = depth;
        self.bg = Some(PinLoad {
            done: rx,
            cancel,
            handle: Some(handle),
            started,
            outstanding: todo.len(),
            last: started,
            depth,
        });
        Ok(true)
    }

    /// Take one report of the background load.
    fn take_pin_done(&mut self, d: PinDone) {
        let Some(bg) = &mut self.bg else {
            return;
        };
        bg.outstanding = bg.outstanding.saturating_sub(1);
        bg.last = bg.last.max(d.at);
        let loaded = self.loading[d.layer].take();
        if let Some(e) = d.lock_error {
            self.stats.pinned_unlocked_bytes += self.manifest.layers[d.layer].size;
            self.lock_error.get_or_insert(e);
        }
        match d.result {
            Ok(bytes) => {
                self.pinned[d.layer] = loaded;
                self.stats.bytes_read += bytes;
            }
            Err(e) => {
                // Other pieces of this layer may still be in flight: the buffer is freed only
                // after the load thread has been joined.
                self.retired.extend(loaded);
                self.pin_errors[d.layer] = Some(e);
            }
        }
        if bg.outstanding == 0 {
            let secs = (bg.last - bg.started).as_secs_f64();
            self.pinned_load_seconds += secs;
            self.stats.read_seconds += secs;
            if let Some(h) = bg.handle.take() {
                let _ = h.join();
            }
            self.bg = None;
            self.retired.clear();
        }
    }

    /// Take every report the background load has sent, without waiting.
    fn poll_background(&mut self) {
        while let Some(d) = self.bg.as_ref().and_then(|bg| bg.done.try_recv().ok()) {
            self.take_pin_done(d);
        }
    }

    /// Wait until the background load has reported pinned layer `layer`.
    fn wait_pinned(&mut self, layer: usize) -> Result<(), WeightError> {
        self.poll_background();
        let t0 = Instant::now();
        while self.pinned[layer].is_none() && self.pin_errors[layer].is_none() {
            let Some(bg) = &self.bg else {
                break;
            };
            match bg.done.recv() {
                Ok(d) => self.take_pin_done(d),
                Err(_) => {
                    // The load thread ended (every sender is gone, so no task runs) without
                    // reporting this layer: a task panicked.
                    self.bg = None;
                    self.retired.clear();
                    self.loading[layer] = None;
                    return Err(WeightError::Invalid {
                        name: format!("trunk layer {layer}"),
                        msg: "the background load of the pinned prefix stopped before this                               layer was read (a reader thread failed)"
                            .to_string(),
                    });
                }
            }
        }
        let waited = t0.elapsed().as_secs_f64();
        self.pinned_wait_seconds += waited;
        self.stats.wait_seconds += waited;
        if let Some(e) = self.pin_errors[layer].take() {
            return Err(weight_err(layer, e));
        }
        Ok(())
    }

    /// Load every pinned layer not loaded yet, in parallel pieces (the background load's
    /// machinery, waited for here); returns the seconds taken.
    pub fn load_pinned(&mut self) -> Result<f64, StreamError> {
        let t0 = Instant::now();
        let before = self.pinned_load_seconds;
        self.start_load(READ_PIECE, false)?;
        while let Some(bg) = &self.bg {
            match bg.done.recv() {
                Ok(d) => self.take_pin_done(d),
                Err(_) => {
                    self.bg = None;
                    self.retired.clear();
                    return Err(StreamError::Invalid(
                        "the pinned-prefix load stopped before every layer was read (a reader \
                         thread failed)"
                            .to_string(),
                    ));
                }
            }
        }
        self.stats.wait_seconds += t0.elapsed().as_secs_f64();
        if let Some(e) = self.pin_errors.iter_mut().find_map(Option::take) {
            return Err(e);
        }
        Ok(self.pinned_load_seconds - before)
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

    fn check_layer(&self, layer: usize) -> Result<(), WeightError> {
        if layer >= self.pinned.len() {
            return Err(WeightError::Invalid {
                name: format!("trunk layer {layer}"),
                msg: format!(
                    "out of range: the packed trunk {} serves layers 0..{}",
                    self.dir.display(),
                    self.pinned.len()
                ),
            });
        }
        Ok(())
    }

    fn read_sync(&mut self, layer: usize) -> Result<(), WeightError> {
        let Ring::Sync { slot, holds } = &mut self.ring else {
            return Ok(());
        };
        if matches!(holds, Some((l, _)) if *l == layer) {
            return Ok(());
        }
        *holds = None;
        let t0 = Instant::now();
        let (lead, bytes) = read_packed(
            &self.pool,
            &self.file,
            &self.manifest,
            layer,
            slot.full_mut(),
        )
        .map_err(|e| weight_err(layer, e))?;
        let secs = t0.elapsed().as_secs_f64();
        *holds = Some((layer, lead));
        self.stats.bytes_read += bytes;
        self.stats.read_seconds += secs;
        self.stats.wait_seconds += secs;
        Ok(())
    }

    /// Start the reader thread (only ever called with >= 2 ring slots).
    fn start_reader(&mut self) -> Result<(), WeightError> {
        let Ring::Prefetch(p) = &mut self.ring else {
            return Ok(());
        };
        if p.jobs.is_some() {
            return Ok(());
        }
        let (jobs_tx, jobs_rx) = mpsc::channel::<ReadJob>();
        let (done_tx, done_rx) = mpsc::channel::<ReadDone>();
        let file = Arc::clone(&self.file);
        let pool = Arc::clone(&self.pool);
        let manifest = Arc::clone(&self.manifest);
        let handle = std::thread::Builder::new()
            .name("k3-trunk-reader".to_string())
            .spawn(move || {
                for mut job in jobs_rx {
                    let t0 = Instant::now();
                    let read = read_packed(&pool, &file, &manifest, job.layer, job.buf.full_mut());
                    let bytes = read.as_ref().map_or(0, |&(_, b)| b);
                    let done = ReadDone {
                        layer: job.layer,
                        buf: job.buf,
                        result: read.map(|(lead, _)| lead),
                        seconds: t0.elapsed().as_secs_f64(),
                        bytes,
                    };
                    if done_tx.send(done).is_err() {
                        break;
                    }
                }
            })
            .map_err(|e| WeightError::Invalid {
                name: "packed trunk reader thread".to_string(),
                msg: format!("cannot start: {e}"),
            })?;
        p.jobs = Some(jobs_tx);
        p.done = done_rx;
        p.handle = Some(handle);
        self.reader_threads_spawned += 1;
        self.stats.reader_thread = true;
        Ok(())
    }

    /// Issue reads for the next streamed layers into every free slot (`asked`: the layer the
    /// executor is waiting for, whose read is not a read ahead).
    fn top_up(&mut self, asked: usize) -> Result<(), WeightError> {
        let Ring::Prefetch(p) = &mut self.ring else {
            return Ok(());
        };
        let Some(jobs) = &p.jobs else {
            return Ok(());
        };
        loop {
            let layer = self.streamed[p.cursor];
            let pl = &self.manifest.layers[layer];
            let Some(buf) = p
                .slots
                .take(self.file.span(pl.offset, pl.size as usize).len)
            else {
                break;
            };
            p.cursor = (p.cursor + 1) % self.streamed.len();
            let job = ReadJob { layer, buf };
            if let Err(mpsc::SendError(job)) = jobs.send(job) {
                p.slots.give_back(job.buf);
                return Err(WeightError::Invalid {
                    name: "packed trunk reader thread".to_string(),
                    msg: "stopped unexpectedly".to_string(),
                });
            }
            p.in_flight.push_back(layer);
            if layer != asked {
                self.reads_ahead += 1;
            }
        }
        Ok(())
    }

    /// Receive one finished read (blocking), accounting the wait.
    fn recv_one(&mut self) -> Result<ReadDone, WeightError> {
        let Ring::Prefetch(p) = &mut self.ring else {
            return Err(WeightError::Invalid {
                name: "packed trunk".to_string(),
                msg: "no reader ring".to_string(),
            });
        };
        if p.in_flight.is_empty() {
            return Err(WeightError::Invalid {
                name: "packed trunk".to_string(),
                msg: "no read in flight for the requested layer (internal error: the ring \
                      could not place it)"
                    .to_string(),
            });
        }
        let t0 = Instant::now();
        let done = p.done.recv().map_err(|_| WeightError::Invalid {
            name: "packed trunk reader thread".to_string(),
            msg: "stopped unexpectedly".to_string(),
        })?;
        self.stats.wait_seconds += t0.elapsed().as_secs_f64();
        self.stats.read_seconds += done.seconds;
        self.stats.bytes_read += done.bytes;
        p.in_flight.pop_front();
        Ok(done)
    }

    fn read_prefetched(&mut self, layer: usize) -> Result<(), WeightError> {
        self.start_reader()?;
        self.top_up(layer)?;
        let front = match &self.ring {
            Ring::Prefetch(p) => p.in_flight.front().copied(),
            _ => None,
        };
        if front != Some(layer) {
            // Out of the cyclic order: drain, restart the sequence at `layer`.
            self.out_of_order += 1;
            loop {
                let pending = match &self.ring {
                    Ring::Prefetch(p) => !p.in_flight.is_empty(),
                    _ => false,
                };
                if !pending {
                    break;
                }
                let d = self.recv_one()?;
                if let Ring::Prefetch(p) = &mut self.ring {
                    p.slots.give_back(d.buf);
                }
            }
            let pos = self
                .streamed
                .iter()
                .position(|&l| l == layer)
                .ok_or_else(|| WeightError::Invalid {
                    name: format!("trunk layer {layer}"),
                    msg: "not a streamed layer".to_string(),
                })?;
            if let Ring::Prefetch(p) = &mut self.ring {
                p.cursor = pos;
            }
            self.top_up(layer)?;
        }
        let d = self.recv_one()?;
        let Ring::Prefetch(p) = &mut self.ring else {
            return Ok(());
        };
        if d.layer != layer {
            p.slots.give_back(d.buf);
            return Err(WeightError::Invalid {
                name: format!("trunk layer {layer}"),
                msg: format!("reader delivered layer {} instead", d.layer),
            });
        }
        match d.result {
            Ok(lead) => {
                p.current = Some((layer, Loaded { buf: d.buf, lead }));
                Ok(())
            }
            Err(e) => {
                p.slots.give_back(d.buf);
                Err(weight_err(layer, e))
            }
        }
    }

    /// Pinned layer `l`'s bytes of trunk.bin mapped for [`populate_read`].
    fn map_layer(&self, l: usize) -> Result<memmap2::Mmap, StreamError> {
        let pl = &self.manifest.layers[l];
        map_pinned(
            &self.file,
            pl.offset,
            pl.size as usize,
            self.page_cache_huge,
        )
    }

    /// A pinned layer loaded on first use since `t0`, `bytes` of it from disk.
    fn count_pinned_load(&mut self, t0: Instant, bytes: u64) {
        let secs = t0.elapsed().as_secs_f64();
        self.pinned_load_seconds += secs;
        self.stats.bytes_read += bytes;
        self.stats.read_seconds += secs;
        self.stats.wait_seconds += secs;
    }

    /// Per pinned layer, its bytes not in the page cache now.
    fn uncached_pinned_layers(&self) -> Result<Vec<u64>, WeightError> {
        (0..self.plan.pinned_layers)
            .map(|l| {
                let pl = &self.manifest.layers[l];
                let map = map_range(&self.file, pl.offset, pl.size as usize)
                    .map_err(|e| weight_err(l, e))?;
                Ok(uncached_bytes(map.as_ptr() as usize, map.len()))
            })
            .collect()
    }

    fn load_pinned_one(&mut self, layer: usize) -> Result<(), WeightError> {
        if self.pinned[layer].is_some() {
            return Ok(());
        }
        let pl = &self.manifest.layers[layer];
        let t0 = Instant::now();
        if self.page_cache {
            let map = self.map_layer(layer).map_err(|e| weight_err(layer, e))?;
            // Taken for every pinned layer at the first one: a fault's read window reaches
            // into the layers after it, which would then count as cached.
            if self.lazy_uncached.is_empty() {
                self.lazy_uncached = self.uncached_pinned_layers()?;
            }
            let bytes = self.lazy_uncached[layer];
            populate_read(map.as_ptr() as usize, map.len(), self.page_cache_huge)
                .map_err(|e| weight_err(layer, populate_error(&self.file, e)))?;
            if let Some(e) = keep_mapped(map.as_ptr() as usize, map.len()) {
                self.stats.pinned_unlocked_bytes += pl.size;
                self.lock_error.get_or_insert(e);
            }
            self.count_pinned_load(t0, bytes);
            self.pinned[layer] = Some(Pinned::Mapped(map));
            return Ok(());
        }
        let span = self.file.span(pl.offset, pl.size as usize);
        let mut buf =
            AlignedBuf::new_from(span.len, self.pages).map_err(|e| WeightError::Invalid {
                name: format!("trunk layer {layer}"),
                msg: format!("cannot allocate the pinned buffer: {e}"),
            })?;
        self.huge_pages |= buf.huge_pages();
        if buf.hugetlb() {
            self.stats.hugetlb_bytes += buf.capacity() as u64;
        }
        let (lead, bytes) = read_packed(
            &self.pool,
            &self.file,
            &self.manifest,
            layer,
            buf.full_mut(),
        )
        .map_err(|e| weight_err(layer, e))?;
        self.count_pinned_load(t0, bytes);
        self.pinned[layer] = Some(Pinned::Buf(Loaded { buf, lead }));
        Ok(())
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

/// The page-cache comparison policy (`configs/io/mmap.toml`): trunk.bin mapped read-only,
/// every layer served from the mapping; the kernel decides what stays in RAM.
pub struct MmapTrunk {
    manifest: TrunkManifest,
    decls: Vec<Vec<(TensorDecl, usize)>>,
    map: memmap2::Mmap,
    stats: TrunkStats,
}

impl std::fmt::Debug for MmapTrunk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MmapTrunk")
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl MmapTrunk {
    pub fn open(dir: &Path, spec: &ModelSpec) -> Result<Self, StreamError> {
        let manifest = TrunkManifest::load(dir, spec)?;
        let path = dir.join(TRUNK_BIN);
        if manifest.is_compressed() {
            // A setting that cannot work with this trunk: a usage error (exit 2).
            return Err(StreamError::Config(format!(
                "packed trunk {} is compressed (pack-trunk --compress): its layers cannot be \
                 served from a mapping; use the direct I/O policy (the default) or pack without \
                 --compress",
                dir.display()
            )));
        }
        let f = std::fs::File::open(&path).map_err(|e| StreamError::io("open", &path, e))?;
        // SAFETY: read-only private mapping; trunk.bin is not modified while a run uses it
        // (pack-trunk writes a new file and renames it over, which keeps this inode intact).
        let map =
            unsafe { memmap2::Mmap::map(&f) }.map_err(|e| StreamError::io("mmap", &path, e))?;
        if (map.len() as u64) < manifest.file_bytes {
            return Err(StreamError::Trunk {
                path: path.display().to_string(),
                msg: format!(
                    "mapped {} bytes, expected {}",
                    map.len(),
                    manifest.file_bytes
                ),
            });
        }
        let decls = layer_decls(spec, &manifest);
        let stats = TrunkStats {
            n_layers: manifest.n_layers,
            ..TrunkStats::default()
        };
        Ok(Self {
            manifest,
            decls,
            map,
            stats,
        })
    }

    pub fn startup_lines(&self) -> Vec<String> {
        vec![
            format!(
                "trunk mmap: {} packed, mapped through the page cache (I/O policy mmap: no \
                 pinned prefix, no ring slots, no O_DIRECT)",
                fmt_bytes(self.manifest.packed_bytes)
            ),
            "trunk bytes_read counts bytes served from the mapping (page faults are not timed)"
                .to_string(),
        ]
    }
}

impl TrunkSource for MmapTrunk {
    fn layer(&mut self, layer: usize) -> Result<LayerWeights<'_>, WeightError> {
        let pl = self
            .manifest
            .layers
            .get(layer)
            .ok_or_else(|| WeightError::Invalid {
                name: format!("trunk layer {layer}"),
                msg: format!("out of range (0..{})", self.manifest.n_layers),
            })?;
        let start = pl.offset as usize;
        let bytes = &self.map[start..start + pl.size as usize];
        self.stats.bytes_read += pl.size;
        Ok(view(&self.decls[layer], bytes))
    }

    fn stats(&self) -> TrunkStats {
        self.stats.clone()
    }
}
