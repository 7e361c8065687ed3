//! macOS: uncached reads with `fcntl(F_NOCACHE)` (no alignment rule; the engine's 4096-byte
//! rounding is kept so buffers and pieces are the same everywhere), read-ahead hints with
//! `F_RDADVISE` and `F_RDAHEAD`, `madvise`/`mincore`/`mlock`, memory from
//! `sysctl hw.memsize` and `host_statistics64` (what `vm_stat` prints). No huge-page advice and
//! no reserved pool (Apple silicon pages are 16 KiB and the kernel offers no larger ones to a
//! process), no per-process memory cap: both reported absent. Compiled and linted in CI for
//! `aarch64-apple-darwin`, not run.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::ptr::NonNull;

use super::memory::{MemInfo, MemoryLimit};
use super::{AnonMap, Feature, FileAdvice, MemAdvice};

pub const OS: &str = "macOS";
pub const UNCACHED: &str = "F_NOCACHE";
pub const ELOOP: i32 = libc::ELOOP;
pub const HAS_RESERVED_HUGE: bool = false;

fn rc(r: libc::c_int) -> io::Result<()> {
    if r == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn set_nocache(f: File) -> io::Result<File> {
    // SAFETY: a valid open fd; F_NOCACHE takes an int flag and has no memory effects.
    rc(unsafe { libc::fcntl(f.as_raw_fd(), libc::F_NOCACHE, 1) })?;
    Ok(f)
}

pub fn open_uncached(path: &Path) -> io::Result<File> {
    set_nocache(File::open(path)?)
}

pub fn create_uncached(path: &Path) -> io::Result<File> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o644)
        .open(path)?;
    set_nocache(f)
}

/// macOS does not report a direct-I/O alignment (`F_NOCACHE` has none): the default applies.
pub fn dio_align(_path: &Path) -> Option<(usize, usize)> {
    None
}

/// `pread`; the caller keeps each request below 2 GiB (macOS refuses larger with `EINVAL`).
pub fn read_at(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    file.read_at(buf, offset)
}

pub fn write_at(file: &File, buf: &[u8], offset: u64) -> io::Result<usize> {
    file.write_at(buf, offset)
}

pub fn advise_file(file: &File, advice: FileAdvice) -> io::Result<()> {
    let fd = file.as_raw_fd();
    match advice {
        // SAFETY: a valid fd; F_RDAHEAD takes an int flag.
        FileAdvice::Random => rc(unsafe { libc::fcntl(fd, libc::F_RDAHEAD, 0) }),
        FileAdvice::WillNeed { offset, len } => {
            let bad = || io::Error::new(io::ErrorKind::InvalidInput, "range past off_t/int");
            let ra = libc::radvisory {
                ra_offset: libc::off_t::try_from(offset).map_err(|_| bad())?,
                ra_count: libc::c_int::try_from(len).unwrap_or(libc::c_int::MAX),
            };
            // SAFETY: a valid fd and a pointer to a radvisory that outlives the call.
            rc(unsafe { libc::fcntl(fd, libc::F_RDADVISE, &ra) })
        }
        FileAdvice::DontNeed { .. } => Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "macOS has no advice to drop a file range from the cache (F_NOCACHE reads do not \
             fill it)",
        )),
    }
}

pub fn page_size() -> Option<usize> {
    // SAFETY: sysconf has no memory effects.
    usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).ok()
}

/// # Safety
/// See [`super::advise_memory`].
pub unsafe fn advise_memory(addr: usize, len: usize, advice: MemAdvice) -> io::Result<()> {
    let adv = match advice {
        MemAdvice::WillNeed => libc::MADV_WILLNEED,
        MemAdvice::DontNeed => libc::MADV_DONTNEED,
        MemAdvice::HugePage | MemAdvice::PopulateRead | MemAdvice::PopulateWrite => {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!("macOS has no {advice:?} memory advice"),
            ));
        }
    };
    // SAFETY: the caller guarantees the range is its own live mapping.
    rc(unsafe { libc::madvise(addr as *mut libc::c_void, len, adv) })
}

/// # Safety
/// See [`super::resident_pages`].
pub unsafe fn resident_pages(addr: usize, len: usize, out: &mut [u8]) -> io::Result<()> {
    // SAFETY: the caller guarantees the range; `out` has a byte per page.
    rc(unsafe { libc::mincore(addr as *const libc::c_void, len, out.as_mut_ptr().cast()) })
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
    // macOS reports ru_maxrss in bytes (Linux: KiB).
    (r == 0).then_some(ru.ru_maxrss as u64)
}

pub fn disk_free_bytes(path: &Path) -> io::Result<u64> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a path with a NUL byte"))?;
    // SAFETY: zeroed statvfs is a valid out value.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid NUL-terminated path and out pointer.
    rc(unsafe { libc::statvfs(c.as_ptr(), &mut st) })?;
    Ok(st.f_bavail as u64 * st.f_frsize as u64)
}

