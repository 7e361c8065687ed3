//! Aligned, RAII-owned I/O buffers from anonymous `mmap`.
//!
//! Owns: allocating buffers whose address (and usable length) are multiples of the O_DIRECT
//! alignment (4096) — or of 2 MiB for large buffers, advised as transparent huge pages with
//! `madvise(MADV_HUGEPAGE)` where the kernel allows it, or taken from the reserved huge-page
//! pool when the caller asks for [`PageSource::ReservedFirst`] and the pool has room — and
//! unmapping them on drop.
//! Must not: read files or know what the bytes mean.
//! Follows upstream: docs/DESIGN.md §3 ("buffers are 2 MB huge-page backed: O_DIRECT pins every
//! target page; 4 KB pages cost ~54 million pin operations per token on real K3") and
//! rust-deps.md Q4 (anonymous mapping + madvise by default: MAP_HUGETLB needs reserved huge
//! pages, `vm.nr_hugepages`, which is 0 unless an administrator sets it).
//!
//! Why the reserved pool at all: on a VM whose balloon device reports free pages to the host
//! (virtio-balloon free page reporting), memory a process frees is handed back to the host
//! within seconds and the next first touch faults on the host: 0.6-1.1 GB/s measured on the
//! development VMs, below the disk's O_DIRECT rate, so a fresh pinned prefix loads at the rate
//! the host backs memory, not the disk's. Pages in the `vm.nr_hugepages` pool are never on the
//! guest's free lists, so they stay backed between runs (5.4-7.5 GB/s to touch after 15-30 s
//! idle; docs/history/PERFORMANCE-LOG.md §8.6). getrusage does not count them in the RSS and
//! the memory cgroup does not charge them: callers report them apart.

use std::io;
use std::ptr::NonNull;
use std::sync::{Arc, Weak};

use crate::platform::{self, AnonMap, MemAdvice};

/// The alignment every buffer (address and capacity) satisfies: the common O_DIRECT limit.
pub const IO_ALIGN: usize = 4096;
/// Transparent huge page size on x86-64 / most arm64 kernels; large buffers align to it.
pub const HUGE_PAGE: usize = 2 << 20;

/// Where a large (2 MiB-aligned) buffer's pages come from. Small buffers are always plain
/// anonymous memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PageSource {
    /// Anonymous memory, advised as 2 MB transparent huge pages.
    #[default]
    Anonymous,
    /// 2 MB pages of the reserved pool (`MAP_HUGETLB`; `vm.nr_hugepages`) when the pool has
    /// enough free pages for the whole buffer (the mapping reserves them up front, so a later
    /// fault cannot fail); otherwise as [`PageSource::Anonymous`].
    ReservedFirst,
}

/// Round `n` up to a multiple of `align` (a power of two).
pub fn align_up(n: u64, align: u64) -> u64 {
    debug_assert!(align.is_power_of_two());
    n.div_ceil(align) * align
}

/// Round `n` down to a multiple of `align` (a power of two).
pub fn align_down(n: u64, align: u64) -> u64 {
    debug_assert!(align.is_power_of_two());
    n & !(align - 1)
}

/// One anonymous mapping ([`AnonMap`], aligned); unmapped when the last buffer carved from it
/// is dropped.
#[derive(Debug)]
struct Region {
    start: NonNull<u8>,
    len: usize,
    /// Pages of the reserved huge-page pool (`MAP_HUGETLB`).
    hugetlb: bool,
    /// Owns the memory; unmapped on drop.
    _map: AnonMap,
}

// SAFETY: the region is only ever unmapped (when its AnonMap drops, once); all access to its
// bytes goes through the disjoint `AlignedBuf`s carved from it.
unsafe impl Send for Region {}
// SAFETY: see above.
unsafe impl Sync for Region {}

impl Region {
    fn from_map(map: AnonMap) -> Region {
        Region {
            start: map.start(),
            len: map.len(),
            hugetlb: map.huge_reserved(),
            _map: map,
        }
    }

