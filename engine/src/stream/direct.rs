//! Direct (page-cache bypassing) positional reads, with a reported fallback, and a small pool
//! that issues many reads in parallel.
//!
//! Owns: opening a file with `O_DIRECT`, learning its alignment from `statx(STATX_DIOALIGN)`
//! (default 4096), rounding each requested `(offset, len)` out to that alignment, reading into
//! an aligned buffer and telling the caller where the requested bytes start. If the
//! filesystem refuses O_DIRECT (EINVAL at open or at a read), reads continue buffered and the
//! reason is kept for the start-up report. Also owns [`ReadPool`], a fixed set of threads that
//! runs a batch of positional reads at queue depth N.
//! Must not: decide what to read (the trunk and the expert store do), or cache anything.
//! Follows upstream: docs/DESIGN.md §3 (reads use O_DIRECT) and §4 (a layer's misses issued
//! together, in parallel); rust-deps.md Q4 (alignment, statx, the tmpfs pitfall: tests put
//! their files on disk) and Q9 (a pread thread pool is the portable path).

use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use super::StreamError;
use super::aligned::{AlignedBuf, IO_ALIGN, align_down, align_up};

/// Alignment requirements of direct I/O on one file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DioAlign {
    /// Required alignment of the user buffer address.
    pub mem: usize,
    /// Required alignment of the file offset and length.
    pub offset: usize,
    /// Whether the values came from `statx` (false: the 4096 default).
    pub from_statx: bool,
}

impl Default for DioAlign {
    fn default() -> Self {
        Self {
            mem: IO_ALIGN,
            offset: IO_ALIGN,
            from_statx: false,
        }
    }
}

/// Ask the kernel for the file's direct-I/O alignment (Linux >= 6.1). Falls back to 4096 when
/// the filesystem does not report it (e.g. tmpfs) or the call is unavailable.
pub fn dio_align(path: &Path) -> DioAlign {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_bytes()) else {
        return DioAlign::default();
    };
    // SAFETY: zeroed statx is a valid (if meaningless) value; the kernel fills it.
    let mut st: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a valid NUL-terminated path and `st` a valid out pointer.
    let rc = unsafe { libc::statx(libc::AT_FDCWD, c.as_ptr(), 0, libc::STATX_DIOALIGN, &mut st) };
    if rc != 0 || st.stx_mask & libc::STATX_DIOALIGN == 0 {
        return DioAlign::default();
    }
    let mem = st.stx_dio_mem_align as usize;
    let offset = st.stx_dio_offset_align as usize;
    if mem == 0 || offset == 0 || !mem.is_power_of_two() || !offset.is_power_of_two() {
        // 0 means "direct I/O not supported" for this file; keep the default and let the
        // probe read decide.
        return DioAlign::default();
    }
    DioAlign {
        mem,
        offset,
        from_statx: true,
    }
}

/// Where the requested bytes sit inside a rounded-out read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    /// Aligned file offset the read starts at.
    pub start: u64,
    /// Aligned length of the read.
    pub len: usize,
    /// Offset of the requested first byte inside the read.
    pub lead: usize,
}

/// A read-only file opened for direct I/O when possible.
#[derive(Debug)]
pub struct DirectFile {
    path: PathBuf,
    /// The O_DIRECT handle, if the open succeeded.
    direct: Option<File>,
    /// A buffered handle, always open (fallback and unaligned small reads).
    buffered: File,
    align: DioAlign,
    size: u64,
    direct_ok: AtomicBool,
    fallback: Mutex<Option<String>>,
}

