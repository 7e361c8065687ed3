//! Mixture of experts with its routing, and the look-ahead guess of the next layers' experts.
//!
//! Per token x [d_model]: router logits W_r x -> [n_experts], scored (sigmoid, plus the
//! correction bias for the choice only), grouped top-k (`n_group` / `topk_group`) -> the k
//! chosen experts and their normalised weights times `routed_scaling_factor`. With a latent
//! MoE, x is first projected to the latent width; each chosen expert e computes
//! w2_e(act(w1_e x) * w3_e x) (MXFP4 or bf16 weights, read through [`ExpertSource`]); the
//! weighted sum (in the order of the routing, fixed, docs/NUMERICS.md §1) is projected back and
//! the shared experts (a dense GLU on every token) are added.
//! Layer-major prefill applies each chosen expert to all of its tokens at once
//! ([`Executor::moe_many`]); decode asks the expert source for the guessed experts of later
//! MoE layers while this one computes (never changing a bit).

use super::*;

/// The router settings of a MoE layer, selecting `top_k` experts (the real routing: the
/// layer's top-k; a prefetch guess: top-k plus its margin).
pub(super) fn router_cfg(p: &k3_models::spec::MoeSpec, top_k: usize) -> router::RouterCfg {
    router::RouterCfg {
        top_k,
        scoring: match p.scoring {
            RouterScoring::Sigmoid => router::Scoring::Sigmoid,
            RouterScoring::Softmax => router::Scoring::Softmax,
        },
        renormalize: p.renormalize,
        scale: p.routed_scaling_factor,
    }
}

/// The widths of a MoE layer, derived once from the spec.
pub(super) struct MoeDims<'s> {
    pub(super) p: &'s k3_models::spec::MoeSpec,
    /// Routed experts.
    pub(super) ne: usize,
    /// Experts per token (top-k).
    pub(super) k: usize,
    /// Expert FFN width.
    pub(super) ff: usize,
    /// Expert input/output width: the latent, or d_model without latent MoE.
    pub(super) dz: usize,
    /// Fused shared-expert width (`ff * n_shared_experts`).
    pub(super) sw: usize,
    /// One routed expert's scratch slot `[gate ff | up ff | h ff | out dz]`.
    pub(super) stride: usize,
}

