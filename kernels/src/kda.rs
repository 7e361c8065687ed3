//! Kimi Delta Attention: the short causal convolution, the forget gate and the recurrent step.
//!
//! Owns: one token of KDA on an f32 state `[n_heads, head_dim_k, head_dim_v]` (row `k` of a
//! head's state belongs to key channel `k`). The same token-by-token recurrence serves
//! prefill and decode (docs/NUMERICS.md).
//! Must not: know projections or norms (the forward pass owns those), allocate, or split one
//! head's state across threads.
//! Follows: FLA `naive_recurrent_kda` / `fused_recurrent_kda` (docs/MODEL.md §4.4).

use crate::isa::{Isa, active};
use crate::math::{exp, sigmoid, silu, softplus};
use crate::par::Pool;

/// Causal depthwise convolution step for one token, then SiLU.
///
/// `history: [channels, kernel-1]` holds each channel's previous inputs, oldest first;
/// `taps: [channels, kernel]` (tap `kernel-1` multiplies the current input `x[c]`).
/// `out[c] = silu(acc)` with `acc = +0`, then `acc = fma(taps[c, j], z_j, acc)` for
/// `j = 0..kernel` ascending, where `z_0..z_{kernel-2}` is the history and `z_{kernel-1} = x[c]`.
/// Afterwards the history is shifted by one (oldest dropped, `x[c]` appended). Single-threaded.
pub fn conv_step(history: &mut [f32], x: &[f32], taps: &[f32], kernel: usize, out: &mut [f32]) {
    conv_step_with(active(), history, x, taps, kernel, out)
}

multiversion! {
    /// [`conv_step`] on a forced path.
    pub fn conv_step_with(history: &mut [f32], x: &[f32], taps: &[f32], kernel: usize, out: &mut [f32]) {
        let c = x.len();
        assert!(kernel >= 1, "conv_step: kernel must be >= 1");
        assert_eq!(out.len(), c, "conv_step: out length differs from x");
        assert_eq!(taps.len(), c * kernel, "conv_step: taps must be [channels, kernel]");
        assert_eq!(history.len(), c * (kernel - 1), "conv_step: history must be [channels, kernel-1]");
        let hk = kernel - 1;
        // pre-activation, then SiLU over the whole vector, then the history shift
        for ch in 0..c {
            let t = &taps[ch * kernel..(ch + 1) * kernel];
            let h = &history[ch * hk..(ch + 1) * hk];
            let mut acc = 0.0f32;
            for (tj, &zj) in t.iter().zip(h.iter()) {
                acc = tj.mul_add(zj, acc);
            }
            out[ch] = t[hk].mul_add(x[ch], acc);
        }
        for o in out.iter_mut() {
            *o = silu(*o);
        }
        if hk > 0 {
            // element by element: `copy_within` of 3 floats was a `memmove` call per channel
            // (~3% of decode samples)
            for (h, &xc) in history.chunks_exact_mut(hk).zip(x) {
                for j in 1..hk {
                    h[j - 1] = h[j];
                }
                h[hk - 1] = xc;
            }
        }
    }
}

/// Forget-gate parameterisation of a KDA layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KdaGate {
    /// Kimi K3: `g = lb * sigmoid(exp(A_log[h]) * (graw + dt_bias))`, `lb < 0` (K3: -5).
    LowerBound(f32),
    /// Kimi-Linear: `g = -(exp(A_log[h]) * softplus(graw + dt_bias))`.
    Softplus,
}

/// Log-decay of the forget gate for every channel: `graw, dt_bias, out: [n_heads * head_dim]`,
/// `a_log: [>= n_heads]` (entry `h` used by head `h`; padding beyond `n_heads` ignored).
/// Formulas in [`KdaGate`], evaluated in the order written (`a = exp(A_log[h])` once per head,
/// `graw + dt_bias` first). Single-threaded.
pub fn kda_gate(
    graw: &[f32],
    a_log: &[f32],
    dt_bias: &[f32],
    head_dim: usize,
    gate: KdaGate,
    out_log_decay: &mut [f32],
) {
    kda_gate_with(
        active(),
        graw,
        a_log,
        dt_bias,
        head_dim,
        gate,
        out_log_decay,
    )
}