impl DirectFile {
    /// Open `path` for reading; with `want_direct`, try O_DIRECT and probe one aligned read.
    /// A refusal (EINVAL at open or at the probe) is not an error: reads go buffered and
    /// [`fallback_reason`](Self::fallback_reason) says why.
    pub fn open(path: &Path, want_direct: bool) -> Result<Self, StreamError> {
        let buffered = File::open(path).map_err(|e| StreamError::io("open", path, e))?;
        let size = buffered
            .metadata()
            .map_err(|e| StreamError::io("stat", path, e))?
            .len();
        let align = dio_align(path);
        let mut fallback = None;
        let mut direct = None;
        if want_direct {
            match std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECT)
                .open(path)
            {
                Ok(f) => direct = Some(f),
                Err(e) => {
                    fallback = Some(format!(
                        "O_DIRECT open of {} refused ({e}); reads are buffered through the page cache",
                        path.display()
                    ))
                }
            }
        } else {
            fallback = Some("buffered reads requested by the I/O policy".to_string());
        }
        let this = Self {
            path: path.to_path_buf(),
            direct_ok: AtomicBool::new(direct.is_some()),
            direct,
            buffered,
            align,
            size,
            fallback: Mutex::new(fallback),
        };
        if this.is_direct() {
            this.probe();
        }
        Ok(this)
    }

    /// One aligned read at offset 0 so a filesystem that accepts O_DIRECT at open but refuses
    /// the reads is detected now, not in the middle of a token.
    fn probe(&self) {
        let Ok(mut buf) = AlignedBuf::with_align(self.align.offset.max(IO_ALIGN), IO_ALIGN) else {
            return;
        };
        let n = buf.capacity();
        if let Some(f) = &self.direct
            && let Err(e) = f.read_at(&mut buf.full_mut()[..n], 0)
        {
            self.disable_direct(format!(
                "O_DIRECT read of {} refused ({e}); reads are buffered through the page cache",
                self.path.display()
            ));
        }
    }

    fn disable_direct(&self, reason: String) {
        self.direct_ok.store(false, Ordering::SeqCst);
        let mut g = self.fallback.lock().unwrap_or_else(|p| p.into_inner());
        if g.is_none() {
            *g = Some(reason);
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// File size in bytes at open time.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Whether reads currently bypass the page cache.
    pub fn is_direct(&self) -> bool {
        self.direct_ok.load(Ordering::SeqCst)
    }

    /// Why reads are buffered (None while O_DIRECT works).
    pub fn fallback_reason(&self) -> Option<String> {
        self.fallback
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub fn dio_align(&self) -> DioAlign {
        self.align
    }

    /// Offset/length alignment used to round reads out (>= 512, a power of two).
    pub fn offset_align(&self) -> usize {
        self.align.offset.max(512)
    }

    /// The rounded-out read that covers `offset..offset+len`.
    pub fn span(&self, offset: u64, len: usize) -> Span {
        let a = self.offset_align() as u64;
        let start = align_down(offset, a);
        let end = align_up(offset + len as u64, a);
        Span {
            start,
            len: (end - start) as usize,
            lead: (offset - start) as usize,
        }
    }

    /// Read `offset..offset+len` into `buf` (rounded out to the alignment) and return the index
    /// in `buf` of the first requested byte. `buf` must start at an address aligned to
    /// [`DioAlign::mem`] (every [`AlignedBuf`] is) and hold at least `span(offset,len).len`
    /// bytes. Bytes of `buf` outside the requested range are unspecified.
    pub fn read_into(&self, offset: u64, len: usize, buf: &mut [u8]) -> Result<usize, StreamError> {
        let span = self.span(offset, len);
        if buf.len() < span.len {
            return Err(StreamError::Invalid(format!(
                "read of {len} bytes at offset {offset} of {} needs a {}-byte buffer, got {}",
                self.path.display(),
                span.len,
                buf.len()
            )));
        }
        if offset + len as u64 > self.size {
            return Err(StreamError::io(
                "read",
                &self.path,
                std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!(
                        "range {offset}..{} is past the end of the file ({} bytes)",
                        offset + len as u64,
                        self.size
                    ),
                ),
            ));
        }
        if len == 0 {
            return Ok(0);
        }
        let need = span.lead + len;
        if self.is_direct() && !(buf.as_ptr() as usize).is_multiple_of(self.align.mem.max(1)) {
            return Err(StreamError::Invalid(format!(
                "O_DIRECT read of {} into a buffer at {:p} not aligned to {} bytes",
                self.path.display(),
                buf.as_ptr(),
                self.align.mem
            )));
        }
        if self.is_direct()
            && let Some(f) = &self.direct
        {
            match read_loop(f, &mut buf[..span.len], span.start, need) {
                Ok(()) => return Ok(span.lead),
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    self.disable_direct(format!(
                        "O_DIRECT read of {} at offset {} refused ({e}); reads are buffered through the page cache",
                        self.path.display(),
                        span.start
                    ));
                }
                Err(e) => return Err(StreamError::io("read", &self.path, e)),
            }
        }
        // Buffered: read exactly the requested bytes at their place inside the span.
        self.buffered
            .read_exact_at(&mut buf[span.lead..need], offset)
            .map_err(|e| StreamError::io("read", &self.path, e))?;
        Ok(span.lead)
    }

    /// The buffered handle (always open): for mapping the file.
    pub fn buffered_file(&self) -> &File {
        &self.buffered
    }

    /// The O_DIRECT handle while direct reads work (for io_uring submission).
    pub fn direct_fd(&self) -> Option<&File> {
        if self.is_direct() {
            self.direct.as_ref()
        } else {
            None
        }
    }

    /// Read exactly `dst.len()` bytes at `offset` into any (unaligned) destination, through
    /// the buffered handle. For small reads (headers, one embedding row).
    pub fn read_exact_at(&self, offset: u64, dst: &mut [u8]) -> Result<(), StreamError> {
        self.buffered
            .read_exact_at(dst, offset)
            .map_err(|e| StreamError::io("read", &self.path, e))
    }
}

