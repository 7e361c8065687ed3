//! The platform layer: the one place that asks the operating system for what std does not
//! give portably. Files opened for uncached reads, positional reads split below 2 GiB,
//! file and memory advice, aligned anonymous memory and large pages, the memory this process
//! may use ([`memory`]), signal defaults, and the list of features this platform has or lacks
//! ([`features`]) in its own terms.
//!
//! Owns: the `cfg` split into one implementation per supported OS (`linux.rs`, `macos.rs`,
//! `windows.rs`, exactly one compiled) and the portable logic all three share: the read loop
//! ([`read_at_least_with`]: short reads, `EINTR`, the 2 GiB split), the [`Feature`] report and
//! the [`AnonMap`] ownership rules. Everything here returns [`std::io::Error`]s; a feature a
//! platform lacks is an error of kind [`io::ErrorKind::Unsupported`] (never a silent success),
//! so callers fall back and say so.
//! Must not: decide anything (whether to read uncached, which pages to use, what to plan):
//! callers do, and report it.
//!
//! | | Linux | macOS | Windows |
//! |---|---|---|---|
//! | uncached reads | `O_DIRECT` (alignment from `statx`) | `F_NOCACHE` (+ `F_RDADVISE`) | `FILE_FLAG_NO_BUFFERING`, overlapped reads |
//! | large pages | THP advice, `vm.nr_hugepages` pool | absent | absent (`MEM_LARGE_PAGES` needs a privilege; not used) |
//! | memory available | `MemAvailable` | `host_statistics64` (free + inactive + speculative) | `GlobalMemoryStatusEx` |
//! | memory cap | memory cgroup v2/v1 | absent | job object limits |
//!
//! Only the Linux implementation runs in CI; the macOS and Windows ones are compiled and
//! linted for `aarch64-apple-darwin` and `x86_64-pc-windows-gnu` (`.ci/cross.sh`).

use std::fs::File;
use std::io;
use std::path::Path;
use std::ptr::NonNull;

pub mod memory;

#[cfg(target_os = "linux")]
#[path = "linux.rs"]
mod sys;
#[cfg(target_os = "macos")]
#[path = "macos.rs"]
mod sys;
#[cfg(windows)]
#[path = "windows.rs"]
mod sys;
#[cfg(not(any(target_os = "linux", target_os = "macos", windows)))]
compile_error!("k3-engine's platform layer has implementations for Linux, macOS and Windows only");

/// This platform's name as users know it (`Linux`, `macOS`, `Windows`).
pub const OS: &str = sys::OS;

/// The largest request one read system call is given: 2 GiB minus 1 MiB. macOS `pread`
/// refuses 2 GiB or more (`EINVAL`), Windows `ReadFile` takes a 32-bit length, and Linux
/// returns at most 0x7ffff000 bytes; every platform gets the same split. A multiple of 1 MiB,
/// so a split uncached read stays aligned.
pub const MAX_READ: usize = (1 << 31) - (1 << 20);

/// What the uncached-read mechanism is called here (`O_DIRECT`, `F_NOCACHE`,
/// `FILE_FLAG_NO_BUFFERING`): the word the start-up report and `doctor` use.
pub const UNCACHED: &str = sys::UNCACHED;

/// Open `path` read-only for reads that bypass the page cache ([`UNCACHED`]). An error means
/// the filesystem or platform refused; callers keep a buffered handle and report why.
pub fn open_uncached(path: &Path) -> io::Result<File> {
    sys::open_uncached(path)
}

/// Create the new file `path` (an error if it exists) for reads and writes that bypass the
/// page cache (`doctor`'s test file).
pub fn create_uncached(path: &Path) -> io::Result<File> {
    sys::create_uncached(path)
}

/// The direct-I/O alignment of `path` as (buffer address, file offset and length), when the
/// platform reports it (Linux `statx(STATX_DIOALIGN)`); `None`: use the 4096 default.
pub fn dio_align(path: &Path) -> Option<(usize, usize)> {
    sys::dio_align(path)
}

