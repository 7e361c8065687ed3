//! Memory facts, read in one place: the memory this process may use (on Linux `MemAvailable`
//! from /proc/meminfo and the memory cgroup headroom, cgroup v2 then v1; on macOS and Windows
//! what the platform layer's `sys` module reads: `host_statistics64`, `GlobalMemoryStatusEx`
//! and job-object limits), the reserved huge-page pool (`vm.nr_hugepages`) and the
//! transparent huge page mode (Linux only).
//!
//! Owns: reading /proc/meminfo, /proc/self/cgroup, the cgroup memory files and
//! /sys/kernel/mm/transparent_hugepage/enabled, and parsing their text (each parser takes the
//! text, so tests feed it samples; [`memory_limit_at`] takes the root, so tests give it a fake
//! tree). Used by planning ([`crate::session`], [`crate::stream::plan`]'s decode-state check),
//! the resident arena ([`crate::resident`]), the buffers' huge-page choice and `k3-run doctor`.
//! Must not: decide anything (presets, budgets): callers do.

use std::path::{Path, PathBuf};

use crate::stream::fmt_bytes;

/// The fields of /proc/meminfo that `k3-run doctor` reports, in bytes (huge-page counts in
/// pages).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct MemInfo {
    pub total: u64,
    pub available: u64,
    pub huge_page_size: u64,
    /// Pages of the reserved huge-page pool (`vm.nr_hugepages`): total and free.
    pub huge_pages_total: u64,
    pub huge_pages_free: u64,
}

/// This machine's memory: /proc/meminfo on Linux ([`parse_meminfo`]), `hw.memsize` and
/// `host_statistics64` on macOS, `GlobalMemoryStatusEx` on Windows; `None` when unreadable or
/// incomplete.
pub fn meminfo() -> Option<MemInfo> {
    #[cfg(target_os = "linux")]
    {
        parse_meminfo(&std::fs::read_to_string("/proc/meminfo").ok()?)
    }
    #[cfg(not(target_os = "linux"))]
    {
        super::sys::meminfo()
    }
}

/// What this platform calls the figures of [`MemInfo`] and [`MemoryLimit`]: (total,
/// available, memory cap).
pub fn terms() -> (&'static str, &'static str, &'static str) {
    if cfg!(target_os = "linux") {
        ("MemTotal", "MemAvailable", "cgroup limit")
    } else if cfg!(target_os = "macos") {
        (
            "hw.memsize",
            "free + inactive + speculative (vm_stat)",
            "memory cap (absent on macOS)",
        )
    } else {
        ("total physical", "available physical", "job object limit")
    }
}

/// Parse /proc/meminfo text; `None` without `MemTotal` or `MemAvailable` (kernels < 3.14).
pub fn parse_meminfo(text: &str) -> Option<MemInfo> {
    let field = |key: &str| -> Option<u64> {
        text.lines().find_map(|l| {
            let rest = l.strip_prefix(key)?.strip_prefix(':')?;
            let kb: u64 = rest.trim().trim_end_matches("kB").trim().parse().ok()?;
            Some(kb * 1024)
        })
    };
    let count = |key: &str| -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix(':')?.trim().parse().ok())
            .unwrap_or(0)
    };
    Some(MemInfo {
        total: field("MemTotal")?,
        available: field("MemAvailable")?,
        huge_page_size: field("Hugepagesize").unwrap_or(0),
        huge_pages_total: count("HugePages_Total"),
        huge_pages_free: count("HugePages_Free"),
    })
}

/// The transparent huge page mode (`always`, `madvise`, `never`), or `unknown`; `absent` off
/// Linux.
pub fn transparent_huge_pages() -> String {
    if !cfg!(target_os = "linux") {
        return "absent".into();
    }
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .ok()
        .and_then(|t| parse_thp_mode(&t))
        .unwrap_or_else(|| "unknown".into())
}

