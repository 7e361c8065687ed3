//! Linux: `O_DIRECT` with `statx(STATX_DIOALIGN)`, `posix_fadvise`, `madvise` (transparent
//! huge pages, `MADV_POPULATE_READ`/`WRITE`), `MAP_HUGETLB` from the `vm.nr_hugepages` pool,
//! `getrusage`, `statvfs`; memory from /proc/meminfo and the memory cgroup
//! ([`super::memory`]). Run by every test in CI.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::ptr::NonNull;

use super::{AnonMap, Feature, FileAdvice, MemAdvice};

pub const OS: &str = "Linux";
pub const UNCACHED: &str = "O_DIRECT";
pub const ELOOP: i32 = libc::ELOOP;
pub const HAS_RESERVED_HUGE: bool = true;

const HUGE_PAGE: usize = 2 << 20;

pub fn open_uncached(path: &Path) -> io::Result<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
}

pub fn create_uncached(path: &Path) -> io::Result<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
}

fn c_path(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a path with a NUL byte"))
}

/// `statx(STATX_DIOALIGN)` (Linux >= 6.1); `None` when the filesystem does not report it
/// (tmpfs, older kernels) or reports 0 ("direct I/O not supported").
pub fn dio_align(path: &Path) -> Option<(usize, usize)> {
    let c = c_path(path).ok()?;
    // SAFETY: zeroed statx is a valid (if meaningless) value; the kernel fills it.
    let mut st: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a valid NUL-terminated path and `st` a valid out pointer.
    let rc = unsafe { libc::statx(libc::AT_FDCWD, c.as_ptr(), 0, libc::STATX_DIOALIGN, &mut st) };
    if rc != 0 || st.stx_mask & libc::STATX_DIOALIGN == 0 {
        return None;
    }
    let mem = st.stx_dio_mem_align as usize;
    let offset = st.stx_dio_offset_align as usize;
    (mem.is_power_of_two() && offset.is_power_of_two()).then_some((mem, offset))
}

pub fn read_at(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    file.read_at(buf, offset)
}

pub fn write_at(file: &File, buf: &[u8], offset: u64) -> io::Result<usize> {
    file.write_at(buf, offset)
}

pub fn advise_file(file: &File, advice: FileAdvice) -> io::Result<()> {
    let (off, len, adv) = match advice {
        FileAdvice::Random => (0, 0, libc::POSIX_FADV_RANDOM),
        FileAdvice::WillNeed { offset, len } => (offset, len, libc::POSIX_FADV_WILLNEED),
        FileAdvice::DontNeed { offset, len } => (offset, len, libc::POSIX_FADV_DONTNEED),
    };
    let too_big = || io::Error::new(io::ErrorKind::InvalidInput, "range past off_t");
    let off = libc::off_t::try_from(off).map_err(|_| too_big())?;
    let len = libc::off_t::try_from(len).map_err(|_| too_big())?;
    // SAFETY: a valid open fd; the call only advises the kernel.
    let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), off, len, adv) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::from_raw_os_error(rc))
    }
}

pub fn page_size() -> Option<usize> {
    // SAFETY: sysconf has no memory effects.
    usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).ok()
}

