//! Checkpoint directories laid out like the released Kimi K3: sharded safetensors plus
//! `model.safetensors.index.json` (or a single `model.safetensors`).
//!
//! Owns: finding the shards, reading and checking every shard header *without reading tensor
//! data*, checking the checkpoint against a [`ModelSpec`] (every declared tensor present with
//! exactly its dtype and shape, nothing unexpected), the two payload checks the spec demands
//! (E8M0 scale byte 0xFF is NaN and rejected; `A_log` padding entries must be 0), and access to
//! tensor bytes through one read-only `mmap` per shard, plus absolute file locations for the
//! O_DIRECT streaming reader and the trunk packer. Must not: decode weights beyond exact
//! widening, decide what is resident, or panic on any file content.
//!
//! Follows upstream: the HF sharded-checkpoint convention (`weight_map` name -> shard file),
//! safetensors 0.8 headers (see [`header`]), K3 names under `language_model.` (see
//! `docs/MODEL.md` §3) and docs/NUMERICS.md §3 (A_log padding, E8M0 0xFF).
//!
//! Namespace rule: every tensor must be declared by the spec unless its name starts with one of
//! the spec's `ignored_tensor_prefixes` (for K3 the manifest lists `vision_tower.` and
//! `mm_projector.`: the MoonViT tower and projector a text-only engine does not use). Ignored
//! tensors' headers are range-checked like any other, but they are not required, not bound
//! and not reported as unexpected. A shard the index names may be missing when every tensor
//! the index maps to it is ignored (a partial shard set: `--layers N` ignores the names of the
//! layers it does not bind).
//!
//! When payload checks run: `A_log` padding is always checked at open (69 tiny tensors in K3).
//! E8M0 scales are checked when they are read. A resident load reads them at open
//! ([`OpenOptions::validate_expert_scales`], the default of [`Checkpoint::open`]); the
//! streaming path opens with it off and calls [`check_e8m0`] on each expert it reads from disk
//! (or [`Checkpoint::validate_expert_scales`] when it reads through the mmap).
//!
//! The mmaps assume the files are not modified while the checkpoint is open (a file truncated
//! underneath a live mapping faults on access, as with every mmap reader).
//!
//! Files: this one opens a checkpoint (shards found, headers read, files mapped); `index.rs`
//! reads the index; `names.rs` is the name table; `validate.rs` checks against the spec and
//! the payload rules; `access.rs` serves names, locations and bytes; `fingerprint.rs` hashes
//! sampled weights; [`header`] parses a shard header; [`error`] says what is wrong.

mod access;
pub mod error;
mod fingerprint;
pub mod header;
mod index;
mod names;
mod validate;

use index::*;
pub use index::{IndexMap, read_index_with_total};
pub use names::TensorNames;
use names::*;
use validate::*;
pub use validate::{check_e8m0, e8m0_nan_at};

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fs::File;
use std::hash::BuildHasher;
use std::path::{Path, PathBuf};

use k3_models::spec::{DType, ModelSpec, Shape, TensorDecl, TensorRole};
use memmap2::Mmap;

/// A shard name an index or manifest may point at: a file directly in the checkpoint
/// directory (not empty, no path separator, not `.` or `..`), with no control or invisible
/// character (it is shown in messages; see [`error::needs_escape`]).
pub fn is_plain_file_name(name: &str) -> bool {
    !name.is_empty()
        && !name.contains(['/', '\\'])
        && name != "."
        && name != ".."
        && !name.chars().any(error::needs_escape)
}

pub use error::CheckpointError;
pub use header::{HeaderEntry, MAX_HEADER_BYTES, ShardHeader};

/// File name of the shard index.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// File name of an unsharded checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";

/// Where one tensor's bytes live on disk (absolute file offsets).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorLocation {
    pub shard_path: PathBuf,
    pub file_offset: u64,
    pub n_bytes: u64,
}

/// One open shard.
#[derive(Debug)]
pub struct Shard {
    pub path: PathBuf,
    pub file_len: u64,
    /// Absolute offset of the data section.
    pub data_start: u64,
    mmap: Mmap,
}

/// Threads of the open-time expert scale check ([`Checkpoint::check_all_scales`]): reads at
/// queue depth 8, like the expert store's pool.
pub const SCALE_CHECK_THREADS: usize = 8;

/// Options of [`Checkpoint::open_with`].
#[derive(Clone, Copy, Debug)]
pub struct OpenOptions {
    /// Read every routed-expert `weight_scale` tensor at open and reject 0xFF bytes. Right for
    /// resident loads; the streaming path turns it off and checks each expert as it reads it.
    pub validate_expert_scales: bool,
}

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            validate_expert_scales: true,
        }
    }
}

/// An opened, validated checkpoint.
pub struct Checkpoint {
    dir: PathBuf,
    shards: Vec<Shard>,
    table: Table,
    /// Every routed-expert scale was checked at open ([`OpenOptions::validate_expert_scales`]).
    scales_checked: bool,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("dir", &self.dir)
            .field("n_shards", &self.shards.len())
            .field("n_tensors", &self.table.len())
            .finish()
    }
}

