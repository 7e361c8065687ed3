//! Matrix-vector products on bf16, MXFP4 and f32 weights, and the canonical dot product.
//!
//! Owns: `out[r] = sum_c W[r, c] * x[c]` for row-major `W` of shape `[rows, cols]` with
//! `rows = out.len()`, `cols = x.len()`; exact MXFP4 decoding; E8M0 validation.
//! Must not: round activations, use a different order per ISA, or split a row across threads.
//!
//! **Reduction order** (every path, every thread count): each output row is one canonical dot
//! product ([`crate::reduce`]): element `c` of the row accumulates into lane `c % 16` with FMA,
//! ascending `c`, then the fixed pairwise tree over the 16 lanes. Weights are widened exactly
//! first (bf16: `bits << 16`; MXFP4: `E2M1[nibble] * 2^(scale - 127)`, exact in f32).
//!
//! **Threads**: rows are split into chunks of whole rows (`par::stream_row_chunk` for the
//! memory-bound bf16/f32 kernels: at least 1 MB of weights per task; `par::row_chunk` for
//! MXFP4); a row is always computed by one task, so the bits are identical for any `Pool`.
//!
//! **Several inputs** ([`rows_bf16_many`], [`rows_mxfp4_many`]: a prompt pass, an expert applied
//! to every token that chose it): each output is the dot product of its row with its input in
//! the order above, bit-identical to the one-input kernel; the weights are read (and widened or
//! decoded) once for all inputs. AVX-512 keeps 4 rows x 4 inputs in registers; other paths run
//! the one-input rows per input over cache-sized row blocks.
//!
//! **MXFP4 layout** (OCP MX, compressed-tensors): `packed` is `[rows, cols/2]` bytes, element
//! `2j` in the LOW nibble of byte `j`, `2j+1` in the high nibble; `scales` is `[rows, cols/32]`
//! E8M0 bytes, value `2^(byte - 127)`; byte 0 is 2^-127 (an f32 subnormal), 0xFF is NaN and
//! must be rejected at load time with [`validate_e8m0`].

use crate::isa::{Isa, active, resolve};
use crate::par::{Pool, row_chunk, stream_row_chunk};
use crate::reduce::{self, LANES, tree16};

/// E2M1 code -> value; bit 3 is the sign (code 8 is -0.0).
pub const E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// E8M0 byte -> `2^(byte - 127)` as f32, exact; byte 0 is the subnormal 2^-127 (bits
/// 0x0040_0000, not built from exponent bits); byte 0xFF is NaN.
pub const fn e8m0_to_f32(byte: u8) -> f32 {
    match byte {
        0 => f32::from_bits(0x0040_0000),
        255 => f32::NAN,
        b => f32::from_bits((b as u32) << 23),
    }
}

/// [`e8m0_to_f32`] for every byte.
pub(crate) static E8M0: [f32; 256] = {
    let mut t = [0.0f32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = e8m0_to_f32(i as u8);
        i += 1;
    }
    t
};

/// `Err(index)` of the first 0xFF (NaN) scale byte, `Ok(())` if there is none.
pub fn validate_e8m0(scales: &[u8]) -> Result<(), usize> {
    match scales.iter().position(|&b| b == 0xFF) {
        Some(i) => Err(i),
        None => Ok(()),
    }
}

/// Decodes one MXFP4 row exactly: `out[c] = E2M1[nibble(c)] * 2^(scales[c/32] - 127)`.
/// Shapes: `packed.len() == out.len()/2`, `scales.len() == out.len()/32`, `out.len() % 32 == 0`.
pub fn mxfp4_dequant_row(packed: &[u8], scales: &[u8], out: &mut [f32]) {
    check_mxfp4_row(packed, scales, out.len());
    for ((o, p), &s) in out
        .chunks_exact_mut(32)
        .zip(packed.chunks_exact(16))
        .zip(scales)
    {
        let scale = E8M0[s as usize];
        for (j, &byte) in p.iter().enumerate() {
            o[2 * j] = E2M1[(byte & 0x0F) as usize] * scale;
            o[2 * j + 1] = E2M1[(byte >> 4) as usize] * scale;
        }
    }
}

