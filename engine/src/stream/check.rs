//! `k3-run pack-trunk --check MODEL_DIR TRUNK_DIR`: is a packed trunk still byte for byte the
//! checkpoint's trunk?
//!
//! Owns: reading every layer of a packed trunk through the engine's own streaming path
//! ([`StreamedTrunk`] at two ring slots, O_DIRECT, compressed records decoded as a run decodes
//! them) and comparing every tensor it serves with the checkpoint's bytes of that tensor; a
//! progress bar over the layers' bytes; Ctrl-C between layers.
//! Must not: change either file. The trunk carries no checksum of its own (the engine checks
//! only sampled fingerprints at open, which catch a pack of other weights, not a flipped byte),
//! so this is the way to prove a trunk whose output is in doubt, or one on a disk that has
//! shown errors.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::Instant;

use k3_models::spec::ModelSpec;

use super::StreamError;
use super::aligned::AlignedBuf;
use super::direct::DirectFile;
use super::pack::TrunkManifest;
use super::trunk::{StreamedTrunk, TrunkOptions};
use crate::checkpoint::Checkpoint;
use crate::weights::TrunkSource;

/// At most this many differing tensors are named (a trunk of the wrong bytes would name
/// thousands).
const MAX_NAMED: usize = 20;

/// What `--check` found.
#[derive(Debug, Default)]
pub struct CheckReport {
    pub layers: usize,
    /// Layers compared whole (fewer than `layers` after Ctrl-C).
    pub layers_checked: usize,
    pub tensors_checked: usize,
    pub bytes_checked: u64,
    pub seconds: f64,
    /// Tensors whose bytes differ from the checkpoint's, and layers that could not be read:
    /// one line each (at most [`MAX_NAMED`]).
    pub problems: Vec<String>,
    /// All differing tensors and unreadable layers, named or not.
    pub n_problems: usize,
    /// Layers with a problem.
    pub bad_layers: Vec<usize>,
    pub interrupted: bool,
    pub compressed: bool,
}

/// Where two byte slices of equal length first differ.
fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    if a == b {
        return None; // memcmp: the common case, fast
    }
    a.iter().zip(b).position(|(x, y)| x != y)
}

/// Compare every layer of the packed trunk in `trunk_dir` with the checkpoint. A trunk that
/// cannot be opened at all (no trunk.json, another model, other weights by its fingerprints)
/// is an error as for a run (exit 2); a checkpoint that cannot be opened (a missing, truncated
/// or malformed index or shard) is [`StreamError::Pack`], as in `pack-trunk` and a run (exit 1).
pub fn check_trunk(
    model_dir: &Path,
    spec: &ModelSpec,
    trunk_dir: &Path,
    stop: &AtomicBool,
    progress: bool,
) -> Result<CheckReport, StreamError> {
    let started = Instant::now();
    let ck = Checkpoint::open(model_dir, spec).map_err(|e| StreamError::Pack(e.to_string()))?;
    let manifest = TrunkManifest::load(trunk_dir, spec)?;
    let largest = manifest.layer_sizes().into_iter().max().unwrap_or(0);
    let total: u64 = manifest.layers.iter().map(|l| l.size).sum();
    // two ring slots: the next layer is read while this one is compared
    let slot = largest.div_ceil(4096) * 4096;
    let opts = TrunkOptions {
        budget_bytes: 2 * slot,
        ring_slots: 2,
        preload_pinned: false,
        ..TrunkOptions::default()
    };
    // a pack of other weights is named as a run names it (exit 2), before any byte is read
    let mut notes = Vec::new();
    crate::session::check_trunk_source(trunk_dir, spec, &ck, &mut notes)?;
    for n in &notes {
        eprintln!("{n}");
    }
    let mut trunk = StreamedTrunk::open(trunk_dir, spec, &opts)?;
    let n = manifest.layers.len().min(spec.n_layers);
    let mut r = CheckReport {
        layers: n,
        compressed: manifest.is_compressed(),
        ..CheckReport::default()
    };
    let bar = crate::bytes_bar(total, progress, "checking");
    // The checkpoint's side of each layer is read by a helper with O_DIRECT, up to `AHEAD`
    // layers before the one compared (through the mapping, page faults ran at ~0.5 GB/s on
    // k3-mini; a helper faulting the mapping in ahead, 0.6 GB/s).
    let spans: Vec<Option<(usize, u64, u64)>> = manifest.layers[..n]
        .iter()
        .map(|pl| source_span(&ck, pl))
        .collect();
    let (free_tx, free_rx) = mpsc::channel::<Option<AlignedBuf>>();
    let (full_tx, full_rx) = mpsc::channel::<Option<Result<Source, String>>>();
    for _ in 0..AHEAD + 1 {
        let _ = free_tx.send(None);
    }
    std::thread::scope(|sc| {
        let ck = &ck;
        let spans = &spans;
        sc.spawn(move || read_sources(ck, spans, &free_rx, &full_tx, stop));
        for l in 0..n {
            if stop.load(Ordering::Relaxed) {
                r.interrupted = true;
                break;
            }
            let src = full_rx.recv().ok().flatten();
            let (src, problem) = match src {
                Some(Ok(s)) => (Some(s), None),
                Some(Err(e)) => (None, Some(e)),
                None => (None, None),
            };
            if let Some(e) = problem {
                r.n_problems += 1;
                r.bad_layers.push(l);
                if r.problems.len() < MAX_NAMED {
                    r.problems
                        .push(format!("layer {l}: the checkpoint's bytes: {e}"));
                }
            } else {
                compare_layer(&mut trunk, ck, src.as_ref(), l, &mut r);
            }
            let _ = free_tx.send(src.map(|s| s.buf));
            r.layers_checked += 1;
            bar.inc(manifest.layers[l].size);
        }
        // the reader ends: no more buffers coming back
        drop(free_tx);
        drop(full_rx);
    });
    bar.finish_and_clear();
    r.seconds = started.elapsed().as_secs_f64();
    Ok(r)
}

