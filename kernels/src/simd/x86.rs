//! x86-64 fast paths: AVX-512F and AVX2+FMA versions of the canonical dot and matvec rows.
//!
//! Owns: instruction sequences that reproduce `crate::reduce`'s order exactly: every
//! accumulation is `vfmadd` (one rounding, like `f32::mul_add`); each of the 16 canonical lanes
//! lives in one SIMD lane and sees its elements in ascending order; the tail past the last full
//! 16-block and the pairwise tree run in scalar code shared with the reference. `R` rows are
//! kept in flight (independent accumulators, fully unrolled) to hide FMA latency; while a group
//! of rows is computed, the next group's rows (contiguous in memory) are prefetched into L2.
//! Neither changes any row's order. The several-input kernels (`*_many`, AVX-512) keep a
//! group of rows x inputs in flight, one accumulator per (row, input), each fed exactly the
//! FMAs the one-input kernel gives that row and input.
//! Must not: use `vdpbf16ps` (its internal rounding differs from an FMA chain) or reassociate.
//!
//! Lane maps: AVX-512 bf16/f32: physical lane j = canonical lane j. AVX-512 MXFP4: one
//! `__m512` accumulator per row, physical lane j = canonical lane 8 * (j % 2) + j / 2 (x
//! permuted to match; lanes restored before the tree). AVX2: canonical lanes 0..8 in a low
//! `__m256`, 8..16 in a high one.
//!
//! Every function here requires its target features; callers dispatch on a detected `Isa`.

use std::arch::x86_64::*;

use crate::matvec::{E2M1, E8M0};
use crate::reduce::{LANES, bf16_tail, fma_tail, tree16};

/// Runs `group::<$rows>` over full groups of rows, then `group::<1>` over the rest.
macro_rules! row_groups {
    ($rows:expr, $out:expr, $group:ident, $($arg:expr),*) => {{
        let out: &mut [f32] = $out;
        let mut r = 0;
        while r + $rows <= out.len() {
            $group::<{ $rows }>($($arg,)* r, &mut out[r..r + $rows]);
            r += $rows;
        }
        while r < out.len() {
            $group::<1>($($arg,)* r, &mut out[r..r + 1]);
            r += 1;
        }
    }};
}

/// The rows of a several-input bf16 call, after checking every shape its kernels read within
/// (one output per input, `w` = rows x cols for every input).
fn bf16_many_rows(w: &[u16], xs: &[&[f32]], outs: &[&mut [f32]]) -> usize {
    let rows = outs.first().map_or(0, |o| o.len());
    assert!(
        xs.len() == outs.len()
            && xs.iter().all(|x| w.len() == rows * x.len())
            && outs.iter().all(|o| o.len() == rows),
        "rows_bf16_many: shape"
    );
    rows
}

/// [`bf16_many_rows`] for MXFP4 (`cols % 32 == 0`, packed and scale bytes of rows x cols).
fn mxfp4_many_rows(packed: &[u8], scales: &[u8], xs: &[&[f32]], outs: &[&mut [f32]]) -> usize {
    let rows = outs.first().map_or(0, |o| o.len());
    assert!(
        xs.len() == outs.len()
            && xs.iter().all(|x| {
                x.len().is_multiple_of(32)
                    && packed.len() == rows * x.len() / 2
                    && scales.len() == rows * x.len() / 32
            })
            && outs.iter().all(|o| o.len() == rows),
        "rows_mxfp4_many: shape"
    );
    rows
}

// -------------------------------------------------------------------------------------------
// AVX-512F
// -------------------------------------------------------------------------------------------

/// Rows `r0..r0+R` of a row-major matrix with `cols` columns, as slices. (A plain loop:
/// `std::array::from_fn` here was not inlined into the `target_feature` kernels and cost ~2.5%
/// of decode samples in closure calls.)
#[inline(always)]
fn rows_of<T, const R: usize>(w: &[T], r0: usize, cols: usize) -> [&[T]; R] {
    let block = &w[r0 * cols..(r0 + R) * cols];
    let mut out: [&[T]; R] = [&[]; R];
    for (i, o) in out.iter_mut().enumerate() {
        *o = &block[i * cols..(i + 1) * cols];
    }
    out
}

/// Prefetches (into L2) the cache line at `p + ahead` bytes; never faults, never reads.
#[inline(always)]
fn prefetch_l2<T>(p: *const T, ahead_bytes: usize) {
    // SAFETY: prefetch is a hint; it does not fault on any address (wrapping_add avoids
    // creating an out-of-bounds pointer through `add`).
    unsafe { _mm_prefetch::<_MM_HINT_T1>(p.cast::<i8>().wrapping_add(ahead_bytes)) };
}

