//! The synth spec file (`configs/synth/*.toml`): model dimensions, shard count and
//! conditioning knobs of a synthetic checkpoint.
//!
//! Owns: parsing (strict: `deny_unknown_fields`, `schema_version = 1`) and validation of a
//! synth spec, reporting every problem at once with its TOML path. Must not: write files or
//! describe the tensor graph (the models crate derives the tensors from the config.json this
//! spec turns into).
//!
//! Defaults of `[conditioning]` are the oracle's (`fixtures/oracle/synth_k3.py`, README
//! "Conditioning"): out_gain 0.25 on every sublayer output projection, KDA q/k correlation 0.8,
//! router bias std 2.0, router gain 2, AttnRes logit std 1.5, logit std 3, norm weights 1 +- 0.1.
//! Everything else is fixed to the release's values by the models crate's
//! `ConfigDims::k3_family`: K3's layer-map rule (MLA at 0-based layers 3, 7, 11, ... plus the
//! final layer, KDA elsewhere), SiTU 4/25, sigmoid router, KDA lower-bound gate -5, MXFP4
//! group 32, `A_log` padding by the manifest's rule (head_dim entries when head_dim > heads).

use std::path::Path;

use serde::Deserialize;

/// Current schema version of synth spec files.
pub const SCHEMA_VERSION: u32 = 1;

#[derive(Clone, Debug, Deserialize, serde::Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SynthSpec {
    pub schema_version: u32,
    /// Model name, written to config.json's `_name_or_path` and the synth manifest.
    pub name: String,
    pub model: ModelDims,
    pub kda: KdaDims,
    pub mla: MlaDims,
    pub moe: MoeDims,
    #[serde(default)]
    pub layout: Layout,
    #[serde(default)]
    pub conditioning: Conditioning,
}

#[derive(Clone, Debug, Deserialize, serde::Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModelDims {
    pub d_model: usize,
    pub n_layers: usize,
    /// Vocabulary of the model (embedding rows / logits). At least 256.
    pub vocab_size: usize,
    /// AttnRes block size: a snapshot is pushed at layers `l % attn_res_block == 0`.
    pub attn_res_block: usize,
    /// Number of leading dense-MLP layers. K3: 1.
    #[serde(default = "default_first_k_dense")]
    pub first_k_dense: usize,
    /// Width of the dense MLP (`intermediate_size`).
    pub dense_ffn: usize,
}

#[derive(Clone, Debug, Deserialize, serde::Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct KdaDims {
    pub n_heads: usize,
    pub head_dim: usize,
    #[serde(default = "default_conv_kernel")]
    pub conv_kernel: usize,
}

#[derive(Clone, Debug, Deserialize, serde::Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct MlaDims {
    pub n_heads: usize,
    pub q_lora_rank: usize,
    pub kv_lora_rank: usize,
    pub d_nope: usize,
    pub d_rope: usize,
    pub d_v: usize,
}

#[derive(Clone, Debug, Deserialize, serde::Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct MoeDims {
    pub n_experts: usize,
    pub n_experts_active: usize,
    pub n_shared_experts: usize,
    /// Routed expert FFN width (`moe_intermediate_size`), multiple of 32.
    pub d_expert_ff: usize,
    /// Latent width (`routed_expert_hidden_size`), multiple of 32.
    pub d_latent: usize,
    #[serde(default = "one")]
    pub routed_scaling_factor: f32,
}

#[derive(Clone, Debug, Deserialize, serde::Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Layout {
    /// Number of safetensors shards (>= 1; whole layers per shard, so <= n_layers).
    #[serde(default = "default_shards")]
    pub shards: usize,
    /// Add tiny `vision_tower.*` / `mm_projector.*` tensors like the release carries.
    #[serde(default = "yes")]
    pub vision_stubs: bool,
}

impl Default for Layout {
    fn default() -> Self {
        Layout {
            shards: default_shards(),
            vision_stubs: true,
        }
    }
}

