//! Background reads of guessed experts (`--expert-prefetch`): items sent to the read pool,
//! completions returned to the cache.

use super::*;

/// One expert a prefetch reads: its slot, key, layout and the slot's buffer (owned by its
/// read task until the read is done).
pub(super) struct PrefetchItem {
    pub(super) slot: usize,
    pub(super) key: ExpertKey,
    pub(super) layout: Layout,
    pub(super) buf: AlignedBuf,
}

/// One prefetched expert back from its reader thread: the item (buffer filled), its read
/// result, the bytes requested and when the read started and ended.
pub(super) struct PrefetchDone {
    pub(super) item: PrefetchItem,
    pub(super) result: Result<(), String>,
    pub(super) bytes: u64,
    pub(super) started: Instant,
    pub(super) finished: Instant,
}

/// Prefetch reads: every guessed expert is one owned task on the store's reader threads that
/// reads the expert's runs into its slot buffer and sends it back, so an expert is usable as
/// soon as ITS read has landed, not when the whole guess of its layer has
/// ([`ExpertSource::experts_split`] computes those first).
pub(super) struct Prefetcher {
    pub(super) files: Arc<Vec<DirectFile>>,
    pub(super) pool: Arc<ReadPool>,
    pub(super) tx: mpsc::Sender<PrefetchDone>,
    pub(super) done: mpsc::Receiver<PrefetchDone>,
    /// The layer of every item sent and not yet received back.
    pub(super) in_flight: Vec<usize>,
    /// End of the latest read received, to add up the time with a prefetch read in flight.
    pub(super) busy_until: Option<Instant>,
}

impl Prefetcher {
    pub(super) fn new(files: Arc<Vec<DirectFile>>, pool: Arc<ReadPool>) -> Self {
        let (tx, done) = mpsc::channel();
        Self {
            files,
            pool,
            tx,
            done,
            in_flight: Vec::new(),
            busy_until: None,
        }
    }

    /// Queue one read task per item, in disk order, behind the reads already queued.
    pub(super) fn send(&mut self, mut items: Vec<PrefetchItem>) {
        items.sort_by_key(|it| it.layout.runs.first().map(|r| (r.file, r.offset)));
        let mut tasks: Vec<crate::stream::blocking::Task> = Vec::with_capacity(items.len());
        for mut item in items {
            self.in_flight.push(item.key.0);
            let (files, tx) = (Arc::clone(&self.files), self.tx.clone());
            tasks.push(Box::new(move || {
                let started = Instant::now();
                let (result, bytes) =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        read_item(&files, &mut item)
                    }))
                    .unwrap_or_else(|_| (Err("the read task panicked".to_string()), 0));
                // The cache may be gone (end of run): nothing waits for this item then.
                let _ = tx.send(PrefetchDone {
                    item,
                    result,
                    bytes,
                    started,
                    finished: Instant::now(),
                });
            }));
        }
        self.pool.spawn(tasks);
    }
}

/// Read one item's runs into its buffer (each run at its `buf_off`), one after another on
/// the calling thread. Returns `Ok(())` or the first error message, and the bytes requested.
pub(super) fn read_item(
    files: &[DirectFile],
    item: &mut PrefetchItem,
) -> (Result<(), String>, u64) {
    let buf = item.buf.full_mut();
    let mut bytes = 0u64;
    for r in &item.layout.runs {
        let Some(dst) = buf.get_mut(r.buf_off..r.buf_off + r.buf_len) else {
            return (
                Err("expert buffer too small (internal error)".to_string()),
                bytes,
            );
        };
        bytes += r.buf_len as u64;
        if let Err(e) = files[r.file as usize].read_into(r.offset, r.len, dst) {
            return (Err(e.to_string()), bytes);
        }
    }
    (Ok(()), bytes)
}

/// Read every job's runs into its buffer (each run at its `buf_off`): all runs issued
/// together, sorted by (file, offset), on `pool`. Returns per job `Ok(())` or the first error
/// message, and the bytes requested. `urgent`: ahead of other queued reads (demand misses).
pub(super) fn read_runs(
    files: &[DirectFile],
    pool: &ReadPool,
    jobs: Vec<(&[RunRead], &mut [u8])>,
    urgent: bool,
) -> (Vec<Result<(), String>>, u64) {
    let mut results: Vec<Result<(), String>> = vec![Ok(()); jobs.len()];
    let mut bytes = 0u64;
    let mut tagged: Vec<(usize, u16, u64, ReadReq<'_>)> = Vec::new();
    for (i, (runs, buf)) in jobs.into_iter().enumerate() {
        let mut rest: &mut [u8] = buf;
        let mut at = 0usize;
        for r in runs {
            let tail = std::mem::take(&mut rest);
            if r.buf_off < at || r.buf_off - at + r.buf_len > tail.len() {
                results[i] = Err("expert buffer too small (internal error)".to_string());
                break;
            }
            let (_, tail) = tail.split_at_mut(r.buf_off - at);
            let (mine, tail) = tail.split_at_mut(r.buf_len);
            rest = tail;
            at = r.buf_off + r.buf_len;
            bytes += r.buf_len as u64;
            tagged.push((
                i,
                r.file,
                r.offset,
                ReadReq {
                    file: &files[r.file as usize],
                    offset: r.offset,
                    len: r.len,
                    buf: mine,
                },
            ));
        }
    }
    tagged.sort_by_key(|t| (t.1, t.2));
    let (tags, mut reqs): (Vec<usize>, Vec<ReadReq<'_>>) =
        tagged.into_iter().map(|(i, _, _, r)| (i, r)).unzip();
    let done = if urgent {
        pool.read_all_first(&mut reqs)
    } else {
        pool.read_all(&mut reqs)
    };
    for (i, r) in tags.into_iter().zip(done) {
        if let Err(e) = r
            && results[i].is_ok()
        {
            results[i] = Err(e.to_string());
        }
    }
    (results, bytes)
}
