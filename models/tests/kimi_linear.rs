//! The same schema describes Kimi-Linear-48B (executed on a synthetic fixture by
//! `runner/tests/kimi_linear.rs`):
//! flat config layout, softplus KDA gate, low-rank output gate, direct q_proj, SiLU, BF16
//! experts, plain residuals. Config from docs/MODEL.md §1-§3 [KL] columns.

mod common;

use k3_models::spec::{
    Activation, AttnKind, DType, ExpertFormat, FfnKind, KdaGateSpec, TensorRole,
};

#[test]
fn kimi_linear_48b_loads() {
    let spec = common::load("kimi-linear-48b", "kimi-linear-48b-config.json");
    assert_eq!(spec.family, "kimi-linear");
    assert_eq!((spec.d_model, spec.n_layers), (2304, 27));
    assert_eq!(
        spec.layers_with_attn(AttnKind::Mla),
        vec![3, 7, 11, 15, 19, 23, 26]
    );
    assert_eq!(spec.layers_with_attn(AttnKind::Kda).len(), 20);
    assert_eq!(spec.layers_with_ffn(FfnKind::Dense), vec![0]);
    assert_eq!(spec.activation, Activation::Silu);
    assert!(spec.attn_res.is_none());
    let kda = spec.kda.as_ref().expect("KDA");
    // gate_lower_bound is declared in this config but never read by Kimi-Linear's code.
    assert_eq!(kda.gate, KdaGateSpec::Softplus);
    assert!(!kda.full_rank_output_gate);
    assert_eq!(kda.a_log_len, 32);
    let mla = spec.mla.as_ref().expect("MLA");
    assert_eq!((mla.q_lora_rank, mla.output_gate), (None, false));
    let moe = spec.moe.as_ref().expect("MoE");
    assert_eq!(
        (moe.n_experts, moe.n_experts_active, moe.n_shared_experts),
        (256, 8, 1)
    );
    assert_eq!(
        (moe.d_latent, moe.expert_format),
        (None, ExpertFormat::Bf16)
    );
    assert!((moe.routed_scaling_factor - 2.446).abs() < 1e-6);

    let t = |r, l, e| spec.tensor(r, l, e).expect("declared");
    assert_eq!(
        t(TensorRole::KdaALog, Some(0), None).shape.to_vec(),
        vec![1, 1, 32, 1]
    );
    assert_eq!(
        t(TensorRole::KdaGateA, Some(0), None).shape.to_vec(),
        vec![128, 2304]
    );
    assert_eq!(
        t(TensorRole::KdaGateB, Some(0), None).shape.to_vec(),
        vec![4096, 128]
    );
    assert_eq!(
        t(TensorRole::KdaDtBias, Some(0), None).shape.to_vec(),
        vec![4096]
    );
    assert_eq!(
        t(TensorRole::MlaQ, Some(3), None).shape.to_vec(),
        vec![32 * 192, 2304]
    );
    assert_eq!(
        t(TensorRole::MlaKvA, Some(3), None).shape.to_vec(),
        vec![576, 2304]
    );
    assert_eq!(
        t(TensorRole::SharedGate, Some(1), None).shape.to_vec(),
        vec![1024, 2304]
    );
    let w2 = t(TensorRole::ExpertW2, Some(26), Some(255));
    assert_eq!(
        (w2.dtype, w2.shape.to_vec()),
        (DType::BF16, vec![2304, 1024])
    );
    assert_eq!(
        w2.name,
        "model.layers.26.block_sparse_moe.experts.255.w2.weight"
    );
    assert!(spec.tensor(TensorRole::MlaGate, Some(3), None).is_none());
    assert!(
        spec.tensor(TensorRole::AttnResProj, Some(0), None)
            .is_none()
    );
    assert_eq!(spec.count_dtype(DType::U8), 0);
    // 26 MoE layers x 256 experts x 3 weights.
    let experts = spec.tensors.iter().filter(|t| t.expert.is_some()).count();
    assert_eq!(experts, 26 * 256 * 3);
}

#[test]
fn the_k3_manifest_rejects_a_kimi_linear_config() {
    let text =
        std::fs::read_to_string(common::data("kimi-linear-48b-config.json")).expect("fixture");
    let m = std::fs::read_to_string(common::manifest("kimi-k3")).expect("manifest");
    let e = k3_models::load_spec_from_str(&m, "kimi-k3.toml", &text, "kl/config.json")
        .expect_err("wrong family");
    // Flat layout: the K3 manifest looks for text_config and its pins fail.
    assert!(e.iter().any(|x| x.mentions("text_config")), "{e}");
    assert!(e.iter().any(|x| x.mentions("pins.\"model_type\"")), "{e}");
}
