//! MXFP4 AVX-512 decode variants side by side (docs/history/PERFORMANCE-LOG.md §2.6).
//! Every variant is first checked bit-exact against k3-kernels' scalar reference (the canonical dot),
//! then timed: medians of REPS alternating calls, 1 thread.
//!
//! cargo run --release --manifest-path bench/mxfp4-decode/Cargo.toml -- ROWS COLS REPS
//! RING=600 ...: walk a ring of 600 copies of the matrix (DRAM-bound) instead of one (in cache).
//! Needs AVX-512F/VL/VBMI (Zen 4, Ice Lake or later).
use std::arch::x86_64::*;
use std::time::Instant;

use k3_kernels::Pool;
use k3_kernels::isa::Isa;
use k3_kernels::matvec::{E2M1, e8m0_to_f32 as e8m0, matvec_mxfp4_with};
use k3_kernels::reduce::tree16;

static mut TABS: [f32; 4096] = [0.0; 4096];
fn tabs() -> &'static [f32; 4096] {
    unsafe { &*std::ptr::addr_of!(TABS) }
}
static mut E8M0: [f32; 256] = [0.0; 256];
fn tab() -> &'static [f32; 256] {
    unsafe { &*std::ptr::addr_of!(E8M0) }
}

#[inline(always)]
fn pf<T>(p: *const T, a: usize) {
    unsafe { _mm_prefetch::<_MM_HINT_T1>(p.cast::<i8>().wrapping_add(a)) }
}

/// Bytes per packed row, blocks per row, and the packed and scale rows `r0..r0+R`.
#[inline(always)]
fn group<'a, const R: usize>(
    packed: &'a [u8],
    scales: &'a [u8],
    cols: usize,
    r0: usize,
) -> (usize, usize, [&'a [u8]; R], [&'a [u8]; R]) {
    let (pb, nb) = (cols / 2, cols / 32);
    let mut prow: [&[u8]; R] = [&[]; R];
    let mut srow: [&[u8]; R] = [&[]; R];
    for i in 0..R {
        prow[i] = &packed[(r0 + i) * pb..(r0 + i + 1) * pb];
        srow[i] = &scales[(r0 + i) * nb..(r0 + i + 1) * nb];
    }
    (pb, nb, prow, srow)
}

// ---------------- v0: the old decode (before 14b2906) ----------------
#[inline]
#[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
fn g0<const R: usize>(packed: &[u8], scales: &[u8], x: &[f32], r0: usize, out: &mut [f32]) {
    let (pb, nb, prow, srow) = group::<R>(packed, scales, x.len(), r0);
    let (t_lo, t_hi) = unsafe {
        (
            _mm256_loadu_ps(E2M1.as_ptr()),
            _mm256_loadu_ps(E2M1.as_ptr().add(8)),
        )
    };
    let ev = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
    let od = _mm256_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15);
    let mut even = [_mm256_setzero_ps(); R];
    let mut odd = [_mm256_setzero_ps(); R];
    for b in 0..nb {
        unsafe {
            let xp = x.as_ptr().add(32 * b);
            let (x0, x1) = (_mm256_loadu_ps(xp), _mm256_loadu_ps(xp.add(8)));
            let (x2, x3) = (_mm256_loadu_ps(xp.add(16)), _mm256_loadu_ps(xp.add(24)));
            let xe_lo = _mm256_permutex2var_ps(x0, ev, x1);
            let xo_lo = _mm256_permutex2var_ps(x0, od, x1);
            let xe_hi = _mm256_permutex2var_ps(x2, ev, x3);
            let xo_hi = _mm256_permutex2var_ps(x2, od, x3);
            for i in 0..R {
                let s = _mm256_set1_ps(tab()[srow[i][b] as usize]);
                let (s_lo, s_hi) = (_mm256_mul_ps(t_lo, s), _mm256_mul_ps(t_hi, s));
                let p = prow[i].as_ptr().add(16 * b);
                if b % 4 == 0 {
                    pf(p, R * pb);
                }
                let b_lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.cast()));
                let b_hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(8).cast()));
                let e_lo = _mm256_permutex2var_ps(s_lo, b_lo, s_hi);
                let o_lo = _mm256_permutex2var_ps(s_lo, _mm256_srli_epi32::<4>(b_lo), s_hi);
                let e_hi = _mm256_permutex2var_ps(s_lo, b_hi, s_hi);
                let o_hi = _mm256_permutex2var_ps(s_lo, _mm256_srli_epi32::<4>(b_hi), s_hi);
                even[i] = _mm256_fmadd_ps(e_lo, xe_lo, even[i]);
                odd[i] = _mm256_fmadd_ps(o_lo, xo_lo, odd[i]);
                even[i] = _mm256_fmadd_ps(e_hi, xe_hi, even[i]);
                odd[i] = _mm256_fmadd_ps(o_hi, xo_hi, odd[i]);
            }
        }
    }
    for i in 0..R {
        let (mut e, mut o) = ([0.0f32; 8], [0.0f32; 8]);
        unsafe {
            _mm256_storeu_ps(e.as_mut_ptr(), even[i]);
            _mm256_storeu_ps(o.as_mut_ptr(), odd[i]);
        }
        let mut l = [0.0f32; 16];
        for j in 0..8 {
            l[2 * j] = e[j];
            l[2 * j + 1] = o[j];
        }
        out[i] = tree16(l);
    }
}

