//! `k3-run doctor`: can this machine run Kimi K3, with which preset, and how fast can it read?
//!
//! Owns: the machine check — toolchain (`rustc`/`cargo` versions against the workspace's
//! `rust-version`), CPU model and the kernel paths it can run (`k3_kernels::isa`), memory
//! (`MemAvailable`, the cgroup limit, transparent huge pages), the preset that follows from
//! it and the longest context that preset leaves room for in that memory (the planner's
//! [`crate::session::preset_context`], the latent MLA cache per position, for the `--model`
//! config.json or the release's), the disk measured the way the engine reads it (large `O_DIRECT` reads, 8 MiB and
//! 4096-aligned by default, into 2 MiB-page buffers like the trunk's, in random and in
//! sequential order, at queue depth 1 and 16, over a test file written where the model or the
//! trunk will live (`--dir`, else the `--trunk` directory, else `--model`; never the current
//! directory by default), announced with its size and place before it is written, and unlinked
//! as soon as it is created, so that no exit leaves it behind; or over an existing `--file`),
//! the DRAM streaming-read bandwidth (all threads and one thread, a buffer far larger than the
//! caches), the exact next commands, and `--json` with every figure
//! (the benchmark scripts in `bench/` read it to compute the I/O and memory floors).
//! Must not: touch any model file, keep the test file, or measure through the page cache
//! (buffered reads of a file just written measure RAM, not the disk: the disk part refuses
//! when `O_DIRECT` is refused, and refuses tmpfs/ramfs).
//! Follows upstream: docs/DESIGN.md §8 and the Korean seed's `scripts/k3-doctor.sh` (preset from
//! `MemAvailable`: >= 192 GB server, >= 96 workstation, >= 32 desktop, >= 10 laptop, else the
//! machine cannot run the model; disk measured "the way the engine reads it", like
//! `tools/devbw.py`; the exact next command; non-zero exit when the model cannot run).
//!
//! Units: GB = 1e9 bytes (like the presets and `--trunk-gb`); the preset thresholds compare
//! the smaller of `MemAvailable` and the cgroup headroom (limit - usage, v1 or v2) in GB.
//!
//! Exit codes of `k3-run doctor`: 0 the machine can run real K3 (a preset was chosen and every
//! measurement asked for was made); 1 it cannot (less than 10 GB available); 2 usage error or
//! a measurement could not be made (a bad `--dir`, tmpfs, not enough free space, `O_DIRECT`
//! refused); 5 stopped by Ctrl-C. No disk named (no `--dir`, `--trunk`, `--model` or `--file`)
//! is not a failed measurement: the disk line says which flag to give.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Instant;

use clap::Args;
use serde::Serialize;

use crate::cli::{Failure, exit};
use crate::platform::memory::MemInfo;
use crate::platform::{self, FsType, UNCACHED};
use crate::stream::aligned::{AlignedBuf, IO_ALIGN};
use crate::stream::direct::DirectFile;

/// Exit code: the machine cannot run real K3 (less than [`MIN_LAPTOP_GB`] available).
pub const EXIT_CANNOT_RUN: u8 = 1;

/// Minimum `rustc` to build the workspace (root Cargo.toml `rust-version`).
pub const MIN_RUSTC: (u32, u32) = (1, 95);

/// Preset thresholds on available memory, in GB (docs/DESIGN.md §8), largest first.
pub const PRESET_THRESHOLDS_GB: [(f64, &str); 4] = [
    (192.0, "server"),
    (96.0, "workstation"),
    (32.0, "desktop"),
    (10.0, "laptop"),
];

/// Below this many GB available, real K3 cannot run (the laptop preset peaks at 8.2 GB RSS).
pub const MIN_LAPTOP_GB: f64 = 10.0;

/// Flags of `k3-run doctor`.
#[derive(Args, Debug, Clone)]
pub struct DoctorArgs {
    /// Directory on the disk to measure (the packed trunk's disk; not tmpfs). A `--size-gb`
    /// test file is written there, read back and removed (its name is unlinked as soon as it
    /// is created, so no exit leaves it behind). Default: the `--trunk` directory (its nearest
    /// existing parent), else the `--model` directory; without any of them the disk is not
    /// measured and doctor says which flag to give.
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Size of the test file in GB (fractions allowed). Larger than any device or host cache
    /// gives honest figures; every read size is one pass over the file at most.
    #[arg(long, default_value_t = 4.0)]
    pub size_gb: f64,
    /// Size of one random read in KiB (a multiple of 4; default 8 MiB like a trunk layer piece).
    #[arg(long, default_value_t = 8192)]
    pub block_kib: usize,
    /// Queue depths to measure (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,16")]
    pub qd: Vec<usize>,
    /// Read orders to measure (comma-separated): random (every block once, shuffled: the
    /// expert pattern) and/or sequential (blocks in file order, N in flight: the trunk pattern).
    #[arg(long, value_delimiter = ',', default_value = "random,sequential")]
    pub order: Vec<ReadOrder>,
    /// Upper bound on the seconds spent reading at each queue depth (0.1..=3600; a pass over
    /// the file ends the measurement earlier).
    #[arg(long, default_value_t = 10.0)]
    pub seconds: f64,
    /// DRAM test buffer in MiB (far larger than the last-level cache).
    #[arg(long, default_value_t = 1024)]
    pub dram_mib: usize,
    /// Timed repetitions of the DRAM read (the median is reported).
    #[arg(long, default_value_t = 7)]
    pub dram_reps: usize,
    /// Measure random reads of this existing file instead of writing a test file (read only;
    /// never modified or deleted). The benchmarks point it at trunk.bin: the very file the
    /// engine streams, on the same disk, with the same device and host caching.
    #[arg(long)]
    pub file: Option<PathBuf>,
    /// Read into buffers on 4 KiB pages instead of 2 MiB (huge) pages, to see what the
    /// engine's huge-page buffers buy on this disk (a read into 4 KiB pages is split into
    /// more segments; on a virtio disk that halves the speed of 0.4-8 MiB reads).
    #[arg(long)]
    pub small_pages: bool,
    /// Skip the disk measurement.
    #[arg(long)]
    pub no_disk: bool,
    /// Skip the DRAM measurement.
    #[arg(long)]
    pub no_dram: bool,
    /// Checkpoint directory to put into the printed commands (default ~/k3model).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Packed trunk directory to put into the printed commands (default DIR/k3trunk).
    #[arg(long)]
    pub trunk: Option<PathBuf>,
    /// Write every figure as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// Where the disk test file goes: `--dir`, else the `--trunk` directory (or, before it is
/// packed, its nearest existing parent), else the `--model` directory; with the flag it came
/// from. `None`: no directory was named (the disk is not measured; the current directory is
/// never assumed).
pub fn probe_dir(a: &DoctorArgs) -> Option<(PathBuf, &'static str)> {
    if let Some(d) = &a.dir {
        return Some((d.clone(), "--dir"));
    }
    if let Some(t) = &a.trunk {
        let existing = t.ancestors().find(|p| p.is_dir()).map(Path::to_path_buf);
        let existing = match existing {
            Some(p) if p.as_os_str().is_empty() => PathBuf::from("."),
            Some(p) => p,
            None => PathBuf::from("."),
        };
        return Some((existing, "--trunk"));
    }
    a.model.as_ref().map(|m| (m.clone(), "--model"))
}

/// The order of the blocks a read measurement visits.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ReadOrder {
    /// Every block once, in a shuffled order (routed experts: scattered reads).
    Random,
    /// Blocks in file order with `qd` in flight (the streamed trunk: layer after layer).
    Sequential,
}

