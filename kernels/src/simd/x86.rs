//! x86-64 fast paths: AVX-512F and AVX2+FMA versions of the canonical dot and matvec rows.
//!
//! Owns: instruction sequences that reproduce `crate::reduce`'s order exactly: logical lane
//! `j` of the 16 canonical lanes is SIMD lane `j` (AVX-512: one `__m512`; AVX2: lanes 0..8 in
//! a low `__m256`, 8..16 in a high one); every accumulation is `vfmadd` (one rounding, like
//! `f32::mul_add`); the tail past the last full 16-block and the pairwise tree run in scalar
//! code shared with the reference. Several rows are kept in flight (independent accumulators
//! per row) to hide FMA latency; that never changes any row's order.
//! Must not: use `vdpbf16ps` (its internal rounding differs from an FMA chain) or reassociate.
//!
//! Every function here requires its target features; callers dispatch on a detected [`Isa`].
//!
//! [`Isa`]: crate::isa::Isa

use std::arch::x86_64::*;

use crate::matvec::{E2M1, E8M0};
use crate::reduce::{LANES, bf16_tail, fma_tail, tree16};

/// Rows processed together by the matvec kernels.
const ROWS: usize = 4;

// -------------------------------------------------------------------------------------------
// AVX-512F
// -------------------------------------------------------------------------------------------

pub(crate) mod avx512 {
    use super::*;

    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    fn lanes(v: __m512) -> [f32; LANES] {
        let mut l = [0.0f32; LANES];
        // SAFETY: `l` holds exactly 16 f32.
        unsafe { _mm512_storeu_ps(l.as_mut_ptr(), v) };
        l
    }