/// One positional read of at most [`MAX_READ`] bytes at `offset` (fewer bytes read is not an
/// error; 0 is end of file).
pub fn read_at(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let n = buf.len().min(MAX_READ);
    sys::read_at(file, &mut buf[..n], offset)
}

/// Read until at least `need` bytes from `start` are in `buf` ([`read_at_least_with`] over
/// [`read_at`]).
pub fn read_at_least(file: &File, buf: &mut [u8], start: u64, need: usize) -> io::Result<()> {
    read_at_least_with(buf, start, need, |b, off| sys::read_at(file, b, off))
}

/// Read exactly `buf.len()` bytes at `offset`.
pub fn read_exact_at(file: &File, buf: &mut [u8], offset: u64) -> io::Result<()> {
    let need = buf.len();
    read_at_least(file, buf, offset, need)
}

/// Write all of `buf` at `offset` (pieces of at most [`MAX_READ`] bytes; `Interrupted`
/// retried).
pub fn write_all_at(file: &File, buf: &[u8], offset: u64) -> io::Result<()> {
    let mut done = 0usize;
    while done < buf.len() {
        let end = buf.len().min(done + MAX_READ);
        match sys::write_at(file, &buf[done..end], offset + done as u64) {
            Ok(0) => return Err(io::Error::from(io::ErrorKind::WriteZero)),
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The read loop every platform shares: call `read(piece, offset)` with pieces of at most
/// [`MAX_READ`] bytes until at least `need` bytes from `start` are in `buf` (a read may stop
/// anywhere in the last piece: a short read at the end of the file is fine once the requested
/// bytes arrived). `Interrupted` is retried; a read of 0 bytes before `need` is
/// `UnexpectedEof`. `need` must not exceed `buf.len()`.
pub fn read_at_least_with(
    buf: &mut [u8],
    start: u64,
    need: usize,
    mut read: impl FnMut(&mut [u8], u64) -> io::Result<usize>,
) -> io::Result<()> {
    if need > buf.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("a read of {need} bytes into a {}-byte buffer", buf.len()),
        ));
    }
    let mut got = 0usize;
    while got < need {
        let end = buf.len().min(got + MAX_READ);
        match read(&mut buf[got..end], start + got as u64) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("file ended after {got} of {need} bytes"),
                ));
            }
            Ok(n) => got += n.min(end - got),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Whether `e` says a path is a symbolic-link loop (`ELOOP`; Windows `ERROR_CANT_RESOLVE_FILENAME`).
pub fn is_symlink_loop(e: &io::Error) -> bool {
    e.raw_os_error().is_some() && e.raw_os_error() == Some(sys::ELOOP)
}

/// Advice about how a file will be read. Advice only: never changes what a read returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileAdvice {
    /// Random access: no read-ahead (Linux `POSIX_FADV_RANDOM`, macOS `F_RDAHEAD` off).
    Random,
    /// This range will be read soon (Linux `POSIX_FADV_WILLNEED`, macOS `F_RDADVISE`).
    WillNeed { offset: u64, len: u64 },
    /// Drop this range's cached pages (Linux `POSIX_FADV_DONTNEED`; absent elsewhere).
    DontNeed { offset: u64, len: u64 },
}

/// Give `advice` for `file`; `Unsupported` where the platform has no such advice.
pub fn advise_file(file: &File, advice: FileAdvice) -> io::Result<()> {
    sys::advise_file(file, advice)
}

/// The system's page size (4096 when it cannot be read).
pub fn page_size() -> usize {
    sys::page_size()
        .filter(|p| p.is_power_of_two())
        .unwrap_or(4096)
}

/// Advice about a range of this process's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemAdvice {
    /// Back the range with transparent huge pages (Linux `MADV_HUGEPAGE`).
    HugePage,
    /// Start reading the range's file pages in (`MADV_WILLNEED`; Windows
    /// `PrefetchVirtualMemory`).
    WillNeed,
    /// Drop the range's page-table entries; a file mapping's bytes are unchanged
    /// (`MADV_DONTNEED`).
    DontNeed,
    /// Read the range's file pages in and map them, or fail (Linux 5.14
    /// `MADV_POPULATE_READ`).
    PopulateRead,
    /// Fault the range's anonymous pages in, writable (Linux 5.14 `MADV_POPULATE_WRITE`).
    PopulateWrite,
}

