//! The TOML model manifest: raw serde types and the strict parser.
//!
//! Owns: the schema of `configs/models/*.toml` (documented field by field in
//! `docs/MANIFEST.md`) and stage one of the two-stage config: TOML text -> [`RawManifest`],
//! rejecting unknown fields and a wrong or missing `schema_version`, and reporting every
//! problem it can find at once, each with its TOML path. Must not: read config.json, compute
//! shapes or decide layer kinds (that is `load`, the only place with shape formulas).
//!
//! Design: the manifest says *what kind* of model this is (block kinds and their options,
//! how the layer map is read, tensor-name templates and dtypes, code defaults that are not
//! config keys); config.json says *how big* it is. So one manifest (`kimi-k3.toml`) serves
//! the 2.8T release and every small synthetic K3-family checkpoint.
//!
//! Error reporting: the document is split into top-level sections, each deserialised on its
//! own (so a problem in `[kda]` does not hide one in `[moe]`); unknown keys of a section are
//! all found by comparing the table against the serde field list of its raw type (see
//! [`struct_fields`]); type errors carry the inner path via `serde_path_to_error`.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde::de::DeserializeOwned;

use crate::error::{ErrorKind, Errors, Place, SpecError, SpecErrors};

/// The manifest schema this build reads.
pub const SCHEMA_VERSION: i64 = 1;

/// A parsed (not yet validated) manifest. Field meanings: `docs/MANIFEST.md`.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawManifest {
    pub schema_version: i64,
    /// Manifest name, e.g. "kimi-k3".
    pub name: String,
    /// Model family, e.g. "kimi-k3".
    pub family: String,
    #[serde(default)]
    pub description: Option<String>,
    pub config: RawConfig,
    /// Values config.json must hold, keyed by full key path from the file's root
    /// (`"text_config.model_type" = "kimi_linear"`). Structural facts only, never dimensions
    /// in a family manifest.
    #[serde(default)]
    pub pins: BTreeMap<String, toml::Value>,
    pub layer_map: RawLayerMap,
    /// Gated-MLP activation of the dense MLP, shared experts and routed experts.
    pub activation: ActivationKind,
    #[serde(default)]
    pub attn_res: Option<RawAttnRes>,
    #[serde(default)]
    pub kda: Option<RawKda>,
    #[serde(default)]
    pub mla: Option<RawMla>,
    #[serde(default)]
    pub dense: Option<RawDense>,
    #[serde(default)]
    pub moe: Option<RawMoe>,
    #[serde(default)]
    pub checkpoint: Option<RawCheckpoint>,
    /// Tensor-name templates and dtypes, keyed by role key (`TensorRole::key`).
    pub tensors: BTreeMap<String, RawTensor>,
}

/// `[config]`: where things are in config.json.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    /// Key of the object holding the language-model config (`"text_config"` in K3's
    /// multimodal layout); `""` when the text config is the root (Kimi-Linear).
    pub text_config: String,
}

/// `[layer_map]`: how each layer's attention and FFN kind is read from config.json.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLayerMap {
    /// List of layers (numbered from `index_base`) whose attention is KDA.
    pub kda_layers: LayerListKey,
    /// List of layers (numbered from `index_base`) whose attention is MLA.
    pub mla_layers: LayerListKey,
    /// Numbering of the two lists (upstream: 1-based).
    pub index_base: usize,
    /// Rule for dense vs MoE FFN layers.
    pub ffn: FfnRule,
}

/// A config.json list of layer numbers (path relative to the text config).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
pub enum LayerListKey {
    #[serde(rename = "linear_attn_config.kda_layers")]
    LinearAttnKdaLayers,
    #[serde(rename = "linear_attn_config.full_attn_layers")]
    LinearAttnFullAttnLayers,
}

impl LayerListKey {
    /// Key path relative to the text config.
    pub fn key(self) -> &'static str {
        match self {
            LayerListKey::LinearAttnKdaLayers => "linear_attn_config.kda_layers",
            LayerListKey::LinearAttnFullAttnLayers => "linear_attn_config.full_attn_layers",
        }
    }
}

