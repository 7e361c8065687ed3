//! Reading a packed trunk back: `trunk.json` parsed and checked against `trunk.bin` and the
//! model spec, layer by layer.

use super::write::role_name;
use super::*;

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
