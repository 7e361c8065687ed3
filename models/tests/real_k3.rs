//! The released Kimi K3 config.json (tests/data/kimi-k3-config.json, the published key set
//! and values of docs/MODEL.md §2) against configs/models/kimi-k3.toml: layer map,
//! tensor counts and totals of the released checkpoint (docs/MODEL.md §0, §3, §7.9).

mod common;

use k3_models::spec::{
    Activation, AttnKind, DType, ExpertFormat, FfnKind, KdaGateSpec, RouterScoring, TensorRole,
};

#[test]
fn layer_map_is_69_kda_24_mla_with_dense_layer_0() {
    let spec = common::load("kimi-k3", "kimi-k3-config.json");
    assert_eq!(spec.n_layers, 93);
    let mla = spec.layers_with_attn(AttnKind::Mla);
    // K3: MLA at every 4th layer (0-based 3, 7, ..., 91) plus the final layer 92.
    let mut want: Vec<usize> = (3..93).step_by(4).collect();
    want.push(92);
    assert_eq!(mla, want);
    assert_eq!(mla.len(), 24);
    assert_eq!(spec.layers_with_attn(AttnKind::Kda).len(), 69);
    assert_eq!(spec.layers_with_ffn(FfnKind::Dense), vec![0]);
    assert_eq!(
        spec.layers_with_ffn(FfnKind::Moe),
        (1..93).collect::<Vec<_>>()
    );
    assert_eq!(spec.layer(0).attn, AttnKind::Kda);
    assert_eq!(spec.layer(91).attn, AttnKind::Mla);
    assert_eq!(spec.layer(92).attn, AttnKind::Mla);
}

#[test]
fn block_parameters_follow_config_and_manifest() {
    let spec = common::load("kimi-k3", "kimi-k3-config.json");
    assert_eq!(spec.name, "kimi-k3");
    assert_eq!((spec.d_model, spec.vocab_size), (7168, 163_840));
    assert_eq!(spec.rms_norm_eps, 1e-5);
    assert_eq!(spec.eos_token_ids, vec![163_586]);
    assert_eq!(
        spec.activation,
        Activation::Situ {
            beta: 4.0,
            beta_lin: Some(25.0)
        }
    );
    let kda = spec.kda.as_ref().expect("K3 has KDA");
    assert_eq!((kda.n_heads, kda.head_dim, kda.conv_kernel), (96, 128, 4));
    assert_eq!(kda.gate, KdaGateSpec::LowerBound(-5.0));
    assert_eq!(kda.a_log_len, 128);
    assert!(kda.full_rank_output_gate);
    assert_eq!(kda.gate_rank, 128);
    assert_eq!((kda.l2_eps, kda.o_norm_eps), (1e-6, 1e-5));
    let mla = spec.mla.as_ref().expect("K3 has MLA");
    assert_eq!(mla.n_heads, 96);
    assert_eq!(mla.q_lora_rank, Some(1536));
    assert_eq!(
        (mla.kv_lora_rank, mla.d_nope, mla.d_rope, mla.d_v),
        (512, 128, 64, 128)
    );
    assert!(mla.output_gate);
    assert_eq!(mla.latent_norm_eps, 1e-6);
    assert_eq!(spec.dense.as_ref().expect("dense layer 0").d_ff, 33_792);
    let moe = spec.moe.as_ref().expect("K3 has MoE");
    assert_eq!(
        (moe.n_experts, moe.n_experts_active, moe.n_shared_experts),
        (896, 16, 2)
    );
    assert_eq!((moe.d_expert_ff, moe.d_latent), (3072, Some(3584)));
    assert!(moe.latent_norm && moe.renormalize && moe.has_score_bias);
    assert_eq!(moe.scoring, RouterScoring::Sigmoid);
    assert_eq!(moe.routed_scaling_factor, 1.0);
    assert_eq!(
        (moe.mxfp4_group, moe.expert_format),
        (32, ExpertFormat::Mxfp4)
    );
    let ar = spec.attn_res.as_ref().expect("K3 has Block AttnRes");
    assert_eq!((ar.block_size, ar.eps), (12, 1e-5));
}

/// Vision tower (165 tensors) and projector (3): in the release, not in the text inventory.
/// Shapes from the released header inventory (27 MoonViT blocks of width 1024).
fn vision_and_projector() -> (usize, u64) {
    let per_block: u64 = 4096 * 1024 + 1024 * 4096 + 1024 + 1024 + 1024 * 1536 + 4608 * 1024;
    let tower = 27 * per_block + 1024 + 64 * 64 * 1024 + 1024 * 3 * 14 * 14;
    let projector = 4096 * 4096 + 7168 * 4096 + 7168;
    (27 * 6 + 3 + 3, tower + projector)
}

