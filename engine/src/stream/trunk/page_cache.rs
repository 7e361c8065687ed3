//! The pinned prefix held in trunk.bin's own page-cache pages (I/O policy
//! `pinned = "page-cache"`): mapped read-only, read in with `MADV_POPULATE_READ` (or
//! `MADV_WILLNEED` steps), locked with `mlock`, and what is not cached yet.

use super::*;

use crate::platform::{self, MemAdvice};

/// The system's page size (4096 when it cannot be read).
pub(super) fn page_size() -> usize {
    platform::page_size()
}

/// `[addr, addr + len)` widened to start on a page boundary.
pub(super) fn page_range(addr: usize, len: usize) -> (usize, usize) {
    let start = addr & !(page_size() - 1);
    (start, len + (addr - start))
}

/// Map `len` bytes of `file` at `offset` read-only (shared: the page cache's own pages).
pub(super) fn map_range(
    file: &DirectFile,
    offset: u64,
    len: usize,
) -> Result<memmap2::Mmap, StreamError> {
    // SAFETY: the mapping is read-only; a packed trunk is not modified while a run uses it
    // (the same contract as the checkpoint's shard maps and `MmapTrunk`).
    unsafe {
        memmap2::MmapOptions::new()
            .offset(offset)
            .len(len)
            .map(file.buffered_file())
    }
    .map_err(|e| StreamError::io("map", file.path(), e))
}

/// Bytes of the pages of `[addr, addr + len)` (a live file mapping) not in the page cache now:
/// what reading it in asks of the disk.
pub(super) fn uncached_bytes(addr: usize, len: usize) -> u64 {
    let page = page_size();
    let (start, len) = page_range(addr, len);
    let mut resident = vec![0u8; len.div_ceil(page)];
    // SAFETY: the range lies inside a live mapping owned by the caller; mincore writes one
    // byte per page of it into `resident`, which has that many.
    if unsafe { platform::resident_pages(start, len, &mut resident) }.is_err() {
        return len as u64;
    }
    (resident.iter().filter(|&&v| v & 1 == 0).count() * page).min(len) as u64
}

/// `MADV_WILLNEED` steps of [`populate_read`] without huge pages: the kernel reads at most
/// max(read-ahead window, largest device request) per call, 128 KiB-8 MiB and 1280 KiB-4 MiB
/// on common systems, so a step of 1 MiB is read whole almost everywhere.
pub(super) const WILLNEED_STEP: usize = 1 << 20;

/// Read `[addr, addr + len)` of a live read-only file mapping into the page cache and map it.
///
/// With `huge` (the mapping is advised `MADV_HUGEPAGE`), each fault reads an aligned 4 MiB
/// window into 2 MiB folios where the filesystem has large folios (ext4 since Linux 6.16, xfs),
/// and the populate maps them with 2 MiB entries: decode then reads the prefix with as few TLB
/// misses as from 2 MiB-page buffers (4 KiB pages cost k3-mini's all-pinned decode ~10%).
///
/// Without it, faults would read the device's read-ahead window around each of them (8 MiB
/// on the development VM, 128 KiB on many systems). So the range is first asked for with
/// `MADV_WILLNEED` in [`WILLNEED_STEP`]s, which start reads of exactly those pages (in 4 KiB
/// folios) and return; the populate then waits for them. A page the advice did not reach is
/// read by its fault, with the normal read-around.
pub(super) fn populate_read(addr: usize, len: usize, huge: bool) -> std::io::Result<()> {
    let (start, len) = page_range(addr, len);
    // SAFETY: the range lies inside a live mapping owned by the caller (see `PinLoad`);
    // WILLNEED and POPULATE_READ only read the file's pages in and map them.
    unsafe {
        if !huge {
            for off in (0..len).step_by(WILLNEED_STEP) {
                let n = WILLNEED_STEP.min(len - off);
                let _ = platform::advise_memory(start + off, n, MemAdvice::WillNeed);
            }
        }
        platform::advise_memory(start, len, MemAdvice::PopulateRead)
    }
}

/// A failed [`populate_read`] of `file` (EFAULT: the read failed).
pub(super) fn populate_error(file: &DirectFile, e: std::io::Error) -> StreamError {
    StreamError::io(
        "read into the page cache (MADV_POPULATE_READ)",
        file.path(),
        e,
    )
}

/// Whether transparent huge pages can back a mapping advised `MADV_HUGEPAGE` (the system's
/// setting is not `never`).
pub(super) fn thp_advisable() -> bool {
    cfg!(target_os = "linux")
        && std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .is_ok_and(|s| !s.contains("[never]"))
}

/// Map pinned layer bytes of `file` for [`populate_read`], advised `MADV_HUGEPAGE` with
/// `huge`.
pub(super) fn map_pinned(
    file: &DirectFile,
    offset: u64,
    len: usize,
    huge: bool,
) -> Result<memmap2::Mmap, StreamError> {
    let map = map_range(file, offset, len)?;
    if huge {
        // Advice only: a refusal (or a platform without it) leaves base pages, the same
        // bytes.
        // SAFETY: the range is the live mapping just made; the advice never changes bytes.
        let _ = unsafe {
            platform::advise_memory(map.as_ptr() as usize, map.len(), MemAdvice::HugePage)
        };
    }
    Ok(map)
}

