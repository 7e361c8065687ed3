//! Validation: manifest + config.json -> [`ModelSpec`] (stage two of the two-stage config).
//!
//! Owns: every semantic check (the manifest's own consistency, pins, every manifest/config
//! contradiction, ranges, what k3-run does not implement), the layer map, and the call into
//! `inventory` that lays out `ModelSpec::tensors`. Every problem found is reported together,
//! each naming its TOML path and/or config.json key and file. Must not: touch tensor data,
//! infer a layer's kind from which tensors exist (the kind comes from config.json lists read
//! the way the manifest says), or invent a default for a key the engine needs.
//!
//! Stages: (1) manifest semantics + pins + reading config.json, all problems collected;
//! (2) if those pass, cross-checks between the two, all collected; (3) the inventory.
//! Later stages need the earlier ones' values, so a failing stage stops there.

use std::path::Path;

use serde_json::Value;

use crate::error::{ErrorKind, Errors, Place, SpecError, SpecErrors};
use crate::hf_config::{self, ConfigDims, ConfigNeeds, key_path, lookup};
use crate::inventory::{self, ALogLayout, BlockRoles, Template, Templates};
use crate::manifest::{
    self, ALogLenRule, ALogShape, ActivationKind, EpsKey, EpsRaw, ExpertFormatKind, KdaGateKind,
    LayerListKey, OutputGateKind, RankRule, RawManifest,
};
use crate::spec::{
    Activation, AttnKind, AttnResSpec, DType, DenseMlpSpec, ExpertFormat, FfnKind, KdaGateSpec,
    KdaSpec, LayerSpec, MlaSpec, ModelSpec, MoeSpec, RoleScope, RouterScoring, TensorIndex,
    TensorRole,
};

/// `std::fs::read_to_string` of a regular file only: a FIFO or a device named as a config
/// is an error, not a read that blocks (a FIFO without a writer) or never ends (`/dev/zero`).
pub fn read_regular_file(p: &Path) -> std::io::Result<String> {
    let bytes = read_regular_bytes(p)?;
    String::from_utf8(bytes)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e.utf8_error()))
}

/// `std::fs::read` of a regular file only (see [`read_regular_file`]); the error says what the
/// path is instead ("is a directory, not a regular file").
pub fn read_regular_bytes(p: &Path) -> std::io::Result<Vec<u8>> {
    let t = std::fs::metadata(p)?.file_type();
    if !t.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{}, not a regular file", describe_file_type(t)),
        ));
    }
    std::fs::read(p)
}

/// "is a directory", "is a FIFO (named pipe)", ... for a path that is not a regular file.
pub fn describe_file_type(t: std::fs::FileType) -> &'static str {
    if t.is_dir() {
        return "is a directory";
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return "is a FIFO (named pipe)";
        } else if t.is_char_device() {
            return "is a character device";
        } else if t.is_block_device() {
            return "is a block device";
        } else if t.is_socket() {
            return "is a socket";
        }
    }
    "is not a regular file"
}

/// Load a model description: the manifest TOML and the checkpoint's config.json.
pub fn load_spec(manifest_path: &Path, config_json_path: &Path) -> Result<ModelSpec, SpecErrors> {
    let mfile = manifest_path.display().to_string();
    let cfile = config_json_path.display().to_string();
    let read = |p: &Path, f: &str| {
        read_regular_file(p).map_err(|e| {
            SpecError::new(
                ErrorKind::Io,
                Place::File {
                    file: f.to_string(),
                },
                format!("cannot read: {e}"),
            )
        })
    };
    match (read(manifest_path, &mfile), read(config_json_path, &cfile)) {
        (Ok(m), Ok(c)) => load_spec_from_str(&m, &mfile, &c, &cfile),
        (m, c) => Err(SpecErrors(
            [m.err(), c.err()].into_iter().flatten().collect(),
        )),
    }
}

/// Read and parse a manifest file (stage one only).
pub fn load_manifest(manifest_path: &Path) -> Result<RawManifest, SpecErrors> {
    let file = manifest_path.display().to_string();
    let text = read_regular_file(manifest_path).map_err(|e| {
        SpecErrors(vec![SpecError::new(
            ErrorKind::Io,
            Place::File { file: file.clone() },
            format!("cannot read: {e}"),
        )])
    })?;
    manifest::parse_manifest(&text, &file)
}

/// [`load_spec`] on texts; `manifest_file` / `config_file` name them in messages.
pub fn load_spec_from_str(
    manifest_toml: &str,
    manifest_file: &str,
    config_json: &str,
    config_file: &str,
) -> Result<ModelSpec, SpecErrors> {
    let m = manifest::parse_manifest(manifest_toml, manifest_file);
    let c = hf_config::parse_config_json(config_json, config_file);
    match (m, c) {
        (Ok(m), Ok(c)) => build_spec(&m, manifest_file, &c, config_file),
        (m, c) => Err(SpecErrors(
            [m.err(), c.err()]
                .into_iter()
                .flatten()
                .flat_map(|e| e.0)
                .collect(),
        )),
    }
}

/// The config.json key groups a manifest needs.
pub fn config_needs(m: &RawManifest) -> ConfigNeeds {
    ConfigNeeds {
        text_config: m.config.text_config.clone(),
        kda: m.kda.is_some(),
        mla: m.mla.is_some(),
        dense: m.dense.is_some(),
        moe: m.moe.is_some(),
        situ: m.activation == ActivationKind::Situ,
        quantization: m
            .moe
            .as_ref()
            .is_some_and(|x| x.expert_format == ExpertFormatKind::Mxfp4),
    }
}

