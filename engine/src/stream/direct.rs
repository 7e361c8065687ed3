//! Direct (page-cache bypassing) positional reads, with a reported fallback, and a small pool
//! that issues many reads in parallel.
//!
//! Owns: opening a file for uncached reads through [`crate::platform`] (`O_DIRECT` on Linux,
//! `F_NOCACHE` on macOS, `FILE_FLAG_NO_BUFFERING` on Windows), learning its alignment (Linux
//! `statx(STATX_DIOALIGN)`; default 4096), rounding each requested `(offset, len)` out to that alignment, reading into
//! an aligned buffer and telling the caller where the requested bytes start. If the
//! filesystem refuses O_DIRECT (EINVAL at open or at a read), reads continue buffered and the
//! reason is kept for the start-up report. Also owns [`ReadPool`], a fixed set of threads that
//! runs a batch of positional reads at queue depth N.
//! Must not: decide what to read (the trunk and the expert store do), or cache anything.
//! Follows upstream: docs/DESIGN.md §3 (reads use O_DIRECT) and §4 (a layer's misses issued
//! together, in parallel); rust-deps.md Q4 (alignment, statx, the tmpfs pitfall: tests put
//! their files on disk) and Q9 (a pread thread pool is the portable path).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use super::StreamError;
use super::aligned::{AlignedBuf, IO_ALIGN, align_down, align_up};
use crate::platform::{self, UNCACHED};

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

/// Ask the platform for the file's direct-I/O alignment (Linux >= 6.1 `statx`). Falls back
/// to 4096 when the filesystem does not report it (e.g. tmpfs, or "not supported": the probe
/// read decides), and on macOS and Windows.
pub fn dio_align(path: &Path) -> DioAlign {
    match platform::dio_align(path) {
        Some((mem, offset)) => DioAlign {
            mem,
            offset,
            from_statx: true,
        },
        None => DioAlign::default(),
    }
}