#[derive(Clone, Debug, Deserialize, serde::Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Conditioning {
    /// Gain of every sublayer output projection (o_proj, down_proj, shared down_proj,
    /// routed_expert_up_proj).
    #[serde(default = "d_out_gain")]
    pub out_gain: f32,
    /// Correlation of KDA q_proj / q_conv1d with k.
    #[serde(default = "d_qk_corr")]
    pub qk_corr: f32,
    /// Std of `e_score_correction_bias` (small = flat routing with more near ties).
    #[serde(default = "d_router_bias_std")]
    pub router_bias_std: f32,
    /// Router weight gain.
    #[serde(default = "d_router_gain")]
    pub router_gain: f32,
    /// Std of the AttnRes logits (pseudo-query gain).
    #[serde(default = "d_attn_res_logit_std")]
    pub attn_res_logit_std: f32,
    /// Std of the output logits (lm_head gain).
    #[serde(default = "d_logit_std")]
    pub logit_std: f32,
    /// Norm weights are 1 + N(0, norm_spread).
    #[serde(default = "d_norm_spread")]
    pub norm_spread: f32,
}

impl Default for Conditioning {
    fn default() -> Self {
        Conditioning {
            out_gain: d_out_gain(),
            qk_corr: d_qk_corr(),
            router_bias_std: d_router_bias_std(),
            router_gain: d_router_gain(),
            attn_res_logit_std: d_attn_res_logit_std(),
            logit_std: d_logit_std(),
            norm_spread: d_norm_spread(),
        }
    }
}

fn default_first_k_dense() -> usize {
    1
}
fn default_conv_kernel() -> usize {
    4
}
fn default_shards() -> usize {
    4
}
fn one() -> f32 {
    1.0
}
fn yes() -> bool {
    true
}
fn d_out_gain() -> f32 {
    0.25
}
fn d_qk_corr() -> f32 {
    0.8
}
fn d_router_bias_std() -> f32 {
    2.0
}
fn d_router_gain() -> f32 {
    2.0
}
fn d_attn_res_logit_std() -> f32 {
    1.5
}
fn d_logit_std() -> f32 {
    3.0
}
fn d_norm_spread() -> f32 {
    0.1
}

/// A spec file that cannot be used; `problems` lists every problem with its TOML path.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error("{}: cannot read synth spec: {source}", path.display())]
    Io {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: invalid synth spec TOML: {msg}", path.display())]
    Parse {
        path: std::path::PathBuf,
        msg: String,
    },
    #[error("{}: invalid synth spec:\n  {}", path.display(), problems.join("\n  "))]
    Invalid {
        path: std::path::PathBuf,
        problems: Vec<String>,
    },
}

impl SynthSpec {
    /// Read, parse and validate a spec file.
    pub fn load(path: &Path) -> Result<SynthSpec, SpecError> {
        let text = k3_models::load::read_regular_file(path).map_err(|source| SpecError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&text, path)
    }

    /// Parse and validate spec text (`path` is only used in messages).
    pub fn parse(text: &str, path: &Path) -> Result<SynthSpec, SpecError> {
        let spec: SynthSpec = toml::from_str(text).map_err(|e| SpecError::Parse {
            path: path.to_path_buf(),
            msg: e.to_string(),
        })?;
        let problems = spec.problems();
        if problems.is_empty() {
            Ok(spec)
        } else {
            Err(SpecError::Invalid {
                path: path.to_path_buf(),
                problems,
            })
        }
    }