/// Dense-vs-MoE rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
pub enum FfnRule {
    /// Upstream `KimiLinear` rule: layer `i` is MoE iff `i >= first_k_dense_replace` and
    /// `i % moe_layer_freq == 0`; dense otherwise.
    #[serde(rename = "first_k_dense_replace")]
    FirstKDenseReplace,
}

/// Gated-MLP activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ActivationKind {
    /// SiTU-GLU; betas from `activation_situ_beta` / `activation_situ_linear_beta`;
    /// config.json `hidden_act` must be "situ".
    Situ,
    /// SiLU-GLU; config.json `hidden_act` must be "silu".
    Silu,
}

/// An epsilon: a literal (an upstream code default that is not a config key) or the name
/// of the config.json key it is read from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum EpsRaw {
    Value(f64),
    Key(EpsKey),
}

/// Config keys an epsilon may be read from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EpsKey {
    RmsNormEps,
}

impl<'de> Deserialize<'de> for EpsRaw {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<EpsRaw, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = EpsRaw;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a positive number or the config key \"rms_norm_eps\"")
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<EpsRaw, E> {
                Ok(EpsRaw::Value(v))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<EpsRaw, E> {
                Ok(EpsRaw::Value(v as f64))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<EpsRaw, E> {
                Ok(EpsRaw::Value(v as f64))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<EpsRaw, E> {
                match v {
                    "rms_norm_eps" => Ok(EpsRaw::Key(EpsKey::RmsNormEps)),
                    _ => Err(E::invalid_value(serde::de::Unexpected::Str(v), &self)),
                }
            }
        }
        d.deserialize_any(V)
    }
}

/// `[attn_res]`: Block Attention Residuals. Absent = plain pre-norm residual stream.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAttnRes {
    /// Config key holding the block size (layers per block).
    pub block_size: AttnResBlockKey,
    /// eps of the RMS normalisation of the sources.
    pub eps: EpsRaw,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
pub enum AttnResBlockKey {
    #[serde(rename = "attn_res_block_size")]
    AttnResBlockSize,
}