multiversion! {
    /// [`kda_gate`] on a forced path.
    pub fn kda_gate_with(graw: &[f32], a_log: &[f32], dt_bias: &[f32], head_dim: usize, gate: KdaGate, out_log_decay: &mut [f32]) {
        assert!(head_dim > 0 && graw.len().is_multiple_of(head_dim), "kda_gate: len % head_dim != 0");
        let n_heads = graw.len() / head_dim;
        assert!(a_log.len() >= n_heads, "kda_gate: a_log shorter than n_heads");
        assert!(dt_bias.len() == graw.len() && out_log_decay.len() == graw.len(), "kda_gate: length mismatch");
        for (h, &al) in a_log[..n_heads].iter().enumerate() {
            let a = exp(al);
            let r = h * head_dim..(h + 1) * head_dim;
            let it = out_log_decay[r.clone()].iter_mut().zip(&graw[r.clone()]).zip(&dt_bias[r]);
            match gate {
                KdaGate::LowerBound(lb) => {
                    for ((o, &g), &b) in it {
                        *o = lb * sigmoid(a * (g + b));
                    }
                }
                KdaGate::Softplus => {
                    for ((o, &g), &b) in it {
                        *o = -(a * softplus(g + b));
                    }
                }
            }
        }
    }
}

/// Inputs of one KDA token, all f32: `q, k, log_decay: [n_heads * head_dim_k]` (q and k
/// already L2-normalised and scaled), `v: [n_heads * head_dim_v]`, `beta: [n_heads]`.
#[derive(Clone, Copy, Debug)]
pub struct KdaStep<'a> {
    /// Queries `[n_heads, head_dim_k]`.
    pub q: &'a [f32],
    /// Keys `[n_heads, head_dim_k]`.
    pub k: &'a [f32],
    /// Values `[n_heads, head_dim_v]`.
    pub v: &'a [f32],
    /// Log of the per-key-channel decay `[n_heads, head_dim_k]` (the gate `g`).
    pub log_decay: &'a [f32],
    /// Delta-rule write strength per head `[n_heads]`.
    pub beta: &'a [f32],
    /// Number of heads.
    pub n_heads: usize,
    /// Key (and query) head dimension.
    pub head_dim_k: usize,
    /// Value head dimension.
    pub head_dim_v: usize,
}

/// One recurrent KDA step: `state: [n_heads, head_dim_k, head_dim_v]` updated in place,
/// `out: [n_heads, head_dim_v]`.
///
/// Per head, per element (index `k` = key channel, `v` = value channel):
/// 1. decay: `S[k,v] = S[k,v] * exp(g[k])`;
/// 2. `u[v] = v_in[v] - acc[v]`, `acc` = column accumulation (`+0`, then
///    `fma(S[k,v], key[k], acc)` for ascending `k`) over the decayed state;
/// 3. write: `S[k,v] = fma(beta * key[k], u[v], S[k,v])` (`beta * key[k]` rounded first);
/// 4. read: `out[v]` = column accumulation of `S[k,v] * q[k]` over the updated state.
///
/// Threads split heads (a head is computed whole by one task): identical bits for any pool.
pub fn kda_step(pool: &Pool, step: &KdaStep<'_>, state: &mut [f32], out: &mut [f32]) {
    kda_step_with(active(), pool, step, state, out)
}

/// [`kda_step`] on a forced path.
pub fn kda_step_with(
    isa: Isa,
    pool: &Pool,
    step: &KdaStep<'_>,
    state: &mut [f32],
    out: &mut [f32],
) {
    let (h, dk, dv) = (step.n_heads, step.head_dim_k, step.head_dim_v);
    assert!(
        step.q.len() == h * dk && step.k.len() == h * dk && step.log_decay.len() == h * dk,
        "kda_step: q, k, log_decay must be [n_heads * head_dim_k]"
    );
    assert_eq!(
        step.v.len(),
        h * dv,
        "kda_step: v must be [n_heads * head_dim_v]"
    );
    assert_eq!(step.beta.len(), h, "kda_step: beta must be [n_heads]");
    assert_eq!(
        state.len(),
        h * dk * dv,
        "kda_step: state must be [n_heads, dk, dv]"
    );
    assert_eq!(
        out.len(),
        h * dv,
        "kda_step: out must be [n_heads * head_dim_v]"
    );
    if h == 0 || dk == 0 || dv == 0 {
        out.fill(0.0);
        return;
    }
    pool.for_each_chunk2(state, dk * dv, out, dv, |hh, s, o| {
        let head = Head {
            q: &step.q[hh * dk..(hh + 1) * dk],
            k: &step.k[hh * dk..(hh + 1) * dk],
            v: &step.v[hh * dv..(hh + 1) * dv],
            g: &step.log_decay[hh * dk..(hh + 1) * dk],
            beta: step.beta[hh],
        };
        kda_head(isa, &head, s, o);
    });
}