/// Validate a parsed manifest against a parsed config.json and build the spec.
pub fn build_spec(
    m: &RawManifest,
    manifest_file: &str,
    config: &Value,
    config_file: &str,
) -> Result<ModelSpec, SpecErrors> {
    let cx = Cx {
        mfile: manifest_file,
        cfile: config_file,
        tpath: &m.config.text_config,
    };
    let mut errs = Errors::default();
    let templates = check_manifest(m, &cx, &mut errs);
    check_pins(m, config, &cx, &mut errs);
    let dims = match hf_config::read_config_value(config, config_file, &config_needs(m)) {
        Ok(d) => Some(d),
        Err(e) => {
            errs.extend(e);
            None
        }
    };
    let dims = match dims {
        Some(d) if errs.is_empty() => d,
        _ => return Err(SpecErrors(errs.0)),
    };
    let mut spec = assemble(m, &dims, config, &cx, &mut errs);
    errs.check()?;
    let n_moe = spec.layers_with_ffn(FfnKind::Moe).len();
    let n_experts = spec.moe.as_ref().map_or(0, |x| x.n_experts);
    let estimate = spec.n_layers * 64 + n_moe * n_experts * 6;
    if estimate > MAX_TENSORS {
        errs.push(err(
            ErrorKind::Unsupported,
            vec![cx.c("num_hidden_layers"), cx.c("num_experts")],
            format!("about {estimate} tensors: more than the {MAX_TENSORS} k3-run accepts"),
        ));
    }
    errs.check()?;
    let a_log = match m.kda.as_ref().map(|k| k.a_log_shape) {
        Some(ALogShape::Heads4d) => ALogLayout::Heads4d,
        _ => ALogLayout::Flat,
    };
    match inventory::build(&spec, &templates, a_log) {
        Ok(t) => spec.tensors = t,
        Err(msg) => errs.push(SpecError::new(ErrorKind::Invalid, cx.m("tensors"), msg)),
    }
    check_unique_names(&spec, &cx, &mut errs);
    errs.check()?;
    spec.rebuild_index();
    if spec.index == TensorIndex::default() && !spec.tensors.is_empty() {
        errs.push(SpecError::new(
            ErrorKind::Invalid,
            cx.m("tensors"),
            "internal: the inventory is not in the documented order",
        ));
    }
    errs.finish(spec)
}

/// File names and the text-config prefix, for building places.
struct Cx<'a> {
    mfile: &'a str,
    cfile: &'a str,
    tpath: &'a str,
}

impl Cx<'_> {
    fn m(&self, path: &str) -> Place {
        Place::Manifest {
            file: self.mfile.to_string(),
            path: path.to_string(),
        }
    }
    /// A key relative to the text config.
    fn c(&self, key: &str) -> Place {
        Place::Config {
            file: self.cfile.to_string(),
            key: key_path(self.tpath, key),
        }
    }
    /// A key path from the root of config.json.
    fn c_root(&self, key: &str) -> Place {
        Place::Config {
            file: self.cfile.to_string(),
            key: key.to_string(),
        }
    }
}

fn err(kind: ErrorKind, places: Vec<Place>, msg: impl Into<String>) -> SpecError {
    SpecError {
        kind,
        places,
        message: msg.into(),
    }
}

// ------------------------------------------------------------ manifest semantics ----

/// The roles a manifest's blocks need a template for, and those it may have (roles whose
/// presence depends on config.json, like the latent norm).
fn role_plan(m: &RawManifest) -> (Vec<TensorRole>, Vec<TensorRole>) {
    let attn_res = m.attn_res.is_some();
    let mut req = BlockRoles::global(attn_res);
    req.extend(BlockRoles::layer_common(attn_res));
    let mut opt = Vec::new();
    if let Some(k) = &m.kda {
        req.extend(BlockRoles::kda(k.output_gate == OutputGateKind::FullRank));
    }
    if let Some(x) = &m.mla {
        req.extend(BlockRoles::mla(x.q_lora, x.output_gate));
    }
    if m.dense.is_some() {
        req.extend(BlockRoles::dense());
    }
    if let Some(x) = &m.moe {
        req.extend(BlockRoles::moe(
            x.router_bias,
            x.shared_experts,
            x.latent,
            false,
        ));
        if x.latent {
            opt.push(TensorRole::LatentNorm);
        }
        req.extend(BlockRoles::expert(expert_format(x.expert_format)));
    }
    (req, opt)
}

fn expert_format(k: ExpertFormatKind) -> ExpertFormat {
    match k {
        ExpertFormatKind::Mxfp4 => ExpertFormat::Mxfp4,
        ExpertFormatKind::Bf16 => ExpertFormat::Bf16,
    }
}

/// Which block a role belongs to, for messages.
fn role_owner(role: TensorRole) -> &'static str {
    let k = role.key();
    if k.starts_with("kda_") {
        "[kda]"
    } else if k.starts_with("mla_") {
        "[mla]"
    } else if k.starts_with("dense_") {
        "[dense]"
    } else if k.contains("res_") {
        "[attn_res]"
    } else if matches!(role.scope(), RoleScope::Expert)
        || k.starts_with("router")
        || k.starts_with("shared_")
        || k.starts_with("latent_")
    {
        "[moe]"
    } else {
        "every model"
    }
}