    /// Map `capacity` zeroed bytes (a multiple of 4096) starting at a multiple of `align`;
    /// advise huge pages when `align >= HUGE_PAGE`. Returns the region and whether the advice
    /// was accepted. With [`PageSource::ReservedFirst`] and `align == HUGE_PAGE`, first try the
    /// reserved pool (reported as huge pages).
    fn map(
        capacity: usize,
        align: usize,
        len_for_errors: usize,
        source: PageSource,
    ) -> io::Result<(Region, bool)> {
        if source == PageSource::ReservedFirst
            && align == HUGE_PAGE
            && let Some(r) = Self::map_reserved(capacity)
        {
            return Ok((r, true));
        }
        capacity
            .checked_add(align)
            .ok_or_else(|| too_big(len_for_errors))?;
        let map = AnonMap::new(capacity, align)?;
        let mut huge_pages = false;
        if align >= HUGE_PAGE {
            // SAFETY: the range is our own mapping; huge-page advice is only a hint (absent
            // off Linux: the buffer keeps the base pages).
            huge_pages = unsafe {
                platform::advise_memory(
                    map.start().as_ptr() as usize,
                    capacity,
                    MemAdvice::HugePage,
                )
            }
            .is_ok();
        }
        Ok((Region::from_map(map), huge_pages))
    }

    /// `capacity` bytes (rounded up to 2 MiB) of the reserved huge-page pool, or `None` when
    /// the pool cannot reserve them all (none configured, too few free, not 2 MiB pages, or a
    /// platform without one).
    fn map_reserved(capacity: usize) -> Option<Region> {
        let len = usize::try_from(align_up(capacity as u64, HUGE_PAGE as u64)).ok()?;
        AnonMap::reserved_huge(len).map(Region::from_map)
    }
}

/// A zero-initialised byte buffer backed by an anonymous mapping: its own, or a disjoint
/// piece of one shared with its siblings ([`AlignedBuf::carve`]).
///
/// `len()` is the requested length; `capacity()` is `len` rounded up to the buffer's alignment
/// (at least [`IO_ALIGN`]), so an O_DIRECT read rounded out to 4096 always fits.
#[derive(Debug)]
pub struct AlignedBuf {
    /// Start of the aligned region (inside the mapping).
    ptr: NonNull<u8>,
    /// The requested length.
    len: usize,
    capacity: usize,
    align: usize,
    huge_pages: bool,
    /// Keeps the mapping alive; shared by every buffer carved from it.
    region: Arc<Region>,
    /// For a buffer lent by an [`EndsRing`]: the ring sees the range as taken while this lives.
    _lease: Option<Arc<()>>,
}