fn check_mxfp4_row(packed: &[u8], scales: &[u8], cols: usize) {
    assert!(
        cols.is_multiple_of(32),
        "mxfp4: cols = {cols} is not a multiple of 32"
    );
    assert_eq!(
        packed.len(),
        cols / 2,
        "mxfp4: packed row must hold cols/2 bytes"
    );
    assert_eq!(
        scales.len(),
        cols / 32,
        "mxfp4: scale row must hold cols/32 bytes"
    );
}

/// Canonical dot product of two f32 vectors (same order as a matvec row), active ISA.
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    dot_f32_with(active(), a, b)
}

/// [`dot_f32`] on a forced path (falls back to scalar if `isa` is unavailable).
pub fn dot_f32_with(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot_f32: operand lengths differ");
    crate::simd::dot_f32(resolve(isa), a, b)
}

/// bf16 weights `w: [rows, cols]` (raw bits) times f32 `x: [cols]` into `out: [rows]`.
/// Order: see the module doc. Panics if `w.len() != out.len() * x.len()`.
pub fn matvec_bf16(pool: &Pool, w: &[u16], x: &[f32], out: &mut [f32]) {
    matvec_bf16_with(active(), pool, w, x, out)
}

/// [`matvec_bf16`] on a forced path.
pub fn matvec_bf16_with(isa: Isa, pool: &Pool, w: &[u16], x: &[f32], out: &mut [f32]) {
    let (rows, cols) = (out.len(), x.len());
    assert_eq!(w.len(), rows * cols, "matvec_bf16: w.len() != rows * cols");
    let isa = resolve(isa);
    let chunk = stream_row_chunk(rows, cols * 2, pool.n_threads());
    pool.for_each_chunk(out, chunk, |i, o| {
        let r0 = i * chunk;
        crate::simd::rows_bf16(isa, &w[r0 * cols..(r0 + o.len()) * cols], x, o);
    });
}

/// bf16 weights `w: [rows, cols]` times SEVERAL inputs, rows split across the pool: `outs[t] =
/// W xs[t]`, each output bit-identical to [`matvec_bf16`] of that input alone (a row is one
/// task's, computed by [`rows_bf16_many`]). With one input this is [`matvec_bf16`].
pub fn matvec_bf16_many(pool: &Pool, w: &[u16], xs: &[&[f32]], outs: &mut [&mut [f32]]) {
    matvec_bf16_many_with(active(), pool, w, xs, outs)
}

/// [`matvec_bf16_many`] on a forced path.
pub fn matvec_bf16_many_with(
    isa: Isa,
    pool: &Pool,
    w: &[u16],
    xs: &[&[f32]],
    outs: &mut [&mut [f32]],
) {
    assert_eq!(
        xs.len(),
        outs.len(),
        "matvec_bf16_many: one output per input"
    );
    if let ([x], [o]) = (xs, &mut *outs) {
        return matvec_bf16_with(isa, pool, w, x, o);
    }
    let Some(first) = outs.first() else { return };
    let (rows, cols) = (first.len(), xs[0].len());
    assert_eq!(
        w.len(),
        rows * cols,
        "matvec_bf16_many: w.len() != rows * cols"
    );
    if rows == 0 || cols == 0 {
        // every output is an empty dot product (or there is none)
        outs.iter_mut().for_each(|o| o.fill(0.0));
        return;
    }
    // Tasks of rows for every input: the work of all inputs per task, as for a stream.
    let per = stream_row_chunk(rows, cols * 2 * xs.len(), pool.n_threads());
    let mut per_input: Vec<_> = outs.iter_mut().map(|o| o.chunks_mut(per)).collect();
    let mut tasks: Vec<(&[u16], Vec<&mut [f32]>)> = w
        .chunks(per * cols)
        .map(|wc| {
            let o = per_input
                .iter_mut()
                .map(|c| c.next().expect("one chunk per row range"))
                .collect();
            (wc, o)
        })
        .collect();
    pool.for_each_chunk(&mut tasks, 1, |_, t| {
        for (wc, o) in t.iter_mut() {
            rows_bf16_many_with(isa, wc, xs, o);
        }
    });
}