/// The bracketed mode of /sys/kernel/mm/transparent_hugepage/enabled text
/// (`always [madvise] never` -> `madvise`).
pub fn parse_thp_mode(text: &str) -> Option<String> {
    let (_, rest) = text.trim().split_once('[')?;
    Some(rest.split(']').next()?.to_string())
}

/// The memory this process may use: the smaller of `MemAvailable` (/proc/meminfo) and the
/// memory cgroup headroom (limit minus usage; cgroup v2, else v1, see [`cgroup_memory_at`]).
/// `None` if neither is readable (non-Linux). Measure it before the session allocates: what
/// the session has already touched counts as usage.
pub fn memory_limit_bytes() -> Option<u64> {
    memory_limit().bytes()
}

/// [`memory_limit_at`] the real root `/` on Linux; the platform's figures elsewhere.
pub fn memory_limit() -> MemoryLimit {
    #[cfg(target_os = "linux")]
    {
        memory_limit_at(Path::new("/"))
    }
    #[cfg(not(target_os = "linux"))]
    {
        super::sys::memory_limit()
    }
}

/// The memory limit seen under `root` (`/` in production; a fake tree in tests): reads
/// `root/proc/meminfo`, `root/proc/self/cgroup` and the cgroup files under `root/sys/fs/cgroup`.
pub fn memory_limit_at(root: &Path) -> MemoryLimit {
    MemoryLimit {
        mem_available_bytes: std::fs::read_to_string(root.join("proc/meminfo"))
            .ok()
            .and_then(|s| parse_meminfo_available(&s)),
        cgroup: cgroup_memory_at(root),
        job: None,
    }
}

/// Free pages of the reserved 2 MiB huge-page pool (`vm.nr_hugepages`) in bytes, from
/// /proc/meminfo; `None` when unreadable or the default huge page is not 2 MiB (the only size
/// [`crate::stream::aligned::PageSource::ReservedFirst`] maps).
pub fn reserved_pool_free_bytes() -> Option<u64> {
    if !cfg!(target_os = "linux") {
        return None;
    }
    parse_reserved_pool_free(&std::fs::read_to_string("/proc/meminfo").ok()?)
}

/// [`reserved_pool_free_bytes`] from the text of /proc/meminfo.
pub fn parse_reserved_pool_free(text: &str) -> Option<u64> {
    let field = |name: &str| {
        text.lines().find_map(|l| {
            let rest = l.strip_prefix(name)?.strip_prefix(':')?;
            rest.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
        })
    };
    let page_kb = field("Hugepagesize")?;
    (page_kb == 2048).then_some(field("HugePages_Free")? * page_kb * 1024)
}

/// `MemAvailable` in bytes from the text of /proc/meminfo.
pub fn parse_meminfo_available(text: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix("MemAvailable:")?;
        let kb: u64 = rest.trim().trim_end_matches("kB").trim().parse().ok()?;
        Some(kb * 1024)
    })
}

/// What bounds this process's memory: the memory available (`MemAvailable` on Linux) and the
/// tightest cap (the memory cgroup on Linux, the job object on Windows; macOS has none).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct MemoryLimit {
    /// `MemAvailable` on Linux; the platform's available figure elsewhere ([`terms`]).
    pub mem_available_bytes: Option<u64>,
    /// `None`: no cgroup limit found (unlimited, the files are missing, or not Linux).
    pub cgroup: Option<CgroupMemory>,
    /// Windows: the job object's memory limit (`None` outside a job or without one).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub job: Option<JobMemory>,
}

/// A Windows job object's memory limit (process or job) and this process's private bytes.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct JobMemory {
    /// `process` (`JOB_OBJECT_LIMIT_PROCESS_MEMORY`) or `job` (`JOB_OBJECT_LIMIT_JOB_MEMORY`).
    pub scope: &'static str,
    pub limit_bytes: u64,
    pub usage_bytes: u64,
}

