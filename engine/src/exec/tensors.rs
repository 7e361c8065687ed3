//! Weight views shared by the blocks: bf16 bytes as u16, exact widening to f32, and the
//! projection helpers (`lin`, `lin_batch`) that run one matvec per weight on the pool.

use super::*;

/// View raw little-endian bytes as bf16 bit patterns (copying only if misaligned).
pub(super) fn bf16_bits(t: TensorBytes<'_>) -> Cow<'_, [u16]> {
    bf16_of(t.bytes)
}

/// Little-endian bf16 bytes as u16 (borrowed when 2-byte aligned, else copied).
pub(super) fn bf16_of(bytes: &[u8]) -> Cow<'_, [u16]> {
    match bytemuck::try_cast_slice::<u8, u16>(bytes) {
        Ok(s) => Cow::Borrowed(s),
        Err(_) => Cow::Owned(
            bytes
                .chunks_exact(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]]))
                .collect(),
        ),
    }
}

/// Widen a small BF16 or F32 tensor exactly into `out[..n]`; returns n.
pub(super) fn widen(t: TensorBytes<'_>, out: &mut [f32]) -> usize {
    match t.decl.dtype {
        DType::BF16 => {
            let n = t.bytes.len() / 2;
            crate::weights::widen_bf16_le(t.bytes, &mut out[..n]);
            n
        }
        DType::F32 => {
            let n = t.bytes.len() / 4;
            for (o, c) in out[..n].iter_mut().zip(t.bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
            n
        }
        DType::U8 => 0,
    }
}

pub(super) fn need<'a>(
    lw: &LayerWeights<'a>,
    layer: usize,
    role: TensorRole,
) -> Result<TensorBytes<'a>, ExecError> {
    lw.get(role).ok_or(ExecError::MissingTensor { layer, role })
}

/// `out = W x` for a bf16 tensor.
pub(super) fn lin(pool: &Pool, w: TensorBytes<'_>, x: &[f32], out: &mut [f32]) {
    matvec::matvec_bf16(pool, &bf16_bits(w), x, out);
}

/// Several bf16 matvecs over the same input `x` in ONE parallel dispatch (row chunks of every
/// matrix are the tasks): [`lin_many`] with one token. Each output row is still one canonical
/// dot product computed by one thread, so the bits equal those of separate [`lin`] calls for
/// any thread count; it only saves the per-call fork/join cost of many small matvecs.
pub(super) fn lin_batch(pool: &Pool, x: &[f32], jobs: Vec<(TensorBytes<'_>, &mut [f32])>) {
    lin_many(pool, 1, jobs.into_iter().map(|(w, o)| (w, x, o)).collect());
}
