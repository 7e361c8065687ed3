//! `pack-trunk`: rewrite the dense trunk into one file, `trunk.bin`, plus `trunk.json`.
//!
//! Owns: the packed-trunk format (this module's [`TrunkManifest`]), verifying that each
//! layer's non-expert tensors form one contiguous range inside one shard (a hole — e.g. expert
//! bytes in between — is refused, naming the layer, the gap's offsets and what lies in it),
//! one range copy per layer to a 4096-aligned offset, the progress bar, and atomic output
//! (temporary names, renamed at the end; an interrupted pack leaves nothing that looks
//! complete). Packing is deterministic: packing twice gives identical files.
//! Must not: reorder or convert bytes (the trunk is the checkpoint's own bytes), or include
//! global tensors (embedding, lm_head, final norm, output AttnRes): their checkpoint locations
//! are recorded in `trunk.json` for reference only.
//! Follows upstream: docs/DESIGN.md §2 and the Chinese seed article §2 (one range copy per layer,
//! 4096-byte aligned so one O_DIRECT pread reads a whole layer; a hole would drag expert bytes
//! in: 400 GB instead of 109).
//!
//! Files: this one holds the format (`trunk.json` structs, names, versions); `write.rs` packs
//! (layer ranges, holes, the copy, compressed records); `manifest.rs` reads a packed trunk back
//! and checks it against the model.

use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use k3_models::spec::{ModelSpec, TensorDecl};

use super::aligned::{IO_ALIGN, align_up};
use super::compress::{self, Compression, Encoder, StoredChunk, StoredLayer};
use super::{StreamError, fmt_bytes};
use crate::checkpoint::{Checkpoint, OpenOptions};

mod manifest;
pub mod write;

pub use write::{pack_trunk, pack_trunk_with, plan_pack, run};

/// File names inside a packed-trunk directory.
pub const TRUNK_BIN: &str = "trunk.bin";
pub const TRUNK_JSON: &str = "trunk.json";
const PARTIAL: &str = ".partial";
/// Format tag and version written into `trunk.json`.
pub const FORMAT: &str = "k3-trunk";
pub const VERSION: u32 = 1;
/// The version of a compressed pack (`pack-trunk --compress`): older readers refuse it by
/// its version instead of misreading the records as raw layers.
pub const VERSION_COMPRESSED: u32 = 2;

/// `trunk.json`.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrunkManifest {
    pub format: String,
    pub version: u32,
    /// The spec's model name.
    pub model: String,
    pub n_layers: usize,
    /// Every layer offset is a multiple of this.
    pub align: u64,
    /// Sum of the layer sizes (exact, without padding).
    pub packed_bytes: u64,
    /// Length of trunk.bin (layers padded to `align`).
    pub file_bytes: u64,
    pub layers: Vec<PackedLayer>,
    /// Where the global tensors live in the checkpoint (not in trunk.bin; informational).
    pub globals: Vec<GlobalTensor>,
    /// Set when the layers are stored compressed (version 2; [`super::compress`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compression: Option<Compression>,
}

/// One layer's range in trunk.bin.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PackedLayer {
    pub layer: usize,
    /// Offset in trunk.bin (multiple of `align`).
    pub offset: u64,
    /// Exact bytes of the layer's trunk tensors.
    pub size: u64,
    /// Shard file name the range was copied from, and its absolute offset there.
    pub source_shard: String,
    pub source_offset: u64,
    /// In layer order of offsets.
    pub tensors: Vec<PackedTensor>,
    /// The layer's compressed records (compressed packs only); `size` stays the layer's raw
    /// size, the bytes it takes in RAM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stored: Option<StoredLayer>,
    /// [`Checkpoint::layer_fingerprints`] of the weights packed: a run refuses a trunk packed
    /// from other weights of the same shape. Absent in packs of older builds (then not
    /// checked, and said so at start).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_fingerprint: Option<String>,
}

/// One tensor inside a packed layer.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PackedTensor {
    pub name: String,
    /// `TensorRole` variant name.
    pub role: String,
    pub dtype: String,
    pub shape: Vec<usize>,
    /// Offset inside the layer.
    pub offset: u64,
    pub size: u64,
}

/// A global tensor's location in the checkpoint.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GlobalTensor {
    pub name: String,
    pub role: String,
    pub dtype: String,
    pub shape: Vec<usize>,
    pub shard: String,
    pub offset: u64,
    pub size: u64,
}

/// What a pack did.
#[derive(Clone, Debug, serde::Serialize)]
pub struct PackReport {
    pub trunk_bin: PathBuf,
    pub trunk_json: PathBuf,
    pub n_layers: usize,
    pub packed_bytes: u64,
    pub file_bytes: u64,
    pub largest_layer: usize,
    pub largest_layer_bytes: u64,
    /// One ring slot: the largest layer rounded up to the O_DIRECT alignment. The smallest
    /// trunk budget that can stream from this pack.
    pub min_slot_bytes: u64,
    /// Compressed packs: the bytes of the stored records (what a pass over the trunk reads).
    pub stored_bytes: Option<u64>,
    pub seconds: f64,
}

impl PackReport {
    pub fn summary(&self) -> String {
        let head = format!(
            "packed {} layers, {} ({} with alignment) into {} in {:.1} s; largest layer {} ({}): \
             one ring slot takes {} ({} bytes, 4 KiB-aligned reads)",
            self.n_layers,
            fmt_bytes(self.packed_bytes),
            fmt_bytes(self.file_bytes),
            self.trunk_bin.display(),
            self.seconds,
            self.largest_layer,
            fmt_bytes(self.largest_layer_bytes),
            fmt_bytes(self.min_slot_bytes),
            self.min_slot_bytes
        );
        match self.stored_bytes {
            None => format!("{head}, the smallest --trunk-gb that can stream from this trunk"),
            Some(b) => format!(
                "{head}, the smallest --trunk-gb that can stream from this trunk; stored \
                 compressed: {} of records, {:.1}% of the layers' bytes (a pass over the trunk \
                 reads that much and decodes it in place back to the same bytes)",
                fmt_bytes(b),
                100.0 * b as f64 / self.packed_bytes.max(1) as f64
            ),
        }
    }
}

/// The trunk tensors of every layer, in layer order: each layer's declarations that are not
/// routed experts, in declaration order. One pass over the spec (the release declares
/// ~500,000 tensors, all but ~7,000 of them routed experts).
pub fn trunk_decls_by_layer(spec: &ModelSpec) -> Vec<Vec<&TensorDecl>> {
    let mut by_layer: Vec<Vec<&TensorDecl>> = vec![Vec::new(); spec.n_layers];
    for t in spec.tensors.iter().filter(|t| t.expert.is_none()) {
        if let Some(v) = t.layer.and_then(|l| by_layer.get_mut(l)) {
            v.push(t);
        }
    }
    by_layer
}