// ---------------- v2: zmm, vpmultishiftqb with broadcast, lane j = canonical j ----------------
#[inline]
#[target_feature(enable = "avx512f,avx512vl,avx512vbmi,avx2,fma")]
fn g2<const R: usize>(packed: &[u8], scales: &[u8], x: &[f32], r0: usize, out: &mut [f32]) {
    let (pb, nb, prow, srow) = group::<R>(packed, scales, x.len(), r0);
    let t = unsafe { _mm512_loadu_ps(E2M1.as_ptr()) };
    // qword lane q: byte 0 <- bits 8q.., byte 4 <- bits 8q+4..
    let mut c = [0u8; 64];
    for q in 0..8 {
        c[8 * q] = (8 * q) as u8;
        c[8 * q + 4] = (8 * q + 4) as u8;
    }
    let ctrl = unsafe { _mm512_loadu_si512(c.as_ptr().cast()) };
    let mut acc = [_mm512_setzero_ps(); R];
    for b in 0..nb {
        unsafe {
            let xp = x.as_ptr().add(32 * b);
            let (x0, x1) = (_mm512_loadu_ps(xp), _mm512_loadu_ps(xp.add(16)));
            for i in 0..R {
                let tb = _mm512_mul_ps(t, _mm512_set1_ps(tab()[srow[i][b] as usize]));
                let p = prow[i].as_ptr().add(16 * b);
                if b % 4 == 0 {
                    pf(p, R * pb);
                }
                let q0 = _mm512_set1_epi64(std::ptr::read_unaligned(p.cast::<i64>()));
                let q1 = _mm512_set1_epi64(std::ptr::read_unaligned(p.add(8).cast::<i64>()));
                let i0 = _mm512_multishift_epi64_epi8(ctrl, q0);
                let i1 = _mm512_multishift_epi64_epi8(ctrl, q1);
                acc[i] = _mm512_fmadd_ps(_mm512_permutexvar_ps(i0, tb), x0, acc[i]);
                acc[i] = _mm512_fmadd_ps(_mm512_permutexvar_ps(i1, tb), x1, acc[i]);
            }
        }
    }
    for i in 0..R {
        let mut l = [0.0f32; 16];
        unsafe { _mm512_storeu_ps(l.as_mut_ptr(), acc[i]) };
        out[i] = tree16(l);
    }
}