impl<'s> MoeDims<'s> {
    pub(super) fn of(spec: &'s ModelSpec) -> MoeDims<'s> {
        let p = spec
            .moe
            .as_ref()
            .expect("validated: MoE layers have a MoeSpec");
        let (ff, dz) = (p.d_expert_ff, p.d_latent.unwrap_or(spec.d_model));
        MoeDims {
            p,
            ne: p.n_experts,
            k: p.n_experts_active,
            ff,
            dz,
            sw: ff * p.n_shared_experts,
            stride: 3 * ff + dz,
        }
    }
}

/// Scratch of the expert-prefetch guess, separate from [`Scratch`] so the guess cannot touch
/// anything the real forward pass reads.
pub(super) struct GuessScratch {
    pub(super) xn: Vec<f32>,      // [d_model]
    pub(super) norm: Vec<f32>,    // [max small tensor]
    pub(super) bias: Vec<f32>,    // [max small tensor]
    pub(super) logits: Vec<f32>,  // [E]
    pub(super) ids: Vec<u32>,     // [E]
    pub(super) weights: Vec<f32>, // [E]
    /// The MoE layers guessed by look-ahead and not reached yet (their own pre-attention guess
    /// is skipped).
    pub(super) ahead_for: Vec<usize>,
    pub(super) q: Vec<f32>, // [d_model] pseudo-query of the next layer's MLP AttnRes
    pub(super) mix: Vec<f32>, // [d_model] estimated next MoE input
    pub(super) rl: Vec<f32>, // [AttnRes sources]
}

impl GuessScratch {
    pub(super) fn new(plan: &Plan) -> GuessScratch {
        let b = &plan.buffers;
        GuessScratch {
            xn: vec![0.0; b.d_model],
            norm: vec![0.0; b.max_small_tensor],
            bias: vec![0.0; b.max_small_tensor],
            logits: vec![0.0; b.n_experts],
            ids: vec![0; b.n_experts],
            weights: vec![0.0; b.n_experts],
            ahead_for: Vec::new(),
            q: vec![0.0; b.d_model],
            mix: vec![0.0; b.d_model],
            rl: vec![0.0; b.max_attn_res_sources + 1],
        }
    }
}

/// The routed experts `ws` (one task each; `ws[t]` is the expert routed `at[t]`-th and writes
/// the `at[t]`-th `scratch.len() / k`-sized slot of `scratch`, see [`Executor::moe`]) and the
/// bf16 matvecs `rows` on input `x` (split into row chunks of about one expert's time) in ONE
/// dispatch, tasks interleaved: the experts are compute-bound (MXFP4 decode) and the rows
/// memory-bound, so two threads running one of each use both the cores and the memory bus.
/// Every output is the same kernel call on the same input as in separate dispatches (a row is
/// always one canonical dot on one thread), so the bits do not change.
pub(super) fn experts_with_rows(
    (pool, serial): (&Pool, &Pool),
    (act, ff, k): (Activation, usize, usize),
    (xin, scratch, at, ws): (&[f32], &mut [f32], &[usize], &[ExpertWeights<'_>]),
    (x, rows): (&[f32], Vec<(TensorBytes<'_>, &mut [f32])>),
) {
    enum Work<'a, 'w> {
        Expert(&'a ExpertWeights<'w>, &'a mut [f32]),
        Rows(&'a [u16], &'a mut [f32]),
    }
    let cols = x.len();
    let ws_bits: Vec<Cow<'_, [u16]>> = rows.iter().map(|(t, _)| bf16_bits(*t)).collect();
    let total_rows: usize = rows.iter().map(|(_, o)| o.len()).sum();
    let per = total_rows
        .div_ceil(ws.len().max(1))
        .max(stream_row_chunk(total_rows, cols * 2, pool.n_threads()))
        .next_multiple_of(8);
    let mut row_tasks = Vec::new();
    for (w, (_, out)) in ws_bits.iter().zip(rows) {
        for (i, oc) in out.chunks_mut(per).enumerate() {
            let r0 = i * per;
            row_tasks.push(Work::Rows(&w[r0 * cols..(r0 + oc.len()) * cols], oc));
        }
    }
    // which[j]: the index in `ws` of the expert routed j-th (None: not in this call)
    let mut which = vec![None; k];
    for (t, &j) in at.iter().enumerate() {
        which[j] = Some(t);
    }
    let stride = scratch.len() / k.max(1);
    let mut tasks: Vec<Work<'_, '_>> = Vec::with_capacity(ws.len() + row_tasks.len());
    let mut row_tasks = row_tasks.into_iter();
    for (j, buf) in scratch.chunks_mut(stride.max(1)).enumerate() {
        if let Some(t) = which.get(j).copied().flatten() {
            tasks.push(Work::Expert(&ws[t], buf));
            tasks.extend(row_tasks.next());
        }
    }
    tasks.extend(row_tasks);
    pool.for_each_chunk(&mut tasks, 1, |_, t| match &mut t[0] {
        Work::Expert(ew, buf) => {
            // the slot is [gate ff | up ff | h ff | out]
            let (tmp, out) = buf.split_at_mut(3 * ff);
            expert_ffn(act, ff, xin, ew, tmp, out);
        }
        Work::Rows(w, o) => matvec::matvec_bf16(serial, w, x, o),
    });
}

/// One routed expert on one thread: `out = W2 glu(W1 xin, W3 xin)` with `tmp` (`3 * ff`) as
/// the gate / up / h scratch (see [`expert_ffn_many`]).
pub(super) fn expert_ffn(
    act: Activation,
    ff: usize,
    xin: &[f32],
    ew: &ExpertWeights<'_>,
    tmp: &mut [f32],
    out: &mut [f32],
) {
    expert_ffn_many(act, ff, &[xin], ew, tmp, &mut [out]);
}

/// One routed expert applied to several inputs on one thread: `outs[t] = W2 glu(W1 xins[t],
/// W3 xins[t])`, with `tmp` (`3 * ff` per input) as the gate / up / h scratch. Each weight
/// row is decoded once for all the inputs (`rows_mxfp4_many` / `rows_bf16_many`), each output
/// the canonical row order of its input alone (MXFP4 or BF16 weights; both kernels accumulate
/// in the same canonical order, so an expert stored as BF16 holding the exact values of an
/// MXFP4 one gives the same bits).
pub(super) fn expert_ffn_many(
    act: Activation,
    ff: usize,
    xins: &[&[f32]],
    ew: &ExpertWeights<'_>,
    tmp: &mut [f32],
    outs: &mut [&mut [f32]],
) {
    let n = xins.len();
    let (gate, rest) = tmp[..3 * ff * n].split_at_mut(ff * n);
    let (up, h) = rest.split_at_mut(ff * n);
    let mut g: Vec<&mut [f32]> = gate.chunks_mut(ff).collect();
    let mut u: Vec<&mut [f32]> = up.chunks_mut(ff).collect();
    match ew.format {
        ExpertFormat::Mxfp4 => {
            matvec::rows_mxfp4_many(ew.w1_packed, ew.w1_scale, xins, &mut g);
            matvec::rows_mxfp4_many(ew.w3_packed, ew.w3_scale, xins, &mut u);
        }
        ExpertFormat::Bf16 => {
            matvec::rows_bf16_many(&bf16_of(ew.w1_packed), xins, &mut g);
            matvec::rows_bf16_many(&bf16_of(ew.w3_packed), xins, &mut u);
        }
    }
    for ((gi, ui), hi) in g.iter().zip(&u).zip(h.chunks_mut(ff)) {
        glu(act, gi, ui, hi);
    }
    let hs: Vec<&[f32]> = h.chunks(ff).collect();
    match ew.format {
        ExpertFormat::Mxfp4 => matvec::rows_mxfp4_many(ew.w2_packed, ew.w2_scale, &hs, outs),
        ExpertFormat::Bf16 => matvec::rows_bf16_many(&bf16_of(ew.w2_packed), &hs, outs),
    }
}

/// Most tokens one task of an expert-major layer applies its expert to ([`Executor::moe_many`]):
/// an expert most of a chunk chose is split into several tasks, so the threads stay balanced.
pub(super) const EXPERT_TOKENS_PER_TASK: usize = 8;

/// How many MoE layers ahead the look-ahead expert guess reaches: during MoE layer L the
/// experts of the second MoE layer after it are guessed (the first was guessed during the MoE
/// layer before L), so about two layers of reads are queued and the disk does not idle between
/// them. k3-mini pinned trunk + desktop-sized cache, 9 alternating runs each: prefetch wait
/// 0.23-0.55 vs 0.41-0.73 s per run, decode faster in 6 of 9 pairs (medians 0.1881 vs 0.1981
/// in the second round), guess coverage 97.6% vs 97.9%. Never changes a bit.
pub const DEFAULT_LOOKAHEAD_DEPTH: usize = 2;

/// Environment variable overriding [`DEFAULT_LOOKAHEAD_DEPTH`] (1 = the next MoE layer), for
/// benchmarks.
pub const LOOKAHEAD_DEPTH_ENV: &str = "K3_LOOKAHEAD_DEPTH";

pub(super) fn lookahead_depth() -> usize {
    std::env::var(LOOKAHEAD_DEPTH_ENV)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(DEFAULT_LOOKAHEAD_DEPTH)
        .max(1)
}

impl<'s> Executor<'s> {
    /// The MoE of `n` tokens whose inputs are in `rows.xn`, EXPERT-MAJOR: the router and the
    /// latent down-projection of all tokens (weights read once), every token's routing, then
    /// each routed expert any token chose is fetched ONCE (ascending id, `top_k` per
    /// `experts()` call) and applied to every token that chose it, the shared experts of all
    /// tokens, and each token's combine in its routed order, the latent up-projection of all
    /// tokens; outputs into `rows.mlp_out`. A streamed expert is read once per layer per call
    /// instead of once per token that routes to it; the bits are those of [`Self::moe`].
    pub(super) fn moe_many(
        &mut self,
        l: usize,
        lw: &LayerWeights<'_>,
        n: usize,
        experts: &mut dyn ExpertSource,
    ) -> Result<(), ExecError> {
        let spec = self.spec;
        let MoeDims {
            p,
            ne,
            k,
            ff,
            dz,
            sw,
            ..
        } = MoeDims::of(spec);
        let (d, act) = (spec.d_model, spec.activation);
        let (pool, s) = (&self.pool, &mut self.s);
        let Rows {
            xn,
            mlp_out,
            tmp_d,
            work,
            ids,
            weights,
            ..
        } = &mut self.rows;
        let (xn, mlp_out, tmp_d) = (&xn[..n * d], &mut mlp_out[..n * d], &mut tmp_d[..n * d]);
        let (ids, weights) = (&mut ids[..n * k], &mut weights[..n * k]);
        let latent = p.d_latent.is_some();
        let [logits, z, acc, gate, up, h] = carve(
            work,
            [
                n * ne,
                if latent { n * dz } else { 0 },
                n * dz,
                n * sw,
                n * sw,
                n * sw,
            ],
        );
        let mut jobs = vec![(need(lw, l, TensorRole::Router)?, xn, &mut *logits)];
        if latent {
            jobs.push((need(lw, l, TensorRole::LatentDown)?, xn, &mut *z));
        }
        lin_many(pool, n, jobs);
        for i in 0..n {
            Self::route_token(
                p,
                &mut s.w_a,
                (lw, l),
                &logits[i * ne..(i + 1) * ne],
                &mut ids[i * k..(i + 1) * k],
                &mut weights[i * k..(i + 1) * k],
            )?;
        }
        // the expert input of token i: its latent z or its MoE input
        let xin: &[f32] = if latent { z } else { xn };
        // Each chosen expert once, top_k at a time; one task per (token, expert) pair, each on
        // one thread (a task's bits are those of the canonical row order).
        let mut union: Vec<u32> = ids.to_vec();
        union.sort_unstable();
        union.dedup();
        // Only each expert's output is kept ([token][rank][dz]); gate/up/h are per task.
        // One buffer kept by the executor across layers and calls (a chunk of 256 tokens of
        // real K3 needs 59 MB: allocated per layer it would be faulted in and zeroed each time).
        let mut outs = std::mem::take(&mut self.many_outs);
        outs.clear();
        outs.resize(n * k * dz, 0.0);
        for group in union.chunks(k.max(1)) {
            let ews = experts.experts(l, group)?;
            // per expert of the group: the inputs of the tokens that chose it, their slots
            type Task<'a, 'w> = (&'a ExpertWeights<'w>, Vec<&'a [f32]>, Vec<&'a mut [f32]>);
            let mut chose: Vec<Task<'_, '_>> = ews.iter().map(|ew| (ew, vec![], vec![])).collect();
            for (i, out) in outs.chunks_mut(k * dz).enumerate() {
                for (&id, slot) in ids[i * k..(i + 1) * k].iter().zip(out.chunks_mut(dz)) {
                    if let Ok(g) = group.binary_search(&id) {
                        chose[g].1.push(&xin[i * dz..(i + 1) * dz]);
                        chose[g].2.push(slot);
                    }
                }
            }
            let mut tasks: Vec<Task<'_, '_>> = Vec::new();
            for (ew, xs, os) in chose {
                let mut os = os.into_iter();
                for x in xs.chunks(EXPERT_TOKENS_PER_TASK) {
                    tasks.push((ew, x.to_vec(), os.by_ref().take(x.len()).collect()));
                }
            }
            pool.for_each_chunk(&mut tasks, 1, |_, t| {
                let (ew, xs, os) = &mut t[0];
                let mut tmp = vec![0.0; 3 * ff * xs.len()];
                expert_ffn_many(act, ff, xs, ew, &mut tmp, os);
            });
        }
        if sw > 0 {
            lin_many(
                pool,
                n,
                vec![
                    (need(lw, l, TensorRole::SharedGate)?, xn, &mut *gate),
                    (need(lw, l, TensorRole::SharedUp)?, xn, &mut *up),
                ],
            );
            for i in 0..n {
                let r = i * sw..(i + 1) * sw;
                glu(act, &gate[r.clone()], &up[r.clone()], &mut h[r]);
            }
            let w = need(lw, l, TensorRole::SharedDown)?;
            lin_many(pool, n, vec![(w, &*h, &mut *tmp_d)]);
        }
        for i in 0..n {
            Self::routed_sum(
                spec,
                (lw, l),
                &mut s.w_a,
                &weights[i * k..(i + 1) * k],
                outs[i * k * dz..(i + 1) * k * dz].chunks(dz),
                &mut acc[i * dz..(i + 1) * dz],
                &mut s.accn[..dz],
            )?;
        }
        self.many_outs = outs;
        if latent {
            lin_many(
                pool,
                n,
                vec![(need(lw, l, TensorRole::LatentUp)?, &*acc, &mut *mlp_out)],
            );
        } else {
            mlp_out.copy_from_slice(acc);
        }
        if sw > 0 {
            ops::add_inplace(mlp_out, tmp_d);
        }
        Ok(())
    }

    /// Guess the top-(k + margin) experts of the layer `tw` belongs to, from the estimate of
    /// its MoE input ([`Self::estimate_next_moe_input`]; `fallback` without AttnRes), into
    /// `g.ids`; returns how many (see [`Self::guess_experts`]).
    pub(super) fn guess_layer(
        spec: &ModelSpec,
        pool: &Pool,
        s: &Scratch,
        g: &mut GuessScratch,
        tw: &LayerWeights<'_>,
        margin: usize,
        fallback: &[f32],
    ) -> Option<usize> {
        let mut src = std::mem::take(&mut g.mix);
        if !Self::estimate_next_moe_input(spec, s, g, tw, &mut src) {
            src.copy_from_slice(fallback);
        }
        let n = Self::guess_experts(spec, pool, &src, g, tw, margin);
        g.mix = src;
        n
    }

    /// `out` = AttnRes(blocks ∪ {partial}) with the pseudo-query (MLP res proj ⊙ norm) of the
    /// layer `nlw` belongs to: the input its MoE would see if its attention added nothing.
    /// `false` (and `out` untouched) without AttnRes or when a tensor is missing.
    pub(super) fn estimate_next_moe_input(
        spec: &ModelSpec,
        s: &Scratch,
        g: &mut GuessScratch,
        nlw: &LayerWeights<'_>,
        out: &mut [f32],
    ) -> bool {
        let (Some(ar), Some(proj), Some(norm)) = (
            spec.attn_res.as_ref(),
            nlw.get(TensorRole::MlpResProj),
            nlw.get(TensorRole::MlpResNorm),
        ) else {
            return false;
        };
        let d = out.len();
        if [proj, norm].iter().any(|t| t.decl.n_elements() != d)
            || g.norm.len() < d
            || g.bias.len() < d
        {
            return false;
        }
        widen(proj, &mut g.norm);
        widen(norm, &mut g.bias);
        for i in 0..d {
            g.q[i] = g.norm[i] * g.bias[i];
        }
        let mut sources: Vec<&[f32]> = s.blocks.iter().map(|b| b.as_slice()).collect();
        if s.has_partial {
            sources.push(&s.partial);
        }
        let n = sources.len();
        if n == 0 || n > g.rl.len() {
            return false;
        }
        attnres::attnres_mix(&sources, &g.q[..d], ar.eps, &mut g.rl[..n], out);
        true
    }

    /// The expert-prefetch guess of layer `l`: top-(k + margin) ids (ascending) of the layer's
    /// router on rmsnorm(`resid`, post-attention norm) into `g.ids`; returns how many, or
    /// `None` when a tensor it needs is missing (then no guess is made).
    pub(super) fn guess_experts(
        spec: &ModelSpec,
        pool: &Pool,
        resid: &[f32],
        g: &mut GuessScratch,
        lw: &LayerWeights<'_>,
        margin: usize,
    ) -> Option<usize> {
        let p = spec.moe.as_ref()?;
        let ne = p.n_experts;
        let n = (p.n_experts_active + margin).min(ne);
        let nw = widen(lw.get(TensorRole::PostAttnNorm)?, &mut g.norm);
        ops::rmsnorm(resid, Some(&g.norm[..nw]), spec.rms_norm_eps, &mut g.xn);
        lin(
            pool,
            lw.get(TensorRole::Router)?,
            &g.xn,
            &mut g.logits[..ne],
        );
        let bias = if p.has_score_bias {
            let nb = widen(lw.get(TensorRole::RouterBias)?, &mut g.bias);
            Some(&g.bias[..nb])
        } else {
            None
        };
        let cfg = router_cfg(p, n);
        router::route(
            &g.logits[..ne],
            bias,
            &cfg,
            &mut g.ids[..n],
            &mut g.weights[..n],
        );
        Some(n)
    }

    /// Latent MoE with shared experts: `s.xn` in, `s.mlp_out` out.
    pub(super) fn moe(
        spec: &ModelSpec,
        (pool, serial, fetch): (&Pool, &Pool, &std::io::Result<IoThreads>),
        s: &mut Scratch,
        lw: &LayerWeights<'_>,
        l: usize,
        experts: &mut dyn ExpertSource,
    ) -> Result<(), ExecError> {
        let MoeDims {
            p,
            ne,
            k,
            ff,
            dz,
            sw,
            ..
        } = MoeDims::of(spec);
        // With a provider that reads from disk, the routed experts' reads overlap the work
        // that does not need them (latent down-projection, shared experts): the router runs
        // alone, `experts()` runs on a scoped helper thread while the pool computes the rest.
        // Each output is computed by the same kernels on the same inputs either way, so the
        // bits do not depend on the overlap.
        let may_block = experts.reads_block();
        // projections from xn: router logits [E] (f32), latent down z [latent], shared-expert
        // gate and up [ff * n_shared] -- in one dispatch when nothing overlaps
        let w_router = need(lw, l, TensorRole::Router)?;
        let w_latent = match p.d_latent {
            Some(_) => Some(need(lw, l, TensorRole::LatentDown)?),
            None => None,
        };
        let w_shared = if sw > 0 {
            Some((
                need(lw, l, TensorRole::SharedGate)?,
                need(lw, l, TensorRole::SharedUp)?,
            ))
        } else {
            None
        };
        // The projections of xn that do not need the routing, as lin_batch jobs.
        fn rest_jobs<'w, 'o>(
            w_latent: Option<TensorBytes<'w>>,
            w_shared: Option<(TensorBytes<'w>, TensorBytes<'w>)>,
            z: &'o mut [f32],
            ff_gate: &'o mut [f32],
            ff_up: &'o mut [f32],
        ) -> Vec<(TensorBytes<'w>, &'o mut [f32])> {
            let mut jobs = Vec::new();
            if let Some(w) = w_latent {
                jobs.push((w, z));
            }
            if let Some((g, u)) = w_shared {
                jobs.push((g, ff_gate));
                jobs.push((u, ff_up));
            }
            jobs
        }
        if may_block {
            lin(pool, w_router, &s.xn, &mut s.router_logits[..ne]);
        } else {
            // router + latent down now; the shared experts' gate/up run later, mixed with the
            // routed experts (memory-bound rows beside compute-bound experts)
            let mut jobs = vec![(w_router, &mut s.router_logits[..ne])];
            jobs.extend(rest_jobs(
                w_latent,
                None,
                &mut s.z[..dz],
                &mut s.ff_gate[..0],
                &mut s.ff_up[..0],
            ));
            lin_batch(pool, &s.xn, jobs);
        }
        Self::route_token(
            p,
            &mut s.w_a,
            (lw, l),
            &s.router_logits[..ne],
            &mut s.ids[..k],
            &mut s.weights[..k],
        )?;
        let shared_down = if sw > 0 {
            Some(need(lw, l, TensorRole::SharedDown)?)
        } else {
            None
        };
        // Shared experts into tmp_d: glu(gate, up) then the down-projection.
        let shared = |ff_gate: &[f32], ff_up: &[f32], ff_h: &mut [f32], tmp_d: &mut [f32]| {
            if let Some(w) = shared_down {
                glu(
                    spec.activation,
                    &ff_gate[..sw],
                    &ff_up[..sw],
                    &mut ff_h[..sw],
                );
                lin(pool, w, &ff_h[..sw], tmp_d);
            }
        };
        // Overlap only when the routed experts are not all in RAM already.
        let overlap = may_block && !experts.ready(l, &s.ids[..k]);
        let split = overlap && experts.reads_ahead();
        if may_block && (split || !overlap) {
            // Only the latent down-projection now (the routed experts need it): with `split`
            // the shared experts run once the next layer's guess has been issued, and with
            // every expert in RAM they run mixed with the routed experts (below).
            if let Some(w) = w_latent {
                lin(pool, w, &s.xn, &mut s.z[..dz]);
            }
        }
        // Routed experts run in parallel, one task per expert (each task's matvecs on one
        // thread, so a task's bits are those of the canonical row order); outputs land in
        // per-expert slots [gate ff | up ff | h ff | out dz] and are combined afterwards in
        // ascending id (route() returns ids ascending), however they were split in time.
        let stride = 3 * ff + dz;
        let act = spec.activation;
        // The routed experts at positions `at` (views `ws`) into their scratch slots, mixed with
        // the shared experts' gate/up rows when `with_shared`.
        let run = |(xin, xn): (&[f32], &[f32]),
                   scratch: &mut [f32],
                   (at, ws): (&[usize], &[ExpertWeights<'_>]),
                   shared_rows: Option<(&mut [f32], &mut [f32])>| {
            let rows = match (w_shared, shared_rows) {
                (Some((g, u)), Some((gate, up))) => vec![(g, &mut gate[..sw]), (u, &mut up[..sw])],
                _ => Vec::new(),
            };
            experts_with_rows(
                (pool, serial),
                (act, ff, k),
                (xin, &mut scratch[..k * stride], at, ws),
                (xn, rows),
            );
        };
        let all: Vec<usize> = (0..k).collect();
        // latent down-projection z = W_down x  [latent] (computed above or alongside below)
        let xin: &[f32] = if p.d_latent.is_some() {
            &s.z[..dz]
        } else {
            &s.xn
        };
        let (xn, scratch) = (&s.xn, &mut s.experts_scratch);
        let (ff_gate, ff_up, ff_h, tmp_d) =
            (&mut s.ff_gate, &mut s.ff_up, &mut s.ff_h, &mut s.tmp_d);
        if split {
            // Guessed experts are landing one by one. `experts_split` first issues the next
            // layer's guess when nothing is read on demand, then hands out the experts already
            // in RAM: those and the shared experts run while the others finish their reads.
            let mut shared_done = false;
            let (at, ews) = experts.experts_split(l, &s.ids[..k], &mut |at, ws| {
                run(
                    (xin, xn),
                    scratch,
                    (at, ws),
                    Some((&mut *ff_gate, &mut *ff_up)),
                );
                shared(ff_gate, ff_up, ff_h, tmp_d);
                shared_done = true;
            })?;
            let rows = (!shared_done).then_some((&mut ff_gate[..], &mut ff_up[..]));
            run((xin, xn), scratch, (&at, &ews), rows);
            if !shared_done {
                shared(ff_gate, ff_up, ff_h, tmp_d);
            }
        } else if overlap {
            // Prefetch off: wait for the experts on the fetch thread while the pool computes
            // the latent down-projection and the shared experts.
            let ids = &s.ids[..k];
            let z = &mut s.z;
            let fetcher = fetch.as_ref().map_err(|e| WeightError::Invalid {
                name: format!("routed experts of layer {l}"),
                msg: format!("cannot start the expert fetch thread: {e}"),
            })?;
            let mut got = None;
            fetcher.run_alongside(Box::new(|| got = Some(experts.experts(l, ids))), || {
                let jobs = rest_jobs(
                    w_latent,
                    w_shared,
                    &mut z[..dz],
                    &mut ff_gate[..sw],
                    &mut ff_up[..sw],
                );
                if !jobs.is_empty() {
                    lin_batch(pool, xn, jobs);
                }
                shared(ff_gate, ff_up, ff_h, tmp_d);
            });
            let ews = got.unwrap_or_else(|| {
                Err(WeightError::Invalid {
                    name: format!("routed experts of layer {l}"),
                    msg: "the expert fetch panicked (internal error)".to_string(),
                })
            })?;
            let xin: &[f32] = if p.d_latent.is_some() { &z[..dz] } else { xn };
            run((xin, xn), scratch, (&all, &ews), None);
        } else {
            // Every routed expert in RAM (resident, or already in the cache): the routed
            // experts (compute-bound) and the shared experts' gate/up rows (memory-bound) in
            // ONE dispatch, interleaved, so one thread streams weights while the other decodes
            // MXFP4 (k3-mini resident: 0.1250 vs 0.1259 s/token, medians of 6 alternating
            // runs; 9 of 11 pairs faster).
            let ews = experts.experts(l, &s.ids[..k])?;
            run(
                (xin, xn),
                scratch,
                (&all, &ews),
                Some((&mut *ff_gate, &mut *ff_up)),
            );
            drop(ews);
            shared(ff_gate, ff_up, ff_h, tmp_d);
        }
        Self::moe_combine(spec, pool, s, lw, l)
    }

    /// The routing of one token: selection with the score bias, weights from the unbiased
    /// scores, from its router `logits` into `ids` / `weights` (top-k, ids ascending); `w_a`
    /// holds the widened bias.
    pub(super) fn route_token(
        p: &k3_models::spec::MoeSpec,
        w_a: &mut [f32],
        (lw, l): (&LayerWeights<'_>, usize),
        logits: &[f32],
        ids: &mut [u32],
        weights: &mut [f32],
    ) -> Result<(), ExecError> {
        let cfg = router_cfg(p, p.n_experts_active);
        let bias = if p.has_score_bias {
            let n = widen(need(lw, l, TensorRole::RouterBias)?, w_a);
            Some(&w_a[..n])
        } else {
            None
        };
        router::route(logits, bias, &cfg, ids, weights);
        Ok(())
    }

    /// One token's routed experts' outputs `outs` (routed order) weighted by `weights` and
    /// summed in that order into `acc`, then the routed-expert norm (through `tmp`) when the
    /// model has one: the input of the latent up-projection.
    pub(super) fn routed_sum<'o>(
        spec: &ModelSpec,
        (lw, l): (&LayerWeights<'_>, usize),
        w_a: &mut [f32],
        weights: &[f32],
        outs: impl Iterator<Item = &'o [f32]>,
        acc: &mut [f32],
        tmp: &mut [f32],
    ) -> Result<(), ExecError> {
        acc.fill(0.0);
        for (&w, out) in weights.iter().zip(outs) {
            ops::axpy(acc, w, out);
        }
        if MoeDims::of(spec).p.latent_norm {
            let n = widen(need(lw, l, TensorRole::LatentNorm)?, w_a);
            ops::rmsnorm(acc, Some(&w_a[..n]), spec.rms_norm_eps, tmp);
            acc.copy_from_slice(tmp);
        }
        Ok(())
    }

    /// The end of a MoE layer's decode step: the routed experts' outputs (slots `[gate ff |
    /// up ff | h ff | out]` in `s.experts_scratch`, routed order) combined
    /// ([`Self::routed_sum`]), the latent up-projection, plus the shared experts (`s.tmp_d`),
    /// into `s.mlp_out`.
    pub(super) fn moe_combine(
        spec: &ModelSpec,
        pool: &Pool,
        s: &mut Scratch,
        lw: &LayerWeights<'_>,
        l: usize,
    ) -> Result<(), ExecError> {
        let MoeDims {
            p,
            k,
            ff,
            dz,
            sw,
            stride,
            ..
        } = MoeDims::of(spec);
        let outs = s.experts_scratch[..k * stride]
            .chunks(stride)
            .map(|slot| &slot[3 * ff..]);
        Self::routed_sum(
            spec,
            (lw, l),
            &mut s.w_a,
            &s.weights[..k],
            outs,
            &mut s.acc[..dz],
            &mut s.accn[..dz],
        )?;
        if p.d_latent.is_some() {
            lin(
                pool,
                need(lw, l, TensorRole::LatentUp)?,
                &s.acc[..dz],
                &mut s.mlp_out,
            );
        } else {
            s.mlp_out.copy_from_slice(&s.acc[..dz]);
        }
        // fused shared experts (width d_expert_ff * n_shared) on the same input (computed above)
        if sw > 0 {
            ops::add_inplace(&mut s.mlp_out, &s.tmp_d);
        }
        Ok(())
    }
}
