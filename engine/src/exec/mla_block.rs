//! Multi-head Latent Attention (MLA, NoPE): the softmax-attention block of every few layers.
//!
//! Per token x [d_model], H heads, widths nope / rope / v, latent ranks q_lora and kv_lora:
//! q = q_b(RMSNorm(q_a x)) -> [H, nope + rope] (or q = W_q x without a q latent);
//! c = kv_a x -> [kv_lora | rope]; kv = kv_b(RMSNorm(c_kv)) -> [H, nope | v]; the key is
//! [k_nope(h) | k_rope] with k_rope shared by the heads; no rotary embedding is applied (NoPE).
//! Scores q.k * softmax_scale over the sequence's positions so far, softmax, weighted sum of v
//! -> [H, v], optionally gated by sigmoid(g x), then o_proj -> [d_model].
//! Decode state ([`MlaState`]): the latent form, f32, one row per position appended in token
//! order: the normalised `c_kv` [kv_lora] and the shared `k_rope` [rope]. Attention is
//! computed absorbed ([`attn::mla_attend`]): the query's nope part is mapped into the latent
//! space through `kv_b`'s key rows, scored against the cached latent plus `k_rope`, and the
//! probability-weighted latent is mapped out through `kv_b`'s value rows, per head. In exact
//! arithmetic this is the expanded form above; the canonical order is docs/NUMERICS.md §1.

use super::*;

/// Latent KV cache of one MLA layer: the normalised `c_kv` and the shared `k_rope`.
#[derive(Clone, Debug, Default)]
pub struct MlaState {
    /// [n_pos, kv_lora]: RMSNorm(c_kv) with the norm's weight applied.
    pub c_kv: Vec<f32>,
    /// [n_pos, d_rope]
    pub k_rope: Vec<f32>,
}

impl<'s> Executor<'s> {
    /// Multi-head latent attention (NoPE) for the tokens of [`Self::attention`]: each token's
    /// key and value are appended to its sequence's cache and it attends to its positions so
    /// far, in token order.
    pub(super) fn mla_many(
        spec: &ModelSpec,
        pool: &Pool,
        s: &mut Scratch,
        rows: &mut Rows,
        (lw, l): (&LayerWeights<'_>, usize),
        sts: &mut [&mut LayerState],
        at: &[(usize, usize)],
    ) -> Result<(), ExecError> {
        let p = spec
            .mla
            .as_ref()
            .expect("validated: MLA layers have an MlaSpec");
        let (h, dn, dr, dv) = (p.n_heads, p.d_nope, p.d_rope, p.d_v);
        let (dq, kvl, ql) = (dn + dr, p.kv_lora_rank, p.q_lora_rank.unwrap_or(0));
        let (d, n) = (spec.d_model, at.len());
        let Rows {
            xn, attn_out, work, ..
        } = rows;
        let (xn, attn_out) = (&xn[..n * d], &mut attn_out[..n * d]);
        let [qa, qan, mq, ckv, ckvn, mo, mg] = carve(
            work,
            [
                n * ql,
                n * ql,
                n * h * dq,
                n * (kvl + dr),
                n * kvl,
                n * h * dv,
                n * h * dv,
            ],
        );
        // projections of every token: q_a [q_lora] (or q [H*(nope+rope)]), kv_a [kv_lora |
        // k_rope], output gate g [H*dv]
        let mut jobs = vec![(need(lw, l, TensorRole::MlaKvA)?, xn, &mut *ckv)];
        match p.q_lora_rank {
            Some(_) => jobs.push((need(lw, l, TensorRole::MlaQA)?, xn, &mut *qa)),
            None => jobs.push((need(lw, l, TensorRole::MlaQ)?, xn, &mut *mq)),
        }
        if p.output_gate {
            jobs.push((need(lw, l, TensorRole::MlaGate)?, xn, &mut *mg));
        }
        lin_many(pool, n, jobs);
        // q = q_b(RMSNorm(q_a x)) -> [H, nope+rope]
        if p.q_lora_rank.is_some() {
            let nw = widen(need(lw, l, TensorRole::MlaQANorm)?, &mut s.w_a);
            for (a, an) in qa.chunks(ql).zip(qan.chunks_mut(ql)) {
                ops::rmsnorm(a, Some(&s.w_a[..nw]), p.latent_norm_eps, an);
            }
            let w = need(lw, l, TensorRole::MlaQB)?;
            lin_many(pool, n, vec![(w, &*qan, &mut *mq)]);
        }
        // c = kv_a x -> [kv_lora | k_rope]; the cache row is [RMSNorm(c_kv) | k_rope]
        let nw = widen(need(lw, l, TensorRole::MlaKvANorm)?, &mut s.w_a);
        for (c, cn) in ckv.chunks(kvl + dr).zip(ckvn.chunks_mut(kvl)) {
            ops::rmsnorm(&c[..kvl], Some(&s.w_a[..nw]), p.latent_norm_eps, cn);
        }
        let w_kv_b = bf16_bits(need(lw, l, TensorRole::MlaKvB)?);
        for (i, &(seq, pos)) in at.iter().enumerate() {
            let LayerState::Mla(st) = &mut *sts[seq] else {
                unreachable!("SeqState is built from the same layer map")
            };
            // append this position to the cache
            debug_assert_eq!(st.k_rope.len(), pos * dr);
            st.c_kv.extend_from_slice(&ckvn[i * kvl..(i + 1) * kvl]);
            st.k_rope
                .extend_from_slice(&ckv[i * (kvl + dr) + kvl..(i + 1) * (kvl + dr)]);
            let n_pos = pos + 1;
            let shape = attn::MlaShape {
                n_heads: h,
                d_nope: dn,
                d_rope: dr,
                d_v: dv,
                kv_lora: kvl,
                n_pos,
                scale: 1.0 / (dq as f32).sqrt(),
            };
            let moi = &mut mo[i * h * dv..(i + 1) * h * dv];
            let cache = attn::MlaCache {
                c_kv: &st.c_kv,
                k_rope: &st.k_rope,
            };
            attn::mla_attend(
                pool,
                &shape,
                &mq[i * h * dq..(i + 1) * h * dq],
                &w_kv_b,
                &cache,
                &mut s.scores[..shape.work_len()],
                moi,
            );
            if p.output_gate {
                // g = g_proj x was computed with the other projections above
                ops::mul_sigmoid_inplace(moi, &mg[i * h * dv..(i + 1) * h * dv]);
            }
        }
        let w_o = need(lw, l, TensorRole::MlaO)?;
        lin_many(pool, n, vec![(w_o, &*mo, attn_out)]);
        Ok(())
    }
}