// ---------------- v1 (kept): zmm, broadcast qword + vpsrlvd, permuted lanes ----------------
// PF: prefetch distance in row groups (0 = none); TABLES: the scaled table loaded from the 16 KB
// precomputed tables instead of one multiply; REG: lanes restored with one vpermps and the tree
// in registers instead of a store and the scalar tree.
#[inline]
#[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
fn g1<const R: usize, const PF: usize, const TABLES: bool, const REG: bool>(
    packed: &[u8],
    scales: &[u8],
    x: &[f32],
    r0: usize,
    out: &mut [f32],
) {
    let (pb, nb, prow, srow) = group::<R>(packed, scales, x.len(), r0);
    let t = unsafe { _mm512_loadu_ps(E2M1.as_ptr()) };
    // lane j: dword j%2 of the qword, shifted 4*(j/2) -> element 8(j%2)+j/2
    let sh = _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28);
    let xperm = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
    let mut acc = [_mm512_setzero_ps(); R];
    for b in 0..nb {
        unsafe {
            let xp = x.as_ptr().add(32 * b);
            let x0 = _mm512_permutexvar_ps(xperm, _mm512_loadu_ps(xp));
            let x1 = _mm512_permutexvar_ps(xperm, _mm512_loadu_ps(xp.add(16)));
            for i in 0..R {
                let tb = if TABLES {
                    _mm512_loadu_ps(tabs().as_ptr().add(16 * srow[i][b] as usize))
                } else {
                    _mm512_mul_ps(t, _mm512_set1_ps(tab()[srow[i][b] as usize]))
                };
                let p = prow[i].as_ptr().add(16 * b);
                if b % 4 == 0 && PF > 0 {
                    pf(p, PF * R * pb);
                }
                let q0 = _mm512_set1_epi64(std::ptr::read_unaligned(p.cast::<i64>()));
                let q1 = _mm512_set1_epi64(std::ptr::read_unaligned(p.add(8).cast::<i64>()));
                let i0 = _mm512_srlv_epi32(q0, sh);
                let i1 = _mm512_srlv_epi32(q1, sh);
                acc[i] = _mm512_fmadd_ps(_mm512_permutexvar_ps(i0, tb), x0, acc[i]);
                acc[i] = _mm512_fmadd_ps(_mm512_permutexvar_ps(i1, tb), x1, acc[i]);
            }
        }
    }
    if REG {
        let back = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
        for i in 0..R {
            out[i] = tree16_reg(_mm512_permutexvar_ps(back, acc[i]));
        }
    } else {
        for i in 0..R {
            let mut a = [0.0f32; 16];
            unsafe { _mm512_storeu_ps(a.as_mut_ptr(), acc[i]) };
            let mut l = [0.0f32; 16];
            for j in 0..16 {
                l[8 * (j % 2) + j / 2] = a[j];
            }
            out[i] = tree16(l);
        }
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
fn tree16_reg(v: __m512) -> f32 {
    let a = _mm256_add_ps(
        _mm512_castps512_ps256(v),
        _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v))),
    );
    let b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
    let c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps::<1>(c, c)))
}

