//! The executor: one token through the whole Kimi-family stack, as a flat list of kernel calls.
//!
//! Owns: the forward pass (embedding, Block AttnRes, KDA, MLA, dense SiTU-GLU, latent MoE,
//! output AttnRes, final norm, lm_head), the per-sequence decode state (KDA conv windows and
//! recurrent state, MLA KV cache) and the scratch buffers, all sized from the [`Plan`].
//! Must not: know where weight bytes come from (see [`crate::weights`]) or do I/O itself.
//!
//! Follows upstream: `docs/MODEL.md` §4 (HF `modeling_kimi_linear.py`
//! semantics) with the seed engine's precision model (docs/NUMERICS.md §2): every activation stays
//! f32, weights are widened exactly from bf16 / MXFP4. Every position goes through the same
//! kernel calls on the same inputs whether fed token by token ([`Executor::step`]) or
//! layer-major in a chunk ([`Executor::prefill`]: each layer applied to every token of the
//! chunk before the next layer, each projection one token-major matvec for all of them whose
//! rows have the one-token bits, see `exec/rows.rs`), so prefill, full recompute and
//! incremental decode give the same bits (docs/NUMERICS.md §1).
//!
//! Tap names (rule of thumb 3) used in comments and dumps: `blk.{l}.attn_in`, `blk.{l}.attn_out`,
//! `blk.{l}.mlp_in`, `blk.{l}.mlp_out`, `out.hidden`, `out.logits`.

use std::borrow::Cow;

use k3_kernels::par::{Pool, stream_row_chunk};

mod attnres_block;
mod kda_block;
mod mla_block;
mod mlp_block;
mod moe_block;
mod rows;
mod stage;
mod state;
mod tensors;

use k3_kernels::{attn, attnres, kda, matvec, ops, router};
use k3_models::spec::{
    Activation, AttnKind, DType, ExpertFormat, FfnKind, KdaGateSpec, ModelSpec, RouterScoring,
    TensorRole,
};
pub use kda_block::KdaState;
pub use mla_block::MlaState;
use mlp_block::*;
use moe_block::*;
pub use moe_block::{DEFAULT_LOOKAHEAD_DEPTH, LOOKAHEAD_DEPTH_ENV};
use rows::{Rows, carve, lin_many};
pub use stage::TokenCarry;
pub use state::{LayerState, SeqState, StateMark};
use tensors::*;

use crate::plan::Plan;
use crate::stream::blocking::IoThreads;
use crate::weights::{
    ExpertSource, ExpertWeights, GlobalSource, LayerWeights, TensorBytes, TrunkSource, WeightError,
};

/// Errors of one forward step.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error(transparent)]
    Weight(#[from] WeightError),
    #[error("layer {layer}: tensor {role:?} is missing from the layer's weights")]
    MissingTensor { layer: usize, role: TensorRole },
    #[error("token id {token} is outside the vocabulary (size {vocab})")]
    BadToken { token: u32, vocab: usize },
    #[error("context full: position {pos} exceeds the planned maximum of {max} positions")]
    ContextFull { pos: usize, max: usize },
    #[error(
        "the logits after position {pos} are not finite (logit {index} is {value}): the \
         weights or the loaded state hold NaN or infinite values, so no id can be chosen"
    )]
    NonFinite {
        pos: usize,
        index: usize,
        value: f32,
    },
}

/// [`ExecError::NonFinite`] for the first NaN or infinite logit, if any.
pub fn check_finite(logits: &[f32], pos: usize) -> Result<(), ExecError> {
    match logits.iter().position(|x| !x.is_finite()) {
        None => Ok(()),
        Some(index) => Err(ExecError::NonFinite {
            pos,
            index,
            value: logits[index],
        }),
    }
}

/// Where the weights come from: the three providers the executor talks to.
pub struct Providers<'a> {
    pub trunk: Box<dyn TrunkSource + 'a>,
    pub experts: Box<dyn ExpertSource + 'a>,
    pub global: Box<dyn GlobalSource + 'a>,
}

