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

use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use k3_models::spec::{ModelSpec, TensorDecl};

use super::aligned::{IO_ALIGN, align_up};
use super::compress::{self, Compression, Encoder, StoredChunk, StoredLayer};
use super::{StreamError, fmt_bytes};
use crate::checkpoint::{Checkpoint, OpenOptions};

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

fn role_name(d: &TensorDecl) -> String {
    format!("{:?}", d.role)
}

fn file_name(p: &Path) -> String {
    p.file_name().map_or_else(
        || p.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    )
}

struct LayerSource {
    shard_path: PathBuf,
    source_offset: u64,
    size: u64,
    tensors: Vec<PackedTensor>,
}

/// Locate and verify one layer's contiguous range.
fn layer_source(
    ck: &Checkpoint,
    decls: &[&TensorDecl],
    layer: usize,
) -> Result<LayerSource, StreamError> {
    if decls.is_empty() {
        return Err(StreamError::Pack(format!(
            "layer {layer} declares no trunk tensors"
        )));
    }
    let mut located = Vec::with_capacity(decls.len());
    for d in decls {
        let loc = ck
            .locate(&d.name)
            .map_err(|e| StreamError::Pack(format!("layer {layer}: {e}")))?;
        if loc.n_bytes != d.n_bytes() as u64 {
            return Err(StreamError::Pack(format!(
                "layer {layer}: tensor {} has {} bytes in {} but its declaration needs {}",
                d.name,
                loc.n_bytes,
                loc.shard_path.display(),
                d.n_bytes()
            )));
        }
        located.push((d, loc));
    }
    located.sort_by(|a, b| {
        (&a.1.shard_path, a.1.file_offset, &a.0.name).cmp(&(
            &b.1.shard_path,
            b.1.file_offset,
            &b.0.name,
        ))
    });
    let first = &located[0];
    for w in located.windows(2) {
        let (a, b) = (&w[0], &w[1]);
        if a.1.shard_path != b.1.shard_path {
            return Err(StreamError::Pack(format!(
                "layer {layer}: trunk tensors are split across shards ({} holds {}, {} holds {}); \
                 a layer must be one contiguous range in one shard",
                file_name(&a.1.shard_path),
                a.0.name,
                file_name(&b.1.shard_path),
                b.0.name
            )));
        }
        let a_end = a.1.file_offset + a.1.n_bytes;
        if b.1.file_offset != a_end {
            let inside = tensors_in_gap(ck, &a.1.shard_path, a_end, b.1.file_offset);
            return Err(StreamError::Pack(format!(
                "layer {layer}: the trunk range has a hole at bytes {}..{} of {} ({} bytes, \
                 between {} and {}){}; copying it would drag non-trunk bytes into trunk.bin, so \
                 the pack is refused",
                a_end,
                b.1.file_offset,
                a.1.shard_path.display(),
                b.1.file_offset.saturating_sub(a_end),
                a.0.name,
                b.0.name,
                inside
            )));
        }
    }
    let source_offset = first.1.file_offset;
    let tensors = located
        .iter()
        .map(|(d, loc)| PackedTensor {
            name: d.name.clone(),
            role: role_name(d),
            dtype: d.dtype.as_str().to_string(),
            shape: d.shape.to_vec(),
            offset: loc.file_offset - source_offset,
            size: loc.n_bytes,
        })
        .collect::<Vec<_>>();
    let size = located
        .last()
        .map_or(0, |(_, l)| l.file_offset + l.n_bytes - source_offset);
    Ok(LayerSource {
        shard_path: first.1.shard_path.clone(),
        source_offset,
        size,
        tensors,
    })
}

