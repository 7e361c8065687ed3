//! The checkpoint's HF `config.json`: strict reader and writer, in the real Kimi K3 layout.
//!
//! Owns: [`ConfigDims`], a typed mirror of the config.json keys the engine uses, named field
//! for field after upstream (`KimiLinearConfig`, `linear_attn_config`, compressed-tensors
//! `quantization_config`); [`read_config`] (JSON text -> `ConfigDims`, every problem reported
//! with its key path and file); [`ConfigDims::to_config_json`] (the writer the synthesiser
//! uses, producing exactly the real layout). Must not: decide block kinds or shapes (that is
//! the manifest + `load`), or default a key the engine needs.
//!
//! Layout followed (the released `moonshotai/Kimi-K3` config.json, see
//! `docs/MODEL.md` §2): top level `architectures`
//! `["KimiK3ForConditionalGeneration"]`, `model_type` `kimi_k3`, token ids,
//! `tie_word_embeddings`, `text_config` (the LM, `model_type` `kimi_linear`) holding
//! `linear_attn_config` and `quantization_config`, and `vision_config` (ignored). In the raw
//! release file `quantization_config` sits only under `text_config`; HF's loaded-config dump
//! and synth_k3.py also put a copy at the top level, which is accepted only if identical.
//! Keys the engine does not use (vision, generation defaults, HF bookkeeping) are ignored.
//!
//! Which keys are required depends on the block kinds the manifest declares
//! ([`ConfigNeeds`]): a K3 manifest needs the MLA keys, a manifest without `[mla]` does not.
//! A needed key that is absent (or null where a value is needed) is an error naming the
//! key path; nothing is defaulted here.

use serde_json::{Map, Value};

use crate::error::{ErrorKind, Errors, Place, SpecError, SpecErrors};

/// Which key groups the manifest needs from config.json.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigNeeds {
    /// Key of the text config object (`"text_config"`), or `""` for the root.
    pub text_config: String,
    pub kda: bool,
    pub mla: bool,
    pub dense: bool,
    pub moe: bool,
    /// `activation_situ_beta` / `activation_situ_linear_beta`.
    pub situ: bool,
    /// `quantization_config` (MXFP4 experts).
    pub quantization: bool,
}

impl ConfigNeeds {
    /// Everything a K3-family config has (used by the writer round trip).
    pub fn k3_all() -> ConfigNeeds {
        ConfigNeeds {
            text_config: "text_config".to_string(),
            kda: true,
            mla: true,
            dense: true,
            moe: true,
            situ: true,
            quantization: true,
        }
    }
}

/// The config.json keys the engine uses. `Option` fields are keys upstream allows to be
/// absent or null; what `None` means is stated on each. Lists of layers are kept as written
/// (1-based upstream); the manifest says how to read them.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ConfigDims {
    /// Top-level `model_type` ("kimi_k3").
    pub model_type: String,
    /// Top-level `architectures`.
    pub architectures: Vec<String>,
    /// `text_config.model_type` ("kimi_linear"); equals `model_type` in a flat layout.
    pub text_model_type: String,
    /// `text_config.architectures`.
    pub text_architectures: Vec<String>,
    pub bos_token_id: Option<u32>,
    /// `eos_token_id` (an integer or a list): the model's stop tokens.
    pub eos_token_ids: Vec<u32>,
    pub pad_token_id: Option<u32>,
    pub media_placeholder_token_id: Option<u32>,
    /// `text_config.tie_word_embeddings`.
    pub tie_word_embeddings: bool,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f64,
    /// "situ" (K3) or "silu" (Kimi-Linear).
    pub hidden_act: String,
    /// SiTU beta (needed when the manifest says `activation = "situ"`).
    pub activation_situ_beta: Option<f64>,
    /// SiTU linear beta; `None` (JSON null) = no soft clip of the up branch.
    pub activation_situ_linear_beta: Option<f64>,
    pub first_k_dense_replace: usize,
    pub moe_layer_freq: usize,
    /// Dense MLP width (needed with `[dense]`).
    pub intermediate_size: Option<usize>,
    pub linear_attn_config: LinearAttnConfig,
    /// The MLA keys (flat in the text config), read when the manifest has `[mla]`.
    pub mla: Option<MlaConfig>,
    /// The MoE keys (flat in the text config), read when the manifest has `[moe]`.
    pub moe: Option<MoeConfig>,
    /// `attn_res_block_size`; `None` = key absent (no Block AttnRes upstream).
    pub attn_res_block_size: Option<usize>,
    /// `num_nextn_predict_layers` (MTP); `None` = absent.
    pub num_nextn_predict_layers: Option<usize>,
    /// Informational only (NoPE).
    pub max_position_embeddings: Option<usize>,
    /// `text_config.quantization_config`; `None` = absent (read when MXFP4 experts).
    pub quantization_config: Option<QuantizationConfig>,
}

/// `text_config.linear_attn_config`.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct LinearAttnConfig {
    /// 1-based KDA layers, as written.
    pub kda_layers: Vec<usize>,
    /// 1-based MLA ("full attention") layers, as written.
    pub full_attn_layers: Vec<usize>,
    /// The KDA dimensions, read when the manifest has `[kda]`.
    pub kda: Option<KdaConfig>,
}