fn check_manifest(m: &RawManifest, cx: &Cx<'_>, errs: &mut Errors) -> Templates {
    for (path, v) in [("name", &m.name), ("family", &m.family)] {
        if v.trim().is_empty() {
            errs.push(SpecError::new(
                ErrorKind::Invalid,
                cx.m(path),
                "must not be empty",
            ));
        }
    }
    let eps_fields = [
        ("attn_res.eps", m.attn_res.as_ref().map(|a| a.eps)),
        ("kda.l2_eps", m.kda.as_ref().map(|k| k.l2_eps)),
        ("kda.o_norm_eps", m.kda.as_ref().map(|k| k.o_norm_eps)),
        (
            "mla.latent_norm_eps",
            m.mla.as_ref().map(|x| x.latent_norm_eps),
        ),
    ];
    for (path, e) in eps_fields {
        if let Some(EpsRaw::Value(v)) = e
            && let Err(msg) = check_eps(v)
        {
            errs.push(SpecError::new(ErrorKind::Invalid, cx.m(path), msg));
        }
    }
    if let Some(x) = &m.moe {
        match (x.expert_format, x.mxfp4_group) {
            (ExpertFormatKind::Mxfp4, None) => errs.push(SpecError::new(
                ErrorKind::Missing,
                cx.m("moe.mxfp4_group"),
                "required when expert_format = \"mxfp4\"",
            )),
            (ExpertFormatKind::Mxfp4, Some(g)) if g != 32 => errs.push(SpecError::new(
                ErrorKind::Unsupported,
                cx.m("moe.mxfp4_group"),
                format!("MXFP4 (OCP MX) blocks are 32 elements; found {g}"),
            )),
            (ExpertFormatKind::Bf16, Some(_)) => errs.push(SpecError::new(
                ErrorKind::Invalid,
                cx.m("moe.mxfp4_group"),
                "only meaningful with expert_format = \"mxfp4\"",
            )),
            _ => {}
        }
    }
    if let Some(c) = &m.checkpoint {
        for (i, p) in c.ignore_prefixes.iter().enumerate() {
            if p.is_empty() {
                errs.push(SpecError::new(
                    ErrorKind::Invalid,
                    cx.m(&format!("checkpoint.ignore_prefixes[{i}]")),
                    "an empty prefix would ignore every tensor",
                ));
            }
        }
    }
    check_templates(m, cx, errs)
}

fn check_templates(m: &RawManifest, cx: &Cx<'_>, errs: &mut Errors) -> Templates {
    let (req, opt) = role_plan(m);
    let mut t = Templates(vec![None; TensorRole::ALL.len()]);
    // Templates may repeat across block kinds (KDA and MLA both use `self_attn.o_proj`): a
    // layer has one attention kind. Real collisions are caught on the expanded names.
    for (key, raw) in &m.tensors {
        let path = format!("tensors.{key}");
        let Some(role) = TensorRole::from_key(key) else {
            let known: Vec<&str> = TensorRole::ALL.iter().map(|r| r.key()).collect();
            errs.push(SpecError::new(
                ErrorKind::UnknownField,
                cx.m(&path),
                format!(
                    "unknown tensor role `{key}`; known roles: {}",
                    known.join(", ")
                ),
            ));
            continue;
        };
        if !req.contains(&role) && !opt.contains(&role) {
            errs.push(SpecError::new(
                ErrorKind::Invalid,
                cx.m(&path),
                format!(
                    "role `{key}` is not used by the blocks this manifest declares (it belongs \
                     to {}, or to an option not chosen)",
                    role_owner(role)
                ),
            ));
        }
        let dtype = DType::parse(&raw.dtype);
        match dtype {
            None => errs.push(SpecError::new(
                ErrorKind::Invalid,
                cx.m(&format!("{path}.dtype")),
                format!("unknown dtype `{}`; expected BF16, F32 or U8", raw.dtype),
            )),
            Some(d) if d != DType::U8 && key.starts_with("expert_w") && key.contains("_packed") => {
                errs.push(u8_needed(cx, &path))
            }
            Some(d) if d != DType::U8 && key.ends_with("_scale") => errs.push(u8_needed(cx, &path)),
            _ => {}
        }
        if let Err(msg) = check_placeholders(&raw.name, role.scope()) {
            errs.push(SpecError::new(
                ErrorKind::Invalid,
                cx.m(&format!("{path}.name")),
                msg,
            ));
        }
        if let Some(dtype) = dtype {
            t.0[role as usize] = Some(Template {
                name: raw.name.clone(),
                dtype,
            });
        }
    }
    for role in req {
        if !m.tensors.contains_key(role.key()) {
            errs.push(SpecError::new(
                ErrorKind::Missing,
                cx.m(&format!("tensors.{}", role.key())),
                format!("name template required by {}", role_owner(role)),
            ));
        }
    }
    t
}

fn u8_needed(cx: &Cx<'_>, path: &str) -> SpecError {
    SpecError::new(
        ErrorKind::Invalid,
        cx.m(&format!("{path}.dtype")),
        "MXFP4 packed nibbles and E8M0 scales are stored as U8",
    )
}

/// `{layer}` exactly once in per-layer and per-expert templates, `{expert}` exactly once in
/// per-expert ones, no other placeholder.
fn check_placeholders(name: &str, scope: RoleScope) -> Result<(), String> {
    let mut layer = 0;
    let mut expert = 0;
    let mut rest = name;
    while let Some(open) = rest.find('{') {
        let after = &rest[open + 1..];
        let Some(close) = after.find('}') else {
            return Err("unclosed `{` in name template".into());
        };
        match &after[..close] {
            "layer" => layer += 1,
            "expert" => expert += 1,
            other => {
                return Err(format!(
                    "unknown placeholder `{{{other}}}`; templates know {{layer}} and {{expert}}"
                ));
            }
        }
        rest = &after[close + 1..];
    }
    if rest.contains('}') {
        return Err("stray `}` in name template".into());
    }
    let (want_l, want_e) = match scope {
        RoleScope::Global => (0, 0),
        RoleScope::Layer => (1, 0),
        RoleScope::Expert => (1, 1),
    };
    if (layer, expert) != (want_l, want_e) {
        return Err(format!(
            "a {} role's template needs {{layer}} x{want_l} and {{expert}} x{want_e}; found x{layer} and x{expert}",
            match scope {
                RoleScope::Global => "global",
                RoleScope::Layer => "per-layer",
                RoleScope::Expert => "per-expert",
            }
        ));
    }
    Ok(())
}

// ----------------------------------------------------------------------- pins ----

