//! MLA attention for one query over the cached positions, in the absorbed (latent) form.
//!
//! Owns: the absorbed attention of one query, per head: the query's no-position part mapped
//! into the latent space through `kv_b`'s key rows, scores against the cached latent plus the
//! shared rope part, softmax over positions, the probability-weighted latent, and that latent
//! mapped out through `kv_b`'s value rows.
//! Must not: project the token (q, kv_a, o_proj are the forward pass's), normalise or cache
//! (the forward pass owns the cache layout), mask (every cached position is visible to the
//! query), or allocate (the per-head work area is scratch).
//! Follows: docs/MODEL.md §4.5 (NoPE MLA: no rotary; `k_rope` is shared by all heads) and
//! docs/NUMERICS.md §1 (the canonical order below).

use crate::isa::{Isa, active};
use crate::ops::softmax_body;
use crate::par::Pool;
use crate::reduce::{bf16_to_f32, dot_bf16_ref, dot_ref};

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
    /// Latent width of the cache, `kv_lora_rank` (K3: 512).
    pub kv_lora: usize,
    /// Number of cached positions (including the current token).
    pub n_pos: usize,
    /// Score scale (K3: 192^-0.5).
    pub scale: f32,
}

impl MlaShape {
    /// f32 elements of [`mla_attend`]'s `work` area: `[n_heads, 2 * kv_lora + n_pos]`.
    pub fn work_len(&self) -> usize {
        self.n_heads * (2 * self.kv_lora + self.n_pos)
    }
}

/// The latent cache of one MLA layer (shapes in [`mla_attend`]'s doc).
#[derive(Clone, Copy, Debug)]
pub struct MlaCache<'a> {
    /// `[n_pos, kv_lora]`: the normalised `c_kv` of every position.
    pub c_kv: &'a [f32],
    /// `[n_pos, d_rope]`: the key's rope part, shared by all heads.
    pub k_rope: &'a [f32],
}

/// One query against `n_pos` cached latent positions.
///
/// Shapes: `q: [n_heads, d_nope + d_rope]` (nope part first); `w_kv_b: [n_heads * (d_nope +
/// d_v), kv_lora]` bf16 bits, the `kv_b` projection (head `h`'s key rows `h*(d_nope+d_v) ..
/// +d_nope`, then its value rows `.. +d_v`); `cache` as in [`MlaCache`]; `work:
/// [n_heads, 2*kv_lora + n_pos]` scratch (per head: the absorbed query, the weighted latent,
/// the probabilities, left holding them); `out: [n_heads, d_v]`.
///
/// Order per head `h` (`Wk[i]`, `Wv[d]`: its key and value rows, widened exactly):
/// 1. `qa[j]` = column accumulation over `i` ascending: `+0`, `fma(q_nope[i], Wk[i][j], acc)`;
/// 2. `s[p] = (dot(qa, c_kv[p]) + dot(q_rope, k_rope[p])) * scale` (two canonical dots);
/// 3. `softmax_inplace` order over `p`;
/// 4. `ol[j]` = column accumulation over `p` ascending: `+0`, `fma(prob[p], c_kv[p][j], acc)`;
/// 5. `out[d] = dot(Wv[d], ol)` (canonical dot).
///
/// Threads split heads (whole heads per task): identical bits for any pool.
#[allow(clippy::too_many_arguments)]
pub fn mla_attend(
    pool: &Pool,
    shape: &MlaShape,
    q: &[f32],
    w_kv_b: &[u16],
    cache: &MlaCache<'_>,
    work: &mut [f32],
    out: &mut [f32],
) {
    mla_attend_with(active(), pool, shape, q, w_kv_b, cache, work, out)
}

