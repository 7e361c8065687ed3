//! Windows: uncached reads with `FILE_FLAG_NO_BUFFERING | FILE_FLAG_OVERLAPPED` (offsets,
//! lengths and buffer addresses sector-aligned: the engine rounds every uncached read out to
//! 4096 bytes and its buffers are 4096-aligned, which covers 512-byte and 4 KiB sectors), each
//! read an overlapped `ReadFile` with its own event so the reader threads' requests are in
//! flight together on one handle; memory from `GlobalMemoryStatusEx`, the job object's
//! process and job memory limits from `QueryInformationJobObject`, usage from
//! `GetProcessMemoryInfo`; `VirtualAlloc`, `VirtualLock`, `PrefetchVirtualMemory`. No
//! large pages (`MEM_LARGE_PAGES` needs the "Lock pages in memory" privilege; not used) and
//! no residency query or populate advice: reported absent, callers fall back. Compiled and
//! linted in CI for `x86_64-pc-windows-gnu`, not run.

use std::fs::File;
use std::io;
use std::os::windows::ffi::OsStrExt;
use std::os::windows::fs::OpenOptionsExt;
use std::os::windows::io::AsRawHandle;
use std::path::Path;
use std::ptr::NonNull;

use windows_sys::Win32::Foundation::{
    CloseHandle, ERROR_HANDLE_EOF, ERROR_IO_PENDING, GetLastError, HANDLE,
};
use windows_sys::Win32::Storage::FileSystem::{
    FILE_FLAG_NO_BUFFERING, FILE_FLAG_OVERLAPPED, FILE_FLAG_WRITE_THROUGH, GetDiskFreeSpaceExW,
    GetVolumeInformationW, GetVolumePathNameW, ReadFile,
};
use windows_sys::Win32::System::IO::{GetOverlappedResult, OVERLAPPED};
use windows_sys::Win32::System::JobObjects::{
    JOB_OBJECT_LIMIT_JOB_MEMORY, JOB_OBJECT_LIMIT_PROCESS_MEMORY,
    JOBOBJECT_EXTENDED_LIMIT_INFORMATION, JobObjectExtendedLimitInformation,
    QueryInformationJobObject,
};
use windows_sys::Win32::System::Memory::{
    MEM_COMMIT, MEM_RELEASE, MEM_RESERVE, PAGE_READWRITE, PrefetchVirtualMemory, VirtualAlloc,
    VirtualFree, VirtualLock, WIN32_MEMORY_RANGE_ENTRY,
};
use windows_sys::Win32::System::ProcessStatus::{
    GetProcessMemoryInfo, PROCESS_MEMORY_COUNTERS, PROCESS_MEMORY_COUNTERS_EX,
};
use windows_sys::Win32::System::SystemInformation::{
    GetSystemInfo, GlobalMemoryStatusEx, MEMORYSTATUSEX, SYSTEM_INFO,
};
use windows_sys::Win32::System::Threading::{CreateEventW, GetCurrentProcess};

use super::memory::{JobMemory, MemInfo, MemoryLimit};
use super::{AnonMap, Feature, FileAdvice, MemAdvice};

pub const OS: &str = "Windows";
pub const UNCACHED: &str = "FILE_FLAG_NO_BUFFERING";
pub const ELOOP: i32 = 1921;
pub const HAS_RESERVED_HUGE: bool = false;

fn unsupported(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::Unsupported, format!("Windows has no {what}"))
}

pub fn open_uncached(path: &Path) -> io::Result<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(FILE_FLAG_NO_BUFFERING | FILE_FLAG_OVERLAPPED)
        .open(path)
}

pub fn create_uncached(path: &Path) -> io::Result<File> {
    // Writes go through std's synchronous write, so no FILE_FLAG_OVERLAPPED here.
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .custom_flags(FILE_FLAG_NO_BUFFERING | FILE_FLAG_WRITE_THROUGH)
        .open(path)
}

