//! Bad manifests and bad config.json files: every problem reported at once, each naming its
//! TOML path or config key and the file.

mod common;

use k3_models::{ErrorKind, SpecErrors, load_spec_from_str};
use serde_json::{Value, json};

const MFILE: &str = "kimi-k3.toml";
const CFILE: &str = "ckpt/config.json";

fn manifest() -> String {
    std::fs::read_to_string(common::manifest("kimi-k3")).expect("kimi-k3.toml readable")
}

fn config() -> Value {
    let t = std::fs::read_to_string(common::data("kimi-k3-config.json")).expect("fixture");
    serde_json::from_str(&t).expect("fixture is JSON")
}

fn small_config() -> Value {
    let t = std::fs::read_to_string(common::data("synth-C/config.json")).expect("fixture");
    serde_json::from_str(&t).expect("fixture is JSON")
}

fn errors(m: &str, c: &Value) -> SpecErrors {
    match load_spec_from_str(m, MFILE, &c.to_string(), CFILE) {
        Ok(_) => panic!("expected errors"),
        Err(e) => e,
    }
}

/// Edit a config.json value at a JSON pointer (`None` removes the key).
fn set(c: &mut Value, pointer: &str, v: Option<Value>) {
    let (parent, key) = pointer.rsplit_once('/').expect("pointer has a parent");
    let obj = c
        .pointer_mut(parent)
        .and_then(Value::as_object_mut)
        .expect("parent object exists");
    match v {
        Some(v) => obj.insert(key.to_string(), v),
        None => obj.remove(key),
    };
}

fn find<'a>(e: &'a SpecErrors, kind: ErrorKind, at: &str) -> &'a k3_models::SpecError {
    e.iter()
        .find(|x| x.kind == kind && x.mentions(at))
        .unwrap_or_else(|| panic!("no {kind:?} error at `{at}` in:\n{e}"))
}

#[test]
fn the_unmodified_inputs_load() {
    // Baseline for every test below: each error is caused by its one edit.
    load_spec_from_str(&manifest(), MFILE, &config().to_string(), CFILE).expect("loads");
    load_spec_from_str(&manifest(), MFILE, &small_config().to_string(), CFILE).expect("loads");
}

#[test]
fn unknown_manifest_field_is_named_with_its_toml_path() {
    let m = manifest().replace("[kda]\n", "[kda]\ngaet = \"lower_bound\"\n");
    let e = errors(&m, &config());
    let x = find(&e, ErrorKind::UnknownField, "kda.gaet");
    assert!(
        x.message.contains("a_log_len"),
        "lists the known fields: {x}"
    );
    assert!(x.to_string().contains(MFILE));
    assert_eq!(e.len(), 1, "{e}");

    let m = manifest().replace("schema_version = 1\n", "schema_version = 1\ncolour = 3\n");
    find(&errors(&m, &config()), ErrorKind::UnknownField, "colour");

    let m = manifest().replace(
        "[tensors]\n",
        "[tensors]\nkda_qq = { name = \"x\", dtype = \"BF16\" }\n",
    );
    find(
        &errors(&m, &config()),
        ErrorKind::UnknownField,
        "tensors.kda_qq",
    );

    let m = manifest().replace("kda_q = { name", "kda_q = { dtyp = \"BF16\", name");
    find(
        &errors(&m, &config()),
        ErrorKind::UnknownField,
        "tensors.kda_q.dtyp",
    );
}

#[test]
fn missing_schema_version() {
    let m = manifest().replace("schema_version = 1\n", "");
    let e = errors(&m, &config());
    find(&e, ErrorKind::SchemaVersion, "schema_version");
}

#[test]
fn wrong_schema_version() {
    let m = manifest().replace("schema_version = 1\n", "schema_version = 2\n");
    let e = errors(&m, &config());
    let x = find(&e, ErrorKind::SchemaVersion, "schema_version");
    assert!(x.message.contains('2') && x.message.contains('1'), "{x}");
    let m = manifest().replace("schema_version = 1\n", "schema_version = \"1\"\n");
    find(
        &errors(&m, &config()),
        ErrorKind::SchemaVersion,
        "schema_version",
    );
}