#[test]
fn tensor_counts_match_the_released_checkpoint() {
    let spec = common::load("kimi-k3", "kimi-k3-config.json");
    let count = |f: &dyn Fn(TensorRole) -> bool| spec.tensors.iter().filter(|t| f(t.role)).count();
    let key = |r: TensorRole| r.key().to_string();
    assert_eq!(count(&|r| key(r).starts_with("kda_")), 69 * 14);
    assert_eq!(count(&|r| key(r).starts_with("mla_")), 24 * 8);
    assert_eq!(count(&|r| key(r).contains("res_")), 93 * 4 + 2);
    assert_eq!(count(&|r| key(r).ends_with("_packed")), 247_296);
    assert_eq!(count(&|r| key(r).ends_with("_scale")), 247_296);
    assert_eq!(spec.count_dtype(DType::U8), 494_592);
    let (n_vision, _) = vision_and_projector();
    assert_eq!(n_vision, 168);
    // Released: 497,220 tensors = 2,122 BF16 + 506 F32 + 494,592 U8, of which the 168
    // vision/projector tensors are BF16.
    assert_eq!(spec.tensors.len() + n_vision, 497_220);
    assert_eq!(spec.count_dtype(DType::BF16) + n_vision, 2_122);
    assert_eq!(spec.count_dtype(DType::F32), 506);
}

#[test]
fn parameter_totals_match_the_released_checkpoint() {
    let spec = common::load("kimi-k3", "kimi-k3-config.json");
    let (_, vision_params) = vision_and_projector();
    // S1: 2,779,931,837,184 logical parameters for the whole release (MXFP4 weights counted
    // at their logical size, E8M0 scales not counted), vision tower and projector included.
    assert_eq!(spec.logical_params() + vision_params, 2_779_931_837_184);
    // A third-party header statistic of the release: 1,503,647,073,024 stored elements.
    assert_eq!(spec.stored_elements() + vision_params, 1_503_647_073_024);
}

#[test]
fn shapes_match_the_released_headers() {
    let spec = common::load("kimi-k3", "kimi-k3-config.json");
    let shape = |r, l, e| {
        let t = spec.tensor(r, l, e).expect("tensor declared");
        (t.dtype, t.shape.to_vec(), t.name.clone())
    };
    use DType::*;
    use TensorRole::*;
    // Values from docs/MODEL.md §3 tables (the released headers).
    assert_eq!(shape(Embed, None, None).1, vec![163_840, 7168]);
    assert_eq!(shape(LmHead, None, None).2, "language_model.lm_head.weight");
    assert_eq!(shape(OutputResProj, None, None).1, vec![1, 7168]);
    assert_eq!(shape(KdaQ, Some(0), None).1, vec![12_288, 7168]);
    assert_eq!(
        shape(KdaQConv, Some(1), None),
        (
            F32,
            vec![12_288, 1, 4],
            "language_model.model.layers.1.self_attn.q_conv1d.weight".into()
        )
    );
    assert_eq!(shape(KdaFA, Some(2), None).1, vec![128, 7168]);
    assert_eq!(shape(KdaFB, Some(2), None).1, vec![12_288, 128]);
    assert_eq!(shape(KdaDtBias, Some(4), None).0, F32);
    assert_eq!(
        shape(KdaALog, Some(90), None),
        (
            F32,
            vec![128],
            "language_model.model.layers.90.self_attn.A_log".into()
        )
    );
    assert_eq!(shape(KdaBeta, Some(0), None).1, vec![96, 7168]);
    assert_eq!(
        shape(KdaONorm, Some(0), None),
        (
            F32,
            vec![128],
            "language_model.model.layers.0.self_attn.o_norm.weight".into()
        )
    );
    assert_eq!(shape(KdaO, Some(0), None).1, vec![7168, 12_288]);
    assert_eq!(shape(MlaQA, Some(3), None).1, vec![1536, 7168]);
    assert_eq!(shape(MlaQB, Some(3), None).1, vec![18_432, 1536]);
    assert_eq!(shape(MlaKvA, Some(7), None).1, vec![576, 7168]);
    assert_eq!(shape(MlaKvANorm, Some(7), None).1, vec![512]);
    assert_eq!(shape(MlaKvB, Some(92), None).1, vec![24_576, 512]);
    assert_eq!(shape(MlaGate, Some(92), None).1, vec![12_288, 7168]);
    assert_eq!(shape(DenseGate, Some(0), None).1, vec![33_792, 7168]);
    assert_eq!(shape(DenseDown, Some(0), None).1, vec![7168, 33_792]);
    assert_eq!(shape(Router, Some(1), None).1, vec![896, 7168]);
    assert_eq!(shape(RouterBias, Some(1), None).0, F32);
    assert_eq!(shape(SharedGate, Some(5), None).1, vec![6144, 7168]);
    assert_eq!(shape(SharedDown, Some(5), None).1, vec![7168, 6144]);
    assert_eq!(shape(LatentDown, Some(5), None).1, vec![3584, 7168]);
    assert_eq!(shape(LatentNorm, Some(5), None).1, vec![3584]);
    assert_eq!(shape(LatentUp, Some(5), None).1, vec![7168, 3584]);
    assert_eq!(
        shape(ExpertW1Packed, Some(1), Some(0)),
        (
            U8,
            vec![3072, 1792],
            "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed".into()
        )
    );
    assert_eq!(shape(ExpertW1Scale, Some(1), Some(0)).1, vec![3072, 112]);
    assert_eq!(
        shape(ExpertW3Packed, Some(50), Some(400)).1,
        vec![3072, 1792]
    );
    assert_eq!(
        shape(ExpertW2Packed, Some(92), Some(895)).1,
        vec![3584, 1536]
    );
    assert_eq!(shape(ExpertW2Scale, Some(92), Some(895)).1, vec![3584, 96]);
    // Roles a layer does not have are absent.
    assert!(spec.tensor(MlaQA, Some(0), None).is_none());
    assert!(spec.tensor(KdaQ, Some(3), None).is_none());
    assert!(spec.tensor(Router, Some(0), None).is_none());
    assert!(spec.tensor(DenseGate, Some(1), None).is_none());
    assert!(spec.tensor(ExpertW1Packed, Some(1), Some(896)).is_none());
    assert!(spec.tensor(ExpertW1Packed, Some(0), Some(0)).is_none());
    assert!(spec.tensor(InputNorm, Some(93), None).is_none());
}

