//! Token-major buffers of a multi-token pass and the matvecs that read each weight once for
//! all of its tokens.
//!
//! Owns: [`Rows`] (`[n, width]` buffers, row `i` = token `i` of the pass; one work area carved
//! per phase) and [`lin_many`] (bf16 projections of `n` inputs: each weight row block applied
//! to every token while it is in cache, each output bit-identical to one-input matvecs).
//! Must not: reorder any output's reduction (see `k3_kernels::matvec`).

use std::borrow::Cow;

use k3_kernels::matvec;
use k3_kernels::par::{Pool, stream_row_chunk};

use crate::plan::BufferSizes;
use crate::weights::TensorBytes;

use super::bf16_bits;

/// The token-major buffers of a pass over `n` tokens: the fixed rows every layer uses and one
/// work area the attention phase and then the FFN phase carve ([`carve`]). Grown on demand
/// (`fit`), never shrunk; a one-token decode step uses the first row of each.
pub(super) struct Rows {
    per_work: usize,
    d: usize,
    /// [n, d] each: the normed input of the current phase, the attention output, the FFN
    /// output, the shared experts' output.
    pub(super) xn: Vec<f32>,
    pub(super) attn_out: Vec<f32>,
    pub(super) mlp_out: Vec<f32>,
    pub(super) tmp_d: Vec<f32>,
    /// [n, pass_work_per_token]
    pub(super) work: Vec<f32>,
    /// [n, top_k]: each token's routed ids (ascending) and weights.
    pub(super) ids: Vec<u32>,
    pub(super) weights: Vec<f32>,
    k: usize,
}

impl Rows {
    pub(super) fn new(b: &BufferSizes) -> Rows {
        Rows {
            per_work: b.pass_work_per_token(),
            d: b.d_model,
            xn: Vec::new(),
            attn_out: Vec::new(),
            mlp_out: Vec::new(),
            tmp_d: Vec::new(),
            work: Vec::new(),
            ids: Vec::new(),
            weights: Vec::new(),
            k: b.n_experts_active,
        }
    }

    /// Room for `n` tokens (contents unspecified).
    pub(super) fn fit(&mut self, n: usize) {
        let d = self.d;
        for v in [
            &mut self.xn,
            &mut self.attn_out,
            &mut self.mlp_out,
            &mut self.tmp_d,
        ] {
            if v.len() < n * d {
                v.resize(n * d, 0.0);
            }
        }
        if self.work.len() < n * self.per_work {
            self.work.resize(n * self.per_work, 0.0);
        }
        if self.ids.len() < n * self.k {
            self.ids.resize(n * self.k, 0);
            self.weights.resize(n * self.k, 0.0);
        }
    }

    /// Bytes held (for the plan's accounting test).
    #[cfg(test)]
    pub(super) fn bytes(&self) -> usize {
        4 * (self.xn.len()
            + self.attn_out.len()
            + self.mlp_out.len()
            + self.tmp_d.len()
            + self.work.len()
            + self.ids.len()
            + self.weights.len())
    }
}

/// Consecutive pieces of `buf` of the given lengths (the rest is left out). Panics if `buf` is
/// shorter than their sum (the work area is sized by `BufferSizes::pass_work_per_token`).
pub(super) fn carve<const N: usize>(mut buf: &mut [f32], lens: [usize; N]) -> [&mut [f32]; N] {
    let mut out: [&mut [f32]; N] = std::array::from_fn(|_| <&mut [f32]>::default());
    for (o, n) in out.iter_mut().zip(lens) {
        let (a, b) = std::mem::take(&mut buf).split_at_mut(n);
        *o = a;
        buf = b;
    }
    out
}

