//! I/O policies: how the packed trunk and the routed experts are read.
//!
//! Owns: parsing `configs/io/*.toml` (unknown keys refused); the built-in `direct` (default),
//! `page-cache` (direct with the pinned prefix in trunk.bin's page cache) and `mmap`
//! (page-cache comparison for the benchmark) policies.
//! Must not: open files (the trunk and expert store do).
//! Follows upstream: docs/DESIGN.md §3 (O_DIRECT, 2 MB pages) and issue 4 ("the same model through
//! a plain mmap + page-cache path ... to show what the pinned prefix + O_DIRECT design buys").

use std::path::Path;

use super::StreamError;

/// How the packed trunk is held.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TrunkIo {
    /// Pinned prefix + ring slots, positional reads (O_DIRECT when `o_direct`).
    Direct,
    /// Plain `mmap` of trunk.bin through the page cache.
    Mmap,
}

/// Where the pinned prefix of a packed trunk lives (I/O policy key `pinned`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PinnedPages {
    /// Exact-size buffers filled with positional reads (O_DIRECT when `o_direct`).
    #[default]
    Buffers,
    /// trunk.bin's own page-cache pages: each pinned layer is mapped read-only, read into the
    /// page cache with `MADV_POPULATE_READ` at queue depth 16 and locked with `mlock` (when
    /// the process may lock that much; otherwise left unlocked and reported). No buffer is
    /// allocated, so fresh memory is never zeroed for it, and a run after another one finds
    /// the prefix still cached. A compressed trunk, or a kernel without
    /// `MADV_POPULATE_READ` (before Linux 5.14), falls back to buffers, reported at start.
    PageCache,
}

/// One I/O policy file.
#[derive(Clone, Debug, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct IoPolicy {
    pub name: String,
    pub trunk: TrunkIo,
    /// Open trunk.bin and the shards with O_DIRECT (falls back to buffered, reported).
    pub o_direct: bool,
    /// Advise 2 MB transparent huge pages for large buffers.
    pub huge_pages: bool,
    /// Take the pinned prefix, the ring and a resident arena from the reserved huge-page
    /// pool (`vm.nr_hugepages`) when it has room for a buffer, else as `huge_pages` says. The
    /// pool's pages stay backed between runs, where freed memory on a VM can be handed back
    /// to the host and faulted in again slowly; they are not in the peak RSS and not charged
    /// to a memory cgroup (the run reports them apart). Nothing changes while the pool is 0,
    /// the kernel's default.
    #[serde(default)]
    pub reserved_huge_pages: bool,
    /// Where the pinned prefix lives: `"buffers"` (default) or `"page-cache"`.
    #[serde(default)]
    pub pinned: PinnedPages,
    /// Reader threads for expert misses (queue depth).
    pub read_threads: usize,
    /// Try io_uring for expert reads (falls back to the thread pool at run time).
    #[serde(default)]
    pub io_uring: bool,
}

const DIRECT: &str = include_str!("../../../configs/io/direct.toml");
const MMAP: &str = include_str!("../../../configs/io/mmap.toml");
const PAGE_CACHE: &str = include_str!("../../../configs/io/page-cache.toml");

pub fn parse_io_policy(text: &str, origin: &str) -> Result<IoPolicy, StreamError> {
    let p: IoPolicy = toml::from_str(text)
        .map_err(|e| StreamError::Config(format!("I/O policy {origin}: {e}")))?;
    if p.read_threads == 0 || p.read_threads > 256 {
        return Err(StreamError::Config(format!(
            "I/O policy {origin}: read_threads must be in 1..=256, got {}",
            p.read_threads
        )));
    }
    Ok(p)
}

impl IoPolicy {
    /// Where large trunk and arena buffers' pages come from under this policy.
    pub fn page_source(&self) -> super::aligned::PageSource {
        if self.reserved_huge_pages {
            super::aligned::PageSource::ReservedFirst
        } else {
            super::aligned::PageSource::Anonymous
        }
    }

