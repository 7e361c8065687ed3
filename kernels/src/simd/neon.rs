//! aarch64 fast paths: NEON versions of the canonical dot and matvec rows.
//!
//! Owns: instruction sequences that reproduce `crate::reduce`'s order exactly: the 16
//! canonical lanes are four `float32x4_t` (lanes 0..4, 4..8, 8..12, 12..16); every
//! accumulation is `vfmaq_f32` (fused, like `f32::mul_add`); the tail and the pairwise tree
//! run in the scalar code shared with the reference. Several rows are in flight at once.
//! Must not: reassociate, or use BFDOT/BFMMLA (their internal rounding is not an FMA chain).
//!
//! MXFP4 decoding: a byte table maps each nibble to `2 * |E2M1|` (an integer 0..12) with the
//! sign in bit 7; `(2|v|) * 2^(scale-128)` is the same real number as `|v| * 2^(scale-127)`,
//! so the single rounding (only ever an overflow to inf) is identical to the scalar
//! `E2M1[nibble] * scale`, and the sign bit is OR-ed in afterwards (`-0` for nibble 8, as in
//! the scalar table).

use std::arch::aarch64::*;

use crate::matvec::E8M0;
use crate::reduce::{LANES, bf16_tail, fma_tail, tree16};

/// Rows processed together by the matvec kernels.
const ROWS: usize = 4;

/// Nibble -> `2 * |E2M1|` with the sign in bit 7.
const NIBBLE_CODE: [u8; 16] = [
    0, 1, 2, 3, 4, 6, 8, 12, 0x80, 0x81, 0x82, 0x83, 0x84, 0x86, 0x88, 0x8C,
];

type Acc = [float32x4_t; 4];

#[inline]
#[target_feature(enable = "neon")]
fn zero() -> Acc {
    [vdupq_n_f32(0.0); 4]
}

#[inline]
#[target_feature(enable = "neon")]
fn lanes(a: &Acc) -> [f32; LANES] {
    let mut l = [0.0f32; LANES];
    for (q, v) in a.iter().enumerate() {
        // SAFETY: `l` holds 16 f32; q < 4 so 4 floats at 4q are in bounds.
        unsafe { vst1q_f32(l.as_mut_ptr().add(4 * q), *v) };
    }
    l
}

/// Canonical dot (see `crate::reduce`).
///
/// # Safety
/// NEON must be available (always true on aarch64 Linux).
#[target_feature(enable = "neon")]
pub(crate) unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let full = a.len().min(b.len()) / LANES * LANES;
    let mut acc = zero();
    let mut c = 0;
    while c < full {
        for (q, v) in acc.iter_mut().enumerate() {
            // SAFETY: c + 16 <= full <= len of both slices.
            let (va, vb) = unsafe {
                (
                    vld1q_f32(a.as_ptr().add(c + 4 * q)),
                    vld1q_f32(b.as_ptr().add(c + 4 * q)),
                )
            };
            *v = vfmaq_f32(*v, va, vb);
        }
        c += LANES;
    }
    let mut l = lanes(&acc);
    fma_tail(&mut l, &a[full..], &b[full..]);
    tree16(l)
}

/// `out[r] = dot(w[r*cols..], x)` for f32 weights.
///
/// # Safety
/// NEON must be available.
#[target_feature(enable = "neon")]
pub(crate) unsafe fn rows_f32(w: &[f32], x: &[f32], out: &mut [f32]) {
    let cols = x.len();
    assert_eq!(w.len(), out.len() * cols, "rows_f32: shape");
    let full = cols / LANES * LANES;
    let mut r = 0;
    while r < out.len() {
        let n = ROWS.min(out.len() - r);
        let mut acc = [zero(); ROWS];
        let mut c = 0;
        while c < full {
            for q in 0..4 {
                // SAFETY: c + 16 <= cols and row r + i < out.len(): loads are in bounds.
                let xv = unsafe { vld1q_f32(x.as_ptr().add(c + 4 * q)) };
                for (i, a) in acc.iter_mut().enumerate().take(n) {
                    // SAFETY: as above.
                    let wv = unsafe { vld1q_f32(w.as_ptr().add((r + i) * cols + c + 4 * q)) };
                    a[q] = vfmaq_f32(a[q], wv, xv);
                }
            }
            c += LANES;
        }
        for (i, a) in acc.iter().enumerate().take(n) {
            let row = &w[(r + i) * cols..(r + i + 1) * cols];
            let mut l = lanes(a);
            fma_tail(&mut l, &row[full..], &x[full..]);
            out[r + i] = tree16(l);
        }
        r += n;
    }
}

