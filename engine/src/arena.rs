//! Resident weight arena: a checkpoint's tensor bytes loaded once into 2 MiB-page anonymous
//! memory.
//!
//! Owns: laying out a set of declared tensors in one [`AlignedBuf`] (huge-page advised), reading
//! them from the shards with positional reads (O_DIRECT where the filesystem allows it, in
//! 8 MiB pieces on the [`ReadPool`], with a progress bar for long loads), and handing back each
//! tensor's bytes. Every tensor keeps its file offset modulo 4096 inside the arena, so its
//! address alignment is the same as through the checkpoint's memory map.
//! Must not: convert, reorder or check weight values (the bytes are the file's bytes; the
//! checkpoint validated them at open), keep a page-cache copy alive (direct reads bypass the
//! page cache; a buffered fallback drops what it read with `POSIX_FADV_DONTNEED`), or decide
//! what is resident (the session does).
//! Follows upstream: docs/DESIGN.md §3 (2 MB pages, O_DIRECT) applied to the resident path: the
//! executor's matvecs stream the weights once per token, and on 4 KiB-page file mappings they
//! pay a TLB miss and a prefetcher restart every 4 KiB.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use k3_models::spec::TensorDecl;

use crate::checkpoint::Checkpoint;
use crate::stream::StreamError;
use crate::stream::aligned::{AlignedBuf, HUGE_PAGE, IO_ALIGN, align_down, align_up};
use crate::stream::direct::{DirectFile, ReadPool, ReadReq};

/// Size of one positional read (pieces of an extent are read in parallel).
pub const PIECE_BYTES: usize = 8 << 20;
/// Tensors of one shard whose gap is at most this are read as one extent (the gap too).
pub const MERGE_GAP: u64 = 1 << 20;
/// Loads smaller than this show no progress bar.
const PROGRESS_MIN_BYTES: u64 = 64 << 20;

/// How the arena is filled.
#[derive(Clone, Debug)]
pub struct ArenaOptions {
    /// Open the shards with O_DIRECT (falls back to buffered reads, reported).
    pub o_direct: bool,
    /// Advise 2 MiB transparent huge pages for the arena.
    pub huge_pages: bool,
    /// With `huge_pages`: where the arena's pages come from (the reserved pool when it has
    /// room for the whole arena, I/O policy `reserved_huge_pages`).
    pub pages: crate::stream::aligned::PageSource,
    /// Reads in flight.
    pub read_threads: usize,
    /// Draw a progress bar on stderr (only when it is a terminal and the load is large).
    pub progress: bool,
}

impl Default for ArenaOptions {
    fn default() -> Self {
        ArenaOptions {
            o_direct: true,
            huge_pages: true,
            pages: crate::stream::aligned::PageSource::Anonymous,
            read_threads: 8,
            progress: true,
        }
    }
}

/// What a load did, for the start-up line.
#[derive(Clone, Debug, Default)]
pub struct ArenaStats {
    pub n_tensors: usize,
    /// Sum of the tensors' own bytes.
    pub tensor_bytes: u64,
    /// Arena size (tensors + alignment padding + small merged gaps).
    pub arena_bytes: u64,
    /// Bytes read from the shards.
    pub bytes_read: u64,
    pub extents: usize,
    pub seconds: f64,
    /// Whether `madvise(MADV_HUGEPAGE)` was accepted (or the pages are the reserved pool's).
    pub huge_pages: bool,
    /// The arena is on the reserved huge-page pool (not in the peak RSS getrusage reports).
    pub hugetlb: bool,
    /// Every shard was read with O_DIRECT.
    pub o_direct: bool,
    /// Why some reads were buffered, if they were.
    pub fallback: Option<String>,
}

/// Tensor bytes resident in anonymous memory.
#[derive(Debug)]
pub struct Arena {
    buf: AlignedBuf,
    /// Per requested tensor, in request order: (offset in `buf`, length).
    spans: Vec<(usize, usize)>,
    stats: ArenaStats,
}

/// One tensor's place on disk and in the request list.
struct Want {
    index: usize,
    offset: u64,
    len: u64,
}

