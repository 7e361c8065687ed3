//! The execution plan: what the executor will allocate and touch, derived from the one
//! [`ModelSpec`] the executor runs (no hand-duplicated size formulas: buffer sizes come from the
//! spec's dimensions, byte counts from its tensor inventory).
//!
//! Owns: scratch-buffer sizes, per-layer trunk / expert byte counts, decode-state bytes (KDA
//! state, MLA KV per position), and the text `k3-run plan` prints. Must not: allocate or read
//! weights.

use std::fmt;

use k3_models::spec::{AttnKind, FfnKind, ModelSpec, TensorRole};

/// Scratch-buffer sizes (in f32 elements) the executor allocates once.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct BufferSizes {
    pub d_model: usize,
    pub max_attn_res_sources: usize,
    pub max_small_tensor: usize,
    pub kda_heads: usize,
    pub kda_channels: usize,
    pub kda_gate_rank: usize,
    pub mla_heads: usize,
    pub mla_q_lora: usize,
    pub mla_q: usize,
    pub mla_ckv: usize,
    pub mla_kv_lora: usize,
    pub mla_kv: usize,
    pub mla_out: usize,
    pub max_ff: usize,
    pub n_experts: usize,
    pub n_experts_active: usize,
    /// Width of one routed expert's FFN.
    pub expert_ff: usize,
    pub moe_latent: usize,
}

impl BufferSizes {
    /// f32 elements per token a multi-token pass keeps outside its work area: the layer's
    /// attention and FFN input (normed), attention output, FFN output and shared-expert output.
    pub fn pass_fixed_per_token(&self) -> usize {
        4 * self.d_model
    }

    /// f32 elements per token of a multi-token pass's work area, shared by the attention phase
    /// (KDA or MLA projections and outputs) and the FFN phase (dense or MoE router, latent and
    /// shared-expert activations): the largest of the four.
    pub fn pass_work_per_token(&self) -> usize {
        let head_dim = self.kda_channels.checked_div(self.kda_heads).unwrap_or(0);
        let kda = 8 * self.kda_channels + self.kda_gate_rank + self.kda_heads + head_dim;
        let mla =
            2 * self.mla_q_lora + self.mla_q + self.mla_ckv + self.mla_kv_lora + 2 * self.mla_out;
        let ffn = 3 * self.max_ff;
        let moe = 3 * self.max_ff + self.n_experts + 2 * self.moe_latent;
        kda.max(mla).max(ffn).max(moe)
    }
}

/// One layer's entry in the plan.
#[derive(Clone, Debug, serde::Serialize)]
pub struct LayerPlan {
    pub index: usize,
    pub attn: AttnKind,
    pub ffn: FfnKind,
    /// Bytes of the layer's dense-trunk tensors (everything but routed experts).
    pub trunk_bytes: u64,
    /// Bytes of all routed experts of the layer.
    pub expert_bytes: u64,
    /// Bytes of one routed expert (w1, w3, w2 packed + scales).
    pub bytes_per_expert: u64,
    /// Decode state carried across positions: fixed part (KDA) ...
    pub state_bytes: u64,
    /// ... and the part that grows per position (MLA KV cache).
    pub kv_bytes_per_position: u64,
}

/// The compiled plan.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Plan {
    pub model: String,
    pub max_positions: usize,
    pub buffers: BufferSizes,
    pub layers: Vec<LayerPlan>,
    /// Embedding + lm_head + final norms.
    pub global_bytes: u64,
    /// Bytes of the embedding table (part of `global_bytes`).
    pub embed_bytes: u64,
    /// Bytes of one embedding row (one token's vector: 2 x d_model in bf16).
    pub embed_row_bytes: u64,
    /// Bytes of routed experts a token touches per MoE layer (top-k experts).
    pub active_expert_bytes_per_layer: u64,
    /// Most tokens one layer-major call feeds (a prompt chunk; `--prefill-chunk`): callers
    /// split longer prompts. Each chunk reads a streamed trunk once.
    pub prefill_chunk: usize,
}