/// Names of (up to three) tensors lying in a gap, for the refusal message.
fn tensors_in_gap(ck: &Checkpoint, shard: &Path, begin: u64, end: u64) -> String {
    let mut names: Vec<(u64, &str)> = ck
        .tensor_names()
        .filter_map(|n| {
            let l = ck.try_location(n)?;
            (l.shard_path == shard && l.file_offset < end && l.file_offset + l.n_bytes > begin)
                .then_some((l.file_offset, n))
        })
        .collect();
    names.sort();
    if names.is_empty() {
        return String::new();
    }
    let n = names.len();
    let shown: Vec<&str> = names.iter().take(3).map(|x| x.1).collect();
    format!(
        "; the gap holds {n} other tensor(s), e.g. {}",
        shown.join(", ")
    )
}

/// Build the manifest (no file written yet): every layer verified before anything is copied.
pub fn plan_pack(
    ck: &Checkpoint,
    spec: &ModelSpec,
) -> Result<(TrunkManifest, Vec<PathBuf>), StreamError> {
    let mut layers = Vec::with_capacity(spec.n_layers);
    let mut sources = Vec::with_capacity(spec.n_layers);
    let mut offset = 0u64;
    let mut fingerprints = ck.layer_fingerprints(spec).into_iter();
    for (l, decls) in trunk_decls_by_layer(spec).iter().enumerate() {
        let s = layer_source(ck, decls, l)?;
        layers.push(PackedLayer {
            layer: l,
            offset,
            size: s.size,
            source_shard: file_name(&s.shard_path),
            source_offset: s.source_offset,
            tensors: s.tensors,
            stored: None,
            source_fingerprint: fingerprints.next().flatten(),
        });
        offset = align_up(offset + s.size, IO_ALIGN as u64);
        sources.push(s.shard_path);
    }
    let mut globals = Vec::new();
    for d in spec.tensors.iter().filter(|t| t.layer.is_none()) {
        if let Some(loc) = ck.try_location(&d.name) {
            globals.push(GlobalTensor {
                name: d.name.clone(),
                role: role_name(d),
                dtype: d.dtype.as_str().to_string(),
                shape: d.shape.to_vec(),
                shard: file_name(&loc.shard_path),
                offset: loc.file_offset,
                size: loc.n_bytes,
            });
        }
    }
    let m = TrunkManifest {
        format: FORMAT.to_string(),
        version: VERSION,
        model: spec.name.clone(),
        n_layers: spec.n_layers,
        align: IO_ALIGN as u64,
        packed_bytes: layers.iter().map(|l| l.size).sum(),
        file_bytes: offset,
        layers,
        globals,
        compression: None,
    };
    Ok((m, sources))
}

/// Pack the trunk of the checkpoint in `model_dir` into `out_dir/trunk.bin` + `trunk.json`.
/// `progress` shows a progress bar on stderr (hidden anyway when stderr is not a terminal).
pub fn pack_trunk(
    model_dir: &Path,
    spec: &ModelSpec,
    out_dir: &Path,
    progress: bool,
) -> Result<PackReport, StreamError> {
    pack_trunk_with(model_dir, spec, out_dir, progress, None)
}