// ---------------------------------------------------------------------------------------------
// Pure parts (unit-tested)

/// The preset for `available_bytes` of memory, or `None` when real K3 cannot run.
pub fn pick_preset(available_bytes: u64) -> Option<&'static str> {
    let gb = available_bytes as f64 / 1e9;
    PRESET_THRESHOLDS_GB
        .iter()
        .find(|(min, _)| gb >= *min)
        .map(|(_, name)| *name)
}

/// The next larger preset and the GB it needs, if any (for the report).
pub fn next_preset(available_bytes: u64) -> Option<(&'static str, f64)> {
    let gb = available_bytes as f64 / 1e9;
    PRESET_THRESHOLDS_GB
        .iter()
        .rev()
        .find(|(min, _)| gb < *min)
        .map(|(min, name)| (*name, *min))
}

/// The model doctor plans the context for: the config.json of `--model DIR` when it is there
/// (the model that will run), else the released Kimi K3's (built in: the checkpoint is not
/// downloaded yet); with the words that say which. A config.json that is there but does not
/// describe a model the manifest accepts is an error naming the file.
pub fn context_model(model: Option<&Path>) -> Result<(crate::plan::Plan, String), String> {
    let (spec, source) = match model.filter(|m| m.join("config.json").is_file()) {
        Some(dir) => (
            k3_engine::model::load_spec(dir, None, None)
                .map_err(|e| format!("--model {}: {e}", dir.display()))?,
            format!("the widths of {}", dir.join("config.json").display()),
        ),
        None => (
            k3_engine::model::release_spec().map_err(|e| e.to_string())?,
            "the released Kimi K3's widths".to_string(),
        ),
    };
    // the context length is what is being found: the plan's own maximum is not used
    Ok((crate::plan::Plan::new(&spec, 0), source))
}

/// The longest context of one sequence at `preset` in `available_bytes`: the planner's
/// [`crate::session::preset_context`] (the one `k3-run plan` prints per machine class and a
/// run's memory check refuses beyond), here in this machine's memory.
pub fn context_at(
    plan: &crate::plan::Plan,
    preset: &str,
    available_bytes: u64,
) -> Result<crate::session::PresetContext, String> {
    let p = crate::stream::presets::load_preset(preset).map_err(|e| e.to_string())?;
    crate::session::preset_context(plan, &p, available_bytes).map_err(|e| e.to_string())
}

/// Doctor's `context` line for [`context_at`]'s answer.
pub fn context_line(
    plan: &crate::plan::Plan,
    c: &crate::session::PresetContext,
    source: &str,
) -> String {
    use crate::stream::fmt_bytes;
    let mla: Vec<u64> = plan
        .layers
        .iter()
        .map(|l| l.kv_bytes_per_position)
        .filter(|&b| b > 0)
        .collect();
    let cache = match mla.first() {
        Some(&per_layer) => format!(
            "MLA latent cache {} per position ({} x {} MLA layers)",
            fmt_bytes(plan.kv_bytes_per_position()),
            fmt_bytes(per_layer),
            mla.len()
        ),
        None => "no MLA layers: the state does not grow".to_string(),
    };
    let what = match c.longest {
        None => "none: the preset's trunk budget cannot hold one ring slot of this model".into(),
        Some(0) => "not one position: the weights' budgets leave no room".into(),
        Some(crate::session::CONTEXT_SEARCH_MAX) => "no limit".into(),
        Some(n) => format!("{n} positions of one sequence (--max-context up to {n})"),
    };
    format!(
        "context    {what} at the {} preset in {} ({} planned for weights; {cache}, {} fixed \
         state, {} for prompt chunks; {source})",
        c.preset,
        gb(c.memory_bytes),
        fmt_bytes(c.planned_bytes),
        fmt_bytes(plan.state_bytes()),
        fmt_bytes(plan.prefill_bytes())
    )
}

/// Whether a virtio balloon device is bound (a VM that may hand freed memory to its host).
fn balloon_present() -> bool {
    std::fs::read_dir("/sys/bus/virtio/drivers/virtio_balloon")
        .map(|d| {
            d.flatten()
                .any(|e| e.file_name().to_string_lossy().starts_with("virtio"))
        })
        .unwrap_or(false)
}

/// The doctor's line about the reserved huge-page pool: its size when there is one (2 MiB
/// pages only: the size the engine maps), a hint when there is none on a VM with a balloon
/// device, nothing otherwise.
pub fn reserved_pool_line(m: &MemInfo, balloon: bool) -> Option<String> {
    if m.huge_pages_total > 0 && m.huge_page_size == 2 << 20 {
        Some(format!(
            "memory     reserved huge pages (vm.nr_hugepages): {} free of {} ({} of {} of 2 MiB \
             pages): the pinned prefix, ring slots and a resident arena take them first",
            gb(m.huge_pages_free * m.huge_page_size),
            gb(m.huge_pages_total * m.huge_page_size),
            m.huge_pages_free,
            m.huge_pages_total
        ))
    } else if m.huge_pages_total > 0 {
        Some(format!(
            "memory     reserved huge pages of {} KiB are not used (the engine maps 2 MiB pages)",
            m.huge_page_size / 1024
        ))
    } else if balloon {
        Some(
            "memory     a virtio balloon is present: on a VM that reports free pages, a fresh \
             pinned prefix loads at the rate the host backs memory; `sudo sysctl \
             vm.nr_hugepages=N` (2 MiB each, the pinned prefix's size) keeps its buffers \
             backed, and `--io page-cache` keeps it in trunk.bin's page cache, where the next \
             run finds it (docs/STREAMING.md)"
                .to_string(),
        )
    } else {
        None
    }
}

/// Free page reporting's parameters (`/sys/module/page_reporting/parameters`): the order of
/// the smallest free block reported, and the KiB reported so far where the kernel says.
const PAGE_REPORTING: &str = "/sys/module/page_reporting/parameters";

/// (`page_reporting_order`, `reported_kib`) when this kernel has free page reporting.
fn page_reporting() -> Option<(u32, Option<u64>)> {
    let read = |f: &str| std::fs::read_to_string(format!("{PAGE_REPORTING}/{f}")).ok();
    let order = read("page_reporting_order")?.trim().parse().ok()?;
    Some((
        order,
        read("reported_kib").and_then(|t| t.trim().parse().ok()),
    ))
}

/// The doctor's line about free page reporting on a VM with a balloon device: memory the
/// guest frees goes back to the host, and a fresh pinned prefix then loads at the rate the
/// host backs memory. Nothing without a balloon, or when the kernel has no reporting.
pub fn page_reporting_line(balloon: bool, reporting: Option<(u32, Option<u64>)>) -> Option<String> {
    let (order, reported_kib) = reporting.filter(|_| balloon)?;
    // An order above the largest buddy order (10 on x86-64 with 4 KiB pages) matches no free
    // block: nothing is reported. Kernels that accept such a value stop reporting with it.
    if order > 10 {
        return Some(format!(
            "memory     free page reporting: page_reporting_order {order} (above the largest \
             page order: freed memory stays with this VM, and a fresh pinned prefix loads at \
             the disk's rate)"
        ));
    }
    let so_far = match reported_kib {
        Some(k) => format!(
            ", {} handed back to the host so far",
            gb(k.saturating_mul(1024))
        ),
        None => String::new(),
    };
    Some(format!(
        "memory     free page reporting: page_reporting_order {order}{so_far}: memory this VM \
         frees goes back to the host, so a cold pinned prefix loads at the rate the host backs \
         it again (k3-mini on the development VM: 0.63x of the disk's QD16 rate, 0.99x with \
         reporting stopped). An administrator can stop it where the kernel accepts an order \
         above its largest (`echo 11 > {PAGE_REPORTING}/page_reporting_order`), or reserve \
         huge pages for the buffers (`sudo sysctl vm.nr_hugepages=N`, 2 MiB each); `--io \
         page-cache` lets the next run find the prefix cached (docs/STREAMING.md)"
    ))
}

