//! Loading the pinned prefix: parallel reads into exact-size buffers at start-up, or on
//! background threads beside start-up and the prompt (the executor waits per layer).

use super::*;

pub(super) struct ReadJob {
    pub(super) layer: usize,
    pub(super) buf: AlignedBuf,
}

pub(super) struct ReadDone {
    pub(super) layer: usize,
    pub(super) buf: AlignedBuf,
    pub(super) result: Result<usize, StreamError>,
    pub(super) seconds: f64,
    pub(super) bytes: u64,
}

/// A pinned layer's buffer handed to the background load: the load writes it through this
/// pointer, the trunk keeps the [`AlignedBuf`] (see [`PinLoad`] for why that is sound).
pub(super) struct Place {
    pub(super) ptr: *mut u8,
    pub(super) len: usize,
}

// SAFETY: a `Place` is only a destination address; see `PinLoad`.
unsafe impl Send for Place {}

/// One pinned layer read by the background load.
pub(super) struct PinDone {
    pub(super) layer: usize,
    /// Disk bytes read, or the first error of the layer.
    pub(super) result: Result<u64, StreamError>,
    pub(super) at: Instant,
    /// A page-cache layer that could not be locked in RAM: why (the layer is served anyway).
    pub(super) lock_error: Option<String>,
}

/// The pinned prefix loading in the background (`TrunkOptions::background_pinned`).
///
/// Soundness of the shared buffers: the trunk allocates every pinned buffer and keeps it in
/// `StreamedTrunk::loading`; the load thread writes each through a [`Place`] and never reads
/// or frees it. The trunk makes no reference into a buffer until the load has reported that
/// layer complete over `done` (the channel orders the writes before the reads), and then no
/// write touches it again. A layer reported failed may still have pieces in flight, so its
/// buffer moves to `StreamedTrunk::retired`, freed only after the thread has been joined (or
/// has ended: its channel disconnected). `StreamedTrunk`'s `Drop` cancels the load and joins
/// its thread before any buffer is freed.
pub(super) struct PinLoad {
    pub(super) done: mpsc::Receiver<PinDone>,
    pub(super) cancel: Arc<AtomicBool>,
    pub(super) handle: Option<JoinHandle<()>>,
    pub(super) started: Instant,
    /// Layers not reported yet.
    pub(super) outstanding: usize,
    /// The latest report's time.
    pub(super) last: Instant,
    pub(super) depth: usize,
}

/// What [`background_load`] reads, and with what.
pub(super) struct LoadWork {
    pub(super) pool: ReadPool,
    pub(super) file: Arc<DirectFile>,
    pub(super) manifest: Arc<TrunkManifest>,
    /// (layer, its buffer, the lead of its first byte).
    pub(super) layers: Vec<(usize, Place, usize)>,
    /// Read size of raw layers.
    pub(super) piece: usize,
    /// Page-cache layers (`TrunkOptions::pinned_page_cache`): every `Place` is a read-only
    /// mapping of the layer, populated piece by piece and locked once complete.
    pub(super) page_cache: bool,
    /// The page-cache mappings are advised `MADV_HUGEPAGE` (see [`populate_read`]).
    pub(super) huge: bool,
    /// Buffers (address, length) a helper populates ahead of the reads: the ones in fresh
    /// anonymous memory. Not those on the reserved huge-page pool: the host keeps those backed,
    /// so a reader's own fault only zeroes its page, and a helper faulting the same pages
    /// competes with the readers (pinned load on the pool with / without it, 8 alternating
    /// runs twice: 1.76 / 1.65 s and 1.84 / 1.75 s; docs/history/PERFORMANCE-LOG.md §8.6).
    pub(super) populate: Vec<(usize, usize)>,
}

