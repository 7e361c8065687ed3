//! MLA attention for one query over the cached positions.
//!
//! Owns: scores, softmax over positions and the weighted sum of values, per head.
//! Must not: project, normalise or cache (the forward pass owns the KV cache layout), mask
//! (every cached position is visible to the query), or allocate (scores are scratch).
//! Follows: docs/MODEL.md §4.5 (NoPE MLA: no rotary; `k_rope` is shared by all heads).

use crate::isa::{Isa, active};
use crate::ops::softmax_body;
use crate::par::Pool;
use crate::reduce::dot_ref;

/// Shapes and scale of one MLA attention call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MlaShape {
    /// Number of heads.
    pub n_heads: usize,
    /// Per-head non-positional query/key width (K3: 128).
    pub d_nope: usize,
    /// Shared "rope" query/key width (K3: 64; not rotated in K3).
    pub d_rope: usize,
    /// Per-head value width (K3: 128).
    pub d_v: usize,
    /// Number of cached positions (including the current token).
    pub n_pos: usize,
    /// Score scale (K3: 192^-0.5).
    pub scale: f32,
}

/// One query against `n_pos` cached positions.
///
/// Shapes: `q: [n_heads, d_nope + d_rope]` (nope part first), `k_nope: [n_pos, n_heads,
/// d_nope]`, `k_rope: [n_pos, d_rope]`, `v: [n_pos, n_heads, d_v]`, `scores: [n_heads, n_pos]`
/// scratch (left holding the probabilities), `out: [n_heads, d_v]`.
///
/// Order per head `h`: `s[p] = (dot(q_nope, k_nope[p,h]) + dot(q_rope, k_rope[p])) * scale`
/// (two canonical dots), then `softmax_inplace` order over `p`, then
/// `out[d]` = column accumulation (`+0`, `fma(prob[p], v[p,h,d], acc)` for ascending `p`).
/// Threads split heads (whole heads per task): identical bits for any pool.
#[allow(clippy::too_many_arguments)]
pub fn mla_attend(
    pool: &Pool,
    shape: &MlaShape,
    q: &[f32],
    k_nope: &[f32],
    k_rope: &[f32],
    v: &[f32],
    scores: &mut [f32],
    out: &mut [f32],
) {
    let cache = MlaCache { k_nope, k_rope, v };
    mla_attend_with(active(), pool, shape, q, &cache, scores, out)
}

/// Cached keys and values of [`mla_attend`] (shapes in its doc).
#[derive(Clone, Copy, Debug)]
pub struct MlaCache<'a> {
    /// `[n_pos, n_heads, d_nope]`.
    pub k_nope: &'a [f32],
    /// `[n_pos, d_rope]`, shared by all heads.
    pub k_rope: &'a [f32],
    /// `[n_pos, n_heads, d_v]`.
    pub v: &'a [f32],
}

/// [`mla_attend`] on a forced path.
pub fn mla_attend_with(
    isa: Isa,
    pool: &Pool,
    shape: &MlaShape,
    q: &[f32],
    cache: &MlaCache<'_>,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let MlaShape {
        n_heads,
        d_nope,
        d_rope,
        d_v,
        n_pos,
        ..
    } = *shape;
    let dq = d_nope + d_rope;
    assert_eq!(
        q.len(),
        n_heads * dq,
        "mla_attend: q must be [n_heads, d_nope + d_rope]"
    );
    assert_eq!(
        cache.k_nope.len(),
        n_pos * n_heads * d_nope,
        "mla_attend: k_nope shape"
    );
    assert_eq!(
        cache.k_rope.len(),
        n_pos * d_rope,
        "mla_attend: k_rope shape"
    );
    assert_eq!(cache.v.len(), n_pos * n_heads * d_v, "mla_attend: v shape");
    assert_eq!(
        scores.len(),
        n_heads * n_pos,
        "mla_attend: scores must be [n_heads, n_pos]"
    );
    assert_eq!(
        out.len(),
        n_heads * d_v,
        "mla_attend: out must be [n_heads, d_v]"
    );
    if n_heads == 0 || d_v == 0 {
        return;
    }
    if n_pos == 0 {
        out.fill(0.0);
        return;
    }
    // Heads per task: whole heads only, so bits never depend on the split.
    let hc = n_heads.div_ceil(pool.n_threads() * 2).max(1);
    pool.for_each_chunk2(scores, hc * n_pos, out, hc * d_v, |t, sc, o| {
        let heads = Heads {
            h0: t * hc,
            n: o.len() / d_v,
        };
        mla_heads(isa, shape, heads, q, cache, sc, o);
    });
}