impl Plan {
    /// Compile the plan for a spec and a maximum context length (positions).
    pub fn new(spec: &ModelSpec, max_positions: usize) -> Plan {
        let d = spec.d_model;
        let mut b = BufferSizes {
            d_model: d,
            max_attn_res_sources: spec
                .attn_res
                .as_ref()
                .map_or(1, |a| spec.n_layers.div_ceil(a.block_size) + 1),
            ..BufferSizes::default()
        };
        // the largest small (widened) tensor: any tensor that is not a matrix to matvec
        b.max_small_tensor = spec
            .tensors
            .iter()
            .filter(|t| is_small(t.role))
            .map(|t| t.shape.iter().product::<usize>())
            .max()
            .unwrap_or(0)
            .max(d);
        if let Some(k) = &spec.kda {
            b.kda_heads = k.n_heads;
            b.kda_channels = k.n_heads * k.head_dim;
            b.kda_gate_rank = k.gate_rank.max(k.head_dim);
        }
        if let Some(m) = &spec.mla {
            b.mla_heads = m.n_heads;
            b.mla_q_lora = m.q_lora_rank.unwrap_or(0);
            b.mla_q = m.n_heads * (m.d_nope + m.d_rope);
            b.mla_ckv = m.kv_lora_rank + m.d_rope;
            b.mla_kv_lora = m.kv_lora_rank;
            b.mla_kv = m.n_heads * (m.d_nope + m.d_v);
            b.mla_out = m.n_heads * m.d_v;
        }
        let mut max_ff = 0;
        if let Some(dn) = &spec.dense {
            max_ff = max_ff.max(dn.d_ff);
        }
        if let Some(m) = &spec.moe {
            max_ff = max_ff.max(m.d_expert_ff * m.n_shared_experts.max(1));
            b.n_experts = m.n_experts;
            b.n_experts_active = m.n_experts_active;
            b.expert_ff = m.d_expert_ff;
            b.moe_latent = m.d_latent.unwrap_or(d);
        }
        b.max_ff = max_ff;

        let mut layers: Vec<LayerPlan> = spec
            .layers
            .iter()
            .map(|l| LayerPlan {
                index: l.index,
                attn: l.attn,
                ffn: l.ffn,
                trunk_bytes: 0,
                expert_bytes: 0,
                bytes_per_expert: 0,
                state_bytes: 0,
                kv_bytes_per_position: 0,
            })
            .collect();
        let mut global_bytes = 0u64;
        for t in &spec.tensors {
            let n = t.n_bytes() as u64;
            match (t.layer, t.expert) {
                (Some(l), Some(e)) => {
                    layers[l].expert_bytes += n;
                    if e == 0 {
                        layers[l].bytes_per_expert += n;
                    }
                }
                (Some(l), None) => layers[l].trunk_bytes += n,
                (None, _) => global_bytes += n,
            }
        }
        let (embed_bytes, embed_row_bytes) = spec
            .tensors
            .iter()
            .find(|t| t.role == TensorRole::Embed && t.layer.is_none() && t.expert.is_none())
            .map_or((0, 0), |t| {
                let n = t.n_bytes() as u64;
                (n, n / t.shape.first().copied().unwrap_or(1).max(1) as u64)
            });
        let f = std::mem::size_of::<f32>() as u64;
        for lp in &mut layers {
            match lp.attn {
                AttnKind::Kda => {
                    let k = spec
                        .kda
                        .as_ref()
                        .expect("validated: KDA layers have a KdaSpec");
                    let ch = (k.n_heads * k.head_dim) as u64;
                    lp.state_bytes = f
                        * (3 * ch * (k.conv_kernel as u64 - 1)
                            + (k.n_heads * k.head_dim * k.head_dim) as u64);
                }
                AttnKind::Mla => {
                    let m = spec
                        .mla
                        .as_ref()
                        .expect("validated: MLA layers have an MlaSpec");
                    // the latent cache: normalised c_kv and the shared k_rope
                    lp.kv_bytes_per_position = f * (m.kv_lora_rank + m.d_rope) as u64;
                }
            }
        }
        let active = spec.moe.as_ref().map_or(0, |m| {
            layers
                .iter()
                .find(|l| l.ffn == FfnKind::Moe)
                .map_or(0, |l| l.bytes_per_expert * m.n_experts_active as u64)
        });
        Plan {
            model: spec.name.clone(),
            max_positions,
            buffers: b,
            layers,
            global_bytes,
            embed_bytes,
            embed_row_bytes,
            active_expert_bytes_per_layer: active,
            prefill_chunk: crate::exec::PREFILL_CHUNK,
        }
    }