#[test]
fn several_manifest_errors_are_reported_at_once() {
    let m = manifest()
        .replace("[kda]\n", "[kda]\ngaet = 1\n")
        .replace("[moe]\n", "[moe]\nexperts = 8\n")
        .replace("q_lora = true", "q_lora = \"yes\"")
        .replace("gate = \"lower_bound\"", "gate = \"lowerbound\"");
    let e = errors(&m, &config());
    find(&e, ErrorKind::UnknownField, "kda.gaet");
    find(&e, ErrorKind::UnknownField, "moe.experts");
    find(&e, ErrorKind::Invalid, "mla.q_lora");
    assert!(e.len() >= 3, "{e}");
}

#[test]
fn several_validation_errors_are_reported_at_once() {
    // Manifest semantics, pins and config.json problems together.
    let m = manifest()
        .replace("l2_eps = 1e-6", "l2_eps = -1.0")
        .replace(
            "kda_gate = { name = \"language_model.model.layers.{layer}.self_attn.g_proj.weight\", dtype = \"BF16\" }\n",
            "",
        );
    let mut c = config();
    set(&mut c, "/model_type", Some(json!("kimi_k2")));
    set(&mut c, "/text_config/hidden_size", None);
    set(&mut c, "/text_config/linear_attn_config/num_heads", None);
    let e = errors(&m, &c);
    find(&e, ErrorKind::Invalid, "kda.l2_eps");
    find(&e, ErrorKind::Missing, "tensors.kda_gate");
    find(&e, ErrorKind::Contradiction, "pins.\"model_type\"");
    find(&e, ErrorKind::Missing, "text_config.hidden_size");
    find(
        &e,
        ErrorKind::Missing,
        "text_config.linear_attn_config.num_heads",
    );
    assert_eq!(e.len(), 5, "{e}");
}

#[test]
fn missing_config_key_names_the_key_path_and_file() {
    let mut c = config();
    set(&mut c, "/text_config/linear_attn_config/num_heads", None);
    let e = errors(&manifest(), &c);
    let x = find(
        &e,
        ErrorKind::Missing,
        "text_config.linear_attn_config.num_heads",
    );
    let shown = x.to_string();
    assert!(shown.contains(CFILE) && shown.contains("text_config.linear_attn_config.num_heads"));

    // null where a value is needed is the same problem, said differently.
    let mut c = config();
    set(
        &mut c,
        "/text_config/moe_intermediate_size",
        Some(Value::Null),
    );
    let x = errors(&manifest(), &c);
    let x = find(&x, ErrorKind::Missing, "text_config.moe_intermediate_size");
    assert!(x.message.contains("null"));

    // A key only some manifests need: the lower bound of the K3 gate.
    let mut c = config();
    set(
        &mut c,
        "/text_config/linear_attn_config/gate_lower_bound",
        None,
    );
    let e = errors(&manifest(), &c);
    let x = find(
        &e,
        ErrorKind::Missing,
        "text_config.linear_attn_config.gate_lower_bound",
    );
    assert!(
        x.mentions("kda.gate"),
        "names the manifest field that needs it: {x}"
    );

    // The whole text_config.
    let mut c = config();
    set(&mut c, "/text_config", None);
    find(&errors(&manifest(), &c), ErrorKind::Missing, "text_config");
}

#[test]
fn wrong_config_types_are_invalid() {
    let mut c = config();
    set(&mut c, "/text_config/num_experts", Some(json!(896.5)));
    set(
        &mut c,
        "/text_config/linear_attn_config/kda_layers",
        Some(json!([1, "two"])),
    );
    set(&mut c, "/text_config/moe_renormalize", Some(json!("true")));
    let e = errors(&manifest(), &c);
    find(&e, ErrorKind::Invalid, "text_config.num_experts");
    find(
        &e,
        ErrorKind::Invalid,
        "text_config.linear_attn_config.kda_layers[1]",
    );
    find(&e, ErrorKind::Invalid, "text_config.moe_renormalize");
}

