//! The validated model description (`ModelSpec`) that the planner, loader, synthesiser and
//! executor all consume.
//!
//! Owns: the typed, validated shape of a Kimi-family model (dimensions, layer map, block kinds,
//! the tensor inventory). Must not: read files (see `manifest` and `hf_config`), know about
//! memory budgets or I/O. Follows upstream: field meanings mirror the HF `config.json`
//! (`text_config`, `linear_attn_config`) of Kimi K3; see
//! `docs/MODEL.md` §2-§4.
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
    /// eps of `q_a_layernorm` / `kv_a_layernorm` (docs/NUMERICS.md §3: 1e-6).
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
    /// MXFP4 group size along the input dimension (32). Meaningful only when
    /// `expert_format == ExpertFormat::Mxfp4`; the manifest's value is kept otherwise.
    pub mxfp4_group: usize,
    /// How routed expert weights are stored (K3: MXFP4 `weight_packed` + `weight_scale`).
    pub expert_format: ExpertFormat,
}

/// Storage format of the routed experts' weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum ExpertFormat {
    /// compressed-tensors `mxfp4-pack-quantized`: roles `ExpertW{1,3,2}{Packed,Scale}`, U8.
    Mxfp4,
    /// Plain BF16 linear weights: roles `ExpertW{1,3,2}` (Kimi-Linear), run by the same
    /// executor, resident and streamed (`runner/tests/bf16_experts.rs`).
    Bf16,
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
    /// Parse a safetensors dtype string ("BF16", "F32", "U8").
    pub fn parse(s: &str) -> Option<DType> {
        match s {
            "BF16" => Some(DType::BF16),
            "F32" => Some(DType::F32),
            "U8" => Some(DType::U8),
            _ => None,
        }
    }
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
    // routed experts stored unquantized (BF16; Kimi-Linear layout, not used by K3)
    ExpertW1,
    ExpertW3,
    ExpertW2,
}

/// Where a role's tensors live: once per model, once per layer, or once per routed expert.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum RoleScope {
    Global,
    Layer,
    Expert,
}

impl TensorRole {
    /// Every role, in declaration order (`ALL[r as usize] == r`).
    pub const ALL: [TensorRole; 56] = [
        TensorRole::Embed,
        TensorRole::LmHead,
        TensorRole::FinalNorm,
        TensorRole::OutputResProj,
        TensorRole::OutputResNorm,
        TensorRole::InputNorm,
        TensorRole::PostAttnNorm,
        TensorRole::AttnResProj,
        TensorRole::AttnResNorm,
        TensorRole::MlpResProj,
        TensorRole::MlpResNorm,
        TensorRole::KdaQ,
        TensorRole::KdaK,
        TensorRole::KdaV,
        TensorRole::KdaQConv,
        TensorRole::KdaKConv,
        TensorRole::KdaVConv,
        TensorRole::KdaFA,
        TensorRole::KdaFB,
        TensorRole::KdaDtBias,
        TensorRole::KdaALog,
        TensorRole::KdaBeta,
        TensorRole::KdaGate,
        TensorRole::KdaGateA,
        TensorRole::KdaGateB,
        TensorRole::KdaONorm,
        TensorRole::KdaO,
        TensorRole::MlaQ,
        TensorRole::MlaQA,
        TensorRole::MlaQANorm,
        TensorRole::MlaQB,
        TensorRole::MlaKvA,
        TensorRole::MlaKvANorm,
        TensorRole::MlaKvB,
        TensorRole::MlaGate,
        TensorRole::MlaO,
        TensorRole::DenseGate,
        TensorRole::DenseUp,
        TensorRole::DenseDown,
        TensorRole::Router,
        TensorRole::RouterBias,
        TensorRole::SharedGate,
        TensorRole::SharedUp,
        TensorRole::SharedDown,
        TensorRole::LatentDown,
        TensorRole::LatentNorm,
        TensorRole::LatentUp,
        TensorRole::ExpertW1Packed,
        TensorRole::ExpertW1Scale,
        TensorRole::ExpertW3Packed,
        TensorRole::ExpertW3Scale,
        TensorRole::ExpertW2Packed,
        TensorRole::ExpertW2Scale,
        TensorRole::ExpertW1,
        TensorRole::ExpertW3,
        TensorRole::ExpertW2,
    ];