/// pread until at least `need` bytes from `start` are in `buf` (a short read at end of file is
/// fine as long as the requested bytes arrived).
fn read_loop(f: &File, buf: &mut [u8], start: u64, need: usize) -> std::io::Result<()> {
    let mut got = 0usize;
    while got < need {
        let n = f.read_at(&mut buf[got..], start + got as u64)?;
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!("file ended after {} of {need} bytes", got),
            ));
        }
        got += n;
    }
    Ok(())
}

/// One positional read for [`ReadPool::read_all`].
#[derive(Debug)]
pub struct ReadReq<'a> {
    pub file: &'a DirectFile,
    pub offset: u64,
    pub len: usize,
    /// Aligned destination of at least `file.span(offset, len).len` bytes.
    pub buf: &'a mut [u8],
}

/// A fixed set of reader threads: a batch of positional reads runs at queue depth
/// `depth` (each thread issues one blocking pread at a time). With the `io-uring` feature and
/// [`ReadPool::with_io_uring`], O_DIRECT batches go through one io_uring instead.
#[derive(Debug)]
pub struct ReadPool {
    pool: super::blocking::IoThreads,
    depth: usize,
    #[cfg(feature = "io-uring")]
    ring: Option<std::sync::Mutex<super::uring::Ring>>,
    note: Option<String>,
}

impl ReadPool {
    pub fn new(depth: usize) -> Result<Self, StreamError> {
        let depth = depth.max(1);
        let pool = super::blocking::IoThreads::new(depth, "k3-read").map_err(|e| {
            StreamError::Invalid(format!("cannot start {depth} reader threads: {e}"))
        })?;
        Ok(Self {
            pool,
            depth,
            #[cfg(feature = "io-uring")]
            ring: None,
            note: None,
        })
    }

    /// Like [`ReadPool::new`], but O_DIRECT batches are submitted through io_uring when this
    /// build has the `io-uring` feature and the kernel allows it; otherwise the pread threads
    /// are used and [`ReadPool::backend_line`] says why.
    pub fn with_io_uring(depth: usize) -> Result<Self, StreamError> {
        #[allow(unused_mut)]
        let mut p = Self::new(depth)?;
        #[cfg(feature = "io-uring")]
        match super::uring::Ring::new(depth.max(1) as u32) {
            Ok(r) => p.ring = Some(std::sync::Mutex::new(r)),
            Err(e) => {
                p.note = Some(format!(
                    "io_uring unavailable ({e}); using {} pread threads",
                    p.depth
                ))
            }
        }
        #[cfg(not(feature = "io-uring"))]
        {
            p.note = Some(format!(
                "io_uring requested but this build lacks the `io-uring` feature; using {} pread threads",
                p.depth
            ));
        }
        Ok(p)
    }

    /// Pool for an I/O policy: io_uring if the policy asks for it (with fallback), else threads.
    pub fn for_policy(policy: &super::io_policy::IoPolicy) -> Result<Self, StreamError> {
        if policy.io_uring {
            Self::with_io_uring(policy.read_threads)
        } else {
            Self::new(policy.read_threads)
        }
    }

    /// Whether batches go through io_uring.
    pub fn uses_io_uring(&self) -> bool {
        #[cfg(feature = "io-uring")]
        {
            self.ring.is_some()
        }
        #[cfg(not(feature = "io-uring"))]
        {
            false
        }
    }

    /// One line for the start-up report: the backend and queue depth (and a fallback reason).
    pub fn backend_line(&self) -> String {
        if self.uses_io_uring() {
            format!("io_uring at queue depth {}", self.depth)
        } else if let Some(n) = &self.note {
            n.clone()
        } else {
            format!("{} pread threads", self.depth)
        }
    }