#[test]
fn manifest_config_contradictions_name_both() {
    let mut c = config();
    set(
        &mut c,
        "/text_config/linear_attn_config/use_full_rank_gate",
        Some(json!(false)),
    );
    set(&mut c, "/text_config/mla_use_output_gate", None);
    set(&mut c, "/text_config/hidden_act", Some(json!("silu")));
    set(&mut c, "/text_config/q_lora_rank", Some(Value::Null));
    let e = errors(&manifest(), &c);
    for (m, k) in [
        (
            "kda.output_gate",
            "text_config.linear_attn_config.use_full_rank_gate",
        ),
        ("mla.output_gate", "text_config.mla_use_output_gate"),
        ("activation", "text_config.hidden_act"),
        ("mla.q_lora", "text_config.q_lora_rank"),
    ] {
        let x = find(&e, ErrorKind::Contradiction, m);
        assert!(x.mentions(k), "{x}");
        let shown = x.to_string();
        assert!(shown.contains(MFILE) && shown.contains(CFILE), "{shown}");
    }
}

#[test]
fn quantization_contradictions() {
    let mut c = config();
    set(
        &mut c,
        "/text_config/quantization_config/config_groups/group_0/weights/group_size",
        Some(json!(16)),
    );
    let e = errors(&manifest(), &c);
    find(
        &e,
        ErrorKind::Contradiction,
        "pins.\"text_config.quantization_config.config_groups.group_0.weights.group_size\"",
    );
    // Without the pin, the typed check of [moe] catches it too.
    let m: String = manifest()
        .lines()
        .filter(|l| !l.contains("weights.group_size\" = 32"))
        .map(|l| format!("{l}\n"))
        .collect();
    let e = errors(&m, &c);
    let x = find(&e, ErrorKind::Contradiction, "moe.mxfp4_group");
    assert!(x.mentions("text_config.quantization_config.config_groups.*.weights.group_size"));

    let m = manifest().replace("mxfp4_group = 32", "mxfp4_group = 16");
    find(
        &errors(&m, &config()),
        ErrorKind::Unsupported,
        "moe.mxfp4_group",
    );

    // A top-level copy must equal the text config's (synth_k3.py writes one).
    let mut c = config();
    let mut q = c["text_config"]["quantization_config"].clone();
    set(&mut c, "/quantization_config", Some(q.clone()));
    load_spec_from_str(&manifest(), MFILE, &c.to_string(), CFILE).expect("identical copy is fine");
    q["format"] = json!("nvfp4-pack-quantized");
    set(&mut c, "/quantization_config", Some(q.clone()));
    let e = errors(&manifest(), &c);
    let x = find(&e, ErrorKind::Contradiction, "quantization_config");
    assert!(x.mentions("text_config.quantization_config"));

    // Only at the top level: not the released layout.
    let mut c = config();
    set(&mut c, "/quantization_config", Some(q));
    set(&mut c, "/text_config/quantization_config", None);
    let e = errors(&manifest(), &c);
    find(&e, ErrorKind::Invalid, "quantization_config");
}

#[test]
fn a_log_length_inconsistent_with_head_count() {
    // 32 heads of 16: a stored A_log of head_dim = 16 entries cannot hold one per head.
    let m = manifest().replace(
        "a_log_len = \"padded_head_dim\"",
        "a_log_len = \"head_dim\"",
    );
    let mut c = small_config();
    set(
        &mut c,
        "/text_config/linear_attn_config/num_heads",
        Some(json!(32)),
    );
    let e = errors(&m, &c);
    let x = find(&e, ErrorKind::Invalid, "kda.a_log_len");
    assert!(x.message.contains("A_log") && x.mentions("text_config.linear_attn_config.num_heads"));
    // The padded rule (synth_k3.py's) gives 64 entries for 32 heads instead.
    let spec = load_spec_from_str(&manifest(), MFILE, &c.to_string(), CFILE).expect("loads");
    assert_eq!(spec.kda.as_ref().map(|k| k.a_log_len), Some(64));
}

