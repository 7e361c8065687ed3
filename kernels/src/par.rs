//! Threading: a fixed-size worker pool and the only ways kernels split work.
//!
//! Owns: [`Pool`] (a rayon `ThreadPool`, or the calling thread alone when `n_threads == 1`)
//! and chunked helpers that hand disjoint OUTPUT slices to tasks.
//! Must not: split a reduction across threads. Every helper here gives each task whole output
//! elements (rows, heads), so the bits never depend on the number of threads or on scheduling.

use rayon::prelude::*;

use crate::KernelError;

/// A worker pool of `n_threads` threads. Row-parallel kernels take `&Pool`.
pub struct Pool {
    n_threads: usize,
    /// `None` when `n_threads == 1`: work runs on the calling thread.
    inner: Option<rayon::ThreadPool>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("n_threads", &self.n_threads)
            .finish()
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
        })
    }

    /// Like [`Pool::new`] but reports a failure to start the worker threads.
    pub fn try_new(n_threads: usize) -> Result<Pool, KernelError> {
        let n_threads = n_threads.max(1);
        if n_threads == 1 {
            return Ok(Pool {
                n_threads,
                inner: None,
            });
        }
        let inner = rayon::ThreadPoolBuilder::new()
            .num_threads(n_threads)
            .thread_name(|i| format!("k3-kernel-{i}"))
            .build()
            .map_err(|e| KernelError::ThreadPool {
                n_threads,
                reason: e.to_string(),
            })?;
        Ok(Pool {
            n_threads,
            inner: Some(inner),
        })
    }

    /// Number of worker threads.
    pub fn n_threads(&self) -> usize {
        self.n_threads
    }

    /// Runs `op` inside the pool (so rayon parallel iterators in `op` use these workers).
    pub fn install<R: Send>(&self, op: impl FnOnce() -> R + Send) -> R {
        match &self.inner {
            Some(pool) => pool.install(op),
            None => op(),
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
        match &self.inner {
            None => data
                .chunks_mut(chunk_len)
                .enumerate()
                .for_each(|(i, c)| f(i, c)),
            Some(pool) => pool.install(|| {
                data.par_chunks_mut(chunk_len)
                    .enumerate()
                    .for_each(|(i, c)| f(i, c))
            }),
        }
    }

    /// Like [`Pool::for_each_chunk`] over two outputs chunked in lockstep: chunk `i` of `a`
    /// has `a_len` elements and chunk `i` of `b` has `b_len` (heads of scores and outputs).
    pub fn for_each_chunk2<A: Send, B: Send>(
        &self,
        a: &mut [A],
        a_len: usize,
        b: &mut [B],
        b_len: usize,
        f: impl Fn(usize, &mut [A], &mut [B]) + Sync + Send,
    ) {
        let (a_len, b_len) = (a_len.max(1), b_len.max(1));
        match &self.inner {
            None => a
                .chunks_mut(a_len)
                .zip(b.chunks_mut(b_len))
                .enumerate()
                .for_each(|(i, (ca, cb))| f(i, ca, cb)),
            Some(pool) => pool.install(|| {
                a.par_chunks_mut(a_len)
                    .zip(b.par_chunks_mut(b_len))
                    .enumerate()
                    .for_each(|(i, (ca, cb))| f(i, ca, cb))
            }),
        }
    }
}

/// Rows per task for a row-parallel kernel: about 8 tasks per thread, a multiple of 8 rows.
/// The value never affects results (each row is computed whole by one task).
pub(crate) fn row_chunk(rows: usize, n_threads: usize) -> usize {
    if n_threads <= 1 {
        return rows.max(1);
    }
    let per = rows.div_ceil(n_threads * 8);
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
    fn row_chunk_is_positive_multiple_of_8() {
        for rows in [0, 1, 7, 100, 12288] {
            for n in [1, 2, 3, 8] {
                let c = row_chunk(rows, n);
                assert!(c >= 1);
                if n > 1 {
                    assert_eq!(c % 8, 0);
                }
            }
        }
    }
}