/// The load's thread: every piece (raw) or record (compressed) of the layers, in file order,
/// at the depth of the pool, each layer reported on `tx` once all its reads landed (or at its
/// first error). Fresh anonymous pages are zeroed by the kernel when first touched, and an
/// O_DIRECT read faults its target pages in before the device is asked, so the readers would
/// stall on zeroing: a helper populates the buffers ahead of the reads (MADV_POPULATE_WRITE
/// allocates and zeroes pages not yet present and never changes a page that is; a reader that
/// overtakes it faults its own pages).
pub(super) fn background_load(work: LoadWork, cancel: Arc<AtomicBool>, tx: mpsc::Sender<PinDone>) {
    let LoadWork {
        pool,
        file,
        manifest,
        layers,
        piece,
        page_cache,
        huge,
        populate: regions,
    } = work;
    // Build the jobs of every layer: (layer slot k, job).
    enum Job<'a> {
        Raw {
            offset: u64,
            len: usize,
            buf: &'a mut [u8],
        },
        Chunk(compress::ChunkJob<'a>),
        /// A piece of a page-cache layer's mapping: (address, length).
        Populate(usize, usize),
    }
    let align = file.offset_align();
    let mut jobs: Vec<(usize, Job<'_>)> = Vec::new();
    let mut disk = vec![0u64; layers.len()];
    let mut failed_early: Vec<Option<StreamError>> = (0..layers.len()).map(|_| None).collect();
    for (k, (l, place, lead)) in layers.iter().enumerate() {
        let pl = &manifest.layers[*l];
        if page_cache {
            // Read-only mappings: never written, so no `&mut` is made of them.
            let (addr, len) = (place.ptr as usize, place.len);
            disk[k] = uncached_bytes(addr, len);
            for start in (0..len).step_by(piece.max(1)) {
                jobs.push((k, Job::Populate(addr + start, (len - start).min(piece))));
            }
            continue;
        }
        // SAFETY: see `PinLoad`: the buffer is live until this thread has been joined and
        // nothing else references it until layer `l` is reported.
        let buf: &mut [u8] = unsafe { std::slice::from_raw_parts_mut(place.ptr, place.len) };
        match (&manifest.compression, &pl.stored) {
            (Some(c), Some(stored)) => {
                let lr = compress::LayerRead {
                    layer: *l,
                    offset: pl.offset,
                    size: pl.size,
                    stored,
                    dst: buf,
                };
                match compress::chunk_jobs(c.chunk_bytes, lr) {
                    Ok(js) => {
                        for j in js {
                            disk[k] += j.disk_bytes(&file);
                            jobs.push((k, Job::Chunk(j)));
                        }
                    }
                    Err(e) => failed_early[k] = Some(e),
                }
            }
            (Some(_), None) => {
                failed_early[k] = Some(StreamError::Invalid(format!(
                    "packed trunk layer {l} has no stored records"
                )));
            }
            (None, _) => {
                let size = pl.size as usize;
                if *lead == 0 && piece.is_multiple_of(align) {
                    for (i, dst) in buf.chunks_mut(piece).enumerate() {
                        let start = i * piece;
                        if start >= size {
                            break;
                        }
                        let len = (size - start).min(piece);
                        disk[k] += file.span(pl.offset + start as u64, len).len as u64;
                        jobs.push((
                            k,
                            Job::Raw {
                                offset: pl.offset + start as u64,
                                len,
                                buf: dst,
                            },
                        ));
                    }
                } else {
                    disk[k] += file.span(pl.offset, size).len as u64;
                    jobs.push((
                        k,
                        Job::Raw {
                            offset: pl.offset,
                            len: size,
                            buf,
                        },
                    ));
                }
            }
        }
    }
    let places: Vec<(usize, usize)> = layers
        .iter()
        .map(|(_, p, _)| (p.ptr as usize, p.len))
        .collect();
    let remaining: Vec<AtomicUsize> = (0..layers.len()).map(|_| AtomicUsize::new(0)).collect();
    for (k, _) in &jobs {
        remaining[*k].fetch_add(1, Ordering::Relaxed);
    }
    let failed: Vec<AtomicBool> = (0..layers.len()).map(|_| AtomicBool::new(false)).collect();
    for (k, e) in failed_early.into_iter().enumerate() {
        if let Some(e) = e {
            failed[k].store(true, Ordering::Relaxed);
            let _ = tx.send(PinDone {
                layer: layers[k].0,
                result: Err(e),
                at: Instant::now(),
                lock_error: None,
            });
        }
    }
    let (file, tx, cancel) = (&*file, &tx, &*cancel);
    let ids: Vec<usize> = layers.iter().map(|(l, _, _)| *l).collect();
    let (remaining, failed, disk, ids, places) = (&remaining, &failed, &disk, &ids, &places);
    std::thread::scope(|sc| {
        if !regions.is_empty() {
            let regions = &regions;
            let _ = std::thread::Builder::new()
                .name("k3-pin-populate".to_string())
                .spawn_scoped(sc, move || {
                    crate::stream::aligned::populate_ahead_while(regions, || {
                        !cancel.load(Ordering::Relaxed)
                    })
                });
        }
        let tasks: Vec<Box<dyn FnOnce() + Send + '_>> = jobs
            .into_iter()
            .map(|(k, job)| {
                Box::new(move || {
                    if cancel.load(Ordering::Relaxed) || failed[k].load(Ordering::Relaxed) {
                        return;
                    }
                    let r = match job {
                        Job::Raw { offset, len, buf } => {
                            file.read_into(offset, len, buf).and_then(|lead| {
                                if lead == 0 {
                                    Ok(())
                                } else {
                                    Err(StreamError::Invalid(format!(
                                        "pinned layer {}: a piece at byte {offset} is not aligned",
                                        ids[k]
                                    )))
                                }
                            })
                        }
                        Job::Chunk(j) => j.run(file),
                        Job::Populate(addr, len) => {
                            populate_read(addr, len, huge).map_err(|e| populate_error(file, e))
                        }
                    };
                    match r {
                        Ok(()) => {
                            if remaining[k].fetch_sub(1, Ordering::AcqRel) == 1 {
                                let lock_error = if page_cache {
                                    keep_mapped(places[k].0, places[k].1)
                                } else {
                                    None
                                };
                                let _ = tx.send(PinDone {
                                    layer: ids[k],
                                    result: Ok(disk[k]),
                                    at: Instant::now(),
                                    lock_error,
                                });
                            }
                        }
                        Err(e) => {
                            if !failed[k].swap(true, Ordering::AcqRel) {
                                let _ = tx.send(PinDone {
                                    layer: ids[k],
                                    result: Err(e),
                                    at: Instant::now(),
                                    lock_error: None,
                                });
                            }
                        }
                    }
                }) as Box<dyn FnOnce() + Send + '_>
            })
            .collect();
        pool.run_tasks(tasks);
    });
}

impl StreamedTrunk {
    /// Start loading the pinned prefix on background threads (see [`PinLoad`]).
    pub(super) fn start_background_load(&mut self) -> Result<(), StreamError> {
        let piece = if self.page_cache {
            READ_PIECE
        } else {
            PINNED_BACKGROUND_PIECE
        };
        self.background = self.start_load(piece, true)?;
        Ok(())
    }

    /// Allocate every pinned buffer not loaded yet and start [`background_load`] on its own
    /// thread, raw layers in `piece`-byte reads; false when nothing is left to load.
    pub(super) fn start_load(
        &mut self,
        piece: usize,
        background: bool,
    ) -> Result<bool, StreamError> {
        let todo: Vec<usize> = (0..self.plan.pinned_layers)
            .filter(|&l| self.pinned[l].is_none() && self.loading[l].is_none())
            .collect();
        if todo.is_empty() {
            return Ok(false);
        }
        let started = Instant::now();
        let mut layers = Vec::with_capacity(todo.len());
        let mut populate = Vec::new();
        for &l in &todo {
            let pl = &self.manifest.layers[l];
            if self.page_cache {
                let map = self.map_layer(l)?;
                layers.push((
                    l,
                    Place {
                        ptr: map.as_ptr().cast_mut(),
                        len: map.len(),
                    },
                    0,
                ));
                self.loading[l] = Some(Pinned::Mapped(map));
                continue;
            }
            let span = self.file.span(pl.offset, pl.size as usize);
            let mut b = AlignedBuf::new_from(span.len, self.pages).map_err(|e| {
                StreamError::Invalid(format!(
                    "cannot allocate the pinned buffer of layer {l} ({}): {e}",
                    fmt_bytes(pl.size)
                ))
            })?;
            self.huge_pages |= b.huge_pages();
            if b.hugetlb() {
                self.stats.hugetlb_bytes += b.capacity() as u64;
            }
            // A compressed layer lands at 0 (records are decoded in place).
            let lead = if self.manifest.compression.is_some() {
                0
            } else {
                span.lead
            };
            let on_pool = b.hugetlb();
            let full = b.full_mut();
            if !on_pool {
                populate.push((full.as_mut_ptr() as usize, full.len()));
            }
            layers.push((
                l,
                Place {
                    ptr: full.as_mut_ptr(),
                    len: full.len(),
                },
                lead,
            ));
            self.loading[l] = Some(Pinned::Buf(Loaded { buf: b, lead }));
        }
        let depth = if self.page_cache && background {
            PAGE_CACHE_BACKGROUND_DEPTH
        } else {
            self.pool.depth().max(PINNED_LOAD_DEPTH)
        };
        let work = LoadWork {
            pool: ReadPool::new(depth)?,
            file: Arc::clone(&self.file),
            manifest: Arc::clone(&self.manifest),
            layers,
            piece,
            page_cache: self.page_cache,
            huge: self.page_cache_huge,
            populate: if std::env::var_os("K3_NO_PIN_POPULATE").is_none() {
                populate
            } else {
                Vec::new()
            },
        };
        let (tx, rx) = mpsc::channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let c = Arc::clone(&cancel);
        let handle = std::thread::Builder::new()
            .name("k3-pin-load".to_string())
            .spawn(move || background_load(work, c, tx))
            .map_err(|e| {
                StreamError::Invalid(format!("cannot start the pinned-load thread: {e}"))
            })?;
        self.pinned_load_depth = depth;
        self.bg = Some(PinLoad {
            done: rx,
            cancel,
            handle: Some(handle),
            started,
            outstanding: todo.len(),
            last: started,
            depth,
        });
        Ok(true)
    }

    /// Take one report of the background load.
    pub(super) fn take_pin_done(&mut self, d: PinDone) {
        let Some(bg) = &mut self.bg else {
            return;
        };
        bg.outstanding = bg.outstanding.saturating_sub(1);
        bg.last = bg.last.max(d.at);
        let loaded = self.loading[d.layer].take();
        if let Some(e) = d.lock_error {
            self.stats.pinned_unlocked_bytes += self.manifest.layers[d.layer].size;
            self.lock_error.get_or_insert(e);
        }
        match d.result {
            Ok(bytes) => {
                self.pinned[d.layer] = loaded;
                self.stats.bytes_read += bytes;
            }
            Err(e) => {
                // Other pieces of this layer may still be in flight: the buffer is freed only
                // after the load thread has been joined.
                self.retired.extend(loaded);
                self.pin_errors[d.layer] = Some(e);
            }
        }
        if bg.outstanding == 0 {
            let secs = (bg.last - bg.started).as_secs_f64();
            self.pinned_load_seconds += secs;
            self.stats.read_seconds += secs;
            if let Some(h) = bg.handle.take() {
                let _ = h.join();
            }
            self.bg = None;
            self.retired.clear();
        }
    }

    /// Take every report the background load has sent, without waiting.
    pub(super) fn poll_background(&mut self) {
        while let Some(d) = self.bg.as_ref().and_then(|bg| bg.done.try_recv().ok()) {
            self.take_pin_done(d);
        }
    }

    /// Wait until the background load has reported pinned layer `layer`.
    pub(super) fn wait_pinned(&mut self, layer: usize) -> Result<(), WeightError> {
        self.poll_background();
        let t0 = Instant::now();
        while self.pinned[layer].is_none() && self.pin_errors[layer].is_none() {
            let Some(bg) = &self.bg else {
                break;
            };
            match bg.done.recv() {
                Ok(d) => self.take_pin_done(d),
                Err(_) => {
                    // The load thread ended (every sender is gone, so no task runs) without
                    // reporting this layer: a task panicked.
                    self.bg = None;
                    self.retired.clear();
                    self.loading[layer] = None;
                    return Err(WeightError::Invalid {
                        name: format!("trunk layer {layer}"),
                        msg: "the background load of the pinned prefix stopped before this                               layer was read (a reader thread failed)"
                            .to_string(),
                    });
                }
            }
        }
        let waited = t0.elapsed().as_secs_f64();
        self.pinned_wait_seconds += waited;
        self.stats.wait_seconds += waited;
        if let Some(e) = self.pin_errors[layer].take() {
            return Err(weight_err(layer, e));
        }
        Ok(())
    }

    /// Load every pinned layer not loaded yet, in parallel pieces (the background load's
    /// machinery, waited for here); returns the seconds taken.
    pub fn load_pinned(&mut self) -> Result<f64, StreamError> {
        let t0 = Instant::now();
        let before = self.pinned_load_seconds;
        self.start_load(READ_PIECE, false)?;
        while let Some(bg) = &self.bg {
            match bg.done.recv() {
                Ok(d) => self.take_pin_done(d),
                Err(_) => {
                    self.bg = None;
                    self.retired.clear();
                    return Err(StreamError::Invalid(
                        "the pinned-prefix load stopped before every layer was read (a reader \
                         thread failed)"
                            .to_string(),
                    ));
                }
            }
        }
        self.stats.wait_seconds += t0.elapsed().as_secs_f64();
        if let Some(e) = self.pin_errors.iter_mut().find_map(Option::take) {
            return Err(e);
        }
        Ok(self.pinned_load_seconds - before)
    }
}
