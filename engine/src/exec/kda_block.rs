//! Kimi Delta Attention (KDA): the linear-attention block of most layers.
//!
//! Per token x [d_model], for H heads of width dk (D = H * dk):
//! q, k, v = ShortConv_{q,k,v}(W_{q,k,v} x) (causal depthwise conv of `conv_kernel` taps over
//! the last positions, then SiLU) -> [D] each; q, k L2-normalised per head;
//! the per-channel decay g = -exp(A_log[h]) * softplus(f_b(f_a x) + dt_bias) (low-rank
//! `gate_rank`) -> [D]; beta = sigmoid(b x) -> [H];
//! per head the delta rule on the state S [dk, dk]:
//! S = diag(exp(g)) S;  S += beta k (v - S^T k)^T;  o = S^T q * dk^-1/2;
//! output o -> RMSNorm per head, gated by sigmoid(g_b(g_a x)), then W_o -> [d_model].
//! Decode state ([`KdaState`]): the conv windows and S, f32. Every position runs the same
//! kernel calls in the same order whether stepped or prefilled (docs/NUMERICS.md §1).

use super::*;

/// Decode state of one KDA layer: conv windows of the pre-conv q/k/v inputs and the
/// recurrent state S[h, k, v] (f32).
#[derive(Clone, Debug)]
pub struct KdaState {
    /// [channels, conv_kernel-1] each, oldest first.
    pub conv_q: Vec<f32>,
    pub conv_k: Vec<f32>,
    pub conv_v: Vec<f32>,
    /// [n_heads, head_dim (key), head_dim (value)]
    pub s: Vec<f32>,
}

/// One KDA head's task in the per-head dispatch of [`Executor::kda_many`].
pub(super) struct KdaHead<'a> {
    /// Each sequence's conv windows (q, k, v) and state of this head.
    pub(super) seqs: Vec<([&'a mut [f32]; 3], &'a mut [f32])>,
    /// This head's output of each token of the pass.
    pub(super) outs: Vec<&'a mut [f32]>,
    /// The conv outputs q, k, v of the token being stepped [3 * D].
    pub(super) qkv: &'a mut [f32],
}

/// `v` cut into `h` slices of `n` (empty slices when `n == 0`).
pub(super) fn per_head(v: &mut [f32], n: usize, h: usize) -> Vec<&mut [f32]> {
    if n == 0 {
        (0..h).map(|_| <&mut [f32]>::default()).collect()
    } else {
        v.chunks_mut(n).take(h).collect()
    }
}