/// Weight bytes of one block of [`rows_bf16_many`]: a block is applied to every input while
/// it is in the core's cache.
pub const MANY_BLOCK_BYTES: usize = 64 * 1024;

/// bf16 weights `w: [rows, cols]` times SEVERAL inputs on the calling thread: `outs[t] = W
/// xs[t]` (`rows = outs[t].len()`, `cols = xs[t].len()`), each output bit-identical to
/// [`matvec_bf16`] of that input alone (the same row kernel on the same row and input). The
/// rows are taken in blocks of about [`MANY_BLOCK_BYTES`], each applied to every input while
/// it is in cache, so `w` streams from memory once for all inputs instead of once per input.
/// Callers split rows across threads (the executor's prompt passes).
pub fn rows_bf16_many(w: &[u16], xs: &[&[f32]], outs: &mut [&mut [f32]]) {
    rows_bf16_many_with(active(), w, xs, outs)
}

/// [`rows_bf16_many`] on a forced path.
pub fn rows_bf16_many_with(isa: Isa, w: &[u16], xs: &[&[f32]], outs: &mut [&mut [f32]]) {
    assert_eq!(xs.len(), outs.len(), "rows_bf16_many: one output per input");
    let Some(first) = outs.first() else { return };
    let (rows, cols) = (first.len(), xs[0].len());
    assert!(
        xs.iter().all(|x| x.len() == cols) && outs.iter().all(|o| o.len() == rows),
        "rows_bf16_many: inputs (or outputs) differ in length"
    );
    assert_eq!(
        w.len(),
        rows * cols,
        "rows_bf16_many: w.len() != rows * cols"
    );
    let isa = resolve(isa);
    // whole groups of 8 rows (the SIMD paths keep 8 rows in flight)
    let block = (MANY_BLOCK_BYTES / (cols * 2).max(1)).max(1).div_ceil(8) * 8;
    let mut r0 = 0;
    while r0 < rows {
        let r1 = (r0 + block).min(rows);
        let wb = &w[r0 * cols..r1 * cols];
        let mut ob: Vec<&mut [f32]> = outs.iter_mut().map(|o| &mut o[r0..r1]).collect();
        crate::simd::rows_bf16_many(isa, wb, xs, &mut ob);
        r0 = r1;
    }
}

/// f32 weights `w: [rows, cols]` times `x: [cols]` into `out: [rows]`. Order: module doc.
pub fn matvec_f32(pool: &Pool, w: &[f32], x: &[f32], out: &mut [f32]) {
    matvec_f32_with(active(), pool, w, x, out)
}

/// [`matvec_f32`] on a forced path.
pub fn matvec_f32_with(isa: Isa, pool: &Pool, w: &[f32], x: &[f32], out: &mut [f32]) {
    let (rows, cols) = (out.len(), x.len());
    assert_eq!(w.len(), rows * cols, "matvec_f32: w.len() != rows * cols");
    let isa = resolve(isa);
    let chunk = stream_row_chunk(rows, cols * 4, pool.n_threads());
    pool.for_each_chunk(out, chunk, |i, o| {
        let r0 = i * chunk;
        crate::simd::rows_f32(isa, &w[r0 * cols..(r0 + o.len()) * cols], x, o);
    });
}

/// MXFP4 weights (`packed: [rows, cols/2]`, `scales: [rows, cols/32]`) times `x: [cols]`
/// into `out: [rows]`, computed on the packed bytes. `cols.is_multiple_of(32)`. Order: module doc
/// (each weight decoded exactly, then the canonical dot). A 0xFF scale gives NaN rows.
pub fn matvec_mxfp4(pool: &Pool, packed: &[u8], scales: &[u8], x: &[f32], out: &mut [f32]) {
    matvec_mxfp4_with(active(), pool, packed, scales, x, out)
}