/// Scratch buffers, sized once from the plan. Shape comments give the dimension names.
struct Scratch {
    /// [d_model] each
    x: Vec<f32>,
    xn: Vec<f32>,
    mlp_out: Vec<f32>,
    tmp_d: Vec<f32>,
    /// AttnRes: completed block sums (+ embedding), each [d_model]; partial sum [d_model].
    blocks: Vec<Vec<f32>>,
    partial: Vec<f32>,
    has_partial: bool,
    res_query: Vec<f32>,
    res_logits: Vec<f32>,
    /// small widened weights [max small tensor]
    w_a: Vec<f32>,
    w_b: Vec<f32>,
    w_c: Vec<f32>,
    scores: Vec<f32>, // MLA attention work [H * (2 * kv_lora + max_pos)]
    /// KDA: each head's conv outputs q, k, v [H * 3 * D] (one token at a time)
    kda_qkv: Vec<f32>,
    // FFN
    ff_gate: Vec<f32>, // [max ff width]
    ff_up: Vec<f32>,
    ff_h: Vec<f32>,
    router_logits: Vec<f32>, // [E]
    ids: Vec<u32>,           // [top_k]
    weights: Vec<f32>,       // [top_k]
    z: Vec<f32>,             // [latent]
    acc: Vec<f32>,           // [latent]
    accn: Vec<f32>,          // [latent]
    /// per routed expert: [gate ff | up ff | h ff | out latent] x top_k
    experts_scratch: Vec<f32>,
}

impl Scratch {
    fn new(plan: &Plan) -> Scratch {
        let b = &plan.buffers;
        let z = |n: usize| vec![0.0f32; n];
        Scratch {
            x: z(b.d_model),
            xn: z(b.d_model),
            mlp_out: z(b.d_model),
            tmp_d: z(b.d_model),
            blocks: Vec::with_capacity(b.max_attn_res_sources),
            partial: z(b.d_model),
            has_partial: false,
            res_query: z(b.d_model),
            res_logits: z(b.max_attn_res_sources + 1),
            w_a: z(b.max_small_tensor),
            w_b: z(b.max_small_tensor),
            w_c: z(b.max_small_tensor),
            scores: z(b.mla_heads * (2 * b.mla_kv_lora + plan.max_positions)),
            kda_qkv: z(3 * b.kda_channels),
            ff_gate: z(b.max_ff),
            ff_up: z(b.max_ff),
            ff_h: z(b.max_ff),
            router_logits: z(b.n_experts),
            ids: vec![0; b.n_experts_active],
            weights: z(b.n_experts_active),
            z: z(b.moe_latent),
            acc: z(b.moe_latent),
            accn: z(b.moe_latent),
            experts_scratch: z(b.n_experts_active * (3 * b.expert_ff + b.moe_latent)),
        }
    }
}

/// Default tokens per layer-major prefill call ([`Executor::prefill`]) when a prompt is fed
/// (`Plan::prefill_chunk`, `--prefill-chunk`): the trunk is streamed once per chunk; each
/// token in flight holds its residual carry and expert outputs (`Plan::prefill_bytes`).
pub const PREFILL_CHUNK: usize = 64;

/// The per-token part of the residual stream between layers (AttnRes partial sum and
/// completed block sums), swapped in and out of the scratch by layer-major prefill.
struct Carry {
    partial: Vec<f32>,
    has_partial: bool,
    blocks: Vec<Vec<f32>>,
}

impl Carry {
    fn swap_with(&mut self, s: &mut Scratch) {
        std::mem::swap(&mut self.partial, &mut s.partial);
        std::mem::swap(&mut self.has_partial, &mut s.has_partial);
        std::mem::swap(&mut self.blocks, &mut s.blocks);
    }
}

