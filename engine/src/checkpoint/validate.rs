//! Checking a checkpoint against its spec: every declared tensor present with its dtype and
//! shape, nothing unexpected, `A_log` padding zero, no E8M0 scale byte 0xFF.

use super::*;

/// Reject any 0xFF byte in an E8M0 scale tensor read by the caller (streaming path).
pub fn check_e8m0(file: &Path, tensor: &str, bytes: &[u8]) -> Result<(), CheckpointError> {
    match e8m0_nan_at(bytes) {
        None => Ok(()),
        Some(index) => Err(CheckpointError::E8m0Nan {
            file: file.to_path_buf(),
            tensor: tensor.to_string(),
            index,
        }),
    }
}

/// Index of the first 0xFF (NaN) byte of an E8M0 scale tensor, if any. SIMD byte search: every
/// streamed expert's scales are checked on each read (k3-mini: 17.7 MB per token; a byte loop
/// took ~2% of the pinned-trunk decode's samples).
pub fn e8m0_nan_at(bytes: &[u8]) -> Option<usize> {
    memchr::memchr(0xFF, bytes)
}

pub(super) fn is_scale_role(role: TensorRole) -> bool {
    matches!(
        role,
        TensorRole::ExpertW1Scale | TensorRole::ExpertW2Scale | TensorRole::ExpertW3Scale
    )
}

pub(super) fn is_ignored(spec: &ModelSpec, name: &str) -> bool {
    spec.ignored_tensor_prefixes
        .iter()
        .any(|p| name.starts_with(p.as_str()))
}

impl Checkpoint {
    /// Every declared tensor present with its dtype and shape; nothing undeclared. A missing
    /// tensor is reported before a wrong dtype or shape. One lookup per declared tensor (the
    /// release declares ~500,000).
    pub(super) fn check_against_spec(&self, spec: &ModelSpec) -> Result<(), CheckpointError> {
        let mut missing: Vec<&TensorDecl> = Vec::new();
        let mut wrong: Option<CheckpointError> = None;
        for d in &spec.tensors {
            let Some(e) = self.table.get(&d.name) else {
                missing.push(d);
                continue;
            };
            if wrong.is_none() {
                wrong = self.wrong_dtype_or_shape(spec, d, e);
            }
        }
        if let Some(first) = missing.first() {
            return Err(CheckpointError::MissingTensor {
                file: self.index_or_dir(),
                model: spec.name.clone(),
                tensor: first.name.clone(),
                more: missing.len() - 1,
            });
        }
        if let Some(e) = wrong {
            return Err(e);
        }
        // Every declared tensor is present and names are unique, so the checkpoint holds no
        // undeclared tensor exactly when it holds as many tensors the manifest does not
        // ignore as the spec declares (ignored ones not counted): the names are only
        // compared one by one when the counts differ.
        let kept = |n: &&str| !is_ignored(spec, n);
        let declared_kept = spec
            .tensors
            .iter()
            .filter(|d| kept(&d.name.as_str()))
            .count();
        if self.table.names().filter(kept).count() == declared_kept {
            return Ok(());
        }
        let declared: hashbrown::HashSet<&str> =
            spec.tensors.iter().map(|d| d.name.as_str()).collect();
        let unexpected: Vec<&str> = self
            .table
            .names()
            .filter(|n| kept(n) && !declared.contains(n))
            .collect();
        if let Some(first) = unexpected.first() {
            return Err(CheckpointError::UnexpectedTensor {
                file: self.path_of(first),
                model: spec.name.clone(),
                tensor: first.to_string(),
                more: unexpected.len() - 1,
            });
        }
        Ok(())
    }

    /// The error for a present tensor whose dtype or shape is not the declared one.
    pub(super) fn wrong_dtype_or_shape(
        &self,
        spec: &ModelSpec,
        d: &TensorDecl,
        e: &Entry,
    ) -> Option<CheckpointError> {
        let file = || self.shards[e.shard()].path.clone();
        if e.dtype() != d.dtype.as_str() {
            return Some(CheckpointError::WrongDtype {
                file: file(),
                tensor: d.name.clone(),
                expected: d.dtype.as_str().to_string(),
                found: e.dtype().to_string(),
            });
        }
        if *e.shape == *d.shape {
            return None;
        }
        Some(match (d.role, spec.kda.as_ref()) {
            (TensorRole::KdaALog, Some(k)) => CheckpointError::ALogShape {
                file: file(),
                tensor: d.name.clone(),
                expected: d.shape.to_vec(),
                found: e.shape.to_vec(),
                n_heads: k.n_heads,
            },
            _ => CheckpointError::WrongShape {
                file: file(),
                tensor: d.name.clone(),
                expected: d.shape.to_vec(),
                found: e.shape.to_vec(),
            },
        })
    }

    pub(super) fn check_a_log(&self, spec: &ModelSpec) -> Result<(), CheckpointError> {
        let Some(kda) = &spec.kda else {
            return Ok(());
        };
        for d in spec
            .tensors
            .iter()
            .filter(|d| d.role == TensorRole::KdaALog)
        {
            let vals = self.f32_vec_pread(d)?;
            if let Some((index, &value)) = vals
                .iter()
                .enumerate()
                .skip(kda.n_heads)
                .find(|(_, v)| **v != 0.0)
            {
                return Err(CheckpointError::ALogPadding {
                    file: self.path_of(&d.name),
                    tensor: d.name.clone(),
                    index,
                    n_heads: kda.n_heads,
                    value,
                });
            }
        }
        Ok(())
    }