fn io_err(file: &Path, what: &'static str, source: std::io::Error) -> CheckpointError {
    CheckpointError::Io {
        file: file.to_path_buf(),
        what,
        source,
    }
}

pub use k3_models::load::describe_file_type;

/// `madvise(MADV_WILLNEED)` over the pages of `bytes`, a slice of a checkpoint mapping
/// ([`Checkpoint::try_bytes`]): the kernel starts reading the ones not in the page cache and
/// returns without waiting, so several tensors' reads are in flight together before the first
/// fault on them, and a fault on a page already read or in flight does not read the kernel's
/// read-around window (the device's `read_ahead_kb`, often several MiB) around it. Advice
/// only: never changes the bytes, and a refusal is ignored. Sound for any slice (on anonymous
/// memory the advice and the residency check do nothing harmful), useful only on a mapping.
pub fn advise_willneed(bytes: &[u8]) {
    if bytes.is_empty() {
        return;
    }
    let page = crate::platform::page_size();
    let addr = bytes.as_ptr() as usize;
    let start = addr & !(page - 1);
    let last = (addr + bytes.len() - 1) & !(page - 1);
    let len = addr + bytes.len() - start;
    // The advice walks every page of the range in the page cache (~50 ns a page here): when
    // the second and the second-to-last page are cached, take the tensor as read and skip it,
    // so a warm run does not pay for the walk. Not the first and last: tensors are not
    // page-aligned, and those pages are shared with the neighbours, which may have been read
    // without this one.
    let cached = |p: usize| {
        let mut v = 0u8;
        // SAFETY: `p` is a page of the mapping `bytes` lies in (see below); mincore writes one
        // byte per page of the one-page range into `v`.
        let r = unsafe { crate::platform::resident_pages(p, page, std::slice::from_mut(&mut v)) };
        r.is_ok() && v & 1 == 1
    };
    if last >= start + 2 * page && cached(start + page) && cached(last - page) {
        return;
    }
    // SAFETY: [start, start + len) lies inside the mapping `bytes` was taken from (mappings
    // begin on a page boundary, and `start` is `bytes`' first page); MADV_WILLNEED does not
    // change the memory's contents or validity.
    let _ =
        unsafe { crate::platform::advise_memory(start, len, crate::platform::MemAdvice::WillNeed) };
}

fn map_shard(header: &ShardHeader) -> Result<Mmap, CheckpointError> {
    let file = File::open(&header.path).map_err(|e| io_err(&header.path, "open shard", e))?;
    // SAFETY: the mapping is read-only and private to this process; the checkpoint contract
    // (module doc) is that shard files are not modified while open. Every slice taken from it
    // is bounds-checked against the length validated in `read_shard_header`.
    let mmap = unsafe { Mmap::map(&file) }.map_err(|e| io_err(&header.path, "mmap shard", e))?;
    if (mmap.len() as u64) < header.file_len {
        return Err(CheckpointError::Truncated {
            file: header.path.clone(),
            tensor: header
                .entries
                .last()
                .map_or_else(String::new, |e| e.name.clone()),
            expected_len: header.file_len,
            actual_len: mmap.len() as u64,
        });
    }
    Ok(mmap)
}

impl Checkpoint {
    /// Open `dir` for a resident load: headers, spec and `A_log` checks, and every expert
    /// scale checked for 0xFF.
    pub fn open(dir: &Path, spec: &ModelSpec) -> Result<Checkpoint, CheckpointError> {
        Self::open_with(dir, spec, &OpenOptions::default())
    }

    /// Open `dir` with explicit options (see [`OpenOptions`]).
    pub fn open_with(
        dir: &Path,
        spec: &ModelSpec,
        opts: &OpenOptions,
    ) -> Result<Checkpoint, CheckpointError> {
        Self::open_files(dir, Some(spec))?.checked(spec, opts)
    }

    /// The model checks of [`Checkpoint::open_with`] on files already opened by
    /// [`Checkpoint::open_unchecked`] (which opened every shard: the same files `open_with`
    /// would open), so a caller that looked at the headers first does not parse them twice.
    pub fn checked(
        self,
        spec: &ModelSpec,
        opts: &OpenOptions,
    ) -> Result<Checkpoint, CheckpointError> {
        let mut ck = self;
        ck.check_against_spec(spec)?;
        ck.check_a_log(spec)?;
        if opts.validate_expert_scales {
            ck.check_all_scales(spec)?;
            ck.scales_checked = true;
        }
        Ok(ck)
    }

    /// Open `dir` checking only the files (index, headers, ranges), not a model. For tools
    /// that inspect a checkpoint before a spec exists.
    pub fn open_unchecked(dir: &Path) -> Result<Checkpoint, CheckpointError> {
        Self::open_files(dir, None)
    }