/// [`pack_trunk`], with `compress = Some(chunk_bytes)`: store every layer as compressed
/// records of `chunk_bytes`-byte chunks ([`super::compress`], whose `CHUNK_BYTES` the
/// command uses; trunk.json version 2). `chunk_bytes` must be a positive multiple of 4096.
pub fn pack_trunk_with(
    model_dir: &Path,
    spec: &ModelSpec,
    out_dir: &Path,
    progress: bool,
    compress: Option<u64>,
) -> Result<PackReport, StreamError> {
    if let Some(cb) = compress
        && (cb == 0 || !cb.is_multiple_of(IO_ALIGN as u64))
    {
        return Err(StreamError::Pack(format!(
            "compressed chunks of {cb} bytes: must be a positive multiple of {IO_ALIGN}"
        )));
    }
    let t0 = Instant::now();
    let ck = Checkpoint::open_with(
        model_dir,
        spec,
        &OpenOptions {
            validate_expert_scales: false,
        },
    )
    .map_err(|e| StreamError::Pack(e.to_string()))?;
    let (mut manifest, sources) = plan_pack(&ck, spec)?;
    drop(ck);

    std::fs::create_dir_all(out_dir).map_err(|e| StreamError::io("create", out_dir, e))?;
    let bin = out_dir.join(TRUNK_BIN);
    let json = out_dir.join(TRUNK_JSON);
    let bin_tmp = out_dir.join(format!("{TRUNK_BIN}{PARTIAL}"));
    let json_tmp = out_dir.join(format!("{TRUNK_JSON}{PARTIAL}"));
    for p in [&bin_tmp, &json_tmp] {
        remove_if_exists(p)?;
    }

    let bar = if progress {
        indicatif::ProgressBar::new(manifest.packed_bytes)
    } else {
        indicatif::ProgressBar::hidden()
    };
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{msg:>12} [{bar:40}] {bytes}/{total_bytes} ({bytes_per_sec}, {eta})",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }

    let out = File::create(&bin_tmp).map_err(|e| StreamError::io("create", &bin_tmp, e))?;
    let mut shards: HashMap<PathBuf, File> = HashMap::new();
    for src in &sources {
        if !shards.contains_key(src) {
            let f = File::open(src).map_err(|e| StreamError::io("open", src, e))?;
            shards.insert(src.clone(), f);
        }
    }
    if let Some(cb) = compress {
        write_compressed(&mut manifest, cb, &sources, &shards, &out, &bin_tmp, &bar)?;
    }
    let mut chunk = vec![0u8; 8 << 20];
    for (pl, src) in manifest.layers.iter().zip(&sources) {
        if compress.is_some() {
            break;
        }
        bar.set_message(format!("layer {}", pl.layer));
        let f = &shards[src];
        let mut done = 0u64;
        while done < pl.size {
            let n = ((pl.size - done) as usize).min(chunk.len());
            f.read_exact_at(&mut chunk[..n], pl.source_offset + done)
                .map_err(|e| StreamError::io("read", src, e))?;
            out.write_all_at(&chunk[..n], pl.offset + done)
                .map_err(|e| StreamError::io("write", &bin_tmp, e))?;
            done += n as u64;
            bar.inc(n as u64);
        }
    }
    // Padding after the last layer, so every layer (and the file) ends on the alignment.
    out.set_len(manifest.file_bytes)
        .map_err(|e| StreamError::io("extend", &bin_tmp, e))?;
    out.sync_all()
        .map_err(|e| StreamError::io("sync", &bin_tmp, e))?;
    drop(out);
    bar.finish_and_clear();

    let mut text = serde_json::to_string_pretty(&manifest)
        .map_err(|e| StreamError::Pack(format!("cannot serialise trunk.json: {e}")))?;
    text.push('\n');
    {
        let mut f = File::create(&json_tmp).map_err(|e| StreamError::io("create", &json_tmp, e))?;
        f.write_all(text.as_bytes())
            .map_err(|e| StreamError::io("write", &json_tmp, e))?;
        f.sync_all()
            .map_err(|e| StreamError::io("sync", &json_tmp, e))?;
    }
    // trunk.json marks a complete pack: remove any old one first, move the data into place,
    // then the manifest.
    remove_if_exists(&json)?;
    std::fs::rename(&bin_tmp, &bin).map_err(|e| StreamError::io("rename", &bin_tmp, e))?;
    std::fs::rename(&json_tmp, &json).map_err(|e| StreamError::io("rename", &json_tmp, e))?;
    if let Ok(d) = File::open(out_dir) {
        let _ = d.sync_all();
    }

    let (largest_layer, largest_layer_bytes) = manifest
        .layers
        .iter()
        .map(|l| (l.layer, l.size))
        .max_by_key(|&(i, s)| (s, std::cmp::Reverse(i)))
        .unwrap_or((0, 0));
    Ok(PackReport {
        trunk_bin: bin,
        trunk_json: json,
        n_layers: manifest.n_layers,
        packed_bytes: manifest.packed_bytes,
        file_bytes: manifest.file_bytes,
        largest_layer,
        largest_layer_bytes,
        min_slot_bytes: align_up(largest_layer_bytes, IO_ALIGN as u64),
        stored_bytes: manifest.compression.as_ref().map(|c| c.stored_bytes),
        seconds: t0.elapsed().as_secs_f64(),
    })
}

