//! The tensor inventory: which roles each layer has, every tensor's shape, and the expansion
//! of the manifest's name templates into `ModelSpec::tensors`.
//!
//! Owns: the ONLY shape formulas in k3-run ([`shape`]) and the role sets of each block kind
//! ([`BlockRoles`]); the planner, loader and synthesiser read shapes from
//! `ModelSpec::tensors`, never recompute them. Must not: read files or decide block kinds
//! (that is `load`, from the manifest and config.json).
//!
//! Follows upstream (`docs/MODEL.md` §3): PyTorch `[out, in]` linear
//! weights; KDA q/k/v `[H*K, d]`, depthwise conv `[H*K, 1, conv]`, `f_a` `[rank, d]`, `f_b`
//! `[H*K, rank]`, `dt_bias` `[H*K]`, `A_log` `[a_log_len]`, `b_proj` `[H, d]`, `o_norm` `[K]`;
//! MLA `q_b` `[H*(nope+rope), q_lora]`, `kv_a_proj_with_mqa` `[kv_lora+rope, d]`, `kv_b`
//! `[H*(nope+v), kv_lora]`, `g_proj` `[H*v, d]`; MoE shared width
//! `moe_intermediate_size * num_shared_experts`; MXFP4 experts `weight_packed [out, in/2]`
//! and `weight_scale [out, in/group]` of the logical `w1/w3 [ff, d_in]`, `w2 [d_in, ff]`.

use crate::spec::{
    AttnKind, DType, ExpertFormat, FfnKind, KdaSpec, MlaSpec, ModelSpec, MoeSpec, Shape,
    TensorDecl, TensorRole,
};

/// How the stored `A_log` is shaped (manifest `kda.a_log_shape`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ALogLayout {
    /// `[a_log_len]`.
    Flat,
    /// `[1, 1, a_log_len, 1]`.
    Heads4d,
}

/// One role's name template and dtype (validated).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Template {
    pub name: String,
    pub dtype: DType,
}

/// Templates indexed by `role as usize`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Templates(pub Vec<Option<Template>>);

impl Templates {
    pub fn get(&self, role: TensorRole) -> Option<&Template> {
        self.0.get(role as usize).and_then(Option::as_ref)
    }
}

/// Role sets of each block kind, given its options. One place, used both to check that a
/// manifest has exactly the templates its blocks need and to lay out the inventory.
pub struct BlockRoles;

impl BlockRoles {
    pub fn global(attn_res: bool) -> Vec<TensorRole> {
        use TensorRole::*;
        let mut v = vec![Embed, LmHead, FinalNorm];
        if attn_res {
            v.extend([OutputResProj, OutputResNorm]);
        }
        v
    }

    /// Roles every layer has.
    pub fn layer_common(attn_res: bool) -> Vec<TensorRole> {
        use TensorRole::*;
        let mut v = vec![InputNorm, PostAttnNorm];
        if attn_res {
            v.extend([AttnResProj, AttnResNorm, MlpResProj, MlpResNorm]);
        }
        v
    }

    pub fn kda(full_rank_output_gate: bool) -> Vec<TensorRole> {
        use TensorRole::*;
        let mut v = vec![
            KdaQ, KdaK, KdaV, KdaQConv, KdaKConv, KdaVConv, KdaFA, KdaFB, KdaDtBias, KdaALog,
            KdaBeta,
        ];
        if full_rank_output_gate {
            v.push(KdaGate);
        } else {
            v.extend([KdaGateA, KdaGateB]);
        }
        v.extend([KdaONorm, KdaO]);
        v
    }

    pub fn mla(q_lora: bool, output_gate: bool) -> Vec<TensorRole> {
        use TensorRole::*;
        let mut v = if q_lora {
            vec![MlaQA, MlaQANorm, MlaQB]
        } else {
            vec![MlaQ]
        };
        v.extend([MlaKvA, MlaKvANorm, MlaKvB]);
        if output_gate {
            v.push(MlaGate);
        }
        v.push(MlaO);
        v
    }