    /// The manifest key of this role (`[tensors]` table of a model manifest).
    pub fn key(self) -> &'static str {
        match self {
            TensorRole::Embed => "embed",
            TensorRole::LmHead => "lm_head",
            TensorRole::FinalNorm => "final_norm",
            TensorRole::OutputResProj => "output_res_proj",
            TensorRole::OutputResNorm => "output_res_norm",
            TensorRole::InputNorm => "input_norm",
            TensorRole::PostAttnNorm => "post_attn_norm",
            TensorRole::AttnResProj => "attn_res_proj",
            TensorRole::AttnResNorm => "attn_res_norm",
            TensorRole::MlpResProj => "mlp_res_proj",
            TensorRole::MlpResNorm => "mlp_res_norm",
            TensorRole::KdaQ => "kda_q",
            TensorRole::KdaK => "kda_k",
            TensorRole::KdaV => "kda_v",
            TensorRole::KdaQConv => "kda_q_conv",
            TensorRole::KdaKConv => "kda_k_conv",
            TensorRole::KdaVConv => "kda_v_conv",
            TensorRole::KdaFA => "kda_f_a",
            TensorRole::KdaFB => "kda_f_b",
            TensorRole::KdaDtBias => "kda_dt_bias",
            TensorRole::KdaALog => "kda_a_log",
            TensorRole::KdaBeta => "kda_beta",
            TensorRole::KdaGate => "kda_gate",
            TensorRole::KdaGateA => "kda_gate_a",
            TensorRole::KdaGateB => "kda_gate_b",
            TensorRole::KdaONorm => "kda_o_norm",
            TensorRole::KdaO => "kda_o",
            TensorRole::MlaQ => "mla_q",
            TensorRole::MlaQA => "mla_q_a",
            TensorRole::MlaQANorm => "mla_q_a_norm",
            TensorRole::MlaQB => "mla_q_b",
            TensorRole::MlaKvA => "mla_kv_a",
            TensorRole::MlaKvANorm => "mla_kv_a_norm",
            TensorRole::MlaKvB => "mla_kv_b",
            TensorRole::MlaGate => "mla_gate",
            TensorRole::MlaO => "mla_o",
            TensorRole::DenseGate => "dense_gate",
            TensorRole::DenseUp => "dense_up",
            TensorRole::DenseDown => "dense_down",
            TensorRole::Router => "router",
            TensorRole::RouterBias => "router_bias",
            TensorRole::SharedGate => "shared_gate",
            TensorRole::SharedUp => "shared_up",
            TensorRole::SharedDown => "shared_down",
            TensorRole::LatentDown => "latent_down",
            TensorRole::LatentNorm => "latent_norm",
            TensorRole::LatentUp => "latent_up",
            TensorRole::ExpertW1Packed => "expert_w1_packed",
            TensorRole::ExpertW1Scale => "expert_w1_scale",
            TensorRole::ExpertW3Packed => "expert_w3_packed",
            TensorRole::ExpertW3Scale => "expert_w3_scale",
            TensorRole::ExpertW2Packed => "expert_w2_packed",
            TensorRole::ExpertW2Scale => "expert_w2_scale",
            TensorRole::ExpertW1 => "expert_w1",
            TensorRole::ExpertW3 => "expert_w3",
            TensorRole::ExpertW2 => "expert_w2",
        }
    }

    /// Inverse of [`TensorRole::key`].
    pub fn from_key(key: &str) -> Option<TensorRole> {
        TensorRole::ALL.iter().copied().find(|r| r.key() == key)
    }

    /// Whether the role is global, per layer or per routed expert.
    pub fn scope(self) -> RoleScope {
        use TensorRole::*;
        match self {
            Embed | LmHead | FinalNorm | OutputResProj | OutputResNorm => RoleScope::Global,
            ExpertW1Packed | ExpertW1Scale | ExpertW3Packed | ExpertW3Scale | ExpertW2Packed
            | ExpertW2Scale | ExpertW1 | ExpertW3 | ExpertW2 => RoleScope::Expert,
            _ => RoleScope::Layer,
        }
    }
}