pub(crate) mod avx512 {
    use super::*;

    /// Rows in flight (32 vector registers leave room for 8 accumulators and temporaries).
    const ROWS: usize = 8;

    #[inline]
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
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
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
    unsafe fn bf16x16(p: *const u16) -> __m512 {
        // SAFETY: the caller guarantees 16 readable u16 (32 bytes) at p.
        let h = unsafe { _mm256_loadu_si256(p.cast()) };
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
    }

    /// Canonical dot (see `crate::reduce`).
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
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

    /// Rows `r0..r0+R` of an f32 matvec into `out` (`out.len() == R`).
    #[inline]
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
    fn group_f32<const R: usize>(w: &[f32], x: &[f32], r0: usize, out: &mut [f32]) {
        let cols = x.len();
        let rows: [&[f32]; R] = rows_of(w, r0, cols);
        let full = cols / LANES * LANES;
        let mut acc = [_mm512_setzero_ps(); R];
        let mut c = 0;
        while c < full {
            // SAFETY: c + 16 <= full <= cols = length of x and of every row.
            unsafe {
                let xv = _mm512_loadu_ps(x.as_ptr().add(c));
                for i in 0..R {
                    let p = rows[i].as_ptr().add(c);
                    prefetch_l2(p, R * cols * 4);
                    acc[i] = _mm512_fmadd_ps(_mm512_loadu_ps(p), xv, acc[i]);
                }
            }
            c += LANES;
        }
        for i in 0..R {
            let mut l = lanes(acc[i]);
            fma_tail(&mut l, &rows[i][full..], &x[full..]);
            out[i] = tree16(l);
        }
    }

    /// `out[r] = dot(w[r*cols..], x)` for f32 weights.
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
    pub(crate) fn rows_f32(w: &[f32], x: &[f32], out: &mut [f32]) {
        assert_eq!(w.len(), out.len() * x.len(), "rows_f32: shape");
        row_groups!(ROWS, out, group_f32, w, x);
    }

    /// Rows `r0..r0+R` of a bf16 matvec.
    #[inline]
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
    fn group_bf16<const R: usize>(w: &[u16], x: &[f32], r0: usize, out: &mut [f32]) {
        let cols = x.len();
        let rows: [&[u16]; R] = rows_of(w, r0, cols);
        let full = cols / LANES * LANES;
        let mut acc = [_mm512_setzero_ps(); R];
        let mut c = 0;
        while c < full {
            // SAFETY: c + 16 <= full <= cols = length of x and of every row.
            unsafe {
                let xv = _mm512_loadu_ps(x.as_ptr().add(c));
                for i in 0..R {
                    let p = rows[i].as_ptr().add(c);
                    if c.is_multiple_of(32) {
                        prefetch_l2(p, R * cols * 2); // one 64-byte line per two steps
                    }
                    acc[i] = _mm512_fmadd_ps(bf16x16(p), xv, acc[i]);
                }
            }
            c += LANES;
        }
        for i in 0..R {
            let mut l = lanes(acc[i]);
            bf16_tail(&mut l, &rows[i][full..], &x[full..]);
            out[i] = tree16(l);
        }
    }

    /// `out[r] = dot(bf16 row r, x)`.
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
    pub(crate) fn rows_bf16(w: &[u16], x: &[f32], out: &mut [f32]) {
        assert_eq!(w.len(), out.len() * x.len(), "rows_bf16: shape");
        row_groups!(ROWS, out, group_bf16, w, x);
    }

    /// Rows `r0..r0+R` of a bf16 matvec for `N` inputs at once (`outs[t][r0 + i]` = row `i`
    /// times `xs[t]`): each 16 weights are widened once and multiplied into every input's
    /// accumulator. The accumulator of (row, input) sees exactly the FMAs [`group_bf16`] gives
    /// that row and input, in the same order, then the same tail and tree: the same bits.
    #[inline]
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
    fn group_bf16_n<const R: usize, const N: usize>(
        w: &[u16],
        xs: [&[f32]; N],
        r0: usize,
        outs: &mut [&mut [f32]],
    ) {
        let cols = xs[0].len();
        let rows: [&[u16]; R] = rows_of(w, r0, cols);
        let full = cols / LANES * LANES;
        let mut acc = [[_mm512_setzero_ps(); N]; R];
        let mut c = 0;
        while c < full {
            // SAFETY: c + 16 <= full <= cols = length of every input and of every row.
            unsafe {
                let mut xv = [_mm512_setzero_ps(); N];
                for t in 0..N {
                    xv[t] = _mm512_loadu_ps(xs[t].as_ptr().add(c));
                }
                for i in 0..R {
                    let p = rows[i].as_ptr().add(c);
                    if c.is_multiple_of(32) {
                        prefetch_l2(p, R * cols * 2); // the next group's rows
                    }
                    let wv = bf16x16(p);
                    for t in 0..N {
                        acc[i][t] = _mm512_fmadd_ps(wv, xv[t], acc[i][t]);
                    }
                }
            }
            c += LANES;
        }
        for i in 0..R {
            for t in 0..N {
                let mut l = lanes(acc[i][t]);
                bf16_tail(&mut l, &rows[i][full..], &xs[t][full..]);
                outs[t][r0 + i] = tree16(l);
            }
        }
    }