/// One head's inputs.
struct Head<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    g: &'a [f32],
    beta: f32,
}

/// Value columns processed together (stack scratch; columns are independent).
const TILE: usize = 64;

multiversion! {
    fn kda_head(head: &Head<'_>, s: &mut [f32], o: &mut [f32]) {
        let dv = o.len();
        let mut v0 = 0;
        while v0 < dv {
            let t = TILE.min(dv - v0);
            let mut acc = [0.0f32; TILE];
            for (kk, (&key, &g)) in head.k.iter().zip(head.g).enumerate() {
                let a = exp(g);
                let row = &mut s[kk * dv + v0..kk * dv + v0 + t];
                for (sv, av) in row.iter_mut().zip(acc.iter_mut()) {
                    let d = *sv * a;
                    *sv = d;
                    *av = d.mul_add(key, *av);
                }
            }
            let mut u = [0.0f32; TILE];
            for ((uv, &vin), &av) in u.iter_mut().zip(&head.v[v0..v0 + t]).zip(acc.iter()) {
                *uv = vin - av;
            }
            let mut out = [0.0f32; TILE];
            for (kk, (&key, &q)) in head.k.iter().zip(head.q).enumerate() {
                let bk = head.beta * key;
                let row = &mut s[kk * dv + v0..kk * dv + v0 + t];
                for ((sv, &uv), ov) in row.iter_mut().zip(u.iter()).zip(out.iter_mut()) {
                    let w = bk.mul_add(uv, *sv);
                    *sv = w;
                    *ov = w.mul_add(q, *ov);
                }
            }
            o[v0..v0 + t].copy_from_slice(&out[..t]);
            v0 += t;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conv_step_shifts_history_and_applies_taps() {
        // one channel, kernel 3, taps [1, 2, 4]; history [a, b]; x = c
        let mut hist = [1.0f32, 2.0];
        let mut out = [0.0f32];
        conv_step(&mut hist, &[3.0], &[1.0, 2.0, 4.0], 3, &mut out);
        assert_eq!(out[0], silu(1.0 + 4.0 + 12.0));
        assert_eq!(hist, [2.0, 3.0]);
    }

    #[test]
    fn kda_step_matches_hand_computed_single_head() {
        // K = 1, V = 2: S' = a*S; u = v - S'*k; S'' = S' + b*k*u; o = S''*q
        let pool = Pool::new(1);
        let mut state = [0.5f32, -1.0];
        let mut out = [0.0f32; 2];
        let g = (0.5f32).ln();
        let step = KdaStep {
            q: &[2.0],
            k: &[1.0],
            v: &[1.0, 1.0],
            log_decay: &[g],
            beta: &[0.5],
            n_heads: 1,
            head_dim_k: 1,
            head_dim_v: 2,
        };
        kda_step(&pool, &step, &mut state, &mut out);
        let a = exp(g);
        let s1 = [0.5 * a, -a];
        let u = [1.0 - s1[0], 1.0 - s1[1]];
        let s2 = [s1[0] + 0.5 * u[0], s1[1] + 0.5 * u[1]];
        assert_eq!(state, s2);
        assert_eq!(out, [s2[0] * 2.0, s2[1] * 2.0]);
    }

    #[test]
    fn gate_formulas() {
        let mut out = [0.0f32; 2];
        kda_gate(
            &[0.0, 1.0],
            &[0.0, 9.0],
            &[0.0, 0.0],
            2,
            KdaGate::LowerBound(-5.0),
            &mut out,
        );
        assert_eq!(out[0], -2.5);
        assert_eq!(out[1], -5.0 * sigmoid(1.0));
        kda_gate(
            &[0.0, 1.0],
            &[0.0],
            &[0.0, 0.0],
            2,
            KdaGate::Softplus,
            &mut out,
        );
        assert_eq!(out[1], -softplus(1.0));
    }
}