/// `(major, minor, patch)` from `rustc 1.95.0 (abc 2026-01-01)` or `cargo 1.95.0 (...)`.
pub fn parse_tool_version(line: &str) -> Option<(u32, u32, u32)> {
    let v = line.split_whitespace().nth(1)?;
    let v = v.split(['-', '+']).next()?;
    let mut it = v.split('.').map(|p| p.parse::<u32>().ok());
    Some((it.next()??, it.next()??, it.next().flatten().unwrap_or(0)))
}

/// A deterministic permutation of `0..n_blocks` scaled to byte offsets (`i * block`), so a
/// pass reads every block once in random order (no block twice: no device-cache hits).
pub fn random_offsets(n_blocks: usize, block: usize, seed: u64) -> Vec<u64> {
    let mut idx: Vec<u64> = (0..n_blocks as u64).collect();
    let mut s = seed | 1;
    for i in (1..idx.len()).rev() {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        let j = (s % (i as u64 + 1)) as usize;
        idx.swap(i, j);
    }
    idx.into_iter().map(|i| i * block as u64).collect()
}

/// The value at quantile `q` (0..=1) of `v` (sorted in place); 0 for an empty slice.
pub fn quantile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let i = ((v.len() - 1) as f64 * q.clamp(0.0, 1.0)).round() as usize;
    v[i]
}

/// Median of `v` (mean of the two middle values for an even count); 0 for an empty slice.
pub fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The measurement the I/O floor divides by: the fastest one at the largest queue depth
/// measured (a floor must not be beaten, so it takes the disk's best pattern).
pub fn floor_read(reads: &[ReadResult]) -> Option<&ReadResult> {
    let qd = reads.iter().map(|r| r.qd).max()?;
    reads
        .iter()
        .filter(|r| r.qd == qd)
        .max_by(|x, y| x.mb_per_s.total_cmp(&y.mb_per_s))
}

/// Name of a filesystem magic number from statfs (the common ones).
pub fn fs_name(magic: i64) -> &'static str {
    match magic {
        0xEF53 => "ext4",
        0x5846_5342 => "xfs",
        0x9123_683E => "btrfs",
        0x0102_1994 => "tmpfs",
        0x8584_58f6 => "ramfs",
        0x6969 => "nfs",
        0x794c_7630 => "overlayfs",
        0x2fc1_2fc1 => "zfs",
        0xF2F5_2010 => "f2fs",
        0x6573_5546 => "fuse",
        0x6165_6e73 => "9p",
        _ => "unknown",
    }
}

/// Whether a filesystem lives in RAM (measuring it says nothing about a disk).
pub fn fs_is_ram(magic: i64) -> bool {
    matches!(fs_name(magic), "tmpfs" | "ramfs")
}

/// The device and mount point holding `path` from /proc/self/mounts text (longest prefix).
pub fn mount_of(mounts: &str, path: &Path) -> Option<(String, String)> {
    mounts
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let dev = f.next()?;
            let mnt = f.next()?.replace("\\040", " ");
            path.starts_with(&mnt).then(|| (dev.to_string(), mnt))
        })
        .max_by_key(|(_, m)| m.len())
}

// ---------------------------------------------------------------------------------------------
// Measurements

/// One queue depth's random-read result.
#[derive(Clone, Debug, Serialize)]
pub struct ReadResult {
    pub order: ReadOrder,
    pub qd: usize,
    pub block_bytes: usize,
    pub reads: usize,
    pub bytes: u64,
    pub seconds: f64,
    /// Decimal MB/s (1e6 bytes).
    pub mb_per_s: f64,
    pub latency_median_ms: f64,
    pub latency_p99_ms: f64,
}

/// The disk part of the report.
#[derive(Clone, Debug, Serialize)]
pub struct DiskReport {
    /// The directory measured (test file written there) or the `--file` read.
    pub dir: String,
    /// false with `--file`: an existing file was read, nothing written.
    pub test_file_written: bool,
    pub filesystem: String,
    pub device: Option<String>,
    pub mount_point: Option<String>,
    pub file_bytes: u64,
    pub write_mb_per_s: f64,
    /// Read buffers on 4 KiB pages (`--small-pages`) instead of 2 MiB pages like the engine's.
    pub small_pages: bool,
    pub reads: Vec<ReadResult>,
}

/// The DRAM part of the report.
#[derive(Clone, Debug, Serialize)]
pub struct DramReport {
    pub buffer_bytes: u64,
    pub threads: usize,
    pub reps: usize,
    /// Median GB/s (1e9 bytes) of a streaming read split over all threads.
    pub all_threads_gb_per_s: f64,
    /// Median GB/s of the same read by one thread.
    pub one_thread_gb_per_s: f64,
    /// max(all threads, one thread): the memory floor divides by this.
    pub reference_gb_per_s: f64,
}

/// The filesystem holding `path`: its name and whether it lives in RAM.
fn filesystem(path: &Path) -> Result<(String, bool), String> {
    match platform::fs_type(path) {
        Ok(FsType::Magic(m)) => Ok((fs_name(m).to_string(), fs_is_ram(m))),
        Ok(FsType::Name(n)) => {
            let ram = matches!(n.as_str(), "tmpfs" | "ramfs");
            Ok((n, ram))
        }
        Err(e) => Err(format!("statfs {}: {e}", path.display())),
    }
}

/// Fill `buf` with xorshift bytes (incompressible, so a deduplicating or compressing layer
/// below cannot shortcut the reads).
fn fill_random(buf: &mut [u8], seed: u64) {
    let mut s = seed | 1;
    for c in buf.chunks_mut(8) {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        let b = s.to_le_bytes();
        c.copy_from_slice(&b[..c.len()]);
    }
}

/// Create the test file at `path`, on Linux remove its name at once (the open descriptor keeps
/// the file until it is closed, so no exit, not even a kill, leaves it behind; elsewhere the
/// caller removes it when done), and write `n_blocks` blocks uncached (sequential,
/// `block`-sized writes), then fdatasync it. Returns the open file and the write rate in MB/s.
fn write_test_file(
    path: &Path,
    n_blocks: usize,
    block: usize,
    stop: &AtomicBool,
) -> Result<(std::fs::File, f64), String> {
    let mut f = platform::create_uncached(path).map_err(|e| {
        format!(
            "cannot create the test file {} with {UNCACHED}: {e} (the engine reads with \
             {UNCACHED}; a filesystem that refuses it cannot be measured the way the engine reads)",
            path.display()
        )
    })?;
    #[cfg(target_os = "linux")]
    std::fs::remove_file(path).map_err(|e| {
        format!(
            "cannot remove the name of the test file {} right after creating it: {e}",
            path.display()
        )
    })?;
    let mut buf = AlignedBuf::new(block).map_err(|e| format!("test buffer: {e}"))?;
    fill_random(buf.as_mut_slice(), 0x6b33_646f_6374_6f72);
    let t0 = Instant::now();
    for i in 0..n_blocks {
        if stop.load(Ordering::Relaxed) {
            return Err("interrupted".into());
        }
        // Make every block distinct: stamp the block index into each 4 KiB page.
        for page in buf.as_mut_slice().chunks_mut(IO_ALIGN) {
            page[..8].copy_from_slice(&(i as u64).to_le_bytes());
        }
        f.write_all(buf.as_slice())
            .map_err(|e| format!("writing the test file {}: {e}", path.display()))?;
    }
    f.sync_data()
        .map_err(|e| format!("fdatasync of the test file {}: {e}", path.display()))?;
    let secs = t0.elapsed().as_secs_f64();
    Ok((f, (n_blocks * block) as f64 / 1e6 / secs.max(1e-9)))
}