/// Layers read ahead of the one compared, on the checkpoint's side.
const AHEAD: usize = 2;

/// One layer's checkpoint bytes: `buf[lead..lead + len]` holds shard `shard` from offset `lo`.
struct Source {
    buf: AlignedBuf,
    lead: usize,
    shard: usize,
    lo: u64,
    len: usize,
}

/// A packed layer's tensors' span in one shard of the checkpoint (from the checkpoint's own
/// table): (shard, first byte, end); `None` when they are not all in one shard (then that
/// layer is compared through the mapping).
fn source_span(ck: &Checkpoint, pl: &super::pack::PackedLayer) -> Option<(usize, u64, u64)> {
    let mut span: Option<(usize, u64, u64)> = None;
    for t in &pl.tensors {
        let (sh, off, len) = ck.shard_span(&t.name)?;
        span = match span {
            None => Some((sh, off, off + len)),
            Some((s, lo, hi)) if s == sh => Some((s, lo.min(off), hi.max(off + len))),
            Some(_) => return None,
        };
    }
    span
}

/// Read each layer's checkpoint span into a buffer that came back on `free` (grown when too
/// small) and send it on `full`, in layer order; `None` for a layer without a span. Ends when
/// no buffer comes back, the comparison stops receiving, or on Ctrl-C.
fn read_sources(
    ck: &Checkpoint,
    spans: &[Option<(usize, u64, u64)>],
    free: &mpsc::Receiver<Option<AlignedBuf>>,
    full: &mpsc::Sender<Option<Result<Source, String>>>,
    stop: &AtomicBool,
) {
    let mut files: Vec<Option<DirectFile>> = ck.shards().iter().map(|_| None).collect();
    for span in spans {
        let Ok(buf) = free.recv() else { return };
        if stop.load(Ordering::Relaxed) {
            return;
        }
        let msg = span.map(|(shard, lo, hi)| {
            let path = &ck.shards()[shard].path;
            if files[shard].is_none() {
                files[shard] = Some(DirectFile::open(path, true).map_err(|e| e.to_string())?);
            }
            let f = files[shard].as_ref().expect("opened above");
            let len = (hi - lo) as usize;
            let need = f.span(lo, len).len;
            let mut buf = match buf {
                Some(b) if b.capacity() >= need => b,
                _ => AlignedBuf::new(need)
                    .map_err(|e| format!("cannot allocate a read buffer: {e}"))?,
            };
            let lead = f
                .read_into(lo, len, buf.full_mut())
                .map_err(|e| e.to_string())?;
            Ok(Source {
                buf,
                lead,
                shard,
                lo,
                len,
            })
        });
        if full.send(msg).is_err() {
            return;
        }
    }
}

/// The checkpoint's bytes of tensor `name`: from the layer's read span when it holds them,
/// else through the mapping.
fn want_bytes<'a>(ck: &'a Checkpoint, src: Option<&'a Source>, name: &str) -> Option<&'a [u8]> {
    if let (Some(s), Some((sh, off, len))) = (src, ck.shard_span(name))
        && sh == s.shard
        && off >= s.lo
        && off + len <= s.lo + s.len as u64
    {
        let at = s.lead + (off - s.lo) as usize;
        return Some(&s.buf.full()[at..at + len as usize]);
    }
    ck.try_bytes(name)
}

/// Compare layer `l` as the trunk serves it with the checkpoint, tensor by tensor, into `r`.
fn compare_layer(
    trunk: &mut StreamedTrunk,
    ck: &Checkpoint,
    src: Option<&Source>,
    l: usize,
    r: &mut CheckReport,
) {
    let mut bad = false;
    match trunk.layer(l) {
        Ok(lw) => {
            for t in &lw.tensors {
                let name = t.decl.name.as_str();
                let problem = match want_bytes(ck, src, name) {
                    None => Some(format!(
                        "layer {l}: {name} is served by the trunk but not in the checkpoint"
                    )),
                    Some(want) if want.len() != t.bytes.len() => Some(format!(
                        "layer {l}: {name}: {} bytes in the trunk, {} in the checkpoint",
                        t.bytes.len(),
                        want.len()
                    )),
                    Some(want) => first_difference(t.bytes, want).map(|at| {
                        format!(
                            "layer {l}: {name} differs from the checkpoint at byte {at} of {} \
                             (0x{:02x} in the trunk, 0x{:02x} in the checkpoint)",
                            want.len(),
                            t.bytes[at],
                            want[at]
                        )
                    }),
                };
                r.tensors_checked += 1;
                r.bytes_checked += t.bytes.len() as u64;
                if let Some(p) = problem {
                    bad = true;
                    r.n_problems += 1;
                    if r.problems.len() < MAX_NAMED {
                        r.problems.push(p);
                    }
                }
            }
        }
        Err(e) => {
            bad = true;
            r.n_problems += 1;
            if r.problems.len() < MAX_NAMED {
                r.problems.push(format!("layer {l}: cannot be read: {e}"));
            }
        }
    }
    if bad {
        r.bad_layers.push(l);
    }
}

#[cfg(test)]
mod tests {
    use super::first_difference;

    #[test]
    fn first_difference_finds_the_first_byte() {
        assert_eq!(first_difference(b"abc", b"abc"), None);
        assert_eq!(first_difference(b"abc", b"abd"), Some(2));
        assert_eq!(first_difference(b"xbc", b"abd"), Some(0));
        assert_eq!(first_difference(b"", b""), None);
    }
}