// ---------------- v3: ymm, multishift, AVX2 lane layout (.0 lanes 0..8, .1 lanes 8..16) ----------------
#[inline]
#[target_feature(enable = "avx512f,avx512vl,avx512vbmi,avx2,fma")]
fn g3<const R: usize>(packed: &[u8], scales: &[u8], x: &[f32], r0: usize, out: &mut [f32]) {
    let (pb, nb, prow, srow) = group::<R>(packed, scales, x.len(), r0);
    let (t_lo, t_hi) = unsafe {
        (
            _mm256_loadu_ps(E2M1.as_ptr()),
            _mm256_loadu_ps(E2M1.as_ptr().add(8)),
        )
    };
    // ymm lane j (qword q=j/2): element j of the 8-element dword group: bits 4j
    let mut c = [0u8; 32];
    for q in 0..4 {
        c[8 * q] = (8 * q) as u8;
        c[8 * q + 4] = (8 * q + 4) as u8;
    }
    let ctrl_a = unsafe { _mm256_loadu_si256(c.as_ptr().cast()) };
    for q in 0..4 {
        c[8 * q] = (32 + 8 * q) as u8;
        c[8 * q + 4] = (32 + 8 * q + 4) as u8;
    }
    let ctrl_b = unsafe { _mm256_loadu_si256(c.as_ptr().cast()) };
    let mut a0 = [_mm256_setzero_ps(); R];
    let mut a1 = [_mm256_setzero_ps(); R];
    for b in 0..nb {
        unsafe {
            let xp = x.as_ptr().add(32 * b);
            let xs = [
                _mm256_loadu_ps(xp),
                _mm256_loadu_ps(xp.add(8)),
                _mm256_loadu_ps(xp.add(16)),
                _mm256_loadu_ps(xp.add(24)),
            ];
            for i in 0..R {
                let s = _mm256_set1_ps(tab()[srow[i][b] as usize]);
                let (s_lo, s_hi) = (_mm256_mul_ps(t_lo, s), _mm256_mul_ps(t_hi, s));
                let p = prow[i].as_ptr().add(16 * b);
                if b % 4 == 0 {
                    pf(p, R * pb);
                }
                let q0 = _mm256_set1_epi64x(std::ptr::read_unaligned(p.cast::<i64>()));
                let q1 = _mm256_set1_epi64x(std::ptr::read_unaligned(p.add(8).cast::<i64>()));
                let i0 = _mm256_multishift_epi64_epi8(ctrl_a, q0);
                let i1 = _mm256_multishift_epi64_epi8(ctrl_b, q0);
                let i2 = _mm256_multishift_epi64_epi8(ctrl_a, q1);
                let i3 = _mm256_multishift_epi64_epi8(ctrl_b, q1);
                a0[i] = _mm256_fmadd_ps(_mm256_permutex2var_ps(s_lo, i0, s_hi), xs[0], a0[i]);
                a1[i] = _mm256_fmadd_ps(_mm256_permutex2var_ps(s_lo, i1, s_hi), xs[1], a1[i]);
                a0[i] = _mm256_fmadd_ps(_mm256_permutex2var_ps(s_lo, i2, s_hi), xs[2], a0[i]);
                a1[i] = _mm256_fmadd_ps(_mm256_permutex2var_ps(s_lo, i3, s_hi), xs[3], a1[i]);
            }
        }
    }
    for i in 0..R {
        let mut l = [0.0f32; 16];
        unsafe {
            _mm256_storeu_ps(l.as_mut_ptr(), a0[i]);
            _mm256_storeu_ps(l.as_mut_ptr().add(8), a1[i]);
        }
        out[i] = tree16(l);
    }
}

macro_rules! rows {
    ($name:ident, $g:ident, $r:expr $(, $c:expr)*) => {
        #[target_feature(enable = "avx512f,avx512vl,avx512vbmi,avx2,fma")]
        fn $name(packed: &[u8], scales: &[u8], x: &[f32], out: &mut [f32]) {
            let mut r = 0;
            while r + $r <= out.len() {
                $g::<{ $r } $(, { $c })*>(packed, scales, x, r, &mut out[r..r + $r]);
                r += $r;
            }
            while r < out.len() {
                $g::<1 $(, { $c })*>(packed, scales, x, r, &mut out[r..r + 1]);
                r += 1;
            }
        }
    };
}
rows!(r0_8, g0, 8);
rows!(r1_8, g1, 8, 1, false, false);
rows!(r5_8, g1, 8, 1, false, true);
rows!(r1_8p0, g1, 8, 0, false, false);
rows!(r1_8p2, g1, 8, 2, false, false);
rows!(r1_8p4, g1, 8, 4, false, false);
rows!(r1_8p8, g1, 8, 8, false, false);
rows!(r1_4, g1, 4, 1, false, false);
rows!(r1_12, g1, 12, 1, false, false);
rows!(r1_16, g1, 16, 1, false, false);
rows!(r4_8, g1, 8, 1, true, false);
rows!(r2_8, g2, 8);
rows!(r3_8, g3, 8);