/// Windows does not report a direct-I/O alignment per file here: the 4096 default applies.
pub fn dio_align(_path: &Path) -> Option<(usize, usize)> {
    None
}

/// An event handle closed on drop.
struct Event(HANDLE);

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: a handle this module created and nothing else closes.
        unsafe { CloseHandle(self.0) };
    }
}

/// One `ReadFile` at `offset` with an OVERLAPPED of its own (works on overlapped and
/// synchronous handles alike); waits for it. End of file is `Ok(0)`.
pub fn read_at(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let len = u32::try_from(buf.len()).unwrap_or(u32::MAX);
    // SAFETY: no attributes, manual reset, not signalled, unnamed.
    let ev = unsafe { CreateEventW(std::ptr::null(), 1, 0, std::ptr::null()) };
    if ev.is_null() {
        return Err(io::Error::last_os_error());
    }
    let ev = Event(ev);
    // SAFETY: an all-zero OVERLAPPED is valid; offset and event are set below.
    let mut ov: OVERLAPPED = unsafe { std::mem::zeroed() };
    ov.Anonymous.Anonymous.Offset = offset as u32;
    ov.Anonymous.Anonymous.OffsetHigh = (offset >> 32) as u32;
    ov.hEvent = ev.0;
    let h = file.as_raw_handle() as HANDLE;
    let mut n: u32 = 0;
    // SAFETY: `buf` holds `len` writable bytes and, like `ov`, outlives the request: it is
    // waited for below before either goes out of scope.
    let ok = unsafe { ReadFile(h, buf.as_mut_ptr(), len, &mut n, &mut ov) };
    if ok == 0 {
        // SAFETY: no memory effects.
        let err = unsafe { GetLastError() };
        if err == ERROR_HANDLE_EOF {
            return Ok(0);
        }
        if err != ERROR_IO_PENDING {
            return Err(io::Error::from_raw_os_error(err as i32));
        }
        // SAFETY: the request was issued with `ov`; bWait = TRUE waits for it to finish.
        if unsafe { GetOverlappedResult(h, &ov, &mut n, 1) } == 0 {
            // SAFETY: no memory effects.
            let err = unsafe { GetLastError() };
            if err == ERROR_HANDLE_EOF {
                return Ok(0);
            }
            return Err(io::Error::from_raw_os_error(err as i32));
        }
    }
    Ok(n as usize)
}

/// std's positional write (`WriteFile` with an OVERLAPPED offset) on a synchronous handle.
pub fn write_at(file: &File, buf: &[u8], offset: u64) -> io::Result<usize> {
    use std::os::windows::fs::FileExt;
    let n = buf.len().min(u32::MAX as usize);
    file.seek_write(&buf[..n], offset)
}

pub fn advise_file(_file: &File, advice: FileAdvice) -> io::Result<()> {
    Err(unsupported(&format!("file advice {advice:?}")))
}

pub fn page_size() -> Option<usize> {
    // SAFETY: an all-zero SYSTEM_INFO is a valid out value.
    let mut si: SYSTEM_INFO = unsafe { std::mem::zeroed() };
    // SAFETY: a valid out pointer.
    unsafe { GetSystemInfo(&mut si) };
    usize::try_from(si.dwPageSize).ok().filter(|&p| p > 0)
}

