//! The executor: one token through the whole Kimi-family stack, as a flat list of kernel calls.
//!
//! Owns: the forward pass (embedding, Block AttnRes, KDA, MLA, dense SiTU-GLU, latent MoE,
//! output AttnRes, final norm, lm_head), the per-sequence decode state (KDA conv windows and
//! recurrent state, MLA KV cache) and the scratch buffers, all sized from the [`Plan`].
//! Must not: know where weight bytes come from (see [`crate::weights`]) or do I/O itself.
//!
//! Follows upstream: `../shared/research/k3-architecture.md` §4 (HF `modeling_kimi_linear.py`
//! semantics) with the seed engine's precision model (NUMERICS.md §2): every activation stays
//! f32, weights are widened exactly from bf16 / MXFP4. Every position goes through the same
//! kernel calls on the same inputs whether fed token by token ([`Executor::step`]) or
//! layer-major in a chunk ([`Executor::prefill`]: each layer applied to every token of the
//! chunk before the next layer, each projection one token-major matvec for all of them whose
//! rows have the one-token bits, see `exec/rows.rs`), so prefill, full recompute and
//! incremental decode give the same bits (NUMERICS.md §1).
//!
//! Tap names (rule of thumb 3) used in comments and dumps: `blk.{l}.attn_in`, `blk.{l}.attn_out`,
//! `blk.{l}.mlp_in`, `blk.{l}.mlp_out`, `out.hidden`, `out.logits`.

use std::borrow::Cow;

use k3_kernels::par::{Pool, stream_row_chunk};

mod rows;
use k3_kernels::{attn, attnres, kda, matvec, ops, router};
use k3_models::spec::{
    Activation, AttnKind, DType, ExpertFormat, FfnKind, KdaGateSpec, ModelSpec, RouterScoring,
    TensorRole,
};
use rows::{Rows, carve, lin_many};

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
struct KdaHead<'a> {
    /// Each sequence's conv windows (q, k, v) and state of this head.
    seqs: Vec<([&'a mut [f32]; 3], &'a mut [f32])>,
    /// This head's output of each token of the pass.
    outs: Vec<&'a mut [f32]>,
    /// The conv outputs q, k, v of the token being stepped [3 * D].
    qkv: &'a mut [f32],
}

/// `v` cut into `h` slices of `n` (empty slices when `n == 0`).
fn per_head(v: &mut [f32], n: usize, h: usize) -> Vec<&mut [f32]> {
    if n == 0 {
        (0..h).map(|_| <&mut [f32]>::default()).collect()
    } else {
        v.chunks_mut(n).take(h).collect()
    }
}

/// KV cache of one MLA layer (expanded per-head k_nope and v plus the shared k_rope).
#[derive(Clone, Debug, Default)]
pub struct MlaState {
    /// [n_pos, n_heads, d_nope]
    pub k_nope: Vec<f32>,
    /// [n_pos, d_rope]
    pub k_rope: Vec<f32>,
    /// [n_pos, n_heads, d_v]
    pub v: Vec<f32>,
}

#[derive(Clone, Debug)]
pub enum LayerState {
    Kda(KdaState),
    Mla(MlaState),
}

/// The whole per-sequence state: everything carried from one position to the next.
#[derive(Clone, Debug)]
pub struct SeqState {
    pub layers: Vec<LayerState>,
    /// Positions already processed.
    pub n_pos: usize,
}

impl SeqState {
    pub fn new(spec: &ModelSpec) -> SeqState {
        let layers = spec
            .layers
            .iter()
            .map(|l| match l.attn {
                AttnKind::Kda => {
                    let p = spec
                        .kda
                        .as_ref()
                        .expect("validated: KDA layers have a KdaSpec");
                    let ch = p.n_heads * p.head_dim;
                    let win = ch * (p.conv_kernel - 1);
                    LayerState::Kda(KdaState {
                        conv_q: vec![0.0; win],
                        conv_k: vec![0.0; win],
                        conv_v: vec![0.0; win],
                        s: vec![0.0; p.n_heads * p.head_dim * p.head_dim],
                    })
                }
                AttnKind::Mla => LayerState::Mla(MlaState::default()),
            })
            .collect();
        SeqState { layers, n_pos: 0 }
    }