fn check_pins(m: &RawManifest, config: &Value, cx: &Cx<'_>, errs: &mut Errors) {
    for (key, want) in &m.pins {
        let mp = cx.m(&format!("pins.\"{key}\""));
        match lookup(config, key) {
            None => errs.push(err(
                ErrorKind::Missing,
                vec![mp, cx.c_root(key)],
                format!("the manifest pins this key to {want}, but config.json does not have it"),
            )),
            Some(have) if !toml_eq_json(want, have) => errs.push(SpecError::contradiction(
                mp,
                cx.c_root(key),
                format!("the manifest pins {want}, config.json has {have}"),
            )),
            Some(_) => {}
        }
    }
}

fn toml_eq_json(t: &toml::Value, j: &Value) -> bool {
    match (t, j) {
        (toml::Value::String(a), Value::String(b)) => a == b,
        (toml::Value::Boolean(a), Value::Bool(b)) => a == b,
        (toml::Value::Integer(a), Value::Number(b)) => b.as_i64() == Some(*a),
        (toml::Value::Float(a), Value::Number(b)) => b.as_f64() == Some(*a),
        (toml::Value::Array(a), Value::Array(b)) => {
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| toml_eq_json(x, y))
        }
        _ => false,
    }
}

// ------------------------------------------------------------------ cross-checks ----

fn eps(e: EpsRaw, d: &ConfigDims) -> f32 {
    match e {
        EpsRaw::Value(v) => v as f32,
        EpsRaw::Key(EpsKey::RmsNormEps) => d.rms_norm_eps as f32,
    }
}

/// Largest dimension accepted from config.json (K3's largest is the vocabulary, 163,840).
/// Bounds every shape product well inside `usize`, so no arithmetic on bad input overflows.
pub const MAX_DIM: usize = 1 << 20;

/// Largest tensor inventory accepted (K3: 497,052), so a bad config cannot exhaust memory.
pub const MAX_TENSORS: usize = 1 << 24;

/// Largest epsilon accepted (config `rms_norm_eps` and the manifest's eps values). An
/// epsilon guards `1 / sqrt(mean(x^2) + eps)` against a zero vector; K3 and Kimi-Linear use
/// 1e-5 and 1e-6. Above 1.0 it no longer guards but rescales: it swamps the mean square of
/// unit-scale activations and silently shrinks every normalised vector, so such a value is a
/// corrupted config, not a model.
pub const MAX_EPS: f64 = 1.0;

/// An epsilon: finite, > 0 (0 divides a zero vector by zero) and at most [`MAX_EPS`].
fn check_eps(v: f64) -> Result<(), String> {
    if v.is_finite() && v > 0.0 && v <= MAX_EPS {
        Ok(())
    } else {
        Err(format!(
            "an epsilon must be a positive number at most {MAX_EPS} (K3: 1e-5), found {v}"
        ))
    }
}

/// A SiTU beta (`activation_situ_beta` β or `activation_situ_linear_beta` β_lin): SiTU
/// computes `β·tanh(x/β)`, a soft clip to ±β. β = 0 divides by zero (x = 0 gives NaN), a
/// negative β is no clip bound (the formula is even in β: it computes what |β| does), and a β
/// beyond the f32 range becomes infinite (∞·0 = NaN). Any finite β > 0 is meaningful: a huge
/// one tends to no clip at all. K3: 4.0 and 25.0.
fn check_situ_beta(v: f64) -> Result<(), String> {
    if v.is_finite() && v > 0.0 && (v as f32).is_finite() {
        Ok(())
    } else {
        Err(format!(
            "must be a positive number within f32 range (the SiTU soft-clip bound in \
             beta*tanh(x/beta); K3: 4.0 and 25.0), found {v}"
        ))
    }
}

/// A dimension: 1..=MAX_DIM.
fn positive(v: usize, place: Place, what: &str, errs: &mut Errors) {
    if v == 0 || v > MAX_DIM {
        errs.push(SpecError::new(
            ErrorKind::Invalid,
            place,
            format!("{what} = {v} must be in 1..={MAX_DIM}"),
        ));
    }
}

/// A dimension that may be 0: 0..=MAX_DIM.
fn at_most(v: usize, place: Place, what: &str, errs: &mut Errors) {
    if v > MAX_DIM {
        errs.push(SpecError::new(
            ErrorKind::Invalid,
            place,
            format!("{what} = {v} exceeds {MAX_DIM}"),
        ));
    }
}

fn assemble(
    m: &RawManifest,
    d: &ConfigDims,
    config: &Value,
    cx: &Cx<'_>,
    errs: &mut Errors,
) -> ModelSpec {
    positive(d.hidden_size, cx.c("hidden_size"), "hidden_size", errs);
    positive(
        d.num_hidden_layers,
        cx.c("num_hidden_layers"),
        "num_hidden_layers",
        errs,
    );
    positive(d.vocab_size, cx.c("vocab_size"), "vocab_size", errs);
    if let Err(msg) = check_eps(d.rms_norm_eps) {
        errs.push(SpecError::new(
            ErrorKind::Invalid,
            cx.c("rms_norm_eps"),
            msg,
        ));
    }
    if d.max_position_embeddings == Some(0) {
        errs.push(SpecError::new(
            ErrorKind::Invalid,
            cx.c("max_position_embeddings"),
            "0 positions: must be at least 1 (K3 and Kimi-Linear: 1048576)",
        ));
    }
    if d.tie_word_embeddings {
        errs.push(err(
            ErrorKind::Unsupported,
            vec![cx.c("tie_word_embeddings"), cx.m("tensors.lm_head")],
            "tied embeddings: the manifest declares a separate lm_head tensor",
        ));
    }
    if let Some(n) = d.num_nextn_predict_layers.filter(|&n| n > 0) {
        errs.push(SpecError::new(
            ErrorKind::Unsupported,
            cx.c("num_nextn_predict_layers"),
            format!("{n} multi-token-prediction layers: k3-run has none"),
        ));
    }
    let activation = activation(m, d, cx, errs);
    let layers = layer_map(m, d, cx, errs);
    let kda = m.kda.as_ref().and_then(|k| kda_spec(k, d, cx, errs));
    let mla = m.mla.as_ref().and_then(|x| mla_spec(x, d, cx, errs));
    let dense = m.dense.as_ref().and_then(|_| {
        let d_ff = d.intermediate_size?;
        positive(d_ff, cx.c("intermediate_size"), "intermediate_size", errs);
        Some(DenseMlpSpec { d_ff })
    });
    let moe = m
        .moe
        .as_ref()
        .and_then(|x| moe_spec(x, d, config, cx, errs));
    let attn_res = attn_res(m, d, cx, errs);
    ModelSpec {
        name: m.name.clone(),
        family: m.family.clone(),
        d_model: d.hidden_size,
        n_layers: d.num_hidden_layers,
        vocab_size: d.vocab_size,
        rms_norm_eps: d.rms_norm_eps as f32,
        activation,
        layers,
        kda,
        mla,
        dense,
        moe,
        attn_res,
        eos_token_ids: d.eos_token_ids.clone(),
        tensors: Vec::new(),
        ignored_tensor_prefixes: m
            .checkpoint
            .as_ref()
            .map(|c| c.ignore_prefixes.clone())
            .unwrap_or_default(),
        truncated_from: None,
        index: TensorIndex::default(),
    }
}