/// A run of tensors of one shard read with one (split) read.
struct Extent {
    shard: usize,
    /// Aligned file range `start..end` (end may pass the end of the file; reads are clamped).
    start: u64,
    end: u64,
    /// Offset of `start` in the arena.
    at: usize,
    /// The first tensor (request index) of the extent, for error messages.
    first: usize,
}

impl Arena {
    /// Load `decls` (any order; each must be in `ckpt`) into one arena. Tensor `i` of the
    /// result is `decls[i]`.
    pub fn load(
        ckpt: &Checkpoint,
        decls: &[&TensorDecl],
        opts: &ArenaOptions,
    ) -> Result<Arena, StreamError> {
        let t0 = Instant::now();
        // Group by shard, in file order.
        let mut by_shard: BTreeMap<PathBuf, Vec<Want>> = BTreeMap::new();
        for (index, d) in decls.iter().enumerate() {
            let loc = ckpt.locate(&d.name).map_err(StreamError::Invalid)?;
            by_shard.entry(loc.shard_path).or_default().push(Want {
                index,
                offset: loc.file_offset,
                len: loc.n_bytes,
            });
        }
        let mut files = Vec::with_capacity(by_shard.len());
        let mut extents: Vec<Extent> = Vec::new();
        let mut spans = vec![(0usize, 0usize); decls.len()];
        let mut at = 0usize;
        for (path, mut wants) in by_shard {
            let file = DirectFile::open(&path, opts.o_direct)?;
            let align = file.offset_align().max(IO_ALIGN) as u64;
            let shard = files.len();
            wants.sort_by_key(|w| (w.offset, w.len));
            let mut cur: Option<Extent> = None;
            for w in &wants {
                let (s, e) = (
                    align_down(w.offset, align),
                    align_up(w.offset + w.len, align),
                );
                match &mut cur {
                    Some(x) if s <= x.end + MERGE_GAP => x.end = x.end.max(e),
                    _ => {
                        if let Some(x) = cur.take() {
                            at = x.at + usize_of(x.end - x.start, &path)?;
                            extents.push(x);
                        }
                        cur = Some(Extent {
                            shard,
                            start: s,
                            end: e,
                            at: usize_of(align_up(at as u64, align), &path)?,
                            first: w.index,
                        });
                    }
                }
                let x = cur
                    .as_ref()
                    .expect("invariant: an extent was just opened or extended");
                spans[w.index] = (
                    x.at + usize_of(w.offset - x.start, &path)?,
                    usize_of(w.len, &path)?,
                );
            }
            if let Some(x) = cur.take() {
                at = x.at + usize_of(x.end - x.start, &path)?;
                extents.push(x);
            }
            files.push(file);
        }
        let align = if opts.huge_pages { HUGE_PAGE } else { IO_ALIGN };
        let mut buf = AlignedBuf::with_align_from(at, align, opts.pages).map_err(|e| {
            StreamError::Invalid(format!(
                "cannot allocate {} for the resident weights of {}: {e}",
                crate::stream::fmt_bytes(at as u64),
                ckpt.dir().display()
            ))
        })?;
        let bytes_read = read_extents(&files, &extents, &mut buf, opts, decls)?;
        let mut fallback = None;
        for (shard, f) in files.iter().enumerate() {
            if !f.is_direct() {
                drop_cached(f.path(), &extents, shard);
                if fallback.is_none() {
                    fallback = f.fallback_reason();
                }
            }
        }
        let stats = ArenaStats {
            n_tensors: decls.len(),
            tensor_bytes: spans.iter().map(|&(_, l)| l as u64).sum(),
            arena_bytes: at as u64,
            bytes_read,
            extents: extents.len(),
            seconds: t0.elapsed().as_secs_f64(),
            huge_pages: buf.huge_pages(),
            hugetlb: buf.hugetlb(),
            o_direct: files.iter().all(DirectFile::is_direct),
            fallback,
        };
        Ok(Arena { buf, spans, stats })
    }

    /// The bytes of tensor `i` (the `i`-th declaration given to [`Arena::load`]).
    ///
    /// Panics if `i` is out of range (a programming error: indices come from the load order).
    pub fn bytes(&self, i: usize) -> &[u8] {
        let (at, len) = self.spans[i];
        &self.buf.as_slice()[at..at + len]
    }