/// A tensor's dimensions, stored inline up to two dimensions (a heap `Vec` for three or
/// more: a handful per layer). Derefs to `[usize]`; prints and serialises like a `Vec<usize>`.
/// The release declares 497,056 tensors, almost all 2-D: one heap allocation each as a `Vec`.
pub type Shape = smallvec::SmallVec<[usize; 2]>;

/// One tensor the model needs, with its exact checkpoint name, dtype and shape.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct TensorDecl {
    pub name: String,
    pub role: TensorRole,
    pub layer: Option<usize>,
    pub expert: Option<usize>,
    pub dtype: DType,
    pub shape: Shape,
}

impl TensorDecl {
    pub fn n_bytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size_bytes()
    }
    /// Number of stored elements (product of the shape).
    pub fn n_elements(&self) -> usize {
        self.shape.iter().product::<usize>()
    }
    /// Logical parameters: 2 per MXFP4 packed byte, 0 for E8M0 scales, else one per element.
    pub fn logical_params(&self) -> usize {
        use TensorRole::*;
        match self.role {
            ExpertW1Packed | ExpertW3Packed | ExpertW2Packed => 2 * self.n_elements(),
            ExpertW1Scale | ExpertW3Scale | ExpertW2Scale => 0,
            _ => self.n_elements(),
        }
    }
}

/// The validated model.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ModelSpec {
    /// Manifest name, e.g. "kimi-k3".
    pub name: String,
    /// Model family named by the manifest, e.g. "kimi-k3" (the synthetic checkpoints share it).
    pub family: String,
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
    /// Every tensor the model binds, in a stable order:
    /// 1. global roles (in `TensorRole` declaration order: embed, lm_head, final norm,
    ///    output AttnRes proj/norm);
    /// 2. then layer by layer (0..n_layers): the layer's non-expert roles in `TensorRole`
    ///    declaration order (norms, AttnRes, attention block, FFN block), then its routed
    ///    experts expert-major (e = 0..n_experts), each expert's roles in declaration order
    ///    (w1 packed, w1 scale, w3 packed, w3 scale, w2 packed, w2 scale).
    ///
    /// Derived from the manifest's name templates and the dimensions above.
    pub tensors: Vec<TensorDecl>,
    /// Checkpoint tensor-name prefixes the model ignores (vision tower, projector). A
    /// checkpoint tensor that is neither declared in `tensors` nor under one of these
    /// prefixes is unexpected.
    pub ignored_tensor_prefixes: Vec<String>,
    /// `Some(n)` when this spec binds only its first `n_layers` of the `n` layers the config
    /// declares ([`ModelSpec::first_layers`], `--layers N`).
    pub truncated_from: Option<usize>,
    /// Position index over `tensors` for [`ModelSpec::tensor`]; rebuilt with
    /// [`ModelSpec::rebuild_index`] after editing `tensors` by hand.
    #[serde(skip)]
    pub index: TensorIndex,
}

/// O(1) lookup table from (role, layer, expert) to a position in `ModelSpec::tensors`.
/// Small: one slot per role per layer, plus each layer's expert block geometry.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TensorIndex {
    global: Vec<Option<u32>>,
    layers: Vec<LayerSlots>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct LayerSlots {
    /// Position of each non-expert role of the layer, indexed by `role as usize`.
    slots: Vec<Option<u32>>,
    /// Position of expert 0's first tensor.
    expert_base: u32,
    /// Per-expert role order inside one expert's run of tensors.
    expert_roles: Vec<TensorRole>,
    n_experts: u32,
}