    /// The default policy (`configs/io/direct.toml`).
    pub fn direct() -> Self {
        parse_io_policy(DIRECT, "configs/io/direct.toml")
            .expect("the shipped configs/io/direct.toml is valid (unit-tested)")
    }
    /// The direct policy with the pinned prefix in the page cache
    /// (`configs/io/page-cache.toml`).
    pub fn page_cache() -> Self {
        parse_io_policy(PAGE_CACHE, "configs/io/page-cache.toml")
            .expect("the shipped configs/io/page-cache.toml is valid (unit-tested)")
    }
    /// The page-cache comparison policy (`configs/io/mmap.toml`).
    pub fn mmap() -> Self {
        parse_io_policy(MMAP, "configs/io/mmap.toml")
            .expect("the shipped configs/io/mmap.toml is valid (unit-tested)")
    }
}

impl Default for IoPolicy {
    fn default() -> Self {
        Self::direct()
    }
}

/// `--io VALUE`: `direct`, `mmap`, or a path to a policy TOML file.
pub fn load_io_policy(value: &str) -> Result<IoPolicy, StreamError> {
    match value {
        "direct" => Ok(IoPolicy::direct()),
        "mmap" => Ok(IoPolicy::mmap()),
        "page-cache" => Ok(IoPolicy::page_cache()),
        v if v.contains('/') || v.ends_with(".toml") => {
            let path = Path::new(v);
            let text = k3_models::load::read_regular_file(path)
                .map_err(|e| StreamError::io("read I/O policy", path, e))?;
            parse_io_policy(&text, v)
        }
        v => Err(StreamError::Config(format!(
            "unknown I/O policy {v:?}; built-in: direct, page-cache, mmap (or a path to a .toml)"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_policies_parse() {
        let d = parse_io_policy(DIRECT, "direct.toml").expect("direct");
        assert_eq!(
            (d.trunk, d.o_direct, d.huge_pages, d.reserved_huge_pages),
            (TrunkIo::Direct, true, true, true)
        );
        let m = parse_io_policy(MMAP, "mmap.toml").expect("mmap");
        assert_eq!(
            (m.trunk, m.o_direct, m.reserved_huge_pages),
            (TrunkIo::Mmap, false, false)
        );
        // a policy written before the key existed reads as before: no reserved pages
        let old = parse_io_policy(
            "name='x'\ntrunk='direct'\no_direct=true\nhuge_pages=true\nread_threads=4\n",
            "old.toml",
        )
        .expect("old policy");
        assert!(!old.reserved_huge_pages);
        assert_eq!(old.pinned, PinnedPages::Buffers);
        assert_eq!(d.pinned, PinnedPages::Buffers);
        let pc = parse_io_policy(PAGE_CACHE, "page-cache.toml").expect("page-cache");
        assert_eq!(
            (pc.trunk, pc.o_direct, pc.pinned),
            (TrunkIo::Direct, true, PinnedPages::PageCache)
        );
        assert_eq!(load_io_policy("page-cache").expect("page-cache"), pc);
        assert_eq!(load_io_policy("mmap").expect("mmap"), m);
        assert_eq!(IoPolicy::default(), d);
    }

    #[test]
    fn bad_policies_are_refused() {
        let e = parse_io_policy(
            "name='x'\ntrunk='direct'\no_direct=true\nhuge_pages=true\nread_threads=4\nqd=3\n",
            "x.toml",
        )
        .expect_err("unknown key");
        assert!(e.to_string().contains("qd"), "{e}");
        let e = parse_io_policy(
            "name='x'\ntrunk='nfs'\no_direct=true\nhuge_pages=true\nread_threads=4\n",
            "x.toml",
        )
        .expect_err("bad enum");
        assert!(e.to_string().contains("x.toml"), "{e}");
        let e = parse_io_policy(
            "name='x'\ntrunk='mmap'\no_direct=true\nhuge_pages=true\nread_threads=0\n",
            "x.toml",
        )
        .expect_err("zero threads");
        assert!(e.to_string().contains("read_threads"), "{e}");
        let e = parse_io_policy(
            "name='x'\ntrunk='direct'\no_direct=true\nhuge_pages=true\nread_threads=4\npinned='ram'\n",
            "x.toml",
        )
        .expect_err("bad pinned");
        assert!(
            e.to_string().contains("x.toml") && e.to_string().contains("page-cache"),
            "{e}"
        );
        assert!(load_io_policy("uring").is_err());
    }
}