#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct KdaConfig {
    pub num_heads: usize,
    pub head_dim: usize,
    pub short_conv_kernel_size: usize,
    /// `None` = absent (upstream then uses the low-rank output gate).
    pub use_full_rank_gate: Option<bool>,
    /// `None` = absent (upstream then has no lower-bound gate).
    pub gate_lower_bound: Option<f64>,
}

#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct MlaConfig {
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    /// `None` = null/absent: direct `q_proj`.
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// Upstream asserts true; `None` = absent.
    pub mla_use_nope: Option<bool>,
    /// `None` = absent (no output gate upstream).
    pub mla_use_output_gate: Option<bool>,
}

#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub num_experts_per_token: usize,
    pub num_shared_experts: usize,
    pub moe_intermediate_size: usize,
    /// Presence enables latent MoE upstream.
    pub routed_expert_hidden_size: Option<usize>,
    pub latent_moe_use_norm: Option<bool>,
    /// "sigmoid" or "softmax".
    pub moe_router_activation_func: String,
    pub moe_renormalize: bool,
    pub routed_scaling_factor: f64,
    pub use_grouped_topk: Option<bool>,
    pub num_expert_group: usize,
    pub topk_group: usize,
    /// Informational ("noaux_tc").
    pub topk_method: Option<String>,
}

/// The parts of compressed-tensors `quantization_config` the engine checks. The writer adds
/// the remaining fields of the released file with their released values.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct QuantizationConfig {
    /// "compressed-tensors".
    pub quant_method: String,
    /// "mxfp4-pack-quantized".
    pub format: String,
    /// From `config_groups.group_0.weights`: 4.
    pub num_bits: usize,
    /// `weights.type`: "float".
    pub weight_type: String,
    /// `weights.strategy`: "group".
    pub strategy: String,
    /// `weights.group_size`: 32.
    pub group_size: usize,
    pub symmetric: bool,
    /// `weights.scale_dtype`: "torch.uint8".
    pub scale_dtype: String,
    /// Modules left unquantized (regexes, informational).
    pub ignore: Vec<String>,
}

/// Read config.json text. `file` is used in messages. Every problem is reported.
pub fn read_config(text: &str, file: &str, needs: &ConfigNeeds) -> Result<ConfigDims, SpecErrors> {
    let root = parse_config_json(text, file)?;
    read_config_value(&root, file, needs)
}

/// Parse config.json text into a [`Value`]. Besides syntax errors, a key given twice in one
/// object with two different values is refused, naming its path and both values: Python's
/// `json` (and so `transformers`) silently keeps the last one, and which one the checkpoint
/// was written for cannot be known. A key repeated with the same value is accepted.
pub fn parse_config_json(text: &str, file: &str) -> Result<Value, SpecErrors> {
    let syntax = |e: serde_json::Error| {
        SpecErrors(vec![SpecError::new(
            ErrorKind::Syntax,
            Place::File {
                file: file.to_string(),
            },
            format!("not valid JSON: {e}"),
        )])
    };
    let conflicts = std::cell::RefCell::new(Vec::new());
    let mut de = serde_json::Deserializer::from_str(text);
    let root = serde::de::DeserializeSeed::deserialize(
        Checked {
            path: String::new(),
            conflicts: &conflicts,
        },
        &mut de,
    )
    .map_err(syntax)?;
    de.end().map_err(syntax)?;
    let conflicts = conflicts.into_inner();
    if conflicts.is_empty() {
        return Ok(root);
    }
    Err(SpecErrors(
        conflicts
            .into_iter()
            .map(|(key, first, later)| {
                SpecError::new(
                    ErrorKind::Invalid,
                    Place::Config {
                        file: file.to_string(),
                        key,
                    },
                    format!(
                        "given twice in one object with different values ({first}, then \
                         {later}); remove one (Python's json would keep the last without a word)"
                    ),
                )
            })
            .collect(),
    ))
}

/// Builds a [`Value`] like `serde_json`'s own parse, and records `(path, first, later)` for
/// each key given twice in one object with different values (the later one is kept).
struct Checked<'a> {
    path: String,
    conflicts: &'a std::cell::RefCell<Vec<(String, String, String)>>,
}

impl Checked<'_> {
    fn child(&self, key: &str) -> Self {
        Checked {
            path: if self.path.is_empty() {
                key.to_string()
            } else {
                format!("{}.{key}", self.path)
            },
            conflicts: self.conflicts,
        }
    }
}

impl<'de> serde::de::DeserializeSeed<'de> for Checked<'_> {
    type Value = Value;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for Checked<'_> {
    type Value = Value;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        // Non-finite numbers cannot come out of JSON text; `from` maps them to null anyway.
        Ok(Value::from(v))
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_string()))
    }
    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut out = Vec::new();
        while let Some(v) = seq.next_element_seed(Checked {
            path: format!("{}[{}]", self.path, out.len()),
            conflicts: self.conflicts,
        })? {
            out.push(v);
        }
        Ok(Value::Array(out))
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            let v = map.next_value_seed(self.child(&key))?;
            if let Some(first) = out.get(&key)
                && *first != v
            {
                let path = self.child(&key).path;
                self.conflicts
                    .borrow_mut()
                    .push((path, first.to_string(), v.to_string()));
            }
            out.insert(key, v);
        }
        Ok(Value::Object(out))
    }
}