    /// 16 bf16 at `p` widened exactly to f32 (`bits << 16`).
    ///
    /// # Safety
    /// `p..p+16` must be readable.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn bf16x16(p: *const u16) -> __m512 {
        // SAFETY: the caller guarantees 16 readable u16 (32 bytes) at p.
        let h = unsafe { _mm256_loadu_si256(p.cast()) };
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
    }

    /// Canonical dot (see `crate::reduce`).
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(crate) fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
        let full = a.len().min(b.len()) / LANES * LANES;
        let mut acc = _mm512_setzero_ps();
        let mut c = 0;
        while c < full {
            // SAFETY: c + 16 <= full <= len of both slices.
            let (va, vb) = unsafe {
                (
                    _mm512_loadu_ps(a.as_ptr().add(c)),
                    _mm512_loadu_ps(b.as_ptr().add(c)),
                )
            };
            acc = _mm512_fmadd_ps(va, vb, acc);
            c += LANES;
        }
        let mut l = lanes(acc);
        fma_tail(&mut l, &a[full..], &b[full..]);
        tree16(l)
    }

    /// `out[r] = dot(w[r*cols..], x)` for f32 weights.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(crate) fn rows_f32(w: &[f32], x: &[f32], out: &mut [f32]) {
        let cols = x.len();
        assert_eq!(w.len(), out.len() * cols, "rows_f32: shape");
        let full = cols / LANES * LANES;
        let mut r = 0;
        while r < out.len() {
            let n = ROWS.min(out.len() - r);
            let mut acc = [_mm512_setzero_ps(); ROWS];
            let mut c = 0;
            while c < full {
                // SAFETY: c + 16 <= cols and row r + i < out.len(), so every load is in bounds.
                unsafe {
                    let xv = _mm512_loadu_ps(x.as_ptr().add(c));
                    for (i, a) in acc.iter_mut().enumerate().take(n) {
                        let wv = _mm512_loadu_ps(w.as_ptr().add((r + i) * cols + c));
                        *a = _mm512_fmadd_ps(wv, xv, *a);
                    }
                }
                c += LANES;
            }
            for (i, a) in acc.iter().enumerate().take(n) {
                let row = &w[(r + i) * cols..(r + i + 1) * cols];
                let mut l = lanes(*a);
                fma_tail(&mut l, &row[full..], &x[full..]);
                out[r + i] = tree16(l);
            }
            r += n;
        }
    }

    /// `out[r] = dot(bf16 row r, x)`.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(crate) fn rows_bf16(w: &[u16], x: &[f32], out: &mut [f32]) {
        let cols = x.len();
        assert_eq!(w.len(), out.len() * cols, "rows_bf16: shape");
        let full = cols / LANES * LANES;
        let mut r = 0;
        while r < out.len() {
            let n = ROWS.min(out.len() - r);
            let mut acc = [_mm512_setzero_ps(); ROWS];
            let mut c = 0;
            while c < full {
                // SAFETY: c + 16 <= cols and row r + i < out.len(), so every load is in bounds.
                unsafe {
                    let xv = _mm512_loadu_ps(x.as_ptr().add(c));
                    for (i, a) in acc.iter_mut().enumerate().take(n) {
                        let wv = bf16x16(w.as_ptr().add((r + i) * cols + c));
                        *a = _mm512_fmadd_ps(wv, xv, *a);
                    }
                }
                c += LANES;
            }
            for (i, a) in acc.iter().enumerate().take(n) {
                let row = &w[(r + i) * cols..(r + i + 1) * cols];
                let mut l = lanes(*a);
                bf16_tail(&mut l, &row[full..], &x[full..]);
                out[r + i] = tree16(l);
            }
            r += n;
        }
    }

    /// Elements `0..16` and `16..32` of one MXFP4 block (16 bytes at `p`), decoded exactly:
    /// lane `j` of the first vector is element `j`, of the second element `16 + j`.
    ///
    /// # Safety
    /// `p..p+16` must be readable.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn mxfp4_block(p: *const u8, table: __m512) -> (__m512, __m512) {
        // SAFETY: the caller guarantees 16 readable bytes at p.
        let v = unsafe { _mm_loadu_si128(p.cast()) };
        // element 2j is the low nibble of byte j, 2j+1 the high nibble
        let shift = _mm512_set_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0);
        let lo = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(v, v)), shift);
        let hi = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(v, v)), shift);
        // vpermps reads only the low 4 bits of each index: the nibble.
        (
            _mm512_permutexvar_ps(lo, table),
            _mm512_permutexvar_ps(hi, table),
        )
    }

    /// `out[r] = dot(decoded MXFP4 row r, x)`; `cols % 32 == 0`.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(crate) fn rows_mxfp4(packed: &[u8], scales: &[u8], x: &[f32], out: &mut [f32]) {
        let cols = x.len();
        let nb = cols / 32;
        assert!(
            cols.is_multiple_of(32)
                && packed.len() == out.len() * cols / 2
                && scales.len() == out.len() * nb,
            "rows_mxfp4: shape"
        );
        // SAFETY: E2M1 holds exactly 16 f32.
        let e2m1 = unsafe { _mm512_loadu_ps(E2M1.as_ptr()) };
        let mut r = 0;
        while r < out.len() {
            let n = ROWS.min(out.len() - r);
            let mut acc = [_mm512_setzero_ps(); ROWS];
            for b in 0..nb {
                // SAFETY: block b < nb: x has 32 floats at 32b, each row has 16 bytes at
                // (r+i)*cols/2 + 16b, all inside the slices checked above.
                unsafe {
                    let x0 = _mm512_loadu_ps(x.as_ptr().add(32 * b));
                    let x1 = _mm512_loadu_ps(x.as_ptr().add(32 * b + 16));
                    for (i, a) in acc.iter_mut().enumerate().take(n) {
                        let s = E8M0[*scales.get_unchecked((r + i) * nb + b) as usize];
                        // exact: a power of two times a 2-bit-significand value
                        let table = _mm512_mul_ps(e2m1, _mm512_set1_ps(s));
                        let p = packed.as_ptr().add((r + i) * cols / 2 + 16 * b);
                        let (w0, w1) = mxfp4_block(p, table);
                        *a = _mm512_fmadd_ps(w0, x0, *a);
                        *a = _mm512_fmadd_ps(w1, x1, *a);
                    }
                }
            }
            for (i, a) in acc.iter().enumerate().take(n) {
                out[r + i] = tree16(lanes(*a));
            }
            r += n;
        }
    }
}

