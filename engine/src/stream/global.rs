//! Ultra-low-memory global tensors: embedding rows and lm_head chunks streamed from the
//! checkpoint instead of resident (`--ultra-low-memory`).
//!
//! Owns: [`StreamedGlobal`], a `GlobalSource` that reads one embedding row per token with a
//! positional read, and computes `lm_head · x` chunk by chunk of rows read from the shard into
//! one reused aligned buffer, with the canonical `k3_kernels::matvec::matvec_bf16` on each
//! chunk. Rows are independent and the kernel splits output rows only, so the logits are bit
//! for bit those of the resident path whatever the chunk size (a test checks it). The small
//! global tensors (final norm, output AttnRes) are copied once at start.
//! Must not: keep the embedding or lm_head resident, or compute anything but the matvec.
//! Follows upstream: docs/DESIGN.md §5 (`--ultra-low-memory` streams exact embedding rows and
//! lm_head chunks) and the Korean seed (ultra preset).

use std::time::Instant;

use k3_kernels::matvec::matvec_bf16_many;
use k3_kernels::par::Pool;
use k3_models::spec::{DType, ModelSpec, TensorDecl, TensorRole};

use super::StreamError;
use super::aligned::AlignedBuf;
use super::direct::{DirectFile, ReadPool};
use super::trunk::READ_PIECE;
use crate::checkpoint::Checkpoint;
use crate::weights::{GlobalSource, TensorBytes, WeightError};

/// A 2-D bf16 tensor on disk.
#[derive(Debug)]
struct DiskMatrix {
    name: String,
    file: DirectFile,
    offset: u64,
    rows: usize,
    cols: usize,
}

/// Streams embedding rows and lm_head chunks (see the module doc).
#[derive(Debug)]
pub struct StreamedGlobal {
    embed: DiskMatrix,
    lm_head: DiskMatrix,
    small: Vec<(TensorDecl, Vec<u8>)>,
    chunk_rows: usize,
    chunk: AlignedBuf,
    pool: ReadPool,
    bits: Vec<u16>,
    row: Vec<u8>,
    bytes_read: u64,
    read_seconds: f64,
}

/// Options of [`StreamedGlobal::new`].
#[derive(Clone, Debug)]
pub struct GlobalOptions {
    /// Bytes of lm_head read per chunk (rounded to whole rows, at least one row).
    pub chunk_bytes: usize,
    pub o_direct: bool,
    /// Queue depth of lm_head chunk reads (4 MiB pieces in parallel).
    pub read_threads: usize,
}

impl Default for GlobalOptions {
    fn default() -> Self {
        Self {
            chunk_bytes: 64 << 20,
            o_direct: true,
            read_threads: 8,
        }
    }
}

fn matrix(
    spec: &ModelSpec,
    ckpt: &Checkpoint,
    role: TensorRole,
    o_direct: bool,
) -> Result<DiskMatrix, StreamError> {
    let d = spec
        .tensor(role, None, None)
        .ok_or_else(|| StreamError::Invalid(format!("the model declares no {role:?} tensor")))?;
    if d.dtype != DType::BF16 || d.shape.len() != 2 {
        return Err(StreamError::Invalid(format!(
            "tensor {} must be a 2-D BF16 matrix to be streamed, declared {} {:?}",
            d.name,
            d.dtype.as_str(),
            d.shape
        )));
    }
    let loc = ckpt.locate(&d.name).map_err(StreamError::Invalid)?;
    Ok(DiskMatrix {
        name: d.name.clone(),
        file: DirectFile::open(&loc.shard_path, o_direct)?,
        offset: loc.file_offset,
        rows: d.shape[0],
        cols: d.shape[1],
    })
}

impl StreamedGlobal {
    pub fn new(
        spec: &ModelSpec,
        ckpt: &Checkpoint,
        opts: &GlobalOptions,
    ) -> Result<Self, StreamError> {
        let embed = matrix(spec, ckpt, TensorRole::Embed, false)?;
        let lm_head = matrix(spec, ckpt, TensorRole::LmHead, opts.o_direct)?;
        let mut small = Vec::new();
        for role in [
            TensorRole::FinalNorm,
            TensorRole::OutputResProj,
            TensorRole::OutputResNorm,
        ] {
            if let Some(d) = spec.tensor(role, None, None) {
                let b = ckpt.try_bytes(&d.name).ok_or_else(|| {
                    StreamError::Invalid(format!(
                        "tensor {} is not in the checkpoint {}",
                        d.name,
                        ckpt.dir().display()
                    ))
                })?;
                small.push((d.clone(), b.to_vec()));
            }
        }
        let row_bytes = lm_head.cols * 2;
        let chunk_rows = (opts.chunk_bytes / row_bytes.max(1)).clamp(1, lm_head.rows.max(1));
        let span = lm_head
            .file
            .span(lm_head.offset, chunk_rows * row_bytes)
            .len
            + lm_head.file.offset_align();
        let chunk = AlignedBuf::new(span).map_err(|e| {
            StreamError::Invalid(format!(
                "cannot allocate the lm_head chunk buffer ({span} bytes): {e}"
            ))
        })?;
        Ok(Self {
            row: vec![0u8; embed.cols * 2],
            embed,
            lm_head,
            small,
            chunk_rows,
            chunk,
            pool: ReadPool::new(opts.read_threads)?,
            bits: Vec::new(),
            bytes_read: 0,
            read_seconds: 0.0,
        })
    }