fn ok(r: i32) -> io::Result<()> {
    if r != 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// # Safety
/// See [`super::advise_memory`].
pub unsafe fn advise_memory(addr: usize, len: usize, advice: MemAdvice) -> io::Result<()> {
    match advice {
        MemAdvice::WillNeed => {
            let range = WIN32_MEMORY_RANGE_ENTRY {
                VirtualAddress: addr as *mut core::ffi::c_void,
                NumberOfBytes: len,
            };
            // SAFETY: the caller guarantees the range; the call only reads pages in.
            ok(unsafe { PrefetchVirtualMemory(GetCurrentProcess(), 1, &range, 0) })
        }
        _ => Err(unsupported(&format!("{advice:?} memory advice"))),
    }
}

/// # Safety
/// See [`super::resident_pages`].
pub unsafe fn resident_pages(_addr: usize, _len: usize, _out: &mut [u8]) -> io::Result<()> {
    Err(unsupported("page residency query (mincore)"))
}

/// # Safety
/// See [`super::lock_memory`].
pub unsafe fn lock_memory(addr: usize, len: usize) -> io::Result<()> {
    // SAFETY: the caller guarantees the range.
    ok(unsafe { VirtualLock(addr as *const core::ffi::c_void, len) })
}

fn process_memory() -> Option<PROCESS_MEMORY_COUNTERS_EX> {
    // SAFETY: an all-zero counters struct is a valid out value.
    let mut c: PROCESS_MEMORY_COUNTERS_EX = unsafe { std::mem::zeroed() };
    c.cb = std::mem::size_of::<PROCESS_MEMORY_COUNTERS_EX>() as u32;
    // SAFETY: `c` is as large as `cb` says; the EX struct starts with the plain one.
    let r = unsafe {
        GetProcessMemoryInfo(
            GetCurrentProcess(),
            (&mut c as *mut PROCESS_MEMORY_COUNTERS_EX).cast::<PROCESS_MEMORY_COUNTERS>(),
            c.cb,
        )
    };
    (r != 0).then_some(c)
}

pub fn peak_rss_bytes() -> Option<u64> {
    process_memory().map(|c| c.PeakWorkingSetSize as u64)
}

pub fn disk_free_bytes(path: &Path) -> io::Result<u64> {
    let wide: Vec<u16> = path.as_os_str().encode_wide().chain([0]).collect();
    let mut free = 0u64;
    // SAFETY: a NUL-terminated wide path and a valid out pointer; the others may be null.
    ok(unsafe {
        GetDiskFreeSpaceExW(
            wide.as_ptr(),
            &mut free,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        )
    })?;
    Ok(free)
}

pub fn fs_type(path: &Path) -> io::Result<super::FsType> {
    let wide: Vec<u16> = path.as_os_str().encode_wide().chain([0]).collect();
    let mut root = [0u16; 1024];
    // SAFETY: a NUL-terminated wide path and an out buffer of the length passed.
    ok(unsafe { GetVolumePathNameW(wide.as_ptr(), root.as_mut_ptr(), root.len() as u32) })?;
    let mut name = [0u16; 64];
    // SAFETY: `root` is NUL-terminated (written above); the out buffer has the length passed
    // and every other out pointer may be null.
    ok(unsafe {
        GetVolumeInformationW(
            root.as_ptr(),
            std::ptr::null_mut(),
            0,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            name.as_mut_ptr(),
            name.len() as u32,
        )
    })?;
    let n = name.iter().position(|&c| c == 0).unwrap_or(name.len());
    Ok(super::FsType::Name(String::from_utf16_lossy(&name[..n])))
}

/// Windows has no SIGPIPE: a write to a closed pipe is an error the writer sees.
pub fn default_sigpipe() {}

/// Reserve and commit `len + align` bytes and use the aligned part; Windows cannot release
/// part of an allocation, so the whole one is released on drop.
pub fn map_anon(len: usize, align: usize) -> io::Result<AnonMap> {
    let total = len
        .checked_add(align)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "map overflows"))?;
    // SAFETY: a fresh allocation with no address hint; the result is checked.
    let base = unsafe {
        VirtualAlloc(
            std::ptr::null(),
            total,
            MEM_RESERVE | MEM_COMMIT,
            PAGE_READWRITE,
        )
    };
    let base = NonNull::new(base.cast::<u8>()).ok_or_else(io::Error::last_os_error)?;
    let start = (base.as_ptr() as usize).next_multiple_of(align);
    Ok(AnonMap {
        start: NonNull::new(start as *mut u8)
            .ok_or_else(|| io::Error::other("VirtualAlloc returned a null aligned start"))?,
        len,
        base,
        base_len: total,
        huge_reserved: false,
    })
}