/// Read an already parsed config.json.
pub fn read_config_value(
    root: &Value,
    file: &str,
    needs: &ConfigNeeds,
) -> Result<ConfigDims, SpecErrors> {
    let mut r = Reader {
        file,
        errs: Errors::default(),
    };
    let dims = r.read_all(root, needs);
    if !r.errs.is_empty() {
        return Err(SpecErrors(r.errs.0));
    }
    dims.ok_or_else(|| {
        SpecErrors(vec![SpecError::new(
            ErrorKind::Invalid,
            Place::File {
                file: file.to_string(),
            },
            "config.json could not be read",
        )])
    })
}

/// Look up a dotted key path (`"text_config.linear_attn_config.num_heads"`).
pub fn lookup<'v>(root: &'v Value, path: &str) -> Option<&'v Value> {
    if path.is_empty() {
        return Some(root);
    }
    path.split('.').try_fold(root, |v, k| v.as_object()?.get(k))
}

/// Join a key path prefix and a key.
pub fn key_path(prefix: &str, key: &str) -> String {
    if prefix.is_empty() {
        key.to_string()
    } else {
        format!("{prefix}.{key}")
    }
}

struct Reader<'f> {
    file: &'f str,
    errs: Errors,
}

/// An object being read, with its key path from the root.
#[derive(Clone, Copy)]
struct Obj<'v, 'p> {
    map: &'v Map<String, Value>,
    path: &'p str,
}