#[test]
fn layer_map_problems() {
    let mut c = small_config();
    // 8 layers: KDA [1,2,3,5,6,7], MLA [4,8]. Put 4 in both, drop 8, add 9.
    set(
        &mut c,
        "/text_config/linear_attn_config/kda_layers",
        Some(json!([1, 2, 3, 4, 5, 6, 7, 9])),
    );
    set(
        &mut c,
        "/text_config/linear_attn_config/full_attn_layers",
        Some(json!([4, 4])),
    );
    let e = errors(&manifest(), &c);
    let both = find(
        &e,
        ErrorKind::Contradiction,
        "text_config.linear_attn_config.kda_layers",
    );
    assert!(both.message.contains("[4]"), "{both}");
    let none = e
        .iter()
        .find(|x| x.message.contains("neither"))
        .unwrap_or_else(|| panic!("{e}"));
    assert!(none.message.contains("[8]"), "{none}");
    assert!(
        e.iter()
            .any(|x| x.message.contains("[9]") && x.mentions("layer_map.index_base"))
    );
    assert!(e.iter().any(|x| x.message.contains("listed twice")));
}

#[test]
fn config_blocks_the_manifest_does_not_declare() {
    // A manifest without [attn_res] and its tensors, on a config that declares AttnRes.
    let mut m = manifest();
    let start = m.find("[attn_res]").expect("section");
    let end = m.find("[kda]").expect("section");
    m.replace_range(start..end, "");
    let m: String = m
        .lines()
        .filter(|l| !l.contains("res_proj") && !l.contains("res_norm"))
        .map(|l| format!("{l}\n"))
        .collect();
    let e = errors(&m, &config());
    find(&e, ErrorKind::Contradiction, "attn_res");
    assert_eq!(e.len(), 1, "{e}");
}

#[test]
fn template_problems() {
    let m = manifest()
        .replace("self_attn.q_proj.weight", "self_attn.{layr}.q_proj.weight")
        .replace(
            "[tensors]\n",
            "[tensors]\nkda_gate_a = { name = \"x.{layer}\", dtype = \"BF16\" }\n",
        )
        .replace(
            "self_attn.A_log\", dtype = \"F32\"",
            "self_attn.A_log\", dtype = \"F64\"",
        )
        .replace(
            "w2.weight_scale\", dtype = \"U8\"",
            "w2.weight_scale\", dtype = \"BF16\"",
        )
        .replace(
            "\"language_model.model.norm.weight\"",
            "\"language_model.model.{layer}.norm.weight\"",
        );
    let e = errors(&m, &config());
    find(&e, ErrorKind::Invalid, "tensors.kda_q.name");
    find(&e, ErrorKind::Invalid, "tensors.kda_gate_a");
    find(&e, ErrorKind::Invalid, "tensors.kda_a_log.dtype");
    find(&e, ErrorKind::Invalid, "tensors.expert_w2_scale.dtype");
    find(&e, ErrorKind::Invalid, "tensors.final_norm.name");
}

#[test]
fn colliding_names_are_caught_after_expansion() {
    let m = manifest().replace("post_attention_layernorm.weight", "input_layernorm.weight");
    let e = errors(&m, &config());
    assert!(
        e.iter().any(|x| x.message.contains("produced twice")),
        "{e}"
    );
}

#[test]
fn unsupported_configs() {
    let mut c = config();
    set(&mut c, "/text_config/num_expert_group", Some(json!(8)));
    set(&mut c, "/text_config/topk_group", Some(json!(4)));
    set(
        &mut c,
        "/text_config/num_nextn_predict_layers",
        Some(json!(1)),
    );
    set(&mut c, "/text_config/num_key_value_heads", Some(json!(8)));
    set(
        &mut c,
        "/text_config/moe_router_activation_func",
        Some(json!("sparsemixer")),
    );
    set(
        &mut c,
        "/text_config/num_experts_per_token",
        Some(json!(900)),
    );
    let e = errors(&manifest(), &c);
    find(&e, ErrorKind::Contradiction, "text_config.num_expert_group");
    find(
        &e,
        ErrorKind::Unsupported,
        "text_config.num_nextn_predict_layers",
    );
    find(
        &e,
        ErrorKind::Contradiction,
        "text_config.num_key_value_heads",
    );
    find(
        &e,
        ErrorKind::Unsupported,
        "text_config.moe_router_activation_func",
    );
    find(
        &e,
        ErrorKind::Contradiction,
        "text_config.num_experts_per_token",
    );
}