pub fn fs_type(path: &Path) -> io::Result<super::FsType> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a path with a NUL byte"))?;
    // SAFETY: zeroed statfs is a valid out value.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid NUL-terminated path and out pointer.
    rc(unsafe { libc::statfs(c.as_ptr(), &mut st) })?;
    let name: Vec<u8> = st
        .f_fstypename
        .iter()
        .take_while(|&&b| b != 0)
        .map(|&b| b as u8)
        .collect();
    Ok(super::FsType::Name(
        String::from_utf8_lossy(&name).into_owned(),
    ))
}

pub fn default_sigpipe() {
    // SAFETY: resetting a signal disposition to its default has no memory effects.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

pub fn map_anon(len: usize, align: usize) -> io::Result<AnonMap> {
    let slack = align.saturating_sub(4096);
    let map_len = len
        .checked_add(slack)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "map overflows"))?;
    // SAFETY: anonymous private mapping with no address hint; the result is checked.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            map_len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANON,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    // Pages may be 16 KiB: trimming the ends could cut a page in two, so the whole mapping
    // is kept and unmapped at once.
    let start = (base as usize).next_multiple_of(align);
    Ok(AnonMap {
        start: NonNull::new(start as *mut u8)
            .ok_or_else(|| io::Error::other("mmap returned a null aligned start"))?,
        len,
        base: NonNull::new(base as *mut u8)
            .ok_or_else(|| io::Error::other("mmap returned null"))?,
        base_len: map_len,
        huge_reserved: false,
    })
}

pub fn map_reserved_huge(_len: usize) -> Option<AnonMap> {
    None
}

/// # Safety
/// `base..base+len` must be a range this module mapped and nothing uses any more.
pub unsafe fn unmap(base: NonNull<u8>, len: usize) {
    // SAFETY: forwarded from the caller.
    unsafe {
        libc::munmap(base.as_ptr() as *mut libc::c_void, len);
    }
}

fn sysctl_u64(name: &str) -> Option<u64> {
    let c = CString::new(name).ok()?;
    let mut v: u64 = 0;
    let mut size = std::mem::size_of::<u64>();
    // SAFETY: `v` is a valid out buffer of `size` bytes; no new value is set.
    let r = unsafe {
        libc::sysctlbyname(
            c.as_ptr(),
            (&mut v as *mut u64).cast(),
            &mut size,
            std::ptr::null_mut(),
            0,
        )
    };
    (r == 0 && size == std::mem::size_of::<u64>()).then_some(v)
}

/// Free + inactive + speculative pages (what `vm_stat` lists), in bytes: the memory a
/// process can take without the system compressing or swapping the memory of others.
fn available_bytes() -> Option<u64> {
    // SAFETY: zeroed vm_statistics64 is a valid out value.
    let mut st: libc::vm_statistics64 = unsafe { std::mem::zeroed() };
    let mut count = libc::HOST_VM_INFO64_COUNT;
    // SAFETY: `st` holds HOST_VM_INFO64_COUNT integers; the kernel writes at most `count`.
    #[allow(deprecated)] // mach_host_self: libc points at the mach2 crate; the call is the same
    let r = unsafe {
        libc::host_statistics64(
            libc::mach_host_self(),
            libc::HOST_VM_INFO64,
            (&mut st as *mut libc::vm_statistics64).cast(),
            &mut count,
        )
    };
    if r != libc::KERN_SUCCESS {
        return None;
    }
    let page = page_size()? as u64;
    let pages =
        u64::from(st.free_count) + u64::from(st.inactive_count) + u64::from(st.speculative_count);
    Some(pages * page)
}

pub fn meminfo() -> Option<MemInfo> {
    Some(MemInfo {
        total: sysctl_u64("hw.memsize")?,
        available: available_bytes()?,
        huge_page_size: 0,
        huge_pages_total: 0,
        huge_pages_free: 0,
    })
}

pub fn memory_limit() -> MemoryLimit {
    MemoryLimit {
        mem_available_bytes: available_bytes(),
        cgroup: None,
        job: None,
    }
}

pub fn features() -> Vec<Feature> {
    vec![
        Feature {
            name: "uncached reads",
            present: true,
            detail: "F_NOCACHE (read-ahead hints with F_RDADVISE)".to_string(),
        },
        Feature {
            name: "large pages",
            present: false,
            detail: "macOS offers no huge-page advice or reserved pool to a process; buffers use \
                     its base pages"
                .to_string(),
        },
        Feature {
            name: "memory cap",
            present: false,
            detail: "macOS has no per-process memory cgroup; the budget is checked against \
                     vm_stat's free + inactive + speculative pages"
                .to_string(),
        },
    ]
}