    /// Memory an embedding served row by row from the checkpoint's map takes for `tokens`
    /// tokens: the 4 KiB pages their rows can touch (a row of `embed_row_bytes` spans at most
    /// `ceil(row / 4096) + 1` pages: 5 pages, 20,480 B, for a 14,336-byte row), never more than
    /// the whole table's pages. A run reads only the rows of its tokens, so counting the whole
    /// table (2.35 GB at the release's widths) would plan memory it never touches.
    pub fn embed_touched_bytes(&self, tokens: usize) -> u64 {
        const PAGE: u64 = 4096;
        if self.embed_row_bytes == 0 {
            return 0;
        }
        let per_row = (self.embed_row_bytes.div_ceil(PAGE) + 1) * PAGE;
        let table = (self.embed_bytes.div_ceil(PAGE) + 1) * PAGE;
        per_row.saturating_mul(tokens as u64).min(table)
    }

    pub fn trunk_bytes(&self) -> u64 {
        self.layers.iter().map(|l| l.trunk_bytes).sum()
    }
    pub fn expert_bytes(&self) -> u64 {
        self.layers.iter().map(|l| l.expert_bytes).sum()
    }
    pub fn state_bytes(&self) -> u64 {
        self.layers.iter().map(|l| l.state_bytes).sum()
    }
    pub fn kv_bytes_per_position(&self) -> u64 {
        self.layers.iter().map(|l| l.kv_bytes_per_position).sum()
    }
    /// Working memory of one layer-major call of [`Self::prefill_chunk`] tokens: each
    /// token's residual carry (the partial sum and the AttnRes block snapshots), its rows of
    /// the pass's token-major buffers (layer inputs and outputs, projections: see
    /// [`BufferSizes::pass_work_per_token`]), its routing and its routed experts' outputs
    /// (expert-major MoE).
    pub fn prefill_bytes(&self) -> u64 {
        let b = &self.buffers;
        let per_token = b.d_model * (b.max_attn_res_sources + 1)
            + b.pass_fixed_per_token()
            + b.pass_work_per_token()
            + 2 * b.n_experts_active
            + b.n_experts_active * b.moe_latent;
        (self.prefill_chunk * per_token * 4) as u64
    }
    /// Decode-state memory for a request of `positions` positions.
    pub fn state_bytes_for(&self, positions: usize) -> u64 {
        self.state_bytes() + self.kv_bytes_per_position() * positions as u64
    }
    /// Weight bytes one decode token touches: trunk + globals' lm_head/embedding row + active experts.
    pub fn bytes_touched_per_token(&self, embed_row_bytes: u64, lm_head_bytes: u64) -> u64 {
        let n_moe = self.layers.iter().filter(|l| l.ffn == FfnKind::Moe).count() as u64;
        self.trunk_bytes()
            + embed_row_bytes
            + lm_head_bytes
            + n_moe * self.active_expert_bytes_per_layer
    }
}