fn rc(r: libc::c_int) -> io::Result<()> {
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// # Safety
/// See [`super::advise_memory`].
pub unsafe fn advise_memory(addr: usize, len: usize, advice: MemAdvice) -> io::Result<()> {
    let adv = match advice {
        MemAdvice::HugePage => libc::MADV_HUGEPAGE,
        MemAdvice::WillNeed => libc::MADV_WILLNEED,
        MemAdvice::DontNeed => libc::MADV_DONTNEED,
        MemAdvice::PopulateRead => libc::MADV_POPULATE_READ,
        MemAdvice::PopulateWrite => libc::MADV_POPULATE_WRITE,
    };
    // SAFETY: the caller guarantees the range is its own live mapping.
    rc(unsafe { libc::madvise(addr as *mut libc::c_void, len, adv) })
}

/// # Safety
/// See [`super::resident_pages`].
pub unsafe fn resident_pages(addr: usize, len: usize, out: &mut [u8]) -> io::Result<()> {
    // SAFETY: the caller guarantees the range; `out` has a byte per page.
    rc(unsafe { libc::mincore(addr as *mut libc::c_void, len, out.as_mut_ptr()) })
}

/// # Safety
/// See [`super::lock_memory`].
pub unsafe fn lock_memory(addr: usize, len: usize) -> io::Result<()> {
    // SAFETY: the caller guarantees the range; mlock does not change the contents.
    rc(unsafe { libc::mlock(addr as *const libc::c_void, len) })
}

pub fn peak_rss_bytes() -> Option<u64> {
    // SAFETY: getrusage only writes into the zeroed struct we pass.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointer to a rusage struct; RUSAGE_SELF is always valid.
    let r = unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    // Linux reports ru_maxrss in KiB.
    (r == 0).then(|| (ru.ru_maxrss as u64) * 1024)
}

pub fn disk_free_bytes(path: &Path) -> io::Result<u64> {
    let c = c_path(path)?;
    // SAFETY: zeroed statvfs is a valid out value.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid NUL-terminated path and out pointer.
    rc(unsafe { libc::statvfs(c.as_ptr(), &mut st) })?;
    Ok(st.f_bavail as u64 * st.f_frsize as u64)
}

pub fn fs_type(path: &Path) -> io::Result<super::FsType> {
    let c = c_path(path)?;
    // SAFETY: zeroed statfs is a valid out value.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid NUL-terminated path and out pointer.
    rc(unsafe { libc::statfs(c.as_ptr(), &mut st) })?;
    #[allow(clippy::unnecessary_cast)] // `f_type` is not i64 on every Linux target
    Ok(super::FsType::Magic(st.f_type as i64))
}

pub fn default_sigpipe() {
    // SAFETY: resetting a signal disposition to its default has no memory effects.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// Over-map by `align - 4096` so an aligned start exists, then unmap both ends.
pub fn map_anon(len: usize, align: usize) -> io::Result<AnonMap> {
    let slack = align - 4096;
    let map_len = len.checked_add(slack).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("a map of {len} bytes overflows the address space"),
        )
    })?;
    // SAFETY: anonymous private mapping with no address hint; the result is checked.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            map_len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(
            e.kind(),
            format!("mmap of a {map_len}-byte anonymous buffer failed: {e}"),
        ));
    }
    let base_addr = base as usize;
    let start = base_addr.next_multiple_of(align);
    let head = start - base_addr;
    let tail = map_len - head - len;
    // SAFETY: both ranges lie inside the mapping just created and are page-aligned (mmap
    // returns page-aligned addresses; `head`, `len` and `slack` are multiples of 4096).
    unsafe {
        if head > 0 {
            libc::munmap(base, head);
        }
        if tail > 0 {
            libc::munmap((start + len) as *mut libc::c_void, tail);
        }
    }
    let start = NonNull::new(start as *mut u8)
        .ok_or_else(|| io::Error::other("mmap returned a null aligned start"))?;
    Ok(AnonMap {
        start,
        len,
        base: start,
        base_len: len,
        huge_reserved: false,
    })
}

/// Without MAP_NORESERVE the kernel reserves every page now or fails with ENOMEM, so no later
/// fault on the range can fail for want of a page.
pub fn map_reserved_huge(len: usize) -> Option<AnonMap> {
    if len == 0 || !len.is_multiple_of(HUGE_PAGE) {
        return None;
    }
    // SAFETY: anonymous private mapping with no address hint; the result is checked.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_HUGETLB | libc::MAP_HUGE_2MB,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return None;
    }
    let start = NonNull::new(base as *mut u8)?;
    let map = AnonMap {
        start,
        len,
        base: start,
        base_len: len,
        huge_reserved: true,
    };
    // A hugetlb mapping starts on a huge page; anything else is not what was asked for
    // (dropping the map unmaps it).
    (base as usize).is_multiple_of(HUGE_PAGE).then_some(map)
}

/// # Safety
/// `base..base+len` must be a range this module mapped and nothing uses any more.
pub unsafe fn unmap(base: NonNull<u8>, len: usize) {
    // SAFETY: forwarded from the caller.
    unsafe {
        libc::munmap(base.as_ptr() as *mut libc::c_void, len);
    }
}

pub fn features() -> Vec<Feature> {
    let thp = super::memory::transparent_huge_pages();
    let pool = super::memory::meminfo().map_or(0, |m| m.huge_pages_total);
    let cgroup = match super::memory::cgroup_memory_at(Path::new("/")) {
        Some(c) => format!(
            "memory cgroup {} limit {} bytes ({})",
            c.version.name(),
            c.limit_bytes,
            c.dir.display()
        ),
        None => "memory cgroup v2/v1 (no limit set for this process)".to_string(),
    };
    vec![
        Feature {
            name: "uncached reads",
            present: true,
            detail: "O_DIRECT (alignment from statx STATX_DIOALIGN; buffered where a filesystem \
                     refuses it)"
                .to_string(),
        },
        Feature {
            name: "large pages",
            present: thp != "never" || pool > 0,
            detail: format!(
                "transparent huge pages [{thp}], reserved pool vm.nr_hugepages {pool} pages"
            ),
        },
        Feature {
            name: "memory cap",
            present: true,
            detail: cgroup,
        },
    ]
}