fn main() {
    unsafe {
        for i in 0..256 {
            E8M0[i] = e8m0(i as u8);
            for j in 0..16 {
                TABS[16 * i + j] = E2M1[j] * e8m0(i as u8);
            }
        }
    }
    let args: Vec<String> = std::env::args().collect();
    let rows: usize = args.get(1).map(|s| s.parse().unwrap()).unwrap_or(512);
    let cols: usize = args.get(2).map(|s| s.parse().unwrap()).unwrap_or(4096);
    let reps: usize = args.get(3).map(|s| s.parse().unwrap()).unwrap_or(400);
    let mut st = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        st ^= st << 13;
        st ^= st >> 7;
        st ^= st << 17;
        st
    };
    let packed: Vec<u8> = (0..rows * cols / 2).map(|_| next() as u8).collect();
    let scales: Vec<u8> = (0..rows * cols / 32)
        .map(|i| {
            if i % 97 == 0 {
                (next() % 255) as u8
            } else {
                110 + (next() % 20) as u8
            }
        })
        .collect();
    let x: Vec<f32> = (0..cols)
        .map(|_| {
            let r = next();
            (f32::from_bits(0x3f80_0000 | (r as u32 & 0x7f_ffff)) - 1.5)
                * 2f32.powi((r >> 40) as i32 % 30 - 15)
        })
        .collect();
    // the engine's scalar reference (canonical dot of exactly decoded weights)
    let mut want = vec![0.0f32; rows];
    matvec_mxfp4_with(Isa::Scalar, &Pool::new(1), &packed, &scales, &x, &mut want);
    type F = unsafe fn(&[u8], &[u8], &[f32], &mut [f32]);
    let vs: Vec<(&str, F)> = vec![
        ("old: vpmovzxbd + vpermt2ps", r0_8),
        ("kept: bcst + vpsrlvd R8", r1_8),
        ("kept + register epilogue", r5_8),
        ("kept, R4", r1_4),
        ("kept, R12", r1_12),
        ("kept, R16", r1_16),
        ("kept, no prefetch", r1_8p0),
        ("kept, prefetch x2", r1_8p2),
        ("kept, prefetch x4", r1_8p4),
        ("kept, prefetch x8", r1_8p8),
        ("kept, 16 KB tables R8", r4_8),
        ("multishift zmm R8", r2_8),
        ("multishift ymm R8", r3_8),
    ];
    let mut out = vec![0.0f32; rows];
    for (n, f) in &vs {
        unsafe { f(&packed, &scales, &x, &mut out) };
        let ok = out
            .iter()
            .zip(&want)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        println!("{n}: bits {}", if ok { "ok" } else { "DIFFER" });
    }
    let ring: usize = std::env::var("RING")
        .ok()
        .map(|s| s.parse().unwrap())
        .unwrap_or(1);
    let bigp: Vec<u8> = (0..ring * packed.len())
        .map(|i| packed[i % packed.len()])
        .collect();
    let bigs: Vec<u8> = (0..ring * scales.len())
        .map(|i| scales[i % scales.len()])
        .collect();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let noisy = std::env::var("NOISE").is_ok();
    let h = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            if !noisy {
                return 0u64;
            }
            let buf: Vec<u64> = (0..(512usize << 20) / 8).map(|i| i as u64).collect();
            let mut acc = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for c in buf.chunks(4096) {
                    acc ^= c.iter().fold(0, |a, &b| a ^ b);
                }
            }
            acc
        })
    };
    let mut times: Vec<Vec<f64>> = vec![vec![]; vs.len()];
    let mut e = 0;
    for _ in 0..reps {
        for (k, (_, f)) in vs.iter().enumerate() {
            e = (e + 1) % ring;
            let (pp, ss) = (
                &bigp[e * packed.len()..(e + 1) * packed.len()],
                &bigs[e * scales.len()..(e + 1) * scales.len()],
            );
            let t = Instant::now();
            unsafe { f(pp, ss, &x, &mut out) };
            times[k].push(t.elapsed().as_secs_f64());
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = h.join();
    let bytes = (rows * cols / 2 + rows * cols / 32) as f64;
    for (k, (n, _)) in vs.iter().enumerate() {
        let mut v = times[k].clone();
        v.sort_by(|a, b| a.total_cmp(b));
        let m = v[v.len() / 2];
        println!(
            "{n:20} {:8.2} us  {:6.2} GB/s  {:6.2} Gw/s",
            m * 1e6,
            bytes / m / 1e9,
            (rows * cols) as f64 / m / 1e9
        );
    }
}