impl Reader<'_> {
    fn place(&self, key: &str) -> Place {
        Place::Config {
            file: self.file.to_string(),
            key: key.to_string(),
        }
    }

    fn err(&mut self, kind: ErrorKind, key: &str, msg: impl Into<String>) {
        let p = self.place(key);
        self.errs.push(SpecError::new(kind, p, msg));
    }

    /// The raw value of `key`: `None` if absent or null.
    fn raw<'v>(&self, o: Obj<'v, '_>, key: &str) -> Option<&'v Value> {
        o.map.get(key).filter(|v| !v.is_null())
    }

    fn missing(&mut self, o: Obj<'_, '_>, key: &str) {
        let kp = key_path(o.path, key);
        let msg = if o.map.contains_key(key) {
            "is null, but k3-run needs a value"
        } else {
            "required key is missing"
        };
        self.err(ErrorKind::Missing, &kp, msg);
    }

    /// An optional typed value: absent or null -> `None`; present but not convertible -> an
    /// `Invalid` error "must be {what}, found {value}" at its key path, and `None`.
    fn opt_as<T>(
        &mut self,
        o: Obj<'_, '_>,
        key: &str,
        what: &str,
        conv: impl Fn(&Value) -> Option<T>,
    ) -> Option<T> {
        let v = self.raw(o, key)?;
        let t = conv(v);
        if t.is_none() {
            let kp = key_path(o.path, key);
            self.err(
                ErrorKind::Invalid,
                &kp,
                format!("must be {what}, found {v}"),
            );
        }
        t
    }

    /// A required typed value: absent or null is a `Missing` error naming the key path.
    fn req_as<T>(
        &mut self,
        o: Obj<'_, '_>,
        key: &str,
        what: &str,
        conv: impl Fn(&Value) -> Option<T>,
    ) -> Option<T> {
        if self.raw(o, key).is_none() {
            self.missing(o, key);
            return None;
        }
        self.opt_as(o, key, what, conv)
    }

    fn opt_usize(&mut self, o: Obj<'_, '_>, key: &str) -> Option<usize> {
        self.opt_as(o, key, "a non-negative integer", as_usize)
    }

    fn req_usize(&mut self, o: Obj<'_, '_>, key: &str) -> Option<usize> {
        self.req_as(o, key, "a non-negative integer", as_usize)
    }

    fn opt_f64(&mut self, o: Obj<'_, '_>, key: &str) -> Option<f64> {
        self.opt_as(o, key, "a number", as_finite_f64)
    }

    fn req_f64(&mut self, o: Obj<'_, '_>, key: &str) -> Option<f64> {
        self.req_as(o, key, "a number", as_finite_f64)
    }

    fn opt_bool(&mut self, o: Obj<'_, '_>, key: &str) -> Option<bool> {
        self.opt_as(o, key, "true or false", Value::as_bool)
    }

    fn req_bool(&mut self, o: Obj<'_, '_>, key: &str) -> Option<bool> {
        self.req_as(o, key, "true or false", Value::as_bool)
    }

    fn opt_str(&mut self, o: Obj<'_, '_>, key: &str) -> Option<String> {
        self.opt_as(o, key, "a string", |v| v.as_str().map(str::to_string))
    }

    fn req_str(&mut self, o: Obj<'_, '_>, key: &str) -> Option<String> {
        self.req_as(o, key, "a string", |v| v.as_str().map(str::to_string))
    }

    fn req_list<T>(
        &mut self,
        o: Obj<'_, '_>,
        key: &str,
        what: &str,
        item: impl Fn(&Value) -> Option<T>,
    ) -> Option<Vec<T>> {
        let kp = key_path(o.path, key);
        let Some(v) = self.raw(o, key) else {
            self.missing(o, key);
            return None;
        };
        let Some(a) = v.as_array() else {
            self.err(ErrorKind::Invalid, &kp, format!("must be a list of {what}"));
            return None;
        };
        let mut out = Vec::with_capacity(a.len());
        for (i, x) in a.iter().enumerate() {
            match item(x) {
                Some(t) => out.push(t),
                None => {
                    self.err(
                        ErrorKind::Invalid,
                        &format!("{kp}[{i}]"),
                        format!("must be {what}, found {x}"),
                    );
                    return None;
                }
            }
        }
        Some(out)
    }

    fn req_obj<'v, 'p>(&mut self, o: Obj<'v, '_>, key: &str, path: &'p str) -> Option<Obj<'v, 'p>> {
        let Some(v) = self.raw(o, key) else {
            self.missing(o, key);
            return None;
        };
        match v.as_object() {
            Some(map) => Some(Obj { map, path }),
            None => {
                self.err(ErrorKind::Invalid, path, "must be an object");
                None
            }
        }
    }

    fn token_id(&mut self, o: Obj<'_, '_>, key: &str) -> Option<u32> {
        let v = self.raw(o, key)?;
        match v.as_u64().and_then(|n| u32::try_from(n).ok()) {
            Some(n) => Some(n),
            None => {
                let kp = key_path(o.path, key);
                self.err(
                    ErrorKind::Invalid,
                    &kp,
                    format!("must be a token id, found {v}"),
                );
                None
            }
        }
    }

    /// `eos_token_id`: an integer or a non-empty list of integers.
    fn eos(&mut self, o: Obj<'_, '_>) -> Option<Vec<u32>> {
        let kp = key_path(o.path, "eos_token_id");
        let Some(v) = self.raw(o, "eos_token_id") else {
            self.missing(o, "eos_token_id");
            return None;
        };
        let one = |x: &Value| x.as_u64().and_then(|n| u32::try_from(n).ok());
        let ids = match v {
            Value::Array(a) => a.iter().map(one).collect::<Option<Vec<u32>>>(),
            x => one(x).map(|n| vec![n]),
        };
        match ids {
            Some(ids) if !ids.is_empty() => Some(ids),
            _ => {
                self.err(
                    ErrorKind::Invalid,
                    &kp,
                    format!("must be a token id or a non-empty list of token ids, found {v}"),
                );
                None
            }
        }
    }

    fn read_all(&mut self, root_v: &Value, needs: &ConfigNeeds) -> Option<ConfigDims> {
        let Some(root_map) = root_v.as_object() else {
            self.err(
                ErrorKind::Invalid,
                "",
                "config.json must hold a JSON object",
            );
            return None;
        };
        let root = Obj {
            map: root_map,
            path: "",
        };
        let tpath = needs.text_config.as_str();
        let text = if tpath.is_empty() {
            Some(root)
        } else {
            self.req_obj(root, tpath, tpath)
        };

        let model_type = self.req_str(root, "model_type");
        let str_item = |x: &Value| x.as_str().map(str::to_string);
        let architectures = self.req_list(root, "architectures", "strings", str_item);
        let eos_token_ids = self.eos(root);
        let bos_token_id = self.token_id(root, "bos_token_id");
        let pad_token_id = self.token_id(root, "pad_token_id");
        let media_placeholder_token_id = self.token_id(root, "media_placeholder_token_id");

        let text = text?;
        let (text_model_type, text_architectures) = if tpath.is_empty() {
            (model_type.clone(), architectures.clone())
        } else {
            (
                self.req_str(text, "model_type"),
                self.req_list(text, "architectures", "strings", str_item),
            )
        };
        if !tpath.is_empty() {
            self.same_at_both_levels(root, text, "eos_token_id");
            self.same_at_both_levels(root, text, "tie_word_embeddings");
            self.same_at_both_levels(root, text, "quantization_config");
            if root.map.contains_key("quantization_config")
                && !text.map.contains_key("quantization_config")
            {
                let kp = key_path(tpath, "quantization_config");
                self.err(
                    ErrorKind::Invalid,
                    "quantization_config",
                    format!(
                        "found at the top level only; the released K3 layout has it under `{kp}`"
                    ),
                );
            }
        }
        let tie_word_embeddings = self.req_bool(text, "tie_word_embeddings");
        let hidden_size = self.req_usize(text, "hidden_size");
        let num_hidden_layers = self.req_usize(text, "num_hidden_layers");
        let vocab_size = self.req_usize(text, "vocab_size");
        let rms_norm_eps = self.req_f64(text, "rms_norm_eps");
        let hidden_act = self.req_str(text, "hidden_act");
        let (activation_situ_beta, activation_situ_linear_beta) = if needs.situ {
            let b = self.req_f64(text, "activation_situ_beta");
            if !text.map.contains_key("activation_situ_linear_beta") {
                self.missing(text, "activation_situ_linear_beta");
            }
            (b, self.opt_f64(text, "activation_situ_linear_beta"))
        } else {
            (None, None)
        };
        let first_k_dense_replace = self.req_usize(text, "first_k_dense_replace");
        let moe_layer_freq = self.req_usize(text, "moe_layer_freq");
        let intermediate_size = if needs.dense {
            self.req_usize(text, "intermediate_size")
        } else {
            None
        };
        let lin_path = key_path(tpath, "linear_attn_config");
        let linear_attn_config = self
            .req_obj(text, "linear_attn_config", &lin_path)
            .and_then(|lin| self.linear_attn(lin, needs.kda));
        let mla = if needs.mla { self.mla(text) } else { None };
        let moe = if needs.moe { self.moe(text) } else { None };
        let attn_res_block_size = self.opt_usize(text, "attn_res_block_size");
        let num_nextn_predict_layers = self.opt_usize(text, "num_nextn_predict_layers");
        let max_position_embeddings = self.opt_usize(text, "max_position_embeddings");
        let q_path = key_path(tpath, "quantization_config");
        let quantization_config =
            if needs.quantization && text.map.contains_key("quantization_config") {
                self.req_obj(text, "quantization_config", &q_path)
                    .and_then(|q| self.quantization(q))
            } else {
                None
            };
        if (needs.mla && mla.is_none()) || (needs.moe && moe.is_none()) {
            return None;
        }
        Some(ConfigDims {
            model_type: model_type?,
            architectures: architectures?,
            text_model_type: text_model_type?,
            text_architectures: text_architectures?,
            bos_token_id,
            eos_token_ids: eos_token_ids?,
            pad_token_id,
            media_placeholder_token_id,
            tie_word_embeddings: tie_word_embeddings?,
            hidden_size: hidden_size?,
            num_hidden_layers: num_hidden_layers?,
            vocab_size: vocab_size?,
            rms_norm_eps: rms_norm_eps?,
            hidden_act: hidden_act?,
            activation_situ_beta,
            activation_situ_linear_beta,
            first_k_dense_replace: first_k_dense_replace?,
            moe_layer_freq: moe_layer_freq?,
            intermediate_size,
            linear_attn_config: linear_attn_config?,
            mla,
            moe,
            attn_res_block_size,
            num_nextn_predict_layers,
            max_position_embeddings,
            quantization_config,
        })
    }

    /// A key present both at the root and in the text config must agree.
    fn same_at_both_levels(&mut self, root: Obj<'_, '_>, text: Obj<'_, '_>, key: &str) {
        if let (Some(a), Some(b)) = (root.map.get(key), text.map.get(key))
            && a != b
        {
            let pa = self.place(key);
            let pb = self.place(&key_path(text.path, key));
            self.errs.push(SpecError::contradiction(
                pa,
                pb,
                "the top-level copy differs from the text config's",
            ));
        }
    }

    fn linear_attn(&mut self, lin: Obj<'_, '_>, kda: bool) -> Option<LinearAttnConfig> {
        let layer = |x: &Value| x.as_u64().and_then(|n| usize::try_from(n).ok());
        let kda_layers = self.req_list(lin, "kda_layers", "layer numbers", layer);
        let full_attn_layers = self.req_list(lin, "full_attn_layers", "layer numbers", layer);
        let kda = if kda {
            let num_heads = self.req_usize(lin, "num_heads");
            let head_dim = self.req_usize(lin, "head_dim");
            let conv = self.req_usize(lin, "short_conv_kernel_size");
            let full = self.opt_bool(lin, "use_full_rank_gate");
            let lb = self.opt_f64(lin, "gate_lower_bound");
            Some(KdaConfig {
                num_heads: num_heads?,
                head_dim: head_dim?,
                short_conv_kernel_size: conv?,
                use_full_rank_gate: full,
                gate_lower_bound: lb,
            })
        } else {
            None
        };
        Some(LinearAttnConfig {
            kda_layers: kda_layers?,
            full_attn_layers: full_attn_layers?,
            kda,
        })
    }

    fn mla(&mut self, t: Obj<'_, '_>) -> Option<MlaConfig> {
        let num_attention_heads = self.req_usize(t, "num_attention_heads");
        let num_key_value_heads = self.req_usize(t, "num_key_value_heads");
        if !t.map.contains_key("q_lora_rank") {
            // null is meaningful (direct q_proj); absence is not a statement.
            self.missing(t, "q_lora_rank");
        }
        let q_lora_rank = self.opt_usize(t, "q_lora_rank");
        let kv_lora_rank = self.req_usize(t, "kv_lora_rank");
        let qk_nope_head_dim = self.req_usize(t, "qk_nope_head_dim");
        let qk_rope_head_dim = self.req_usize(t, "qk_rope_head_dim");
        let v_head_dim = self.req_usize(t, "v_head_dim");
        let mla_use_nope = self.opt_bool(t, "mla_use_nope");
        let mla_use_output_gate = self.opt_bool(t, "mla_use_output_gate");
        Some(MlaConfig {
            num_attention_heads: num_attention_heads?,
            num_key_value_heads: num_key_value_heads?,
            q_lora_rank,
            kv_lora_rank: kv_lora_rank?,
            qk_nope_head_dim: qk_nope_head_dim?,
            qk_rope_head_dim: qk_rope_head_dim?,
            v_head_dim: v_head_dim?,
            mla_use_nope,
            mla_use_output_gate,
        })
    }

    fn moe(&mut self, t: Obj<'_, '_>) -> Option<MoeConfig> {
        let num_experts = self.req_usize(t, "num_experts");
        let num_experts_per_token = self.req_usize(t, "num_experts_per_token");
        let num_shared_experts = self.req_usize(t, "num_shared_experts");
        let moe_intermediate_size = self.req_usize(t, "moe_intermediate_size");
        let routed_expert_hidden_size = self.opt_usize(t, "routed_expert_hidden_size");
        let latent_moe_use_norm = self.opt_bool(t, "latent_moe_use_norm");
        let act = self.req_str(t, "moe_router_activation_func");
        let renorm = self.req_bool(t, "moe_renormalize");
        let scale = self.req_f64(t, "routed_scaling_factor");
        let use_grouped_topk = self.opt_bool(t, "use_grouped_topk");
        let num_expert_group = self.req_usize(t, "num_expert_group");
        let topk_group = self.req_usize(t, "topk_group");
        let topk_method = self.opt_str(t, "topk_method");
        Some(MoeConfig {
            num_experts: num_experts?,
            num_experts_per_token: num_experts_per_token?,
            num_shared_experts: num_shared_experts?,
            moe_intermediate_size: moe_intermediate_size?,
            routed_expert_hidden_size,
            latent_moe_use_norm,
            moe_router_activation_func: act?,
            moe_renormalize: renorm?,
            routed_scaling_factor: scale?,
            use_grouped_topk,
            num_expert_group: num_expert_group?,
            topk_group: topk_group?,
            topk_method,
        })
    }

    fn quantization(&mut self, q: Obj<'_, '_>) -> Option<QuantizationConfig> {
        let quant_method = self.req_str(q, "quant_method");
        let format = self.req_str(q, "format");
        let str_item = |x: &Value| x.as_str().map(str::to_string);
        let ignore = if q.map.contains_key("ignore") {
            self.req_list(q, "ignore", "strings", str_item)
        } else {
            Some(Vec::new())
        };
        let groups_path = key_path(q.path, "config_groups");
        let groups = self.req_obj(q, "config_groups", &groups_path)?;
        if groups.map.len() != 1 {
            self.err(
                ErrorKind::Unsupported,
                &groups_path,
                format!(
                    "k3-run reads exactly one quantization group (the released file has \
                     `group_0`), found {}",
                    groups.map.len()
                ),
            );
            return None;
        }
        let (gname, _) = groups.map.iter().next()?;
        let gpath = key_path(&groups_path, gname);
        let group = self.req_obj(groups, gname, &gpath)?;
        let wpath = key_path(&gpath, "weights");
        let w = self.req_obj(group, "weights", &wpath)?;
        let num_bits = self.req_usize(w, "num_bits");
        let weight_type = self.req_str(w, "type");
        let strategy = self.req_str(w, "strategy");
        let group_size = self.req_usize(w, "group_size");
        let symmetric = self.req_bool(w, "symmetric");
        let scale_dtype = self.req_str(w, "scale_dtype");
        Some(QuantizationConfig {
            quant_method: quant_method?,
            format: format?,
            num_bits: num_bits?,
            weight_type: weight_type?,
            strategy: strategy?,
            group_size: group_size?,
            symmetric: symmetric?,
            scale_dtype: scale_dtype?,
            ignore: ignore?,
        })
    }
}