impl MemoryLimit {
    /// The smallest of the memory available, the cgroup headroom and the job object's
    /// headroom; `None` if none is known.
    pub fn bytes(&self) -> Option<u64> {
        let cg = self.cgroup.as_ref().map(CgroupMemory::headroom);
        let job = self
            .job
            .as_ref()
            .map(|j| j.limit_bytes.saturating_sub(j.usage_bytes));
        [self.mem_available_bytes, cg, job]
            .into_iter()
            .flatten()
            .min()
    }

    /// One start-up line: the limit and where it came from.
    pub fn report_line(&self) -> String {
        let avail = self
            .mem_available_bytes
            .map_or("unknown".to_string(), fmt_bytes);
        match (self.bytes(), &self.cgroup) {
            (Some(b), Some(c)) => format!(
                "memory limit: {} = the smaller of MemAvailable {avail} and the cgroup {} \
                 headroom {} (limit {} - usage {}, {})",
                fmt_bytes(b),
                c.version.name(),
                fmt_bytes(c.headroom()),
                fmt_bytes(c.limit_bytes),
                fmt_bytes(c.usage_bytes),
                c.dir.display()
            ),
            (Some(b), None) if cfg!(target_os = "linux") => format!(
                "memory limit: {} = MemAvailable (no memory cgroup limit: cgroup v2 memory.max \
                 and v1 memory.limit_in_bytes unlimited or unreadable)",
                fmt_bytes(b)
            ),
            (Some(b), None) => match &self.job {
                Some(j) => format!(
                    "memory limit: {} = the smaller of {} {avail} and the job object's {} \
                     memory limit {} - private bytes {}",
                    fmt_bytes(b),
                    terms().1,
                    j.scope,
                    fmt_bytes(j.limit_bytes),
                    fmt_bytes(j.usage_bytes)
                ),
                None => format!(
                    "memory limit: {} = {} ({} has no memory cap set for this process)",
                    fmt_bytes(b),
                    terms().1,
                    super::OS
                ),
            },
            (None, _) => "memory limit: unknown (no /proc/meminfo, no memory cgroup limit); the \
                          decode-state check is skipped"
                .to_string(),
        }
    }
}

/// Which cgroup interface a limit was read from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CgroupVersion {
    /// `memory.limit_in_bytes` / `memory.usage_in_bytes` under `/sys/fs/cgroup/memory`.
    V1,
    /// `memory.max` / `memory.current` under `/sys/fs/cgroup`.
    V2,
}

impl CgroupVersion {
    pub fn name(self) -> &'static str {
        match self {
            CgroupVersion::V1 => "v1",
            CgroupVersion::V2 => "v2",
        }
    }
}

/// The binding memory cgroup: the level (this process's cgroup or an ancestor) with the least
/// headroom.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct CgroupMemory {
    pub version: CgroupVersion,
    /// Directory of the binding cgroup.
    pub dir: PathBuf,
    pub limit_bytes: u64,
    /// Current usage (page cache charged to the cgroup included; 0 if the file is unreadable).
    pub usage_bytes: u64,
}

impl CgroupMemory {
    /// `limit - usage`, 0 if over.
    pub fn headroom(&self) -> u64 {
        self.limit_bytes.saturating_sub(self.usage_bytes)
    }
}

/// A cgroup v1 limit at or above this is "no limit": an unlimited v1 cgroup reports
/// `PAGE_COUNTER_MAX` pages in bytes (9223372036854771712 with 4 KiB pages; a different value
/// just below 2^63 with larger pages). No machine has 2^60 bytes.
pub const CGROUP_V1_UNLIMITED: u64 = 1 << 60;

