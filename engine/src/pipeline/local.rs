//! An in-process [`Link`]: ranks as threads joined by channels (tests of the pipeline without
//! MPI; the same drivers and messages as the MPI link).

use std::collections::VecDeque;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::time::Duration;

use super::Link;

/// One thread's end of an in-process pipeline.
pub struct LocalLink {
    rank: usize,
    to: Vec<Sender<(usize, Vec<u8>)>>,
    from: Receiver<(usize, Vec<u8>)>,
    /// Messages received while waiting for another sender.
    pending: VecDeque<(usize, Vec<u8>)>,
    timeout: Duration,
}

/// `n` joined links, rank i at index i. A receive that waits longer than `timeout` fails.
pub fn links(n: usize, timeout: Duration) -> Vec<LocalLink> {
    let (txs, rxs): (Vec<_>, Vec<_>) = (0..n).map(|_| channel()).unzip();
    rxs.into_iter()
        .enumerate()
        .map(|(rank, from)| LocalLink {
            rank,
            to: txs.clone(),
            from,
            pending: VecDeque::new(),
            timeout,
        })
        .collect()
}

impl LocalLink {
    fn next(&mut self) -> Result<(usize, Vec<u8>), String> {
        self.from.recv_timeout(self.timeout).map_err(|e| match e {
            RecvTimeoutError::Timeout => format!(
                "rank {}: no message for {:.0} s",
                self.rank,
                self.timeout.as_secs_f64()
            ),
            RecvTimeoutError::Disconnected => format!("rank {}: every peer is gone", self.rank),
        })
    }
}

impl Link for LocalLink {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.to.len()
    }

    fn send(&mut self, to: usize, bytes: &[u8]) -> Result<(), String> {
        self.to[to]
            .send((self.rank, bytes.to_vec()))
            .map_err(|_| format!("rank {to} is gone"))
    }

    fn recv_from(&mut self, from: usize) -> Result<Vec<u8>, String> {
        if let Some(i) = self.pending.iter().position(|(f, _)| *f == from) {
            return Ok(self.pending.remove(i).expect("found").1);
        }
        loop {
            let (f, b) = self.next()?;
            if f == from {
                return Ok(b);
            }
            self.pending.push_back((f, b));
        }
    }

    fn recv_any(&mut self) -> Result<(usize, Vec<u8>), String> {
        match self.pending.pop_front() {
            Some(m) => Ok(m),
            None => self.next(),
        }
    }
}