/// [`mla_attend`] on a forced path.
#[allow(clippy::too_many_arguments)]
pub fn mla_attend_with(
    isa: Isa,
    pool: &Pool,
    shape: &MlaShape,
    q: &[f32],
    w_kv_b: &[u16],
    cache: &MlaCache<'_>,
    work: &mut [f32],
    out: &mut [f32],
) {
    let MlaShape {
        n_heads,
        d_nope,
        d_rope,
        d_v,
        kv_lora,
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
        w_kv_b.len(),
        n_heads * (d_nope + d_v) * kv_lora,
        "mla_attend: kv_b must be [n_heads * (d_nope + d_v), kv_lora]"
    );
    assert_eq!(cache.c_kv.len(), n_pos * kv_lora, "mla_attend: c_kv shape");
    assert_eq!(
        cache.k_rope.len(),
        n_pos * d_rope,
        "mla_attend: k_rope shape"
    );
    assert_eq!(
        work.len(),
        shape.work_len(),
        "mla_attend: work must be [n_heads, 2 * kv_lora + n_pos]"
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
    let stride = 2 * kv_lora + n_pos;
    // Heads per task: whole heads only, so bits never depend on the split.
    let hc = n_heads.div_ceil(pool.n_threads() * 2).max(1);
    pool.for_each_chunk2(work, hc * stride, out, hc * d_v, |t, wk, o| {
        let heads = Heads {
            h0: t * hc,
            n: o.len() / d_v,
        };
        mla_heads(isa, shape, heads, (q, w_kv_b), cache, wk, o);
    });
}

/// A contiguous range of heads `h0..h0 + n`.
#[derive(Clone, Copy)]
struct Heads {
    h0: usize,
    n: usize,
}

multiversion! {
    /// Heads `h0..h0+n`; `wk: [n, 2*kv_lora + n_pos]`, `o: [n, d_v]`. The position loops run
    /// position-outer so the cache rows stream contiguously once for all the task's heads;
    /// each element's own order is the documented one.
    fn mla_heads(shape: &MlaShape, heads: Heads, qw: (&[f32], &[u16]), cache: &MlaCache<'_>, wk: &mut [f32], o: &mut [f32]) {
        let (q, w) = qw;
        let MlaShape { d_nope, d_rope, d_v, kv_lora, n_pos, scale, .. } = *shape;
        let (dq, rows) = (d_nope + d_rope, d_nope + d_v);
        let stride = 2 * kv_lora + n_pos;
        // 1. absorbed query qa = Wk^T q_nope, per head
        for j in 0..heads.n {
            let h = heads.h0 + j;
            let qa = &mut wk[j * stride..j * stride + kv_lora];
            qa.fill(0.0);
            for i in 0..d_nope {
                let a = q[h * dq + i];
                let r = (h * rows + i) * kv_lora;
                for (acc, &wb) in qa.iter_mut().zip(&w[r..r + kv_lora]) {
                    *acc = a.mul_add(bf16_to_f32(wb), *acc);
                }
            }
        }
        // 2. scores
        for p in 0..n_pos {
            let c = &cache.c_kv[p * kv_lora..(p + 1) * kv_lora];
            let kr = &cache.k_rope[p * d_rope..(p + 1) * d_rope];
            for j in 0..heads.n {
                let h = heads.h0 + j;
                let qr = &q[h * dq + d_nope..(h + 1) * dq];
                let (qa, rest) = wk[j * stride..(j + 1) * stride].split_at_mut(2 * kv_lora);
                rest[p] = (dot_ref(&qa[..kv_lora], c) + dot_ref(qr, kr)) * scale;
            }
        }
        // 3. softmax over positions
        for j in 0..heads.n {
            softmax_body(&mut wk[j * stride + 2 * kv_lora..(j + 1) * stride]);
        }
        // 4. weighted latent
        for j in 0..heads.n {
            wk[j * stride + kv_lora..j * stride + 2 * kv_lora].fill(0.0);
        }
        for p in 0..n_pos {
            let c = &cache.c_kv[p * kv_lora..(p + 1) * kv_lora];
            for j in 0..heads.n {
                let (lat, s) = wk[j * stride..(j + 1) * stride].split_at_mut(2 * kv_lora);
                let prob = s[p];
                for (acc, &cv) in lat[kv_lora..].iter_mut().zip(c) {
                    *acc = prob.mul_add(cv, *acc);
                }
            }
        }
        // 5. out = Wv ol, per head
        for j in 0..heads.n {
            let h = heads.h0 + j;
            let ol = &wk[j * stride + kv_lora..j * stride + 2 * kv_lora];
            for (d, ov) in o[j * d_v..(j + 1) * d_v].iter_mut().enumerate() {
                let r = (h * rows + d_nope + d) * kv_lora;
                *ov = dot_bf16_ref(&w[r..r + kv_lora], ol);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bf(x: f32) -> u16 {
        (x.to_bits() >> 16) as u16
    }

    /// A small deterministic value in [-1, 1) that is exact in bf16.
    fn val(i: usize, salt: usize) -> f32 {
        (((i * 7919 + salt * 104_729) % 251) as f32 - 125.0) / 128.0
    }

    #[test]
    fn single_position_returns_the_value_rows_times_the_latent() {
        let pool = Pool::new(1);
        let shape = MlaShape {
            n_heads: 2,
            d_nope: 2,
            d_rope: 1,
            d_v: 2,
            kv_lora: 3,
            n_pos: 1,
            scale: 0.5,
        };
        let q: Vec<f32> = (0..6).map(|i| val(i, 1)).collect();
        let w: Vec<u16> = (0..2 * 4 * 3).map(|i| bf(val(i, 2))).collect();
        let c: Vec<f32> = (0..3).map(|i| val(i, 3)).collect();
        let kr = [0.25f32];
        let mut work = vec![0.0f32; shape.work_len()];
        let mut out = [0.0f32; 4];
        let cache = MlaCache {
            c_kv: &c,
            k_rope: &kr,
        };
        mla_attend(&pool, &shape, &q, &w, &cache, &mut work, &mut out);
        for h in 0..2 {
            // one position: probability exactly 1, so the weighted latent is c itself
            assert_eq!(work[h * 7 + 6], 1.0);
            for d in 0..2 {
                let r = (h * 4 + 2 + d) * 3;
                assert_eq!(out[h * 2 + d], dot_bf16_ref(&w[r..r + 3], &c));
            }
        }
    }

    #[test]
    fn equals_the_expanded_form_up_to_rounding() {
        let (h, dn, dr, dv, kvl, n_pos) = (3, 5, 2, 4, 7, 9);
        let shape = MlaShape {
            n_heads: h,
            d_nope: dn,
            d_rope: dr,
            d_v: dv,
            kv_lora: kvl,
            n_pos,
            scale: 0.3,
        };
        let q: Vec<f32> = (0..h * (dn + dr)).map(|i| val(i, 4)).collect();
        let w: Vec<u16> = (0..h * (dn + dv) * kvl).map(|i| bf(val(i, 5))).collect();
        let c: Vec<f32> = (0..n_pos * kvl).map(|i| val(i, 6)).collect();
        let kr: Vec<f32> = (0..n_pos * dr).map(|i| val(i, 7)).collect();
        let wf = |r: usize, j: usize| bf16_to_f32(w[r * kvl + j]) as f64;
        let mut work = vec![0.0f32; shape.work_len()];
        let mut out = vec![0.0f32; h * dv];
        let cache = MlaCache {
            c_kv: &c,
            k_rope: &kr,
        };
        mla_attend(&Pool::new(2), &shape, &q, &w, &cache, &mut work, &mut out);
        for hh in 0..h {
            // expanded: k_nope[p] = Wk c[p], v[p] = Wv c[p], in f64
            let mut s = vec![0.0f64; n_pos];
            for (p, sp) in s.iter_mut().enumerate() {
                let mut acc = 0.0;
                for i in 0..dn {
                    let k: f64 = (0..kvl)
                        .map(|j| wf(hh * (dn + dv) + i, j) * c[p * kvl + j] as f64)
                        .sum();
                    acc += q[hh * (dn + dr) + i] as f64 * k;
                }
                for r in 0..dr {
                    acc += q[hh * (dn + dr) + dn + r] as f64 * kr[p * dr + r] as f64;
                }
                *sp = acc * 0.3f32 as f64;
            }
            let m = s.iter().cloned().fold(f64::MIN, f64::max);
            let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for d in 0..dv {
                let mut o = 0.0;
                for p in 0..n_pos {
                    let v: f64 = (0..kvl)
                        .map(|j| wf(hh * (dn + dv) + dn + d, j) * c[p * kvl + j] as f64)
                        .sum();
                    o += e[p] / z * v;
                }
                let got = out[hh * dv + d] as f64;
                assert!((got - o).abs() < 1e-5, "head {hh} d {d}: {got} vs {o}");
            }
        }
    }

    #[test]
    fn no_positions_gives_zeros() {
        let shape = MlaShape {
            n_heads: 1,
            d_nope: 1,
            d_rope: 1,
            d_v: 2,
            kv_lora: 2,
            n_pos: 0,
            scale: 1.0,
        };
        let w = [bf(1.0); 6];
        let mut out = [5.0f32; 2];
        let cache = MlaCache {
            c_kv: &[],
            k_rope: &[],
        };
        mla_attend(
            &Pool::new(1),
            &shape,
            &[1.0, 1.0],
            &w,
            &cache,
            &mut [0.0; 4],
            &mut out,
        );
        assert_eq!(out, [0.0, 0.0]);
    }
}