/// A contiguous range of heads `h0..h0 + n`.
#[derive(Clone, Copy)]
struct Heads {
    h0: usize,
    n: usize,
}

multiversion! {
    /// Heads `h0..h0+n`; `sc: [n, n_pos]`, `o: [n, d_v]`. Loops run position-outer so the
    /// cache rows stream contiguously; each element's own order is the documented one.
    fn mla_heads(shape: &MlaShape, heads: Heads, q: &[f32], cache: &MlaCache<'_>, sc: &mut [f32], o: &mut [f32]) {
        let MlaShape { n_heads, d_nope, d_rope, d_v, n_pos, scale } = *shape;
        let dq = d_nope + d_rope;
        for p in 0..n_pos {
            let kr = &cache.k_rope[p * d_rope..(p + 1) * d_rope];
            for j in 0..heads.n {
                let h = heads.h0 + j;
                let (qn, qr) = q[h * dq..(h + 1) * dq].split_at(d_nope);
                let kn = &cache.k_nope[(p * n_heads + h) * d_nope..(p * n_heads + h + 1) * d_nope];
                sc[j * n_pos + p] = (dot_ref(qn, kn) + dot_ref(qr, kr)) * scale;
            }
        }
        for s in sc.chunks_exact_mut(n_pos) {
            softmax_body(s);
        }
        o.fill(0.0);
        for p in 0..n_pos {
            for j in 0..heads.n {
                let h = heads.h0 + j;
                let prob = sc[j * n_pos + p];
                let vp = &cache.v[(p * n_heads + h) * d_v..(p * n_heads + h + 1) * d_v];
                for (ov, &vv) in o[j * d_v..(j + 1) * d_v].iter_mut().zip(vp) {
                    *ov = prob.mul_add(vv, *ov);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_position_returns_its_value() {
        let pool = Pool::new(1);
        let shape = MlaShape {
            n_heads: 2,
            d_nope: 2,
            d_rope: 1,
            d_v: 2,
            n_pos: 1,
            scale: 0.5,
        };
        let q = [1.0f32, 2.0, 3.0, -1.0, 0.0, 1.0];
        let k_nope = [0.5f32, 0.5, 1.0, 1.0];
        let k_rope = [2.0f32];
        let v = [7.0f32, -3.0, 1.5, 2.5];
        let mut scores = [0.0f32; 2];
        let mut out = [0.0f32; 4];
        mla_attend(
            &pool,
            &shape,
            &q,
            &k_nope,
            &k_rope,
            &v,
            &mut scores,
            &mut out,
        );
        assert_eq!(scores, [1.0, 1.0]);
        assert_eq!(out, v);
    }

    #[test]
    fn two_positions_weighted_by_softmax() {
        let pool = Pool::new(1);
        let shape = MlaShape {
            n_heads: 1,
            d_nope: 1,
            d_rope: 1,
            d_v: 1,
            n_pos: 2,
            scale: 1.0,
        };
        // scores: p0 = 1*1 + 0*0 = 1, p1 = 1*0 + 0*5 = 0
        let mut scores = [0.0f32; 2];
        let mut out = [0.0f32; 1];
        mla_attend(
            &pool,
            &shape,
            &[1.0, 0.0],
            &[1.0, 0.0],
            &[0.0, 5.0],
            &[10.0, 20.0],
            &mut scores,
            &mut out,
        );
        let e = std::f64::consts::E;
        let p0 = e / (e + 1.0);
        assert!((out[0] as f64 - (10.0 * p0 + 20.0 * (1.0 - p0))).abs() < 1e-5);
    }
}
