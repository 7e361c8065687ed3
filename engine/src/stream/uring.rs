//! io_uring reads (cargo feature `io-uring`): a batch of O_DIRECT positional reads submitted
//! together at queue depth N from one thread, instead of N blocking pread threads.
//!
//! Owns: one ring and the submit/reap loop for [`ReadPool::read_all`](super::direct::ReadPool).
//! Must not: be required: setup fails under Docker's default seccomp profile or with
//! `kernel.io_uring_disabled`, and the caller then keeps the pread thread pool (rust-deps.md
//! Q9). Anything unusual in a completion (EINVAL, a short read) is retried through the
//! ordinary `DirectFile::read_into` path, which owns the O_DIRECT fallback rules.
//! Follows upstream: io-uring 0.7 (`opcode::Read`, `submit_and_wait`); buffers stay borrowed
//! until every submitted read has completed, so the kernel never writes freed memory.

use std::io;
use std::os::fd::AsRawFd;

use io_uring::{IoUring, opcode, types};

use super::StreamError;
use super::direct::ReadReq;

/// One io_uring instance.
pub struct Ring {
    ring: IoUring,
    entries: u32,
}

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring")
            .field("entries", &self.entries)
            .finish()
    }
}

impl Ring {
    /// Set up a ring of `entries` submission slots (the queue depth).
    pub fn new(entries: u32) -> io::Result<Self> {
        let entries = entries.clamp(1, 4096).next_power_of_two();
        Ok(Self {
            ring: IoUring::new(entries)?,
            entries,
        })
    }

    pub fn entries(&self) -> u32 {
        self.entries
    }

    /// Run the reads; each result is the index of the first requested byte in its buffer,
    /// like `DirectFile::read_into`.
    pub fn read_all(&mut self, reqs: &mut [ReadReq<'_>]) -> Vec<Result<usize, StreamError>> {
        let n = reqs.len();
        let mut results: Vec<Option<Result<usize, StreamError>>> = (0..n).map(|_| None).collect();
        // Requests the ring takes: O_DIRECT files, aligned buffers large enough, < 4 GiB.
        let mut ring_idx = Vec::with_capacity(n);
        for (i, r) in reqs.iter_mut().enumerate() {
            let span = r.file.span(r.offset, r.len);
            let ok = r.len > 0
                && r.file.is_direct()
                && r.offset + r.len as u64 <= r.file.size()
                && r.buf.len() >= span.len
                && (r.buf.as_ptr() as usize).is_multiple_of(r.file.dio_align().mem.max(1))
                && u32::try_from(span.len).is_ok()
                && r.file.direct_fd().is_some();
            if ok {
                ring_idx.push(i);
            } else {
                results[i] = Some(r.file.read_into(r.offset, r.len, r.buf));
            }
        }
        // Submit / reap. Completion values: bytes read or -errno.
        let mut done: Vec<Option<i32>> = vec![None; n];
        let mut next = 0usize;
        let mut in_flight = 0usize;
        let mut completed = 0usize;
        while completed < ring_idx.len() {
            while next < ring_idx.len() && in_flight < self.entries as usize {
                let i = ring_idx[next];
                let r = &mut reqs[i];
                let span = r.file.span(r.offset, r.len);
                let Some(fd) = r.file.direct_fd() else {
                    // The file fell back to buffered reads meanwhile: read it the plain way.
                    results[i] = Some(r.file.read_into(r.offset, r.len, r.buf));
                    next += 1;
                    completed += 1;
                    continue;
                };
                let sqe = opcode::Read::new(
                    types::Fd(fd.as_raw_fd()),
                    r.buf.as_mut_ptr(),
                    span.len as u32,
                )
                .offset(span.start)
                .build()
                .user_data(i as u64);
                // SAFETY: the buffer stays mutably borrowed (through `reqs`) until this
                // function returns, and it does not return before every submitted read has
                // completed (the loop below waits for all of them).
                if unsafe { self.ring.submission().push(&sqe) }.is_err() {
                    if in_flight == 0 {
                        // Cannot happen with an empty queue; never wait on nothing.
                        results[i] = Some(r.file.read_into(r.offset, r.len, r.buf));
                        next += 1;
                        completed += 1;
                        continue;
                    }
                    break;
                }
                next += 1;
                in_flight += 1;
            }
            if in_flight == 0 {
                continue;
            }
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if in_flight == 0 => {
                    // Nothing in the kernel: finish the rest with plain reads.
                    for &i in &ring_idx[next..] {
                        let r = &mut reqs[i];
                        results[i] = Some(r.file.read_into(r.offset, r.len, r.buf));
                    }
                    let _ = e;
                    completed = ring_idx.len();
                    next = ring_idx.len();
                    continue;
                }
                Err(_) => {
                    // Reads are in flight: keep waiting for them (their buffers must not be
                    // released before the kernel is done with them).
                    std::thread::yield_now();
                }
            }
            for cqe in self.ring.completion() {
                let i = cqe.user_data() as usize;
                if i < n && done[i].is_none() {
                    done[i] = Some(cqe.result());
                    in_flight -= 1;
                    completed += 1;
                }
            }
        }
        for &i in &ring_idx {
            if results[i].is_some() {
                continue;
            }
            let r = &mut reqs[i];
            let span = r.file.span(r.offset, r.len);
            let need = span.lead + r.len;
            results[i] = Some(match done[i] {
                Some(res) if res >= 0 && res as usize >= need => Ok(span.lead),
                // Short read, EINVAL (O_DIRECT refused), anything odd: the ordinary path
                // retries and applies the fallback rules.
                Some(res) if res >= 0 || -res == libc::EINVAL => {
                    r.file.read_into(r.offset, r.len, r.buf)
                }
                Some(res) => Err(StreamError::io(
                    "read",
                    r.file.path(),
                    io::Error::from_raw_os_error(-res),
                )),
                None => r.file.read_into(r.offset, r.len, r.buf),
            });
        }
        results
            .into_iter()
            .map(|r| {
                r.unwrap_or_else(|| {
                    Err(StreamError::Invalid(
                        "an io_uring read did not complete (internal error)".to_string(),
                    ))
                })
            })
            .collect()
    }
}