pub fn map_reserved_huge(_len: usize) -> Option<AnonMap> {
    None
}

/// # Safety
/// `base` must be an allocation this module made and nothing uses any more.
pub unsafe fn unmap(base: NonNull<u8>, _len: usize) {
    // SAFETY: forwarded from the caller; MEM_RELEASE takes size 0 and the base address.
    unsafe { VirtualFree(base.as_ptr().cast(), 0, MEM_RELEASE) };
}

fn global_memory() -> Option<MEMORYSTATUSEX> {
    // SAFETY: an all-zero MEMORYSTATUSEX is valid; dwLength is set as the call requires.
    let mut m: MEMORYSTATUSEX = unsafe { std::mem::zeroed() };
    m.dwLength = std::mem::size_of::<MEMORYSTATUSEX>() as u32;
    // SAFETY: a valid out pointer with dwLength set.
    (unsafe { GlobalMemoryStatusEx(&mut m) } != 0).then_some(m)
}

/// The tightest memory limit of the job object this process is in (process or job limit),
/// with this process's private bytes as the usage; `None` outside a job or without a limit.
fn job_memory() -> Option<JobMemory> {
    // SAFETY: an all-zero info struct is a valid out value.
    let mut info: JOBOBJECT_EXTENDED_LIMIT_INFORMATION = unsafe { std::mem::zeroed() };
    // SAFETY: a null job handle asks about the job of the calling process; the buffer has
    // the size passed.
    let r = unsafe {
        QueryInformationJobObject(
            std::ptr::null_mut(),
            JobObjectExtendedLimitInformation,
            (&mut info as *mut JOBOBJECT_EXTENDED_LIMIT_INFORMATION).cast(),
            std::mem::size_of::<JOBOBJECT_EXTENDED_LIMIT_INFORMATION>() as u32,
            std::ptr::null_mut(),
        )
    };
    if r == 0 {
        return None;
    }
    let flags = info.BasicLimitInformation.LimitFlags;
    let usage = process_memory().map_or(0, |c| c.PrivateUsage as u64);
    let mut limits = Vec::new();
    if flags & JOB_OBJECT_LIMIT_PROCESS_MEMORY != 0 {
        limits.push(("process", info.ProcessMemoryLimit as u64));
    }
    if flags & JOB_OBJECT_LIMIT_JOB_MEMORY != 0 {
        limits.push(("job", info.JobMemoryLimit as u64));
    }
    let (scope, limit_bytes) = limits.into_iter().min_by_key(|&(_, l)| l)?;
    Some(JobMemory {
        scope,
        limit_bytes,
        usage_bytes: usage,
    })
}

pub fn meminfo() -> Option<MemInfo> {
    let m = global_memory()?;
    Some(MemInfo {
        total: m.ullTotalPhys,
        available: m.ullAvailPhys,
        huge_page_size: 0,
        huge_pages_total: 0,
        huge_pages_free: 0,
    })
}

pub fn memory_limit() -> MemoryLimit {
    MemoryLimit {
        mem_available_bytes: global_memory().map(|m| m.ullAvailPhys),
        cgroup: None,
        job: job_memory(),
    }
}

pub fn features() -> Vec<Feature> {
    let cap = match job_memory() {
        Some(j) => format!(
            "job object {} memory limit {} bytes",
            j.scope, j.limit_bytes
        ),
        None => "job object memory limits (this process has none)".to_string(),
    };
    vec![
        Feature {
            name: "uncached reads",
            present: true,
            detail: "FILE_FLAG_NO_BUFFERING (sector-aligned, overlapped reads)".to_string(),
        },
        Feature {
            name: "large pages",
            present: false,
            detail: "MEM_LARGE_PAGES needs the SeLockMemoryPrivilege (\"Lock pages in \
                     memory\"); buffers use 4 KiB pages"
                .to_string(),
        },
        Feature {
            name: "memory cap",
            present: true,
            detail: cap,
        },
    ]
}