/// Runs the forward pass. One executor per model; sequences are [`SeqState`]s.
pub struct Executor<'s> {
    spec: &'s ModelSpec,
    plan: Plan,
    pool: Pool,
    /// A one-thread pool for work already inside a parallel task (per-expert matvecs).
    serial: Pool,
    /// The thread that fetches a layer's routed experts from a provider whose reads block,
    /// while the pool computes the work that does not need them (one thread for the
    /// executor's life instead of one per MoE layer: a spawn + join costs ~60 us).
    fetch: std::io::Result<IoThreads>,
    s: Scratch,
    /// Expert-prefetch guess buffers (allocated on first use; never read by the real path).
    guess: Option<GuessScratch>,
    /// Called after each layer of a multi-token call with the tokens it fed (progress of a
    /// long prompt: one pass over a streamed trunk can take minutes).
    layer_hook: Option<LayerHook<'s>>,
    /// The routed experts' outputs of an expert-major layer ([`Self::moe_many`]).
    many_outs: Vec<f32>,
    /// Token-major buffers of the attention and of multi-token passes.
    rows: Rows,
}

/// See [`Executor::set_layer_hook`].
pub type LayerHook<'h> = Box<dyn FnMut(usize) + 'h>;

impl<'s> Executor<'s> {
    pub fn new(spec: &'s ModelSpec, plan: Plan, n_threads: usize) -> Executor<'s> {
        let s = Scratch::new(&plan);
        let mut rows = Rows::new(&plan.buffers);
        rows.fit(1);
        Executor {
            spec,
            plan,
            pool: Pool::new(n_threads),
            serial: Pool::new(1),
            fetch: IoThreads::new(1, "k3-expert-fetch"),
            s,
            guess: None,
            layer_hook: None,
            many_outs: Vec::new(),
            rows,
        }
    }

    /// A function called after each layer of every multi-token call (prompt chunks, batch
    /// steps, verify passes) with the number of tokens the call feeds; `None` removes it.
    /// For progress display only: it cannot change any bit.
    pub fn set_layer_hook(&mut self, hook: Option<LayerHook<'s>>) {
        self.layer_hook = hook;
    }

    fn layer_done(&mut self, tokens: usize) {
        if tokens > 1
            && let Some(h) = self.layer_hook.as_mut()
        {
            h(tokens);
        }
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// The model this executor runs.
    pub fn spec(&self) -> &'s ModelSpec {
        self.spec
    }

    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// Most tokens per layer-major call ([`Plan::prefill_chunk`]): callers split longer prompts.
    pub fn prefill_chunk(&self) -> usize {
        self.plan.prefill_chunk.max(1)
    }

    /// Feed one token at position `state.n_pos`; write the f32 logits of the next token.
    pub fn step(
        &mut self,
        token: u32,
        state: &mut SeqState,
        w: &mut Providers<'_>,
        logits: &mut [f32],
    ) -> Result<(), ExecError> {
        self.prefill(&[token], state, w, logits)
    }

    /// Feed `tokens` at positions `state.n_pos..`, LAYER-MAJOR: each layer's weights are
    /// fetched once and applied to all the tokens ([`Self::layer_many`]: each projection one
    /// matvec for all of them, the recurrence in token order), so a streamed trunk is read once
    /// per call instead of once per token and every weight streams from memory once. Writes
    /// the logits after the LAST token only. Every token goes through the operations of
    /// [`Self::step`] on the same inputs with the same per-layer state, so the bits equal
    /// feeding the tokens one by one. The expert source sees one `begin_token` per call. Holds one residual
    /// carry (d_model floats per AttnRes block) per token: callers chunk long prompts
    /// ([`Self::prefill_chunk`]).
    pub fn prefill(
        &mut self,
        tokens: &[u32],
        state: &mut SeqState,
        w: &mut Providers<'_>,
        logits: &mut [f32],
    ) -> Result<(), ExecError> {
        let Some(mut carries) = self.feed(tokens, state, w, None)? else {
            return Ok(());
        };
        self.outputs_of(&mut carries, &[tokens.len() - 1], w, &mut [logits])
    }

    /// [`Self::prefill`] that also writes the EARLY-EXIT logits of the last token
    /// (`--dump-layer-logits`): `layers[l * vocab..(l + 1) * vocab]` = the logits the model
    /// would give if it stopped after layer `l` (the output AttnRes over the block state after
    /// that layer, the final norm, the lm_head: what a `--layers l+1` run computes). One
    /// extra lm_head pass per layer; the state, `logits` and every other bit are those of
    /// [`Self::prefill`], and the last row equals `logits`.
    pub fn prefill_layer_logits(
        &mut self,
        tokens: &[u32],
        state: &mut SeqState,
        w: &mut Providers<'_>,
        logits: &mut [f32],
        layers: &mut [f32],
    ) -> Result<(), ExecError> {
        assert_eq!(
            layers.len(),
            self.spec.n_layers * self.spec.vocab_size,
            "prefill_layer_logits: one vocab row per layer"
        );
        let Some(mut carries) = self.feed(tokens, state, w, Some(layers))? else {
            return Ok(());
        };
        self.outputs_of(&mut carries, &[tokens.len() - 1], w, &mut [logits])
    }

    /// [`Self::prefill`] with the logits after each of the LAST `logits.len()` tokens:
    /// `logits[i]` after `tokens[tokens.len() - logits.len() + i]`, each bit-identical to the
    /// logits [`Self::step`] gives when the tokens are fed one by one. One trunk pass for all
    /// of them: the verify pass of speculative decoding (`run::generate_with`,
    /// `speculate::Speculator`), which needs the logits from its pending token on only (the
    /// lm_head is not run for the others: with `--ultra-low-memory` it is read from disk).
    pub fn prefill_each(
        &mut self,
        tokens: &[u32],
        state: &mut SeqState,
        w: &mut Providers<'_>,
        logits: &mut [Vec<f32>],
    ) -> Result<(), ExecError> {
        assert!(
            logits.len() <= tokens.len(),
            "prefill_each: at most one logits buffer per token"
        );
        let Some(mut carries) = self.feed(tokens, state, w, None)? else {
            return Ok(());
        };
        let first = tokens.len() - logits.len();
        let which: Vec<usize> = (first..tokens.len()).collect();
        let mut outs: Vec<&mut [f32]> = logits.iter_mut().map(|l| l.as_mut_slice()).collect();
        self.outputs_of(&mut carries, &which, w, &mut outs)
    }

    /// Run `f` on token `k` of a layer-major call: its residual carry (token 0's is the
    /// scratch itself, token k's `carries[k - 1]`) swapped into the scratch and back, whatever
    /// `f` returns.
    fn with_carry<T>(
        &mut self,
        carries: &mut [Carry],
        k: usize,
        f: impl FnOnce(&mut Self) -> Result<T, ExecError>,
    ) -> Result<T, ExecError> {
        if k > 0 {
            carries[k - 1].swap_with(&mut self.s);
        }
        let r = f(self);
        if k > 0 {
            carries[k - 1].swap_with(&mut self.s);
        }
        r
    }

    /// The logits after tokens `which` of a layer-major call (indices as in
    /// [`Self::with_carry`]) into `logits[j]` for `which[j]`: each token's final hidden state
    /// ([`Self::out_hidden`]), then ONE lm_head pass for all of them (the matrix read once;
    /// each row's bits those of a one-token pass).
    fn outputs_of(
        &mut self,
        carries: &mut [Carry],
        which: &[usize],
        w: &mut Providers<'_>,
        logits: &mut [&mut [f32]],
    ) -> Result<(), ExecError> {
        let d = self.spec.d_model;
        self.rows.fit(which.len());
        for (j, &k) in which.iter().enumerate() {
            self.with_carry(carries, k, |ex| {
                ex.out_hidden(w)?;
                ex.rows.attn_out[j * d..(j + 1) * d].copy_from_slice(&ex.s.xn);
                Ok(())
            })?;
        }
        let hs: Vec<&[f32]> = self.rows.attn_out[..which.len() * d].chunks(d).collect();
        w.global.lm_head_many(&self.pool, &hs, logits)?;
        Ok(())
    }

    /// The layers of [`Self::prefill`]: `tokens` through every layer (layer-major), the state
    /// advanced past them. Returns the residual carries (token 0's in the scratch, token k's
    /// in `carries[k - 1]`), or `None` for no tokens. With `layer_logits`, the last token's
    /// early-exit logits after each layer (see [`Self::prefill_layer_logits`]).
    fn feed(
        &mut self,
        tokens: &[u32],
        state: &mut SeqState,
        w: &mut Providers<'_>,
        mut layer_logits: Option<&mut [f32]>,
    ) -> Result<Option<Vec<Carry>>, ExecError> {
        let spec = self.spec;
        if let Some(&token) = tokens.iter().find(|&&t| t as usize >= spec.vocab_size) {
            return Err(ExecError::BadToken {
                token,
                vocab: spec.vocab_size,
            });
        }
        if state.n_pos + tokens.len() > self.plan.max_positions {
            return Err(ExecError::ContextFull {
                pos: state.n_pos.max(self.plan.max_positions),
                max: self.plan.max_positions,
            });
        }
        if tokens.is_empty() {
            return Ok(None);
        }
        w.experts.begin_token();
        let mut carries = self.embed_carries(tokens, w)?;
        // Look-ahead expert guesses (decode only: in a prompt chunk the next layer's input is
        // known only after every token of the chunk went through this one).
        let look_ahead = tokens.len() == 1 && w.experts.prefetch_margin().is_some();
        let depth = lookahead_depth();
        if let Some(g) = self.guess.as_mut() {
            g.ahead_for.clear();
        }
        for l in 0..spec.n_layers {
            let next_moe = (l + 1..spec.n_layers)
                .filter(|&n| spec.layers[n].ffn == FfnKind::Moe)
                .nth(depth - 1);
            let (lw, next_lw) = match next_moe {
                Some(n) if look_ahead => w.trunk.layer_and_peek(l, n)?,
                _ => (w.trunk.layer(l)?, None),
            };
            let ahead = next_moe.zip(next_lw.as_ref());
            let experts = w.experts.as_mut();
            if tokens.len() > 1 {
                let at: Vec<(usize, usize)> =
                    (0..tokens.len()).map(|t| (0, state.n_pos + t)).collect();
                let states = std::slice::from_mut(state);
                self.layer_many(l, &lw, &mut carries, &at, states, experts)?;
            } else {
                self.layer(l, &lw, ahead, &mut state.layers[l], state.n_pos, experts)?;
            }
            self.layer_done(tokens.len());
            if let Some(rows) = layer_logits.as_deref_mut() {
                // the output head on the last token's carry as it stands after layer l: reads
                // the carry, writes only scratch that the next layer overwrites before use
                let v = spec.vocab_size;
                let row = &mut rows[l * v..(l + 1) * v];
                self.outputs_of(&mut carries, &[tokens.len() - 1], w, &mut [row])?;
            }
        }
        state.n_pos += tokens.len();
        Ok(Some(carries))
    }

    /// One decode step of SEVERAL sequences that share each layer's weights: token
    /// `tokens[b]` of sequence `states[b]` at its position `states[b].n_pos`, logits into
    /// `logits[b]`. Layer-major like [`Self::prefill`]: each layer is fetched once (a streamed
    /// trunk is read once per step for the whole batch) and applied to the sequences in turn,
    /// each through exactly the operations of [`Self::step`] on its own state, so every
    /// sequence's bits equal stepping it alone. The expert source sees one `begin_token`.
    pub fn step_batch(
        &mut self,
        tokens: &[u32],
        states: &mut [SeqState],
        w: &mut Providers<'_>,
        logits: &mut [Vec<f32>],
    ) -> Result<(), ExecError> {
        let parts: Vec<&[u32]> = tokens.chunks(1).collect();
        self.prefill_batch(&parts, states, w, logits)
    }

    /// [`Self::prefill`] for SEVERAL sequences at once: `parts[b]` (at least one token) fed to
    /// `states[b]` from its position on, layer-major over all of them (each layer fetched once
    /// for the whole call), tokens of one sequence in order, the sequences in turn; the logits
    /// after each sequence's last token into `logits[b]`. Every token goes through exactly the
    /// operations of [`Self::step`] on its own sequence's state, so each sequence's bits equal
    /// feeding it alone. Holds one residual carry per token: callers bound the total (the
    /// batch driver keeps it near [`Self::prefill_chunk`]).
    pub fn prefill_batch(
        &mut self,
        parts: &[&[u32]],
        states: &mut [SeqState],
        w: &mut Providers<'_>,
        logits: &mut [Vec<f32>],
    ) -> Result<(), ExecError> {
        let spec = self.spec;
        assert!(
            parts.len() == states.len() && parts.len() == logits.len(),
            "prefill_batch: one token list, state and logits buffer per sequence"
        );
        assert!(
            parts.iter().all(|p| !p.is_empty()),
            "prefill_batch: every sequence gets at least one token"
        );
        if let Some(&token) = parts
            .iter()
            .flat_map(|p| p.iter())
            .find(|&&t| t as usize >= spec.vocab_size)
        {
            return Err(ExecError::BadToken {
                token,
                vocab: spec.vocab_size,
            });
        }
        if let Some((st, p)) = states
            .iter()
            .zip(parts)
            .find(|(s, p)| s.n_pos + p.len() > self.plan.max_positions)
        {
            return Err(ExecError::ContextFull {
                pos: (st.n_pos + p.len()).max(self.plan.max_positions),
                max: self.plan.max_positions,
            });
        }
        if parts.is_empty() {
            return Ok(());
        }
        w.experts.begin_token();
        // Every token of every sequence in order; token 0's residual carry lives in the
        // scratch, token k's in `carries[k - 1]`.
        let all: Vec<u32> = parts.iter().flat_map(|p| p.iter().copied()).collect();
        let mut carries = self.embed_carries(&all, w)?;
        if let Some(g) = self.guess.as_mut() {
            g.ahead_for.clear();
        }
        // (sequence, position) of every token, in order
        let at: Vec<(usize, usize)> = states
            .iter()
            .zip(parts)
            .enumerate()
            .flat_map(|(b, (st, p))| (0..p.len()).map(move |t| (b, st.n_pos + t)))
            .collect();
        for l in 0..spec.n_layers {
            let lw = w.trunk.layer(l)?;
            let experts = w.experts.as_mut();
            if at.len() > 1 {
                self.layer_many(l, &lw, &mut carries, &at, states, experts)?;
            } else {
                let st = &mut states[0];
                self.layer(l, &lw, None, &mut st.layers[l], st.n_pos, experts)?;
            }
            self.layer_done(at.len());
        }
        // each sequence's last token
        let which: Vec<usize> = parts
            .iter()
            .scan(0, |k, p| {
                *k += p.len();
                Some(*k - 1)
            })
            .collect();
        // every state is past its tokens now (as `feed` leaves it before the output head)
        for (st, p) in states.iter_mut().zip(parts) {
            st.n_pos += p.len();
        }
        let mut outs: Vec<&mut [f32]> = logits.iter_mut().map(|l| l.as_mut_slice()).collect();
        self.outputs_of(&mut carries, &which, w, &mut outs)
    }

    /// h = E[token] for each token (the residual stream starts as the partial sum P): the
    /// first token's carry in the scratch itself, one [`Carry`] per further token.
    fn embed_carries(
        &mut self,
        tokens: &[u32],
        w: &mut Providers<'_>,
    ) -> Result<Vec<Carry>, ExecError> {
        let mut carries: Vec<Carry> = Vec::with_capacity(tokens.len().saturating_sub(1));
        for (t, &token) in tokens.iter().enumerate() {
            let (partial, blocks) = if t == 0 {
                (&mut self.s.partial, &mut self.s.blocks)
            } else {
                carries.push(Carry {
                    partial: vec![0.0; self.spec.d_model],
                    has_partial: true,
                    blocks: Vec::new(),
                });
                let c = carries.last_mut().expect("just pushed");
                (&mut c.partial, &mut c.blocks)
            };
            w.global.embed_row(token, partial)?;
            blocks.clear();
        }
        self.s.has_partial = true;
        Ok(carries)
    }

    /// out.hidden for the residual carry in the scratch: the final AttnRes mix (or the
    /// residual stream) and the final norm, into `s.xn` (the lm_head's input).
    fn out_hidden(&mut self, w: &Providers<'_>) -> Result<(), ExecError> {
        let spec = self.spec;
        let s = &mut self.s;
        // out.hidden
        match &spec.attn_res {
            Some(ar) => {
                let proj =
                    w.global
                        .small(TensorRole::OutputResProj)
                        .ok_or(ExecError::MissingTensor {
                            layer: spec.n_layers,
                            role: TensorRole::OutputResProj,
                        })?;
                let norm =
                    w.global
                        .small(TensorRole::OutputResNorm)
                        .ok_or(ExecError::MissingTensor {
                            layer: spec.n_layers,
                            role: TensorRole::OutputResNorm,
                        })?;
                Self::attn_res(s, proj, norm, ar.eps, true);
            }
            None => s.x.copy_from_slice(&s.partial),
        }
        let fnorm = w
            .global
            .small(TensorRole::FinalNorm)
            .ok_or(ExecError::MissingTensor {
                layer: spec.n_layers,
                role: TensorRole::FinalNorm,
            })?;
        let n = widen(fnorm, &mut s.w_a);
        ops::rmsnorm(&s.x, Some(&s.w_a[..n]), spec.rms_norm_eps, &mut s.xn);
        Ok(())
    }

    /// Layer `l` for the token whose residual carry is in the scratch, at position `pos`.
    fn layer(
        &mut self,
        l: usize,
        lw: &LayerWeights<'_>,
        ahead: Option<(usize, &LayerWeights<'_>)>,
        st: &mut LayerState,
        pos: usize,
        experts: &mut dyn ExpertSource,
    ) -> Result<(), ExecError> {
        let spec = self.spec;
        let layer = spec.layers[l];
        let (pool, plan, s, guess) = (&self.pool, &self.plan, &mut self.s, &mut self.guess);
        // ---- expert prefetch guess (speculative; cannot change any bit) ----
        // Route with this layer's router on an estimate of its MoE input (below) and let the
        // expert source start reading the top (k + margin) ids while the attention computes.
        // Own buffers only; the real routing after attention decides.
        // Skipped when the previous MoE layer already guessed this one (look-ahead, below).
        let margin = experts.prefetch_margin();
        if let (FfnKind::Moe, Some(margin)) = (layer.ffn, margin) {
            let g = guess.get_or_insert_with(|| GuessScratch::new(plan));
            // From this layer's MoE input as if its attention added nothing (its own AttnRes
            // mix), or the residual stream without AttnRes.
            let guessed_ahead = g.ahead_for.contains(&l);
            g.ahead_for.retain(|&a| a > l);
            if !guessed_ahead
                && let Some(n) = Self::guess_layer(spec, pool, s, g, lw, margin, &s.partial)
            {
                experts.prefetch(l, &g.ids[..n]);
            }
        }
        // ---- end expert prefetch guess ----
        self.attn_in(l, lw)?;
        let d = spec.d_model;
        self.rows.xn[..d].copy_from_slice(&self.s.xn);
        self.attention((lw, l), &mut [st], &[(0, pos)])?;
        Self::attn_merge(spec, &mut self.s, lw, l, &self.rows.attn_out[..d])?;
        let (pool, serial, fetch, plan, s, guess) = (
            &self.pool,
            &self.serial,
            &self.fetch,
            &self.plan,
            &mut self.s,
            &mut self.guess,
        );
        // blk.{l}.mlp_out
        match layer.ffn {
            FfnKind::Dense => {
                let rows = &mut self.rows;
                rows.xn[..d].copy_from_slice(&s.xn);
                Self::dense_many(spec, pool, rows, 1, lw, l)?;
                s.mlp_out.copy_from_slice(&rows.mlp_out[..d]);
            }
            FfnKind::Moe => {
                // Look-ahead guess of the next MoE layer, from this layer's MoE input with
                // the next layer's router (its weights are in RAM: pinned or resident), read
                // after this layer's own misses while this layer's experts and the next
                // layer's attention compute. Own buffers only; cannot change any bit.
                if let (Some((nl, nlw)), Some(margin)) = (ahead, margin) {
                    let g = guess.get_or_insert_with(|| GuessScratch::new(plan));
                    // The next layer's MoE input, estimated: its AttnRes mix (its own
                    // pseudo-query) of the blocks and the current partial sum (the next
                    // attention's output is not known yet); without AttnRes, this layer's
                    // MoE input. 95% of routed ids at margin 0 on k3-mini vs 89% with this
                    // layer's own mix.
                    if let Some(n) = Self::guess_layer(spec, pool, s, g, nlw, margin, &s.x) {
                        experts.prefetch_after_next(nl, &g.ids[..n]);
                        g.ahead_for.push(nl);
                    }
                }
                Self::moe(spec, (pool, serial, fetch), s, lw, l, experts)?;
            }
        }
        ops::add_inplace(&mut s.partial, &s.mlp_out);
        Ok(())
    }

    /// Layer `l` for several tokens of one layer-major call (token `i` of `at` is the carry
    /// [`Self::with_carry`] gives for `i`, on `states[seq]` at `pos`), in phases: every
    /// token's attention input; the attention of all of them ([`Self::attention`]: each
    /// projection reads its weights once for all tokens, the recurrence and the KV cache
    /// advance token by token in order); every token's FFN input; the FFN of all of them
    /// ([`Self::dense_many`], or [`Self::moe_many`]: expert-major). A token's outputs feed only
    /// its own next layer, never another token's work in this one except through the
    /// sequence's attention state, which sees the tokens in order. Every output is the same
    /// kernel on the same input as in [`Self::layer`], so the bits are those of the tokens one
    /// by one.
    fn layer_many(
        &mut self,
        l: usize,
        lw: &LayerWeights<'_>,
        carries: &mut [Carry],
        at: &[(usize, usize)],
        states: &mut [SeqState],
        experts: &mut dyn ExpertSource,
    ) -> Result<(), ExecError> {
        let spec = self.spec;
        let (d, n) = (spec.d_model, at.len());
        self.rows.fit(n);
        for i in 0..n {
            self.with_carry(carries, i, |ex| {
                ex.attn_in(l, lw)?;
                ex.rows.xn[i * d..(i + 1) * d].copy_from_slice(&ex.s.xn);
                Ok(())
            })?;
        }
        let mut sts: Vec<&mut LayerState> = states.iter_mut().map(|s| &mut s.layers[l]).collect();
        self.attention((lw, l), &mut sts, at)?;
        for i in 0..n {
            self.with_carry(carries, i, |ex| {
                let attn_out = &ex.rows.attn_out[i * d..(i + 1) * d];
                Self::attn_merge(spec, &mut ex.s, lw, l, attn_out)?;
                ex.rows.xn[i * d..(i + 1) * d].copy_from_slice(&ex.s.xn);
                Ok(())
            })?;
        }
        match spec.layers[l].ffn {
            FfnKind::Dense => Self::dense_many(spec, &self.pool, &mut self.rows, n, lw, l)?,
            FfnKind::Moe => self.moe_many(l, lw, n, experts)?,
        }
        for i in 0..n {
            self.with_carry(carries, i, |ex| {
                ops::add_inplace(&mut ex.s.partial, &ex.rows.mlp_out[i * d..(i + 1) * d]);
                Ok(())
            })?;
        }
        Ok(())
    }
}

impl<'s> Executor<'s> {
    /// The attention of layer `l` for the `n = at.len()` tokens whose inputs are in `rows.xn`
    /// (token `i` on `sts[at[i].0]` at position `at[i].1`, in order), outputs into
    /// `rows.attn_out`: KDA or MLA by the layer map.
    fn attention(
        &mut self,
        (lw, l): (&LayerWeights<'_>, usize),
        sts: &mut [&mut LayerState],
        at: &[(usize, usize)],
    ) -> Result<(), ExecError> {
        let spec = self.spec;
        let pools = (&self.pool, &self.serial);
        let (s, rows) = (&mut self.s, &mut self.rows);
        match spec.layers[l].attn {
            AttnKind::Kda => Self::kda_many(spec, pools, s, rows, (lw, l), sts, at),
            AttnKind::Mla => Self::mla_many(spec, pools.0, s, rows, (lw, l), sts, at),
        }
    }
}
