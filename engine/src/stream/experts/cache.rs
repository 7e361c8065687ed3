//! [`ExpertCache`]: the budgeted slots, their states, buffers, prefetch bookkeeping, traces
//! and report lines (serving experts is the `ExpertSource` impl in `mod.rs`).

use super::*;

/// Slot states of the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotState {
    Empty,
    InFlight,
    Ready,
}

#[derive(Debug)]
pub(super) struct Slot {
    pub(super) state: SlotState,
    pub(super) key: Option<ExpertKey>,
    pub(super) buf: Option<AlignedBuf>,
    pub(super) tensors: [(usize, usize); 6],
    pub(super) loaded_token: u64,
    /// Loaded (or being loaded) by a prefetch and not requested since.
    pub(super) from_prefetch: bool,
}

/// Where one requested expert is served from during a call.
#[derive(Clone, Copy, Debug)]
pub(super) enum Place {
    Slot(usize),
    Scratch(usize),
}

/// Options of [`ExpertCache::new`].
#[derive(Clone, Debug)]
pub struct ExpertCacheOptions {
    /// `--cache-gb` in bytes (0 = no caching).
    pub budget_bytes: u64,
    pub o_direct: bool,
    /// Queue depth of expert reads.
    pub read_threads: usize,
}

impl Default for ExpertCacheOptions {
    fn default() -> Self {
        Self {
            budget_bytes: 0,
            o_direct: true,
            read_threads: 8,
        }
    }
}

/// The streamed `ExpertSource`: a byte-budgeted cache in front of an [`ExpertStore`].
pub struct ExpertCache<'c> {
    pub(super) store: ExpertStore<'c>,
    pub(super) capacity: usize,
    pub(super) slots: Vec<Slot>,
    pub(super) map: HashMap<ExpertKey, usize>,
    pub(super) policy: Box<dyn EvictionPolicy + 'c>,
    pub(super) scratch: Vec<(AlignedBuf, [(usize, usize); 6])>,
    pub(super) token: u64,
    pub(super) stats: ExpertStats,
    pub(super) trace: Option<Vec<(u32, u32)>>,
    /// Extra ids the executor should guess per MoE layer (`None`: no guesses wanted).
    pub(super) prefetch_margin: Option<usize>,
    pub(super) prefetcher: Option<Prefetcher>,
    /// Why prefetching stopped (the thread could not start or died); prefetch is then a no-op.
    pub(super) prefetch_off: Option<String>,
    /// The pending guesses (layer, ids), to measure how much of the real routing they covered.
    pub(super) guesses: Vec<(usize, Vec<u32>)>,
    /// A look-ahead guess to start after the next `experts` call's own reads.
    pub(super) deferred: Option<(usize, Vec<u32>)>,
    /// Slots the last `experts` call served from (a prefetch never evicts them).
    pub(super) last_slots: Vec<usize>,
    /// The layer of the last `experts` call.
    pub(super) last_layer: Option<usize>,
    /// Expert buffers carved (huge-page regions) but not yet handed to a slot or scratch.
    pub(super) spare: Vec<AlignedBuf>,
    /// Buffers carved so far (slots + scratch + spare).
    pub(super) carved: usize,
}