/// `[kda]`: Kimi Delta Attention block.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawKda {
    pub gate: KdaGateKind,
    pub output_gate: OutputGateKind,
    /// Rank of `f_a_proj` / `f_b_proj` (and of `g_a_proj` / `g_b_proj` when low-rank).
    pub forget_gate_rank: RankRule,
    /// How many `A_log` entries are stored.
    pub a_log_len: ALogLenRule,
    /// How the stored `A_log` is shaped.
    pub a_log_shape: ALogShape,
    /// eps of the per-head q/k L2 normalisation.
    pub l2_eps: EpsRaw,
    /// eps of the gated output RMSNorm `o_norm`.
    pub o_norm_eps: EpsRaw,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KdaGateKind {
    /// `lower_bound * sigmoid(exp(A_log[h]) * (graw + dt_bias))`; lower bound read from
    /// `linear_attn_config.gate_lower_bound` (required).
    LowerBound,
    /// `-exp(A_log[h]) * softplus(graw + dt_bias)` (Kimi-Linear; `gate_lower_bound` ignored).
    Softplus,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OutputGateKind {
    /// `g_proj` (config `linear_attn_config.use_full_rank_gate` must be true).
    FullRank,
    /// `g_a_proj` -> `g_b_proj` (config `use_full_rank_gate` absent or false).
    LowRank,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RankRule {
    /// The KDA head dim (upstream `nn.Linear(hidden, head_dim)`).
    HeadDim,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ALogLenRule {
    /// Exactly `head_dim` entries (the first `num_heads` used, the rest zero padding).
    HeadDim,
    /// `head_dim` if it exceeds `num_heads` (K3: 128 for 96 heads), else the smallest
    /// multiple of 32 above `num_heads` (synth_k3.py's rule; K3 itself never needs it).
    PaddedHeadDim,
    /// Exactly `num_heads` entries, no padding (Kimi-Linear).
    NHeads,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ALogShape {
    /// `[a_log_len]` (K3).
    Flat,
    /// `[1, 1, a_log_len, 1]` (Kimi-Linear).
    Heads4d,
}

/// `[mla]`: multi-head latent attention block (NoPE).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawMla {
    /// `q_a_proj` -> `q_a_layernorm` -> `q_b_proj` (true; config `q_lora_rank` must be set)
    /// or a direct `q_proj` (false; `q_lora_rank` null or absent).
    pub q_lora: bool,
    /// Sigmoid output gate `g_proj` (config `mla_use_output_gate` must agree).
    pub output_gate: bool,
    /// eps of `q_a_layernorm` / `kv_a_layernorm` (HF code default 1e-6, not a config key).
    pub latent_norm_eps: EpsRaw,
}

/// `[dense]`: dense gated MLP (width `intermediate_size`). No options yet.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawDense {}

/// `[moe]`: mixture of experts.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawMoe {
    /// Routed experts work at `routed_expert_hidden_size` behind a down/up projection.
    pub latent: bool,
    /// Fused shared experts (width `moe_intermediate_size * num_shared_experts`).
    pub shared_experts: bool,
    /// Router has `e_score_correction_bias` (selection only).
    pub router_bias: bool,
    pub expert_format: ExpertFormatKind,
    /// MXFP4 group size (required when `expert_format = "mxfp4"`; must equal the config's
    /// `quantization_config` group size).
    #[serde(default)]
    pub mxfp4_group: Option<usize>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExpertFormatKind {
    Mxfp4,
    Bf16,
}

/// `[checkpoint]`: facts about the checkpoint beyond the tensors the model binds.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawCheckpoint {
    /// Tensor-name prefixes present in the checkpoint but not used (vision tower...).
    #[serde(default)]
    pub ignore_prefixes: Vec<String>,
}

/// One `[tensors]` entry: a name template (`{layer}`, `{expert}` placeholders) and a dtype.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTensor {
    pub name: String,
    /// safetensors dtype: "BF16", "F32" or "U8".
    pub dtype: String,
}

/// Top-level keys that may be absent.
const OPTIONAL_TOP: &[&str] = &[
    "description",
    "pins",
    "attn_res",
    "kda",
    "mla",
    "dense",
    "moe",
    "checkpoint",
];

/// Parse manifest text. `file` is used in error messages only.
pub fn parse_manifest(text: &str, file: &str) -> Result<RawManifest, SpecErrors> {
    let place = |path: &str| Place::Manifest {
        file: file.to_string(),
        path: path.to_string(),
    };
    let table: toml::Table = match text.parse() {
        Ok(t) => t,
        Err(e) => {
            // a model's config.json given as the manifest: say so, not only where TOML failed
            let msg =
                if serde_json::from_str::<serde_json::Value>(text).is_ok_and(|v| v.is_object()) {
                    "is JSON (a model config.json?), not a manifest: a model manifest is TOML \
                 (configs/models/*.toml, docs/MANIFEST.md); the model config is read from \
                 MODEL_DIR/config.json or --config"
                        .to_string()
                } else {
                    format!("not valid TOML: {e}")
                };
            return Err(SpecErrors(vec![SpecError::new(
                ErrorKind::Syntax,
                Place::File {
                    file: file.to_string(),
                },
                msg,
            )]));
        }
    };
    // The schema version decides how everything else reads: check it first, alone.
    let version_problem = match table.get("schema_version") {
        None => Some((
            ErrorKind::SchemaVersion,
            format!("missing; this k3-run reads schema_version = {SCHEMA_VERSION}"),
        )),
        Some(toml::Value::Integer(SCHEMA_VERSION)) => None,
        Some(toml::Value::Integer(v)) => Some((
            ErrorKind::SchemaVersion,
            format!("schema_version = {v} is not supported; this k3-run reads {SCHEMA_VERSION}"),
        )),
        Some(other) => Some((
            ErrorKind::SchemaVersion,
            format!(
                "must be the integer {SCHEMA_VERSION}, found a {}",
                other.type_str()
            ),
        )),
    };
    if let Some((kind, msg)) = version_problem {
        return Err(SpecErrors(vec![SpecError::new(
            kind,
            place("schema_version"),
            msg,
        )]));
    }

    let mut errs = Errors::default();
    let top_fields = struct_fields::<RawManifest>().unwrap_or(&[]);
    for key in table.keys() {
        if !top_fields.contains(&key.as_str()) {
            errs.push(unknown_field(file, "", key, top_fields));
        }
    }
    for &f in top_fields {
        if !table.contains_key(f) && !OPTIONAL_TOP.contains(&f) {
            errs.push(SpecError::new(
                ErrorKind::Missing,
                place(f),
                "required field is missing",
            ));
        }
    }
    for (key, value) in &table {
        check_top(key, value, file, &mut errs);
    }
    if !errs.is_empty() {
        return Err(SpecErrors(errs.0));
    }
    // Every section checked on its own; the whole document now deserialises.
    match serde_path_to_error::deserialize::<_, RawManifest>(toml::Value::Table(table)) {
        Ok(m) => Ok(m),
        Err(e) => Err(SpecErrors(vec![serde_error(file, "", &e)])),
    }
}

/// Check one top-level entry by deserialising it into its raw type.
fn check_top(key: &str, value: &toml::Value, file: &str, errs: &mut Errors) {
    match key {
        "schema_version" => {}
        "name" | "family" | "description" => {
            section::<String>(value, key, file, errs);
        }
        "config" => section::<RawConfig>(value, key, file, errs),
        "layer_map" => section::<RawLayerMap>(value, key, file, errs),
        "activation" => section::<ActivationKind>(value, key, file, errs),
        "attn_res" => section::<RawAttnRes>(value, key, file, errs),
        "kda" => section::<RawKda>(value, key, file, errs),
        "mla" => section::<RawMla>(value, key, file, errs),
        "dense" => section::<RawDense>(value, key, file, errs),
        "moe" => section::<RawMoe>(value, key, file, errs),
        "checkpoint" => section::<RawCheckpoint>(value, key, file, errs),
        "pins" => check_pins(value, file, errs),
        "tensors" => check_tensors(value, file, errs),
        _ => {} // reported as unknown already
    }
}

fn check_pins(value: &toml::Value, file: &str, errs: &mut Errors) {
    let Some(t) = value.as_table() else {
        errs.push(SpecError::new(
            ErrorKind::Invalid,
            mplace(file, "pins"),
            "must be a table of config key path = value",
        ));
        return;
    };
    for (k, v) in t {
        if !pin_value_ok(v) {
            errs.push(SpecError::new(
                ErrorKind::Invalid,
                mplace(file, &format!("pins.\"{k}\"")),
                "a pin must be a string, integer, float, boolean or an array of those",
            ));
        }
        if k.is_empty() || k.split('.').any(str::is_empty) {
            errs.push(SpecError::new(
                ErrorKind::Invalid,
                mplace(file, &format!("pins.\"{k}\"")),
                "a pin key is a dotted config.json key path such as \"text_config.model_type\"",
            ));
        }
    }
}

fn pin_value_ok(v: &toml::Value) -> bool {
    match v {
        toml::Value::String(_)
        | toml::Value::Integer(_)
        | toml::Value::Float(_)
        | toml::Value::Boolean(_) => true,
        toml::Value::Array(a) => a.iter().all(pin_value_ok),
        _ => false,
    }
}

fn check_tensors(value: &toml::Value, file: &str, errs: &mut Errors) {
    let Some(t) = value.as_table() else {
        errs.push(SpecError::new(
            ErrorKind::Invalid,
            mplace(file, "tensors"),
            "must be a table of role = { name = \"...\", dtype = \"...\" }",
        ));
        return;
    };
    for (k, v) in t {
        // Role keys are checked against `TensorRole` in validation (`load`), where the
        // list of known roles is; here only the entry's own shape.
        section::<RawTensor>(v, &format!("tensors.{k}"), file, errs);
    }
}

fn mplace(file: &str, path: &str) -> Place {
    Place::Manifest {
        file: file.to_string(),
        path: path.to_string(),
    }
}

fn join(prefix: &str, key: &str) -> String {
    if prefix.is_empty() {
        key.to_string()
    } else if key.is_empty() {
        prefix.to_string()
    } else {
        format!("{prefix}.{key}")
    }
}

fn unknown_field(file: &str, prefix: &str, key: &str, expected: &[&str]) -> SpecError {
    SpecError::new(
        ErrorKind::UnknownField,
        mplace(file, &join(prefix, key)),
        format!(
            "unknown field `{key}`; expected one of: {}",
            expected.join(", ")
        ),
    )
}

/// Deserialise one section into `T`, first reporting every unknown key (if `T` is a
/// struct), then the first type error with its full path.
fn section<T: DeserializeOwned>(value: &toml::Value, path: &str, file: &str, errs: &mut Errors) {
    let mut value = value.clone();
    if let (Some(fields), toml::Value::Table(t)) = (struct_fields::<T>(), &mut value) {
        let unknown: Vec<String> = t
            .keys()
            .filter(|k| !fields.contains(&k.as_str()))
            .cloned()
            .collect();
        for k in &unknown {
            errs.push(unknown_field(file, path, k, fields));
            t.remove(k);
        }
    }
    if let Err(e) = serde_path_to_error::deserialize::<_, T>(value) {
        errs.push(serde_error(file, path, &e));
    }
}

fn serde_error(
    file: &str,
    prefix: &str,
    e: &serde_path_to_error::Error<toml::de::Error>,
) -> SpecError {
    let inner = e.inner().to_string();
    let inner = inner.trim();
    let sub = e.path().to_string();
    let sub = if sub == "." { String::new() } else { sub };
    let at = join(prefix, &sub);
    // serde reports a missing field at the parent; name the field itself.
    if let Some(name) = inner
        .strip_prefix("missing field `")
        .and_then(|r| r.strip_suffix('`'))
    {
        return SpecError::new(
            ErrorKind::Missing,
            mplace(file, &join(&at, name)),
            "required field is missing",
        );
    }
    SpecError::new(ErrorKind::Invalid, mplace(file, &at), inner.to_string())
}

/// The field names a derived `Deserialize` struct accepts (`None` for non-structs).
///
/// Found by asking `T` to deserialise from a probe that records the `fields` argument of
/// `deserialize_struct` and then fails; serde derives pass the full field list there.
pub fn struct_fields<T: DeserializeOwned>() -> Option<&'static [&'static str]> {
    let mut fields = None;
    let _ = T::deserialize(FieldsProbe(&mut fields));
    fields
}

