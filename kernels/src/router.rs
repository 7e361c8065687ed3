//! The MoE router: scores, biased top-k selection, renormalised weights.
//!
//! Owns: turning router logits into `top_k` expert ids (ascending) and their weights.
//! Must not: allocate (selection is k passes over the logits), or let the correction bias
//! leak into the weights (it is used for selection only).
//! Follows: HF `KimiMoEGate` (docs/MODEL.md §4.6); ties, unspecified upstream
//! (`torch.topk(sorted=False)`), break to the lower id (docs/NUMERICS.md).

use crate::isa::active;
use crate::math::{exp, sigmoid};
use crate::reduce::LANES;

/// How logits become scores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scoring {
    /// `s = sigmoid(logit)` (K3).
    Sigmoid,
    /// `s = softmax(logits)` over all experts (same order as `ops::softmax_inplace`).
    Softmax,
}

/// Router configuration.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RouterCfg {
    /// Experts per token.
    pub top_k: usize,
    /// Score function.
    pub scoring: Scoring,
    /// Divide the weights by their sum (+1e-20) when `top_k > 1` (HF `norm_topk_prob`).
    pub renormalize: bool,
    /// Multiplier applied last (`routed_scaling_factor`).
    pub scale: f32,
}

/// Routes one token. `logits, bias: [n_experts]`, `ids, weights: [top_k]`.
///
/// 1. scores `s` per [`Scoring`]; selection key `c[e] = s[e] + bias[e]` (or `s[e]`); a NaN key
///    ranks below every number.
/// 2. top-k by key, descending, ties to the lower id; `ids` written ASCENDING.
/// 3. `w = s[id]` (unbiased); if `renormalize && top_k > 1`: `d = (sum of w in ascending id
///    order, sequential adds) + 1e-20`, `w = w / d`; finally `w = w * scale`.
///
/// Single-threaded; no allocation (one pass, `ids`/`weights` hold the running top-k).
/// Panics if `top_k > n_experts` or on length mismatch.
pub fn route(
    logits: &[f32],
    bias: Option<&[f32]>,
    cfg: &RouterCfg,
    ids: &mut [u32],
    weights: &mut [f32],
) {
    route_with(active(), logits, bias, cfg, ids, weights)
}

/// Softmax normaliser: (max, canonical sum of exp(l - max)), streaming.
#[inline(always)]
fn softmax_stats(logits: &[f32]) -> (f32, f32) {
    let mut m = f32::NEG_INFINITY;
    for &v in logits {
        if v > m {
            m = v;
        }
    }
    let mut acc = [0.0f32; LANES];
    for (i, &v) in logits.iter().enumerate() {
        acc[i % LANES] += exp(v - m);
    }
    (m, crate::reduce::tree16(acc))
}

#[inline(always)]
fn score(scoring: Scoring, stats: (f32, f32), logit: f32) -> f32 {
    match scoring {
        Scoring::Sigmoid => sigmoid(logit),
        Scoring::Softmax => exp(logit - stats.0) / stats.1,
    }
}

/// `a` ranks before `b`: larger key, then lower id; NaN keys rank last.
#[inline(always)]
fn ranks_before(ka: f32, a: usize, kb: f32, b: usize) -> bool {
    let ka = if ka.is_nan() { f32::NEG_INFINITY } else { ka };
    let kb = if kb.is_nan() { f32::NEG_INFINITY } else { kb };
    ka > kb || (ka == kb && a < b)
}

multiversion! {
    /// [`route`] on a forced path.
    pub fn route_with(logits: &[f32], bias: Option<&[f32]>, cfg: &RouterCfg, ids: &mut [u32], weights: &mut [f32]) {
        let n = logits.len();
        let k = cfg.top_k;
        assert!(k <= n, "route: top_k = {k} exceeds n_experts = {n}");
        assert!(ids.len() == k && weights.len() == k, "route: ids and weights must be [top_k]");
        if k == 0 {
            return;
        }
        if let Some(b) = bias {
            assert_eq!(b.len(), n, "route: bias must be [n_experts]");
        }
        let stats = if cfg.scoring == Scoring::Softmax { softmax_stats(logits) } else { (0.0, 1.0) };
        let key = |e: usize| {
            let s = score(cfg.scoring, stats, logits[e]);
            match bias {
                Some(b) => s + b[e],
                None => s,
            }
        };
        // One pass keeping the best `m` experts sorted by rank in ids[..m] (keys in
        // weights[..m]). Experts arrive in ascending id, so an equal key never displaces an
        // earlier (lower) id: ties go to the lower id.
        let mut m = 0;
        for e in 0..n {
            let ke = key(e);
            if m == k && !ranks_before(ke, e, weights[k - 1], ids[k - 1] as usize) {
                continue;
            }
            let mut pos = m.min(k - 1);
            while pos > 0 && ranks_before(ke, e, weights[pos - 1], ids[pos - 1] as usize) {
                weights[pos] = weights[pos - 1];
                ids[pos] = ids[pos - 1];
                pos -= 1;
            }
            weights[pos] = ke;
            ids[pos] = e as u32;
            m = (m + 1).min(k);
        }
        ids.sort_unstable();
        for (w, &id) in weights.iter_mut().zip(ids.iter()) {
            *w = score(cfg.scoring, stats, logits[id as usize]);
        }
        if cfg.renormalize && k > 1 {
            let mut sum = 0.0f32;
            for &w in weights.iter() {
                sum += w;
            }
            let d = sum + 1e-20;
            for w in weights.iter_mut() {
                *w /= d;
            }
        }
        for w in weights.iter_mut() {
            *w *= cfg.scale;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bias_selects_but_does_not_weight() {
        let logits = [2.0f32, 1.0, 0.0, -1.0];
        let bias = [0.0f32, 0.0, 10.0, 0.0];
        let cfg = RouterCfg {
            top_k: 2,
            scoring: Scoring::Sigmoid,
            renormalize: false,
            scale: 1.0,
        };
        let mut ids = [0u32; 2];
        let mut w = [0.0f32; 2];
        route(&logits, Some(&bias), &cfg, &mut ids, &mut w);
        assert_eq!(ids, [0, 2]);
        assert_eq!(w, [sigmoid(2.0), sigmoid(0.0)]);
        route(&logits, None, &cfg, &mut ids, &mut w);
        assert_eq!(ids, [0, 1]);
    }

    #[test]
    fn ties_go_to_lower_id_and_renormalise() {
        let logits = [1.0f32, 3.0, 3.0, 3.0, f32::NAN];
        let cfg = RouterCfg {
            top_k: 2,
            scoring: Scoring::Sigmoid,
            renormalize: true,
            scale: 2.0,
        };
        let mut ids = [0u32; 2];
        let mut w = [0.0f32; 2];
        route(&logits, None, &cfg, &mut ids, &mut w);
        assert_eq!(ids, [1, 2]);
        let s = sigmoid(3.0);
        let d = (s + s) + 1e-20;
        assert_eq!(w, [(s / d) * 2.0, (s / d) * 2.0]);
    }
}