/// The doctor's test file: open while measured; off Linux its name is removed on drop (on
/// Linux it is gone already).
struct TestFile {
    file: Option<std::fs::File>,
    path: PathBuf,
}

impl Drop for TestFile {
    fn drop(&mut self) {
        drop(self.file.take());
        if !cfg!(target_os = "linux") {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Random `block`-sized O_DIRECT reads at queue depth `qd` (qd threads, one blocking pread
/// each) over one pass of `offsets`, stopped early after `max_seconds`.
fn read_at_qd(
    file: &DirectFile,
    offsets: &[u64],
    block: usize,
    qd: usize,
    max_seconds: f64,
    small_pages: bool,
    stop: &AtomicBool,
) -> Result<ReadResult, String> {
    let next = AtomicUsize::new(0);
    let t0 = Instant::now();
    let per_thread: Vec<Result<Vec<f64>, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..qd)
            .map(|_| {
                s.spawn(|| -> Result<Vec<f64>, String> {
                    // Like the engine's trunk slots and expert buffers: on huge pages (2 MiB
                    // aligned). With 4 KiB pages a virtio disk (max_segments 254) splits an
                    // 8 MiB read into ~1 MiB requests: measured 1.1 GB/s instead of ~3 GB/s;
                    // 408 KiB reads ran at ~1.1 GB/s instead of 2.2-3.0 GB/s.
                    let buf = if small_pages {
                        AlignedBuf::with_align(block, IO_ALIGN)
                    } else {
                        AlignedBuf::carve(1, block).map(|mut v| v.remove(0))
                    };
                    let mut buf = buf.map_err(|e| format!("read buffer: {e}"))?;
                    let mut lat = Vec::new();
                    loop {
                        if stop.load(Ordering::Relaxed) || t0.elapsed().as_secs_f64() >= max_seconds
                        {
                            break;
                        }
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&off) = offsets.get(i) else { break };
                        let r0 = Instant::now();
                        file.read_into(off, block, buf.full_mut())
                            .map_err(|e| e.to_string())?;
                        lat.push(r0.elapsed().as_secs_f64());
                    }
                    Ok(lat)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a reader thread panicked".to_string()))
            })
            .collect()
    });
    let secs = t0.elapsed().as_secs_f64();
    let mut lat = Vec::new();
    for r in per_thread {
        lat.extend(r?);
    }
    if !file.is_direct() {
        return Err(format!(
            "{UNCACHED} reads were refused during the test ({}); buffered figures would measure \
             the page cache, not the disk",
            file.fallback_reason().unwrap_or_default()
        ));
    }
    let reads = lat.len();
    if reads == 0 {
        return Err(format!(
            "no read of {} KiB at queue depth {qd} finished within --seconds {max_seconds}: no \
             figure to report",
            block / 1024
        ));
    }
    let bytes = (reads * block) as u64;
    let med = quantile(&mut lat, 0.5) * 1e3;
    let p99 = quantile(&mut lat, 0.99) * 1e3;
    Ok(ReadResult {
        order: ReadOrder::Random,
        qd,
        block_bytes: block,
        reads,
        bytes,
        seconds: secs,
        mb_per_s: bytes as f64 / 1e6 / secs.max(1e-9),
        latency_median_ms: med,
        latency_p99_ms: p99,
    })
}

fn measure_disk(
    a: &DoctorArgs,
    dir: &Path,
    from: &str,
    stop: &AtomicBool,
) -> Result<DiskReport, String> {
    let target = a.file.as_deref().unwrap_or(dir);
    let target = std::fs::canonicalize(target).map_err(|e| {
        format!(
            "{} {}: {e}",
            if a.file.is_some() { "--file" } else { from },
            target.display()
        )
    })?;
    if a.file.is_none() && !target.is_dir() {
        return Err(format!("{from} {} is not a directory", target.display()));
    }
    if a.file.is_some() && !target.is_file() {
        return Err(format!("--file {} is not a regular file", target.display()));
    }
    let block = a.block_kib * 1024;
    if block == 0 || !block.is_multiple_of(IO_ALIGN) {
        return Err(format!(
            "--block-kib {} must be a positive multiple of 4 (reads are 4096-aligned)",
            a.block_kib
        ));
    }
    if !a.size_gb.is_finite() || a.size_gb <= 0.0 {
        return Err(format!("--size-gb must be > 0, got {}", a.size_gb));
    }
    let qd_max = a.qd.iter().copied().max().unwrap_or(1);
    if a.qd.is_empty() || a.qd.contains(&0) || qd_max > 256 {
        return Err("--qd values must be in 1..=256".into());
    }
    let (fs, in_ram) = filesystem(&target)?;
    if in_ram {
        return Err(format!(
            "{} is on {fs} (RAM, not a disk): measure the disk that will hold the packed trunk",
            target.display(),
        ));
    }
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    let mount = mount_of(&mounts, &target);
    let (path, guard, n_blocks, write_mb_per_s) = match &a.file {
        Some(_) => {
            let len = std::fs::metadata(&target)
                .map_err(|e| format!("--file {}: {e}", target.display()))?
                .len();
            let n = (len / block as u64) as usize;
            (target.clone(), None, n, 0.0)
        }
        None => {
            let n = ((a.size_gb * 1e9) as u64 / block as u64) as usize;
            if n < 2 * qd_max {
                // refused before anything is written
                return Err(format!(
                    "a {} GB test file holds only {n} reads of {} KiB; the test needs at least \
                     {} (2 x the largest queue depth): raise --size-gb",
                    a.size_gb,
                    a.block_kib,
                    2 * qd_max
                ));
            }
            let file_bytes = (n * block) as u64;
            let free = platform::disk_free_bytes(&target)
                .map_err(|e| format!("free space of {}: {e}", target.display()))?;
            if free < file_bytes + (1 << 30) {
                return Err(format!(
                    "{} has {:.2} GB free; the {:.2} GB test file plus 1 GiB of headroom does \
                     not fit (lower --size-gb)",
                    target.display(),
                    free as f64 / 1e9,
                    file_bytes as f64 / 1e9
                ));
            }
            println!(
                "disk       writing a {:.2} GB test file in {} (the {from} directory's disk; \
                 {:.2} GB free there), reading it back and removing it (--no-disk skips this) ...",
                file_bytes as f64 / 1e9,
                target.display(),
                free as f64 / 1e9
            );
            let _ = std::io::stdout().flush();
            let path = target.join(format!(".k3-doctor-{}.tmp", std::process::id()));
            let (file, w) = write_test_file(&path, n, block, stop)?;
            #[cfg(target_os = "linux")]
            let read_path = {
                use std::os::fd::AsRawFd;
                // the name is gone already: read the open file through its descriptor
                PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()))
            };
            #[cfg(not(target_os = "linux"))]
            let read_path = path.clone();
            (
                read_path,
                Some(TestFile {
                    file: Some(file),
                    path,
                }),
                n,
                w,
            )
        }
    };
    if n_blocks < 2 * qd_max {
        return Err(format!(
            "the test covers only {n_blocks} reads of {} KiB; it needs at least {} (2 x the \
             largest queue depth): raise --size-gb or use a larger --file",
            a.block_kib,
            2 * qd_max
        ));
    }
    let file = DirectFile::open(&path, true).map_err(|e| e.to_string())?;
    if !file.is_direct() {
        return Err(format!(
            "{}; buffered figures would measure the page cache, not the disk",
            file.fallback_reason()
                .unwrap_or_else(|| format!("{UNCACHED} refused"))
        ));
    }
    if a.order.is_empty() {
        return Err("--order needs random and/or sequential".into());
    }
    let mut reads = Vec::new();
    for &order in &a.order {
        for (k, &qd) in a.qd.iter().enumerate() {
            let offsets = match order {
                ReadOrder::Random => {
                    random_offsets(n_blocks, block, 0x9e37_79b9_7f4a_7c15 ^ k as u64)
                }
                ReadOrder::Sequential => (0..n_blocks as u64).map(|i| i * block as u64).collect(),
            };
            let mut r = read_at_qd(&file, &offsets, block, qd, a.seconds, a.small_pages, stop)?;
            if stop.load(Ordering::Relaxed) {
                return Err("interrupted".into());
            }
            r.order = order;
            reads.push(r);
        }
    }
    drop(file);
    drop(guard);
    Ok(DiskReport {
        dir: target.display().to_string(),
        test_file_written: a.file.is_none(),
        filesystem: fs,
        device: mount.as_ref().map(|m| m.0.clone()),
        mount_point: mount.map(|m| m.1),
        file_bytes: (n_blocks * block) as u64,
        write_mb_per_s,
        small_pages: a.small_pages,
        reads,
    })
}