    /// Every row of `w` for `N` inputs (see [`group_bf16_n`]).
    #[inline]
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
    fn rows_bf16_n<const N: usize>(w: &[u16], xs: [&[f32]; N], outs: &mut [&mut [f32]]) {
        let rows = outs[0].len();
        let mut r = 0;
        while r + MANY_ROWS <= rows {
            group_bf16_n::<MANY_ROWS, N>(w, xs, r, outs);
            r += MANY_ROWS;
        }
        while r < rows {
            group_bf16_n::<1, N>(w, xs, r, outs);
            r += 1;
        }
    }

    /// Rows in flight of the several-input kernels (times the inputs: the accumulators).
    const MANY_ROWS: usize = 4;

    /// `outs[t][r] = dot(bf16 row r, xs[t])` for every input: inputs four at a time through
    /// [`group_bf16_n`], then two, then one ([`rows_bf16`]); the same bits as [`rows_bf16`]
    /// of each input.
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
    pub(crate) fn rows_bf16_many(w: &[u16], xs: &[&[f32]], outs: &mut [&mut [f32]]) {
        bf16_many_rows(w, xs, outs);
        let mut t = 0;
        while t + 4 <= xs.len() {
            let x = [xs[t], xs[t + 1], xs[t + 2], xs[t + 3]];
            rows_bf16_n::<4>(w, x, &mut outs[t..t + 4]);
            t += 4;
        }
        if t + 2 <= xs.len() {
            rows_bf16_n::<2>(w, [xs[t], xs[t + 1]], &mut outs[t..t + 2]);
            t += 2;
        }
        if t < xs.len() {
            rows_bf16(w, xs[t], outs[t]);
        }
    }

