//! A pipeline rank's trunk: only its own range of layers.
//!
//! Owns: holding the dense-trunk tensors of layers `start..end` for the run: the longest
//! prefix of the range that fits the rank's budget pinned in RAM (read once at start from the
//! shards that hold them, into an [`Arena`]), the rest served from the checkpoint's memory
//! maps. A layer outside the range is an error, never a read. Must not: convert bytes (the
//! executor widens the checkpoint's own bytes, so the bits are those of every other source).

use std::ops::Range;

use k3_models::spec::{ModelSpec, TensorDecl};

use crate::arena::{Arena, ArenaOptions};
use crate::checkpoint::Checkpoint;
use crate::stream::StreamError;
use crate::stream::aligned::{IO_ALIGN, align_up};
use crate::weights::{LayerWeights, TensorBytes, TrunkSource, TrunkStats, WeightError};

enum Src<'c> {
    Pinned(usize),
    Mapped(&'c [u8]),
}

/// The trunk of one pipeline rank.
pub struct RangeTrunk<'c> {
    range: Range<usize>,
    /// Per layer of the range: its tensors.
    layers: Vec<Vec<(&'c TensorDecl, Src<'c>)>>,
    arena: Option<Arena>,
    pinned_layers: usize,
    stats: TrunkStats,
}

impl<'c> RangeTrunk<'c> {
    /// Layers `range` of `spec`: the longest prefix whose tensors (each layer rounded up to
    /// the 4096-byte alignment) fit `budget` pinned, the rest mapped.
    pub fn open(
        spec: &'c ModelSpec,
        ckpt: &'c Checkpoint,
        range: Range<usize>,
        budget: u64,
        opts: &ArenaOptions,
    ) -> Result<RangeTrunk<'c>, StreamError> {
        if range.is_empty() || range.end > spec.n_layers {
            return Err(StreamError::Config(format!(
                "layers {}..{} are not a range of the model's {} layers",
                range.start, range.end, spec.n_layers
            )));
        }
        let mut layers: Vec<Vec<&'c TensorDecl>> = vec![Vec::new(); range.len()];
        for t in &spec.tensors {
            if let (Some(l), None) = (t.layer, t.expert)
                && range.contains(&l)
            {
                layers[l - range.start].push(t);
            }
        }
        let size = |ts: &[&TensorDecl]| -> Result<u64, StreamError> {
            let mut n = 0u64;
            for t in ts {
                n += ckpt.locate(&t.name).map_err(StreamError::Invalid)?.n_bytes;
            }
            Ok(align_up(n, IO_ALIGN as u64))
        };
        let mut pinned_layers = 0;
        let mut used = 0u64;
        for ts in &layers {
            let s = size(ts)?;
            if used + s > budget {
                break;
            }
            used += s;
            pinned_layers += 1;
        }
        let pin: Vec<&TensorDecl> = layers[..pinned_layers].iter().flatten().copied().collect();
        let arena = if pin.is_empty() {
            None
        } else {
            Some(Arena::load(ckpt, &pin, opts)?)
        };
        let mut k = 0;
        let mut bound = Vec::with_capacity(layers.len());
        for (i, ts) in layers.iter().enumerate() {
            let mut v = Vec::with_capacity(ts.len());
            for &t in ts {
                if i < pinned_layers {
                    v.push((t, Src::Pinned(k)));
                    k += 1;
                } else {
                    let b = ckpt.try_bytes(&t.name).ok_or_else(|| {
                        StreamError::Invalid(format!(
                            "tensor {} is not in the checkpoint at {}",
                            t.name,
                            ckpt.dir().display()
                        ))
                    })?;
                    v.push((t, Src::Mapped(b)));
                }
            }
            bound.push(v);
        }
        let arena_stats = arena
            .as_ref()
            .map(|a| a.stats().clone())
            .unwrap_or_default();
        let stats = TrunkStats {
            n_layers: range.len(),
            pinned_layers,
            pinned_bytes: arena_stats.arena_bytes,
            o_direct: arena_stats.o_direct,
            pinned_load_seconds: arena_stats.seconds,
            ..TrunkStats::default()
        };
        Ok(RangeTrunk {
            range,
            layers: bound,
            arena,
            pinned_layers,
            stats,
        })
    }

    /// The layers this rank holds.
    pub fn range(&self) -> Range<usize> {
        self.range.clone()
    }

    /// Layers of the range pinned in RAM (the first ones).
    pub fn pinned_layers(&self) -> usize {
        self.pinned_layers
    }

    /// Bytes read from the shards to pin the prefix at start.
    pub fn load_bytes(&self) -> u64 {
        self.arena.as_ref().map_or(0, |a| a.stats().bytes_read)
    }

    /// The start-up line.
    pub fn startup_line(&self) -> String {
        let r = &self.range;
        format!(
            "trunk: layers {}..{}: {} pinned ({}, read in {:.2} s){}",
            r.start,
            r.end,
            self.pinned_layers,
            crate::stream::fmt_bytes(self.stats.pinned_bytes),
            self.stats.pinned_load_seconds,
            if self.pinned_layers < r.len() {
                format!(
                    ", {} served from the checkpoint's memory maps (read per token unless the \
                     page cache keeps them)",
                    r.len() - self.pinned_layers
                )
            } else {
                String::new()
            }
        )
    }
}

impl TrunkSource for RangeTrunk<'_> {
    fn layer(&mut self, layer: usize) -> Result<LayerWeights<'_>, WeightError> {
        if !self.range.contains(&layer) {
            return Err(WeightError::Trunk(format!(
                "layer {layer} is not on this pipeline rank (layers {}..{})",
                self.range.start, self.range.end
            )));
        }
        let i = layer - self.range.start;
        let mut tensors = Vec::with_capacity(self.layers[i].len());
        for (decl, src) in &self.layers[i] {
            let bytes = match src {
                Src::Pinned(k) => self
                    .arena
                    .as_ref()
                    .expect("invariant: a pinned tensor has an arena")
                    .bytes(*k),
                Src::Mapped(b) => {
                    self.stats.bytes_read += b.len() as u64;
                    b
                }
            };
            tensors.push(TensorBytes { decl, bytes });
        }
        Ok(LayerWeights { tensors })
    }

    fn stats(&self) -> TrunkStats {
        self.stats.clone()
    }
}