/// One streaming read of `buf` split over `threads` threads; bytes/s.
fn read_once(buf: &[u64], threads: usize) -> f64 {
    let chunk = buf.len().div_ceil(threads.max(1));
    let t0 = Instant::now();
    let sink: u64 = std::thread::scope(|s| {
        let hs: Vec<_> = buf
            .chunks(chunk)
            .map(|c| s.spawn(move || k3_kernels::membw::xor_reduce(c)))
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or(0))
            .fold(0, |a, b| a ^ b)
    });
    let dt = t0.elapsed().as_secs_f64();
    std::hint::black_box(sink);
    (buf.len() * 8) as f64 / dt.max(1e-9)
}

fn measure_dram(mib: usize, reps: usize, threads: usize) -> Result<DramReport, String> {
    let n = (mib.max(64) << 20) / 8;
    let mut buf: Vec<u64> = Vec::new();
    buf.try_reserve_exact(n)
        .map_err(|e| format!("cannot allocate the {mib} MiB DRAM test buffer: {e}"))?;
    let mut s = 0x243f_6a88_85a3_08d3u64;
    buf.extend((0..n).map(|_| {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    }));
    let reps = reps.max(1);
    read_once(&buf, threads); // warm-up
    let mut all: Vec<f64> = (0..reps).map(|_| read_once(&buf, threads)).collect();
    read_once(&buf, 1);
    let mut one: Vec<f64> = (0..reps).map(|_| read_once(&buf, 1)).collect();
    let all = median(&mut all) / 1e9;
    let one = median(&mut one) / 1e9;
    Ok(DramReport {
        buffer_bytes: (n * 8) as u64,
        threads,
        reps,
        all_threads_gb_per_s: all,
        one_thread_gb_per_s: one,
        reference_gb_per_s: all.max(one),
    })
}