#[test]
fn eos_and_duplicated_keys() {
    let mut c = config();
    set(&mut c, "/eos_token_id", Some(json!([163586, 163585])));
    set(
        &mut c,
        "/text_config/eos_token_id",
        Some(json!([163586, 163585])),
    );
    let spec =
        load_spec_from_str(&manifest(), MFILE, &c.to_string(), CFILE).expect("a list is fine");
    assert_eq!(spec.eos_token_ids, vec![163_586, 163_585]);
    set(&mut c, "/text_config/eos_token_id", Some(json!(2)));
    let e = errors(&manifest(), &c);
    let x = find(&e, ErrorKind::Contradiction, "eos_token_id");
    assert!(x.mentions("text_config.eos_token_id"));
}

#[test]
fn syntax_errors_name_the_file() {
    let e = errors("schema_version = 1\n[kda\n", &config());
    assert_eq!(e.iter().next().map(|x| x.kind), Some(ErrorKind::Syntax));
    assert!(e.to_string().contains(MFILE));
    let e =
        load_spec_from_str(&manifest(), MFILE, "{\"model_type\": ", CFILE).expect_err("bad JSON");
    let x = find(&e, ErrorKind::Syntax, CFILE);
    assert!(x.message.contains("JSON"));
    // Both files bad: both reported.
    let e = load_spec_from_str("[kda", MFILE, "{", CFILE).expect_err("both bad");
    assert_eq!(e.len(), 2, "{e}");
}

#[test]
fn unreadable_files_are_io_errors() {
    let e = k3_models::load_spec(
        std::path::Path::new("/nonexistent/m.toml"),
        std::path::Path::new("/nonexistent/config.json"),
    )
    .expect_err("missing files");
    assert_eq!(e.of_kind(ErrorKind::Io).len(), 2, "{e}");
    assert!(e.to_string().contains("/nonexistent/config.json"));
}

#[test]
fn missing_required_manifest_sections() {
    let mut m = manifest();
    let start = m.find("[layer_map]").expect("section");
    let end = m.find("[attn_res]").expect("section");
    m.replace_range(start..end, "");
    let m = m.replace("activation = \"situ\"\n", "");
    let e = errors(&m, &config());
    find(&e, ErrorKind::Missing, "layer_map");
    find(&e, ErrorKind::Missing, "activation");
    let m = manifest().replace("latent_norm_eps = 1e-6", "");
    find(
        &errors(&m, &config()),
        ErrorKind::Missing,
        "mla.latent_norm_eps",
    );
}

#[test]
fn absurd_sizes_are_errors_not_crashes() {
    let mut c = config();
    set(
        &mut c,
        "/text_config/num_hidden_layers",
        Some(json!(1_000_000_000_000u64)),
    );
    set(&mut c, "/text_config/hidden_size", Some(json!(0)));
    let e = errors(&manifest(), &c);
    find(&e, ErrorKind::Invalid, "text_config.num_hidden_layers");
    find(&e, ErrorKind::Invalid, "text_config.hidden_size");

    // Each dimension in range, but the inventory would be billions of tensors.
    let mut c = config();
    set(&mut c, "/text_config/num_experts", Some(json!(1_000_000)));
    let e = errors(&manifest(), &c);
    find(&e, ErrorKind::Unsupported, "text_config.num_experts");
}