/// Write every layer of `m` as compressed chunk records into `out` (layers and records at
/// 4096-aligned offsets) and fill in the offsets, stored forms and file length. Chunks are
/// encoded in parallel, in batches; each chunk's record depends only on its bytes, so the
/// file is the same at any thread count.
fn write_compressed(
    m: &mut TrunkManifest,
    cb: u64,
    sources: &[PathBuf],
    shards: &HashMap<PathBuf, File>,
    out: &File,
    out_path: &Path,
    bar: &indicatif::ProgressBar,
) -> Result<(), StreamError> {
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, 16);
    let batch = threads * 4;
    let mut encoders: Vec<Encoder> = (0..threads).map(|_| Encoder::new()).collect();
    let mut records: Vec<(Vec<u8>, bool)> = Vec::new();
    let mut raw = Vec::new();
    let mut pos = 0u64;
    let mut stored_total = 0u64;
    for (pl, src) in m.layers.iter_mut().zip(sources) {
        bar.set_message(format!("layer {}", pl.layer));
        let f = &shards[src];
        pl.offset = pos;
        let n = pl.size.div_ceil(cb) as usize;
        let mut chunks = Vec::with_capacity(n);
        let mut end = 0u64; // end of the last record, from the layer's offset
        for first in (0..n).step_by(batch) {
            let k = batch.min(n - first);
            let start = first as u64 * cb;
            let len = (pl.size - start).min(k as u64 * cb) as usize;
            raw.resize(len, 0);
            f.read_exact_at(&mut raw, pl.source_offset + start)
                .map_err(|e| StreamError::io("read", src, e))?;
            records.resize_with(k, || (Vec::new(), false));
            let per = k.div_ceil(threads);
            let results: Vec<Result<(), StreamError>> = std::thread::scope(|sc| {
                let hs: Vec<_> = encoders
                    .iter_mut()
                    .zip(records.chunks_mut(per))
                    .enumerate()
                    .map(|(t, (enc, mine))| {
                        let raw = &raw;
                        sc.spawn(move || {
                            for (j, rec) in mine.iter_mut().enumerate() {
                                let a = (t * per + j) * cb as usize;
                                let piece = &raw[a..(a + cb as usize).min(raw.len())];
                                rec.1 = enc.encode(piece, &mut rec.0);
                            }
                            Ok::<(), StreamError>(())
                        })
                    })
                    .collect();
                hs.into_iter()
                    .map(|h| {
                        h.join().unwrap_or_else(|_| {
                            Err(StreamError::Pack("a compression thread panicked".into()))
                        })
                    })
                    .collect()
            });
            for r in results {
                r?;
            }
            for (rec, z) in &records {
                let at = align_up(end, IO_ALIGN as u64);
                out.write_all_at(rec, pos + at)
                    .map_err(|e| StreamError::io("write", out_path, e))?;
                chunks.push(StoredChunk {
                    at,
                    len: rec.len() as u64,
                    z: *z,
                });
                end = at + rec.len() as u64;
                stored_total += rec.len() as u64;
            }
            bar.inc(len as u64);
        }
        pl.stored = Some(StoredLayer { bytes: end, chunks });
        pos = align_up(pos + end, IO_ALIGN as u64);
    }
    m.file_bytes = pos;
    m.version = VERSION_COMPRESSED;
    m.compression = Some(Compression {
        codec: compress::CODEC.to_string(),
        chunk_bytes: cb,
        stored_bytes: stored_total,
    });
    Ok(())
}

