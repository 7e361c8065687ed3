//! Elementwise kernels, norms and softmax.
//!
//! Owns: RMSNorm (with and without weight), softmax, SiTU / soft-clip / SiTU-GLU, SiLU-GLU,
//! per-head L2 norm, residual adds, sigmoid gating, argmax.
//! Must not: round to bf16 (activations stay f32, docs/NUMERICS.md §2) or use threads: these are
//! O(n) per token and run on the calling thread.
//!
//! Each public kernel has a `_with(isa, ..)` twin; all paths run the same body compiled per
//! instruction set (see `multiversion`), so they agree bit for bit by construction and by test.
//! Sums use the canonical orders of [`crate::reduce`].

use crate::isa::active;
use crate::math::{rsqrt, sigmoid, silu, tanh};
use crate::reduce::{dot_ref, sum_ref};

/// `rsqrt(dot(x, x) / n + eps)` with the canonical dot, `n = x.len()` as f32; `(x·x)/n` is a
/// division. Empty `x` gives NaN.
pub fn rms_inv(x: &[f32], eps: f32) -> f32 {
    rms_inv_with(active(), x, eps)
}

multiversion! {
    /// [`rms_inv`] on a forced path.
    pub fn rms_inv_with(x: &[f32], eps: f32) -> f32 {
        rms_inv_body(x, eps)
    }
}

#[inline(always)]
fn rms_inv_body(x: &[f32], eps: f32) -> f32 {
    rsqrt(dot_ref(x, x) / x.len() as f32 + eps)
}

/// RMSNorm: `out[i] = (x[i] * r) * weight[i]` (or `x[i] * r` without weight), with
/// `r = rms_inv(x, eps)`. Single-threaded.
pub fn rmsnorm(x: &[f32], weight: Option<&[f32]>, eps: f32, out: &mut [f32]) {
    rmsnorm_with(active(), x, weight, eps, out)
}

multiversion! {
    /// [`rmsnorm`] on a forced path.
    pub fn rmsnorm_with(x: &[f32], weight: Option<&[f32]>, eps: f32, out: &mut [f32]) {
        assert_eq!(x.len(), out.len(), "rmsnorm: x and out lengths differ");
        let r = rms_inv_body(x, eps);
        match weight {
            Some(w) => {
                assert_eq!(w.len(), x.len(), "rmsnorm: weight length differs from x");
                for ((o, &xi), &wi) in out.iter_mut().zip(x).zip(w) {
                    *o = (xi * r) * wi;
                }
            }
            None => {
                for (o, &xi) in out.iter_mut().zip(x) {
                    *o = xi * r;
                }
            }
        }
    }
}

/// In-place softmax: `m = max(x)` (NaN ignored), `x[i] = exp(x[i] - m)`, `s` = canonical sum,
/// `x[i] = x[i] / s`. All `-inf` (or any NaN) gives NaN. Single-threaded.
pub fn softmax_inplace(x: &mut [f32]) {
    softmax_inplace_with(active(), x)
}

multiversion! {
    /// [`softmax_inplace`] on a forced path.
    pub fn softmax_inplace_with(x: &mut [f32]) {
        softmax_body(x)
    }
}

#[inline(always)]
pub(crate) fn softmax_body(x: &mut [f32]) {
    let mut m = f32::NEG_INFINITY;
    for &v in x.iter() {
        if v > m {
            m = v;
        }
    }
    for v in x.iter_mut() {
        *v = crate::math::exp(*v - m);
    }
    let s = sum_ref(x);
    for v in x.iter_mut() {
        *v /= s;
    }
}

/// SiTU: `(beta * tanh(g / beta)) * sigmoid(g)`.
#[inline(always)]
pub fn situ(g: f32, beta: f32) -> f32 {
    (beta * tanh(g / beta)) * sigmoid(g)
}

/// Linear soft-clip: `beta_lin * tanh(u / beta_lin)`.
#[inline(always)]
pub fn soft_clip(u: f32, beta_lin: f32) -> f32 {
    beta_lin * tanh(u / beta_lin)
}

/// SiTU-GLU: `out[i] = situ(gate[i], beta) * soft_clip(up[i], beta_lin)`, or `* up[i]` when
/// `beta_lin` is `None`. Single-threaded.
pub fn situ_glu(gate: &[f32], up: &[f32], beta: f32, beta_lin: Option<f32>, out: &mut [f32]) {
    situ_glu_with(active(), gate, up, beta, beta_lin, out)
}

multiversion! {
    /// [`situ_glu`] on a forced path.
    pub fn situ_glu_with(gate: &[f32], up: &[f32], beta: f32, beta_lin: Option<f32>, out: &mut [f32]) {
        assert!(gate.len() == out.len() && up.len() == out.len(), "situ_glu: length mismatch");
        match beta_lin {
            Some(bl) => {
                for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
                    *o = situ(g, beta) * soft_clip(u, bl);
                }
            }
            None => {
                for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
                    *o = situ(g, beta) * u;
                }
            }
        }
    }
}

/// SiLU-GLU (Kimi-Linear): `out[i] = silu(gate[i]) * up[i]`. Single-threaded.
pub fn silu_glu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    silu_glu_with(active(), gate, up, out)
}