/// [`matvec_mxfp4`] on a forced path.
pub fn matvec_mxfp4_with(
    isa: Isa,
    pool: &Pool,
    packed: &[u8],
    scales: &[u8],
    x: &[f32],
    out: &mut [f32],
) {
    let (rows, cols) = (out.len(), x.len());
    assert!(
        cols.is_multiple_of(32),
        "matvec_mxfp4: cols = {cols} is not a multiple of 32"
    );
    assert_eq!(
        packed.len(),
        rows * cols / 2,
        "matvec_mxfp4: packed.len() != rows*cols/2"
    );
    assert_eq!(
        scales.len(),
        rows * cols / 32,
        "matvec_mxfp4: scales.len() != rows*cols/32"
    );
    let isa = resolve(isa);
    let chunk = row_chunk(rows, pool.n_threads());
    let (pb, sb) = (cols / 2, cols / 32);
    pool.for_each_chunk(out, chunk, |i, o| {
        let r0 = i * chunk;
        let r1 = r0 + o.len();
        crate::simd::rows_mxfp4(
            isa,
            &packed[r0 * pb..r1 * pb],
            &scales[r0 * sb..r1 * sb],
            x,
            o,
        );
    });
}

/// MXFP4 weights (`packed: [rows, cols/2]`, `scales: [rows, cols/32]`) times SEVERAL inputs
/// on the calling thread: `outs[t] = W xs[t]`, each output bit-identical to [`matvec_mxfp4`]
/// of that input alone. Each row is decoded once for all inputs (the decode, not the memory,
/// bounds a one-input MXFP4 matvec): an expert applied to every token that routed to it.
pub fn rows_mxfp4_many(packed: &[u8], scales: &[u8], xs: &[&[f32]], outs: &mut [&mut [f32]]) {
    rows_mxfp4_many_with(active(), packed, scales, xs, outs)
}

/// [`rows_mxfp4_many`] on a forced path.
pub fn rows_mxfp4_many_with(
    isa: Isa,
    packed: &[u8],
    scales: &[u8],
    xs: &[&[f32]],
    outs: &mut [&mut [f32]],
) {
    assert_eq!(
        xs.len(),
        outs.len(),
        "rows_mxfp4_many: one output per input"
    );
    let Some(first) = outs.first() else { return };
    let (rows, cols) = (first.len(), xs[0].len());
    assert!(
        cols.is_multiple_of(32),
        "rows_mxfp4_many: cols = {cols} is not a multiple of 32"
    );
    assert!(
        xs.iter().all(|x| x.len() == cols) && outs.iter().all(|o| o.len() == rows),
        "rows_mxfp4_many: inputs (or outputs) differ in length"
    );
    assert!(
        packed.len() == rows * cols / 2 && scales.len() == rows * cols / 32,
        "rows_mxfp4_many: packed or scales do not match rows x cols"
    );
    crate::simd::rows_mxfp4_many(resolve(isa), packed, scales, xs, outs);
}

/// Scalar reference rows: f32 weights.
pub(crate) fn rows_f32_ref(w: &[f32], x: &[f32], out: &mut [f32]) {
    let cols = x.len();
    for (r, o) in out.iter_mut().enumerate() {
        *o = reduce::dot_ref(&w[r * cols..(r + 1) * cols], x);
    }
}

/// Scalar reference rows: bf16 weights.
pub(crate) fn rows_bf16_ref(w: &[u16], x: &[f32], out: &mut [f32]) {
    let cols = x.len();
    for (r, o) in out.iter_mut().enumerate() {
        *o = reduce::dot_bf16_ref(&w[r * cols..(r + 1) * cols], x);
    }
}