// -------------------------------------------------------------------------------------------
// AVX2 + FMA: canonical lanes 0..8 in `.0`, 8..16 in `.1`
// -------------------------------------------------------------------------------------------

pub(crate) mod avx2 {
    use super::*;

    #[derive(Clone, Copy)]
    struct Acc(__m256, __m256);

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn zero() -> Acc {
        Acc(_mm256_setzero_ps(), _mm256_setzero_ps())
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn lanes(a: Acc) -> [f32; LANES] {
        let mut l = [0.0f32; LANES];
        // SAFETY: `l` holds 16 f32: 8 at offset 0 and 8 at offset 8.
        unsafe {
            _mm256_storeu_ps(l.as_mut_ptr(), a.0);
            _mm256_storeu_ps(l.as_mut_ptr().add(8), a.1);
        }
        l
    }

    /// 8 bf16 at `p` widened exactly to f32.
    ///
    /// # Safety
    /// `p..p+8` must be readable.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn bf16x8(p: *const u16) -> __m256 {
        // SAFETY: the caller guarantees 8 readable u16 at p.
        let h = unsafe { _mm_loadu_si128(p.cast()) };
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
    }

    /// Canonical dot.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
        let full = a.len().min(b.len()) / LANES * LANES;
        let mut acc = zero();
        let mut c = 0;
        while c < full {
            // SAFETY: c + 16 <= full <= len of both slices.
            unsafe {
                let (pa, pb) = (a.as_ptr().add(c), b.as_ptr().add(c));
                acc.0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa), _mm256_loadu_ps(pb), acc.0);
                acc.1 = _mm256_fmadd_ps(
                    _mm256_loadu_ps(pa.add(8)),
                    _mm256_loadu_ps(pb.add(8)),
                    acc.1,
                );
            }
            c += LANES;
        }
        let mut l = lanes(acc);
        fma_tail(&mut l, &a[full..], &b[full..]);
        tree16(l)
    }

    /// `out[r] = dot(w[r*cols..], x)` for f32 weights.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) fn rows_f32(w: &[f32], x: &[f32], out: &mut [f32]) {
        let cols = x.len();
        assert_eq!(w.len(), out.len() * cols, "rows_f32: shape");
        let full = cols / LANES * LANES;
        let mut r = 0;
        while r < out.len() {
            let n = ROWS.min(out.len() - r);
            let mut acc = [zero(); ROWS];
            let mut c = 0;
            while c < full {
                // SAFETY: c + 16 <= cols and row r + i < out.len(), so every load is in bounds.
                unsafe {
                    let x0 = _mm256_loadu_ps(x.as_ptr().add(c));
                    let x1 = _mm256_loadu_ps(x.as_ptr().add(c + 8));
                    for (i, a) in acc.iter_mut().enumerate().take(n) {
                        let p = w.as_ptr().add((r + i) * cols + c);
                        a.0 = _mm256_fmadd_ps(_mm256_loadu_ps(p), x0, a.0);
                        a.1 = _mm256_fmadd_ps(_mm256_loadu_ps(p.add(8)), x1, a.1);
                    }
                }
                c += LANES;
            }
            for (i, a) in acc.iter().enumerate().take(n) {
                let row = &w[(r + i) * cols..(r + i + 1) * cols];
                let mut l = lanes(*a);
                fma_tail(&mut l, &row[full..], &x[full..]);
                out[r + i] = tree16(l);
            }
            r += n;
        }
    }

    /// `out[r] = dot(bf16 row r, x)`.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) fn rows_bf16(w: &[u16], x: &[f32], out: &mut [f32]) {
        let cols = x.len();
        assert_eq!(w.len(), out.len() * cols, "rows_bf16: shape");
        let full = cols / LANES * LANES;
        let mut r = 0;
        while r < out.len() {
            let n = ROWS.min(out.len() - r);
            let mut acc = [zero(); ROWS];
            let mut c = 0;
            while c < full {
                // SAFETY: c + 16 <= cols and row r + i < out.len(), so every load is in bounds.
                unsafe {
                    let x0 = _mm256_loadu_ps(x.as_ptr().add(c));
                    let x1 = _mm256_loadu_ps(x.as_ptr().add(c + 8));
                    for (i, a) in acc.iter_mut().enumerate().take(n) {
                        let p = w.as_ptr().add((r + i) * cols + c);
                        a.0 = _mm256_fmadd_ps(bf16x8(p), x0, a.0);
                        a.1 = _mm256_fmadd_ps(bf16x8(p.add(8)), x1, a.1);
                    }
                }
                c += LANES;
            }
            for (i, a) in acc.iter().enumerate().take(n) {
                let row = &w[(r + i) * cols..(r + i + 1) * cols];
                let mut l = lanes(*a);
                bf16_tail(&mut l, &row[full..], &x[full..]);
                out[r + i] = tree16(l);
            }
            r += n;
        }
    }

    /// Decodes 8 elements whose bytes (each repeated twice) are in the low 8 bytes of `d`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn mxfp4_x8(d: __m128i, mag: __m256) -> __m256 {
        let shift = _mm256_set_epi32(4, 0, 4, 0, 4, 0, 4, 0);
        let idx = _mm256_srlv_epi32(_mm256_cvtepu8_epi32(d), shift);
        // vpermps reads the low 3 bits (magnitude); bit 3 of the nibble is the sign.
        let m = _mm256_permutevar8x32_ps(mag, idx);
        let sign = _mm256_slli_epi32::<28>(idx);
        let sign = _mm256_and_si256(sign, _mm256_set1_epi32(i32::MIN));
        _mm256_xor_ps(m, _mm256_castsi256_ps(sign))
    }

    /// `out[r] = dot(decoded MXFP4 row r, x)`; `cols % 32 == 0`.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) fn rows_mxfp4(packed: &[u8], scales: &[u8], x: &[f32], out: &mut [f32]) {
        let cols = x.len();
        let nb = cols / 32;
        assert!(
            cols.is_multiple_of(32)
                && packed.len() == out.len() * cols / 2
                && scales.len() == out.len() * nb,
            "rows_mxfp4: shape"
        );
        // SAFETY: E2M1 holds 16 f32; the first 8 are the non-negative magnitudes.
        let e2m1 = unsafe { _mm256_loadu_ps(E2M1.as_ptr()) };
        let mut r = 0;
        while r < out.len() {
            let n = ROWS.min(out.len() - r);
            let mut acc = [zero(); ROWS];
            for b in 0..nb {
                // SAFETY: block b < nb: x has 32 floats at 32b, each row has 16 bytes at
                // (r+i)*cols/2 + 16b, all inside the slices checked above.
                unsafe {
                    let xp = x.as_ptr().add(32 * b);
                    let xs = [
                        _mm256_loadu_ps(xp),
                        _mm256_loadu_ps(xp.add(8)),
                        _mm256_loadu_ps(xp.add(16)),
                        _mm256_loadu_ps(xp.add(24)),
                    ];
                    for (i, a) in acc.iter_mut().enumerate().take(n) {
                        let s = E8M0[*scales.get_unchecked((r + i) * nb + b) as usize];
                        // exact: (-m) * s == -(m * s), so sign-xor after scaling matches scalar
                        let mag = _mm256_mul_ps(e2m1, _mm256_set1_ps(s));
                        let p = packed.as_ptr().add((r + i) * cols / 2 + 16 * b);
                        let v = _mm_loadu_si128(p.cast());
                        let lo = _mm_unpacklo_epi8(v, v); // elements 0..16
                        let hi = _mm_unpackhi_epi8(v, v); // elements 16..32
                        a.0 = _mm256_fmadd_ps(mxfp4_x8(lo, mag), xs[0], a.0);
                        a.1 = _mm256_fmadd_ps(mxfp4_x8(_mm_srli_si128::<8>(lo), mag), xs[1], a.1);
                        a.0 = _mm256_fmadd_ps(mxfp4_x8(hi, mag), xs[2], a.0);
                        a.1 = _mm256_fmadd_ps(mxfp4_x8(_mm_srli_si128::<8>(hi), mag), xs[3], a.1);
                    }
                }
            }
            for (i, a) in acc.iter().enumerate().take(n) {
                out[r + i] = tree16(lanes(*a));
            }
            r += n;
        }
    }
}