// ------------------------------------------------------------------------------- writer --

/// Dimensions of a K3-family model, for building a synthetic [`ConfigDims`] with
/// [`ConfigDims::k3_family`]. Names follow `synth_k3.py`'s options.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct K3Shape {
    pub hidden: usize,
    pub layers: usize,
    /// `attn_res_block_size`.
    pub block: usize,
    pub kda_heads: usize,
    pub kda_head_dim: usize,
    pub conv_k: usize,
    pub mla_heads: usize,
    pub q_lora: usize,
    pub kv_lora: usize,
    pub qk_nope: usize,
    pub qk_rope: usize,
    pub v_head: usize,
    pub experts: usize,
    pub topk: usize,
    pub shared: usize,
    pub moe_inter: usize,
    pub latent: usize,
    pub dense_inter: usize,
    pub first_dense: usize,
    pub vocab: usize,
}

/// K3's layer-map rule (0-based): MLA at every 4th layer (3, 7, ...) plus the final layer,
/// KDA elsewhere. Returns (kda, mla). Used to write synthetic configs; loading always reads
/// the lists from config.json.
pub fn k3_layer_map(n_layers: usize) -> (Vec<usize>, Vec<usize>) {
    let is_mla = |l: usize| (l + 1).is_multiple_of(4) || l + 1 == n_layers;
    let mla = (0..n_layers).filter(|&l| is_mla(l)).collect();
    let kda = (0..n_layers).filter(|&l| !is_mla(l)).collect();
    (kda, mla)
}