    /// Every validation problem, each prefixed with its TOML path.
    pub fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        let mut need = |ok: bool, msg: &str| {
            if !ok {
                p.push(msg.to_string());
            }
        };
        let m = &self.model;
        need(
            self.schema_version == SCHEMA_VERSION,
            &format!(
                "schema_version: must be {SCHEMA_VERSION}, got {}",
                self.schema_version
            ),
        );
        need(!self.name.is_empty(), "name: must not be empty");
        need(m.d_model > 0, "model.d_model: must be > 0");
        need(m.n_layers >= 2, "model.n_layers: must be >= 2");
        need(
            m.vocab_size >= 256,
            "model.vocab_size: must be >= 256 (all byte tokens)",
        );
        need(m.attn_res_block >= 1, "model.attn_res_block: must be >= 1");
        need(
            m.first_k_dense < m.n_layers,
            "model.first_k_dense: must be < model.n_layers (at least one MoE layer)",
        );
        need(m.dense_ffn > 0, "model.dense_ffn: must be > 0");
        let k = &self.kda;
        need(k.n_heads > 0, "kda.n_heads: must be > 0");
        need(k.head_dim > 0, "kda.head_dim: must be > 0");
        need(k.conv_kernel >= 1, "kda.conv_kernel: must be >= 1");
        let a = &self.mla;
        for (v, n) in [
            (a.n_heads, "mla.n_heads"),
            (a.q_lora_rank, "mla.q_lora_rank"),
            (a.kv_lora_rank, "mla.kv_lora_rank"),
            (a.d_nope, "mla.d_nope"),
            (a.d_v, "mla.d_v"),
        ] {
            need(v > 0, &format!("{n}: must be > 0"));
        }
        let e = &self.moe;
        need(e.n_experts >= 1, "moe.n_experts: must be >= 1");
        need(
            e.n_experts_active >= 1 && e.n_experts_active <= e.n_experts,
            "moe.n_experts_active: must be in 1..=moe.n_experts",
        );
        need(
            e.n_shared_experts >= 1,
            "moe.n_shared_experts: must be >= 1",
        );
        need(
            e.d_expert_ff > 0 && e.d_expert_ff.is_multiple_of(32),
            "moe.d_expert_ff: must be a positive multiple of 32 (MXFP4 blocks)",
        );
        need(
            e.d_latent > 0 && e.d_latent.is_multiple_of(32),
            "moe.d_latent: must be a positive multiple of 32 (MXFP4 blocks)",
        );
        need(
            self.layout.shards >= 1 && self.layout.shards <= m.n_layers,
            "layout.shards: must be in 1..=model.n_layers (whole layers per shard)",
        );
        let c = &self.conditioning;
        need(
            (0.0..1.0).contains(&c.qk_corr),
            "conditioning.qk_corr: must be in [0, 1)",
        );
        for (v, n) in [
            (c.out_gain, "conditioning.out_gain"),
            (c.router_bias_std, "conditioning.router_bias_std"),
            (c.router_gain, "conditioning.router_gain"),
            (c.attn_res_logit_std, "conditioning.attn_res_logit_std"),
            (c.logit_std, "conditioning.logit_std"),
            (c.norm_spread, "conditioning.norm_spread"),
        ] {
            need(
                v.is_finite() && v >= 0.0,
                &format!("{n}: must be finite and >= 0"),
            );
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: &str = r#"
schema_version = 1
name = "t"
[model]
d_model = 64
n_layers = 9
vocab_size = 300
attn_res_block = 2
dense_ffn = 128
[kda]
n_heads = 2
head_dim = 16
[mla]
n_heads = 2
q_lora_rank = 32
kv_lora_rank = 32
d_nope = 16
d_rope = 8
d_v = 16
[moe]
n_experts = 8
n_experts_active = 3
n_shared_experts = 1
d_expert_ff = 32
d_latent = 32
"#;

    #[test]
    fn defaults_are_the_oracles() {
        let s = SynthSpec::parse(MIN, Path::new("t.toml")).unwrap();
        assert_eq!(s.conditioning.out_gain, 0.25);
        assert_eq!(s.conditioning.qk_corr, 0.8);
        assert_eq!(s.conditioning.router_bias_std, 2.0);
        assert_eq!(s.layout.shards, 4);
    }

    #[test]
    fn unknown_key_is_rejected_with_its_name() {
        let text = MIN.replace("dense_ffn = 128", "dense_ffn = 128\ndense_fnn = 3");
        let err = SynthSpec::parse(&text, Path::new("t.toml")).unwrap_err();
        assert!(err.to_string().contains("dense_fnn"), "{err}");
    }

    #[test]
    fn every_problem_is_reported_with_its_path() {
        let text = MIN
            .replace("d_expert_ff = 32", "d_expert_ff = 33")
            .replace("n_experts_active = 3", "n_experts_active = 9")
            .replace("vocab_size = 300", "vocab_size = 200");
        let err = SynthSpec::parse(&text, Path::new("t.toml")).unwrap_err();
        let msg = err.to_string();
        for key in [
            "moe.d_expert_ff",
            "moe.n_experts_active",
            "model.vocab_size",
        ] {
            assert!(msg.contains(key), "{key} missing in {msg}");
        }
    }
}