/// Several bf16 projections of `n` tokens: job `(w, xs, outs)` is `outs[i] = W xs[i]` for
/// each token `i` (`xs: [n, cols]`, `outs: [n, rows]`, row-major), each job one dispatch of
/// [`matvec::matvec_bf16_many`] (tasks are row ranges computed for every token, the weights
/// read once). Every output row is one canonical dot product on one thread, so the bits equal
/// separate one-token matvecs for any thread count and any `n`. With one token (a decode
/// step) every job's row chunks go into ONE dispatch: tasks of at least 1 MB of rows, each a
/// contiguous stream (`matvec_bf16`), without a fork/join per small matrix.
pub(super) fn lin_many(pool: &Pool, n: usize, jobs: Vec<(TensorBytes<'_>, &[f32], &mut [f32])>) {
    if n == 0 {
        return;
    }
    let ws: Vec<Cow<'_, [u16]>> = jobs.iter().map(|(t, _, _)| bf16_bits(*t)).collect();
    let serial = Pool::new(1);
    if n == 1 {
        // A decode step: the same tasks without the per-task token lists (this runs ~8 times
        // per layer per token; their allocations cost ~1% of resident decode).
        let mut tasks: Vec<(&[u16], &[f32], &mut [f32])> = Vec::new();
        for (w, (_, x, out)) in ws.iter().zip(jobs) {
            let cols = x.len();
            assert_eq!(
                w.len(),
                out.len() * cols,
                "lin_many: a job's shapes disagree"
            );
            if cols == 0 {
                out.fill(0.0);
                continue;
            }
            let per = stream_row_chunk(out.len(), cols * 2, pool.n_threads());
            for (wc, oc) in w.chunks(per * cols).zip(out.chunks_mut(per)) {
                tasks.push((wc, x, oc));
            }
        }
        pool.for_each_chunk(&mut tasks, 1, |_, t| {
            for (w, x, o) in t.iter_mut() {
                matvec::matvec_bf16(&serial, w, x, o);
            }
        });
        return;
    }
    for (w, (_, xs, outs)) in ws.iter().zip(jobs) {
        let (rows, cols) = (outs.len() / n, xs.len() / n);
        assert!(
            outs.len() == n * rows && xs.len() == n * cols && w.len() == rows * cols,
            "lin_many: a job's shapes disagree ({} weights, {} inputs, {} outputs, {n} tokens)",
            w.len(),
            xs.len(),
            outs.len()
        );
        // One dispatch per matrix (a pass's projections are tens of microseconds of work per
        // token: the fork/join is small beside them).
        let x_rows: Vec<&[f32]> = (0..n).map(|i| &xs[i * cols..(i + 1) * cols]).collect();
        let mut out_rows: Vec<&mut [f32]> = Vec::with_capacity(n);
        let mut rest = outs;
        for _ in 0..n {
            let (o, r) = std::mem::take(&mut rest).split_at_mut(rows);
            out_rows.push(o);
            rest = r;
        }
        matvec::matvec_bf16_many(pool, w, &x_rows, &mut out_rows);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `Rows` holds for `n` tokens is what the plan counts for them
    /// (`Plan::prefill_bytes` adds the carries and expert outputs).
    #[test]
    fn rows_hold_what_the_plan_counts() {
        let b = BufferSizes {
            d_model: 96,
            kda_heads: 3,
            kda_channels: 3 * 32,
            kda_gate_rank: 40,
            mla_heads: 2,
            mla_q_lora: 24,
            mla_q: 2 * 48,
            mla_ckv: 40,
            mla_kv_lora: 32,
            mla_kv: 2 * 64,
            mla_out: 2 * 32,
            max_ff: 160,
            n_experts: 8,
            n_experts_active: 3,
            expert_ff: 80,
            moe_latent: 48,
            ..BufferSizes::default()
        };
        let mut r = Rows::new(&b);
        for n in [1, 5, 64, 3] {
            r.fit(n);
            let per = b.pass_fixed_per_token() + b.pass_work_per_token() + 2 * b.n_experts_active;
            // grown to the largest n so far, never shrunk
            let most = n.max(if n == 3 { 64 } else { n });
            assert_eq!(r.bytes(), 4 * most * per, "n = {n}");
        }
    }

    #[test]
    fn carve_gives_consecutive_pieces() {
        let mut buf: Vec<f32> = (0..10).map(|i| i as f32).collect();
        let [a, b, c] = carve(&mut buf, [2, 0, 5]);
        assert_eq!(a, &[0.0, 1.0]);
        assert!(b.is_empty());
        assert_eq!(c, &[2.0, 3.0, 4.0, 5.0, 6.0]);
    }
}