/// Config numbers whose value makes the math meaningless are refused at their key and file;
/// the real values (K3's betas 4 and 25, scale 1.0, eps 1e-5; Kimi-Linear's scale 2.446) and
/// values that are only unusual (a huge beta tends to no clip) load.
#[test]
fn config_numbers_out_of_their_meaningful_range_are_invalid() {
    let cases: [(&str, Value); 13] = [
        ("activation_situ_beta", json!(0.0)),
        ("activation_situ_beta", json!(-4.0)),
        ("activation_situ_beta", json!(1e39)),
        ("activation_situ_linear_beta", json!(0.0)),
        ("activation_situ_linear_beta", json!(-25.0)),
        ("routed_scaling_factor", json!(0.0)),
        ("routed_scaling_factor", json!(-1.0)),
        ("routed_scaling_factor", json!(1e39)),
        ("rms_norm_eps", json!(0.0)),
        ("rms_norm_eps", json!(-1e-5)),
        ("rms_norm_eps", json!(1.5)),
        ("rms_norm_eps", json!(1e12)),
        ("max_position_embeddings", json!(0)),
    ];
    for (key, v) in cases {
        let mut c = config();
        set(&mut c, &format!("/text_config/{key}"), Some(v.clone()));
        let e = errors(&manifest(), &c);
        let x = find(&e, ErrorKind::Invalid, &format!("text_config.{key}"));
        let text = x.to_string();
        assert!(text.contains(CFILE), "{key} = {v}: names the file: {text}");
        assert_eq!(e.len(), 1, "{key} = {v}: only this error:\n{e}");
    }
    for (key, v) in [
        ("activation_situ_beta", json!(1e12)),
        ("activation_situ_linear_beta", json!(1e12)),
        ("activation_situ_linear_beta", Value::Null),
        ("routed_scaling_factor", json!(2.446)),
        ("rms_norm_eps", json!(1.0)),
        ("rms_norm_eps", json!(1e-6)),
        ("max_position_embeddings", json!(1)),
    ] {
        let mut c = config();
        set(&mut c, &format!("/text_config/{key}"), Some(v.clone()));
        load_spec_from_str(&manifest(), MFILE, &c.to_string(), CFILE)
            .unwrap_or_else(|e| panic!("{key} = {v} must load:\n{e}"));
    }
    // The manifest's own epsilons have the same bound.
    let m = manifest().replace("l2_eps = 1e-6", "l2_eps = 2.0");
    find(&errors(&m, &config()), ErrorKind::Invalid, "kda.l2_eps");
}

#[test]
fn a_config_json_given_as_the_manifest_is_named_as_one() {
    let c = config().to_string();
    let e = match load_spec_from_str(&c, "config.json", &c, CFILE) {
        Ok(_) => panic!("a config.json is no manifest"),
        Err(e) => e,
    };
    let x = find(&e, ErrorKind::Syntax, "config.json");
    assert!(
        x.to_string().contains("is JSON (a model config.json?)") && x.to_string().contains("TOML"),
        "{e}"
    );
    // TOML that is merely broken keeps the parser's message
    let e = errors("schema_version = [", &config());
    let x = find(&e, ErrorKind::Syntax, MFILE);
    assert!(x.to_string().contains("not valid TOML"), "{e}");
}

#[test]
fn a_config_key_given_twice_with_different_values_is_refused() {
    let text = std::fs::read_to_string(common::data("kimi-k3-config.json")).expect("fixture");
    let m = manifest();
    let with = |extra: &str| {
        let edited = text.replacen(
            "\"hidden_size\": 7168,",
            &format!("\"hidden_size\": 7168,\n    \"hidden_size\": {extra},"),
            1,
        );
        assert_ne!(edited, text, "the fixture has the key");
        load_spec_from_str(&m, MFILE, &edited, CFILE)
    };
    // Two values: which one the weights were written for cannot be known (Python's json
    // would keep the last silently), so the key is named with both values.
    let e = match with("7000") {
        Ok(_) => panic!("two different values of one key must be refused"),
        Err(e) => e,
    };
    let x = find(&e, ErrorKind::Invalid, "text_config.hidden_size");
    let msg = x.to_string();
    assert!(
        msg.contains(CFILE) && msg.contains("7168, then 7000"),
        "{e}"
    );
    assert_eq!(e.len(), 1, "{e}");
    // The same value twice is harmless: the spec is the one of the unedited text.
    let same = with("7168").expect("a repeated equal value loads");
    let plain = load_spec_from_str(&m, MFILE, &text, CFILE).expect("loads");
    assert_eq!(format!("{same:?}"), format!("{plain:?}"));
}