impl TensorIndex {
    /// Build the index of a tensor list laid out in the documented stable order. Returns
    /// `None` if the list does not follow that order (then lookups fall back to a scan).
    pub fn build(tensors: &[TensorDecl], n_layers: usize) -> Option<TensorIndex> {
        let n_roles = TensorRole::ALL.len();
        let mut idx = TensorIndex {
            global: vec![None; n_roles],
            layers: vec![LayerSlots::default(); n_layers],
        };
        for l in &mut idx.layers {
            l.slots = vec![None; n_roles];
        }
        for (i, t) in tensors.iter().enumerate() {
            let pos = u32::try_from(i).ok()?;
            match (t.layer, t.expert) {
                (None, None) => idx.global[t.role as usize] = Some(pos),
                (Some(l), None) => idx.layers.get_mut(l)?.slots[t.role as usize] = Some(pos),
                (Some(l), Some(e)) => {
                    let ls = idx.layers.get_mut(l)?;
                    if e == 0 {
                        if ls.expert_roles.is_empty() {
                            ls.expert_base = pos;
                        }
                        ls.expert_roles.push(t.role);
                    }
                    ls.n_experts = ls.n_experts.max(u32::try_from(e).ok()? + 1);
                }
                (None, Some(_)) => return None,
            }
        }
        let built = idx;
        // Verify the expert geometry claim for every expert tensor.
        let ok = tensors
            .iter()
            .enumerate()
            .all(|(i, t)| built.position(t.role, t.layer, t.expert) == Some(i));
        ok.then_some(built)
    }

    fn position(
        &self,
        role: TensorRole,
        layer: Option<usize>,
        expert: Option<usize>,
    ) -> Option<usize> {
        match (layer, expert) {
            (None, None) => self
                .global
                .get(role as usize)
                .copied()
                .flatten()
                .map(|p| p as usize),
            (Some(l), None) => self
                .layers
                .get(l)?
                .slots
                .get(role as usize)
                .copied()
                .flatten()
                .map(|p| p as usize),
            (Some(l), Some(e)) => {
                let ls = self.layers.get(l)?;
                if e >= ls.n_experts as usize {
                    return None;
                }
                let k = ls.expert_roles.iter().position(|&r| r == role)?;
                Some(ls.expert_base as usize + e * ls.expert_roles.len() + k)
            }
            (None, Some(_)) => None,
        }
    }
}

impl ModelSpec {
    pub fn layer(&self, i: usize) -> &LayerSpec {
        &self.layers[i]
    }

    /// Find the declaration of a tensor by role / layer / expert. O(1) through `index`; if the
    /// index is stale (tensors edited by hand) the answer is still right, found by a scan.
    pub fn tensor(
        &self,
        role: TensorRole,
        layer: Option<usize>,
        expert: Option<usize>,
    ) -> Option<&TensorDecl> {
        let matches = |t: &TensorDecl| t.role == role && t.layer == layer && t.expert == expert;
        if let Some(t) = self
            .index
            .position(role, layer, expert)
            .and_then(|i| self.tensors.get(i))
            && matches(t)
        {
            return Some(t);
        }
        self.tensors.iter().find(|t| matches(t))
    }

    /// Rebuild `index` from `tensors` (call after editing `tensors`).
    pub fn rebuild_index(&mut self) {
        self.index = TensorIndex::build(&self.tensors, self.n_layers).unwrap_or_default();
    }

    /// The same model bound to its first `n` layers only (`--layers N`, a diagnostic for
    /// partial shard sets): layer kinds, dimensions and global tensors unchanged; the declared
    /// tensors of layers `n..` dropped and their checkpoint names ignored (each dropped layer's
    /// common name prefix joins `ignored_tensor_prefixes`), so a checkpoint may hold them or
    /// not. `n == n_layers` returns the spec unchanged.
    pub fn first_layers(&self, n: usize) -> Result<ModelSpec, String> {
        if n == 0 || n > self.n_layers {
            return Err(format!(
                "--layers {n}: model {} has {} layers; bind 1..={} of them",
                self.name, self.n_layers, self.n_layers
            ));
        }
        let mut s = self.clone();
        if n == self.n_layers {
            return Ok(s);
        }
        for l in n..self.n_layers {
            let names: Vec<&str> = self
                .tensors
                .iter()
                .filter(|t| t.layer == Some(l))
                .map(|t| t.name.as_str())
                .collect();
            match dotted_prefix(&names) {
                Some(p) => s.ignored_tensor_prefixes.push(p.to_string()),
                None => s
                    .ignored_tensor_prefixes
                    .extend(names.iter().map(|n| n.to_string())),
            }
        }
        s.tensors.retain(|t| t.layer.is_none_or(|l| l < n));
        s.layers.truncate(n);
        s.n_layers = n;
        s.truncated_from = Some(self.truncated_from.unwrap_or(self.n_layers));
        s.rebuild_index();
        Ok(s)
    }