/// Give `advice` for `[addr, addr + len)`; `Unsupported` where the platform lacks it.
///
/// # Safety
/// The range must lie inside one live mapping of this process that the caller owns;
/// [`MemAdvice::DontNeed`] only on a read-only file mapping or on memory whose contents the
/// caller no longer needs.
pub unsafe fn advise_memory(addr: usize, len: usize, advice: MemAdvice) -> io::Result<()> {
    // SAFETY: forwarded from the caller.
    unsafe { sys::advise_memory(addr, len, advice) }
}

/// Which pages of `[addr, addr + len)` (page-aligned `addr`) are resident: bit 0 of one byte
/// per page written to `out`, which must hold `len.div_ceil(page_size())` bytes.
/// `Unsupported` on Windows.
///
/// # Safety
/// The range must lie inside one live mapping of this process.
pub unsafe fn resident_pages(addr: usize, len: usize, out: &mut [u8]) -> io::Result<()> {
    if out.len() < len.div_ceil(page_size()) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "residency vector shorter than the range's pages",
        ));
    }
    // SAFETY: forwarded from the caller; `out` holds a byte per page (checked above).
    unsafe { sys::resident_pages(addr, len, out) }
}

/// Lock `[addr, addr + len)` in RAM (`mlock`, Windows `VirtualLock`).
///
/// # Safety
/// The range must lie inside one live mapping of this process.
pub unsafe fn lock_memory(addr: usize, len: usize) -> io::Result<()> {
    // SAFETY: forwarded from the caller.
    unsafe { sys::lock_memory(addr, len) }
}

/// Peak resident set size of this process in bytes (Linux/macOS `getrusage`, Windows the
/// peak working set); `None` if the platform did not say.
pub fn peak_rss_bytes() -> Option<u64> {
    sys::peak_rss_bytes()
}

/// Free bytes of the filesystem holding `path` for an unprivileged user.
pub fn disk_free_bytes(path: &Path) -> io::Result<u64> {
    sys::disk_free_bytes(path)
}

/// The type of the filesystem holding a path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FsType {
    /// Linux `statfs` magic number (`f_type`).
    Magic(i64),
    /// The name the platform gives (macOS `f_fstypename`, Windows the volume's file system).
    Name(String),
}

/// The type of the filesystem holding `path` (`doctor` refuses to measure RAM filesystems).
pub fn fs_type(path: &Path) -> io::Result<FsType> {
    sys::fs_type(path)
}

/// Restore the default action of `SIGPIPE` (a closed pipe ends the process quietly, as for
/// any Unix filter); Windows has no `SIGPIPE` and nothing is done there.
pub fn default_sigpipe() {
    sys::default_sigpipe();
}

/// Zeroed, read-write anonymous memory starting at a requested alignment, unmapped on drop.
/// On the reserved huge-page pool when made by [`AnonMap::reserved_huge`].
#[derive(Debug)]
pub struct AnonMap {
    start: NonNull<u8>,
    len: usize,
    /// What the OS handed out (before trimming to the aligned range, where the platform
    /// cannot trim), and its length: what drop gives back.
    base: NonNull<u8>,
    base_len: usize,
    huge_reserved: bool,
}

// SAFETY: an AnonMap is a plain owned range of memory; it is only unmapped in Drop, once.
unsafe impl Send for AnonMap {}
// SAFETY: as above; `&AnonMap` gives access to nothing but addresses.
unsafe impl Sync for AnonMap {}