// SAFETY: the buffer exclusively owns its byte range (buffers carved from one region are
// disjoint); `&AlignedBuf` only hands out `&[u8]` and `&mut AlignedBuf` only `&mut [u8]`, so
// the usual borrow rules make sharing sound.
unsafe impl Send for AlignedBuf {}
// SAFETY: see above; no interior mutability.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A buffer of `len` bytes: 2 MiB-aligned and huge-page advised when `len >= 2 MiB`,
    /// otherwise 4096-aligned.
    pub fn new(len: usize) -> io::Result<Self> {
        let align = if len >= HUGE_PAGE {
            HUGE_PAGE
        } else {
            IO_ALIGN
        };
        Self::with_align(len, align)
    }

    /// A buffer of `len` bytes aligned to `align` (a power of two >= 4096). Alignments of
    /// 2 MiB or more are advised as huge pages.
    pub fn with_align(len: usize, align: usize) -> io::Result<Self> {
        Self::with_align_from(len, align, PageSource::Anonymous)
    }

    /// [`AlignedBuf::new`] with its pages from `source` (large buffers only).
    pub fn new_from(len: usize, source: PageSource) -> io::Result<Self> {
        let align = if len >= HUGE_PAGE {
            HUGE_PAGE
        } else {
            IO_ALIGN
        };
        Self::with_align_from(len, align, source)
    }

    /// [`AlignedBuf::with_align`] with its pages from `source` (2 MiB alignments only).
    pub fn with_align_from(len: usize, align: usize, source: PageSource) -> io::Result<Self> {
        if !align.is_power_of_two() || align < IO_ALIGN {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("buffer alignment {align} is not a power of two >= {IO_ALIGN}"),
            ));
        }
        let capacity = align_up(len.max(1) as u64, align.min(HUGE_PAGE) as u64);
        let capacity = usize::try_from(capacity).map_err(|_| too_big(len))?;
        let (region, huge_pages) = Region::map(capacity, align, len, source)?;
        Ok(Self {
            ptr: region.start,
            len,
            capacity,
            align,
            huge_pages,
            region: Arc::new(region),
            _lease: None,
        })
    }

    /// `count` buffers of `len` bytes each, carved from ONE huge-page-advised mapping: each
    /// starts at a multiple of 4096 (`capacity()` = `len` rounded up to 4096) and they never
    /// overlap. For many small buffers (routed experts, ~0.4 MB each on k3-mini) that must
    /// read fast: on this machine's virtio disk a 408 KiB O_DIRECT read into 4 KiB pages ran at
    /// ~1.1 GB/s and into 2 MiB pages at ~2.2-3.0 GB/s (docs/history/PERFORMANCE-LOG.md §4.3). The mapping is
    /// unmapped when the last of them is dropped.
    pub fn carve(count: usize, len: usize) -> io::Result<Vec<AlignedBuf>> {
        if count == 0 {
            return Ok(Vec::new());
        }
        let stride = align_up(len.max(1) as u64, IO_ALIGN as u64);
        let total = stride
            .checked_mul(count as u64)
            .map(|t| align_up(t, HUGE_PAGE as u64))
            .ok_or_else(|| too_big(len))?;
        let total = usize::try_from(total).map_err(|_| too_big(len))?;
        let stride = stride as usize;
        let (region, huge_pages) = Region::map(total, HUGE_PAGE, len, PageSource::Anonymous)?;
        let region = Arc::new(region);
        Ok((0..count)
            .map(|i| AlignedBuf {
                // SAFETY: i * stride + stride <= count * stride <= total: inside the region.
                ptr: unsafe { NonNull::new_unchecked(region.start.as_ptr().add(i * stride)) },
                len,
                capacity: stride,
                align: IO_ALIGN,
                huge_pages,
                region: Arc::clone(&region),
                _lease: None,
            })
            .collect())
    }

    /// The requested length.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Usable bytes (the requested length rounded up to the alignment).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Alignment of the start address.
    pub fn align(&self) -> usize {
        self.align
    }

    /// Whether the buffer is on huge pages: `madvise(MADV_HUGEPAGE)` accepted, or pages of
    /// the reserved pool.
    pub fn huge_pages(&self) -> bool {
        self.huge_pages
    }

    /// Whether the buffer's pages come from the reserved huge-page pool (not counted in the
    /// process's RSS by getrusage).
    pub fn hugetlb(&self) -> bool {
        self.region.hugetlb
    }

    /// The first `len()` bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the mapping holds `capacity >= len` readable bytes, zero-initialised by mmap.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The first `len()` bytes, mutable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` guarantees exclusivity.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// All `capacity()` bytes (for rounded-out O_DIRECT reads).
    pub fn full(&self) -> &[u8] {
        // SAFETY: the mapping holds `capacity` bytes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.capacity) }
    }

    /// All `capacity()` bytes, mutable.
    pub fn full_mut(&mut self) -> &mut [u8] {
        // SAFETY: the mapping holds `capacity` bytes; `&mut self` guarantees exclusivity.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.capacity) }
    }
}

