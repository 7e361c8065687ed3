//! Reading tensors: names, locations in the shard files, byte slices of the mappings, exact
//! widening to bf16 bits and f32.

use super::*;

impl Checkpoint {
    pub(super) fn unknown(&self, name: &str) -> CheckpointError {
        CheckpointError::UnknownTensor {
            file: self.index_or_dir(),
            tensor: name.to_string(),
        }
    }

    pub(super) fn path_of(&self, name: &str) -> PathBuf {
        self.table.get(name).map_or_else(
            || self.index_or_dir(),
            |e| self.shards[e.shard()].path.clone(),
        )
    }

    /// The directory this checkpoint was opened from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The shards, in file-name order.
    pub fn shards(&self) -> &[Shard] {
        &self.shards
    }

    /// Sum of the shard file sizes.
    pub fn total_file_bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.file_len).sum()
    }

    /// Sum of all tensor payloads (what the index's `metadata.total_size` counts).
    pub fn total_tensor_bytes(&self) -> u64 {
        self.table.entries.iter().map(|e| e.end - e.begin).sum()
    }

    /// Every tensor name, in file order (shard by shard, by offset).
    pub fn tensor_names(&self) -> TensorNames<'_> {
        self.table.names()
    }

    /// Header facts of a tensor: (dtype string, shape).
    pub fn info(&self, name: &str) -> Option<(&str, &[usize])> {
        self.table.get(name).map(|e| (e.dtype(), &*e.shape))
    }

    /// The raw bytes of a tensor by name, `None` if the checkpoint does not hold it.
    pub fn try_bytes(&self, name: &str) -> Option<&[u8]> {
        let e = self.table.get(name)?;
        let s = &self.shards[e.shard()];
        let start = usize::try_from(s.data_start + e.begin).ok()?;
        let end = usize::try_from(s.data_start + e.end).ok()?;
        s.mmap.get(start..end)
    }

    /// The raw bytes of a declared tensor.
    ///
    /// Panics if `decl` is not in this checkpoint: [`Checkpoint::open`] verified every
    /// declaration of the spec it was given, so this only happens for a foreign declaration.
    pub fn bytes(&self, decl: &TensorDecl) -> &[u8] {
        self.try_bytes(&decl.name)
            .expect("invariant: open() verified every declared tensor is present and in range")
    }

    /// Absolute location of a tensor (for O_DIRECT readers and the trunk packer).
    pub fn try_location(&self, name: &str) -> Option<TensorLocation> {
        let e = self.table.get(name)?;
        let s = &self.shards[e.shard()];
        Some(TensorLocation {
            shard_path: s.path.clone(),
            file_offset: s.data_start + e.begin,
            n_bytes: e.end - e.begin,
        })
    }

    /// Where `name`'s bytes live as (index into [`Checkpoint::shards`], absolute file offset,
    /// length): [`Checkpoint::try_location`] without building a path, for callers that
    /// locate every routed expert (~500,000 tensors in the release).
    pub fn shard_span(&self, name: &str) -> Option<(usize, u64, u64)> {
        let e = self.table.get(name)?;
        Some((
            e.shard(),
            self.shards[e.shard()].data_start + e.begin,
            e.end - e.begin,
        ))
    }

    /// [`Checkpoint::try_location`], or a message naming the tensor and the checkpoint
    /// directory (callers wrap it in their own error type).
    pub fn locate(&self, name: &str) -> Result<TensorLocation, String> {
        self.try_location(name).ok_or_else(|| {
            format!(
                "tensor {name} is not in the checkpoint {}",
                self.dir().display()
            )
        })
    }

    /// Absolute location of a declared tensor. Panics like [`Checkpoint::bytes`].
    pub fn location(&self, decl: &TensorDecl) -> TensorLocation {
        self.try_location(&decl.name)
            .expect("invariant: open() verified every declared tensor is present")
    }

    /// The one contiguous byte range covering `decls` (in any order): all in one shard and no
    /// hole between them. The trunk packer uses this per layer; the synth guarantees it.
    pub fn contiguous_range(
        &self,
        decls: &[&TensorDecl],
    ) -> Result<TensorLocation, CheckpointError> {
        let mut es: Vec<(&str, &Entry)> = Vec::with_capacity(decls.len());
        for d in decls {
            let e = self
                .table
                .get(&d.name)
                .ok_or_else(|| self.unknown(&d.name))?;
            es.push((&d.name, e));
        }
        es.sort_by_key(|(_, e)| (e.shard, e.begin, e.end));
        let (Some(&(first_name, first)), Some(&(last_name, last))) = (es.first(), es.last()) else {
            return Err(CheckpointError::NotContiguous {
                file: self.index_or_dir(),
                tensor: String::new(),
                other: String::new(),
                msg: "empty tensor list".into(),
            });
        };
        let file = self.shards[first.shard()].path.clone();
        for w in es.windows(2) {
            let ((an, a), (bn, b)) = (w[0], w[1]);
            let msg = if a.shard != b.shard {
                Some("they are in different shards".to_string())
            } else if b.begin != a.end {
                Some(format!(
                    "hole of {} bytes between {an} and {bn}",
                    b.begin.saturating_sub(a.end)
                ))
            } else {
                None
            };
            if let Some(msg) = msg {
                return Err(CheckpointError::NotContiguous {
                    file,
                    tensor: first_name.to_string(),
                    other: last_name.to_string(),
                    msg,
                });
            }
        }
        let s = &self.shards[first.shard()];
        Ok(TensorLocation {
            shard_path: s.path.clone(),
            file_offset: s.data_start + first.begin,
            n_bytes: last.end - first.begin,
        })
    }

    /// BF16 bit patterns of a declared BF16 tensor; borrowed when the bytes are 2-aligned on
    /// a little-endian host, copied otherwise. Panics if `decl` is not BF16 (programming error).
    pub fn bf16_bits(&self, decl: &TensorDecl) -> Cow<'_, [u16]> {
        assert_eq!(
            decl.dtype,
            DType::BF16,
            "bf16_bits on non-BF16 tensor {}",
            decl.name
        );
        let b = self.bytes(decl);
        if cfg!(target_endian = "little")
            && let Ok(s) = bytemuck::try_cast_slice::<u8, u16>(b)
        {
            return Cow::Borrowed(s);
        }
        Cow::Owned(
            b.chunks_exact(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]]))
                .collect(),
        )
    }

    /// Values of a declared F32 tensor (always a copy; alignment does not matter).
    /// Panics if `decl` is not F32 (programming error).
    pub fn f32_vec(&self, decl: &TensorDecl) -> Vec<f32> {
        assert_eq!(
            decl.dtype,
            DType::F32,
            "f32_vec on non-F32 tensor {}",
            decl.name
        );
        let b = self.bytes(decl);
        if cfg!(target_endian = "little")
            && let Ok(s) = bytemuck::try_cast_slice::<u8, f32>(b)
        {
            return s.to_vec();
        }
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }
}