impl AnonMap {
    /// `len` zeroed bytes (a multiple of 4096) starting at a multiple of `align` (a power of
    /// two, at least 4096).
    pub fn new(len: usize, align: usize) -> io::Result<AnonMap> {
        if !align.is_power_of_two() || align < 4096 || !len.is_multiple_of(4096) || len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("anonymous map of {len} bytes aligned to {align}"),
            ));
        }
        sys::map_anon(len, align)
    }

    /// `len` bytes (a multiple of 2 MiB) of the reserved 2 MiB huge-page pool (Linux
    /// `MAP_HUGETLB`, `vm.nr_hugepages`), reserved up front; `None` when the pool cannot give
    /// them all, or the platform has no such pool.
    pub fn reserved_huge(len: usize) -> Option<AnonMap> {
        sys::map_reserved_huge(len)
    }

    /// Whether this platform has a reserved huge-page pool at all.
    pub fn has_reserved_huge() -> bool {
        sys::HAS_RESERVED_HUGE
    }

    /// First byte (aligned as asked).
    pub fn start(&self) -> NonNull<u8> {
        self.start
    }

    /// Usable bytes from [`AnonMap::start`].
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true (a map has at least one page); for clippy's `len_without_is_empty`.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the pages come from the reserved huge-page pool.
    pub fn huge_reserved(&self) -> bool {
        self.huge_reserved
    }
}

impl Drop for AnonMap {
    fn drop(&mut self) {
        // SAFETY: `base..base+base_len` is exactly what `sys` kept mapped for this value, and
        // nothing borrowed from it outlives the map (owners hold the map alive).
        unsafe { sys::unmap(self.base, self.base_len) }
    }
}

/// One feature of the platform layer as it stands on this machine.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Feature {
    /// What it is (`uncached reads`, `large pages`, `memory cap`, `plugins`).
    pub name: &'static str,
    /// Whether this platform has it (a Linux machine without a cgroup limit still has the
    /// mechanism: `present`, and `detail` says no limit is set).
    pub present: bool,
    /// In the platform's terms: the mechanism, or why it is absent.
    pub detail: String,
}

impl Feature {
    /// `large pages: absent (...)` / `uncached reads: O_DIRECT`.
    pub fn line(&self) -> String {
        if self.present {
            format!("{}: {}", self.name, self.detail)
        } else {
            format!("{}: absent ({})", self.name, self.detail)
        }
    }
}

/// The features of this platform: uncached reads, large pages, memory cap, plugins.
pub fn features() -> Vec<Feature> {
    let mut f = sys::features();
    f.push(Feature {
        name: "plugins",
        present: true,
        detail: format!(
            "shared libraries named {}NAME{}",
            std::env::consts::DLL_PREFIX,
            std::env::consts::DLL_SUFFIX
        ),
    });
    f
}