fn activation(m: &RawManifest, d: &ConfigDims, cx: &Cx<'_>, errs: &mut Errors) -> Activation {
    let want = match m.activation {
        ActivationKind::Situ => "situ",
        ActivationKind::Silu => "silu",
    };
    if d.hidden_act != want {
        errs.push(SpecError::contradiction(
            cx.m("activation"),
            cx.c("hidden_act"),
            format!(
                "manifest says {want:?}, config.json says {:?}",
                d.hidden_act
            ),
        ));
    }
    match m.activation {
        ActivationKind::Situ => {
            // hf_config requires the key when the manifest says situ; checked again here
            // so that no path builds a spec without it.
            let beta = d.activation_situ_beta.unwrap_or_else(|| {
                errs.push(err(
                    ErrorKind::Missing,
                    vec![cx.c("activation_situ_beta"), cx.m("activation")],
                    "required key is missing (SiTU reads it)",
                ));
                f64::NAN
            });
            for (key, v) in [
                ("activation_situ_beta", d.activation_situ_beta),
                ("activation_situ_linear_beta", d.activation_situ_linear_beta),
            ] {
                if let Some(v) = v
                    && let Err(msg) = check_situ_beta(v)
                {
                    errs.push(SpecError::new(ErrorKind::Invalid, cx.c(key), msg));
                }
            }
            Activation::Situ {
                beta: beta as f32,
                beta_lin: d.activation_situ_linear_beta.map(|b| b as f32),
            }
        }
        ActivationKind::Silu => Activation::Silu,
    }
}

fn list_of(key: LayerListKey, d: &ConfigDims) -> &[usize] {
    match key {
        LayerListKey::LinearAttnKdaLayers => &d.linear_attn_config.kda_layers,
        LayerListKey::LinearAttnFullAttnLayers => &d.linear_attn_config.full_attn_layers,
    }
}

fn layer_map(m: &RawManifest, d: &ConfigDims, cx: &Cx<'_>, errs: &mut Errors) -> Vec<LayerSpec> {
    let n = d.num_hidden_layers;
    if n > MAX_DIM {
        return Vec::new(); // reported by `assemble`; nothing sensible to map
    }
    let lm = &m.layer_map;
    let base = lm.index_base;
    // attn[l]: Some(kind) once assigned.
    let mut attn: Vec<Vec<AttnKind>> = vec![Vec::new(); n];
    for (key, kind) in [
        (lm.kda_layers, AttnKind::Kda),
        (lm.mla_layers, AttnKind::Mla),
    ] {
        let mut bad = Vec::new();
        let mut dup = Vec::new();
        for &x in list_of(key, d) {
            match x.checked_sub(base).filter(|&l| l < n) {
                None => bad.push(x),
                Some(l) if attn[l].contains(&kind) => dup.push(x),
                Some(l) => attn[l].push(kind),
            }
        }
        if !bad.is_empty() {
            errs.push(err(
                ErrorKind::Invalid,
                vec![cx.c(key.key()), cx.m("layer_map.index_base")],
                format!(
                    "layer numbers {bad:?} are outside {base}..={} ({n} layers numbered from {base})",
                    (n + base).saturating_sub(1)
                ),
            ));
        }
        if !dup.is_empty() {
            errs.push(SpecError::new(
                ErrorKind::Invalid,
                cx.c(key.key()),
                format!("layer numbers {dup:?} are listed twice"),
            ));
        }
    }
    let both: Vec<usize> = (0..n)
        .filter(|&l| attn[l].len() > 1)
        .map(|l| l + base)
        .collect();
    let none: Vec<usize> = (0..n)
        .filter(|&l| attn[l].is_empty())
        .map(|l| l + base)
        .collect();
    if !both.is_empty() {
        errs.push(SpecError::contradiction(
            cx.c(lm.kda_layers.key()),
            cx.c(lm.mla_layers.key()),
            format!("layers {both:?} are listed as both KDA and MLA"),
        ));
    }
    if !none.is_empty() {
        errs.push(err(
            ErrorKind::Invalid,
            vec![cx.c(lm.kda_layers.key()), cx.c(lm.mla_layers.key())],
            format!("layers {none:?} are in neither list"),
        ));
    }
    if d.moe_layer_freq == 0 {
        errs.push(SpecError::new(
            ErrorKind::Invalid,
            cx.c("moe_layer_freq"),
            "must be at least 1",
        ));
    }
    let freq = d.moe_layer_freq.max(1);
    let layers: Vec<LayerSpec> = (0..n)
        .map(|l| LayerSpec {
            index: l,
            attn: attn[l].first().copied().unwrap_or(AttnKind::Kda),
            ffn: if l < d.first_k_dense_replace || l % freq != 0 {
                FfnKind::Dense
            } else {
                FfnKind::Moe
            },
        })
        .collect();
    let has = |f: &dyn Fn(&LayerSpec) -> bool| layers.iter().filter(|l| f(l)).count();
    let checks = [
        (
            has(&|l| l.attn == AttnKind::Kda),
            m.kda.is_some(),
            "kda",
            lm.kda_layers.key(),
            "KDA",
        ),
        (
            has(&|l| l.attn == AttnKind::Mla),
            m.mla.is_some(),
            "mla",
            lm.mla_layers.key(),
            "MLA",
        ),
        (
            has(&|l| l.ffn == FfnKind::Dense),
            m.dense.is_some(),
            "dense",
            "first_k_dense_replace",
            "dense-FFN",
        ),
        (
            has(&|l| l.ffn == FfnKind::Moe),
            m.moe.is_some(),
            "moe",
            "first_k_dense_replace",
            "MoE",
        ),
    ];
    for (count, declared, section, key, what) in checks {
        if count > 0 && !declared {
            errs.push(SpecError::contradiction(
                cx.m(section),
                cx.c(key),
                format!("config.json gives {count} {what} layers but the manifest has no [{section}] block"),
            ));
        }
    }
    layers
}

