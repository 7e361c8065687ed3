//! The validated model description (`ModelSpec`) that the planner, loader, synthesiser and
//! executor all consume.
//!
//! Owns: the typed, validated shape of a Kimi-family model (dimensions, layer map, block kinds,
//! the tensor inventory). Must not: read files (see `manifest` and `hf_config`), know about
//! memory budgets or I/O. Follows upstream: field meanings mirror the HF `config.json`
//! (`text_config`, `linear_attn_config`) of Kimi K3; see
//! `../shared/research/k3-architecture.md` §2-§4.
//!
//! A `ModelSpec` is only built by validation (`manifest` + `hf_config`), never by hand in
//! production code, so every field here has been checked against both sources.

/// Which attention block a layer uses. Rule of thumb 1: the layer map is data.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum AttnKind {
    /// Kimi Delta Attention (linear attention with a recurrent f32 state).
    Kda,
    /// Multi-head latent attention (NoPE in K3), with a KV cache.
    Mla,
}

/// Which feed-forward block a layer uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum FfnKind {
    /// Dense gated MLP (layer 0 of K3).
    Dense,
    /// Latent mixture of experts with shared experts.
    Moe,
}

/// One layer of the stack.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct LayerSpec {
    pub index: usize,
    pub attn: AttnKind,
    pub ffn: FfnKind,
}

/// Gated-MLP activation.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub enum Activation {
    /// SiTU-GLU: `beta*tanh(g/beta)*sigmoid(g) * soft_clip(u)`; `beta_lin = None` means no clip.
    Situ { beta: f32, beta_lin: Option<f32> },
    /// SiLU-GLU (Kimi-Linear).
    Silu,
}

/// KDA forget-gate form.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub enum KdaGateSpec {
    /// K3: `g = lower_bound * sigmoid(exp(A_log[h]) * (graw + dt_bias))`.
    LowerBound(f32),
    /// Kimi-Linear: `g = -exp(A_log[h]) * softplus(graw + dt_bias)`.
    Softplus,
}

#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct KdaSpec {
    pub n_heads: usize,
    /// K = V = head_dim in K3.
    pub head_dim: usize,
    pub conv_kernel: usize,
    pub gate: KdaGateSpec,
    /// Stored length of `A_log` (K3: 128, of which the first `n_heads` are used; the rest must be 0).
    pub a_log_len: usize,
    /// Full-rank output gate `g_proj` (K3) vs low-rank `g_a_proj`/`g_b_proj` (Kimi-Linear).
    pub full_rank_output_gate: bool,
    /// Rank of the forget-gate low-rank projection `f_a_proj` (K3: head_dim).
    pub gate_rank: usize,
    /// eps of the gated output RMSNorm (`o_norm`).
    pub o_norm_eps: f32,
    /// eps of the per-head q/k L2 normalisation (1e-6 upstream).
    pub l2_eps: f32,
}

#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct MlaSpec {
    pub n_heads: usize,
    /// `None` = direct `q_proj` (Kimi-Linear); `Some(r)` = `q_a_proj` -> norm -> `q_b_proj`.
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub d_nope: usize,
    /// The "rope" slice; never rotated in K3 (NoPE).
    pub d_rope: usize,
    pub d_v: usize,
    pub output_gate: bool,
    /// eps of `q_a_layernorm` / `kv_a_layernorm` (NUMERICS.md §3: 1e-6).
    pub latent_norm_eps: f32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum RouterScoring {
    Sigmoid,
    Softmax,
}

#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct MoeSpec {
    pub n_experts: usize,
    pub n_experts_active: usize,
    pub n_shared_experts: usize,
    /// Width of one routed expert's FFN (`moe_intermediate_size`).
    pub d_expert_ff: usize,
    /// Latent width of routed experts (`routed_expert_hidden_size`); `None` = experts at d_model.
    pub d_latent: Option<usize>,
    /// RMSNorm on the combined routed latent output (`latent_moe_use_norm`).
    pub latent_norm: bool,
    pub scoring: RouterScoring,
    pub renormalize: bool,
    pub routed_scaling_factor: f32,
    /// Router has `e_score_correction_bias` (selection only).
    pub has_score_bias: bool,
    /// MXFP4 group size along the input dimension (32).
    pub mxfp4_group: usize,
}