impl<'s> Executor<'s> {
    /// Kimi Delta Attention for the tokens of [`Self::attention`].
    pub(super) fn kda_many(
        spec: &ModelSpec,
        (pool, serial): (&Pool, &Pool),
        s: &mut Scratch,
        rows: &mut Rows,
        (lw, l): (&LayerWeights<'_>, usize),
        sts: &mut [&mut LayerState],
        at: &[(usize, usize)],
    ) -> Result<(), ExecError> {
        let p = spec
            .kda
            .as_ref()
            .expect("validated: KDA layers have a KdaSpec");
        let (h, dk, ck) = (p.n_heads, p.head_dim, p.conv_kernel);
        let (ch, rank, d, n) = (h * dk, p.gate_rank, spec.d_model, at.len());
        let Rows {
            xn, attn_out, work, ..
        } = rows;
        let (xn, attn_out) = (&xn[..n * d], &mut attn_out[..n * d]);
        let [q, k, v, fa, beta, gout, graw, log_decay, o, on, ga] = carve(
            work,
            [
                n * ch,
                n * ch,
                n * ch,
                n * rank,
                n * h,
                n * ch,
                n * ch,
                n * ch,
                n * ch,
                n * ch,
                n * dk,
            ],
        );
        // projections of every token: q, k, v [H*D], f_a [rank], b [H], g [H*D]
        let mut jobs = vec![
            (need(lw, l, TensorRole::KdaQ)?, xn, &mut *q),
            (need(lw, l, TensorRole::KdaK)?, xn, &mut *k),
            (need(lw, l, TensorRole::KdaV)?, xn, &mut *v),
            (need(lw, l, TensorRole::KdaFA)?, xn, &mut *fa),
            (need(lw, l, TensorRole::KdaBeta)?, xn, &mut *beta),
        ];
        if p.full_rank_output_gate {
            jobs.push((need(lw, l, TensorRole::KdaGate)?, xn, &mut *gout));
        }
        lin_many(pool, n, jobs);
        // forget gate: graw = f_b(f_a x); g = gate(graw, A_log, dt_bias)
        let w_fb = need(lw, l, TensorRole::KdaFB)?;
        lin_many(pool, n, vec![(w_fb, &*fa, &mut *graw)]);
        let na = widen(need(lw, l, TensorRole::KdaALog)?, &mut s.w_a);
        let nb = widen(need(lw, l, TensorRole::KdaDtBias)?, &mut s.w_b);
        let gate = match p.gate {
            KdaGateSpec::LowerBound(lb) => kda::KdaGate::LowerBound(lb),
            KdaGateSpec::Softplus => kda::KdaGate::Softplus,
        };
        // A_log: first n_heads entries (padding validated zero at load)
        debug_assert!(na >= h);
        for (gr, ld) in graw.chunks(ch).zip(log_decay.chunks_mut(ch)) {
            kda::kda_gate(gr, &s.w_a[..h], &s.w_b[..nb], dk, gate, ld);
        }
        // beta = sigmoid(b_proj x) [H]
        for b in beta.iter_mut() {
            *b = k3_kernels::math::sigmoid(*b);
        }
        // Per head, in ONE dispatch, every token in order (every step below is per channel or
        // per head, so a head's bits do not depend on which thread runs it): the causal
        // depthwise short conv + SiLU of q, k, v (taps [ch, 1, ck]), the L2 norm of q (scaled
        // by head_dim^-1/2) and k, and the delta-rule step on the head's state of the token's
        // sequence.
        let nq = widen(need(lw, l, TensorRole::KdaQConv)?, &mut s.w_a);
        let nk = widen(need(lw, l, TensorRole::KdaKConv)?, &mut s.w_b);
        let nv = widen(need(lw, l, TensorRole::KdaVConv)?, &mut s.w_c);
        let taps = [&s.w_a[..nq], &s.w_b[..nk], &s.w_c[..nv]];
        let (hk, sd) = (dk * (ck - 1), dk * dk);
        let (q_scale, l2_eps) = (1.0 / (dk as f32).sqrt(), p.l2_eps);
        let (q, k, v, log_decay, beta) = (&*q, &*k, &*v, &*log_decay, &*beta);
        // head hh of every sequence: its conv windows and state
        let mut heads: Vec<KdaHead<'_>> = s.kda_qkv[..3 * ch]
            .chunks_mut(3 * dk)
            .map(|qkv| KdaHead {
                seqs: Vec::with_capacity(sts.len()),
                outs: Vec::with_capacity(n),
                qkv,
            })
            .collect();
        for st in sts.iter_mut() {
            let LayerState::Kda(st) = &mut **st else {
                unreachable!("SeqState is built from the same layer map")
            };
            let [hq, hk_, hv] =
                [&mut st.conv_q, &mut st.conv_k, &mut st.conv_v].map(|c| per_head(c, hk, h));
            for ((((cq, ck_), cv), state), head) in hq
                .into_iter()
                .zip(hk_)
                .zip(hv)
                .zip(st.s.chunks_mut(sd))
                .zip(heads.iter_mut())
            {
                head.seqs.push(([cq, ck_, cv], state));
            }
        }
        for (j, c) in o.chunks_mut(dk).enumerate() {
            heads[j % h].outs.push(c);
        }
        pool.for_each_chunk(&mut heads, 1, |hh, t| {
            let t = &mut t[0];
            let (qc, rest) = t.qkv.split_at_mut(dk);
            let (kc, vc) = rest.split_at_mut(dk);
            let mut qkv = [qc, kc, vc];
            for (i, &(seq, _)) in at.iter().enumerate() {
                let (conv, state) = &mut t.seqs[seq];
                let r = i * ch + hh * dk..i * ch + (hh + 1) * dk;
                for (j, (x, out)) in [&q[r.clone()], &k[r.clone()], &v[r.clone()]]
                    .into_iter()
                    .zip(qkv.iter_mut())
                    .enumerate()
                {
                    kda::conv_step(
                        conv[j],
                        x,
                        &taps[j][hh * dk * ck..(hh + 1) * dk * ck],
                        ck,
                        out,
                    );
                }
                let [qc, kc, vc] = &mut qkv;
                ops::l2norm_heads(qc, dk, l2_eps, q_scale);
                ops::l2norm_heads(kc, dk, l2_eps, 1.0);
                let step = kda::KdaStep {
                    q: qc,
                    k: kc,
                    v: vc,
                    log_decay: &log_decay[r],
                    beta: &beta[i * h + hh..i * h + hh + 1],
                    n_heads: 1,
                    head_dim_k: dk,
                    head_dim_v: dk,
                };
                kda::kda_step(serial, &step, state, t.outs[i]);
            }
        });
        drop(heads);
        // output gate + gated RMSNorm per head: o * rms_inv(o) * o_norm * sigmoid(g)
        if !p.full_rank_output_gate {
            // low-rank output gate (Kimi-Linear); the full-rank one was computed above
            let w_a = need(lw, l, TensorRole::KdaGateA)?;
            lin_many(pool, n, vec![(w_a, xn, &mut *ga)]);
            let w_b = need(lw, l, TensorRole::KdaGateB)?;
            lin_many(pool, n, vec![(w_b, &*ga, &mut *gout)]);
        }
        let nn = widen(need(lw, l, TensorRole::KdaONorm)?, &mut s.w_a);
        for ((oh, onh), gh) in o.chunks(dk).zip(on.chunks_mut(dk)).zip(gout.chunks(dk)) {
            ops::rmsnorm(oh, Some(&s.w_a[..nn]), p.o_norm_eps, onh);
            ops::mul_sigmoid_inplace(onh, gh);
        }
        let w_o = need(lw, l, TensorRole::KdaO)?;
        lin_many(pool, n, vec![(w_o, &*on, attn_out)]);
        Ok(())
    }
}