#[test]
fn inventory_order_and_index_are_consistent() {
    let spec = common::load("kimi-k3", "kimi-k3-config.json");
    // Documented order: globals, then layer by layer; within a layer non-expert roles in
    // declaration order, then experts expert-major.
    let mut last: Option<(usize, usize, usize, TensorRole)> = None;
    for t in &spec.tensors {
        let key = (
            t.layer.map_or(0, |l| l + 1),
            usize::from(t.expert.is_some()),
            t.expert.unwrap_or(0),
            t.role,
        );
        if let Some(prev) = last {
            assert!(prev < key, "{} out of order", t.name);
        }
        last = Some(key);
    }
    // The index finds every tensor at its own position.
    for (i, t) in spec.tensors.iter().enumerate() {
        let found = spec.tensor(t.role, t.layer, t.expert).expect("indexed");
        assert!(std::ptr::eq(found, &spec.tensors[i]), "{}", t.name);
    }
    let names: std::collections::HashSet<&str> =
        spec.tensors.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names.len(), spec.tensors.len());
}

#[test]
fn lookup_stays_right_when_tensors_are_edited_by_hand() {
    let mut spec = common::load("kimi-k3", "kimi-k3-config.json");
    spec.tensors.truncate(2000);
    spec.tensors.remove(0); // shifts every position: the index is now stale
    let t = spec
        .tensor(TensorRole::LmHead, None, None)
        .expect("still found by the fallback scan");
    assert_eq!(t.role, TensorRole::LmHead);
    assert!(spec.tensor(TensorRole::Embed, None, None).is_none());
    spec.rebuild_index();
    let t = spec
        .tensor(TensorRole::InputNorm, Some(1), None)
        .expect("found");
    assert_eq!(
        t.name,
        "language_model.model.layers.1.input_layernorm.weight"
    );
}

#[test]
fn summary_snapshot() {
    let spec = common::load("kimi-k3", "kimi-k3-config.json");
    insta::assert_snapshot!("kimi_k3_summary", spec.summary());
}

/// `--layers N` on the real K3 layout: the first N layers keep their kinds, every declared
/// tensor of a later layer is dropped and covered by an ignored prefix that covers no kept
/// tensor (layer 5's prefix must not swallow layer 50), and the bounds are refused.
#[test]
fn first_layers_binds_a_prefix_of_the_layer_map() {
    let spec = common::load("kimi-k3", "kimi-k3-config.json");
    let n = 6;
    let part = spec.first_layers(n).expect("6 of 93 layers");
    assert_eq!(part.n_layers, n);
    assert_eq!(part.truncated_from, Some(spec.n_layers));
    assert_eq!(&part.layers[..], &spec.layers[..n], "layer kinds unchanged");
    let ignored = |name: &str| {
        part.ignored_tensor_prefixes
            .iter()
            .any(|p| name.starts_with(p.as_str()))
    };
    let bound: std::collections::HashSet<&str> =
        part.tensors.iter().map(|t| t.name.as_str()).collect();
    for t in &spec.tensors {
        let kept = t.layer.is_none_or(|l| l < n);
        assert_eq!(bound.contains(t.name.as_str()), kept, "{}", t.name);
        assert_eq!(ignored(&t.name), !kept, "{} ignored?", t.name);
    }
    // the O(1) index was rebuilt for the kept tensors
    let d = &part.tensors[part.tensors.len() - 1];
    assert_eq!(
        part.tensor(d.role, d.layer, d.expert).map(|t| &t.name),
        Some(&d.name)
    );
    assert_eq!(spec.first_layers(spec.n_layers).as_ref(), Ok(&spec));
    for bad in [0, spec.n_layers + 1] {
        let e = spec.first_layers(bad).expect_err("out of range");
        assert!(
            e.contains(&format!("--layers {bad}")) && e.contains("93"),
            "{e}"
        );
    }
}