fn kda_spec(
    k: &manifest::RawKda,
    d: &ConfigDims,
    cx: &Cx<'_>,
    errs: &mut Errors,
) -> Option<KdaSpec> {
    let c = d.linear_attn_config.kda.as_ref()?;
    let key = |s: &str| format!("linear_attn_config.{s}");
    positive(c.num_heads, cx.c(&key("num_heads")), "num_heads", errs);
    positive(c.head_dim, cx.c(&key("head_dim")), "head_dim", errs);
    positive(
        c.short_conv_kernel_size,
        cx.c(&key("short_conv_kernel_size")),
        "short_conv_kernel_size",
        errs,
    );
    let gate = match k.gate {
        KdaGateKind::LowerBound => match c.gate_lower_bound {
            None => {
                errs.push(err(
                    ErrorKind::Missing,
                    vec![cx.c(&key("gate_lower_bound")), cx.m("kda.gate")],
                    "required key is missing (the manifest's gate = \"lower_bound\" reads it)",
                ));
                KdaGateSpec::LowerBound(f32::NAN)
            }
            Some(lb) => {
                if lb >= 0.0 {
                    errs.push(SpecError::new(
                        ErrorKind::Invalid,
                        cx.c(&key("gate_lower_bound")),
                        format!("a lower bound of the log-decay must be negative, found {lb}"),
                    ));
                }
                KdaGateSpec::LowerBound(lb as f32)
            }
        },
        KdaGateKind::Softplus => KdaGateSpec::Softplus,
    };
    let full = k.output_gate == OutputGateKind::FullRank;
    if c.use_full_rank_gate.unwrap_or(false) != full {
        let have = match c.use_full_rank_gate {
            Some(b) => b.to_string(),
            None => "absent (upstream: low-rank gate)".to_string(),
        };
        errs.push(SpecError::contradiction(
            cx.m("kda.output_gate"),
            cx.c(&key("use_full_rank_gate")),
            format!(
                "manifest says {}, config.json use_full_rank_gate is {have}",
                if full {
                    "\"full_rank\""
                } else {
                    "\"low_rank\""
                }
            ),
        ));
    }
    let (h, hd) = (c.num_heads, c.head_dim);
    let a_log_len = match k.a_log_len {
        ALogLenRule::HeadDim => hd,
        ALogLenRule::NHeads => h,
        ALogLenRule::PaddedHeadDim if hd > h => hd,
        ALogLenRule::PaddedHeadDim => (h + 1).div_ceil(32) * 32,
    };
    if a_log_len < h {
        errs.push(err(
            ErrorKind::Invalid,
            vec![
                cx.m("kda.a_log_len"),
                cx.c(&key("num_heads")),
                cx.c(&key("head_dim")),
            ],
            format!(
                "A_log length inconsistent: the rule gives {a_log_len} stored entries but there \
                 are {h} heads (one A_log entry per head)"
            ),
        ));
    }
    let gate_rank = match k.forget_gate_rank {
        RankRule::HeadDim => hd,
    };
    Some(KdaSpec {
        n_heads: h,
        head_dim: hd,
        conv_kernel: c.short_conv_kernel_size,
        gate,
        a_log_len,
        full_rank_output_gate: full,
        gate_rank,
        o_norm_eps: eps(k.o_norm_eps, d),
        l2_eps: eps(k.l2_eps, d),
    })
}