    /// Whether `other` holds the same positions and the same state, bit for bit.
    pub fn same_bits(&self, other: &SeqState) -> bool {
        let eq = |a: &[f32], b: &[f32]| {
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
        };
        self.n_pos == other.n_pos
            && self.layers.len() == other.layers.len()
            && self
                .layers
                .iter()
                .zip(&other.layers)
                .all(|(a, b)| match (a, b) {
                    (LayerState::Kda(a), LayerState::Kda(b)) => {
                        eq(&a.conv_q, &b.conv_q)
                            && eq(&a.conv_k, &b.conv_k)
                            && eq(&a.conv_v, &b.conv_v)
                            && eq(&a.s, &b.s)
                    }
                    (LayerState::Mla(a), LayerState::Mla(b)) => {
                        eq(&a.k_nope, &b.k_nope) && eq(&a.k_rope, &b.k_rope) && eq(&a.v, &b.v)
                    }
                    _ => false,
                })
    }

    /// A mark to [`Self::rewind`] to: the KDA layers' conv windows and recurrent state (fixed
    /// size, copied) and every MLA cache's length (append-only, so a length is enough).
    pub fn mark(&self) -> StateMark {
        StateMark {
            n_pos: self.n_pos,
            layers: self
                .layers
                .iter()
                .map(|l| match l {
                    LayerState::Kda(k) => MarkedLayer::Kda(k.clone()),
                    LayerState::Mla(m) => {
                        MarkedLayer::Mla([m.k_nope.len(), m.k_rope.len(), m.v.len()])
                    }
                })
                .collect(),
        }
    }

    /// Back to the state at `mark` (taken from this state, which has only been fed since):
    /// the KDA states copied back, the MLA caches cut to their marked lengths.
    pub fn rewind(&mut self, mark: &StateMark) {
        assert!(
            mark.n_pos <= self.n_pos && mark.layers.len() == self.layers.len(),
            "rewind: the mark is not from this state's past"
        );
        for (l, m) in self.layers.iter_mut().zip(&mark.layers) {
            match (l, m) {
                (LayerState::Kda(k), MarkedLayer::Kda(saved)) => k.clone_from(saved),
                (LayerState::Mla(st), MarkedLayer::Mla([a, b, c])) => {
                    st.k_nope.truncate(*a);
                    st.k_rope.truncate(*b);
                    st.v.truncate(*c);
                }
                _ => panic!("rewind: the mark's layer kinds differ from this state's"),
            }
        }
        self.n_pos = mark.n_pos;
    }
}

/// A point a [`SeqState`] can be rewound to (speculative decoding's rejected drafts).
#[derive(Clone, Debug)]
pub struct StateMark {
    n_pos: usize,
    layers: Vec<MarkedLayer>,
}

#[derive(Clone, Debug)]
enum MarkedLayer {
    Kda(KdaState),
    Mla([usize; 3]),
}