/// How a [`DirectFile`] reads its uncached handle: [`platform::read_at_least`], or in tests a
/// reader that refuses.
type UncachedRead = fn(&File, &mut [u8], u64, usize) -> std::io::Result<()>;

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
    /// The uncached handle, if the open succeeded.
    direct: Option<File>,
    read_uncached: UncachedRead,
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
        Self::open_with(
            path,
            want_direct,
            platform::open_uncached,
            platform::read_at_least,
        )
    }

    /// [`DirectFile::open`] with the uncached open and read given (tests: a refusal).
    fn open_with(
        path: &Path,
        want_direct: bool,
        open_uncached: fn(&Path) -> std::io::Result<File>,
        read_uncached: UncachedRead,
    ) -> Result<Self, StreamError> {
        let buffered = File::open(path).map_err(|e| StreamError::io("open", path, e))?;
        let size = buffered
            .metadata()
            .map_err(|e| StreamError::io("stat", path, e))?
            .len();
        let align = dio_align(path);
        let mut fallback = None;
        let mut direct = None;
        if want_direct {
            match open_uncached(path) {
                Ok(f) => direct = Some(f),
                Err(e) => {
                    fallback = Some(format!(
                        "{UNCACHED} open of {} refused ({e}); reads are buffered through the page cache",
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
            read_uncached,
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
        let need = n.min(usize::try_from(self.size).unwrap_or(usize::MAX));
        if let Some(f) = &self.direct
            && let Err(e) = (self.read_uncached)(f, &mut buf.full_mut()[..n], 0, need)
        {
            self.disable_direct(format!(
                "{UNCACHED} read of {} refused ({e}); reads are buffered through the page cache",
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

    /// Why reads are buffered (None while uncached reads work).
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
                "{UNCACHED} read of {} into a buffer at {:p} not aligned to {} bytes",
                self.path.display(),
                buf.as_ptr(),
                self.align.mem
            )));
        }
        if self.is_direct()
            && let Some(f) = &self.direct
        {
            match (self.read_uncached)(f, &mut buf[..span.len], span.start, need) {
                Ok(()) => return Ok(span.lead),
                Err(e) if refused(&e) => {
                    self.disable_direct(format!(
                        "{UNCACHED} read of {} at offset {} refused ({e}); reads are buffered through the page cache",
                        self.path.display(),
                        span.start
                    ));
                }
                Err(e) => return Err(StreamError::io("read", &self.path, e)),
            }
        }
        // Buffered: read exactly the requested bytes at their place inside the span.
        platform::read_exact_at(&self.buffered, &mut buf[span.lead..need], offset)
            .map_err(|e| StreamError::io("read", &self.path, e))?;
        Ok(span.lead)
    }

    /// The buffered handle (always open): for mapping the file.
    pub fn buffered_file(&self) -> &File {
        &self.buffered
    }

    /// The uncached handle while uncached reads work (for io_uring submission).
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
        platform::read_exact_at(&self.buffered, dst, offset)
            .map_err(|e| StreamError::io("read", &self.path, e))
    }
}

/// Whether a failed uncached read was a refusal of the mode (buffered reads then continue):
/// `EINVAL` on Linux and macOS, `ERROR_INVALID_PARAMETER` (87) on Windows.
fn refused(e: &std::io::Error) -> bool {
    let invalid = if cfg!(windows) { 87 } else { 22 };
    e.raw_os_error() == Some(invalid)
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
    #[cfg(all(feature = "io-uring", target_os = "linux"))]
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
            #[cfg(all(feature = "io-uring", target_os = "linux"))]
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
        #[cfg(all(feature = "io-uring", target_os = "linux"))]
        match super::uring::Ring::new(depth.max(1) as u32) {
            Ok(r) => p.ring = Some(std::sync::Mutex::new(r)),
            Err(e) => {
                p.note = Some(format!(
                    "io_uring unavailable ({e}); using {} pread threads",
                    p.depth
                ))
            }
        }
        #[cfg(not(all(feature = "io-uring", target_os = "linux")))]
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
        #[cfg(all(feature = "io-uring", target_os = "linux"))]
        {
            self.ring.is_some()
        }
        #[cfg(not(all(feature = "io-uring", target_os = "linux")))]
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
        #[cfg(all(feature = "io-uring", target_os = "linux"))]
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A scratch directory removed on drop.
    struct Scratch(PathBuf);

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// A file under target/ (not tmpfs) with known bytes; the directory goes with the guard.
    fn sample(name: &str, len: usize) -> (PathBuf, Vec<u8>, Scratch) {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../target/platform-tests")
            .join(format!("direct-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create the scratch dir");
        let data: Vec<u8> = (0..len as u32).map(|i| (i * 31 % 255) as u8).collect();
        let path = dir.join("f.bin");
        std::fs::write(&path, &data).expect("write");
        (path, data, Scratch(dir))
    }

    fn einval() -> std::io::Error {
        std::io::Error::from_raw_os_error(if cfg!(windows) { 87 } else { 22 })
    }

    /// The platform's uncached open, or a plain one where this filesystem refuses it (the
    /// read function under test decides what is refused).
    fn open_any(p: &Path) -> std::io::Result<File> {
        platform::open_uncached(p).or_else(|_| File::open(p))
    }

    fn refuse_open(_: &Path) -> std::io::Result<File> {
        Err(einval())
    }

    /// Accepts the probe at offset 0, refuses every later read as a filesystem refusing
    /// uncached reads would.
    fn refuse_after_probe(f: &File, b: &mut [u8], off: u64, need: usize) -> std::io::Result<()> {
        if off == 0 {
            platform::read_at_least(f, b, off, need)
        } else {
            Err(einval())
        }
    }

    fn fail_hard(_: &File, _: &mut [u8], _: u64, _: usize) -> std::io::Result<()> {
        Err(std::io::Error::from(std::io::ErrorKind::PermissionDenied))
    }

    fn check_reads(f: &DirectFile, data: &[u8]) {
        for (off, len) in [(0u64, 10usize), (4095, 2), (5000, 60_000), (123_456, 7)] {
            let mut buf = AlignedBuf::new(f.span(off, len).len).expect("buffer");
            let lead = f.read_into(off, len, buf.full_mut()).expect("read");
            assert_eq!(
                &buf.full()[lead..lead + len],
                &data[off as usize..off as usize + len],
                "{off}+{len}"
            );
        }
    }

    #[test]
    fn a_refused_uncached_open_falls_back_to_buffered_reads_and_says_why() {
        let (path, data, _scratch) = sample("open", 200_000);
        let f =
            DirectFile::open_with(&path, true, refuse_open, platform::read_at_least).expect("open");
        assert!(!f.is_direct());
        let why = f.fallback_reason().expect("a reason");
        assert!(why.contains(&format!("{UNCACHED} open of")), "{why}");
        assert!(why.contains("buffered through the page cache"), "{why}");
        check_reads(&f, &data);
    }

    #[test]
    fn a_refused_uncached_read_falls_back_mid_run_with_the_same_bytes() {
        let (path, data, _scratch) = sample("read", 200_000);
        let f = DirectFile::open_with(&path, true, open_any, refuse_after_probe).expect("open");
        assert!(f.is_direct(), "the probe at offset 0 was accepted");
        assert_eq!(f.fallback_reason(), None);
        check_reads(&f, &data);
        assert!(
            !f.is_direct(),
            "the refusal at a later offset switched to buffered"
        );
        let why = f.fallback_reason().expect("a reason");
        assert!(why.contains(&format!("{UNCACHED} read of")), "{why}");
        let at = f.span(4095, 2).start;
        assert!(
            at > 0 && why.contains(&format!("at offset {at} refused")),
            "{why}"
        );
    }

    #[test]
    fn a_refused_probe_falls_back_and_other_read_errors_are_errors() {
        let (path, data, _scratch) = sample("probe", 50_000);
        let f = DirectFile::open_with(&path, true, open_any, fail_hard).expect("open");
        assert!(!f.is_direct(), "a failed probe disables uncached reads");
        check_reads_small(&f, &data);
        // After a good probe, an error that is not a refusal is returned, not hidden.
        let f = DirectFile::open_with(&path, true, open_any, |f, b, off, need| {
            if off == 0 {
                platform::read_at_least(f, b, off, need)
            } else {
                fail_hard(f, b, off, need)
            }
        })
        .expect("open");
        let mut buf = AlignedBuf::new(f.span(8192, 10).len).expect("buffer");
        assert!(f.read_into(8192, 10, buf.full_mut()).is_err());
        assert!(f.is_direct(), "a hard error does not switch modes");
    }

    fn check_reads_small(f: &DirectFile, data: &[u8]) {
        let mut buf = AlignedBuf::new(f.span(4097, 30_000).len).expect("buffer");
        let lead = f.read_into(4097, 30_000, buf.full_mut()).expect("read");
        assert_eq!(&buf.full()[lead..lead + 30_000], &data[4097..34_097]);
    }

    #[test]
    fn the_real_uncached_path_reads_the_same_bytes_or_says_why_not() {
        let (path, data, _scratch) = sample("real", 300_000);
        let f = DirectFile::open(&path, true).expect("open");
        if let Some(why) = f.fallback_reason() {
            assert!(why.contains(UNCACHED), "{why}");
        }
        check_reads(&f, &data);
        let buffered = DirectFile::open(&path, false).expect("open");
        assert!(!buffered.is_direct());
        check_reads(&buffered, &data);
    }
}