    /// Bytes this source holds in RAM, for the memory plan: the lm_head chunk buffer, the
    /// bf16 copy of a chunk made when the chunk is not 2-byte aligned (an odd tensor offset),
    /// the embedding row buffer and the small tensors.
    pub fn buffer_bytes(&self) -> u64 {
        let chunk = (self.chunk_rows * self.lm_head.cols * 2) as u64;
        let realign = if self.lm_head.offset.is_multiple_of(2) {
            0
        } else {
            chunk
        };
        self.chunk.capacity() as u64
            + realign
            + self.row.len() as u64
            + self.small.iter().map(|(_, b)| b.len() as u64).sum::<u64>()
    }

    /// Rows of lm_head per chunk.
    pub fn chunk_rows(&self) -> usize {
        self.chunk_rows
    }

    /// Bytes read from disk so far and the seconds it took.
    pub fn io(&self) -> (u64, f64) {
        (self.bytes_read, self.read_seconds)
    }

    /// One line for the start-up report.
    pub fn startup_line(&self) -> String {
        format!(
            "ultra-low-memory: embedding rows read per token; lm_head streamed in chunks of {} rows ({}); {}",
            self.chunk_rows,
            super::fmt_bytes((self.chunk_rows * self.lm_head.cols * 2) as u64),
            if self.lm_head.file.is_direct() {
                "O_DIRECT".to_string()
            } else {
                format!(
                    "buffered ({})",
                    self.lm_head.file.fallback_reason().unwrap_or_default()
                )
            }
        )
    }
}

fn io_err(name: &str, e: StreamError) -> WeightError {
    match e {
        StreamError::Io { path, source, .. } => WeightError::Io {
            what: name.to_string(),
            path,
            source,
        },
        other => WeightError::Invalid {
            name: name.to_string(),
            msg: other.to_string(),
        },
    }
}

impl GlobalSource for StreamedGlobal {
    fn embed_row(&mut self, token: u32, out: &mut [f32]) -> Result<(), WeightError> {
        let e = &self.embed;
        if token as usize >= e.rows || out.len() != e.cols {
            return Err(WeightError::Invalid {
                name: e.name.clone(),
                msg: format!(
                    "row {token} of {} (width {}, output {})",
                    e.rows,
                    e.cols,
                    out.len()
                ),
            });
        }
        let t0 = Instant::now();
        let off = e.offset + token as u64 * e.cols as u64 * 2;
        e.file
            .read_exact_at(off, &mut self.row)
            .map_err(|err| io_err(&e.name, err))?;
        self.read_seconds += t0.elapsed().as_secs_f64();
        self.bytes_read += self.row.len() as u64;
        crate::weights::widen_bf16_le(&self.row, out);
        Ok(())
    }

    /// Each chunk of rows read once and applied to every input.
    fn lm_head_many(
        &mut self,
        pool: &Pool,
        xs: &[&[f32]],
        logits: &mut [&mut [f32]],
    ) -> Result<(), WeightError> {
        let m = &self.lm_head;
        let bad = xs
            .iter()
            .zip(logits.iter())
            .map(|(x, l)| (x.len(), l.len()))
            .find(|&(x, l)| x != m.cols || l != m.rows)
            .or((xs.len() != logits.len()).then_some((0, 0)));
        if let Some((x, l)) = bad {
            return Err(WeightError::Invalid {
                name: m.name.clone(),
                msg: format!(
                    "shape [{}, {}] does not match x ({}) and logits ({}) of {} inputs",
                    m.rows,
                    m.cols,
                    x,
                    l,
                    xs.len()
                ),
            });
        }
        let row_bytes = m.cols * 2;
        let mut r0 = 0usize;
        while r0 < m.rows {
            let n = self.chunk_rows.min(m.rows - r0);
            let len = n * row_bytes;
            let t0 = Instant::now();
            let lead = self
                .pool
                .read_split(
                    &m.file,
                    m.offset + (r0 * row_bytes) as u64,
                    len,
                    self.chunk.full_mut(),
                    READ_PIECE,
                )
                .map_err(|e| io_err(&m.name, e))?;
            self.read_seconds += t0.elapsed().as_secs_f64();
            self.bytes_read += m.file.span(m.offset + (r0 * row_bytes) as u64, len).len as u64;
            let bytes = &self.chunk.full()[lead..lead + len];
            let w: &[u16] = match bytemuck::try_cast_slice::<u8, u16>(bytes) {
                Ok(w) => w,
                Err(_) => {
                    self.bits.clear();
                    self.bits.extend(
                        bytes
                            .chunks_exact(2)
                            .map(|c| u16::from_le_bytes([c[0], c[1]])),
                    );
                    &self.bits
                }
            };
            let mut outs: Vec<&mut [f32]> = logits.iter_mut().map(|l| &mut l[r0..r0 + n]).collect();
            matvec_bf16_many(pool, w, xs, &mut outs);
            r0 += n;
        }
        Ok(())
    }

    fn small(&self, role: TensorRole) -> Option<TensorBytes<'_>> {
        self.small
            .iter()
            .find(|(d, _)| d.role == role)
            .map(|(d, b)| TensorBytes { decl: d, bytes: b })
    }
}