    pub fn dense() -> Vec<TensorRole> {
        use TensorRole::*;
        vec![DenseGate, DenseUp, DenseDown]
    }

    /// Non-expert MoE roles.
    pub fn moe(
        router_bias: bool,
        shared: bool,
        latent: bool,
        latent_norm: bool,
    ) -> Vec<TensorRole> {
        use TensorRole::*;
        let mut v = vec![Router];
        if router_bias {
            v.push(RouterBias);
        }
        if shared {
            v.extend([SharedGate, SharedUp, SharedDown]);
        }
        if latent {
            v.push(LatentDown);
            if latent_norm {
                v.push(LatentNorm);
            }
            v.push(LatentUp);
        }
        v
    }

    /// One routed expert's roles, in storage order.
    pub fn expert(format: ExpertFormat) -> Vec<TensorRole> {
        use TensorRole::*;
        match format {
            ExpertFormat::Mxfp4 => vec![
                ExpertW1Packed,
                ExpertW1Scale,
                ExpertW3Packed,
                ExpertW3Scale,
                ExpertW2Packed,
                ExpertW2Scale,
            ],
            ExpertFormat::Bf16 => vec![ExpertW1, ExpertW3, ExpertW2],
        }
    }
}

fn kda_of(spec: &ModelSpec) -> Option<&KdaSpec> {
    spec.kda.as_ref()
}

/// Shape of a tensor of `role` in `spec`. `None` if the spec lacks the block the role
/// belongs to. The only shape formulas in k3-run.
pub fn shape(spec: &ModelSpec, role: TensorRole, a_log: ALogLayout) -> Option<Vec<usize>> {
    use TensorRole::*;
    let d = spec.d_model;
    let v = spec.vocab_size;
    let s = match role {
        Embed | LmHead => vec![v, d],
        FinalNorm | OutputResNorm | InputNorm | PostAttnNorm | AttnResNorm | MlpResNorm => vec![d],
        OutputResProj | AttnResProj | MlpResProj => vec![1, d],
        KdaQ | KdaK | KdaV | KdaQConv | KdaKConv | KdaVConv | KdaFA | KdaFB | KdaDtBias
        | KdaALog | KdaBeta | KdaGate | KdaGateA | KdaGateB | KdaONorm | KdaO => {
            kda_shape(kda_of(spec)?, d, role, a_log)
        }
        MlaQ | MlaQA | MlaQANorm | MlaQB | MlaKvA | MlaKvANorm | MlaKvB | MlaGate | MlaO => {
            mla_shape(spec.mla.as_ref()?, d, role)?
        }
        DenseGate | DenseUp => vec![spec.dense.as_ref()?.d_ff, d],
        DenseDown => vec![d, spec.dense.as_ref()?.d_ff],
        _ => moe_shape(spec.moe.as_ref()?, d, role)?,
    };
    Some(s)
}

fn kda_shape(k: &KdaSpec, d: usize, role: TensorRole, a_log: ALogLayout) -> Vec<usize> {
    use TensorRole::*;
    let hk = k.n_heads * k.head_dim;
    let r = k.gate_rank;
    match role {
        KdaQ | KdaK | KdaV | KdaGate => vec![hk, d],
        KdaQConv | KdaKConv | KdaVConv => vec![hk, 1, k.conv_kernel],
        KdaFA | KdaGateA => vec![r, d],
        KdaFB | KdaGateB => vec![hk, r],
        KdaDtBias => vec![hk],
        KdaALog => match a_log {
            ALogLayout::Flat => vec![k.a_log_len],
            ALogLayout::Heads4d => vec![1, 1, k.a_log_len, 1],
        },
        KdaBeta => vec![k.n_heads, d],
        KdaONorm => vec![k.head_dim],
        _ => vec![d, hk], // KdaO
    }
}