/// The `ignore` list of the released `quantization_config`.
pub const K3_QUANT_IGNORE: &[&str] = &[
    "re:.*self_attn.*",
    "re:.*shared_experts.*",
    "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
    "re:.*lm_head.*",
    "re:.*vision_tower.*",
    "re:.*mm_projector.*",
];

impl ConfigDims {
    /// A K3-family config with the given dimensions and every other value as in the
    /// release (SiTU 4 / 25, sigmoid router with renormalisation and scale 1.0, eps 1e-5,
    /// KDA lower-bound gate -5 with full-rank output gate, gated NoPE MLA, MXFP4 group 32,
    /// K3's layer-map rule). Token ids follow synth_k3.py's rule (bos = vocab-256,
    /// eos = vocab-254 for vocab > 512, else 1 and 2; pad = vocab-1); override as needed.
    pub fn k3_family(s: &K3Shape) -> ConfigDims {
        let (kda, mla) = k3_layer_map(s.layers);
        let big = s.vocab > 512;
        ConfigDims {
            model_type: "kimi_k3".into(),
            architectures: vec!["KimiK3ForConditionalGeneration".into()],
            text_model_type: "kimi_linear".into(),
            text_architectures: vec!["KimiLinearForCausalLM".into()],
            bos_token_id: Some(if big { s.vocab as u32 - 256 } else { 1 }),
            eos_token_ids: vec![if big { s.vocab as u32 - 254 } else { 2 }],
            pad_token_id: Some(s.vocab.saturating_sub(1) as u32),
            media_placeholder_token_id: Some(s.vocab.saturating_sub(3) as u32),
            tie_word_embeddings: false,
            hidden_size: s.hidden,
            num_hidden_layers: s.layers,
            vocab_size: s.vocab,
            rms_norm_eps: 1e-5,
            hidden_act: "situ".into(),
            activation_situ_beta: Some(4.0),
            activation_situ_linear_beta: Some(25.0),
            first_k_dense_replace: s.first_dense,
            moe_layer_freq: 1,
            intermediate_size: Some(s.dense_inter),
            linear_attn_config: LinearAttnConfig {
                kda_layers: kda.iter().map(|l| l + 1).collect(),
                full_attn_layers: mla.iter().map(|l| l + 1).collect(),
                kda: Some(KdaConfig {
                    num_heads: s.kda_heads,
                    head_dim: s.kda_head_dim,
                    short_conv_kernel_size: s.conv_k,
                    use_full_rank_gate: Some(true),
                    gate_lower_bound: Some(-5.0),
                }),
            },
            mla: Some(MlaConfig {
                num_attention_heads: s.mla_heads,
                num_key_value_heads: s.mla_heads,
                q_lora_rank: Some(s.q_lora),
                kv_lora_rank: s.kv_lora,
                qk_nope_head_dim: s.qk_nope,
                qk_rope_head_dim: s.qk_rope,
                v_head_dim: s.v_head,
                mla_use_nope: Some(true),
                mla_use_output_gate: Some(true),
            }),
            moe: Some(MoeConfig {
                num_experts: s.experts,
                num_experts_per_token: s.topk,
                num_shared_experts: s.shared,
                moe_intermediate_size: s.moe_inter,
                routed_expert_hidden_size: Some(s.latent),
                latent_moe_use_norm: Some(true),
                moe_router_activation_func: "sigmoid".into(),
                moe_renormalize: true,
                routed_scaling_factor: 1.0,
                use_grouped_topk: Some(true),
                num_expert_group: 1,
                topk_group: 1,
                topk_method: Some("noaux_tc".into()),
            }),
            attn_res_block_size: Some(s.block),
            num_nextn_predict_layers: Some(0),
            max_position_embeddings: Some(1_048_576),
            quantization_config: Some(QuantizationConfig {
                quant_method: "compressed-tensors".into(),
                format: "mxfp4-pack-quantized".into(),
                num_bits: 4,
                weight_type: "float".into(),
                strategy: "group".into(),
                group_size: 32,
                symmetric: true,
                scale_dtype: "torch.uint8".into(),
                ignore: K3_QUANT_IGNORE.iter().map(|s| s.to_string()).collect(),
            }),
        }
    }