    /// Queue depth (number of reader threads).
    pub fn depth(&self) -> usize {
        self.depth
    }

    /// Queue owned tasks on the reader threads (behind the reads already queued) and return
    /// at once; each task reports back itself ([`super::blocking::IoThreads::spawn`]). Always
    /// the pread threads, also when batches go through io_uring.
    pub fn spawn(&self, tasks: Vec<super::blocking::Task>) {
        self.pool.spawn(tasks);
    }

    /// Run scoped tasks (e.g. read-and-decode jobs of a compressed trunk) on the pread
    /// threads, in the given order, and return when all have finished.
    pub fn run_tasks<'a>(&self, tasks: Vec<Box<dyn FnOnce() + Send + 'a>>) {
        self.pool.run(tasks);
    }

    /// Read `offset..offset+len` of `file` into `buf` like [`DirectFile::read_into`], split
    /// into `piece`-byte reads (a multiple of the alignment) issued in parallel: one large
    /// pread runs at queue depth 1, which on NVMe/virtio is 2-3x slower than 4 MiB pieces at
    /// depth 8. Returns the index in `buf` of the first requested byte.
    pub fn read_split(
        &self,
        file: &DirectFile,
        offset: u64,
        len: usize,
        buf: &mut [u8],
        piece: usize,
    ) -> Result<usize, StreamError> {
        let span = file.span(offset, len);
        let align = file.offset_align();
        if len == 0
            || piece == 0
            || !piece.is_multiple_of(align)
            || span.len <= piece
            || self.depth == 1
        {
            return file.read_into(offset, len, buf);
        }
        if buf.len() < span.len {
            return Err(StreamError::Invalid(format!(
                "read of {len} bytes at offset {offset} of {} needs a {}-byte buffer, got {}",
                file.path().display(),
                span.len,
                buf.len()
            )));
        }
        let end = offset + len as u64;
        let mut reqs: Vec<ReadReq<'_>> = buf[..span.len]
            .chunks_mut(piece)
            .enumerate()
            .map(|(i, b)| {
                let p_start = (span.start + (i * piece) as u64).max(offset);
                let p_end = (span.start + ((i + 1) * piece) as u64).min(end);
                ReadReq {
                    file,
                    offset: p_start,
                    len: (p_end - p_start) as usize,
                    buf: b,
                }
            })
            .collect();
        for r in self.read_all(&mut reqs) {
            r?;
        }
        Ok(span.lead)
    }

    /// Run every read, in parallel, issued in the given order (callers sort by disk offset);
    /// returns each read's lead offset (see [`DirectFile::read_into`]) or its error, in order.
    pub fn read_all(&self, reqs: &mut [ReadReq<'_>]) -> Vec<Result<usize, StreamError>> {
        self.read_all_with(reqs, false)
    }

    /// Like [`ReadPool::read_all`], but ahead of reads queued by other callers and not yet
    /// started (a demand read the executor waits for, ahead of speculative prefetches).
    pub fn read_all_first(&self, reqs: &mut [ReadReq<'_>]) -> Vec<Result<usize, StreamError>> {
        self.read_all_with(reqs, true)
    }

    fn read_all_with(
        &self,
        reqs: &mut [ReadReq<'_>],
        first: bool,
    ) -> Vec<Result<usize, StreamError>> {
        #[cfg(feature = "io-uring")]
        if let Some(ring) = &self.ring
            && reqs.len() > 1
        {
            let mut ring = ring.lock().unwrap_or_else(|p| p.into_inner());
            return ring.read_all(reqs);
        }
        let mut results: Vec<Option<Result<usize, StreamError>>> =
            (0..reqs.len()).map(|_| None).collect();
        if reqs.len() == 1 {
            // No hand-off for a single read.
            let r = &mut reqs[0];
            results[0] = Some(r.file.read_into(r.offset, r.len, r.buf));
        } else {
            let tasks = reqs
                .iter_mut()
                .zip(results.iter_mut())
                .map(|(r, out)| {
                    Box::new(move || *out = Some(r.file.read_into(r.offset, r.len, r.buf)))
                        as Box<dyn FnOnce() + Send + '_>
                })
                .collect();
            if first {
                self.pool.run_first(tasks);
            } else {
                self.pool.run(tasks);
            }
        }
        results
            .into_iter()
            .map(|r| {
                r.unwrap_or_else(|| {
                    Err(StreamError::Invalid(
                        "a read job did not run (reader thread panicked)".to_string(),
                    ))
                })
            })
            .collect()
    }
}