/// The memory cgroup limit of this process under `root`: cgroup v2 first (the `0::PATH` line
/// of `root/proc/self/cgroup`, `memory.max` = a number or `max`, `memory.current`), then v1
/// (the line whose controller list has `memory`, `memory.limit_in_bytes` below
/// [`CGROUP_V1_UNLIMITED`], `memory.usage_in_bytes`). The process's cgroup and every ancestor
/// up to the mount point are read (a parent's limit binds its children) and the level with the
/// least headroom is returned. If the process's cgroup directory does not exist (a container
/// that mounts its own cgroup at the mount point), the mount point alone is read. `None`
/// without a readable limit (unlimited everywhere, hybrid hierarchy without a v2 memory
/// controller and no v1 limit, missing files, non-Linux).
pub fn cgroup_memory_at(root: &Path) -> Option<CgroupMemory> {
    let text = std::fs::read_to_string(root.join("proc/self/cgroup")).ok()?;
    let (v2, v1) = parse_proc_cgroup(&text);
    let mounts = [
        (CgroupVersion::V2, v2, "sys/fs/cgroup"),
        (CgroupVersion::V1, v1, "sys/fs/cgroup/memory"),
    ];
    mounts.into_iter().find_map(|(version, rel, mount)| {
        let rel = rel?;
        cgroup_levels(&root.join(mount), &rel)
            .into_iter()
            .filter_map(|dir| {
                let (limit_bytes, usage_bytes) = read_cgroup_level(version, &dir)?;
                Some(CgroupMemory {
                    version,
                    dir,
                    limit_bytes,
                    usage_bytes,
                })
            })
            .min_by_key(CgroupMemory::headroom)
    })
}

/// The memory cgroup paths of this process from /proc/self/cgroup text: (v2 `0::PATH`, v1
/// `N:...memory...:PATH`).
pub fn parse_proc_cgroup(text: &str) -> (Option<String>, Option<String>) {
    let (mut v2, mut v1) = (None, None);
    for l in text.lines() {
        let mut it = l.splitn(3, ':');
        let (Some(id), Some(ctrl), Some(path)) = (it.next(), it.next(), it.next()) else {
            continue;
        };
        if id == "0" && ctrl.is_empty() {
            v2 = Some(path.trim().to_string());
        } else if ctrl.split(',').any(|c| c == "memory") {
            v1 = Some(path.trim().to_string());
        }
    }
    (v2, v1)
}

/// The cgroup directory for `rel` under `mount` and its ancestors up to `mount`, leaf first.
fn cgroup_levels(mount: &Path, rel: &str) -> Vec<PathBuf> {
    let rel = Path::new(rel.trim_start_matches('/'));
    let plain = rel
        .components()
        .all(|c| matches!(c, std::path::Component::Normal(_)));
    let leaf = mount.join(rel);
    if !plain || !leaf.is_dir() {
        return vec![mount.to_path_buf()];
    }
    leaf.ancestors()
        .take(rel.components().count() + 1)
        .map(Path::to_path_buf)
        .collect()
}