struct FieldsProbe<'a>(&'a mut Option<&'static [&'static str]>);

impl<'de> serde::Deserializer<'de> for FieldsProbe<'_> {
    type Error = serde::de::value::Error;

    fn deserialize_any<V: serde::de::Visitor<'de>>(self, _v: V) -> Result<V::Value, Self::Error> {
        Err(serde::de::Error::custom("field probe"))
    }

    fn deserialize_struct<V: serde::de::Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        _v: V,
    ) -> Result<V::Value, Self::Error> {
        *self.0 = Some(fields);
        Err(serde::de::Error::custom("field probe"))
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier
        ignored_any
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_lists_struct_fields() {
        assert_eq!(
            struct_fields::<RawMla>(),
            Some(&["q_lora", "output_gate", "latent_norm_eps"][..])
        );
        assert_eq!(struct_fields::<RawDense>(), Some(&[][..]));
        assert_eq!(struct_fields::<String>(), None);
    }

    #[test]
    fn eps_is_a_number_or_the_config_key() {
        let parse = |s: &str| {
            let t: toml::Table = format!("x = {s}").parse().expect("toml");
            EpsRaw::deserialize(t["x"].clone()).map_err(|e| e.to_string())
        };
        assert_eq!(parse("1e-6"), Ok(EpsRaw::Value(1e-6)));
        assert_eq!(
            parse("\"rms_norm_eps\""),
            Ok(EpsRaw::Key(EpsKey::RmsNormEps))
        );
        let e = parse("\"rms_eps\"").expect_err("unknown key");
        assert!(e.contains("rms_norm_eps"), "{e}");
    }
}