    /// config.json text in the released K3 layout (nested `text_config` holding
    /// `linear_attn_config` and `quantization_config`; keys sorted like HF writes them;
    /// two-space indent; trailing newline). `None` options are written as absent keys,
    /// except `q_lora_rank` and `activation_situ_linear_beta`, written as null (their
    /// null is meaningful).
    pub fn to_config_json(&self) -> String {
        let mut text = Obj2::default();
        text.put("model_type", self.text_model_type.as_str());
        text.put("architectures", self.text_architectures.clone());
        text.put("hidden_size", self.hidden_size);
        text.put("num_hidden_layers", self.num_hidden_layers);
        text.put("vocab_size", self.vocab_size);
        text.put("rms_norm_eps", self.rms_norm_eps);
        text.put("hidden_act", self.hidden_act.as_str());
        text.opt("activation_situ_beta", self.activation_situ_beta);
        if self.activation_situ_beta.is_some() || self.activation_situ_linear_beta.is_some() {
            text.put(
                "activation_situ_linear_beta",
                self.activation_situ_linear_beta,
            );
        }
        text.put("first_k_dense_replace", self.first_k_dense_replace);
        text.put("moe_layer_freq", self.moe_layer_freq);
        text.opt("intermediate_size", self.intermediate_size);
        text.put("tie_word_embeddings", self.tie_word_embeddings);
        text.opt("bos_token_id", self.bos_token_id);
        text.put("eos_token_id", eos_value(&self.eos_token_ids));
        text.opt("pad_token_id", self.pad_token_id);
        text.put("dtype", "bfloat16");
        text.opt("attn_res_block_size", self.attn_res_block_size);
        text.opt("num_nextn_predict_layers", self.num_nextn_predict_layers);
        text.opt("max_position_embeddings", self.max_position_embeddings);
        text.put("linear_attn_config", self.linear_attn_config.to_value());
        if let Some(m) = &self.mla {
            m.write(&mut text);
        }
        if let Some(m) = &self.moe {
            m.write(&mut text);
        }
        if let Some(q) = &self.quantization_config {
            text.put("quantization_config", q.to_value());
        }

        let mut root = Obj2::default();
        root.put("architectures", self.architectures.clone());
        root.put("model_type", self.model_type.as_str());
        root.opt("bos_token_id", self.bos_token_id);
        root.put("eos_token_id", eos_value(&self.eos_token_ids));
        root.opt("pad_token_id", self.pad_token_id);
        root.opt(
            "media_placeholder_token_id",
            self.media_placeholder_token_id,
        );
        root.put("tie_word_embeddings", self.tie_word_embeddings);
        root.put("dtype", "bfloat16");
        root.put("text_config", text.into_value());
        let mut s = serde_json::to_string_pretty(&root.into_value())
            .expect("serialising a serde_json::Value cannot fail");
        s.push('\n');
        s
    }
}