impl std::fmt::Debug for ExpertCache<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertCache")
            .field("capacity", &self.capacity)
            .field("policy", &self.policy.name())
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl<'c> ExpertCache<'c> {
    pub fn new(
        spec: &'c ModelSpec,
        ckpt: &Checkpoint,
        opts: &ExpertCacheOptions,
    ) -> Result<Self, StreamError> {
        let store = ExpertStore::new(spec, ckpt, opts.o_direct, opts.read_threads)?;
        Ok(Self::with_store(store, opts.budget_bytes))
    }

    /// Like [`ExpertCache::new`] with a given read pool (`opts.read_threads` is ignored), e.g.
    /// `ReadPool::for_policy(&policy)` for io_uring.
    pub fn new_with_pool(
        spec: &'c ModelSpec,
        ckpt: &Checkpoint,
        opts: &ExpertCacheOptions,
        pool: ReadPool,
    ) -> Result<Self, StreamError> {
        let store = ExpertStore::with_pool(spec, ckpt, opts.o_direct, pool)?;
        Ok(Self::with_store(store, opts.budget_bytes))
    }

    /// A cache over an existing store with an LRU policy.
    pub fn with_store(store: ExpertStore<'c>, budget_bytes: u64) -> Self {
        let per = store.expert_buf_bytes().max(1) as u64;
        let capacity = usize::try_from(budget_bytes / per).unwrap_or(usize::MAX);
        let capacity = capacity.min(store.n_experts());
        Self {
            store,
            capacity,
            slots: Vec::new(),
            map: HashMap::new(),
            policy: Box::new(Lru::default()),
            scratch: Vec::new(),
            token: 0,
            stats: ExpertStats {
                budget_bytes,
                ..ExpertStats::default()
            },
            trace: None,
            prefetch_margin: None,
            prefetcher: None,
            prefetch_off: None,
            guesses: Vec::new(),
            deferred: None,
            last_slots: Vec::new(),
            last_layer: None,
            spare: Vec::new(),
            carved: 0,
        }
    }

    /// One expert buffer: from the spare list, else from a newly carved huge-page region.
    /// Buffers are carved in batches (the cache's slots plus one layer's scratch, at most
    /// 64 MiB per region) because a read into 4 KiB pages runs at under half the speed of
    /// one into 2 MiB pages on a virtio disk (docs/history/PERFORMANCE-LOG.md §4.3).
    pub(super) fn take_buf(&mut self, at_least: usize) -> std::io::Result<AlignedBuf> {
        if let Some(b) = self.spare.pop() {
            return Ok(b);
        }
        let need = self.store.expert_buf_bytes();
        let stride = align_up(need.max(1) as u64, IO_ALIGN as u64) as usize;
        let per_region = ((64usize << 20) / stride).max(1);
        // Slots not yet backed, plus room for one call's scratch.
        let wanted = (self.capacity + at_least).saturating_sub(self.carved);
        let count = wanted.clamp(at_least.max(1), per_region.max(at_least.max(1)));
        let mut bufs = AlignedBuf::carve(count, need)?;
        self.carved += bufs.len();
        let b = bufs.pop().expect("carve(count >= 1) returns count buffers");
        self.spare = bufs;
        Ok(b)
    }

    /// Ask the executor for guesses of top-(k + `margin`) experts before each MoE layer
    /// (`None`: no guesses). [`ExpertSource::prefetch`] works either way; this only sets
    /// [`ExpertSource::prefetch_margin`].
    pub fn set_prefetch_margin(&mut self, margin: Option<usize>) {
        self.prefetch_margin = margin;
    }

    /// Why prefetching was switched off during the run, if it was.
    pub fn prefetch_failure(&self) -> Option<&str> {
        self.prefetch_off.as_deref()
    }

    /// Take a finished prefetch read back: buffer into its slot, E8M0 check, Ready.
    /// A failed read or check only frees the slot (a later request reads again and reports).
    pub(super) fn finish_prefetch(&mut self, done: PrefetchDone) {
        self.stats.prefetch_bytes += done.bytes;
        self.stats.bytes_read += done.bytes;
        // Time with at least one prefetch read in flight (reads overlap: each stretch once).
        if let Some(p) = self.prefetcher.as_mut() {
            let from = p.busy_until.map_or(done.started, |b| b.max(done.started));
            if done.finished > from {
                self.stats.prefetch_read_seconds += (done.finished - from).as_secs_f64();
            }
            p.busy_until = Some(p.busy_until.map_or(done.finished, |b| b.max(done.finished)));
        }
        let PrefetchDone {
            item: it, result, ..
        } = done;
        let ok = result.and_then(|()| self.store.check_scales(it.key, &it.layout, it.buf.full()));
        let slot = &mut self.slots[it.slot];
        slot.buf = Some(it.buf);
        if slot.state != SlotState::InFlight || slot.key != Some(it.key) {
            return;
        }
        match ok {
            Ok(()) => {
                slot.state = SlotState::Ready;
                slot.tensors = it.layout.tensors;
                self.policy.on_insert(it.key, it.slot);
            }
            Err(_) => {
                slot.state = SlotState::Empty;
                slot.key = None;
                slot.from_prefetch = false;
                self.stats.prefetch_failures += 1;
                if self.map.get(&it.key) == Some(&it.slot) {
                    self.map.remove(&it.key);
                }
            }
        }
    }

    /// Collect finished prefetch reads; with `until = Some(layer)`, wait until no read for
    /// `layer` or an earlier layer is in flight (look-ahead reads for later layers go on).
    pub(super) fn poll_prefetches(&mut self, until: Option<usize>) {
        loop {
            let Some(p) = self.prefetcher.as_mut() else {
                return;
            };
            if p.in_flight.is_empty() {
                return;
            }
            let block = until.is_some_and(|l| p.in_flight.iter().any(|&b| b <= l));
            let got = if block {
                let t0 = Instant::now();
                let r = p.done.recv().map_err(|_| ());
                let waited = t0.elapsed().as_secs_f64();
                self.stats.prefetch_wait_seconds += waited;
                self.stats.read_seconds += waited;
                r
            } else {
                match p.done.try_recv() {
                    Ok(d) => Ok(d),
                    Err(mpsc::TryRecvError::Empty) => return,
                    Err(mpsc::TryRecvError::Disconnected) => Err(()),
                }
            };
            match got {
                Ok(d) => {
                    if let Some(p) = self.prefetcher.as_mut()
                        && let Some(i) = p.in_flight.iter().position(|&l| l == d.item.key.0)
                    {
                        p.in_flight.swap_remove(i);
                    }
                    self.finish_prefetch(d);
                }
                Err(()) => {
                    self.abandon_prefetches("the expert prefetch thread stopped".to_string());
                    return;
                }
            }
        }
    }

    /// Switch prefetching off and free every slot a prefetch still holds.
    pub(super) fn abandon_prefetches(&mut self, why: String) {
        self.prefetcher = None;
        self.prefetch_off.get_or_insert(why);
        for (i, slot) in self.slots.iter_mut().enumerate() {
            if slot.state == SlotState::InFlight && slot.from_prefetch {
                if let Some(k) = slot.key
                    && self.map.get(&k) == Some(&i)
                {
                    self.map.remove(&k);
                }
                slot.state = SlotState::Empty;
                slot.key = None;
                slot.from_prefetch = false;
            }
        }
    }

    /// Replace the eviction policy (before the first request).
    pub fn set_policy(&mut self, policy: Box<dyn EvictionPolicy + 'c>) {
        self.policy = policy;
    }

    /// Experts the budget holds.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn store(&self) -> &ExpertStore<'c> {
        &self.store
    }

    pub fn policy_name(&self) -> &str {
        self.policy.name()
    }

    /// The state of every allocated slot (for tests and reports).
    pub fn slot_states(&self) -> Vec<(SlotState, Option<ExpertKey>)> {
        self.slots.iter().map(|s| (s.state, s.key)).collect()
    }

    /// Start recording every (layer, expert) request (`--dump-cache-trace`).
    pub fn enable_trace(&mut self) {
        self.trace.get_or_insert_with(Vec::new);
    }

    /// The recorded requests, in order (token starts marked, see `stream::trace`).
    pub fn trace(&self) -> Option<&[(u32, u32)]> {
        self.trace.as_deref()
    }

    /// Write `dir/expert_trace.bin` + `dir/expert_hist.json` (needs [`Self::enable_trace`]).
    pub fn write_trace(&self, dir: &std::path::Path) -> Result<(), StreamError> {
        let t = self.trace.as_deref().ok_or_else(|| {
            StreamError::Invalid("expert trace was not enabled for this run".to_string())
        })?;
        crate::stream::trace::write_trace(dir, t)
    }

    /// One line for the start-up report.
    pub fn startup_line(&self) -> String {
        format!(
            "expert cache: {} budget = {} experts of {} ({} policy); {}; {}",
            crate::stream::fmt_bytes(self.stats.budget_bytes),
            self.capacity,
            crate::stream::fmt_bytes(self.store.expert_buf_bytes() as u64),
            self.policy.name(),
            self.store.io_line(),
            self.store.backend_line()
        )
    }

    /// The end-of-run summary lines (seed format).
    pub fn report_lines(&self) -> Vec<String> {
        let s = &self.stats;
        let pct = |a: u64| {
            if s.requests == 0 {
                0.0
            } else {
                100.0 * a as f64 / s.requests as f64
            }
        };
        vec![
            format!(
                "requests : {} hits {} ({:.2}%) misses {} evictions {}",
                s.requests,
                s.hits,
                pct(s.hits),
                s.misses,
                s.evictions
            ),
            format!(
                "TRUE resident hit rate {:.2}%",
                100.0 * s.resident_hit_rate()
            ),
            format!(
                "prefetch: {} experts read ahead ({} in {:.2} s, waited {:.2} s), {} requests served by them, {} wasted; guesses covered {:.2}% of routed ids{}",
                s.prefetched,
                crate::stream::fmt_bytes(s.prefetch_bytes),
                s.prefetch_read_seconds,
                s.prefetch_wait_seconds,
                s.prefetch_hits,
                s.prefetch_wasted,
                100.0 * s.guess_accuracy(),
                self.prefetch_off
                    .as_deref()
                    .map_or_else(String::new, |f| format!(" (STOPPED: {f})"))
            ),
            format!(
                "eviction policy {}{}",
                self.policy.name(),
                self.policy
                    .failure()
                    .map_or_else(String::new, |f| format!(" (FELL BACK: {f})"))
            ),
            format!(
                "read {} in {:.2} s{}",
                crate::stream::fmt_bytes(s.bytes_read),
                s.read_seconds,
                if s.load_failures > 0 {
                    format!("; {} experts FAILED to load", s.load_failures)
                } else {
                    String::new()
                }
            ),
        ]
    }

    /// Find a slot for a miss: an empty one, a new one within capacity, or a victim that the
    /// current call does not use.
    pub(super) fn claim_slot(&mut self, protected: &HashSet<usize>) -> Option<usize> {
        if let Some(i) = self.slots.iter().position(|s| s.state == SlotState::Empty) {
            return Some(i);
        }
        if self.slots.len() < self.capacity {
            self.slots.push(Slot {
                state: SlotState::Empty,
                key: None,
                buf: None,
                tensors: [(0, 0); 6],
                loaded_token: 0,
                from_prefetch: false,
            });
            return Some(self.slots.len() - 1);
        }
        let mut candidates: Vec<(ExpertKey, usize)> = self
            .slots
            .iter()
            .enumerate()
            .filter(|(i, s)| s.state == SlotState::Ready && !protected.contains(i))
            .filter_map(|(i, s)| s.key.map(|k| (k, i)))
            .collect();
        // Experts the policy pinned are not offered, unless nothing else could go.
        if candidates.iter().any(|&(k, _)| !self.policy.is_pinned(k)) {
            candidates.retain(|&(k, _)| !self.policy.is_pinned(k));
        }
        if candidates.is_empty() {
            return None;
        }
        let pick = self
            .policy
            .choose_victim(&candidates)
            .min(candidates.len() - 1);
        let (old, i) = candidates[pick];
        self.map.remove(&old);
        self.policy.on_remove(old, i);
        self.stats.evictions += 1;
        let s = &mut self.slots[i];
        if s.from_prefetch {
            self.stats.prefetch_wasted += 1;
        }
        s.state = SlotState::Empty;
        s.key = None;
        s.from_prefetch = false;
        Some(i)
    }
}