    /// Number of tensors held.
    pub fn len(&self) -> usize {
        self.spans.len()
    }

    pub fn is_empty(&self) -> bool {
        self.spans.is_empty()
    }

    pub fn stats(&self) -> &ArenaStats {
        &self.stats
    }

    /// One start-up line describing the load.
    pub fn startup_line(&self) -> String {
        let s = &self.stats;
        let rate = if s.seconds > 0.0 {
            s.bytes_read as f64 / s.seconds / 1e6
        } else {
            0.0
        };
        let mut line = format!(
            "resident weights: {} tensors, {} in {} ({}) loaded in {:.2} s ({rate:.0} MB/s, {})",
            s.n_tensors,
            crate::stream::fmt_bytes(s.tensor_bytes),
            if s.hugetlb {
                "2 MiB pages of the reserved vm.nr_hugepages pool, not in the peak RSS"
            } else if s.huge_pages {
                "2 MiB-page anonymous memory"
            } else {
                "anonymous memory, 4 KiB pages"
            },
            crate::stream::fmt_bytes(s.arena_bytes),
            s.seconds,
            if s.o_direct {
                "O_DIRECT"
            } else {
                "buffered, page cache dropped after the copy"
            }
        );
        if let Some(f) = &s.fallback {
            line.push_str("; ");
            line.push_str(f);
        }
        line
    }
}

/// Drop this process's page-table mappings of every shard of `ckpt` (pages the checkpoint's
/// open-time checks touched through the memory maps, plus their fault-around neighbours: 1.3 GB
/// on k3-mini). The page cache keeps the pages (shared, reclaimable); a later access through
/// the maps faults them back in with the same bytes. Called before the arena is loaded, so the
/// process does not hold the resident bytes twice. Returns the bytes advised.
pub fn release_mapped_pages(ckpt: &Checkpoint) -> u64 {
    let mut done: Vec<&Path> = Vec::new();
    let mut advised = 0u64;
    for name in ckpt.tensor_names() {
        if done.len() == ckpt.shards().len() {
            break;
        }
        let (Some(loc), Some(bytes)) = (ckpt.try_location(name), ckpt.try_bytes(name)) else {
            continue;
        };
        let Some(shard) = ckpt.shards().iter().find(|s| s.path == loc.shard_path) else {
            continue;
        };
        if done.contains(&shard.path.as_path()) {
            continue;
        }
        done.push(&shard.path);
        // The shard is mapped whole from file offset 0, so the mapping starts `file_offset`
        // bytes before the tensor.
        let Some(base) = (bytes.as_ptr() as usize).checked_sub(loc.file_offset as usize) else {
            continue;
        };
        let Ok(len) = usize::try_from(shard.file_len) else {
            continue;
        };
        if base % IO_ALIGN != 0 || len == 0 {
            continue;
        }
        // SAFETY: `base..base+len` is the checkpoint's read-only mapping of this shard (a
        // memmap2 `Mmap` of the whole file, at least `file_len` bytes long, alive while `ckpt`
        // is borrowed). MADV_DONTNEED on a read-only file mapping only drops page-table
        // entries: the contents seen through any live reference are unchanged (the next
        // access faults the same file bytes back in).
        let r = unsafe {
            crate::platform::advise_memory(base, len, crate::platform::MemAdvice::DontNeed)
        };
        if r.is_ok() {
            advised += len as u64;
        }
    }
    advised
}

fn usize_of(n: u64, path: &Path) -> Result<usize, StreamError> {
    usize::try_from(n).map_err(|_| {
        StreamError::Invalid(format!(
            "{}: {n} bytes do not fit this platform's address space",
            path.display()
        ))
    })
}

/// One read of [`read_extents`]: `len` bytes at `offset` of shard `shard` into the arena at
/// `at` (`cap` = `len` rounded up to the I/O alignment).
struct Piece {
    extent: usize,
    shard: usize,
    offset: u64,
    len: usize,
    at: usize,
    cap: usize,
}

