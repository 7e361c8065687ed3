//! Packing: find each layer's contiguous range in its shard (a hole is refused, naming what
//! lies in it), copy it to its aligned offset in `trunk.bin` (or write compressed records),
//! and write `trunk.json`, under temporary names renamed at the end.

use super::*;

pub(super) fn role_name(d: &TensorDecl) -> String {
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
            crate::platform::read_exact_at(f, &mut chunk[..n], pl.source_offset + done)
                .map_err(|e| StreamError::io("read", src, e))?;
            crate::platform::write_all_at(&out, &chunk[..n], pl.offset + done)
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
            crate::platform::read_exact_at(f, &mut raw, pl.source_offset + start)
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
                crate::platform::write_all_at(out, rec, pos + at)
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