    /// Rows `r0..r0+R` of an MXFP4 matvec (`cols % 32 == 0`).
    ///
    /// Per row and block: the table `E2M1 * scale` (16 exact products, one 512-bit multiply),
    /// then for each half-block (8 bytes, 16 elements) one broadcast load of the 8 bytes to
    /// every qword lane and one `vpsrlvd` that puts a nibble in the low 4 bits of each dword:
    /// lane j takes dword j % 2 shifted by 4 * (j / 2), i.e. element 8 * (j % 2) + j / 2 of
    /// the half. `vpermps` reads only those 4 bits to look the value up; one FMA per half.
    /// The half-blocks' elements c and c + 16 share a lane, first c then c + 16, as the
    /// canonical order wants; x is permuted to the same lane map once per block, and the
    /// accumulator's lanes are put back in canonical order before the tree. On Zen 4 this is
    /// 25-45% faster than widening bytes with `vpmovzxbd` and looking up 8 lanes at a time
    /// (docs/history/PERFORMANCE-LOG.md §2.6).
    #[inline]
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
    fn group_mxfp4<const R: usize>(
        packed: &[u8],
        scales: &[u8],
        x: &[f32],
        r0: usize,
        out: &mut [f32],
    ) {
        let cols = x.len();
        let (pb, nb) = (cols / 2, cols / 32);
        let prow: [&[u8]; R] = rows_of(packed, r0, pb);
        let srow: [&[u8]; R] = rows_of(scales, r0, nb);
        // SAFETY: E2M1 holds exactly 16 f32.
        let table = unsafe { _mm512_loadu_ps(E2M1.as_ptr()) };
        // lane j: the nibble at bit 4 * (j / 2) of dword j % 2 (element 8 * (j % 2) + j / 2)
        let shifts = _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28);
        let x_lanes = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
        let mut acc = [_mm512_setzero_ps(); R];
        for b in 0..nb {
            // SAFETY: b < nb: x has 32 floats at 32b; every packed row has 16 bytes at 16b.
            unsafe {
                let xp = x.as_ptr().add(32 * b);
                let x_lo = _mm512_permutexvar_ps(x_lanes, _mm512_loadu_ps(xp)); // elements 0..16
                let x_hi = _mm512_permutexvar_ps(x_lanes, _mm512_loadu_ps(xp.add(16))); // 16..32
                for i in 0..R {
                    // exact: a power of two times a 2-bit-significand value
                    let s = _mm512_set1_ps(E8M0[srow[i][b] as usize]);
                    let t = _mm512_mul_ps(table, s);
                    let p = prow[i].as_ptr().add(16 * b);
                    if b.is_multiple_of(4) {
                        prefetch_l2(p, R * pb); // one 64-byte line per four blocks
                    }
                    let q_lo = _mm512_set1_epi64(std::ptr::read_unaligned(p.cast::<i64>()));
                    let q_hi = _mm512_set1_epi64(std::ptr::read_unaligned(p.add(8).cast::<i64>()));
                    let w_lo = _mm512_permutexvar_ps(_mm512_srlv_epi32(q_lo, shifts), t);
                    let w_hi = _mm512_permutexvar_ps(_mm512_srlv_epi32(q_hi, shifts), t);
                    acc[i] = _mm512_fmadd_ps(w_lo, x_lo, acc[i]);
                    acc[i] = _mm512_fmadd_ps(w_hi, x_hi, acc[i]);
                }
            }
        }
        for i in 0..R {
            let a = lanes(acc[i]);
            let mut l = [0.0f32; LANES];
            for (j, v) in a.into_iter().enumerate() {
                l[8 * (j % 2) + j / 2] = v;
            }
            out[i] = tree16(l);
        }
    }

    /// Rows `r0..r0+R` of an MXFP4 matvec for `N` inputs at once: each row block is decoded
    /// once (as in [`group_mxfp4`]) and multiplied into every input's accumulator; each input
    /// is permuted to the same lane map. The accumulator of (row, input) sees exactly the FMAs
    /// [`group_mxfp4`] gives that row and input, in the same order: the same bits.
    #[inline]
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
    fn group_mxfp4_n<const R: usize, const N: usize>(
        packed: &[u8],
        scales: &[u8],
        xs: [&[f32]; N],
        r0: usize,
        outs: &mut [&mut [f32]],
    ) {
        let cols = xs[0].len();
        let (pb, nb) = (cols / 2, cols / 32);
        let prow: [&[u8]; R] = rows_of(packed, r0, pb);
        let srow: [&[u8]; R] = rows_of(scales, r0, nb);
        // SAFETY: E2M1 holds exactly 16 f32.
        let table = unsafe { _mm512_loadu_ps(E2M1.as_ptr()) };
        let shifts = _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28);
        let x_lanes = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
        let mut acc = [[_mm512_setzero_ps(); N]; R];
        for b in 0..nb {
            // SAFETY: b < nb: every input has 32 floats at 32b; every packed row has 16 bytes
            // at 16b.
            unsafe {
                let mut x_lo = [_mm512_setzero_ps(); N];
                let mut x_hi = [_mm512_setzero_ps(); N];
                for t in 0..N {
                    let xp = xs[t].as_ptr().add(32 * b);
                    x_lo[t] = _mm512_permutexvar_ps(x_lanes, _mm512_loadu_ps(xp));
                    x_hi[t] = _mm512_permutexvar_ps(x_lanes, _mm512_loadu_ps(xp.add(16)));
                }
                for i in 0..R {
                    let s = _mm512_set1_ps(E8M0[srow[i][b] as usize]);
                    let tb = _mm512_mul_ps(table, s);
                    let p = prow[i].as_ptr().add(16 * b);
                    if b.is_multiple_of(4) {
                        prefetch_l2(p, R * pb);
                    }
                    let q_lo = _mm512_set1_epi64(std::ptr::read_unaligned(p.cast::<i64>()));
                    let q_hi = _mm512_set1_epi64(std::ptr::read_unaligned(p.add(8).cast::<i64>()));
                    let w_lo = _mm512_permutexvar_ps(_mm512_srlv_epi32(q_lo, shifts), tb);
                    let w_hi = _mm512_permutexvar_ps(_mm512_srlv_epi32(q_hi, shifts), tb);
                    for t in 0..N {
                        acc[i][t] = _mm512_fmadd_ps(w_lo, x_lo[t], acc[i][t]);
                        acc[i][t] = _mm512_fmadd_ps(w_hi, x_hi[t], acc[i][t]);
                    }
                }
            }
        }
        for i in 0..R {
            for t in 0..N {
                let a = lanes(acc[i][t]);
                let mut l = [0.0f32; LANES];
                for (j, v) in a.into_iter().enumerate() {
                    l[8 * (j % 2) + j / 2] = v;
                }
                outs[t][r0 + i] = tree16(l);
            }
        }
    }

    /// Every row of an MXFP4 matrix for `N` inputs (see [`group_mxfp4_n`]).
    #[inline]
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
    fn rows_mxfp4_n<const N: usize>(
        packed: &[u8],
        scales: &[u8],
        xs: [&[f32]; N],
        outs: &mut [&mut [f32]],
    ) {
        let rows = outs[0].len();
        let mut r = 0;
        while r + MXFP4_MANY_ROWS <= rows {
            group_mxfp4_n::<MXFP4_MANY_ROWS, N>(packed, scales, xs, r, outs);
            r += MXFP4_MANY_ROWS;
        }
        while r < rows {
            group_mxfp4_n::<1, N>(packed, scales, xs, r, outs);
            r += 1;
        }
    }

    /// Rows in flight of the several-input MXFP4 kernel.
    const MXFP4_MANY_ROWS: usize = 4;

    /// `outs[t][r] = dot(decoded MXFP4 row r, xs[t])` for every input: four at a time through
    /// [`group_mxfp4_n`], then two, then one ([`rows_mxfp4`]); the bits of [`rows_mxfp4`].
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
    pub(crate) fn rows_mxfp4_many(
        packed: &[u8],
        scales: &[u8],
        xs: &[&[f32]],
        outs: &mut [&mut [f32]],
    ) {
        mxfp4_many_rows(packed, scales, xs, outs);
        let mut t = 0;
        while t + 4 <= xs.len() {
            let x = [xs[t], xs[t + 1], xs[t + 2], xs[t + 3]];
            rows_mxfp4_n::<4>(packed, scales, x, &mut outs[t..t + 4]);
            t += 4;
        }
        if t + 2 <= xs.len() {
            rows_mxfp4_n::<2>(packed, scales, [xs[t], xs[t + 1]], &mut outs[t..t + 2]);
            t += 2;
        }
        if t < xs.len() {
            rows_mxfp4(packed, scales, xs[t], outs[t]);
        }
    }

    /// `out[r] = dot(decoded MXFP4 row r, x)`; `cols % 32 == 0`.
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
    pub(crate) fn rows_mxfp4(packed: &[u8], scales: &[u8], x: &[f32], out: &mut [f32]) {
        let cols = x.len();
        assert!(
            cols.is_multiple_of(32)
                && packed.len() == out.len() * cols / 2
                && scales.len() == out.len() * cols / 32,
            "rows_mxfp4: shape"
        );
        row_groups!(ROWS, out, group_mxfp4, packed, scales, x);
    }
}

