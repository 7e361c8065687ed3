//! Block AttnRes: depth-wise softmax mixing of block sums.
//!
//! Owns: the logits, softmax and weighted sum over `n` source vectors for one token.
//! Must not: fold the weights (the caller passes `query = f32(norm_w) * f32(proj_w)`, computed
//! once at load) or round the mix to bf16.
//! Follows: HF `_apply_attn_res` (docs/MODEL.md §4.3).

use crate::isa::active;
use crate::ops::softmax_body;
use crate::reduce::dot_ref;

/// `sources: n vectors [d]`, `query: [d]`, `logits_scratch: [>= n]` (left holding the mixing
/// probabilities), `out: [d]`.
///
/// Order: `logit_i = dot(v_i, query) * rms_inv(v_i, eps)` (two canonical dots; equal in real
/// arithmetic to `<v_i * rms_inv(v_i), query>`), softmax over `i` in the order of
/// `ops::softmax_inplace`, then `out[d]` = column accumulation (`+0`, `fma(p_i, v_i[d], acc)`
/// for ascending `i`) over the UN-normalised sources. Single-threaded.
pub fn attnres_mix(
    sources: &[&[f32]],
    query: &[f32],
    eps: f32,
    logits_scratch: &mut [f32],
    out: &mut [f32],
) {
    attnres_mix_with(active(), sources, query, eps, logits_scratch, out)
}

multiversion! {
    /// [`attnres_mix`] on a forced path.
    pub fn attnres_mix_with(sources: &[&[f32]], query: &[f32], eps: f32, logits_scratch: &mut [f32], out: &mut [f32]) {
        let n = sources.len();
        assert!(logits_scratch.len() >= n, "attnres_mix: logits_scratch shorter than sources");
        assert_eq!(query.len(), out.len(), "attnres_mix: query and out lengths differ");
        let logits = &mut logits_scratch[..n];
        for (l, v) in logits.iter_mut().zip(sources) {
            assert_eq!(v.len(), out.len(), "attnres_mix: source length differs from out");
            let r = crate::math::rsqrt(dot_ref(v, v) / v.len() as f32 + eps);
            *l = dot_ref(v, query) * r;
        }
        softmax_body(logits);
        out.fill(0.0);
        for (&p, v) in logits.iter().zip(sources) {
            for (o, &x) in out.iter_mut().zip(v.iter()) {
                *o = p.mul_add(x, *o);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_logits_average_sources() {
        // Both sources have rms 1 and the same dot with the query -> p = [0.5, 0.5].
        let a = [1.0f32, -1.0];
        let b = [-1.0f32, 1.0];
        let q = [1.0f32, 1.0];
        let mut scratch = [0.0f32; 2];
        let mut out = [9.0f32; 2];
        attnres_mix(&[&a, &b], &q, 0.0, &mut scratch, &mut out);
        assert_eq!(scratch, [0.5, 0.5]);
        assert_eq!(out, [0.0, 0.0]);
    }

    #[test]
    fn single_source_is_identity() {
        let a = [3.0f32, 4.0, -5.0];
        let mut scratch = [0.0f32; 1];
        let mut out = [0.0f32; 3];
        attnres_mix(&[&a], &[0.1, 0.2, 0.3], 1e-5, &mut scratch, &mut out);
        assert_eq!(out, a);
    }
}
