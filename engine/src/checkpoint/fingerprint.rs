//! Weights fingerprints: a hash of sampled bytes of every layer, so a saved decode state is
//! refused by other weights of the same shape.

use super::*;

impl Checkpoint {
    /// A cheap identity of the checkpoint's weights: FNV-1a 64 of every trunk layer's
    /// [`Checkpoint::layer_fingerprints`] and the same over the global tensors. Two checkpoints
    /// of the same shape with other weights differ here (unless they agree at every sampled
    /// byte), so a saved state made with one is not silently used with the other. `None` when
    /// a tensor is absent (a partial shard set) or a sample cannot be read.
    pub fn weights_fingerprint(&self, spec: &ModelSpec) -> Option<String> {
        let mut files = SampleFiles::default();
        let mut h = Fnv::new();
        for fp in self.layer_fingerprints_with(&mut files, spec) {
            h.eat(fp?.as_bytes());
        }
        let globals = spec
            .tensors
            .iter()
            .filter(|t| t.expert.is_none() && t.layer.is_none());
        h.eat(self.fingerprint(&mut files, globals)?.as_bytes());
        Some(h.hex())
    }

    /// A cheap identity of each layer's trunk tensors (what a packed trunk holds of that
    /// layer), in layer order: FNV-1a 64 of every tensor's name and length, then 64 bytes
    /// from the middle of the largest. One small positional read per layer with read-ahead
    /// off: sampling through the mmap would fault in whole read-ahead windows (8 MiB each on
    /// the development VM: seconds at start-up). `None` for a layer when a tensor is absent or
    /// the sample cannot be read. The tensors are grouped by layer in one pass over the spec
    /// (a pass per layer cost 93 x 500,000 steps at the release's tensor count).
    pub fn layer_fingerprints(&self, spec: &ModelSpec) -> Vec<Option<String>> {
        self.layer_fingerprints_with(&mut SampleFiles::default(), spec)
    }

    pub(super) fn layer_fingerprints_with(
        &self,
        files: &mut SampleFiles,
        spec: &ModelSpec,
    ) -> Vec<Option<String>> {
        let mut by_layer: Vec<Vec<&TensorDecl>> = vec![Vec::new(); spec.n_layers];
        for t in spec.tensors.iter().filter(|t| t.expert.is_none()) {
            if let Some(v) = t.layer.and_then(|l| by_layer.get_mut(l)) {
                v.push(t);
            }
        }
        by_layer
            .into_iter()
            .map(|ts| self.fingerprint(files, ts.into_iter()))
            .collect()
    }

    pub(super) fn fingerprint<'a>(
        &self,
        files: &mut SampleFiles,
        tensors: impl Iterator<Item = &'a TensorDecl>,
    ) -> Option<String> {
        let mut h = Fnv::new();
        let mut largest: Option<(u64, u64, usize)> = None; // (length, file offset, shard)
        for t in tensors {
            let e = self.table.get(&t.name)?;
            let len = e.end - e.begin;
            h.eat(t.name.as_bytes());
            h.eat(&len.to_le_bytes());
            if largest.is_none_or(|(l, _, _)| len > l) {
                largest = Some((len, self.shards[e.shard()].data_start + e.begin, e.shard()));
            }
        }
        if let Some((len, at, shard)) = largest {
            let n = len.min(64);
            let at = at + (len - n) / 2;
            let sample = files.read(&self.shards[shard].path, shard, at, n as usize)?;
            h.eat(&sample);
        }
        Some(h.hex())
    }
}

/// FNV-1a 64 (the weights fingerprints; not a checksum against tampering).
pub(super) struct Fnv(pub(super) u64);

impl Fnv {
    pub(super) fn new() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
    pub(super) fn eat(&mut self, b: &[u8]) {
        for &x in b {
            self.0 ^= u64::from(x);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    pub(super) fn hex(&self) -> String {
        format!("{:016x}", self.0)
    }
}

/// Shards opened for fingerprint samples, with read-ahead off (`POSIX_FADV_RANDOM`).
#[derive(Default)]
pub(super) struct SampleFiles(pub(super) std::collections::HashMap<usize, std::fs::File>);

impl SampleFiles {
    pub(super) fn read(&mut self, path: &Path, shard: usize, at: u64, n: usize) -> Option<Vec<u8>> {
        use crate::platform::{self, FileAdvice};
        use std::collections::hash_map::Entry;
        let f = match self.0.entry(shard) {
            Entry::Occupied(o) => o.into_mut(),
            Entry::Vacant(v) => {
                let f = std::fs::File::open(path).ok()?;
                // Advice only: changes read-ahead (absent on Windows).
                let _ = platform::advise_file(&f, FileAdvice::Random);
                v.insert(f)
            }
        };
        let mut buf = vec![0u8; n];
        platform::read_exact_at(f, &mut buf, at).ok()?;
        Some(buf)
    }
}
