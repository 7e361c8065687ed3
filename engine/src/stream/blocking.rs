//! A fixed set of BLOCKING reader threads for scoped batches of positional reads.
//!
//! Owns: [`IoThreads`]: `n` threads that sleep on a condition variable until a batch arrives
//! and go back to sleep when the queue is empty, and [`IoThreads::run`], which runs a batch
//! of closures that may borrow the caller's data and returns only when every one has run.
//! Why not rayon or the kernels' spinning `Pool`: an idle rayon worker spins with
//! `sched_yield` before it sleeps, and eight such workers woken for every expert batch took
//! CPU from the two compute threads on a 2-core machine (perf: `do_sched_yield` + `__sched_yield` ~5% of
//! all samples, in the reader threads; docs/history/PERFORMANCE-LOG.md §5.3). Reads block in
//! the kernel; nothing here needs work stealing.
//! Must not: return from `run` before every task of the batch has finished (the tasks borrow
//! the caller's buffers), or let a panicking task take a thread down (it is caught; the
//! caller sees the task's output slot unset).
//! Follows upstream: the scoped thread-pool pattern (`scoped_threadpool`, `std::thread::scope`).

use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};

/// A queued task (owned: `run` erases its borrows' lifetime while it waits for them).
pub type Task = Box<dyn FnOnce() + Send + 'static>;

#[derive(Default)]
struct Queue {
    tasks: VecDeque<Task>,
    closed: bool,
}

#[derive(Default)]
struct Shared {
    queue: Mutex<Queue>,
    ready: Condvar,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Tasks run outside the lock and their panics are caught: a poisoned lock still holds a
    // consistent queue / counter.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Counts a batch's finished tasks; the caller waits for all of them.
#[derive(Default)]
struct Done {
    count: Mutex<usize>,
    all: Condvar,
}

impl Done {
    fn finish_one(&self) {
        *lock(&self.count) += 1;
        self.all.notify_one();
    }

    fn wait_for(&self, n: usize) {
        let mut c = lock(&self.count);
        while *c < n {
            c = self.all.wait(c).unwrap_or_else(PoisonError::into_inner);
        }
    }
}

/// `n` sleeping reader threads (see the module doc).
pub struct IoThreads {
    shared: Arc<Shared>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for IoThreads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IoThreads")
            .field("threads", &self.threads.len())
            .finish()
    }
}

impl IoThreads {
    /// Start `n` (at least 1) threads named `{name}-{i}`.
    pub fn new(n: usize, name: &str) -> std::io::Result<Self> {
        let shared = Arc::new(Shared::default());
        let mut threads = Vec::with_capacity(n.max(1));
        for i in 0..n.max(1) {
            let sh = Arc::clone(&shared);
            let spawned = std::thread::Builder::new()
                .name(format!("{name}-{i}"))
                .spawn(move || worker(&sh));
            match spawned {
                Ok(h) => threads.push(h),
                Err(e) => {
                    // Stop the ones already started before reporting.
                    drop(IoThreads { shared, threads });
                    return Err(e);
                }
            }
        }
        Ok(Self { shared, threads })
    }