/// Read every extent into its place in `buf`, `PIECE_BYTES` at a time, a batch of pieces in
/// parallel. Returns the bytes read.
fn read_extents(
    files: &[DirectFile],
    extents: &[Extent],
    buf: &mut AlignedBuf,
    opts: &ArenaOptions,
    decls: &[&TensorDecl],
) -> Result<u64, StreamError> {
    // Pieces in arena order, each a disjoint &mut of the arena.
    let mut pieces = Vec::new();
    for (extent, x) in extents.iter().enumerate() {
        let file = &files[x.shard];
        let end = x.end.min(file.size());
        let mut off = x.start;
        while off < end {
            let len = (end - off).min(PIECE_BYTES as u64);
            let cap = align_up(len, file.offset_align().max(IO_ALIGN) as u64);
            pieces.push(Piece {
                extent,
                shard: x.shard,
                offset: off,
                len: usize_of(len, file.path())?,
                at: x.at + usize_of(off - x.start, file.path())?,
                cap: usize_of(cap, file.path())?,
            });
            off += len;
        }
    }
    let total: u64 = pieces.iter().map(|p| p.len as u64).sum();
    let bar = crate::bytes_bar(
        total,
        opts.progress && total >= PROGRESS_MIN_BYTES,
        "resident",
    );
    let pool = ReadPool::new(opts.read_threads)?;
    let region = (buf.full().as_ptr() as usize, buf.capacity());
    let mut reqs: Vec<ReadReq<'_>> = Vec::with_capacity(pieces.len());
    let mut rest: &mut [u8] = buf.full_mut();
    let mut pos = 0usize;
    for p in &pieces {
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(p.at - pos);
        let cap = p.cap.min(tail.len());
        let (mine, tail) = tail.split_at_mut(cap);
        rest = tail;
        pos = p.at + cap;
        reqs.push(ReadReq {
            file: &files[p.shard],
            offset: p.offset,
            len: p.len,
            buf: mine,
        });
    }
    let batch = (2 * pool.depth()).max(1);
    // Zero the fresh pages ahead of the reads on a helper thread (see
    // `stream::aligned::populate_ahead`): the readers would otherwise stall faulting them in.
    std::thread::scope(|sc| -> Result<(), StreamError> {
        if std::env::var_os("K3_NO_PIN_POPULATE").is_none() {
            let _ = std::thread::Builder::new()
                .name("k3-arena-populate".to_string())
                .spawn_scoped(sc, || crate::stream::aligned::populate_ahead(&[region]));
        }
        load_pieces(&pool, &mut reqs, &pieces, batch, &bar, decls, extents)
    })?;
    bar.finish_and_clear();
    Ok(total)
}

/// Read the pieces in batches of `batch`, checking every read landed where it was asked to.
fn load_pieces(
    pool: &ReadPool,
    reqs: &mut [ReadReq<'_>],
    pieces: &[Piece],
    batch: usize,
    bar: &indicatif::ProgressBar,
    decls: &[&TensorDecl],
    extents: &[Extent],
) -> Result<(), StreamError> {
    for (chunk, pcs) in reqs.chunks_mut(batch).zip(pieces.chunks(batch)) {
        let results = pool.read_all(chunk);
        for ((r, req), p) in results.into_iter().zip(chunk.iter()).zip(pcs) {
            let lead = r.map_err(|e| {
                StreamError::Invalid(format!(
                    "loading resident weights (the extent from tensor {} on): {e}",
                    decls[extents[p.extent].first].name
                ))
            })?;
            if lead != 0 {
                return Err(StreamError::Invalid(format!(
                    "loading resident weights from {}: a read at aligned offset {} started {lead} bytes late",
                    req.file.path().display(),
                    req.offset
                )));
            }
            bar.inc(req.len as u64);
        }
    }
    Ok(())
}

/// After buffered reads: ask the kernel to drop the page-cache pages of what was read, so the
/// arena does not leave a second copy behind.
fn drop_cached(path: &Path, extents: &[Extent], shard: usize) {
    let Ok(f) = std::fs::File::open(path) else {
        return;
    };
    for x in extents.iter().filter(|x| x.shard == shard) {
        // Advice only (absent on macOS and Windows: the cached copy stays until evicted).
        let _ = crate::platform::advise_file(
            &f,
            crate::platform::FileAdvice::DontNeed {
                offset: x.start,
                len: x.end - x.start,
            },
        );
    }
}
