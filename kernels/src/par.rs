//! Threading: a fixed-size worker pool and the only ways kernels split work.
//!
//! Owns: [`Pool`] (the calling thread plus workers that spin between dispatches, or the calling
//! thread alone when `n_threads == 1`) and chunked helpers that hand disjoint OUTPUT slices to
//! tasks.
//! Must not: split a reduction across threads. Every helper here gives each task whole output
//! elements (rows, heads), so the bits never depend on the number of threads or on scheduling.
//!
//! Why not rayon (which the design names, and which this pool replaced): a decode step is
//! ~1000 dispatches of 20-300 us each; rayon's caller blocks while its workers run, and its
//! idle workers yield a few times and then sleep, so every dispatch costs a wake-up of two
//! threads (tens of microseconds on a VM) and rayon has no setting for how long to spin. This
//! pool lets the caller take tasks and keeps the workers spinning for [`Pool::set_spin`]:
//! resident decode on k3-mini 0.132 vs 0.144 s/token (median of 5 alternating runs each),
//! context switches per run ~25,000 -> ~200 (docs/history/PERFORMANCE-LOG.md §5.4). The one
//! crate built for this (micropool 0.3: caller participates, configurable spin) aborts the
//! process on a task panic; this pool re-raises it on the caller.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::KernelError;

/// How long an idle worker spins for the next dispatch before it sleeps, by default
/// ([`Pool::set_spin`] changes it). A decode step issues hundreds of dispatches microseconds
/// apart; waking a sleeping thread costs tens of microseconds on a VM (measured: two threads
/// slower than one on in-cache matvecs with a sleeping pool), so workers stay awake across a
/// step and sleep only in longer pauses.
pub const DEFAULT_SPIN: Duration = Duration::from_micros(50);

/// A worker pool of `n_threads` threads (the calling thread plus `n_threads - 1` workers).
/// Row-parallel kernels take `&Pool`.
///
/// Each dispatch hands out task indices `0..n` from one atomic counter; the calling thread
/// takes tasks too and returns when every task has finished. A dispatch from inside a task, or
/// from a second thread while one is running, runs on the calling thread alone (same results:
/// no result ever depends on which thread ran a task).
pub struct Pool {
    n_threads: usize,
    /// `None` when `n_threads == 1`: work runs on the calling thread.
    inner: Option<Arc<Shared>>,
    workers: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("n_threads", &self.n_threads)
            .finish()
    }
}