/// (limit, usage) of one cgroup directory; `None` without a limit (unlimited or unreadable).
fn read_cgroup_level(version: CgroupVersion, dir: &Path) -> Option<(u64, u64)> {
    let read = |name: &str| std::fs::read_to_string(dir.join(name)).ok();
    let (limit_file, usage_file) = match version {
        CgroupVersion::V2 => ("memory.max", "memory.current"),
        CgroupVersion::V1 => ("memory.limit_in_bytes", "memory.usage_in_bytes"),
    };
    let limit: u64 = read(limit_file)?.trim().parse().ok()?; // v2 "max" does not parse: no limit
    if version == CgroupVersion::V1 && limit >= CGROUP_V1_UNLIMITED {
        return None;
    }
    let usage = read(usage_file)
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0);
    Some((limit, usage))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_parse() {
        let t = "MemTotal:       24000000 kB\nMemFree:  1 kB\nMemAvailable:   23000000 kB\n";
        assert_eq!(parse_meminfo_available(t), Some(23_000_000 * 1024));
        assert_eq!(parse_meminfo_available("MemTotal: 1 kB\n"), None);
    }

    #[test]
    fn reserved_pool_parse() {
        let t = "MemAvailable: 9 kB\nHugePages_Total:    1300\nHugePages_Free:     1290\n\
                 HugePages_Rsvd:        0\nHugepagesize:       2048 kB\n";
        assert_eq!(parse_reserved_pool_free(t), Some(1290 * 2048 * 1024));
        let none = t.replace("1290", "0");
        assert_eq!(parse_reserved_pool_free(&none), Some(0));
        // 1 GiB default pages are not what the buffers map
        let gig = t.replace("2048 kB", "1048576 kB");
        assert_eq!(parse_reserved_pool_free(&gig), None);
        assert_eq!(parse_reserved_pool_free("MemTotal: 1 kB\n"), None);
    }

    /// A fake `/` (a temporary directory): `proc/self/cgroup`, `proc/meminfo`, cgroup files.
    struct FakeRoot(tempfile::TempDir);

    impl FakeRoot {
        fn new(proc_cgroup: &str) -> FakeRoot {
            let dir = tempfile::tempdir().expect("create a temporary fake root");
            std::fs::create_dir_all(dir.path().join("proc/self")).expect("create proc/self");
            std::fs::write(dir.path().join("proc/self/cgroup"), proc_cgroup)
                .expect("write proc/self/cgroup");
            std::fs::write(
                dir.path().join("proc/meminfo"),
                "MemTotal: 8000000 kB\nMemAvailable: 4000000 kB\n",
            )
            .expect("write proc/meminfo");
            FakeRoot(dir)
        }
        fn path(&self) -> &Path {
            self.0.path()
        }
        /// Write `files` (name, content) into the cgroup directory `rel` (created).
        fn cgroup(&self, rel: &str, files: &[(&str, &str)]) -> &Self {
            let d = self.path().join(rel);
            std::fs::create_dir_all(&d).expect("create a fake cgroup dir");
            for (name, text) in files {
                std::fs::write(d.join(name), text).expect("write a fake cgroup file");
            }
            self
        }
    }

    const MEM_AVAILABLE: u64 = 4_000_000 * 1024;
    const V1_SENTINEL: &str = "9223372036854771712\n";
    const HYBRID: &str = "9:name=systemd:/\n4:memory:/svc/job\n3:cpuset:/\n0::/\n";

    #[test]
    fn cgroup_v2_limit_is_the_headroom() {
        let r = FakeRoot::new("0::/user.slice/job.scope\n");
        r.cgroup(
            "sys/fs/cgroup/user.slice/job.scope",
            &[
                ("memory.max", "1500000000\n"),
                ("memory.current", "250000000\n"),
            ],
        );
        let m = memory_limit_at(r.path());
        let c = m.cgroup.clone().expect("a v2 limit");
        assert_eq!(c.version, CgroupVersion::V2);
        assert_eq!((c.limit_bytes, c.usage_bytes), (1_500_000_000, 250_000_000));
        assert_eq!(c.dir, r.path().join("sys/fs/cgroup/user.slice/job.scope"));
        assert_eq!(m.mem_available_bytes, Some(MEM_AVAILABLE));
        assert_eq!(m.bytes(), Some(1_250_000_000));
        let line = m.report_line();
        assert!(line.contains("the cgroup v2 headroom 1.25 GB"), "{line}");
        assert!(line.contains("memory limit: 1.25 GB"), "{line}");
    }

    #[test]
    fn cgroup_v2_max_is_no_limit_and_a_limited_parent_binds() {
        let r = FakeRoot::new("0::/a/b\n");
        let leaf = [("memory.max", "max\n"), ("memory.current", "100\n")];
        r.cgroup("sys/fs/cgroup/a/b", &leaf)
            .cgroup("sys/fs/cgroup/a", &leaf);
        let m = memory_limit_at(r.path());
        assert_eq!(m.cgroup, None);
        assert_eq!(m.bytes(), Some(MEM_AVAILABLE), "MemAvailable alone");
        assert!(
            m.report_line()
                .contains("= MemAvailable (no memory cgroup limit")
        );
        // a limit on the parent binds the child
        r.cgroup(
            "sys/fs/cgroup/a",
            &[
                ("memory.max", "3000000000"),
                ("memory.current", "1000000000"),
            ],
        );
        let c = cgroup_memory_at(r.path()).expect("the parent's limit");
        assert_eq!(c.dir, r.path().join("sys/fs/cgroup/a"));
        assert_eq!(c.headroom(), 2_000_000_000);
    }

    #[test]
    fn cgroup_v1_limit_when_v2_has_no_memory_controller() {
        // hybrid hierarchy (this machine): `0::/` exists but v2 has no memory.max
        let r = FakeRoot::new(HYBRID);
        r.cgroup("sys/fs/cgroup", &[("cgroup.procs", "1\n")])
            .cgroup(
                "sys/fs/cgroup/memory/svc/job",
                &[
                    ("memory.limit_in_bytes", "1500000000\n"),
                    ("memory.usage_in_bytes", "1400000000\n"),
                ],
            );
        let c = cgroup_memory_at(r.path()).expect("a v1 limit");
        assert_eq!(c.version, CgroupVersion::V1);
        assert_eq!(c.dir, r.path().join("sys/fs/cgroup/memory/svc/job"));
        assert_eq!(c.headroom(), 100_000_000);
        let m = memory_limit_at(r.path());
        assert_eq!(m.bytes(), Some(100_000_000), "the cgroup is tighter");
        assert!(
            m.report_line()
                .contains("cgroup v1 headroom 100.00 MB (limit 1.50 GB - usage 1.40 GB"),
            "{}",
            m.report_line()
        );
        // a combined controller list names memory too
        let r2 = FakeRoot::new("3:cpu,memory:/x\n");
        r2.cgroup(
            "sys/fs/cgroup/memory/x",
            &[
                ("memory.limit_in_bytes", "2000"),
                ("memory.usage_in_bytes", "500"),
            ],
        );
        assert_eq!(
            cgroup_memory_at(r2.path()).map(|c| c.headroom()),
            Some(1500)
        );
    }

    #[test]
    fn cgroup_v1_unlimited_sentinel_is_no_limit() {
        let r = FakeRoot::new(HYBRID);
        let unlimited = [
            ("memory.limit_in_bytes", V1_SENTINEL),
            ("memory.usage_in_bytes", "8089194496\n"),
        ];
        r.cgroup("sys/fs/cgroup/memory/svc/job", &unlimited)
            .cgroup("sys/fs/cgroup/memory/svc", &unlimited)
            .cgroup("sys/fs/cgroup/memory", &unlimited);
        assert_eq!(cgroup_memory_at(r.path()), None);
        assert_eq!(memory_limit_at(r.path()).bytes(), Some(MEM_AVAILABLE));
        // 64 KiB pages: PAGE_COUNTER_MAX x 65536 is also far above any real limit
        r.cgroup(
            "sys/fs/cgroup/memory/svc",
            &[("memory.limit_in_bytes", "9223372036854710272")],
        );
        assert_eq!(cgroup_memory_at(r.path()), None);
        // a real limit on an ancestor under unlimited leaves binds
        r.cgroup(
            "sys/fs/cgroup/memory/svc",
            &[("memory.limit_in_bytes", "9000000000")],
        );
        let c = cgroup_memory_at(r.path()).expect("the ancestor's limit");
        assert_eq!(c.dir, r.path().join("sys/fs/cgroup/memory/svc"));
        assert_eq!(c.headroom(), 9_000_000_000 - 8_089_194_496);
    }

    #[test]
    fn cgroup_missing_files_are_no_limit() {
        // no /proc/self/cgroup, no meminfo: nothing known
        let r = FakeRoot::new("");
        std::fs::remove_file(r.path().join("proc/self/cgroup")).expect("remove");
        std::fs::remove_file(r.path().join("proc/meminfo")).expect("remove");
        let m = memory_limit_at(r.path());
        assert_eq!(m, MemoryLimit::default());
        assert_eq!(m.bytes(), None);
        assert!(
            m.report_line().contains("check is skipped"),
            "{}",
            m.report_line()
        );
        // cgroup lines but no cgroup files at all
        let r = FakeRoot::new(HYBRID);
        assert_eq!(cgroup_memory_at(r.path()), None);
        // a limit file without the usage file: usage counts as 0
        r.cgroup(
            "sys/fs/cgroup/memory/svc/job",
            &[("memory.limit_in_bytes", "5000")],
        );
        assert_eq!(cgroup_memory_at(r.path()).map(|c| c.headroom()), Some(5000));
        // garbage in the limit file is no limit, not a panic
        r.cgroup(
            "sys/fs/cgroup/memory/svc/job",
            &[("memory.limit_in_bytes", "lots")],
        );
        assert_eq!(cgroup_memory_at(r.path()), None);
    }

    #[test]
    fn cgroup_path_missing_under_the_mount_reads_the_mount_root() {
        // a container sees the host's path in /proc/self/cgroup but mounts its own cgroup
        let r = FakeRoot::new("4:memory:/docker/abc\n");
        r.cgroup(
            "sys/fs/cgroup/memory",
            &[
                ("memory.limit_in_bytes", "7000"),
                ("memory.usage_in_bytes", "1000"),
            ],
        );
        let c = cgroup_memory_at(r.path()).expect("the mount root's limit");
        assert_eq!(c.dir, r.path().join("sys/fs/cgroup/memory"));
        assert_eq!(c.headroom(), 6000);
        // `..` in the path never walks out of the mount
        let r = FakeRoot::new("0::/../../etc\n");
        r.cgroup(
            "sys/fs/cgroup",
            &[("memory.max", "9000"), ("memory.current", "0")],
        );
        let c = cgroup_memory_at(r.path()).expect("the mount root");
        assert_eq!(c.dir, r.path().join("sys/fs/cgroup"));
    }

    #[test]
    fn meminfo_parses_available_not_free() {
        let t = "MemTotal:       24684084 kB\nMemFree:         1561916 kB\n\
                 MemAvailable:   23231456 kB\nHugepagesize:       2048 kB\n";
        let m = parse_meminfo(t).expect("parses");
        assert_eq!(m.total, 24_684_084 * 1024);
        assert_eq!(m.available, 23_231_456 * 1024);
        assert_eq!(m.huge_page_size, 2 << 20);
        assert_eq!((m.huge_pages_total, m.huge_pages_free), (0, 0));
        assert_eq!(parse_meminfo("MemTotal: 1 kB\nMemFree: 1 kB\n"), None);
        let pool = format!("{t}HugePages_Total:    1400\nHugePages_Free:     1200\n");
        let m = parse_meminfo(&pool).expect("parses");
        assert_eq!((m.huge_pages_total, m.huge_pages_free), (1400, 1200));
        assert_eq!(parse_meminfo_available(&pool), Some(m.available));
    }

    #[test]
    fn thp_mode_is_the_bracketed_word() {
        assert_eq!(
            parse_thp_mode("always [madvise] never\n").as_deref(),
            Some("madvise")
        );
        assert_eq!(
            parse_thp_mode("[always] madvise never").as_deref(),
            Some("always")
        );
        assert_eq!(parse_thp_mode("always madvise never"), None);
    }

    #[test]
    fn proc_cgroup_lines() {
        let t = "9:name=systemd:/\n4:memory:/process_api/abc\n1:cpu:/\n0::/\n";
        assert_eq!(
            parse_proc_cgroup(t),
            (Some("/".into()), Some("/process_api/abc".into()))
        );
        assert_eq!(
            parse_proc_cgroup("0::/user.slice/x.scope\n"),
            (Some("/user.slice/x.scope".into()), None)
        );
        assert_eq!(
            parse_proc_cgroup("3:cpu,memory:/a\n"),
            (None, Some("/a".into()))
        );
    }
}