fn mla_spec(
    x: &manifest::RawMla,
    d: &ConfigDims,
    cx: &Cx<'_>,
    errs: &mut Errors,
) -> Option<MlaSpec> {
    let c = d.mla.as_ref()?;
    positive(
        c.num_attention_heads,
        cx.c("num_attention_heads"),
        "num_attention_heads",
        errs,
    );
    positive(c.kv_lora_rank, cx.c("kv_lora_rank"), "kv_lora_rank", errs);
    positive(c.v_head_dim, cx.c("v_head_dim"), "v_head_dim", errs);
    at_most(
        c.qk_nope_head_dim,
        cx.c("qk_nope_head_dim"),
        "qk_nope_head_dim",
        errs,
    );
    at_most(
        c.qk_rope_head_dim,
        cx.c("qk_rope_head_dim"),
        "qk_rope_head_dim",
        errs,
    );
    positive(
        c.qk_nope_head_dim + c.qk_rope_head_dim,
        cx.c("qk_nope_head_dim"),
        "qk_nope_head_dim + qk_rope_head_dim",
        errs,
    );
    if c.num_key_value_heads != c.num_attention_heads {
        errs.push(SpecError::contradiction(
            cx.c("num_key_value_heads"),
            cx.c("num_attention_heads"),
            "MLA is multi-head after kv_b expansion: k3-run needs equal head counts",
        ));
    }
    match (x.q_lora, c.q_lora_rank) {
        (true, None) => errs.push(SpecError::contradiction(
            cx.m("mla.q_lora"),
            cx.c("q_lora_rank"),
            "manifest says q_lora = true, config.json q_lora_rank is null",
        )),
        (true, Some(r)) => positive(r, cx.c("q_lora_rank"), "q_lora_rank", errs),
        (false, Some(r)) => errs.push(SpecError::contradiction(
            cx.m("mla.q_lora"),
            cx.c("q_lora_rank"),
            format!("manifest says q_lora = false, config.json q_lora_rank is {r}"),
        )),
        _ => {}
    }
    if c.mla_use_output_gate.unwrap_or(false) != x.output_gate {
        errs.push(SpecError::contradiction(
            cx.m("mla.output_gate"),
            cx.c("mla_use_output_gate"),
            format!(
                "manifest says {}, config.json says {}",
                x.output_gate,
                c.mla_use_output_gate
                    .map_or("absent (no gate)".to_string(), |b| b.to_string())
            ),
        ));
    }
    match c.mla_use_nope {
        Some(true) => {}
        Some(false) => errs.push(SpecError::new(
            ErrorKind::Unsupported,
            cx.c("mla_use_nope"),
            "rotary MLA is not implemented (K3 is NoPE)",
        )),
        None => errs.push(SpecError::new(
            ErrorKind::Missing,
            cx.c("mla_use_nope"),
            "required key is missing (k3-run implements NoPE MLA only and must see it stated)",
        )),
    }
    Some(MlaSpec {
        n_heads: c.num_attention_heads,
        q_lora_rank: if x.q_lora { c.q_lora_rank } else { None },
        kv_lora_rank: c.kv_lora_rank,
        d_nope: c.qk_nope_head_dim,
        d_rope: c.qk_rope_head_dim,
        d_v: c.v_head_dim,
        output_gate: x.output_gate,
        latent_norm_eps: eps(x.latent_norm_eps, d),
    })
}

fn moe_spec(
    x: &manifest::RawMoe,
    d: &ConfigDims,
    config: &Value,
    cx: &Cx<'_>,
    errs: &mut Errors,
) -> Option<MoeSpec> {
    let c = d.moe.as_ref()?;
    positive(c.num_experts, cx.c("num_experts"), "num_experts", errs);
    positive(
        c.moe_intermediate_size,
        cx.c("moe_intermediate_size"),
        "moe_intermediate_size",
        errs,
    );
    at_most(
        c.num_shared_experts,
        cx.c("num_shared_experts"),
        "num_shared_experts",
        errs,
    );
    if c.num_experts_per_token == 0 || c.num_experts_per_token > c.num_experts {
        errs.push(SpecError::contradiction(
            cx.c("num_experts_per_token"),
            cx.c("num_experts"),
            format!(
                "top-k {} must be in 1..={}",
                c.num_experts_per_token, c.num_experts
            ),
        ));
    }
    let d_latent = match (x.latent, c.routed_expert_hidden_size) {
        (true, None) => {
            errs.push(SpecError::contradiction(
                cx.m("moe.latent"),
                cx.c("routed_expert_hidden_size"),
                "manifest says latent = true, config.json has no routed_expert_hidden_size",
            ));
            None
        }
        (false, Some(w)) => {
            errs.push(SpecError::contradiction(
                cx.m("moe.latent"),
                cx.c("routed_expert_hidden_size"),
                format!("manifest says latent = false, config.json routed_expert_hidden_size is {w} (its presence enables latent MoE upstream)"),
            ));
            None
        }
        (_, w) => w,
    };
    if let Some(w) = d_latent {
        positive(
            w,
            cx.c("routed_expert_hidden_size"),
            "routed_expert_hidden_size",
            errs,
        );
    }
    let latent_norm = if x.latent {
        match c.latent_moe_use_norm {
            Some(b) => b,
            None => {
                errs.push(err(
                    ErrorKind::Missing,
                    vec![cx.c("latent_moe_use_norm"), cx.m("moe.latent")],
                    "required key is missing (latent MoE reads it)",
                ));
                false
            }
        }
    } else {
        false
    };
    match (x.shared_experts, c.num_shared_experts) {
        (true, 0) => errs.push(SpecError::contradiction(
            cx.m("moe.shared_experts"),
            cx.c("num_shared_experts"),
            "manifest says shared_experts = true, config.json num_shared_experts is 0",
        )),
        (false, n) if n > 0 => errs.push(SpecError::contradiction(
            cx.m("moe.shared_experts"),
            cx.c("num_shared_experts"),
            format!("manifest says shared_experts = false, config.json num_shared_experts is {n}"),
        )),
        _ => {}
    }
    let scoring = match c.moe_router_activation_func.as_str() {
        "sigmoid" => RouterScoring::Sigmoid,
        "softmax" => RouterScoring::Softmax,
        other => {
            errs.push(SpecError::new(
                ErrorKind::Unsupported,
                cx.c("moe_router_activation_func"),
                format!("router scoring {other:?}: k3-run knows \"sigmoid\" and \"softmax\""),
            ));
            RouterScoring::Sigmoid
        }
    };
    if c.num_expert_group == 0 {
        errs.push(SpecError::new(
            ErrorKind::Invalid,
            cx.c("num_expert_group"),
            "must be at least 1",
        ));
    } else if c.use_grouped_topk != Some(false)
        && c.num_expert_group > 1
        && c.num_expert_group > c.topk_group
    {
        errs.push(SpecError::contradiction(
            cx.c("num_expert_group"),
            cx.c("topk_group"),
            "group-limited routing would be active upstream; k3-run does not implement it",
        ));
    }
    let scale = c.routed_scaling_factor;
    if !(scale.is_finite() && scale > 0.0 && (scale as f32).is_finite()) {
        errs.push(SpecError::new(
            ErrorKind::Invalid,
            cx.c("routed_scaling_factor"),
            format!(
                "must be a positive number within f32 range (it multiplies the routed \
                 experts' renormalised weights: 0 drops them, a negative value flips their \
                 sign; K3: 1.0, Kimi-Linear: 2.446), found {scale}"
            ),
        ));
    }
    let format = expert_format(x.expert_format);
    let group = x.mxfp4_group.unwrap_or(0);
    let qkey = key_path(cx.tpath, "quantization_config");
    match format {
        ExpertFormat::Mxfp4 => check_quant(d, group, cx, errs),
        ExpertFormat::Bf16 => {
            if lookup(config, &qkey).is_some_and(|v| !v.is_null()) {
                errs.push(SpecError::contradiction(
                    cx.m("moe.expert_format"),
                    cx.c("quantization_config"),
                    "manifest says bf16 experts, config.json declares quantization",
                ));
            }
        }
    }
    if format == ExpertFormat::Mxfp4 && group > 0 {
        let din = d_latent.unwrap_or(d.hidden_size);
        let din_key = if d_latent.is_some() {
            "routed_expert_hidden_size"
        } else {
            "hidden_size"
        };
        for (v, key) in [
            (din, din_key),
            (c.moe_intermediate_size, "moe_intermediate_size"),
        ] {
            if v % group != 0 {
                errs.push(SpecError::contradiction(
                    cx.c(key),
                    cx.m("moe.mxfp4_group"),
                    format!("expert input width {v} is not a multiple of the MXFP4 group {group}"),
                ));
            }
        }
    }
    Some(MoeSpec {
        n_experts: c.num_experts,
        n_experts_active: c.num_experts_per_token,
        n_shared_experts: c.num_shared_experts,
        d_expert_ff: c.moe_intermediate_size,
        d_latent,
        latent_norm,
        scoring,
        renormalize: c.moe_renormalize,
        routed_scaling_factor: c.routed_scaling_factor as f32,
        has_score_bias: x.router_bias,
        mxfp4_group: group,
        expert_format: format,
    })
}