fn remove_if_exists(p: &Path) -> Result<(), StreamError> {
    match std::fs::remove_file(p) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(StreamError::io("remove", p, e)),
    }
}

/// The `k3-run pack-trunk MODEL_DIR OUT_DIR` command body: pack with a progress bar (stderr);
/// the caller prints the report's summary line (stdout).
/// `compress`: `Some(chunk_bytes)` for a compressed pack.
pub fn run(
    model_dir: &Path,
    spec: &ModelSpec,
    out_dir: &Path,
    compress: Option<u64>,
) -> Result<PackReport, StreamError> {
    eprintln!(
        "pack-trunk: {} layers of {} from {} into {}{}",
        spec.n_layers,
        spec.name,
        model_dir.display(),
        out_dir.display(),
        if compress.is_some() {
            " (compressed: 4-bit codes for the bf16 sign/exponent bytes)"
        } else {
            ""
        }
    );
    pack_trunk_with(model_dir, spec, out_dir, true, compress)
}

impl TrunkManifest {
    /// Read `dir/trunk.json` and check it against `trunk.bin` and `spec`. Every refusal is a
    /// [`StreamError::TrunkManifest`] (exit 2).
    pub fn load(dir: &Path, spec: &ModelSpec) -> Result<Self, StreamError> {
        let json = dir.join(TRUNK_JSON);
        // A FIFO or device would be read forever (or block): only a regular file is read.
        if let Ok(meta) = std::fs::metadata(&json)
            && !meta.is_file()
        {
            return Err(StreamError::TrunkManifest {
                path: json.display().to_string(),
                msg: format!(
                    "{}, not a regular file",
                    crate::checkpoint::describe_file_type(meta.file_type())
                ),
            });
        }
        let text = std::fs::read(&json).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                StreamError::TrunkManifest {
                    path: dir.display().to_string(),
                    msg: format!(
                        "no {TRUNK_JSON}: not a packed trunk, or the pack did not finish (run \
                         `k3-run pack-trunk MODEL_DIR {}`)",
                        dir.display()
                    ),
                }
            } else {
                StreamError::TrunkManifest {
                    path: json.display().to_string(),
                    msg: format!("cannot read: {e}"),
                }
            }
        })?;
        let m: TrunkManifest =
            serde_json::from_slice(&text).map_err(|e| StreamError::TrunkManifest {
                path: json.display().to_string(),
                msg: e.to_string(),
            })?;
        let bin = dir.join(TRUNK_BIN);
        let meta = std::fs::metadata(&bin).map_err(|e| StreamError::TrunkManifest {
            path: bin.display().to_string(),
            msg: format!("cannot stat: {e}"),
        })?;
        if !meta.is_file() {
            return Err(StreamError::TrunkManifest {
                path: bin.display().to_string(),
                msg: format!(
                    "{}, not a regular file: a packed trunk's layers are read from a file \
                     (run `k3-run pack-trunk MODEL_DIR {}`)",
                    crate::checkpoint::describe_file_type(meta.file_type()),
                    dir.display()
                ),
            });
        }
        let len = meta.len();
        if len != m.file_bytes {
            return Err(StreamError::TrunkManifest {
                path: bin.display().to_string(),
                msg: format!(
                    "is {len} bytes but {TRUNK_JSON} records {}; the pack is incomplete or \
                     from another model: pack again",
                    m.file_bytes
                ),
            });
        }
        m.validate(spec).map_err(|msg| StreamError::TrunkManifest {
            path: json.display().to_string(),
            msg,
        })?;
        Ok(m)
    }

    /// Check the manifest against the spec: same layers, same tensors (name, role, dtype,
    /// shape), aligned non-overlapping layer ranges inside the file.
    pub fn validate(&self, spec: &ModelSpec) -> Result<(), String> {
        let version_ok = match &self.compression {
            None => self.version == VERSION,
            Some(_) => self.version == VERSION_COMPRESSED,
        };
        if self.format != FORMAT || !version_ok {
            return Err(format!(
                "format {:?} version {} ({}) is not {FORMAT:?} version {VERSION} (raw) or \
                 {VERSION_COMPRESSED} (compressed)",
                self.format,
                self.version,
                if self.compression.is_some() {
                    "compressed"
                } else {
                    "raw"
                }
            ));
        }
        if let Some(c) = &self.compression
            && (c.codec != compress::CODEC
                || c.chunk_bytes == 0
                || !c.chunk_bytes.is_multiple_of(IO_ALIGN as u64))
        {
            return Err(format!(
                "compression codec {:?} with {}-byte chunks: this build reads {:?} with \
                 chunks a multiple of {IO_ALIGN}",
                c.codec,
                c.chunk_bytes,
                compress::CODEC
            ));
        }
        if self.model != spec.name {
            return Err(format!(
                "model {:?}: packed for another model than {:?} (the manifest's name); pack \
                 again for this one",
                self.model, spec.name
            ));
        }
        // Under `--layers N` the spec binds the first N of the packed layers.
        let model_layers = spec.truncated_from.unwrap_or(spec.n_layers);
        if self.n_layers != model_layers || self.layers.len() != model_layers {
            return Err(format!(
                "packed {} layers ({} entries) but the model {} has {}",
                self.n_layers,
                self.layers.len(),
                spec.name,
                model_layers
            ));
        }
        if self.align == 0
            || !self.align.is_power_of_two()
            || !self.align.is_multiple_of(IO_ALIGN as u64)
        {
            return Err(format!(
                "align {} is not a multiple of {IO_ALIGN}",
                self.align
            ));
        }
        let mut end = 0u64;
        let by_layer = trunk_decls_by_layer(spec);
        for (i, pl) in self.layers.iter().enumerate() {
            if pl.layer != i {
                return Err(format!("entry {i} is for layer {}", pl.layer));
            }
            if !pl.offset.is_multiple_of(self.align) || pl.offset < end {
                return Err(format!(
                    "layer {i} at offset {} is not aligned to {} or overlaps the previous layer",
                    pl.offset, self.align
                ));
            }
            let disk = self.check_stored(i, pl)?;
            end = pl
                .offset
                .checked_add(disk)
                .filter(|&e| e <= self.file_bytes)
                .ok_or_else(|| {
                    format!(
                        "layer {i} ({}..+{}) runs past the end of trunk.bin ({} bytes)",
                        pl.offset, disk, self.file_bytes
                    )
                })?;
            if i >= spec.n_layers {
                continue; // not bound (`--layers N`): only its range is checked
            }
            let decls = &by_layer[i];
            if decls.len() != pl.tensors.len() {
                return Err(format!(
                    "layer {i} holds {} tensors but the model declares {}",
                    pl.tensors.len(),
                    decls.len()
                ));
            }
            let mut tend = 0u64;
            let mut seen = std::collections::HashSet::new();
            for t in &pl.tensors {
                if !seen.insert(t.name.as_str()) {
                    return Err(format!("layer {i}: tensor {} is listed twice", t.name));
                }
                let d = decls.iter().find(|d| d.name == t.name).ok_or_else(|| {
                    format!("layer {i}: tensor {} is not declared by the model", t.name)
                })?;
                if t.role != role_name(d)
                    || t.dtype != d.dtype.as_str()
                    || *t.shape != *d.shape
                    || t.size != d.n_bytes() as u64
                {
                    return Err(format!(
                        "layer {i}: tensor {} is {} {} {:?} ({} bytes) but the model declares \
                         {:?} {} {:?} ({} bytes)",
                        t.name,
                        t.role,
                        t.dtype,
                        t.shape,
                        t.size,
                        d.role,
                        d.dtype.as_str(),
                        d.shape,
                        d.n_bytes()
                    ));
                }
                let end = t.offset.checked_add(t.size).filter(|&e| e <= pl.size);
                let Some(end) = end.filter(|_| t.offset >= tend) else {
                    return Err(format!(
                        "layer {i}: tensor {} at {}..+{} overlaps another tensor or leaves the \
                         layer ({} bytes)",
                        t.name, t.offset, t.size, pl.size
                    ));
                };
                tend = end;
            }
            // pack-trunk copies one contiguous range from the first tensor to the end of the
            // last: the layer is exactly as long as that.
            if tend != pl.size {
                return Err(format!(
                    "layer {i}: size {} but its tensors end at +{tend}",
                    pl.size
                ));
            }
        }
        let sum: u64 = self
            .layers
            .iter()
            .try_fold(0u64, |a, l| a.checked_add(l.size))
            .unwrap_or(u64::MAX);
        if self.packed_bytes != sum {
            return Err(format!(
                "packed_bytes {} is not the sum of the layer sizes ({sum})",
                self.packed_bytes
            ));
        }
        if let Some(c) = &self.compression {
            let stored: u64 = self
                .layers
                .iter()
                .filter_map(|l| l.stored.as_ref())
                .flat_map(|s| s.chunks.iter())
                .try_fold(0u64, |a, ch| a.checked_add(ch.len))
                .unwrap_or(u64::MAX);
            if c.stored_bytes != stored {
                return Err(format!(
                    "compression.stored_bytes {} is not the sum of the layers' record \
                     lengths ({stored})",
                    c.stored_bytes
                ));
            }
        }
        Ok(())
    }

    /// The bytes layer `i` takes in trunk.bin (its raw size, or its records' extent), after
    /// checking that its stored form matches the manifest's compression: one record per
    /// chunk, at aligned, increasing, non-overlapping offsets, with plausible plane lengths.
    fn check_stored(&self, i: usize, pl: &PackedLayer) -> Result<u64, String> {
        let (c, s) = match (&self.compression, &pl.stored) {
            (None, None) => return Ok(pl.size),
            (Some(c), Some(s)) => (c, s),
            (None, Some(_)) => {
                return Err(format!(
                    "layer {i} has stored records but the pack is not compressed"
                ));
            }
            (Some(_), None) => return Err(format!("layer {i} has no stored records")),
        };
        let n = pl.size.div_ceil(c.chunk_bytes) as usize;
        if s.chunks.len() != n {
            return Err(format!(
                "layer {i}: {} records for {} bytes in {}-byte chunks (expected {n})",
                s.chunks.len(),
                pl.size,
                c.chunk_bytes
            ));
        }
        let mut end = 0u64;
        for (k, ch) in s.chunks.iter().enumerate() {
            let raw = compress::chunk_raw_len(pl.size, c.chunk_bytes, k);
            if !ch.at.is_multiple_of(IO_ALIGN as u64)
                || ch.at < end
                || !compress::plausible(raw, ch)
            {
                return Err(format!(
                    "layer {i}, chunk {k}: record at +{} ({} bytes, coded {}) is not \
                     aligned, overlaps the previous record, or has an impossible length",
                    ch.at, ch.len, ch.z
                ));
            }
            end = ch.at.checked_add(ch.len).ok_or_else(|| {
                format!(
                    "layer {i}, chunk {k}: record at +{} runs past any file",
                    ch.at
                )
            })?;
        }
        if end != s.bytes {
            return Err(format!(
                "layer {i}: records end at +{end} but the manifest records {}",
                s.bytes
            ));
        }
        Ok(s.bytes)
    }

    /// Whether the layers are stored compressed.
    pub fn is_compressed(&self) -> bool {
        self.compression.is_some()
    }

    /// Packed sizes in layer order (the planner's input).
    pub fn layer_sizes(&self) -> Vec<u64> {
        self.layers.iter().map(|l| l.size).collect()
    }
}
