//! Dispatch of the hot loops (dot, matvec rows) to hand-written SIMD paths.
//!
//! Owns: the `match` from [`Isa`] to an implementation. Must not: change any order defined in
//! [`crate::reduce`]; every path here is tested bit for bit against the scalar reference.

use crate::isa::Isa;
use crate::matvec::{rows_bf16_ref, rows_f32_ref, rows_mxfp4_ref};
use crate::reduce::dot_ref;

multiversion! {
    fn dot_mv(a: &[f32], b: &[f32]) -> f32 { dot_ref(a, b) }
}
multiversion! {
    fn rows_f32_mv(w: &[f32], x: &[f32], out: &mut [f32]) { rows_f32_ref(w, x, out) }
}
multiversion! {
    fn rows_bf16_mv(w: &[u16], x: &[f32], out: &mut [f32]) { rows_bf16_ref(w, x, out) }
}
multiversion! {
    fn rows_mxfp4_mv(p: &[u8], s: &[u8], x: &[f32], out: &mut [f32]) {
        rows_mxfp4_ref(p, s, x, out)
    }
}

/// Canonical dot on `isa` (already resolved to an available path).
pub(crate) fn dot_f32(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    dot_mv(isa, a, b)
}

/// Rows of an f32 matvec on `isa`.
pub(crate) fn rows_f32(isa: Isa, w: &[f32], x: &[f32], out: &mut [f32]) {
    rows_f32_mv(isa, w, x, out)
}

/// Rows of a bf16 matvec on `isa`.
pub(crate) fn rows_bf16(isa: Isa, w: &[u16], x: &[f32], out: &mut [f32]) {
    rows_bf16_mv(isa, w, x, out)
}

/// Rows of an MXFP4 matvec on `isa`.
pub(crate) fn rows_mxfp4(isa: Isa, packed: &[u8], scales: &[u8], x: &[f32], out: &mut [f32]) {
    rows_mxfp4_mv(isa, packed, scales, x, out)
}