/// Tensors the executor widens to f32 scratch instead of running a matvec on.
pub fn is_small(role: TensorRole) -> bool {
    use TensorRole::*;
    matches!(
        role,
        FinalNorm
            | OutputResProj
            | OutputResNorm
            | InputNorm
            | PostAttnNorm
            | AttnResProj
            | AttnResNorm
            | MlpResProj
            | MlpResNorm
            | KdaQConv
            | KdaKConv
            | KdaVConv
            | KdaDtBias
            | KdaALog
            | KdaONorm
            | MlaQANorm
            | MlaKvANorm
            | RouterBias
            | LatentNorm
    )
}

fn gb(b: u64) -> f64 {
    b as f64 / 1e9
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n_kda = self
            .layers
            .iter()
            .filter(|l| l.attn == AttnKind::Kda)
            .count();
        let n_mla = self.layers.len() - n_kda;
        let n_dense = self
            .layers
            .iter()
            .filter(|l| l.ffn == FfnKind::Dense)
            .count();
        writeln!(
            f,
            "plan for {}: {} layer{} ({} KDA, {} MLA; {} dense FFN, {} MoE)",
            self.model,
            self.layers.len(),
            if self.layers.len() == 1 { "" } else { "s" },
            n_kda,
            n_mla,
            n_dense,
            self.layers.len() - n_dense
        )?;
        writeln!(
            f,
            "  dense trunk    {:>12.3} GB ({} bytes)",
            gb(self.trunk_bytes()),
            self.trunk_bytes()
        )?;
        writeln!(
            f,
            "  routed experts {:>12.3} GB ({} bytes)",
            gb(self.expert_bytes()),
            self.expert_bytes()
        )?;
        writeln!(
            f,
            "  global         {:>12.3} GB (embedding {:.3} GB, lm_head and final norms {:.3} GB); \
             a memory-mapped embedding is planned at the rows a run touches ({} B per token, \
             4 KiB pages)",
            gb(self.global_bytes),
            gb(self.embed_bytes),
            gb(self.global_bytes - self.embed_bytes),
            self.embed_touched_bytes(1)
        )?;
        writeln!(
            f,
            "  decode state   {:>12.3} MB fixed (KDA) + {:.3} MB per position (MLA latent cache); {} positions max",
            self.state_bytes() as f64 / 1e6,
            self.kv_bytes_per_position() as f64 / 1e6,
            self.max_positions
        )?;
        writeln!(
            f,
            "  active experts {:>12.3} MB per MoE layer per token",
            self.active_expert_bytes_per_layer as f64 / 1e6
        )?;
        writeln!(
            f,
            "  prompt chunks  {:>12.3} MB working memory for {} tokens per pass ({:.3} MB per token; --prefill-chunk)",
            self.prefill_bytes() as f64 / 1e6,
            self.prefill_chunk,
            self.prefill_bytes() as f64 / 1e6 / self.prefill_chunk.max(1) as f64
        )?;
        writeln!(
            f,
            "  layer  attn  ffn    trunk_bytes  expert_bytes  state_bytes  kv_bytes/pos"
        )?;
        for l in &self.layers {
            writeln!(
                f,
                "  {:>5}  {:<4}  {:<5}  {:>11}  {:>12}  {:>11}  {:>12}",
                l.index,
                format!("{:?}", l.attn),
                format!("{:?}", l.ffn),
                l.trunk_bytes,
                l.expert_bytes,
                l.state_bytes,
                l.kv_bytes_per_position
            )?;
        }
        let b = &self.buffers;
        writeln!(
            f,
            "  scratch (f32 elements): d_model {} kda_channels {} mla_q {} mla_kv {} max_ff {} experts {} (top {}) latent {}",
            b.d_model,
            b.kda_channels,
            b.mla_q,
            b.mla_kv,
            b.max_ff,
            b.n_experts,
            b.n_experts_active,
            b.moe_latent
        )
    }
}