fn check_quant(d: &ConfigDims, group: usize, cx: &Cx<'_>, errs: &mut Errors) {
    let Some(q) = &d.quantization_config else {
        errs.push(err(
            ErrorKind::Missing,
            vec![cx.c("quantization_config"), cx.m("moe.expert_format")],
            "required key is missing (MXFP4 experts are described by it)",
        ));
        return;
    };
    let qk = |s: &str| format!("quantization_config.{s}");
    let wk = |s: &str| format!("quantization_config.config_groups.*.weights.{s}");
    let expect: [(&str, String, &str, String); 6] = [
        (
            "compressed-tensors",
            q.quant_method.clone(),
            "quant_method",
            qk("quant_method"),
        ),
        (
            "mxfp4-pack-quantized",
            q.format.clone(),
            "format",
            qk("format"),
        ),
        ("float", q.weight_type.clone(), "type", wk("type")),
        ("group", q.strategy.clone(), "strategy", wk("strategy")),
        (
            "torch.uint8",
            q.scale_dtype.clone(),
            "scale_dtype",
            wk("scale_dtype"),
        ),
        ("4", q.num_bits.to_string(), "num_bits", wk("num_bits")),
    ];
    for (want, have, what, key) in expect {
        if have != want {
            errs.push(SpecError::new(
                ErrorKind::Unsupported,
                cx.c(&key),
                format!("{what} {have:?}: k3-run reads MXFP4 experts as {want:?}"),
            ));
        }
    }
    if !q.symmetric {
        errs.push(SpecError::new(
            ErrorKind::Unsupported,
            cx.c(&wk("symmetric")),
            "MXFP4 is symmetric",
        ));
    }
    if q.group_size != group {
        errs.push(SpecError::contradiction(
            cx.m("moe.mxfp4_group"),
            cx.c(&wk("group_size")),
            format!("manifest says {group}, config.json says {}", q.group_size),
        ));
    }
}

fn attn_res(
    m: &RawManifest,
    d: &ConfigDims,
    cx: &Cx<'_>,
    errs: &mut Errors,
) -> Option<AttnResSpec> {
    match (&m.attn_res, d.attn_res_block_size) {
        (Some(a), Some(b)) => {
            positive(b, cx.c("attn_res_block_size"), "attn_res_block_size", errs);
            Some(AttnResSpec {
                block_size: b,
                eps: eps(a.eps, d),
            })
        }
        (Some(_), None) => {
            errs.push(err(
                ErrorKind::Missing,
                vec![cx.c("attn_res_block_size"), cx.m("attn_res.block_size")],
                "required key is missing (the manifest declares Block AttnRes)",
            ));
            None
        }
        (None, Some(b)) => {
            errs.push(SpecError::contradiction(
                cx.m("attn_res"),
                cx.c("attn_res_block_size"),
                format!("config.json declares Block AttnRes (block {b}) but the manifest has no [attn_res]"),
            ));
            None
        }
        (None, None) => None,
    }
}

fn check_unique_names(spec: &ModelSpec, cx: &Cx<'_>, errs: &mut Errors) {
    let mut seen = rustc_hash::FxHashSet::default();
    seen.reserve(spec.tensors.len());
    for t in &spec.tensors {
        if !seen.insert(t.name.as_str()) {
            errs.push(SpecError::new(
                ErrorKind::Invalid,
                cx.m(&format!("tensors.{}.name", t.role.key())),
                format!("tensor name {:?} is produced twice", t.name),
            ));
            return;
        }
    }
}