// -------------------------------------------------------------------------------------------
// AVX2 + FMA: canonical lanes 0..8 in `.0`, 8..16 in `.1`
// -------------------------------------------------------------------------------------------

pub(crate) mod avx2 {
    use super::*;

    /// Rows in flight (two `__m256` accumulators per row; 16 vector registers).
    const ROWS: usize = 4;

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

    /// Rows `r0..r0+R` of an f32 matvec.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn group_f32<const R: usize>(w: &[f32], x: &[f32], r0: usize, out: &mut [f32]) {
        let cols = x.len();
        let rows: [&[f32]; R] = rows_of(w, r0, cols);
        let full = cols / LANES * LANES;
        let mut acc = [zero(); R];
        let mut c = 0;
        while c < full {
            // SAFETY: c + 16 <= full <= cols = length of x and of every row.
            unsafe {
                let x0 = _mm256_loadu_ps(x.as_ptr().add(c));
                let x1 = _mm256_loadu_ps(x.as_ptr().add(c + 8));
                for i in 0..R {
                    let p = rows[i].as_ptr().add(c);
                    prefetch_l2(p, R * cols * 4);
                    acc[i].0 = _mm256_fmadd_ps(_mm256_loadu_ps(p), x0, acc[i].0);
                    acc[i].1 = _mm256_fmadd_ps(_mm256_loadu_ps(p.add(8)), x1, acc[i].1);
                }
            }
            c += LANES;
        }
        for i in 0..R {
            let mut l = lanes(acc[i]);
            fma_tail(&mut l, &rows[i][full..], &x[full..]);
            out[i] = tree16(l);
        }
    }

    /// `out[r] = dot(w[r*cols..], x)` for f32 weights.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) fn rows_f32(w: &[f32], x: &[f32], out: &mut [f32]) {
        assert_eq!(w.len(), out.len() * x.len(), "rows_f32: shape");
        row_groups!(ROWS, out, group_f32, w, x);
    }

    /// Rows `r0..r0+R` of a bf16 matvec.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn group_bf16<const R: usize>(w: &[u16], x: &[f32], r0: usize, out: &mut [f32]) {
        let cols = x.len();
        let rows: [&[u16]; R] = rows_of(w, r0, cols);
        let full = cols / LANES * LANES;
        let mut acc = [zero(); R];
        let mut c = 0;
        while c < full {
            // SAFETY: c + 16 <= full <= cols = length of x and of every row.
            unsafe {
                let x0 = _mm256_loadu_ps(x.as_ptr().add(c));
                let x1 = _mm256_loadu_ps(x.as_ptr().add(c + 8));
                for i in 0..R {
                    let p = rows[i].as_ptr().add(c);
                    if c.is_multiple_of(32) {
                        prefetch_l2(p, R * cols * 2);
                    }
                    acc[i].0 = _mm256_fmadd_ps(bf16x8(p), x0, acc[i].0);
                    acc[i].1 = _mm256_fmadd_ps(bf16x8(p.add(8)), x1, acc[i].1);
                }
            }
            c += LANES;
        }
        for i in 0..R {
            let mut l = lanes(acc[i]);
            bf16_tail(&mut l, &rows[i][full..], &x[full..]);
            out[i] = tree16(l);
        }
    }

    /// `out[r] = dot(bf16 row r, x)`.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) fn rows_bf16(w: &[u16], x: &[f32], out: &mut [f32]) {
        assert_eq!(w.len(), out.len() * x.len(), "rows_bf16: shape");
        row_groups!(ROWS, out, group_bf16, w, x);
    }

    /// Decodes the 8 elements (nibbles, low first) of the little-endian dword at `p`: one
    /// broadcast load, `vpsrlvd` puts nibble j in the low bits of lane j, `vpermps` looks up
    /// the magnitude (low 3 bits), bit 3 is the sign.
    ///
    /// # Safety
    /// `p..p+4` must be readable.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn mxfp4_x8(p: *const u8, mag: __m256) -> __m256 {
        let shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
        // SAFETY: the caller guarantees 4 readable bytes at p.
        let d = unsafe { _mm256_set1_epi32(std::ptr::read_unaligned(p.cast::<i32>())) };
        let idx = _mm256_srlv_epi32(d, shifts);
        let m = _mm256_permutevar8x32_ps(mag, idx);
        let sign = _mm256_and_si256(_mm256_slli_epi32::<28>(idx), _mm256_set1_epi32(i32::MIN));
        _mm256_xor_ps(m, _mm256_castsi256_ps(sign))
    }

    /// Rows `r0..r0+R` of an MXFP4 matvec (`cols % 32 == 0`). Dword d of a block holds
    /// elements 8d..8d+8: canonical lanes 0..8 (d even, `.0`) or 8..16 (d odd, `.1`), so x needs
    /// no permutation; elements c and c + 16 reach their lane in that order.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn group_mxfp4<const R: usize>(
        packed: &[u8],
        scales: &[u8],
        x: &[f32],
        r0: usize,
        out: &mut [f32],
    ) {
        let cols = x.len();
        let (pb, nb) = (cols / 2, cols / 32);
        let prow: [&[u8]; R] = rows_of(packed, r0, pb);
        let srow: [&[u8]; R] = rows_of(scales, r0, nb);
        // SAFETY: E2M1 holds 16 f32; the first 8 are the non-negative magnitudes.
        let e2m1 = unsafe { _mm256_loadu_ps(E2M1.as_ptr()) };
        let mut acc = [zero(); R];
        for b in 0..nb {
            // SAFETY: b < nb: x has 32 floats at 32b; every packed row has 16 bytes at 16b.
            unsafe {
                let xp = x.as_ptr().add(32 * b);
                let xs = [
                    _mm256_loadu_ps(xp),
                    _mm256_loadu_ps(xp.add(8)),
                    _mm256_loadu_ps(xp.add(16)),
                    _mm256_loadu_ps(xp.add(24)),
                ];
                for i in 0..R {
                    // exact: (-m) * s == -(m * s), so the sign xor after scaling matches scalar
                    let mag = _mm256_mul_ps(e2m1, _mm256_set1_ps(E8M0[srow[i][b] as usize]));
                    let p = prow[i].as_ptr().add(16 * b);
                    if b.is_multiple_of(4) {
                        prefetch_l2(p, R * pb);
                    }
                    let a = &mut acc[i];
                    a.0 = _mm256_fmadd_ps(mxfp4_x8(p, mag), xs[0], a.0);
                    a.1 = _mm256_fmadd_ps(mxfp4_x8(p.add(4), mag), xs[1], a.1);
                    a.0 = _mm256_fmadd_ps(mxfp4_x8(p.add(8), mag), xs[2], a.0);
                    a.1 = _mm256_fmadd_ps(mxfp4_x8(p.add(12), mag), xs[3], a.1);
                }
            }
        }
        for i in 0..R {
            out[i] = tree16(lanes(acc[i]));
        }
    }

    /// Rows `r0..r0+R` of a bf16 matvec for `N` inputs at once: each 8 weights widened once
    /// and FMA'd into every input's accumulator; (row, input) sees exactly the FMAs of
    /// [`group_bf16`], so every output has its bits.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn group_bf16_n<const R: usize, const N: usize>(
        w: &[u16],
        xs: [&[f32]; N],
        r0: usize,
        outs: &mut [&mut [f32]],
    ) {
        let cols = xs[0].len();
        let rows: [&[u16]; R] = rows_of(w, r0, cols);
        let full = cols / LANES * LANES;
        let mut acc = [[zero(); N]; R];
        let mut c = 0;
        while c < full {
            // SAFETY: c + 16 <= full <= cols = length of every input and of every row.
            unsafe {
                let mut xv = [(_mm256_setzero_ps(), _mm256_setzero_ps()); N];
                for t in 0..N {
                    let xp = xs[t].as_ptr().add(c);
                    xv[t] = (_mm256_loadu_ps(xp), _mm256_loadu_ps(xp.add(8)));
                }
                for i in 0..R {
                    let p = rows[i].as_ptr().add(c);
                    if c.is_multiple_of(32) {
                        prefetch_l2(p, R * cols * 2);
                    }
                    let (w0, w1) = (bf16x8(p), bf16x8(p.add(8)));
                    for t in 0..N {
                        acc[i][t].0 = _mm256_fmadd_ps(w0, xv[t].0, acc[i][t].0);
                        acc[i][t].1 = _mm256_fmadd_ps(w1, xv[t].1, acc[i][t].1);
                    }
                }
            }
            c += LANES;
        }
        for i in 0..R {
            for t in 0..N {
                let mut l = lanes(acc[i][t]);
                bf16_tail(&mut l, &rows[i][full..], &xs[t][full..]);
                outs[t][r0 + i] = tree16(l);
            }
        }
    }

    /// `outs[t][r] = dot(bf16 row r, xs[t])` for every input: inputs two at a time through
    /// [`group_bf16_n`] (2 rows x 2 inputs: 8 of the 16 vector registers accumulate), the last
    /// one alone ([`rows_bf16`]); the bits of [`rows_bf16`] of each input.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) fn rows_bf16_many(w: &[u16], xs: &[&[f32]], outs: &mut [&mut [f32]]) {
        let rows = bf16_many_rows(w, xs, outs);
        let mut t = 0;
        while t + 2 <= xs.len() {
            let x = [xs[t], xs[t + 1]];
            let o = &mut outs[t..t + 2];
            let mut r = 0;
            while r + 2 <= rows {
                group_bf16_n::<2, 2>(w, x, r, o);
                r += 2;
            }
            if r < rows {
                group_bf16_n::<1, 2>(w, x, r, o);
            }
            t += 2;
        }
        if t < xs.len() {
            rows_bf16(w, xs[t], outs[t]);
        }
    }

    /// One row `r` of an MXFP4 matvec for two inputs at once: each 8 weights decoded once
    /// ([`mxfp4_x8`]) and FMA'd into both inputs' accumulators; (row, input) sees exactly the
    /// FMAs of [`group_mxfp4`], so every output has its bits.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn row_mxfp4_2(
        packed: &[u8],
        scales: &[u8],
        xs: [&[f32]; 2],
        r: usize,
        outs: &mut [&mut [f32]],
    ) {
        let cols = xs[0].len();
        let (pb, nb) = (cols / 2, cols / 32);
        let prow = &packed[r * pb..(r + 1) * pb];
        let srow = &scales[r * nb..(r + 1) * nb];
        // SAFETY: E2M1 holds 16 f32; the first 8 are the non-negative magnitudes.
        let e2m1 = unsafe { _mm256_loadu_ps(E2M1.as_ptr()) };
        let mut acc = [zero(); 2];
        for b in 0..nb {
            // SAFETY: b < nb: both inputs have 32 floats at 32b; the row has 16 bytes at 16b.
            unsafe {
                let mag = _mm256_mul_ps(e2m1, _mm256_set1_ps(E8M0[srow[b] as usize]));
                let p = prow.as_ptr().add(16 * b);
                if b.is_multiple_of(4) {
                    prefetch_l2(p, pb);
                }
                let w = [
                    mxfp4_x8(p, mag),
                    mxfp4_x8(p.add(4), mag),
                    mxfp4_x8(p.add(8), mag),
                    mxfp4_x8(p.add(12), mag),
                ];
                for t in 0..2 {
                    let xp = xs[t].as_ptr().add(32 * b);
                    let a = &mut acc[t];
                    a.0 = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xp), a.0);
                    a.1 = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xp.add(8)), a.1);
                    a.0 = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xp.add(16)), a.0);
                    a.1 = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xp.add(24)), a.1);
                }
            }
        }
        for t in 0..2 {
            outs[t][r] = tree16(lanes(acc[t]));
        }
    }

    /// `outs[t][r] = dot(decoded MXFP4 row r, xs[t])` for every input: two at a time through
    /// [`row_mxfp4_2`], the last one alone ([`rows_mxfp4`]); the bits of [`rows_mxfp4`].
    #[target_feature(enable = "avx2,fma")]
    pub(crate) fn rows_mxfp4_many(
        packed: &[u8],
        scales: &[u8],
        xs: &[&[f32]],
        outs: &mut [&mut [f32]],
    ) {
        let rows = mxfp4_many_rows(packed, scales, xs, outs);
        let mut t = 0;
        while t + 2 <= xs.len() {
            let x = [xs[t], xs[t + 1]];
            let o = &mut outs[t..t + 2];
            for r in 0..rows {
                row_mxfp4_2(packed, scales, x, r, o);
            }
            t += 2;
        }
        if t < xs.len() {
            rows_mxfp4(packed, scales, xs[t], outs[t]);
        }
    }

    /// `out[r] = dot(decoded MXFP4 row r, x)`; `cols % 32 == 0`.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) fn rows_mxfp4(packed: &[u8], scales: &[u8], x: &[f32], out: &mut [f32]) {
        let cols = x.len();
        assert!(
            cols.is_multiple_of(32)
                && packed.len() == out.len() * cols / 2
                && scales.len() == out.len() * cols / 32,
            "rows_mxfp4: shape"
        );
        row_groups!(ROWS, out, group_mxfp4, packed, scales, x);
    }
}