impl StateMark {
    /// Positions fed when the mark was taken.
    pub fn n_pos(&self) -> usize {
        self.n_pos
    }
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
    scores: Vec<f32>, // MLA attention scores [H*max_pos]
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
            scores: z(b.mla_heads * plan.max_positions),
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

/// The router settings of a MoE layer, selecting `top_k` experts (the real routing: the
/// layer's top-k; a prefetch guess: top-k plus its margin).
fn router_cfg(p: &k3_models::spec::MoeSpec, top_k: usize) -> router::RouterCfg {
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
struct MoeDims<'s> {
    p: &'s k3_models::spec::MoeSpec,
    /// Routed experts.
    ne: usize,
    /// Experts per token (top-k).
    k: usize,
    /// Expert FFN width.
    ff: usize,
    /// Expert input/output width: the latent, or d_model without latent MoE.
    dz: usize,
    /// Fused shared-expert width (`ff * n_shared_experts`).
    sw: usize,
    /// One routed expert's scratch slot `[gate ff | up ff | h ff | out dz]`.
    stride: usize,
}

impl<'s> MoeDims<'s> {
    fn of(spec: &'s ModelSpec) -> MoeDims<'s> {
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

/// Scratch of the expert-prefetch guess, separate from [`Scratch`] so the guess cannot touch
/// anything the real forward pass reads.
struct GuessScratch {
    xn: Vec<f32>,      // [d_model]
    norm: Vec<f32>,    // [max small tensor]
    bias: Vec<f32>,    // [max small tensor]
    logits: Vec<f32>,  // [E]
    ids: Vec<u32>,     // [E]
    weights: Vec<f32>, // [E]
    /// The MoE layers guessed by look-ahead and not reached yet (their own pre-attention guess
    /// is skipped).
    ahead_for: Vec<usize>,
    q: Vec<f32>,   // [d_model] pseudo-query of the next layer's MLP AttnRes
    mix: Vec<f32>, // [d_model] estimated next MoE input
    rl: Vec<f32>,  // [AttnRes sources]
}

impl GuessScratch {
    fn new(plan: &Plan) -> GuessScratch {
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

/// View raw little-endian bytes as bf16 bit patterns (copying only if misaligned).
fn bf16_bits(t: TensorBytes<'_>) -> Cow<'_, [u16]> {
    bf16_of(t.bytes)
}

/// Little-endian bf16 bytes as u16 (borrowed when 2-byte aligned, else copied).
fn bf16_of(bytes: &[u8]) -> Cow<'_, [u16]> {
    match bytemuck::try_cast_slice::<u8, u16>(bytes) {
        Ok(s) => Cow::Borrowed(s),
        Err(_) => Cow::Owned(
            bytes
                .chunks_exact(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]]))
                .collect(),
        ),
    }
}

/// Widen a small BF16 or F32 tensor exactly into `out[..n]`; returns n.
fn widen(t: TensorBytes<'_>, out: &mut [f32]) -> usize {
    match t.decl.dtype {
        DType::BF16 => {
            let n = t.bytes.len() / 2;
            crate::weights::widen_bf16_le(t.bytes, &mut out[..n]);
            n
        }
        DType::F32 => {
            let n = t.bytes.len() / 4;
            for (o, c) in out[..n].iter_mut().zip(t.bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
            n
        }
        DType::U8 => 0,
    }
}

fn need<'a>(
    lw: &LayerWeights<'a>,
    layer: usize,
    role: TensorRole,
) -> Result<TensorBytes<'a>, ExecError> {
    lw.get(role).ok_or(ExecError::MissingTensor { layer, role })
}

/// `out = W x` for a bf16 tensor.
fn lin(pool: &Pool, w: TensorBytes<'_>, x: &[f32], out: &mut [f32]) {
    matvec::matvec_bf16(pool, &bf16_bits(w), x, out);
}

/// Several bf16 matvecs over the same input `x` in ONE parallel dispatch (row chunks of every
/// matrix are the tasks): [`lin_many`] with one token. Each output row is still one canonical
/// dot product computed by one thread, so the bits equal those of separate [`lin`] calls for
/// any thread count; it only saves the per-call fork/join cost of many small matvecs.
fn lin_batch(pool: &Pool, x: &[f32], jobs: Vec<(TensorBytes<'_>, &mut [f32])>) {
    lin_many(pool, 1, jobs.into_iter().map(|(w, o)| (w, x, o)).collect());
}

/// The routed experts `ws` (one task each; `ws[t]` is the expert routed `at[t]`-th and writes
/// the `at[t]`-th `scratch.len() / k`-sized slot of `scratch`, see [`Executor::moe`]) and the
/// bf16 matvecs `rows` on input `x` (split into row chunks of about one expert's time) in ONE
/// dispatch, tasks interleaved: the experts are compute-bound (MXFP4 decode) and the rows
/// memory-bound, so two threads running one of each use both the cores and the memory bus.
/// Every output is the same kernel call on the same input as in separate dispatches (a row is
/// always one canonical dot on one thread), so the bits do not change.
fn experts_with_rows(
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
fn expert_ffn(
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
fn expert_ffn_many(
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
const EXPERT_TOKENS_PER_TASK: usize = 8;

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

fn lookahead_depth() -> usize {
    std::env::var(LOOKAHEAD_DEPTH_ENV)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(DEFAULT_LOOKAHEAD_DEPTH)
        .max(1)
}

/// Gated MLP activation into `h`.
fn glu(act: Activation, gate: &[f32], up: &[f32], h: &mut [f32]) {
    match act {
        Activation::Situ { beta, beta_lin } => ops::situ_glu(gate, up, beta, beta_lin, h),
        Activation::Silu => ops::silu_glu(gate, up, h),
    }
}

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

    /// The MoE of `n` tokens whose inputs are in `rows.xn`, EXPERT-MAJOR: the router and the
    /// latent down-projection of all tokens (weights read once), every token's routing, then
    /// each routed expert any token chose is fetched ONCE (ascending id, `top_k` per
    /// `experts()` call) and applied to every token that chose it, the shared experts of all
    /// tokens, and each token's combine in its routed order, the latent up-projection of all
    /// tokens; outputs into `rows.mlp_out`. A streamed expert is read once per layer per call
    /// instead of once per token that routes to it; the bits are those of [`Self::moe`].
    fn moe_many(
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

    /// The attention input of layer `l` for the token whose carry is in the scratch: the
    /// AttnRes mix (the block sums and the partial sum; a new block starts here every
    /// `block_size` layers) or the residual stream, normed into `s.xn`.
    fn attn_in(&mut self, l: usize, lw: &LayerWeights<'_>) -> Result<(), ExecError> {
        let spec = self.spec;
        let s = &mut self.s;
        // blk.{l}.attn_in
        match &spec.attn_res {
            Some(ar) => {
                if s.blocks.is_empty() {
                    s.x.copy_from_slice(&s.partial);
                } else {
                    let proj = need(lw, l, TensorRole::AttnResProj)?;
                    let norm = need(lw, l, TensorRole::AttnResNorm)?;
                    Self::attn_res(s, proj, norm, ar.eps, true);
                }
                if l.is_multiple_of(ar.block_size) {
                    s.blocks.push(s.partial.clone());
                    s.has_partial = false;
                }
            }
            None => s.x.copy_from_slice(&s.partial),
        }
        let n = widen(need(lw, l, TensorRole::InputNorm)?, &mut s.w_a);
        ops::rmsnorm(&s.x, Some(&s.w_a[..n]), spec.rms_norm_eps, &mut s.xn);
        Ok(())
    }

    /// After the attention of the token whose carry is in the scratch: `attn_out`
    /// (blk.{l}.attn_out) into the partial sum, then the FFN input (AttnRes mix or residual)
    /// normed into `s.xn` (and unnormed in `s.x`).
    fn attn_merge(
        spec: &ModelSpec,
        s: &mut Scratch,
        lw: &LayerWeights<'_>,
        l: usize,
        attn_out: &[f32],
    ) -> Result<(), ExecError> {
        if s.has_partial {
            ops::add_inplace(&mut s.partial, attn_out);
        } else {
            s.partial.copy_from_slice(attn_out);
            s.has_partial = true;
        }
        // blk.{l}.mlp_in
        match &spec.attn_res {
            Some(ar) => {
                let proj = need(lw, l, TensorRole::MlpResProj)?;
                let norm = need(lw, l, TensorRole::MlpResNorm)?;
                Self::attn_res(s, proj, norm, ar.eps, true);
            }
            None => s.x.copy_from_slice(&s.partial),
        }
        let n = widen(need(lw, l, TensorRole::PostAttnNorm)?, &mut s.w_a);
        ops::rmsnorm(&s.x, Some(&s.w_a[..n]), spec.rms_norm_eps, &mut s.xn);
        Ok(())
    }

    /// Guess the top-(k + margin) experts of the layer `tw` belongs to, from the estimate of
    /// its MoE input ([`Self::estimate_next_moe_input`]; `fallback` without AttnRes), into
    /// `g.ids`; returns how many (see [`Self::guess_experts`]).
    fn guess_layer(
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
    fn estimate_next_moe_input(
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
    fn guess_experts(
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

    /// x = AttnRes(blocks ∪ {partial}) with the pseudo-query `norm ⊙ proj` folded in f32.
    fn attn_res(
        s: &mut Scratch,
        proj: TensorBytes<'_>,
        norm: TensorBytes<'_>,
        eps: f32,
        with_partial: bool,
    ) {
        let d = s.x.len();
        widen(proj, &mut s.w_a);
        widen(norm, &mut s.w_b);
        for i in 0..d {
            s.res_query[i] = s.w_a[i] * s.w_b[i];
        }
        let mut sources: Vec<&[f32]> = s.blocks.iter().map(|b| b.as_slice()).collect();
        if with_partial && s.has_partial {
            sources.push(&s.partial);
        }
        let n = sources.len();
        attnres::attnres_mix(
            &sources,
            &s.res_query,
            eps,
            &mut s.res_logits[..n],
            &mut s.x,
        );
    }

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

    /// Kimi Delta Attention for the tokens of [`Self::attention`].
    fn kda_many(
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

    /// Multi-head latent attention (NoPE) for the tokens of [`Self::attention`]: each token's
    /// key and value are appended to its sequence's cache and it attends to its positions so
    /// far, in token order.
    fn mla_many(
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
        let [qa, qan, mq, ckv, ckvn, kv, mo, mg] = carve(
            work,
            [
                n * ql,
                n * ql,
                n * h * dq,
                n * (kvl + dr),
                n * kvl,
                n * h * (dn + dv),
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
        // c = kv_a x -> [kv_lora | k_rope]; kv = kv_b(norm(c_kv)) -> [H, nope | v]
        let nw = widen(need(lw, l, TensorRole::MlaKvANorm)?, &mut s.w_a);
        for (c, cn) in ckv.chunks(kvl + dr).zip(ckvn.chunks_mut(kvl)) {
            ops::rmsnorm(&c[..kvl], Some(&s.w_a[..nw]), p.latent_norm_eps, cn);
        }
        let w = need(lw, l, TensorRole::MlaKvB)?;
        lin_many(pool, n, vec![(w, &*ckvn, &mut *kv)]);
        for (i, &(seq, pos)) in at.iter().enumerate() {
            let LayerState::Mla(st) = &mut *sts[seq] else {
                unreachable!("SeqState is built from the same layer map")
            };
            // append this position to the cache
            debug_assert_eq!(st.k_rope.len(), pos * dr);
            let kvi = &kv[i * h * (dn + dv)..(i + 1) * h * (dn + dv)];
            for hh in 0..h {
                let base = hh * (dn + dv);
                st.k_nope.extend_from_slice(&kvi[base..base + dn]);
            }
            st.k_rope
                .extend_from_slice(&ckv[i * (kvl + dr) + kvl..(i + 1) * (kvl + dr)]);
            for hh in 0..h {
                let base = hh * (dn + dv) + dn;
                st.v.extend_from_slice(&kvi[base..base + dv]);
            }
            let n_pos = pos + 1;
            let shape = attn::MlaShape {
                n_heads: h,
                d_nope: dn,
                d_rope: dr,
                d_v: dv,
                n_pos,
                scale: 1.0 / (dq as f32).sqrt(),
            };
            let moi = &mut mo[i * h * dv..(i + 1) * h * dv];
            attn::mla_attend(
                pool,
                &shape,
                &mq[i * h * dq..(i + 1) * h * dq],
                &st.k_nope,
                &st.k_rope,
                &st.v,
                &mut s.scores[..h * n_pos],
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

    /// Dense gated MLP (layer 0 of K3) of `n` tokens: `rows.xn` in, `rows.mlp_out` out.
    fn dense_many(
        spec: &ModelSpec,
        pool: &Pool,
        rows: &mut Rows,
        n: usize,
        lw: &LayerWeights<'_>,
        l: usize,
    ) -> Result<(), ExecError> {
        let ff = spec
            .dense
            .as_ref()
            .expect("validated: dense layers have a DenseMlpSpec")
            .d_ff;
        let d = spec.d_model;
        let Rows {
            xn, mlp_out, work, ..
        } = rows;
        let (xn, mlp_out) = (&xn[..n * d], &mut mlp_out[..n * d]);
        let [gate, up, h] = carve(work, [n * ff; 3]);
        lin_many(
            pool,
            n,
            vec![
                (need(lw, l, TensorRole::DenseGate)?, xn, &mut *gate),
                (need(lw, l, TensorRole::DenseUp)?, xn, &mut *up),
            ],
        );
        for ((g, u), hh) in gate.chunks(ff).zip(up.chunks(ff)).zip(h.chunks_mut(ff)) {
            glu(spec.activation, g, u, hh);
        }
        let w = need(lw, l, TensorRole::DenseDown)?;
        lin_many(pool, n, vec![(w, &*h, mlp_out)]);
        Ok(())
    }

    /// Latent MoE with shared experts: `s.xn` in, `s.mlp_out` out.
    fn moe(
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
    fn route_token(
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
    fn routed_sum<'o>(
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
    fn moe_combine(
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