    /// The same model with `A_log` stored as `len` entries instead of the manifest rule's
    /// length. `A_log` holds one entry per KDA head; anything past `n_heads` is storage-only
    /// zero padding (checked at open), so a checkpoint padded to another length is the same
    /// model. Each `A_log` declaration keeps its layout (`[len]` or `[1, 1, len, 1]`). Refused
    /// when `len` is below the head count or the model has no KDA layers.
    pub fn with_stored_a_log_len(&self, len: usize) -> Result<ModelSpec, String> {
        let Some(kda) = &self.kda else {
            return Err(format!("model {} has no KDA layers (no A_log)", self.name));
        };
        if len < kda.n_heads {
            return Err(format!(
                "A_log with {len} entries cannot hold one per KDA head ({} heads)",
                kda.n_heads
            ));
        }
        let mut s = self.clone();
        if let Some(k) = s.kda.as_mut() {
            k.a_log_len = len;
        }
        for t in s
            .tensors
            .iter_mut()
            .filter(|t| t.role == TensorRole::KdaALog)
        {
            // `[len]`, or `[1, 1, len, 1]` (crate::inventory::ALogLayout)
            let at = if t.shape.len() == 4 { 2 } else { 0 };
            if let Some(n) = t.shape.get_mut(at) {
                *n = len;
            }
        }
        s.rebuild_index();
        Ok(s)
    }

    /// Layer indices whose attention block is `kind`, ascending.
    pub fn layers_with_attn(&self, kind: AttnKind) -> Vec<usize> {
        self.layers
            .iter()
            .filter(|l| l.attn == kind)
            .map(|l| l.index)
            .collect()
    }

    /// Layer indices whose FFN block is `kind`, ascending.
    pub fn layers_with_ffn(&self, kind: FfnKind) -> Vec<usize> {
        self.layers
            .iter()
            .filter(|l| l.ffn == kind)
            .map(|l| l.index)
            .collect()
    }

    /// Total checkpoint bytes of every declared tensor.
    pub fn total_bytes(&self) -> u64 {
        self.tensors
            .iter()
            .fold(0u64, |a, t| a.saturating_add(t.n_bytes() as u64))
    }

    /// Number of stored elements over every declared tensor (a U8 byte counts as one).
    pub fn stored_elements(&self) -> u64 {
        self.tensors
            .iter()
            .fold(0u64, |a, t| a.saturating_add(t.n_elements() as u64))
    }

    /// Logical parameter count: MXFP4 packed bytes count as two weights each, their E8M0
    /// scale bytes count as none (they are part of the encoding, not parameters).
    pub fn logical_params(&self) -> u64 {
        self.tensors
            .iter()
            .fold(0u64, |a, t| a.saturating_add(t.logical_params() as u64))
    }

    /// Number of declared tensors of a dtype.
    pub fn count_dtype(&self, dtype: DType) -> usize {
        self.tensors.iter().filter(|t| t.dtype == dtype).count()
    }
}

/// The longest common prefix of `names` that ends with a `.` (so `layers.5.` never covers
/// `layers.50.`); `None` for no names or no such prefix.
fn dotted_prefix<'a>(names: &[&'a str]) -> Option<&'a str> {
    let first = *names.first()?;
    let mut len = first.len();
    for n in &names[1..] {
        len = first
            .bytes()
            .zip(n.bytes())
            .take(len)
            .take_while(|(a, b)| a == b)
            .count();
    }
    let cut = first[..len].rfind('.')? + 1;
    Some(&first[..cut])
}