/// One start-up line naming the features this platform lacks, in its terms (`None` when it
/// lacks none): absent features are reported, never silently ignored.
pub fn absent_line() -> Option<String> {
    let absent: Vec<String> = features()
        .iter()
        .filter(|f| !f.present)
        .map(Feature::line)
        .collect();
    (!absent.is_empty()).then(|| format!("platform {OS}: {}", absent.join("; ")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// A reader over `data` that returns at most `cap` bytes a call and records each request.
    fn short_reader<'a>(
        data: &'a [u8],
        cap: usize,
        asked: &'a mut Vec<(u64, usize)>,
    ) -> impl FnMut(&mut [u8], u64) -> io::Result<usize> + 'a {
        move |b, off| {
            asked.push((off, b.len()));
            let off = off as usize;
            let n = b.len().min(cap).min(data.len().saturating_sub(off));
            b[..n].copy_from_slice(&data[off..off + n]);
            Ok(n)
        }
    }

    #[test]
    fn short_reads_are_continued_at_the_right_offsets() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let mut asked = Vec::new();
        let mut buf = vec![0u8; 5000];
        read_at_least_with(&mut buf, 1234, 5000, short_reader(&data, 777, &mut asked))
            .expect("read");
        assert_eq!(buf, data[1234..6234]);
        assert_eq!(asked.len(), 5000usize.div_ceil(777));
        assert_eq!(
            asked[1],
            (1234 + 777, 5000 - 777),
            "continued after the short read"
        );
    }

    #[test]
    fn end_of_file_before_the_need_is_an_error_and_after_it_is_not() {
        let data = vec![5u8; 3000];
        let mut asked = Vec::new();
        let mut buf = vec![0u8; 4096];
        // the rounded-out span runs past the end, but the 3000 requested bytes arrive
        read_at_least_with(&mut buf, 0, 3000, short_reader(&data, 4096, &mut asked))
            .expect("the need was met");
        assert!(buf[..3000].iter().all(|&b| b == 5));
        let e = read_at_least_with(&mut buf, 0, 3001, short_reader(&data, 4096, &mut asked))
            .expect_err("one byte short");
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
        assert!(e.to_string().contains("after 3000 of 3001"), "{e}");
        let e = read_at_least_with(&mut buf[..10], 0, 11, |_, _| Ok(0)).expect_err("need > buf");
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    }

    #[test]
    fn interrupted_reads_are_retried_and_other_errors_are_returned() {
        let mut calls = 0;
        let mut buf = [0u8; 8];
        read_at_least_with(&mut buf, 0, 8, |b, _| {
            calls += 1;
            if calls == 1 {
                Err(io::Error::from(io::ErrorKind::Interrupted))
            } else {
                b.fill(1);
                Ok(b.len())
            }
        })
        .expect("retried");
        assert_eq!((calls, buf), (2, [1; 8]));
        let e = read_at_least_with(&mut buf, 0, 8, |_, _| Err(io::Error::from_raw_os_error(22)))
            .expect_err("EINVAL is returned");
        assert_eq!(e.raw_os_error(), Some(22));
    }

    /// A 2.35 GB request (the release's embedding) is split into pieces below 2 GiB at the
    /// right offsets; the buffer is an untouched anonymous map, so no memory is used.
    #[test]
    fn a_request_of_2_35_gb_is_split_below_2_gib() {
        const LEN: usize = 2_350_000_000;
        let map = AnonMap::new(LEN.div_ceil(4096) * 4096, 4096).expect("map 2.35 GB");
        // SAFETY: the map holds at least LEN bytes and lives until the end of the test.
        let buf = unsafe { std::slice::from_raw_parts_mut(map.start().as_ptr(), LEN) };
        let mut asked = Vec::new();
        read_at_least_with(buf, 4096, LEN, |b, off| {
            asked.push((off, b.len()));
            Ok(b.len())
        })
        .expect("read");
        assert_eq!(
            asked,
            vec![(4096, MAX_READ), (4096 + MAX_READ as u64, LEN - MAX_READ),]
        );
        assert!(asked.iter().all(|&(_, n)| n < 1 << 31));
        assert!(MAX_READ.is_multiple_of(1 << 20));
    }

    /// Where the reads are: a file under target/ (not tmpfs, which refuses O_DIRECT).
    fn scratch(name: &str) -> std::path::PathBuf {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../target/platform-tests")
            .join(format!("{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create the scratch dir");
        dir
    }

    /// A real 2.35 GB read of a sparse file through the platform's read (uncached where the
    /// filesystem allows it): every piece below 2 GiB, the bytes around the 2 GiB boundary
    /// where they were written.
    #[test]
    fn a_2_35_gb_read_of_a_sparse_file_is_split_and_lands_in_place() {
        const LEN: usize = 2_350_000_000;
        let dir = scratch("sparse");
        let path = dir.join("embedding.bin");
        let marks: [(u64, u8); 6] = [
            (0, 1),
            ((1 << 31) - (1 << 20) - 1, 2),
            ((1 << 31) - (1 << 20), 3),
            ((1 << 31) - 1, 4),
            (1 << 31, 5),
            (LEN as u64 - 1, 6),
        ];
        {
            let f = File::create(&path).expect("create");
            f.set_len(LEN as u64).expect("sparse length");
            for (at, v) in marks {
                write_at(&f, &[v], at);
            }
            f.sync_all().expect("sync");
        }
        let file = open_uncached(&path)
            .or_else(|_| File::open(&path))
            .expect("open");
        let cap = LEN.div_ceil(1 << 20) << 20;
        let map = AnonMap::new(cap, 1 << 21).expect("map");
        // SAFETY: the map holds `cap` bytes and lives until the end of the test.
        let buf = unsafe { std::slice::from_raw_parts_mut(map.start().as_ptr(), cap) };
        let mut sizes = Vec::new();
        read_at_least_with(buf, 0, LEN, |b, off| {
            sizes.push(b.len());
            sys::read_at(&file, b, off)
        })
        .expect("read 2.35 GB");
        assert!(sizes.len() >= 2, "{sizes:?}");
        assert!(sizes.iter().all(|&n| n <= MAX_READ), "{sizes:?}");
        for (at, v) in marks {
            assert_eq!(buf[at as usize], v, "byte at {at}");
        }
        assert_eq!(buf[1 << 30], 0, "a hole reads as zeros");
        drop(file);
        std::fs::remove_dir_all(&dir).ok();
    }

    fn write_at(f: &File, bytes: &[u8], at: u64) {
        use std::io::{Seek, SeekFrom};
        let mut f = f;
        f.seek(SeekFrom::Start(at)).expect("seek");
        f.write_all(bytes).expect("write");
    }

    #[test]
    fn exact_reads_of_a_real_file_match_and_past_the_end_fails() {
        let dir = scratch("exact");
        let path = dir.join("f.bin");
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 253) as u8).collect();
        std::fs::write(&path, &data).expect("write");
        let f = File::open(&path).expect("open");
        let mut b = vec![0u8; 50_001];
        read_exact_at(&f, &mut b, 12_345).expect("read");
        assert_eq!(b, data[12_345..62_346]);
        let e = read_exact_at(&f, &mut b, 60_000).expect_err("past the end");
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn anon_maps_are_aligned_zeroed_and_checked() {
        for align in [4096, 1 << 21] {
            let m = AnonMap::new(3 * 4096, align).expect("map");
            assert_eq!(m.start().as_ptr() as usize % align, 0);
            assert_eq!(m.len(), 3 * 4096);
            // SAFETY: the map holds len bytes.
            let s = unsafe { std::slice::from_raw_parts_mut(m.start().as_ptr(), m.len()) };
            assert!(s.iter().all(|&b| b == 0));
            s.fill(7);
        }
        assert!(AnonMap::new(4096, 1000).is_err());
        assert!(AnonMap::new(100, 4096).is_err());
        assert!(AnonMap::new(0, 4096).is_err());
    }

    #[test]
    fn features_name_every_kind_once_and_absent_ones_in_the_line() {
        let f = features();
        let names: Vec<&str> = f.iter().map(|x| x.name).collect();
        assert_eq!(
            names,
            ["uncached reads", "large pages", "memory cap", "plugins"]
        );
        assert!(f[0].detail.contains(UNCACHED), "{:?}", f[0]);
        assert!(f[3].detail.contains(std::env::consts::DLL_SUFFIX));
        match absent_line() {
            Some(l) => {
                for x in f.iter().filter(|x| !x.present) {
                    assert!(l.contains(&x.line()), "{l}");
                }
            }
            None => assert!(f.iter().all(|x| x.present)),
        }
        let gone = Feature {
            name: "large pages",
            present: false,
            detail: "none here".into(),
        };
        assert_eq!(gone.line(), "large pages: absent (none here)");
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn linux_has_uncached_reads_and_memory_caps() {
        let f = features();
        assert!(f[0].present && f[2].present && f[3].present, "{f:?}");
        assert!(f[2].detail.contains("memory cgroup"), "{f:?}");
        assert_eq!(UNCACHED, "O_DIRECT");
        // large pages are absent only when THP is `never` and no pool is reserved
        let thp = memory::transparent_huge_pages();
        assert_eq!(
            f[1].present,
            thp != "never"
                || f[1].detail.contains("pool vm.nr_hugepages")
                    && !f[1].detail.ends_with(" 0 pages"),
            "{f:?}"
        );
    }
}