// ---------------------------------------------------------------------------------------------
// Machine facts

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .and_then(|r| r.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

fn tool_version(tool: &str) -> Option<String> {
    let out = std::process::Command::new(tool)
        .arg("--version")
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn gb(b: u64) -> String {
    format!("{:.2} GB", b as f64 / 1e9)
}

fn shell_path(p: &Path) -> String {
    let s = p.display().to_string();
    if s.chars()
        .all(|c| c.is_ascii_alphanumeric() || "/._-~+,".contains(c))
    {
        s
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

/// Run `doctor`; returns the exit code.
/// Shortest `--seconds` accepted: below it a queue depth of 16 has hardly issued its first
/// reads (8 MiB each), so the figures would be start-up noise or, at 0, no reads at all
/// (0 MB/s, 0 ms latencies and an I/O floor of 1e12 s per GB).
pub const MIN_SECONDS: f64 = 0.1;
/// Longest `--seconds` accepted: an hour per queue depth and read order is a typo, not a
/// measurement (default 10 s; one pass over the file ends a measurement earlier anyway).
pub const MAX_SECONDS: f64 = 3600.0;

/// Refuse flag values that cannot give a meaningful figure, before anything is measured.
fn check_args(a: &DoctorArgs) -> Result<(), Failure> {
    if !(a.seconds.is_finite() && (MIN_SECONDS..=MAX_SECONDS).contains(&a.seconds)) {
        return Err(Failure::usage(format!(
            "--seconds {}: must be a number of seconds in {MIN_SECONDS}..={MAX_SECONDS} (the \
             time spent reading at each queue depth)",
            a.seconds
        )));
    }
    Ok(())
}

pub fn main(a: &DoctorArgs) -> Result<u8, Failure> {
    check_args(a)?;
    // first Ctrl-C: stop the measurement and remove the test file; second: default action
    let stop = crate::cli::ctrl_c_flag(exit::INTERRUPTED as i32);
    let mut code = exit::OK;
    println!(
        "k3-run doctor ({} {})",
        env!("CARGO_PKG_NAME"),
        env!("CARGO_PKG_VERSION")
    );

    // toolchain
    let rustc = tool_version("rustc");
    let cargo = tool_version("cargo");
    let rustc_ok = rustc
        .as_deref()
        .and_then(parse_tool_version)
        .map(|(ma, mi, _)| (ma, mi) >= MIN_RUSTC);
    println!(
        "toolchain  {}; {}{}",
        rustc.as_deref().unwrap_or("rustc not found"),
        cargo.as_deref().unwrap_or("cargo not found"),
        match rustc_ok {
            Some(true) => format!(" (>= {}.{} needed to build: ok)", MIN_RUSTC.0, MIN_RUSTC.1),
            Some(false) => format!(
                " (TOO OLD: the workspace needs rustc >= {}.{} to build; this binary runs anyway)",
                MIN_RUSTC.0, MIN_RUSTC.1
            ),
            None => " (only needed to build from source; this binary runs without it)".into(),
        }
    );

    // CPU
    let logical = std::thread::available_parallelism().map_or(1, |n| n.get());
    let physical = num_cpus::get_physical().min(logical).max(1);
    let isas: Vec<&str> = k3_kernels::isa::available()
        .into_iter()
        .map(|i| i.name())
        .collect();
    let active = k3_kernels::isa::active().name();
    let simd = isas.iter().any(|n| *n != "scalar");
    println!(
        "cpu        {}; {} logical CPUs, {} physical cores; kernel paths: {} (active: {}){}",
        cpu_model(),
        logical,
        physical,
        isas.join(" "),
        active,
        if simd {
            ""
        } else {
            " -- NO SIMD path: only the scalar reference runs (correct, about 20x slower)"
        }
    );

    // memory and preset
    let meminfo = crate::platform::memory::meminfo();
    // (limit, headroom) of the binding memory cap (the cgroup on Linux, the job object on
    // Windows): the one a run's memory check uses
    let limit = crate::platform::memory::memory_limit();
    let cg = limit
        .cgroup
        .as_ref()
        .map(|c| (c.limit_bytes, c.headroom()))
        .or_else(|| {
            limit
                .job
                .as_ref()
                .map(|j| (j.limit_bytes, j.limit_bytes.saturating_sub(j.usage_bytes)))
        });
    let thp = crate::platform::memory::transparent_huge_pages();
    let available = match (meminfo.map(|m| m.available), cg.map(|c| c.1)) {
        (Some(m), Some(c)) => Some(m.min(c)),
        (m, c) => m.or(c),
    };
    let (t_total, t_avail, t_cap) = crate::platform::memory::terms();
    match meminfo {
        Some(m) => println!(
            "memory     {t_total} {}, {t_avail} {}; {t_cap} {}; transparent huge pages: {}{}",
            gb(m.total),
            gb(m.available),
            cg.map_or("none".into(), |(lim, head)| format!(
                "{} ({} headroom)",
                gb(lim),
                gb(head)
            )),
            thp,
            if thp == "never" {
                " (O_DIRECT buffers fall back to 4 KB pages: more page pinning per read)"
            } else {
                ""
            }
        ),
        None if cfg!(target_os = "linux") => {
            println!("memory     /proc/meminfo has no MemAvailable: cannot size a preset")
        }
        None => println!(
            "memory     {} did not report its memory ({t_avail}): cannot size a preset",
            platform::OS
        ),
    }
    // what this platform has and lacks, in its own terms (absent features said, not hidden)
    for f in platform::features() {
        println!("platform   {} {}", platform::OS, f.line());
    }
    let balloon = balloon_present();
    let reporting = page_reporting_line(balloon, page_reporting());
    // the pool line's own hint for a balloon without a pool says less than the reporting line
    let pool = meminfo.filter(|m| m.huge_pages_total > 0 || reporting.is_none());
    for line in [
        pool.and_then(|m| reserved_pool_line(&m, balloon)),
        reporting,
    ]
    .into_iter()
    .flatten()
    {
        println!("{line}");
    }
    let preset = available.and_then(pick_preset);
    match (preset, available) {
        (Some(p), Some(av)) => {
            let pr = crate::stream::presets::load_preset(p)
                .map_err(|e| Failure::usage(e.to_string()))?;
            println!(
                "preset     {p}: trunk {:.2} GB + expert cache {:.2} GB ({} available >= {:.0} GB){}",
                pr.trunk_gb,
                pr.cache_gb,
                gb(av),
                PRESET_THRESHOLDS_GB
                    .iter()
                    .find(|(_, n)| *n == p)
                    .map_or(0.0, |t| t.0),
                next_preset(av).map_or(String::new(), |(n, need)| format!(
                    "; {n} needs >= {need:.0} GB"
                ))
            );
        }
        _ => {
            println!(
                "preset     none: real Kimi K3 cannot run here ({} available; the smallest preset, \
                 laptop, needs >= {MIN_LAPTOP_GB:.0} GB available; its run peaks at 8.2 GB RSS)",
                available.map_or("unknown".into(), gb)
            );
            code = EXIT_CANNOT_RUN;
        }
    }

    // context: the decode state the preset leaves room for in this memory
    let context = match (preset, available) {
        (Some(p), Some(av)) => match context_model(a.model.as_deref())
            .and_then(|(plan, source)| Ok((context_at(&plan, p, av)?, plan, source)))
        {
            Ok((c, plan, source)) => {
                println!("{}", context_line(&plan, &c, &source));
                Some(serde_json::json!({
                    "preset": c.preset,
                    "memory_bytes": c.memory_bytes,
                    "planned_bytes": c.planned_bytes,
                    "longest_positions": c.longest,
                    "mla_cache_bytes_per_position": plan.kv_bytes_per_position(),
                    "fixed_state_bytes": plan.state_bytes(),
                    "model": source,
                }))
            }
            Err(e) => {
                println!("context    not planned: {e}");
                None
            }
        },
        _ => None,
    };

    // disk
    let probe = probe_dir(a);
    let disk = if a.no_disk {
        None
    } else if a.file.is_none() && probe.is_none() {
        println!(
            "disk       not measured: name the disk that will hold the packed trunk and the \
             checkpoint: --dir DIR (or --trunk DIR / --model DIR); a {:.2} GB test file \
             (--size-gb) is written there, read back and removed. --file trunk.bin reads an \
             existing file instead; --no-disk skips this line",
            a.size_gb
        );
        None
    } else {
        if let Some(f) = &a.file {
            println!(
                "disk       reading {} (existing file, read only) ...",
                f.display()
            );
        }
        let (dir, from) = probe
            .clone()
            .unwrap_or_else(|| (PathBuf::from("."), "--dir"));
        match measure_disk(a, &dir, from, &stop) {
            Ok(d) => {
                if d.test_file_written {
                    println!(
                        "disk       {} ({} on {}): {} written at {:.0} MB/s (sequential {UNCACHED}), then removed",
                        d.dir,
                        d.filesystem,
                        d.device.as_deref().unwrap_or("?"),
                        gb(d.file_bytes),
                        d.write_mb_per_s
                    );
                } else {
                    println!(
                        "disk       {} ({} on {}): {} covered by the reads",
                        d.dir,
                        d.filesystem,
                        d.device.as_deref().unwrap_or("?"),
                        gb(d.file_bytes)
                    );
                }
                if d.small_pages {
                    println!(
                        "disk       read buffers on 4 KiB pages (--small-pages); the engine reads into 2 MiB pages"
                    );
                }
                for r in &d.reads {
                    println!(
                        "disk       {:<10} {} KiB {UNCACHED} reads, queue depth {:>2}: {:>6.0} MB/s ({} reads in {:.2} s; latency median {:.2} ms, p99 {:.2} ms)",
                        match r.order {
                            ReadOrder::Random => "random",
                            ReadOrder::Sequential => "sequential",
                        },
                        r.block_bytes / 1024,
                        r.qd,
                        r.mb_per_s,
                        r.reads,
                        r.seconds,
                        r.latency_median_ms,
                        r.latency_p99_ms
                    );
                }
                if let Some(best) = floor_read(&d.reads) {
                    println!(
                        "disk       I/O floor: every GB streamed per token costs >= {:.3} s ({:.0} MB/s: the fastest read at queue depth {})",
                        1e3 / best.mb_per_s.max(1e-9),
                        best.mb_per_s,
                        best.qd
                    );
                }
                Some(d)
            }
            Err(e) => {
                if stop.load(Ordering::Relaxed) {
                    eprintln!("k3-run doctor: stopped by Ctrl-C; test file removed");
                    return Ok(exit::INTERRUPTED);
                }
                println!("disk       NOT MEASURED: {e}");
                if code == exit::OK {
                    code = exit::USAGE;
                }
                None
            }
        }
    };

    // DRAM
    let dram = if a.no_dram {
        None
    } else {
        match measure_dram(a.dram_mib, a.dram_reps, logical) {
            Ok(d) => {
                println!(
                    "dram       streaming read of {:.2} GiB: {} threads {:.2} GB/s, 1 thread {:.2} GB/s (medians of {}); reference {:.2} GB/s",
                    d.buffer_bytes as f64 / (1u64 << 30) as f64,
                    d.threads,
                    d.all_threads_gb_per_s,
                    d.one_thread_gb_per_s,
                    d.reps,
                    d.reference_gb_per_s
                );
                println!(
                    "dram       memory floor: every GB of weights touched per token costs >= {:.3} s",
                    1.0 / d.reference_gb_per_s.max(1e-9)
                );
                Some(d)
            }
            Err(e) => {
                println!("dram       NOT MEASURED: {e}");
                if code == exit::OK {
                    code = exit::USAGE;
                }
                None
            }
        }
    };

    // next commands
    let model = a
        .model
        .as_deref()
        .map(shell_path)
        .unwrap_or_else(|| "~/k3model".into());
    // A --dir in RAM (tmpfs, ramfs) was refused above: the trunk is not suggested there.
    let dir_in_ram = |d: &Path| filesystem(d).is_ok_and(|(_, ram)| ram);
    let trunk_dir = a.trunk.clone().unwrap_or_else(|| match &probe {
        Some((d, _)) if !dir_in_ram(d) => std::fs::canonicalize(d)
            .unwrap_or_else(|_| d.clone())
            .join("k3trunk"),
        _ => PathBuf::from("/path/on/a/local/disk/k3trunk"),
    });
    let trunk = shell_path(&trunk_dir);
    let mut next = Vec::new();
    if let Some(p) = preset {
        if !trunk_dir.join("trunk.json").is_file() {
            // a partial download gives wrong tokens, not an error: check it before packing
            next.push(format!("k3-run verify {model} --release kimi-k3"));
            next.push(format!("k3-run pack-trunk {model} {trunk}"));
        }
        next.push(format!(
            "k3-run {model} --trunk {trunk} --preset {p} --tok {model} --prompt \"The capital of France is\" --gen 8 --incremental{}",
            if physical != logical {
                format!(" --threads {physical}")
            } else {
                String::new()
            }
        ));
        if next.len() > 1 {
            println!(
                "next       (check the download, pack once onto {}; then run)",
                if disk.is_some() {
                    "the disk measured above"
                } else {
                    "your fastest local disk (not measured here)"
                }
            );
        } else {
            println!("next       (the trunk is packed: run)");
        }
        for c in &next {
            println!("  {c}");
        }
        if next.len() > 1 {
            println!(
                "           (to compare every byte with the published digests too; reads all 1.56 TB, ~19 min at 1.4 GB/s: curl -s \
                 https://huggingface.co/api/models/moonshotai/Kimi-K3/tree/main > k3-tree.json; \
                 k3-run verify {model} --sizes k3-tree.json --hash)"
            );
        }
    } else {
        println!(
            "next       nothing to run: free memory (close programs) or use a machine with >= {MIN_LAPTOP_GB:.0} GB available"
        );
    }

    if let Some(p) = &a.json {
        let j = serde_json::json!({
            "cpu_model": cpu_model(),
            "logical_cpus": logical,
            "physical_cores": physical,
            "isa_available": isas,
            "isa_active": active,
            "rustc": rustc,
            "cargo": cargo,
            "platform": platform::OS,
            "platform_features": platform::features(),
            "meminfo": meminfo,
            "cgroup_limit_bytes": cg.map(|c| c.0),
            "available_bytes": available,
            "transparent_huge_pages": thp,
            "preset": preset,
            "context": context,
            "disk": disk,
            "disk_floor_mb_per_s": disk.as_ref().and_then(|d| floor_read(&d.reads)).map(|r| r.mb_per_s),
            "dram": dram,
            "next_commands": next,
            "exit_code": code,
        });
        let text = serde_json::to_string_pretty(&j).map_err(|e| Failure::usage(e.to_string()))?;
        crate::cli::write_atomic(p, text.as_bytes()).map_err(|e| Failure {
            code: exit::OUT_WRITE,
            msg: format!("cannot write --json {}: {e}", p.display()),
        })?;
    }
    Ok(code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(clap::Parser)]
    struct DoctorCli {
        #[command(flatten)]
        a: DoctorArgs,
    }

    fn doctor_args(argv: &[&str]) -> DoctorArgs {
        use clap::Parser;
        DoctorCli::parse_from(std::iter::once("doctor").chain(argv.iter().copied())).a
    }

    #[test]
    fn the_probe_goes_where_the_trunk_or_model_will_live_never_to_the_cwd_by_default() {
        let tmp = tempfile::tempdir().unwrap();
        let t = tmp.path().to_str().unwrap();
        let not_yet = format!("{t}/a/b/k3trunk");
        assert_eq!(probe_dir(&doctor_args(&[])), None);
        assert_eq!(
            probe_dir(&doctor_args(&[
                "--dir", "/x", "--trunk", t, "--model", "/m"
            ])),
            Some((PathBuf::from("/x"), "--dir"))
        );
        assert_eq!(
            probe_dir(&doctor_args(&["--trunk", &not_yet, "--model", "/m"])),
            Some((tmp.path().to_path_buf(), "--trunk")),
            "a trunk not packed yet: its nearest existing parent"
        );
        assert_eq!(
            probe_dir(&doctor_args(&["--model", "/m"])),
            Some((PathBuf::from("/m"), "--model"))
        );
    }

    const GB: u64 = 1_000_000_000;

    #[test]
    fn preset_thresholds_are_the_memory_plan_prints_contexts_for() {
        // `k3-run plan` plans each preset's longest context in the memory doctor picks it at
        for (gb, name) in PRESET_THRESHOLDS_GB {
            let m = k3_engine::session::PRESET_MEMORY_GB
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, g)| *g);
            assert_eq!(m, Some(gb), "{name}");
        }
    }

    #[test]
    fn the_context_counts_the_latent_mla_cache_at_the_recommended_preset() {
        use k3_models::spec::AttnKind;
        let (plan, source) = context_model(None).expect("the release's config");
        assert!(source.contains("released Kimi K3"), "{source}");
        let spec = k3_engine::model::release_spec().expect("release spec");
        let m = spec.mla.as_ref().expect("MLA");
        let n_mla = spec
            .layers
            .iter()
            .filter(|l| l.attn == AttnKind::Mla)
            .count() as u64;
        assert_eq!(n_mla, 24);
        // per position: normalised c_kv and the shared k_rope of every MLA layer, f32
        let latent = n_mla * 4 * (m.kv_lora_rank + m.d_rope) as u64;
        let expanded = n_mla * 4 * (m.n_heads * (m.d_nope + m.d_v) + m.d_rope) as u64;
        for av in [12 * GB, 23 * GB, 40 * GB, 150 * GB] {
            let preset = pick_preset(av).expect("a preset");
            let c = context_at(&plan, preset, av).expect("planned");
            assert_eq!(c.preset, preset);
            let n = c.longest.expect("a ring slot fits") as u64;
            // what is left after the weights, the fixed state and the prompt chunks holds n
            // positions of latent cache (and their embedding pages) and not one more
            let free = av - c.planned_bytes - plan.state_bytes() - plan.prefill_bytes();
            let need = |n: u64| latent * n + plan.embed_touched_bytes(n as usize);
            assert!(need(n) <= free && need(n + 1) > free, "{preset} {av}: {n}");
            // the expanded cache would hold far fewer: doctor does not count it
            assert!(n > 10 * (free / expanded), "{preset}: {n}");
            let line = context_line(&plan, &c, &source);
            assert!(line.contains(&format!("{n} positions")), "{line}");
            assert!(line.contains(&format!("at the {preset} preset")), "{line}");
            assert!(line.contains("24 MLA layers"), "{line}");
            assert!(
                line.contains(&crate::stream::fmt_bytes(latent)),
                "{line} vs {latent} B"
            );
        }
    }

    #[test]
    fn the_context_is_planned_for_the_model_directory_when_it_has_a_config() {
        let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/models/A/ckpt");
        let (plan, source) = context_model(Some(&fixture)).expect("fixture A");
        assert!(source.contains("config.json"), "{source}");
        let spec = k3_engine::model::load_spec(&fixture, None, None).expect("fixture A spec");
        let m = spec.mla.as_ref().expect("MLA");
        let n_mla = plan
            .layers
            .iter()
            .filter(|l| l.kv_bytes_per_position > 0)
            .count() as u64;
        assert_eq!(
            plan.kv_bytes_per_position(),
            n_mla * 4 * (m.kv_lora_rank + m.d_rope) as u64
        );
        // not downloaded yet: the release's widths
        let tmp = tempfile::tempdir().unwrap();
        let (_, source) = context_model(Some(tmp.path())).expect("the release's config");
        assert!(source.contains("released Kimi K3"), "{source}");
        // a config.json that is not a model: the error names the directory
        std::fs::write(tmp.path().join("config.json"), "{}").unwrap();
        let e = context_model(Some(tmp.path())).expect_err("not a model");
        assert!(e.contains(&tmp.path().display().to_string()), "{e}");
    }

    #[test]
    fn preset_follows_available_memory() {
        assert_eq!(pick_preset(0), None);
        assert_eq!(pick_preset(8 * GB), None);
        assert_eq!(pick_preset(10 * GB - 1), None);
        assert_eq!(pick_preset(10 * GB), Some("laptop"));
        // this 24 GB machine (MemAvailable ~23 GB)
        assert_eq!(pick_preset(23_231_456 * 1024), Some("laptop"));
        assert_eq!(pick_preset(32 * GB - 1), Some("laptop"));
        assert_eq!(pick_preset(32 * GB), Some("desktop"));
        assert_eq!(pick_preset(95 * GB), Some("desktop"));
        assert_eq!(pick_preset(96 * GB), Some("workstation"));
        assert_eq!(pick_preset(191 * GB), Some("workstation"));
        assert_eq!(pick_preset(192 * GB), Some("server"));
        assert_eq!(pick_preset(2000 * GB), Some("server"));
        assert_eq!(next_preset(23 * GB), Some(("desktop", 32.0)));
        assert_eq!(next_preset(5 * GB), Some(("laptop", 10.0)));
        assert_eq!(next_preset(500 * GB), None);
        // every preset the doctor can pick is a shipped preset
        for (_, name) in PRESET_THRESHOLDS_GB {
            crate::stream::presets::load_preset(name).expect("shipped preset");
        }
    }

    #[test]
    fn reserved_pool_line_says_what_is_there() {
        let m = MemInfo {
            huge_page_size: 2 << 20,
            huge_pages_total: 1400,
            huge_pages_free: 1200,
            ..MemInfo::default()
        };
        let l = reserved_pool_line(&m, true).expect("a pool");
        assert!(l.contains("1200 of 1400"), "{l}");
        assert!(l.contains(&gb(1200 * (2 << 20))), "{l}");
        let none = MemInfo {
            huge_pages_total: 0,
            huge_pages_free: 0,
            ..m
        };
        assert!(reserved_pool_line(&none, false).is_none());
        assert!(
            reserved_pool_line(&none, true)
                .expect("hint")
                .contains("vm.nr_hugepages")
        );
        assert!(
            reserved_pool_line(&none, true)
                .expect("hint")
                .contains("--io page-cache")
        );
        let gig = MemInfo {
            huge_page_size: 1 << 30,
            ..m
        };
        assert!(
            reserved_pool_line(&gig, true)
                .expect("line")
                .contains("not used")
        );
    }

    #[test]
    fn page_reporting_line_says_whether_freed_memory_leaves() {
        // no balloon, or no reporting in the kernel: nothing to say
        assert!(page_reporting_line(false, Some((9, Some(1 << 30)))).is_none());
        assert!(page_reporting_line(true, None).is_none());
        let on = page_reporting_line(true, Some((9, Some(1 << 30)))).expect("a line");
        assert!(on.contains("page_reporting_order 9"), "{on}");
        assert!(on.contains(&gb(1 << 40)), "the amount reported: {on}");
        assert!(on.contains("echo 11 >"), "the administrator's lever: {on}");
        assert!(
            on.contains("vm.nr_hugepages") && on.contains("--io page-cache"),
            "{on}"
        );
        // a kernel without the count still gets the line, without an amount
        let on = page_reporting_line(true, Some((9, None))).expect("a line");
        assert!(!on.contains("so far"), "{on}");
        // stopped: no advice to stop it
        let off = page_reporting_line(true, Some((11, Some(5)))).expect("a line");
        assert!(
            off.contains("stays with this VM") && !off.contains("echo"),
            "{off}"
        );
    }

    #[test]
    fn tool_versions() {
        assert_eq!(
            parse_tool_version("rustc 1.95.0 (abcdef 2026-01-01)"),
            Some((1, 95, 0))
        );
        assert_eq!(
            parse_tool_version("cargo 1.96.0-nightly (x)"),
            Some((1, 96, 0))
        );
        assert_eq!(parse_tool_version("rustc"), None);
        assert_eq!(parse_tool_version("rustc x.y"), None);
    }

    #[test]
    fn random_offsets_are_an_aligned_permutation() {
        let block = 8 << 20;
        let o = random_offsets(1000, block, 7);
        assert_eq!(o.len(), 1000);
        assert!(o.iter().all(|&x| x % block as u64 == 0 && x % 4096 == 0));
        let mut s = o.clone();
        s.sort_unstable();
        s.dedup();
        assert_eq!(s.len(), 1000, "every block exactly once");
        assert_eq!(*s.last().expect("non-empty"), 999 * block as u64);
        // not the identity order, and deterministic
        assert_ne!(o, (0..1000).map(|i| i * block as u64).collect::<Vec<_>>());
        assert_eq!(o, random_offsets(1000, block, 7));
    }

    #[test]
    fn floor_takes_the_fastest_read_at_the_deepest_queue() {
        let r = |order, qd, mb| ReadResult {
            order,
            qd,
            block_bytes: 8 << 20,
            reads: 10,
            bytes: 80 << 20,
            seconds: 1.0,
            mb_per_s: mb,
            latency_median_ms: 1.0,
            latency_p99_ms: 2.0,
        };
        let reads = vec![
            r(ReadOrder::Random, 1, 3000.0),
            r(ReadOrder::Random, 16, 1100.0),
            r(ReadOrder::Sequential, 1, 900.0),
            r(ReadOrder::Sequential, 16, 2400.0),
        ];
        let f = floor_read(&reads).expect("some");
        assert_eq!(
            (f.order, f.qd, f.mb_per_s),
            (ReadOrder::Sequential, 16, 2400.0)
        );
        assert!(floor_read(&[]).is_none());
    }

    #[test]
    fn quantiles_and_median() {
        let mut v = vec![5.0, 1.0, 3.0, 2.0, 4.0];
        assert_eq!(median(&mut v.clone()), 3.0);
        assert_eq!(quantile(&mut v, 0.0), 1.0);
        assert_eq!(quantile(&mut v, 1.0), 5.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(&mut []), 0.0);
    }

    #[test]
    fn filesystems_and_mounts() {
        assert!(fs_is_ram(0x0102_1994));
        assert!(!fs_is_ram(0xEF53));
        assert_eq!(fs_name(0xEF53), "ext4");
        let m =
            "/dev/vda / ext4 rw 0 0\ntmpfs /tmp tmpfs rw 0 0\n/dev/sdb1 /work/data xfs rw 0 0\n";
        assert_eq!(
            mount_of(m, Path::new("/work/data/x")),
            Some(("/dev/sdb1".into(), "/work/data".into()))
        );
        assert_eq!(
            mount_of(m, Path::new("/work/bench")),
            Some(("/dev/vda".into(), "/".into()))
        );
        assert_eq!(
            mount_of(m, Path::new("/tmp")),
            Some(("tmpfs".into(), "/tmp".into()))
        );
    }
}