fn mla_shape(m: &MlaSpec, d: usize, role: TensorRole) -> Option<Vec<usize>> {
    use TensorRole::*;
    let h = m.n_heads;
    let qk = m.d_nope + m.d_rope;
    Some(match role {
        MlaQ => vec![h * qk, d],
        MlaQA => vec![m.q_lora_rank?, d],
        MlaQANorm => vec![m.q_lora_rank?],
        MlaQB => vec![h * qk, m.q_lora_rank?],
        MlaKvA => vec![m.kv_lora_rank + m.d_rope, d],
        MlaKvANorm => vec![m.kv_lora_rank],
        MlaKvB => vec![h * (m.d_nope + m.d_v), m.kv_lora_rank],
        MlaGate => vec![h * m.d_v, d],
        _ => vec![d, h * m.d_v], // MlaO
    })
}

fn moe_shape(m: &MoeSpec, d: usize, role: TensorRole) -> Option<Vec<usize>> {
    use TensorRole::*;
    let e = m.n_experts;
    let ws = m.d_expert_ff * m.n_shared_experts;
    let din = m.d_latent.unwrap_or(d);
    let ff = m.d_expert_ff;
    let g = m.mxfp4_group;
    Some(match role {
        Router => vec![e, d],
        RouterBias => vec![e],
        SharedGate | SharedUp => vec![ws, d],
        SharedDown => vec![d, ws],
        LatentDown => vec![m.d_latent?, d],
        LatentNorm => vec![m.d_latent?],
        LatentUp => vec![d, m.d_latent?],
        ExpertW1 | ExpertW3 => vec![ff, din],
        ExpertW2 => vec![din, ff],
        ExpertW1Packed | ExpertW3Packed => vec![ff, din / 2],
        ExpertW1Scale | ExpertW3Scale => vec![ff, din / g],
        ExpertW2Packed => vec![din, ff / 2],
        ExpertW2Scale => vec![din, ff / g],
        _ => return None,
    })
}

/// Non-expert roles of layer `l`, in `TensorRole` declaration order.
pub fn layer_roles(spec: &ModelSpec, l: usize) -> Vec<TensorRole> {
    let ls = spec.layers[l];
    let attn_res = spec.attn_res.is_some();
    let mut v = BlockRoles::layer_common(attn_res);
    match ls.attn {
        AttnKind::Kda => {
            if let Some(k) = &spec.kda {
                v.extend(BlockRoles::kda(k.full_rank_output_gate));
            }
        }
        AttnKind::Mla => {
            if let Some(m) = &spec.mla {
                v.extend(BlockRoles::mla(m.q_lora_rank.is_some(), m.output_gate));
            }
        }
    }
    match ls.ffn {
        FfnKind::Dense => v.extend(BlockRoles::dense()),
        FfnKind::Moe => {
            if let Some(m) = &spec.moe {
                v.extend(BlockRoles::moe(
                    m.has_score_bias,
                    m.n_shared_experts > 0,
                    m.d_latent.is_some(),
                    m.latent_norm,
                ));
            }
        }
    }
    v.sort();
    v
}

/// A template split at its placeholders, so expansion is one allocation per name.
struct Compiled {
    parts: Vec<Part>,
    dtype: DType,
}

enum Part {
    Lit(String),
    Layer,
    Expert,
}

impl Compiled {
    fn new(t: &Template) -> Compiled {
        let mut parts = Vec::new();
        let mut rest = t.name.as_str();
        loop {
            let next = [("{layer}", 0), ("{expert}", 1)]
                .iter()
                .filter_map(|&(p, k)| rest.find(p).map(|i| (i, p.len(), k)))
                .min();
            match next {
                None => {
                    if !rest.is_empty() {
                        parts.push(Part::Lit(rest.to_string()));
                    }
                    break;
                }
                Some((i, len, k)) => {
                    if i > 0 {
                        parts.push(Part::Lit(rest[..i].to_string()));
                    }
                    parts.push(if k == 0 { Part::Layer } else { Part::Expert });
                    rest = &rest[i + len..];
                }
            }
        }
        Compiled {
            parts,
            dtype: t.dtype,
        }
    }