/// Scalar reference rows: MXFP4 weights (decode each weight exactly, canonical dot).
pub(crate) fn rows_mxfp4_ref(packed: &[u8], scales: &[u8], x: &[f32], out: &mut [f32]) {
    let cols = x.len();
    let (pb, sb) = (cols / 2, cols / 32);
    for (r, o) in out.iter_mut().enumerate() {
        *o = dot_mxfp4_ref(
            &packed[r * pb..(r + 1) * pb],
            &scales[r * sb..(r + 1) * sb],
            x,
        );
    }
}

/// Canonical dot of one MXFP4 row with `x` (cols.is_multiple_of(32), so there is no tail).
#[inline(always)]
pub(crate) fn dot_mxfp4_ref(packed: &[u8], scales: &[u8], x: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    for ((p, &s), xb) in packed.chunks_exact(16).zip(scales).zip(x.chunks_exact(32)) {
        let scale = E8M0[s as usize];
        // elements 0..15 of the block, then 16..31, each into lane c % 16
        for (c, &xc) in xb.iter().enumerate() {
            let byte = p[c / 2];
            let nib = if c & 1 == 0 { byte & 0x0F } else { byte >> 4 };
            let w = E2M1[nib as usize] * scale;
            acc[c % LANES] = w.mul_add(xc, acc[c % LANES]);
        }
    }
    tree16(acc)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e8m0_edges() {
        assert_eq!(e8m0_to_f32(127), 1.0);
        assert_eq!(e8m0_to_f32(128), 2.0);
        assert_eq!(e8m0_to_f32(1), f32::MIN_POSITIVE);
        assert_eq!(e8m0_to_f32(0) as f64, 2f64.powi(-127));
        assert_eq!(e8m0_to_f32(254) as f64, 2f64.powi(127));
        assert!(e8m0_to_f32(255).is_nan());
        assert_eq!(validate_e8m0(&[0, 1, 254]), Ok(()));
        assert_eq!(validate_e8m0(&[0, 255, 3, 255]), Err(1));
    }

    #[test]
    fn dequant_nibble_order_and_exactness() {
        // byte 0x71: element 0 = code 1 (0.5), element 1 = code 7 (6.0)
        let mut packed = [0u8; 16];
        packed[0] = 0x71;
        packed[15] = 0x9F; // element 30 = code 15 (-6), element 31 = code 9 (-0.5)
        for s in [0u8, 1, 100, 127, 200, 252] {
            let mut out = [1.0f32; 32];
            mxfp4_dequant_row(&packed, &[s], &mut out);
            let scale = 2f64.powi(s as i32 - 127);
            assert_eq!(out[0] as f64, 0.5 * scale);
            assert_eq!(out[1] as f64, 6.0 * scale);
            assert_eq!(out[30] as f64, -6.0 * scale);
            assert_eq!(out[31] as f64, -0.5 * scale);
            assert_eq!(out[2], 0.0);
        }
        // byte 0 and code 1: 0.5 * 2^-127 = 2^-128 is a subnormal, still exact
        let mut out = [0.0f32; 32];
        mxfp4_dequant_row(&packed, &[0], &mut out);
        assert_eq!(out[0].to_bits(), 0x0020_0000);
    }

    #[test]
    fn matvec_small_exact_case() {
        let pool = Pool::new(1);
        // W = [[1, 2, 3], [-1, 0.5, 0]] in bf16
        let w: [u16; 6] = [0x3F80, 0x4000, 0x4040, 0xBF80, 0x3F00, 0x0000];
        let x = [1.0f32, 2.0, 3.0];
        let mut out = [0.0f32; 2];
        matvec_bf16(&pool, &w, &x, &mut out);
        assert_eq!(out, [14.0, 0.0]);
        let wf = [1.0f32, 2.0, 3.0, -1.0, 0.5, 0.0];
        matvec_f32(&pool, &wf, &x, &mut out);
        assert_eq!(out, [14.0, 0.0]);
    }
}