#[cfg(test)]
mod tests {
    use crate::matvec::rows_mxfp4_ref;

    /// The AVX-512 and AVX2 MXFP4 decodes (each where the CPU has it) against the reference:
    /// every E8M0 byte but 0xFF (subnormal 2^-127 and products that overflow to infinity
    /// included), every nibble, rows that fill a row group and single rows after it.
    #[test]
    fn x86_mxfp4_decodes_match_the_reference_for_every_scale_byte() {
        let (rows, cols) = (11, 32 * 24);
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let packed: Vec<u8> = (0..rows * cols / 2).map(|_| next() as u8).collect();
        // 264 scale bytes: 0..=254 in order, then a few again
        let scales: Vec<u8> = (0..rows * cols / 32).map(|i| (i % 255) as u8).collect();
        let x: Vec<f32> = (0..cols)
            .map(|_| {
                let r = next();
                let mag = f32::from_bits(0x3f80_0000 | (r as u32 & 0x007f_ffff)) - 1.0;
                let exp = 2f32.powi((r >> 32) as i32 % 40 - 20);
                if r >> 63 == 1 { -mag * exp } else { mag * exp }
            })
            .collect();
        let mut want = vec![0.0f32; rows];
        rows_mxfp4_ref(&packed, &scales, &x, &mut want);
        let same = |a: &[f32], b: &[f32]| {
            a.iter()
                .zip(b)
                .all(|(p, q)| p.to_bits() == q.to_bits() || (p.is_nan() && q.is_nan()))
        };
        use crate::isa::{Isa, is_available};
        if is_available(Isa::Avx512) {
            let mut got = vec![0.0f32; rows];
            // SAFETY: AVX-512F/VL were detected.
            unsafe { super::avx512::rows_mxfp4(&packed, &scales, &x, &mut got) };
            assert!(same(&got, &want), "avx512 decode: {got:?} vs {want:?}");
        }
        if is_available(Isa::Avx2) {
            let mut got = vec![0.0f32; rows];
            // SAFETY: AVX2 and FMA were detected.
            unsafe { super::avx2::rows_mxfp4(&packed, &scales, &x, &mut got) };
            assert!(same(&got, &want), "avx2 decode: {got:?} vs {want:?}");
        }
        assert!(want.iter().any(|v| v.is_finite() && *v != 0.0), "{want:?}");
    }
}
