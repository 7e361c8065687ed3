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
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Instant;

use k3_models::spec::ModelSpec;

use super::StreamError;
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
/// is an error as for a run (exit 2).
pub fn check_trunk(
    model_dir: &Path,
    spec: &ModelSpec,
    trunk_dir: &Path,
    stop: &AtomicBool,
    progress: bool,
) -> Result<CheckReport, StreamError> {
    let started = Instant::now();
    let ck = Checkpoint::open(model_dir, spec).map_err(|e| StreamError::Config(e.to_string()))?;
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
    // The checkpoint's side of each layer is read ahead by a helper (its pages faulted in
    // through the mapping, up to `AHEAD` layers before the one compared): page faults one at a
    // time ran at ~0.5 GB/s on k3-mini.
    let ranges: Vec<Option<(usize, usize)>> = manifest.layers[..n]
        .iter()
        .map(|pl| source_range(&ck, pl))
        .collect();
    let compared = AtomicUsize::new(0);
    let finished = AtomicBool::new(false);
    std::thread::scope(|sc| {
        sc.spawn(|| read_ahead(&ranges, &compared, &finished, stop));
        for l in 0..n {
            if stop.load(Ordering::Relaxed) {
                r.interrupted = true;
                break;
            }
            compare_layer(&mut trunk, &ck, l, &mut r);
            r.layers_checked += 1;
            compared.store(l + 1, Ordering::Relaxed);
            bar.inc(manifest.layers[l].size);
        }
        finished.store(true, Ordering::Relaxed);
    });
    bar.finish_and_clear();
    r.seconds = started.elapsed().as_secs_f64();
    Ok(r)
}

/// Layers read ahead of the one compared, on the checkpoint's side.
const AHEAD: usize = 2;

/// The checkpoint bytes of a packed layer: its tensors' span in the shard's mapping.
fn source_range(ck: &Checkpoint, pl: &super::pack::PackedLayer) -> Option<(usize, usize)> {
    let mut lo = usize::MAX;
    let mut hi = 0usize;
    for t in &pl.tensors {
        let b = ck.try_bytes(&t.name)?;
        lo = lo.min(b.as_ptr() as usize);
        hi = hi.max(b.as_ptr() as usize + b.len());
    }
    (hi > lo).then_some((lo, hi - lo))
}

/// Fault in each layer's checkpoint range in 4 MiB pieces, at most [`AHEAD`] layers ahead of
/// `compared`; ends when the comparison has `finished` or on Ctrl-C. Only a hint: a piece the
/// kernel refuses is read by the comparison's own faults.
fn read_ahead(
    ranges: &[Option<(usize, usize)>],
    compared: &AtomicUsize,
    finished: &AtomicBool,
    stop: &AtomicBool,
) {
    const PIECE: usize = 4 << 20;
    for (k, r) in ranges.iter().enumerate() {
        while k > compared.load(Ordering::Relaxed) + AHEAD {
            if finished.load(Ordering::Relaxed) || stop.load(Ordering::Relaxed) {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let Some((addr, len)) = *r else { continue };
        for off in (0..len).step_by(PIECE) {
            if finished.load(Ordering::Relaxed) || stop.load(Ordering::Relaxed) {
                return;
            }
            let _ = super::trunk::populate_read(addr + off, PIECE.min(len - off), false);
        }
    }
}

/// Compare layer `l` as the trunk serves it with the checkpoint, tensor by tensor, into `r`.
fn compare_layer(trunk: &mut StreamedTrunk, ck: &Checkpoint, l: usize, r: &mut CheckReport) {
    let mut bad = false;
    match trunk.layer(l) {
        Ok(lw) => {
            for t in &lw.tensors {
                let name = t.decl.name.as_str();
                let problem = match ck.try_bytes(name) {
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