impl ModelSpec {
    /// A short human-readable description (dimensions, layer map, blocks, inventory by
    /// role), for `k3-run plan`-style output and snapshot tests.
    pub fn summary(&self) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        let attn: String = self
            .layers
            .iter()
            .map(|l| match l.attn {
                AttnKind::Kda => 'K',
                AttnKind::Mla => 'M',
            })
            .collect();
        let ffn: String = self
            .layers
            .iter()
            .map(|l| match l.ffn {
                FfnKind::Dense => 'D',
                FfnKind::Moe => 'E',
            })
            .collect();
        // Writing to a String cannot fail.
        let _ = writeln!(s, "model {} (family {})", self.name, self.family);
        let _ = writeln!(
            s,
            "d_model {} | n_layers {} | vocab {} | rms_norm_eps {:e} | eos {:?}",
            self.d_model, self.n_layers, self.vocab_size, self.rms_norm_eps, self.eos_token_ids
        );
        let _ = writeln!(s, "activation {:?}", self.activation);
        let _ = writeln!(s, "attention (K=KDA, M=MLA): {attn}");
        let _ = writeln!(s, "ffn (D=dense, E=MoE):     {ffn}");
        let _ = writeln!(s, "kda {:?}", self.kda);
        let _ = writeln!(s, "mla {:?}", self.mla);
        let _ = writeln!(s, "dense {:?}", self.dense);
        let _ = writeln!(s, "moe {:?}", self.moe);
        let _ = writeln!(s, "attn_res {:?}", self.attn_res);
        let _ = writeln!(s, "ignored prefixes {:?}", self.ignored_tensor_prefixes);
        let _ = writeln!(
            s,
            "tensors {} (BF16 {}, F32 {}, U8 {}) | bytes {} | stored elements {} | logical params {}",
            self.tensors.len(),
            self.count_dtype(DType::BF16),
            self.count_dtype(DType::F32),
            self.count_dtype(DType::U8),
            self.total_bytes(),
            self.stored_elements(),
            self.logical_params()
        );
        let mut by_role: Vec<(TensorRole, usize, &TensorDecl)> = Vec::new();
        for t in &self.tensors {
            match by_role.iter_mut().find(|(r, _, _)| *r == t.role) {
                Some(e) => e.1 += 1,
                None => by_role.push((t.role, 1, t)),
            }
        }
        by_role.sort_by_key(|e| e.0);
        for (role, n, first) in by_role {
            let _ = writeln!(
                s,
                "  {:<18} x{:<7} {:<4} {:?}  e.g. {}",
                role.key(),
                n,
                first.dtype.as_str(),
                first.shape,
                first.name
            );
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn role_table_is_consistent() {
        for (i, r) in TensorRole::ALL.iter().enumerate() {
            assert_eq!(*r as usize, i, "ALL is in declaration order");
            assert_eq!(TensorRole::from_key(r.key()), Some(*r));
        }
        let keys: std::collections::HashSet<&str> =
            TensorRole::ALL.iter().map(|r| r.key()).collect();
        assert_eq!(keys.len(), TensorRole::ALL.len(), "keys are unique");
        assert_eq!(TensorRole::ExpertW2Scale.scope(), RoleScope::Expert);
        assert_eq!(TensorRole::OutputResNorm.scope(), RoleScope::Global);
        assert_eq!(TensorRole::LatentNorm.scope(), RoleScope::Layer);
    }

    #[test]
    fn logical_params_count_mxfp4_at_logical_size() {
        let d = |role, shape: Vec<usize>, dtype| TensorDecl {
            name: String::new(),
            role,
            layer: Some(1),
            expert: Some(0),
            dtype,
            shape: shape.into(),
        };
        // 64 x 64 logical weight: 64 x 32 packed bytes and 64 x 2 scale bytes.
        assert_eq!(
            d(TensorRole::ExpertW1Packed, vec![64, 32], DType::U8).logical_params(),
            4096
        );
        assert_eq!(
            d(TensorRole::ExpertW1Scale, vec![64, 2], DType::U8).logical_params(),
            0
        );
        assert_eq!(d(TensorRole::KdaQ, vec![3, 5], DType::BF16).n_bytes(), 30);
    }
}