/// `out[r] = dot(bf16 row r, x)`.
///
/// # Safety
/// NEON must be available.
#[target_feature(enable = "neon")]
pub(crate) unsafe fn rows_bf16(w: &[u16], x: &[f32], out: &mut [f32]) {
    let cols = x.len();
    assert_eq!(w.len(), out.len() * cols, "rows_bf16: shape");
    let full = cols / LANES * LANES;
    let mut r = 0;
    while r < out.len() {
        let n = ROWS.min(out.len() - r);
        let mut acc = [zero(); ROWS];
        let mut c = 0;
        while c < full {
            for q in 0..4 {
                // SAFETY: c + 16 <= cols and row r + i < out.len(): loads are in bounds.
                let xv = unsafe { vld1q_f32(x.as_ptr().add(c + 4 * q)) };
                for (i, a) in acc.iter_mut().enumerate().take(n) {
                    // SAFETY: as above; 4 u16 at this offset are inside row r + i.
                    let h = unsafe { vld1_u16(w.as_ptr().add((r + i) * cols + c + 4 * q)) };
                    let wv = vreinterpretq_f32_u32(vshll_n_u16::<16>(h));
                    a[q] = vfmaq_f32(a[q], wv, xv);
                }
            }
            c += LANES;
        }
        for (i, a) in acc.iter().enumerate().take(n) {
            let row = &w[(r + i) * cols..(r + i + 1) * cols];
            let mut l = lanes(a);
            bf16_tail(&mut l, &row[full..], &x[full..]);
            out[r + i] = tree16(l);
        }
        r += n;
    }
}

/// Decodes 16 nibbles (one per byte of `nib`, in element order) into 4 x 4 f32.
#[inline]
#[target_feature(enable = "neon")]
fn decode16(nib: uint8x16_t, table: uint8x16_t, half_scale: float32x4_t) -> Acc {
    let code = vqtbl1q_u8(table, nib);
    let c16 = [vmovl_u8(vget_low_u8(code)), vmovl_high_u8(code)];
    let c32 = [
        vmovl_u16(vget_low_u16(c16[0])),
        vmovl_high_u16(c16[0]),
        vmovl_u16(vget_low_u16(c16[1])),
        vmovl_high_u16(c16[1]),
    ];
    c32.map(|c| {
        let mag = vcvtq_f32_u32(vandq_u32(c, vdupq_n_u32(0x7F)));
        let val = vmulq_f32(mag, half_scale);
        let sign = vshlq_n_u32::<24>(vandq_u32(c, vdupq_n_u32(0x80)));
        vreinterpretq_f32_u32(vorrq_u32(vreinterpretq_u32_f32(val), sign))
    })
}

/// `out[r] = dot(decoded MXFP4 row r, x)`; `cols % 32 == 0`.
///
/// # Safety
/// NEON must be available.
#[target_feature(enable = "neon")]
pub(crate) unsafe fn rows_mxfp4(packed: &[u8], scales: &[u8], x: &[f32], out: &mut [f32]) {
    let cols = x.len();
    let nb = cols / 32;
    assert!(
        cols.is_multiple_of(32)
            && packed.len() == out.len() * cols / 2
            && scales.len() == out.len() * nb,
        "rows_mxfp4: shape"
    );
    // SAFETY: NIBBLE_CODE holds 16 bytes.
    let table = unsafe { vld1q_u8(NIBBLE_CODE.as_ptr()) };
    let mut r = 0;
    while r < out.len() {
        let n = ROWS.min(out.len() - r);
        let mut acc = [zero(); ROWS];
        for b in 0..nb {
            let mut xs = zero();
            let mut xs2 = zero();
            for q in 0..4 {
                // SAFETY: block b < nb, so x has 32 floats at 32b.
                unsafe {
                    xs[q] = vld1q_f32(x.as_ptr().add(32 * b + 4 * q));
                    xs2[q] = vld1q_f32(x.as_ptr().add(32 * b + 16 + 4 * q));
                }
            }
            for (i, a) in acc.iter_mut().enumerate().take(n) {
                let half_scale = vdupq_n_f32(E8M0[scales[(r + i) * nb + b] as usize] * 0.5);
                // SAFETY: row r + i has 16 bytes at 16b of its cols/2 bytes.
                let v = unsafe { vld1q_u8(packed.as_ptr().add((r + i) * cols / 2 + 16 * b)) };
                let lo = vandq_u8(v, vdupq_n_u8(0x0F));
                let hi = vshrq_n_u8::<4>(v);
                // zip: [lo0, hi0, lo1, hi1, ..] = nibbles of elements 0..16, then 16..32
                let w0 = decode16(vzip1q_u8(lo, hi), table, half_scale);
                let w1 = decode16(vzip2q_u8(lo, hi), table, half_scale);
                for q in 0..4 {
                    a[q] = vfmaq_f32(a[q], w0[q], xs[q]);
                }
                for q in 0..4 {
                    a[q] = vfmaq_f32(a[q], w1[q], xs2[q]);
                }
            }
        }
        for (i, a) in acc.iter().enumerate().take(n) {
            out[r + i] = tree16(lanes(a));
        }
        r += n;
    }
}
