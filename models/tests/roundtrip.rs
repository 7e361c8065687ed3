//! The config.json writer (`ConfigDims::to_config_json`) against the reader: write -> read
//! gives the same `ConfigDims` and the same `ModelSpec`, and the written layout is the
//! released one (quantization_config under text_config only, keys sorted).

mod common;

use k3_models::hf_config::{ConfigNeeds, K3Shape, k3_layer_map, read_config};
use k3_models::{ConfigDims, load_spec_from_str};

fn manifest_text() -> String {
    std::fs::read_to_string(common::manifest("kimi-k3")).expect("kimi-k3.toml readable")
}

fn shape_9_layers() -> K3Shape {
    // A shape no fixture uses: 9 layers, block 2, 8 experts top-3.
    K3Shape {
        hidden: 96,
        layers: 9,
        block: 2,
        kda_heads: 3,
        kda_head_dim: 32,
        conv_k: 4,
        mla_heads: 2,
        q_lora: 48,
        kv_lora: 32,
        qk_nope: 16,
        qk_rope: 8,
        v_head: 16,
        experts: 8,
        topk: 3,
        shared: 1,
        moe_inter: 64,
        latent: 64,
        dense_inter: 192,
        first_dense: 1,
        vocab: 300,
    }
}

#[test]
fn write_then_read_gives_the_same_dims_and_spec() {
    let dims = ConfigDims::k3_family(&shape_9_layers());
    let json = dims.to_config_json();
    let back = read_config(&json, "written.json", &ConfigNeeds::k3_all()).expect("reads back");
    assert_eq!(back, dims);
    let spec = load_spec_from_str(&manifest_text(), "kimi-k3.toml", &json, "written.json")
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(spec.n_layers, 9);
    assert_eq!(
        spec.layers_with_attn(k3_models::spec::AttnKind::Mla),
        vec![3, 7, 8]
    );
    let moe = spec.moe.as_ref().expect("MoE");
    assert_eq!((moe.n_experts, moe.n_experts_active), (8, 3));
    // Rewriting what was read gives identical text.
    assert_eq!(back.to_config_json(), json);
}

#[test]
fn released_config_survives_read_write_read() {
    let text = std::fs::read_to_string(common::data("kimi-k3-config.json")).expect("fixture");
    let dims = read_config(&text, "kimi-k3-config.json", &ConfigNeeds::k3_all()).expect("reads");
    let rewritten = dims.to_config_json();
    let again = read_config(&rewritten, "rewritten.json", &ConfigNeeds::k3_all()).expect("reads");
    assert_eq!(again, dims);
    let m = manifest_text();
    let a = load_spec_from_str(&m, "kimi-k3.toml", &text, "kimi-k3-config.json").expect("spec");
    let b = load_spec_from_str(&m, "kimi-k3.toml", &rewritten, "rewritten.json").expect("spec");
    assert_eq!(a, b);
}

#[test]
fn oracle_config_survives_read_write_read() {
    let text = std::fs::read_to_string(common::data("synth-A/config.json")).expect("fixture");
    let dims = read_config(&text, "synth-A", &ConfigNeeds::k3_all()).expect("reads");
    let m = manifest_text();
    let a = load_spec_from_str(&m, "m", &text, "synth-A").expect("spec");
    let b = load_spec_from_str(&m, "m", &dims.to_config_json(), "rewritten").expect("spec");
    assert_eq!(a, b);
}

#[test]
fn written_layout_is_the_released_one() {
    let json = ConfigDims::k3_family(&shape_9_layers()).to_config_json();
    let v: serde_json::Value = serde_json::from_str(&json).expect("valid JSON");
    assert_eq!(v["model_type"], "kimi_k3");
    assert_eq!(v["architectures"][0], "KimiK3ForConditionalGeneration");
    assert!(
        v.get("quantization_config").is_none(),
        "top level has no quantization_config"
    );
    let t = &v["text_config"];
    assert_eq!(t["model_type"], "kimi_linear");
    assert_eq!(t["quantization_config"]["format"], "mxfp4-pack-quantized");
    assert_eq!(
        t["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"],
        32
    );
    assert_eq!(
        t["linear_attn_config"]["full_attn_layers"],
        serde_json::json!([4, 8, 9])
    );
    assert_eq!(
        t["linear_attn_config"]["kda_layers"],
        serde_json::json!([1, 2, 3, 5, 6, 7])
    );
    // Keys appear sorted at every level, like HF's `to_json_string(sort_keys=True)`.
    let keys: Vec<&str> = t
        .as_object()
        .expect("object")
        .keys()
        .map(String::as_str)
        .collect();
    let mut sorted = keys.clone();
    sorted.sort_unstable();
    assert_eq!(keys, sorted);
    // The released key set of text_config is covered (every key k3-run reads).
    let released: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(common::data("kimi-k3-config.json")).expect("fixture"),
    )
    .expect("JSON");
    for k in t.as_object().expect("object").keys() {
        assert!(
            released["text_config"].get(k).is_some(),
            "writer invented key text_config.{k}"
        );
    }
}

#[test]
fn k3_layer_rule_reproduces_the_release_lists() {
    let (kda, mla) = k3_layer_map(93);
    let released: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(common::data("kimi-k3-config.json")).expect("fixture"),
    )
    .expect("JSON");
    let lin = &released["text_config"]["linear_attn_config"];
    let one_based = |v: &[usize]| serde_json::json!(v.iter().map(|l| l + 1).collect::<Vec<_>>());
    assert_eq!(lin["kda_layers"], one_based(&kda));
    assert_eq!(lin["full_attn_layers"], one_based(&mla));
}