#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct DenseMlpSpec {
    pub d_ff: usize,
}

#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct AttnResSpec {
    /// A snapshot of the running partial sum is pushed when `layer % block_size == 0`.
    pub block_size: usize,
    pub eps: f32,
}

/// Checkpoint dtypes the engine binds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
pub enum DType {
    BF16,
    F32,
    U8,
}

impl DType {
    pub fn size_bytes(self) -> usize {
        match self {
            DType::BF16 => 2,
            DType::F32 => 4,
            DType::U8 => 1,
        }
    }
    /// The safetensors dtype string.
    pub fn as_str(self) -> &'static str {
        match self {
            DType::BF16 => "BF16",
            DType::F32 => "F32",
            DType::U8 => "U8",
        }
    }
}

/// What a tensor is for. The executor binds tensors by role, never by guessing from names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub enum TensorRole {
    // global
    Embed,
    LmHead,
    FinalNorm,
    OutputResProj,
    OutputResNorm,
    // per layer
    InputNorm,
    PostAttnNorm,
    AttnResProj,
    AttnResNorm,
    MlpResProj,
    MlpResNorm,
    // KDA
    KdaQ,
    KdaK,
    KdaV,
    KdaQConv,
    KdaKConv,
    KdaVConv,
    KdaFA,
    KdaFB,
    KdaDtBias,
    KdaALog,
    KdaBeta,
    KdaGate,
    KdaGateA,
    KdaGateB,
    KdaONorm,
    KdaO,
    // MLA
    MlaQ,
    MlaQA,
    MlaQANorm,
    MlaQB,
    MlaKvA,
    MlaKvANorm,
    MlaKvB,
    MlaGate,
    MlaO,
    // dense MLP
    DenseGate,
    DenseUp,
    DenseDown,
    // MoE (non-expert)
    Router,
    RouterBias,
    SharedGate,
    SharedUp,
    SharedDown,
    LatentDown,
    LatentNorm,
    LatentUp,
    // routed experts (MXFP4)
    ExpertW1Packed,
    ExpertW1Scale,
    ExpertW3Packed,
    ExpertW3Scale,
    ExpertW2Packed,
    ExpertW2Scale,
}

/// One tensor the model needs, with its exact checkpoint name, dtype and shape.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct TensorDecl {
    pub name: String,
    pub role: TensorRole,
    pub layer: Option<usize>,
    pub expert: Option<usize>,
    pub dtype: DType,
    pub shape: Vec<usize>,
}

impl TensorDecl {
    pub fn n_bytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size_bytes()
    }
}

/// The validated model.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ModelSpec {
    /// Manifest name, e.g. "kimi-k3".
    pub name: String,
    pub d_model: usize,
    pub n_layers: usize,
    pub vocab_size: usize,
    /// eps of every config-eps RMSNorm (input/post-attention/final/AttnRes/latent).
    pub rms_norm_eps: f32,
    pub activation: Activation,
    pub layers: Vec<LayerSpec>,
    pub kda: Option<KdaSpec>,
    pub mla: Option<MlaSpec>,
    pub dense: Option<DenseMlpSpec>,
    pub moe: Option<MoeSpec>,
    /// `None` = plain pre-norm residual stream.
    pub attn_res: Option<AttnResSpec>,
    /// Model stop token ids from config.json (`eos_token_id`).
    pub eos_token_ids: Vec<u32>,
    /// Every tensor the model binds, in a stable order (global first, then by layer, experts last
    /// within a layer). Derived from the manifest's name templates and the dimensions above.
    pub tensors: Vec<TensorDecl>,
}

impl ModelSpec {
    pub fn layer(&self, i: usize) -> &LayerSpec {
        &self.layers[i]
    }
    /// Find the declaration of a tensor by role / layer / expert.
    pub fn tensor(
        &self,
        role: TensorRole,
        layer: Option<usize>,
        expert: Option<usize>,
    ) -> Option<&TensorDecl> {
        self.tensors
            .iter()
            .find(|t| t.role == role && t.layer == layer && t.expert == expert)
    }
}