/// The task function of the current dispatch, lifetime-erased. Valid while a task of its epoch
/// is unfinished (the dispatching thread waits for all of them before returning).
#[derive(Clone, Copy)]
struct Job {
    epoch: u64,
    f: *const (dyn Fn(usize) + Sync + 'static),
    n: usize,
}

// SAFETY: the pointer is only dereferenced under the protocol above (a claimed, unfinished
// task of the job's epoch), while the closure it points to is alive and `Sync`.
unsafe impl Send for Job {}

struct Shared {
    job: Mutex<Option<Job>>,
    /// Latest published epoch (set after `job`).
    epoch: AtomicU64,
    /// (epoch low 32 bits << 32) | next task index.
    next: AtomicU64,
    /// Tasks finished in the current epoch.
    done: AtomicUsize,
    /// A dispatch is running (nested or concurrent dispatches run inline).
    busy: AtomicBool,
    panicked: AtomicBool,
    shutdown: AtomicBool,
    sleeping: AtomicUsize,
    sleep_lock: Mutex<()>,
    wake: Condvar,
    /// Idle spin before sleeping, in nanoseconds ([`Pool::set_spin`]).
    spin_ns: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    /// Claim and run tasks of `job` until none is left (or a newer epoch started).
    fn work(&self, job: Job) {
        let tag = (job.epoch & 0xffff_ffff) << 32;
        loop {
            let v = self.next.load(Ordering::Acquire);
            if v & !0xffff_ffff != tag {
                return;
            }
            let i = (v & 0xffff_ffff) as usize;
            if i >= job.n {
                return;
            }
            if self
                .next
                .compare_exchange_weak(v, v + 1, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
            {
                continue;
            }
            // SAFETY: task `i < n` of this epoch was claimed and is not finished, so the
            // dispatcher is still waiting and the closure is alive.
            let f = unsafe { &*job.f };
            if catch_unwind(AssertUnwindSafe(|| f(i))).is_err() {
                self.panicked.store(true, Ordering::Release);
            }
            self.done.fetch_add(1, Ordering::AcqRel);
        }
    }

    fn worker_loop(&self) {
        let mut seen = self.epoch.load(Ordering::Acquire);
        loop {
            let mut t0 = Instant::now();
            let mut spins = 0u32;
            let spin = Duration::from_nanos(self.spin_ns.load(Ordering::Relaxed));
            loop {
                if self.shutdown.load(Ordering::Acquire) {
                    return;
                }
                if self.epoch.load(Ordering::SeqCst) != seen {
                    break;
                }
                spins = spins.wrapping_add(1);
                if !spins.is_multiple_of(256) || t0.elapsed() < spin {
                    std::hint::spin_loop();
                    continue;
                }
                // Sleep until the next dispatch (checked again under the lock: the
                // dispatcher publishes the epoch before it reads `sleeping`).
                let g = lock(&self.sleep_lock);
                self.sleeping.fetch_add(1, Ordering::SeqCst);
                let g = if self.epoch.load(Ordering::SeqCst) == seen
                    && !self.shutdown.load(Ordering::SeqCst)
                {
                    self.wake.wait(g).unwrap_or_else(|p| p.into_inner())
                } else {
                    g
                };
                self.sleeping.fetch_sub(1, Ordering::SeqCst);
                drop(g);
                t0 = Instant::now();
            }
            let job = *lock(&self.job);
            if let Some(job) = job {
                seen = job.epoch;
                self.work(job);
            }
        }
    }
}

impl Pool {
    /// A pool with `n_threads` workers (0 is treated as 1). If the OS refuses to start the
    /// threads, the pool runs everything on the calling thread and reports `n_threads() == 1`;
    /// use [`Pool::try_new`] to see that error.
    pub fn new(n_threads: usize) -> Pool {
        Pool::try_new(n_threads).unwrap_or(Pool {
            n_threads: 1,
            inner: None,
            workers: Vec::new(),
        })
    }

    /// Like [`Pool::new`] but reports a failure to start the worker threads.
    pub fn try_new(n_threads: usize) -> Result<Pool, KernelError> {
        let n_threads = n_threads.max(1);
        if n_threads == 1 {
            return Ok(Pool {
                n_threads,
                inner: None,
                workers: Vec::new(),
            });
        }
        let shared = Arc::new(Shared {
            job: Mutex::new(None),
            epoch: AtomicU64::new(0),
            next: AtomicU64::new(0),
            done: AtomicUsize::new(0),
            busy: AtomicBool::new(false),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            sleeping: AtomicUsize::new(0),
            sleep_lock: Mutex::new(()),
            wake: Condvar::new(),
            spin_ns: AtomicU64::new(DEFAULT_SPIN.as_nanos() as u64),
        });
        let mut pool = Pool {
            n_threads,
            inner: Some(Arc::clone(&shared)),
            workers: Vec::with_capacity(n_threads - 1),
        };
        for i in 1..n_threads {
            let sh = Arc::clone(&shared);
            let h = std::thread::Builder::new()
                .name(format!("k3-kernel-{i}"))
                .spawn(move || sh.worker_loop())
                .map_err(|e| KernelError::ThreadPool {
                    n_threads,
                    reason: e.to_string(),
                })?;
            pool.workers.push(h);
        }
        Ok(pool)
    }

    /// Number of threads (the caller included).
    pub fn n_threads(&self) -> usize {
        self.n_threads
    }

    /// How long idle workers spin for the next dispatch before they sleep (default
    /// [`DEFAULT_SPIN`]; takes effect from each worker's next idle period). Spinning saves the
    /// wake-up of a sleeping worker per dispatch (a compute-bound decode is ~8% faster on two
    /// vCPUs) but holds a CPU that threads blocked on reads need to issue their next read: a
    /// decode that streams its trunk ran 9% slower spinning. `Duration::ZERO` sleeps at once.
    pub fn set_spin(&self, spin: Duration) {
        if let Some(sh) = &self.inner {
            sh.spin_ns.store(
                spin.as_nanos().min(u64::MAX as u128) as u64,
                Ordering::Relaxed,
            );
        }
    }

