//! Dispatch of the hot loops (dot, matvec rows) to hand-written SIMD paths.
//!
//! Owns: the `match` from [`Isa`] to an implementation. Must not: change any order defined in
//! [`crate::reduce`]; every path here is tested bit for bit against the scalar reference.
//! Callers pass an `isa` already resolved by `isa::resolve` (so it is available).

use crate::isa::Isa;
use crate::matvec::{rows_bf16_ref, rows_f32_ref, rows_mxfp4_ref};
use crate::reduce::dot_ref;

#[cfg(target_arch = "aarch64")]
mod neon;
#[cfg(target_arch = "x86_64")]
mod x86;

/// Canonical dot on `isa`.
pub(crate) fn dot_f32(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    match isa {
        // SAFETY (all arms): `isa` was resolved, so its target features were detected.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86::avx512::dot_f32(a, b) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::avx2::dot_f32(a, b) },
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => unsafe { neon::dot_f32(a, b) },
        _ => dot_ref(a, b),
    }
}

/// Rows of an f32 matvec on `isa`.
pub(crate) fn rows_f32(isa: Isa, w: &[f32], x: &[f32], out: &mut [f32]) {
    match isa {
        // SAFETY (all arms): `isa` was resolved, so its target features were detected.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86::avx512::rows_f32(w, x, out) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::avx2::rows_f32(w, x, out) },
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => unsafe { neon::rows_f32(w, x, out) },
        _ => rows_f32_ref(w, x, out),
    }
}

/// Rows of a bf16 matvec on `isa`.
pub(crate) fn rows_bf16(isa: Isa, w: &[u16], x: &[f32], out: &mut [f32]) {
    match isa {
        // SAFETY (all arms): `isa` was resolved, so its target features were detected.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86::avx512::rows_bf16(w, x, out) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::avx2::rows_bf16(w, x, out) },
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => unsafe { neon::rows_bf16(w, x, out) },
        _ => rows_bf16_ref(w, x, out),
    }
}

/// `outs[t] = W xs[t]` for bf16 rows and several inputs, each output the bits of
/// [`rows_bf16`] on its input; paths without a several-input kernel run the inputs in turn.
pub(crate) fn rows_bf16_many(isa: Isa, w: &[u16], xs: &[&[f32]], outs: &mut [&mut [f32]]) {
    match isa {
        // SAFETY (both arms): `isa` was resolved, so its target features were detected.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86::avx512::rows_bf16_many(w, xs, outs) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::avx2::rows_bf16_many(w, xs, outs) },
        _ => {
            for (x, o) in xs.iter().zip(outs.iter_mut()) {
                rows_bf16(isa, w, x, o);
            }
        }
    }
}

/// Rows of an MXFP4 matvec on `isa`.
pub(crate) fn rows_mxfp4(isa: Isa, packed: &[u8], scales: &[u8], x: &[f32], out: &mut [f32]) {
    match isa {
        // SAFETY (all arms): `isa` was resolved, so its target features were detected.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86::avx512::rows_mxfp4(packed, scales, x, out) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::avx2::rows_mxfp4(packed, scales, x, out) },
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => unsafe { neon::rows_mxfp4(packed, scales, x, out) },
        _ => rows_mxfp4_ref(packed, scales, x, out),
    }
}

/// `outs[t] = W xs[t]` for MXFP4 rows and several inputs, each output the bits of
/// [`rows_mxfp4`] on its input; paths without a several-input kernel run the inputs in turn.
pub(crate) fn rows_mxfp4_many(
    isa: Isa,
    packed: &[u8],
    scales: &[u8],
    xs: &[&[f32]],
    outs: &mut [&mut [f32]],
) {
    match isa {
        // SAFETY (both arms): `isa` was resolved, so its target features were detected.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86::avx512::rows_mxfp4_many(packed, scales, xs, outs) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::avx2::rows_mxfp4_many(packed, scales, xs, outs) },
        _ => {
            for (x, o) in xs.iter().zip(outs.iter_mut()) {
                rows_mxfp4(isa, packed, scales, x, o);
            }
        }
    }
}