    /// Run every task on the threads (started in the given order, after the tasks already
    /// queued) and return when all have finished. Tasks may borrow from the caller (`'a`).
    pub fn run<'a>(&self, tasks: Vec<Box<dyn FnOnce() + Send + 'a>>) {
        self.run_with(tasks, false);
    }

    /// Like [`IoThreads::run`], but the tasks go to the FRONT of the queue (ahead of tasks
    /// queued by other callers and not yet started), e.g. reads the caller is waiting for
    /// ahead of speculative ones.
    pub fn run_first<'a>(&self, tasks: Vec<Box<dyn FnOnce() + Send + 'a>>) {
        self.run_with(tasks, true);
    }

    /// Run `task` on one of the threads while `f` runs on the calling thread; returns `f`'s
    /// result once BOTH have finished (also when `f` panics: the task is waited for before the
    /// panic continues). A panicking task is caught; the caller sees whatever it left unset.
    pub fn run_alongside<'a, R>(
        &self,
        task: Box<dyn FnOnce() + Send + 'a>,
        f: impl FnOnce() -> R,
    ) -> R {
        let done = Arc::new(Done::default());
        let d = Arc::clone(&done);
        let w: Box<dyn FnOnce() + Send + 'a> = Box::new(move || {
            let _ = catch_unwind(AssertUnwindSafe(task));
            d.finish_one();
        });
        // SAFETY: as in `run_with`: the task is queued below, and `_wait` (dropped when this
        // function returns or unwinds, after the task was queued) blocks until it has called
        // `finish_one`, so nothing it borrows for `'a` is used after this function returns.
        let w = unsafe { std::mem::transmute::<Box<dyn FnOnce() + Send + 'a>, Task>(w) };
        struct WaitOne<'d>(&'d Done);
        impl Drop for WaitOne<'_> {
            fn drop(&mut self) {
                self.0.wait_for(1);
            }
        }
        lock(&self.shared.queue).tasks.push_back(w);
        let _wait = WaitOne(&done);
        self.shared.ready.notify_one();
        f()
    }

    /// Queue owned tasks (after the tasks already queued) and return at once: nothing waits
    /// for them. A panicking task is caught (the thread goes on); a task that must report
    /// back does so itself (e.g. over a channel, also when its work failed).
    pub fn spawn(&self, tasks: Vec<Task>) {
        let n = tasks.len();
        if n == 0 {
            return;
        }
        lock(&self.shared.queue)
            .tasks
            .extend(tasks.into_iter().map(|t| {
                Box::new(move || {
                    let _ = catch_unwind(AssertUnwindSafe(t));
                }) as Task
            }));
        if n >= self.threads.len() {
            self.shared.ready.notify_all();
        } else {
            for _ in 0..n {
                self.shared.ready.notify_one();
            }
        }
    }

    fn run_with<'a>(&self, tasks: Vec<Box<dyn FnOnce() + Send + 'a>>, front: bool) {
        let n = tasks.len();
        if n == 0 {
            return;
        }
        let done = Arc::new(Done::default());
        let wrapped: Vec<Task> = tasks
            .into_iter()
            .map(|t| {
                let d = Arc::clone(&done);
                let w: Box<dyn FnOnce() + Send + 'a> = Box::new(move || {
                    let _ = catch_unwind(AssertUnwindSafe(t));
                    d.finish_one();
                });
                // SAFETY: the task only lives until it has run. Every wrapped task is queued
                // below under one lock, and this function then blocks (`wait_for(n)`, which
                // nothing between the queueing and the wait can skip: no call there can
                // panic) until each has called `finish_one`, which each does after its
                // closure returned or its panic was caught. So nothing the task borrows for
                // `'a` is used after `run_with` returns; the 'static is needed only to store it
                // in the shared queue meanwhile. Tasks dropped unqueued (a panic before the
                // lock, e.g. out of memory) never ran and borrow nothing anymore.
                unsafe { std::mem::transmute::<Box<dyn FnOnce() + Send + 'a>, Task>(w) }
            })
            .collect();
        {
            let mut q = lock(&self.shared.queue);
            if front {
                for t in wrapped.into_iter().rev() {
                    q.tasks.push_front(t);
                }
            } else {
                q.tasks.extend(wrapped);
            }
        }
        if n >= self.threads.len() {
            self.shared.ready.notify_all();
        } else {
            for _ in 0..n {
                self.shared.ready.notify_one();
            }
        }
        done.wait_for(n);
    }
}

#[cfg(test)]
impl IoThreads {
    fn queued(&self) -> usize {
        lock(&self.shared.queue).tasks.len()
    }
}

fn worker(sh: &Shared) {
    loop {
        let task = {
            let mut q = lock(&sh.queue);
            loop {
                if let Some(t) = q.tasks.pop_front() {
                    break t;
                }
                if q.closed {
                    return;
                }
                q = sh.ready.wait(q).unwrap_or_else(PoisonError::into_inner);
            }
        };
        task();
    }
}

impl Drop for IoThreads {
    fn drop(&mut self) {
        lock(&self.shared.queue).closed = true;
        self.shared.ready.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// `n` tasks that each add 1 to `counter`.
    fn counting(counter: &AtomicUsize, n: usize) -> Vec<Box<dyn FnOnce() + Send + '_>> {
        (0..n)
            .map(|_| {
                Box::new(move || {
                    counter.fetch_add(1, Ordering::SeqCst);
                }) as Box<dyn FnOnce() + Send>
            })
            .collect()
    }

    /// A batch of `n` tasks still runs to the end on `pool` (after a panic, say).
    fn still_serves(pool: &IoThreads, n: usize) {
        let c = AtomicUsize::new(0);
        pool.run(counting(&c, n));
        assert_eq!(c.load(Ordering::SeqCst), n);
    }