/// One buffer whose two ends are lent out as [`AlignedBuf`]s: a buffer flush with the start
/// or flush with the end, never overlapping a lent buffer that is still alive (dropping a lent
/// buffer returns its range). The trunk's shared ring: a layer is read into one end while the
/// layer before it computes at the other, whenever the two fit side by side.
#[derive(Debug)]
pub struct EndsRing {
    region: Arc<Region>,
    capacity: usize,
    huge_pages: bool,
    /// (start, capacity, lease) of every buffer lent; dead leases are pruned on the next lend.
    lent: Vec<(usize, usize, Weak<()>)>,
}

impl EndsRing {
    /// A ring of `len` bytes rounded up to 4096, 2 MiB-aligned and huge-page advised.
    pub fn new(len: usize) -> io::Result<Self> {
        Self::new_from(len, PageSource::Anonymous)
    }

    /// [`EndsRing::new`] with its pages from `source`.
    pub fn new_from(len: usize, source: PageSource) -> io::Result<Self> {
        let capacity = usize::try_from(align_up(len.max(1) as u64, IO_ALIGN as u64))
            .map_err(|_| too_big(len))?;
        let map_len = usize::try_from(align_up(capacity as u64, HUGE_PAGE as u64))
            .map_err(|_| too_big(len))?;
        let (region, huge_pages) = Region::map(map_len, HUGE_PAGE, len, source)?;
        Ok(Self {
            region: Arc::new(region),
            capacity,
            huge_pages,
            lent: Vec::new(),
        })
    }

    /// Usable bytes (a multiple of 4096).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Whether `madvise(MADV_HUGEPAGE)` was accepted (or the pages are the reserved pool's).
    pub fn huge_pages(&self) -> bool {
        self.huge_pages
    }

    /// Whether the ring's pages come from the reserved huge-page pool.
    pub fn hugetlb(&self) -> bool {
        self.region.hugetlb
    }

    /// Bytes of the mapping (on the reserved pool: rounded up to 2 MiB).
    pub fn mapped_bytes(&self) -> usize {
        self.region.len
    }

    /// Bytes currently lent out (buffers still alive).
    pub fn lent_bytes(&self) -> usize {
        self.lent
            .iter()
            .filter(|(_, _, w)| w.strong_count() > 0)
            .map(|&(_, c, _)| c)
            .sum()
    }

    /// A buffer of `len` bytes (capacity rounded up to 4096) at the start (`at_start`) or
    /// ending at the ring's end; `None` while that range overlaps a lent buffer still alive,
    /// or when `len` exceeds the ring.
    pub fn lend(&mut self, len: usize, at_start: bool) -> Option<AlignedBuf> {
        let cap = usize::try_from(align_up(len.max(1) as u64, IO_ALIGN as u64)).ok()?;
        if cap > self.capacity {
            return None;
        }
        let start = if at_start { 0 } else { self.capacity - cap };
        self.lent.retain(|(_, _, w)| w.strong_count() > 0);
        if self
            .lent
            .iter()
            .any(|&(s, c, _)| start < s + c && s < start + cap)
        {
            return None;
        }
        let lease = Arc::new(());
        self.lent.push((start, cap, Arc::downgrade(&lease)));
        Some(AlignedBuf {
            // SAFETY: start + cap <= capacity <= the mapping's length; the range overlaps no
            // other live buffer lent by this ring (checked above), and the ring lends nothing
            // else, so the new buffer owns its bytes exclusively while it lives.
            ptr: unsafe { NonNull::new_unchecked(self.region.start.as_ptr().add(start)) },
            len,
            capacity: cap,
            align: IO_ALIGN,
            huge_pages: self.huge_pages,
            region: Arc::clone(&self.region),
            _lease: Some(lease),
        })
    }
}

fn too_big(len: usize) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("buffer of {len} bytes overflows the address space"),
    )
}

/// `madvise(MADV_POPULATE_WRITE)` over each region in 8 MiB steps, in order; stops quietly at
/// the first refusal (older kernels, macOS, Windows: the readers then fault their pages
/// themselves).
pub fn populate_ahead(regions: &[(usize, usize)]) {
    populate_ahead_while(regions, || true);
}