    /// The name for `layer` / `expert`, built in `buf` (reused across calls) and returned at
    /// its exact length: one allocation per name, no spare capacity (the release has 497,056).
    fn expand(&self, buf: &mut String, layer: Option<usize>, expert: Option<usize>) -> String {
        use std::fmt::Write;
        buf.clear();
        for p in &self.parts {
            // Writing to a String cannot fail.
            let _ = match p {
                Part::Lit(x) => buf.write_str(x),
                Part::Layer => write!(buf, "{}", layer.unwrap_or(0)),
                Part::Expert => write!(buf, "{}", expert.unwrap_or(0)),
            };
        }
        buf.as_str().to_owned()
    }
}

/// Expand the templates into the full inventory, in the order documented on
/// `ModelSpec::tensors`. Errors name the role whose template or shape is missing (a bug in
/// validation if it ever happens, so it is reported rather than panicking).
pub fn build(
    spec: &ModelSpec,
    t: &Templates,
    a_log: ALogLayout,
) -> Result<Vec<TensorDecl>, String> {
    let compiled: Vec<Option<Compiled>> =
        t.0.iter().map(|x| x.as_ref().map(Compiled::new)).collect();
    // (template, shape) of a role; shapes do not depend on the layer or expert.
    let role_info = |role: TensorRole| -> Result<(&Compiled, Shape), String> {
        let c = compiled
            .get(role as usize)
            .and_then(Option::as_ref)
            .ok_or_else(|| format!("no name template for role `{}`", role.key()))?;
        let shape = shape(spec, role, a_log)
            .ok_or_else(|| format!("no shape for role `{}`", role.key()))?;
        Ok((c, Shape::from_vec(shape)))
    };
    let mut buf = String::with_capacity(128);
    let mut decl = |info: &(&Compiled, Shape), role, layer, expert| TensorDecl {
        name: info.0.expand(&mut buf, layer, expert),
        role,
        layer,
        expert,
        dtype: info.0.dtype,
        shape: info.1.clone(),
    };
    let mut global = BlockRoles::global(spec.attn_res.is_some());
    global.sort();
    // The exact count first, so the list is allocated once at its final size (growing it by
    // doubling held up to 1.5x the final list, and two copies during a move, at the release's
    // 497,056 declarations).
    let expert_roles = spec
        .moe
        .as_ref()
        .map(|m| BlockRoles::expert(m.expert_format));
    let count = global.len()
        + (0..spec.n_layers)
            .map(|l| {
                let experts = match (&spec.moe, &expert_roles) {
                    (Some(m), Some(r)) if spec.layers[l].ffn == FfnKind::Moe => {
                        m.n_experts * r.len()
                    }
                    _ => 0,
                };
                layer_roles(spec, l).len() + experts
            })
            .sum::<usize>();
    let mut out = Vec::with_capacity(count);
    for role in global {
        out.push(decl(&role_info(role)?, role, None, None));
    }
    for l in 0..spec.n_layers {
        for role in layer_roles(spec, l) {
            out.push(decl(&role_info(role)?, role, Some(l), None));
        }
        if spec.layers[l].ffn == FfnKind::Moe
            && let Some(m) = &spec.moe
        {
            let roles = BlockRoles::expert(m.expert_format)
                .into_iter()
                .map(|r| role_info(r).map(|i| (r, i)))
                .collect::<Result<Vec<_>, String>>()?;
            for e in 0..m.n_experts {
                for (role, info) in &roles {
                    out.push(decl(info, *role, Some(l), Some(e)));
                }
            }
        }
    }
    Ok(out)
}