    /// The current idle spin ([`Pool::set_spin`]); zero for a one-thread pool.
    pub fn spin(&self) -> Duration {
        self.inner.as_ref().map_or(Duration::ZERO, |sh| {
            Duration::from_nanos(sh.spin_ns.load(Ordering::Relaxed))
        })
    }

    /// Runs `f(i)` for every `i` in `0..n`, possibly in parallel; returns when all are done.
    /// A panic in a task is re-raised here after every task has finished.
    pub fn for_each_index(&self, n: usize, f: impl Fn(usize) + Sync) {
        let Some(sh) = &self.inner else {
            (0..n).for_each(f);
            return;
        };
        if n <= 1
            || n > u32::MAX as usize
            || sh
                .busy
                .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
                .is_err()
        {
            (0..n).for_each(f);
            return;
        }
        let fr: &(dyn Fn(usize) + Sync) = &f;
        // SAFETY: only the lifetime is erased; this function does not return before every task
        // of the epoch has finished, and workers call the pointer only for unfinished tasks.
        let fp: *const (dyn Fn(usize) + Sync + 'static) = unsafe { std::mem::transmute(fr) };
        let epoch = sh.epoch.load(Ordering::Relaxed) + 1;
        let job = Job { epoch, f: fp, n };
        *lock(&sh.job) = Some(job);
        sh.done.store(0, Ordering::Release);
        sh.next
            .store((epoch & 0xffff_ffff) << 32, Ordering::Release);
        sh.epoch.store(epoch, Ordering::SeqCst);
        if sh.sleeping.load(Ordering::SeqCst) > 0 {
            let _g = lock(&sh.sleep_lock);
            sh.wake.notify_all();
        }
        sh.work(job);
        let mut spins = 0u32;
        while sh.done.load(Ordering::Acquire) < n {
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(1024) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        let panicked = sh.panicked.swap(false, Ordering::AcqRel);
        sh.busy.store(false, Ordering::Release);
        if panicked {
            panic!("a task of a parallel kernel dispatch panicked");
        }
    }

    /// Calls `f(chunk_index, chunk)` for consecutive chunks of `chunk_len` elements of `data`
    /// (the last may be shorter), possibly in parallel. Each element is in exactly one chunk.
    pub fn for_each_chunk<T: Send>(
        &self,
        data: &mut [T],
        chunk_len: usize,
        f: impl Fn(usize, &mut [T]) + Sync + Send,
    ) {
        let chunk_len = chunk_len.max(1);
        let len = data.len();
        let n = len.div_ceil(chunk_len);
        let base = SendPtr(data.as_mut_ptr());
        self.for_each_index(n, |i| {
            let start = i * chunk_len;
            let end = (start + chunk_len).min(len);
            // SAFETY: chunk `i` is `start..end` of `data`, disjoint from every other index,
            // and each index runs once; `data` is borrowed mutably for the whole call.
            let c = unsafe { std::slice::from_raw_parts_mut(base.get().add(start), end - start) };
            f(i, c);
        });
    }

    /// Like [`Pool::for_each_chunk`] over two outputs chunked in lockstep: chunk `i` of `a`
    /// has `a_len` elements and chunk `i` of `b` has `b_len` (heads of scores and outputs).
    /// Runs as many chunks as the shorter of the two has.
    pub fn for_each_chunk2<A: Send, B: Send>(
        &self,
        a: &mut [A],
        a_len: usize,
        b: &mut [B],
        b_len: usize,
        f: impl Fn(usize, &mut [A], &mut [B]) + Sync + Send,
    ) {
        let (a_len, b_len) = (a_len.max(1), b_len.max(1));
        let (la, lb) = (a.len(), b.len());
        let n = la.div_ceil(a_len).min(lb.div_ceil(b_len));
        let (pa, pb) = (SendPtr(a.as_mut_ptr()), SendPtr(b.as_mut_ptr()));
        self.for_each_index(n, |i| {
            let (sa, sb) = (i * a_len, i * b_len);
            let (ea, eb) = ((sa + a_len).min(la), (sb + b_len).min(lb));
            // SAFETY: as in `for_each_chunk`, for each of the two slices.
            let (ca, cb) = unsafe {
                (
                    std::slice::from_raw_parts_mut(pa.get().add(sa), ea - sa),
                    std::slice::from_raw_parts_mut(pb.get().add(sb), eb - sb),
                )
            };
            f(i, ca, cb);
        });
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        if let Some(sh) = &self.inner {
            sh.shutdown.store(true, Ordering::SeqCst);
            let _g = lock(&sh.sleep_lock);
            sh.wake.notify_all();
        }
        for h in self.workers.drain(..) {
            // A worker that panicked outside a task has nothing left to clean up.
            let _ = h.join();
        }
    }
}

/// A raw pointer that may cross threads (the pool hands each task a disjoint range).
struct SendPtr<T>(*mut T);
// SAFETY: used only to rebuild disjoint sub-slices of a `&mut [T]` with `T: Send`.
unsafe impl<T: Send> Send for SendPtr<T> {}
// SAFETY: see above; each task touches only its own range.
unsafe impl<T: Send> Sync for SendPtr<T> {}
impl<T> SendPtr<T> {
    fn get(&self) -> *mut T {
        self.0
    }
}

/// Fewest weight bytes a task of a row-parallel matvec streams, unless that would leave a
/// thread without a task. A task's rows are one contiguous stretch of memory; shorter stretches
/// lose DRAM bandwidth to each stream's ramp-up (hardware prefetchers start over at every
/// jump). Measured on k3-mini, resident decode (docs/history/PERFORMANCE-LOG.md §2.5): 64 KB tasks
/// 0.129 s/token, 256 KB 0.119, 1 MB 0.111, 4 MB 0.112.
pub const MIN_TASK_BYTES: usize = 1 << 20;

/// Rows per task for a compute-bound row-parallel kernel (MXFP4): about 8 tasks per thread,
/// a multiple of 8 rows. The value never affects results (each row is computed whole by one
/// task).
pub(crate) fn row_chunk(rows: usize, n_threads: usize) -> usize {
    if n_threads <= 1 {
        return rows.max(1);
    }
    let per = rows.div_ceil(n_threads * 8);
    per.div_ceil(8).max(1) * 8
}

/// Rows per task for a memory-bound row-parallel kernel whose rows are `row_bytes` each: like
/// [`row_chunk`], but at least [`MIN_TASK_BYTES`] of weights per task, and at most an equal
/// share per thread (every thread gets work); a multiple of 8 rows. Never affects results.
pub fn stream_row_chunk(rows: usize, row_bytes: usize, n_threads: usize) -> usize {
    if n_threads <= 1 {
        return rows.max(1);
    }
    let balance = rows.div_ceil(n_threads * 8);
    let stream = MIN_TASK_BYTES.div_ceil(row_bytes.max(1));
    let per = balance.max(stream).min(rows.div_ceil(n_threads));
    per.div_ceil(8).max(1) * 8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_every_element_once() {
        for n in [1, 2, 3, 8] {
            let pool = Pool::new(n);
            assert_eq!(pool.n_threads(), n);
            let mut data = vec![0u32; 1000];
            pool.for_each_chunk(&mut data, 7, |i, c| {
                for (j, v) in c.iter_mut().enumerate() {
                    *v += (i * 7 + j) as u32 + 1;
                }
            });
            assert!(data.iter().enumerate().all(|(i, &v)| v == i as u32 + 1));
        }
    }

    #[test]
    fn many_back_to_back_dispatches_run_every_task_once() {
        use std::sync::atomic::AtomicU32;
        for (n_threads, spin) in [
            (2, DEFAULT_SPIN),
            (3, DEFAULT_SPIN),
            (8, DEFAULT_SPIN),
            (2, Duration::ZERO),
            (3, Duration::ZERO),
        ] {
            let pool = Pool::new(n_threads);
            pool.set_spin(spin);
            assert_eq!(pool.spin(), spin);
            let hits: Vec<AtomicU32> = (0..97).map(|_| AtomicU32::new(0)).collect();
            for round in 0..3000usize {
                let n = 1 + round % 97;
                pool.for_each_index(n, |i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
                if round % 500 == 0 {
                    // let the workers fall asleep now and then
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            let want: Vec<u32> = (0..97)
                .map(|i| (0..3000usize).filter(|r| 1 + r % 97 > i).count() as u32)
                .collect();
            let got: Vec<u32> = hits.iter().map(|h| h.load(Ordering::Relaxed)).collect();
            assert_eq!(got, want, "{n_threads} threads, spin {spin:?}");
        }
    }

    #[test]
    fn nested_and_concurrent_dispatches_run_inline() {
        let pool = Pool::new(2);
        let mut outer = vec![0u64; 8];
        pool.for_each_chunk(&mut outer, 1, |i, c| {
            let mut inner = vec![0u64; 16];
            pool.for_each_chunk(&mut inner, 1, |j, d| d[0] = j as u64);
            c[0] = inner.iter().sum::<u64>() + i as u64;
        });
        assert_eq!(outer, (0..8).map(|i| 120 + i).collect::<Vec<u64>>());
        // two threads sharing one pool: both complete with correct results
        std::thread::scope(|s| {
            for t in 0..2u64 {
                let pool = &pool;
                s.spawn(move || {
                    for _ in 0..200 {
                        let mut v = vec![0u64; 64];
                        pool.for_each_chunk(&mut v, 4, |i, c| c.fill(i as u64 + t));
                        assert!(v.iter().enumerate().all(|(k, &x)| x == (k / 4) as u64 + t));
                    }
                });
            }
        });
    }

    #[test]
    fn a_panicking_task_is_reraised_after_the_others_finish() {
        use std::sync::atomic::AtomicU32;
        let pool = Pool::new(3);
        let ran = AtomicU32::new(0);
        let r = std::panic::catch_unwind(AssertUnwindSafe(|| {
            pool.for_each_index(64, |i| {
                ran.fetch_add(1, Ordering::Relaxed);
                assert!(i != 17, "task 17 fails");
            });
        }));
        assert!(r.is_err(), "the panic reaches the caller");
        assert_eq!(ran.load(Ordering::Relaxed), 64, "every task ran");
        // the pool still works afterwards
        let mut v = vec![0u8; 10];
        pool.for_each_chunk(&mut v, 3, |_, c| c.fill(1));
        assert!(v.iter().all(|&x| x == 1));
    }

    #[test]
    fn for_each_chunk2_pairs_chunks_in_lockstep() {
        let pool = Pool::new(2);
        let mut a = vec![0usize; 10];
        let mut b = vec![0usize; 15];
        pool.for_each_chunk2(&mut a, 2, &mut b, 3, |i, ca, cb| {
            ca.fill(i);
            cb.fill(i + 100);
        });
        assert_eq!(a, vec![0, 0, 1, 1, 2, 2, 3, 3, 4, 4]);
        assert!(
            b.chunks(3)
                .enumerate()
                .all(|(i, c)| c.iter().all(|&x| x == i + 100))
        );
    }

    #[test]
    fn row_chunk_is_positive_multiple_of_8() {
        for rows in [0, 1, 7, 100, 12288] {
            for n in [1, 2, 3, 8] {
                let mut chunks = vec![row_chunk(rows, n)];
                for row_bytes in [1, 2048, 14336, 1 << 22] {
                    chunks.push(stream_row_chunk(rows, row_bytes, n));
                }
                for c in chunks {
                    assert!(c >= 1);
                    if n > 1 {
                        assert_eq!(c % 8, 0);
                    }
                }
            }
        }
    }

    #[test]
    fn row_chunk_streams_a_megabyte_but_feeds_every_thread() {
        // k3-mini q_proj (2048 rows of 2 KB): 512-row (1 MB) tasks, 4 for 2 threads
        assert_eq!(stream_row_chunk(2048, 2048, 2), 512);
        // K3 down_proj-like (7168 rows of 36 KB): ~8 tasks per thread already stream > 1 MB
        assert_eq!(stream_row_chunk(7168, 36864, 2), 448);
        // a small matrix: 1 MB would be one task; split so both threads work
        assert_eq!(stream_row_chunk(128, 2048, 2), 64);
        // one thread: everything
        assert_eq!(stream_row_chunk(300, 2048, 1), 300);
    }
}
