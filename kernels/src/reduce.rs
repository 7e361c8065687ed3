//! The canonical reduction orders. Every kernel that sums builds on these.
//!
//! Owns: the scalar definition of the order in which floats are combined.
//! Must not: depend on the instruction set; SIMD paths reproduce these functions exactly.
//!
//! **Canonical dot product** of `a` and `b` (length `n`), used by [`crate::matvec`] rows,
//! [`crate::matvec::dot_f32`], norms and attention scores:
//! 1. 16 lanes `acc[0..16]`, all `+0.0`.
//! 2. For `i = 0, 1, .., n-1` in order: `acc[i % 16] = fma(a[i], b[i], acc[i % 16])`
//!    (the tail past the last full block of 16 simply uses lanes `0..n % 16`).
//! 3. A fixed pairwise tree ([`tree16`]): `acc[j] += acc[j + 8]` for `j < 8`, then
//!    `acc[j] += acc[j + 4]` for `j < 4`, then `acc[j] += acc[j + 2]` for `j < 2`, then
//!    `acc[0] + acc[1]`.
//!
//! **Canonical sum** ([`sum_ref`]): the same with `acc[i % 16] += a[i]` (plain add).
//!
//! **Column accumulation** (KDA state reads, attention outputs, AttnRes): `acc = +0.0`, then
//! `acc = fma(w_i, v_i, acc)` for ascending `i`; lanes are independent output elements.

/// Number of interleaved lanes of the canonical order.
pub const LANES: usize = 16;

/// The fixed pairwise tree over the 16 lanes (step 3 of the canonical dot).
#[inline(always)]
pub fn tree16(mut l: [f32; LANES]) -> f32 {
    for j in 0..8 {
        l[j] += l[j + 8];
    }
    for j in 0..4 {
        l[j] += l[j + 4];
    }
    for j in 0..2 {
        l[j] += l[j + 2];
    }
    l[0] + l[1]
}

/// Step 2 for the elements past the last full block: `acc[j] = fma(a[j], b[j], acc[j])`.
#[inline(always)]
pub(crate) fn fma_tail(acc: &mut [f32; LANES], a: &[f32], b: &[f32]) {
    for ((l, &x), &y) in acc.iter_mut().zip(a).zip(b) {
        *l = x.mul_add(y, *l);
    }
}

/// Canonical dot product, scalar reference. Panics if lengths differ.
#[inline(always)]
pub fn dot_ref(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot: operand lengths differ");
    let mut acc = [0.0f32; LANES];
    let full = a.len() / LANES * LANES;
    for (ca, cb) in a[..full]
        .chunks_exact(LANES)
        .zip(b[..full].chunks_exact(LANES))
    {
        for j in 0..LANES {
            acc[j] = ca[j].mul_add(cb[j], acc[j]);
        }
    }
    fma_tail(&mut acc, &a[full..], &b[full..]);
    tree16(acc)
}

/// bf16 bits to f32, exact (`bits << 16`).
#[inline(always)]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// Canonical dot of bf16 weights (widened exactly) with f32 `x`, scalar reference.
#[inline(always)]
pub fn dot_bf16_ref(w: &[u16], x: &[f32]) -> f32 {
    assert_eq!(w.len(), x.len(), "dot_bf16: operand lengths differ");
    let mut acc = [0.0f32; LANES];
    let full = w.len() / LANES * LANES;
    for (cw, cx) in w[..full]
        .chunks_exact(LANES)
        .zip(x[..full].chunks_exact(LANES))
    {
        for j in 0..LANES {
            acc[j] = bf16_to_f32(cw[j]).mul_add(cx[j], acc[j]);
        }
    }
    bf16_tail(&mut acc, &w[full..], &x[full..]);
    tree16(acc)
}

/// Step 2 on a bf16 tail.
#[inline(always)]
pub(crate) fn bf16_tail(acc: &mut [f32; LANES], w: &[u16], x: &[f32]) {
    for ((l, &wb), &y) in acc.iter_mut().zip(w).zip(x) {
        *l = bf16_to_f32(wb).mul_add(y, *l);
    }
}

/// Canonical sum (16 lanes of plain adds, then [`tree16`]), scalar reference.
#[inline(always)]
pub fn sum_ref(a: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let full = a.len() / LANES * LANES;
    for c in a[..full].chunks_exact(LANES) {
        for j in 0..LANES {
            acc[j] += c[j];
        }
    }
    for (l, &x) in acc.iter_mut().zip(&a[full..]) {
        *l += x;
    }
    tree16(acc)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_matches_explicit_lane_definition() {
        // Build inputs whose products are exact powers of two so any order gives the same
        // value, then a case where order matters and compare with a hand-written definition.
        let n = 37;
        let a: Vec<f32> = (0..n).map(|i| 1.0 + i as f32 * 1e-3).collect();
        let b: Vec<f32> = (0..n).map(|i| (i as f32 - 18.0) * 0.37).collect();
        let mut lanes = [0.0f32; 16];
        for i in 0..n {
            lanes[i % 16] = a[i].mul_add(b[i], lanes[i % 16]);
        }
        let mut l = lanes;
        let mut half = 8;
        while half > 0 {
            for j in 0..half {
                l[j] += l[j + half];
            }
            half /= 2;
        }
        assert_eq!(dot_ref(&a, &b).to_bits(), l[0].to_bits());
    }

    #[test]
    fn order_is_observable() {
        // 1e8 + 1 - 1e8 style cancellation: lanes 0 and 8 cancel in the tree's first level.
        let mut a = [0.0f32; 16];
        a[0] = 1e8;
        a[8] = -1e8;
        a[1] = 1.0;
        assert_eq!(sum_ref(&a), 1.0);
        let b = [1.0f32; 16];
        assert_eq!(dot_ref(&a, &b), 1.0);
        // A naive left-to-right sum would give 1e8 + 1 -> 1e8, then - 1e8 -> 0.
        let naive: f32 = [1e8f32, 1.0, -1e8].iter().sum();
        assert_eq!(naive, 0.0);
    }

    #[test]
    fn bf16_widening_is_exact() {
        assert_eq!(bf16_to_f32(0x3F80), 1.0);
        assert_eq!(bf16_to_f32(0xC000), -2.0);
        assert_eq!(bf16_to_f32(0x0001).to_bits(), 0x0001_0000);
        let w = [0x3F80u16, 0x4000, 0x4040];
        assert_eq!(dot_bf16_ref(&w, &[1.0, 1.0, 1.0]), 6.0);
    }
}