/// [`populate_ahead`], stopping before any step for which `go()` is false (a load that was
/// cancelled: its buffers are about to be freed).
pub fn populate_ahead_while(regions: &[(usize, usize)], go: impl Fn() -> bool) {
    const STEP: usize = 8 << 20;
    for &(addr, len) in regions {
        let mut off = 0;
        while off < len {
            if !go() {
                return;
            }
            let n = STEP.min(len - off);
            // SAFETY: the range lies inside a live anonymous mapping owned by the caller (the
            // pinned buffers outlive the scope this runs in); POPULATE_WRITE only faults pages
            // in and never changes the contents of a page already present.
            let r = unsafe { platform::advise_memory(addr + off, n, MemAdvice::PopulateWrite) };
            if r.is_err() {
                return;
            }
            off += n;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_buffers_are_4k_aligned_and_zeroed() {
        for len in [0usize, 1, 4095, 4096, 4097, 100_000] {
            let b = AlignedBuf::new(len).expect("alloc");
            assert_eq!(b.as_slice().as_ptr() as usize % IO_ALIGN, 0, "len {len}");
            assert_eq!(b.len(), len);
            assert!(b.capacity() >= len && b.capacity().is_multiple_of(IO_ALIGN));
            assert!(b.full().iter().all(|&x| x == 0));
        }
    }

    #[test]
    fn large_buffers_are_2m_aligned_and_writable() {
        let mut b = AlignedBuf::new(HUGE_PAGE + 123).expect("alloc");
        assert_eq!(b.as_slice().as_ptr() as usize % HUGE_PAGE, 0);
        assert_eq!(b.capacity() % HUGE_PAGE, 0);
        let cap = b.capacity();
        b.full_mut()[cap - 1] = 7;
        b.as_mut_slice()[0] = 9;
        assert_eq!(b.full()[cap - 1], 7);
        assert_eq!(b.as_slice()[0], 9);
    }

    #[test]
    fn carved_buffers_are_disjoint_aligned_and_outlive_each_other() {
        let mut bufs = AlignedBuf::carve(5, 417_792 + 5).expect("carve");
        assert_eq!(bufs.len(), 5);
        for (i, b) in bufs.iter_mut().enumerate() {
            assert_eq!(b.as_slice().as_ptr() as usize % IO_ALIGN, 0);
            assert_eq!(b.len(), 417_797);
            assert!(b.capacity() >= b.len() && b.capacity().is_multiple_of(IO_ALIGN));
            assert!(b.full().iter().all(|&x| x == 0), "buffer {i} starts zeroed");
            b.full_mut().fill(i as u8 + 1);
        }
        let starts: Vec<usize> = bufs.iter().map(|b| b.full().as_ptr() as usize).collect();
        assert_eq!(starts[0] % HUGE_PAGE, 0, "the region starts on a huge page");
        for w in starts.windows(2) {
            assert!(w[1] >= w[0] + bufs[0].capacity(), "no overlap");
        }
        // Dropping some keeps the others (and their bytes) alive.
        let keep = bufs.pop().expect("five");
        drop(bufs);
        assert!(keep.full().iter().all(|&x| x == 5));
        assert!(AlignedBuf::carve(0, 100).expect("empty").is_empty());
    }

    #[test]
    fn ends_ring_lends_disjoint_ends_and_takes_them_back_on_drop() {
        let mut r = EndsRing::new(10 * IO_ALIGN + 1).expect("ring");
        assert_eq!(r.capacity(), 11 * IO_ALIGN);
        let mut a = r.lend(6 * IO_ALIGN, true).expect("start end is free");
        assert_eq!(a.full().as_ptr() as usize % HUGE_PAGE, 0);
        // 6 + 6 pages do not fit beside each other in 11; 6 + 5 do, flush with the end.
        assert!(r.lend(6 * IO_ALIGN, false).is_none());
        assert!(r.lend(IO_ALIGN, true).is_none(), "the start is lent");
        let mut b = r.lend(5 * IO_ALIGN - 7, false).expect("fits beside");
        assert_eq!(b.capacity(), 5 * IO_ALIGN);
        assert_eq!(
            b.full().as_ptr() as usize,
            a.full().as_ptr() as usize + 6 * IO_ALIGN
        );
        a.full_mut().fill(1);
        b.full_mut().fill(2);
        assert!(a.full().iter().all(|&x| x == 1));
        assert_eq!(r.lent_bytes(), 11 * IO_ALIGN);
        assert!(
            r.lend(12 * IO_ALIGN, true).is_none(),
            "larger than the ring"
        );
        drop(a);
        assert_eq!(r.lent_bytes(), 5 * IO_ALIGN);
        let c = r.lend(6 * IO_ALIGN, true).expect("freed by the drop");
        assert!(r.lend(IO_ALIGN, false).is_none(), "the end is still lent");
        drop(r); // the mapping outlives the ring while buffers live
        assert!(b.full().iter().all(|&x| x == 2));
        assert_eq!(c.capacity(), 6 * IO_ALIGN);
    }

    /// Free 2 MiB pages of the reserved pool, from /proc/meminfo (0 when there is none).
    fn pool_free_pages() -> u64 {
        crate::platform::memory::reserved_pool_free_bytes().unwrap_or(0) / HUGE_PAGE as u64
    }

    /// Reserved-first buffers behave like any other: aligned, zeroed, writable, and on the
    /// pool exactly when it has room (with `vm.nr_hugepages` 0, the default, they fall back to
    /// anonymous memory; docs/TESTING.md records a run of the suite with a pool reserved).
    #[test]
    fn reserved_first_buffers_use_the_pool_when_it_has_room_and_fall_back_otherwise() {
        let free_before = pool_free_pages();
        let mut b = AlignedBuf::new_from(2 * HUGE_PAGE + 5, PageSource::ReservedFirst)
            .expect("reserved-first alloc");
        assert_eq!(b.as_slice().as_ptr() as usize % HUGE_PAGE, 0);
        assert_eq!(b.capacity(), 3 * HUGE_PAGE);
        assert!(b.huge_pages() || !b.hugetlb());
        assert!(b.full().iter().all(|&x| x == 0), "starts zeroed");
        b.full_mut().fill(3);
        assert!(b.as_slice().iter().all(|&x| x == 3));
        // Other tests may take pool pages meanwhile; with 32 free (64 MiB) there is room.
        if free_before >= 32 {
            assert!(
                b.hugetlb(),
                "{free_before} free pool pages, yet not on the pool"
            );
        } else if free_before == 0 {
            assert!(!b.hugetlb(), "no pool, yet on it");
        }
        // Small buffers and anonymous requests never touch the pool.
        let small = AlignedBuf::new_from(100_000, PageSource::ReservedFirst).expect("small");
        assert!(!small.hugetlb());
        assert_eq!(small.as_slice().as_ptr() as usize % IO_ALIGN, 0);
        let anon = AlignedBuf::new_from(2 * HUGE_PAGE, PageSource::Anonymous).expect("anon");
        assert!(!anon.hugetlb());
        let mut r = EndsRing::new_from(HUGE_PAGE + IO_ALIGN, PageSource::ReservedFirst)
            .expect("reserved-first ring");
        assert!(r.mapped_bytes() >= r.capacity());
        let mut x = r.lend(IO_ALIGN, false).expect("end");
        x.full_mut().fill(9);
        assert_eq!(x.hugetlb(), r.hugetlb());
        assert!(x.full().iter().all(|&v| v == 9));
    }

    #[test]
    fn rejects_bad_alignment() {
        assert!(AlignedBuf::with_align(10, 1000).is_err());
        assert!(AlignedBuf::with_align(10, 512).is_err());
    }

    #[test]
    fn align_helpers() {
        assert_eq!(align_up(0, 4096), 0);
        assert_eq!(align_up(1, 4096), 4096);
        assert_eq!(align_up(4096, 4096), 4096);
        assert_eq!(align_down(4097, 4096), 4096);
        assert_eq!(align_down(4095, 512), 3584);
    }
}