    /// The files of `dir`. With a spec, a shard the index names may be missing when every
    /// tensor the index maps to it is one the spec ignores (a partial shard set under
    /// `--layers N`); it is then not opened at all.
    fn open_files(dir: &Path, spec: Option<&ModelSpec>) -> Result<Checkpoint, CheckpointError> {
        let index_path = dir.join(INDEX_FILE);
        let single = dir.join(SINGLE_FILE);
        // An index (else a single file) that is there but no regular file is said so, not
        // reported as "no checkpoint".
        for p in [&index_path, &single] {
            match shard_kind(p) {
                ShardKind::Regular => break,
                ShardKind::Missing => {}
                ShardKind::Other(what) => {
                    return Err(CheckpointError::NotRegular {
                        file: p.clone(),
                        what,
                    });
                }
            }
        }
        let index = if index_path.is_file() {
            Some(read_index(&index_path)?)
        } else if single.is_file() {
            None
        } else {
            return Err(CheckpointError::NoCheckpoint {
                dir: dir.to_path_buf(),
            });
        };
        // Shard file names in sorted order, each with the tensors the index maps to it (as
        // positions in the index, in index order).
        let mut by_file: BTreeMap<&str, Vec<u32>> = BTreeMap::new();
        match &index {
            Some(map) => {
                let mut per_file: Vec<Vec<u32>> = vec![Vec::new(); map.files.len()];
                for (i, &f) in (0u32..).zip(&map.file_of) {
                    per_file[f as usize].push(i);
                }
                // A file all of whose names were mapped again to another file is not named.
                by_file.extend(
                    map.files
                        .iter()
                        .map(String::as_str)
                        .zip(per_file)
                        .filter(|(_, names)| !names.is_empty()),
                );
            }
            None => {
                by_file.insert(SINGLE_FILE, Vec::new());
            }
        }
        let name_of = |i: &u32| index.as_ref().map_or("", |m| m.name(*i as usize));
        let mut shards = Vec::with_capacity(by_file.len());
        let mut table = Table::default();
        if let Some(map) = &index {
            table.entry_of = vec![NO_ENTRY; map.len()];
            table.entries.reserve_exact(map.len());
            table.name_of.reserve_exact(map.len());
        }
        // Positions in the index of a shard's header entries.
        let mut positions: Vec<u32> = Vec::new();
        // Every shard the index names must exist before any header is judged, so an index
        // pointing at a missing file is reported as that, not as a mismatch elsewhere.
        let not_needed = |names: &[u32]| {
            spec.is_some_and(|sp| {
                !names.is_empty() && names.iter().all(|n| is_ignored(sp, name_of(n)))
            })
        };
        by_file.retain(|file_name, names| dir.join(file_name).is_file() || !not_needed(names));
        for (file_name, names) in &by_file {
            let path = dir.join(file_name);
            // The first of the shard's tensors by name.
            let tensor = names
                .iter()
                .map(name_of)
                .min()
                .map_or_else(String::new, str::to_string);
            match shard_kind(&path) {
                ShardKind::Regular => {}
                ShardKind::Missing => {
                    return Err(CheckpointError::MissingShard {
                        file: path,
                        index: index_path.clone(),
                        tensor,
                        n_tensors: names.len(),
                    });
                }
                ShardKind::Other(what) => {
                    return Err(CheckpointError::ShardNotRegular {
                        file: path,
                        index: index_path.clone(),
                        what,
                        tensor,
                        n_tensors: names.len(),
                    });
                }
            }
        }
        for (file_name, names) in &by_file {
            let path = dir.join(file_name);
            let header = header::read_shard_header(&path)?;
            positions.clear();
            if let Some(map) = &index {
                cross_check_index(&header, &index_path, map, file_name, names, &mut positions)?;
            }
            let shard_idx = shards.len();
            let mmap = map_shard(&header)?;
            shards.push(Shard {
                path,
                file_len: header.file_len,
                data_start: header.data_start,
                mmap,
            });
            let shard = u32::try_from(shard_idx).expect("invariant: fewer than 2^32 shards");
            table.entries.reserve(header.entries.len());
            for (k, e) in header.entries.iter().enumerate() {
                table.push(
                    &e.name,
                    positions.get(k).copied(),
                    Entry {
                        begin: e.begin,
                        end: e.end,
                        shape: Shape::from_slice(&e.shape),
                        shard,
                        dtype: header::dtype_id(e.dtype)
                            .expect("invariant: header entries hold canonical dtypes"),
                    },
                );
            }
        }
        // The table's names are the index's (with an index, the entries' positions are
        // positions in it); the rest of the index is freed.
        drop(by_file);
        if let Some(map) = index {
            table.names = map.names;
        }
        if let Some(dup) = table.duplicate() {
            // Only reachable with an index whose cross-check passed for two shards holding
            // the same name, which a JSON map cannot express; kept as an error, not a panic.
            let tensor = dup.to_string();
            return Err(CheckpointError::NotInIndex {
                file: table
                    .get(&tensor)
                    .map_or_else(|| dir.to_path_buf(), |e| shards[e.shard()].path.clone()),
                index: index_path,
                tensor,
            });
        }
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            shards,
            table,
            scales_checked: false,
        })
    }

    fn index_or_dir(&self) -> PathBuf {
        let idx = self.dir.join(INDEX_FILE);
        if idx.is_file() {
            idx
        } else {
            self.dir.join(SINGLE_FILE)
        }
    }
}