fn eos_value(ids: &[u32]) -> Value {
    match ids {
        [one] => Value::from(*one),
        many => Value::from(many.to_vec()),
    }
}

/// A JSON object built in sorted key order (independent of serde_json's `preserve_order`).
#[derive(Default)]
struct Obj2(std::collections::BTreeMap<String, Value>);

impl Obj2 {
    fn put(&mut self, k: &str, v: impl Into<Value>) {
        self.0.insert(k.to_string(), v.into());
    }
    fn opt<T: Into<Value>>(&mut self, k: &str, v: Option<T>) {
        if let Some(v) = v {
            self.put(k, v);
        }
    }
    fn into_value(self) -> Value {
        Value::Object(self.0.into_iter().collect())
    }
}

impl LinearAttnConfig {
    fn to_value(&self) -> Value {
        let mut o = Obj2::default();
        o.put("kda_layers", self.kda_layers.clone());
        o.put("full_attn_layers", self.full_attn_layers.clone());
        if let Some(k) = &self.kda {
            o.put("num_heads", k.num_heads);
            o.put("head_dim", k.head_dim);
            o.put("short_conv_kernel_size", k.short_conv_kernel_size);
            o.opt("use_full_rank_gate", k.use_full_rank_gate);
            o.opt("gate_lower_bound", k.gate_lower_bound);
        }
        o.into_value()
    }
}

impl MlaConfig {
    fn write(&self, t: &mut Obj2) {
        t.put("num_attention_heads", self.num_attention_heads);
        t.put("num_key_value_heads", self.num_key_value_heads);
        t.put("q_lora_rank", self.q_lora_rank);
        t.put("kv_lora_rank", self.kv_lora_rank);
        t.put("qk_nope_head_dim", self.qk_nope_head_dim);
        t.put("qk_rope_head_dim", self.qk_rope_head_dim);
        t.put("v_head_dim", self.v_head_dim);
        t.opt("mla_use_nope", self.mla_use_nope);
        t.opt("mla_use_output_gate", self.mla_use_output_gate);
    }
}

impl MoeConfig {
    fn write(&self, t: &mut Obj2) {
        t.put("num_experts", self.num_experts);
        t.put("num_experts_per_token", self.num_experts_per_token);
        t.put("num_shared_experts", self.num_shared_experts);
        t.put("moe_intermediate_size", self.moe_intermediate_size);
        t.opt("routed_expert_hidden_size", self.routed_expert_hidden_size);
        t.opt("latent_moe_use_norm", self.latent_moe_use_norm);
        t.put(
            "moe_router_activation_func",
            self.moe_router_activation_func.as_str(),
        );
        t.put("moe_renormalize", self.moe_renormalize);
        t.put("routed_scaling_factor", self.routed_scaling_factor);
        t.opt("use_grouped_topk", self.use_grouped_topk);
        t.put("num_expert_group", self.num_expert_group);
        t.put("topk_group", self.topk_group);
        t.opt("topk_method", self.topk_method.clone());
    }
}

impl QuantizationConfig {
    /// The released file's structure (`config_groups.group_0`), with this config's values.
    fn to_value(&self) -> Value {
        let mut w = Obj2::default();
        w.put("actorder", Value::Null);
        w.put("block_structure", Value::Null);
        w.put("dynamic", false);
        w.put("group_size", self.group_size);
        w.put("num_bits", self.num_bits);
        w.put("observer", "minmax");
        w.put("observer_kwargs", Value::Object(Map::new()));
        w.put("scale_dtype", self.scale_dtype.as_str());
        w.put("strategy", self.strategy.as_str());
        w.put("symmetric", self.symmetric);
        w.put("type", self.weight_type.as_str());
        w.put("zp_dtype", Value::Null);
        let mut g = Obj2::default();
        g.put("format", self.format.as_str());
        g.put("input_activations", Value::Null);
        g.put("output_activations", Value::Null);
        g.put("targets", vec!["Linear"]);
        g.put("weights", w.into_value());
        let mut groups = Obj2::default();
        groups.put("group_0", g.into_value());
        let mut q = Obj2::default();
        q.put("config_groups", groups.into_value());
        q.put("format", self.format.as_str());
        q.put("global_compression_ratio", Value::Null);
        q.put("ignore", self.ignore.clone());
        q.put("kv_cache_scheme", Value::Null);
        q.put("quant_method", self.quant_method.as_str());
        q.put("quantization_status", "compressed");
        q.into_value()
    }
}

fn as_usize(v: &Value) -> Option<usize> {
    v.as_u64().and_then(|n| usize::try_from(n).ok())
}

fn as_finite_f64(v: &Value) -> Option<f64> {
    v.as_f64().filter(|x| x.is_finite())
}
