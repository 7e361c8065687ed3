//! [`MmapTrunk`]: the page-cache comparison policy (`configs/io/mmap.toml`).

use super::*;

/// The page-cache comparison policy (`configs/io/mmap.toml`): trunk.bin mapped read-only,
/// every layer served from the mapping; the kernel decides what stays in RAM.
pub struct MmapTrunk {
    manifest: TrunkManifest,
    decls: Vec<Vec<(TensorDecl, usize)>>,
    map: memmap2::Mmap,
    stats: TrunkStats,
}

impl std::fmt::Debug for MmapTrunk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MmapTrunk")
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl MmapTrunk {
    pub fn open(dir: &Path, spec: &ModelSpec) -> Result<Self, StreamError> {
        let manifest = TrunkManifest::load(dir, spec)?;
        let path = dir.join(TRUNK_BIN);
        if manifest.is_compressed() {
            // A setting that cannot work with this trunk: a usage error (exit 2).
            return Err(StreamError::Config(format!(
                "packed trunk {} is compressed (pack-trunk --compress): its layers cannot be \
                 served from a mapping; use the direct I/O policy (the default) or pack without \
                 --compress",
                dir.display()
            )));
        }
        let f = std::fs::File::open(&path).map_err(|e| StreamError::io("open", &path, e))?;
        // SAFETY: read-only private mapping; trunk.bin is not modified while a run uses it
        // (pack-trunk writes a new file and renames it over, which keeps this inode intact).
        let map =
            unsafe { memmap2::Mmap::map(&f) }.map_err(|e| StreamError::io("mmap", &path, e))?;
        if (map.len() as u64) < manifest.file_bytes {
            return Err(StreamError::Trunk {
                path: path.display().to_string(),
                msg: format!(
                    "mapped {} bytes, expected {}",
                    map.len(),
                    manifest.file_bytes
                ),
            });
        }
        let decls = layer_decls(spec, &manifest);
        let stats = TrunkStats {
            n_layers: manifest.n_layers,
            ..TrunkStats::default()
        };
        Ok(Self {
            manifest,
            decls,
            map,
            stats,
        })
    }

    pub fn startup_lines(&self) -> Vec<String> {
        vec![
            format!(
                "trunk mmap: {} packed, mapped through the page cache (I/O policy mmap: no \
                 pinned prefix, no ring slots, no O_DIRECT)",
                fmt_bytes(self.manifest.packed_bytes)
            ),
            "trunk bytes_read counts bytes served from the mapping (page faults are not timed)"
                .to_string(),
        ]
    }
}

impl TrunkSource for MmapTrunk {
    fn layer(&mut self, layer: usize) -> Result<LayerWeights<'_>, WeightError> {
        let pl = self
            .manifest
            .layers
            .get(layer)
            .ok_or_else(|| WeightError::Invalid {
                name: format!("trunk layer {layer}"),
                msg: format!("out of range (0..{})", self.manifest.n_layers),
            })?;
        let start = pl.offset as usize;
        let bytes = &self.map[start..start + pl.size as usize];
        self.stats.bytes_read += pl.size;
        Ok(view(&self.decls[layer], bytes))
    }

    fn stats(&self) -> TrunkStats {
        self.stats.clone()
    }
}