/// A page-cache layer read in completely: `mlock` it so it stays in RAM (its pages are in:
/// nothing is read). Returns why the lock was refused.
pub(super) fn keep_mapped(addr: usize, len: usize) -> Option<String> {
    let (start, len) = page_range(addr, len);
    // SAFETY: the range lies inside a live mapping owned by the caller; mlock does not change
    // the memory's contents.
    unsafe { platform::lock_memory(start, len) }
        .err()
        .map(|e| e.to_string())
}

/// Whether this kernel knows `MADV_POPULATE_READ`; the error when it does not. The advice is
/// given for an empty range of a mapping of `file` (one page at `offset`): the kernel checks
/// the advice before the length, and reads nothing.
pub(super) fn probe_populate_read(
    file: &DirectFile,
    offset: u64,
    len: usize,
) -> Result<(), String> {
    let map = map_range(file, offset, len.clamp(1, page_size())).map_err(|e| e.to_string())?;
    let (start, _) = page_range(map.as_ptr() as usize, 0);
    // SAFETY: an empty range at the start of a live mapping: nothing is read or changed.
    if let Err(e) = unsafe { platform::advise_memory(start, 0, MemAdvice::PopulateRead) } {
        return Err(if cfg!(target_os = "linux") {
            format!("MADV_POPULATE_READ refused ({e}; it needs Linux 5.14)")
        } else {
            format!(
                "reading a mapping in ahead is absent on {} ({e})",
                platform::OS
            )
        });
    }
    Ok(())
}

impl StreamedTrunk {
    /// Pinned layer `l`'s bytes of trunk.bin mapped for [`populate_read`].
    pub(super) fn map_layer(&self, l: usize) -> Result<memmap2::Mmap, StreamError> {
        let pl = &self.manifest.layers[l];
        map_pinned(
            &self.file,
            pl.offset,
            pl.size as usize,
            self.page_cache_huge,
        )
    }

    /// A pinned layer loaded on first use since `t0`, `bytes` of it from disk.
    pub(super) fn count_pinned_load(&mut self, t0: Instant, bytes: u64) {
        let secs = t0.elapsed().as_secs_f64();
        self.pinned_load_seconds += secs;
        self.stats.bytes_read += bytes;
        self.stats.read_seconds += secs;
        self.stats.wait_seconds += secs;
    }

    /// Per pinned layer, its bytes not in the page cache now.
    pub(super) fn uncached_pinned_layers(&self) -> Result<Vec<u64>, WeightError> {
        (0..self.plan.pinned_layers)
            .map(|l| {
                let pl = &self.manifest.layers[l];
                let map = map_range(&self.file, pl.offset, pl.size as usize)
                    .map_err(|e| weight_err(l, e))?;
                Ok(uncached_bytes(map.as_ptr() as usize, map.len()))
            })
            .collect()
    }

    pub(super) fn load_pinned_one(&mut self, layer: usize) -> Result<(), WeightError> {
        if self.pinned[layer].is_some() {
            return Ok(());
        }
        let pl = &self.manifest.layers[layer];
        let t0 = Instant::now();
        if self.page_cache {
            let map = self.map_layer(layer).map_err(|e| weight_err(layer, e))?;
            // Taken for every pinned layer at the first one: a fault's read window reaches
            // into the layers after it, which would then count as cached.
            if self.lazy_uncached.is_empty() {
                self.lazy_uncached = self.uncached_pinned_layers()?;
            }
            let bytes = self.lazy_uncached[layer];
            populate_read(map.as_ptr() as usize, map.len(), self.page_cache_huge)
                .map_err(|e| weight_err(layer, populate_error(&self.file, e)))?;
            if let Some(e) = keep_mapped(map.as_ptr() as usize, map.len()) {
                self.stats.pinned_unlocked_bytes += pl.size;
                self.lock_error.get_or_insert(e);
            }
            self.count_pinned_load(t0, bytes);
            self.pinned[layer] = Some(Pinned::Mapped(map));
            return Ok(());
        }
        let span = self.file.span(pl.offset, pl.size as usize);
        let mut buf =
            AlignedBuf::new_from(span.len, self.pages).map_err(|e| WeightError::Invalid {
                name: format!("trunk layer {layer}"),
                msg: format!("cannot allocate the pinned buffer: {e}"),
            })?;
        self.huge_pages |= buf.huge_pages();
        if buf.hugetlb() {
            self.stats.hugetlb_bytes += buf.capacity() as u64;
        }
        let (lead, bytes) = read_packed(
            &self.pool,
            &self.file,
            &self.manifest,
            layer,
            buf.full_mut(),
        )
        .map_err(|e| weight_err(layer, e))?;
        self.count_pinned_load(t0, bytes);
        self.pinned[layer] = Some(Pinned::Buf(Loaded { buf, lead }));
        Ok(())
    }
}