    /// A small F32 tensor read with one positional read, not through the mapping: a fault
    /// on a cold mapping reads a whole read-ahead window (8 MiB on some VMs), so checking one
    /// 1 KB tensor per layer that way read hundreds of MB at start-up.
    pub(super) fn f32_vec_pread(&self, decl: &TensorDecl) -> Result<Vec<f32>, CheckpointError> {
        let Some(loc) = self.try_location(&decl.name) else {
            return Ok(self.f32_vec(decl)); // unreachable after check_against_spec
        };
        let io = |source| CheckpointError::Io {
            file: loc.shard_path.clone(),
            what: "A_log",
            source,
        };
        let mut b = vec![0u8; loc.n_bytes as usize];
        File::open(&loc.shard_path)
            .and_then(|f| crate::platform::read_exact_at(&f, &mut b, loc.file_offset))
            .map_err(io)?;
        Ok(b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    /// Whether every routed-expert scale was checked at open.
    pub fn scales_checked(&self) -> bool {
        self.scales_checked
    }

    /// Check one routed-expert scale tensor held elsewhere (e.g. loaded into RAM), naming
    /// the shard it came from.
    pub fn check_scale_bytes(
        &self,
        decl: &TensorDecl,
        bytes: &[u8],
    ) -> Result<(), CheckpointError> {
        check_e8m0(&self.path_of(&decl.name), &decl.name, bytes)
    }

    /// Check every routed-expert scale of `spec` through the mmap (what `validate_expert_scales`
    /// does at open).
    ///
    /// Only the scale bytes are read, with positional reads on descriptors advised
    /// `POSIX_FADV_RANDOM`, on [`SCALE_CHECK_THREADS`] threads: through the maps every scale
    /// tensor's fault read a whole read-ahead window (8 MiB here), i.e. most of the experts,
    /// before the first token (k3-mini: 2.7 s of a 4-6 s start). The error reported is the
    /// first bad tensor in declaration order, as a sequential check would find.
    pub fn check_all_scales(&self, spec: &ModelSpec) -> Result<(), CheckpointError> {
        let decls: Vec<&TensorDecl> = spec
            .tensors
            .iter()
            .filter(|d| is_scale_role(d.role))
            .collect();
        if decls.is_empty() {
            return Ok(());
        }
        let n_threads = SCALE_CHECK_THREADS.min(decls.len());
        let next = std::sync::atomic::AtomicUsize::new(0);
        // The first error's declaration index; workers skip declarations after it.
        let first_bad = std::sync::atomic::AtomicUsize::new(usize::MAX);
        let errors: Vec<Option<(usize, CheckpointError)>> = std::thread::scope(|sc| {
            let handles: Vec<_> = (0..n_threads)
                .map(|_| {
                    sc.spawn(|| -> Option<(usize, CheckpointError)> {
                        use std::sync::atomic::Ordering::Relaxed;
                        let mut files: Vec<Option<File>> = Vec::new();
                        let mut buf = Vec::new();
                        let mut bad: Option<(usize, CheckpointError)> = None;
                        loop {
                            let i = next.fetch_add(1, Relaxed);
                            if i >= decls.len() || i > first_bad.load(Relaxed) {
                                return bad;
                            }
                            if let Err(e) = self.check_scale_pread(decls[i], &mut files, &mut buf) {
                                first_bad.fetch_min(i, Relaxed);
                                if bad.as_ref().is_none_or(|(j, _)| i < *j) {
                                    bad = Some((i, e));
                                }
                            }
                        }
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or(None))
                .collect()
        });
        match errors.into_iter().flatten().min_by_key(|(i, _)| *i) {
            Some((_, e)) => Err(e),
            None => Ok(()),
        }
    }

    /// One scale tensor read with a positional read (descriptors cached in `files`, by shard).
    pub(super) fn check_scale_pread(
        &self,
        decl: &TensorDecl,
        files: &mut Vec<Option<File>>,
        buf: &mut Vec<u8>,
    ) -> Result<(), CheckpointError> {
        use crate::platform::{self, FileAdvice};
        let e = self
            .table
            .get(&decl.name)
            .ok_or_else(|| self.unknown(&decl.name))?;
        let shard = &self.shards[e.shard()];
        let io = |source| CheckpointError::Io {
            file: shard.path.clone(),
            what: "expert scales",
            source,
        };
        if files.len() < self.shards.len() {
            files.resize_with(self.shards.len(), || None);
        }
        let f = match &mut files[e.shard()] {
            Some(f) => f,
            slot @ None => {
                let f = File::open(&shard.path).map_err(io)?;
                // Advice only: no read-ahead for these small scattered reads (absent on
                // Windows).
                let _ = platform::advise_file(&f, FileAdvice::Random);
                slot.insert(f)
            }
        };
        buf.resize((e.end - e.begin) as usize, 0);
        platform::read_exact_at(f, buf, shard.data_start + e.begin).map_err(io)?;
        check_e8m0(&shard.path, &decl.name, buf)
    }

    /// Whether `decl` is a routed-expert scale tensor.
    pub fn is_scale(decl: &TensorDecl) -> bool {
        is_scale_role(decl.role)
    }

    /// Check the three `weight_scale` tensors of one routed expert through the mmap.
    pub fn validate_expert_scales(
        &self,
        spec: &ModelSpec,
        layer: usize,
        expert: usize,
    ) -> Result<(), CheckpointError> {
        for d in spec
            .tensors
            .iter()
            .filter(|d| d.layer == Some(layer) && d.expert == Some(expert) && is_scale_role(d.role))
        {
            let bytes = self
                .try_bytes(&d.name)
                .ok_or_else(|| self.unknown(&d.name))?;
            check_e8m0(&self.path_of(&d.name), &d.name, bytes)?;
        }
        Ok(())
    }
}