multiversion! {
    /// [`silu_glu`] on a forced path.
    pub fn silu_glu_with(gate: &[f32], up: &[f32], out: &mut [f32]) {
        assert!(gate.len() == out.len() && up.len() == out.len(), "silu_glu: length mismatch");
        for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
            *o = silu(g) * u;
        }
    }
}

/// Per-head L2 norm: for each head of `head_dim` elements, `r = rsqrt(dot(x, x) + eps)`
/// (canonical dot), `x[i] = (x[i] * r) * scale`. Single-threaded.
pub fn l2norm_heads(x: &mut [f32], head_dim: usize, eps: f32, scale: f32) {
    l2norm_heads_with(active(), x, head_dim, eps, scale)
}

multiversion! {
    /// [`l2norm_heads`] on a forced path.
    pub fn l2norm_heads_with(x: &mut [f32], head_dim: usize, eps: f32, scale: f32) {
        assert!(head_dim > 0 && x.len().is_multiple_of(head_dim), "l2norm_heads: len % head_dim != 0");
        for h in x.chunks_exact_mut(head_dim) {
            let r = rsqrt(dot_ref(h, h) + eps);
            for v in h.iter_mut() {
                *v = (*v * r) * scale;
            }
        }
    }
}

/// `acc[i] = acc[i] + x[i]`.
pub fn add_inplace(acc: &mut [f32], x: &[f32]) {
    add_inplace_with(active(), acc, x)
}

multiversion! {
    /// [`add_inplace`] on a forced path.
    pub fn add_inplace_with(acc: &mut [f32], x: &[f32]) {
        assert_eq!(acc.len(), x.len(), "add_inplace: length mismatch");
        for (a, &v) in acc.iter_mut().zip(x) {
            *a += v;
        }
    }
}

/// `acc[i] = fma(a, x[i], acc[i])` (fused, one rounding).
pub fn axpy(acc: &mut [f32], a: f32, x: &[f32]) {
    axpy_with(active(), acc, a, x)
}

multiversion! {
    /// [`axpy`] on a forced path.
    pub fn axpy_with(acc: &mut [f32], a: f32, x: &[f32]) {
        assert_eq!(acc.len(), x.len(), "axpy: length mismatch");
        for (s, &v) in acc.iter_mut().zip(x) {
            *s = a.mul_add(v, *s);
        }
    }
}

/// `x[i] = x[i] * sigmoid(gate[i])`.
pub fn mul_sigmoid_inplace(x: &mut [f32], gate: &[f32]) {
    mul_sigmoid_inplace_with(active(), x, gate)
}

multiversion! {
    /// [`mul_sigmoid_inplace`] on a forced path.
    pub fn mul_sigmoid_inplace_with(x: &mut [f32], gate: &[f32]) {
        assert_eq!(x.len(), gate.len(), "mul_sigmoid_inplace: length mismatch");
        for (v, &g) in x.iter_mut().zip(gate) {
            *v *= sigmoid(g);
        }
    }
}

/// Index of the largest element; ties go to the lowest index; NaN never wins. Returns 0 for
/// an empty or all-NaN slice.
pub fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    let mut best_v = f32::NAN;
    for (i, &v) in x.iter().enumerate() {
        if v > best_v || (best_v.is_nan() && !v.is_nan()) {
            best = i;
            best_v = v;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rmsnorm_unit_vector() {
        let x = [3.0f32, 4.0];
        let mut out = [0.0f32; 2];
        rmsnorm(&x, Some(&[1.0, 2.0]), 0.0, &mut out);
        // rms = sqrt(12.5)
        let r = 1.0 / 12.5f32.sqrt();
        assert_eq!(out, [3.0 * r, (4.0 * r) * 2.0]);
    }

    #[test]
    fn softmax_sums_to_one_and_is_shift_invariant() {
        let mut a = [1.0f32, 2.0, 3.0, -1.0];
        let mut b = a.map(|v| v + 100.0);
        softmax_inplace(&mut a);
        softmax_inplace(&mut b);
        assert_eq!(a, b);
        assert!((a.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(a[2] > a[1] && a[1] > a[0] && a[0] > a[3]);
    }

    #[test]
    fn situ_limits() {
        // large g: tanh -> 1, sigmoid -> 1, so situ -> beta
        assert_eq!(situ(1000.0, 4.0), 4.0);
        assert_eq!(soft_clip(1e6, 25.0), 25.0);
        let want = 4.0 * (0.1f64 / 4.0).tanh() / (1.0 + (-0.1f64).exp());
        assert!((situ(0.1, 4.0) as f64 - want).abs() < 1e-8);
    }

    #[test]
    fn argmax_ties_and_nan() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, -1.0, f32::NAN, -1.0]), 1);
        assert_eq!(argmax(&[f32::NAN, f32::NAN]), 0);
        assert_eq!(argmax(&[]), 0);
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), 0);
    }

    #[test]
    fn l2norm_unit_norm() {
        let mut x = [3.0f32, 4.0, 0.0, 2.0];
        l2norm_heads(&mut x, 2, 0.0, 1.0);
        assert_eq!(x, [0.6, 0.8, 0.0, 1.0]);
    }
}