    #[test]
    fn spawned_tasks_run_without_a_wait_and_survive_a_panic() {
        let pool = IoThreads::new(2, "t").expect("threads start");
        let (tx, rx) = std::sync::mpsc::channel::<usize>();
        let mut tasks: Vec<Task> = vec![Box::new(|| panic!("a spawned task panics"))];
        for i in 0..20 {
            let tx = tx.clone();
            tasks.push(Box::new(move || tx.send(i).expect("receiver alive")));
        }
        drop(tx);
        pool.spawn(tasks);
        let mut got: Vec<usize> = rx.iter().collect();
        got.sort_unstable();
        assert_eq!(got, (0..20).collect::<Vec<_>>());
        // the threads are still there after the panic
        still_serves(&pool, 5);
    }

    #[test]
    fn every_task_runs_once_and_may_borrow() {
        let pool = IoThreads::new(3, "t").expect("threads start");
        let mut out = vec![0usize; 100];
        for round in 1..=3 {
            let tasks: Vec<Box<dyn FnOnce() + Send + '_>> = out
                .iter_mut()
                .enumerate()
                .map(|(i, o)| Box::new(move || *o += i * round) as Box<dyn FnOnce() + Send>)
                .collect();
            pool.run(tasks);
        }
        assert!(out.iter().enumerate().all(|(i, &v)| v == 6 * i));
    }

    #[test]
    fn a_panicking_task_does_not_stop_the_batch_or_the_pool() {
        let pool = IoThreads::new(2, "t").expect("threads start");
        let ran = AtomicUsize::new(0);
        let tasks: Vec<Box<dyn FnOnce() + Send + '_>> = (0..10)
            .map(|i| {
                let ran = &ran;
                Box::new(move || {
                    if i == 3 {
                        panic!("task {i} fails on purpose");
                    }
                    ran.fetch_add(1, Ordering::SeqCst);
                }) as Box<dyn FnOnce() + Send>
            })
            .collect();
        pool.run(tasks);
        assert_eq!(ran.load(Ordering::SeqCst), 9);
        // Both threads still serve a later batch.
        still_serves(&pool, 8);
    }

    #[test]
    fn run_alongside_runs_both_and_waits_for_the_task() {
        let pool = IoThreads::new(1, "t").expect("threads start");
        for _ in 0..20 {
            let mut got = None;
            let caller = pool.run_alongside(
                Box::new(|| {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                    got = Some(std::thread::current().name().map(str::to_string));
                }),
                || 7,
            );
            assert_eq!(caller, 7);
            assert_eq!(
                got,
                Some(Some("t-0".to_string())),
                "ran on the pool's thread"
            );
        }
        // A panicking task leaves its output unset and the thread serves the next one.
        let mut got: Option<u32> = None;
        pool.run_alongside(Box::new(|| panic!("on purpose")), || ());
        pool.run_alongside(Box::new(|| got = Some(1)), || ());
        assert_eq!(got, Some(1));
    }

    #[test]
    fn run_first_jumps_the_queue() {
        let pool = IoThreads::new(1, "t").expect("threads start");
        let order = Mutex::new(Vec::new());
        let (started_tx, started_rx) = std::sync::mpsc::channel::<()>();
        let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
        std::thread::scope(|s| {
            let order = &order;
            let pool = &pool;
            s.spawn(move || {
                let blocker: Box<dyn FnOnce() + Send + '_> = Box::new(move || {
                    started_tx.send(()).expect("main waits");
                    release_rx.recv().expect("main releases");
                });
                let mut tasks = vec![blocker];
                for i in 1..=2 {
                    tasks.push(Box::new(move || lock(order).push(i)));
                }
                pool.run(tasks);
            });
            started_rx.recv().expect("the blocker starts");
            assert_eq!(pool.queued(), 2);
            let urgent = s.spawn(|| pool.run_first(vec![Box::new(|| lock(order).push(0))]));
            while pool.queued() < 3 {
                std::thread::yield_now();
            }
            release_tx.send(()).expect("the blocker waits");
            urgent.join().expect("no panic");
        });
        assert_eq!(*lock(&order), vec![0, 1, 2]);
    }

    #[test]
    fn batches_from_two_callers_at_once_both_finish() {
        let pool = IoThreads::new(2, "t").expect("threads start");
        let total = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..2 {
                s.spawn(|| {
                    for _ in 0..50 {
                        pool.run(counting(&total, 4));
                    }
                });
            }
        });
        assert_eq!(total.load(Ordering::SeqCst), 2 * 50 * 4);
    }
}
