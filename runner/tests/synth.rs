//! `k3-run synth`: the written checkpoint loads through the strict loader, has the documented
//! layout (whole layers per shard, trunk contiguous before the experts), the conditioning it
//! claims, K3 tokenizer files, and is byte-identical for a seed.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use k3_engine::checkpoint::Checkpoint;
use k3_engine::synth::{self, SynthArgs, SynthSpec, mxfp4, tokenizer};
use k3_models::spec::{ModelSpec, RoleScope, TensorDecl, TensorRole};
use sha2::{Digest, Sha256};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn spec_path(name: &str) -> PathBuf {
    repo().join("configs/synth").join(format!("{name}.toml"))
}

fn write(name: &str, seed: u64, out: &Path) -> synth::SynthReport {
    let args = SynthArgs {
        spec: spec_path(name),
        seed,
        out: out.to_path_buf(),
        manifest: None,
        quiet: true,
    };
    synth::run(&args).unwrap_or_else(|e| panic!("synth {name}: {e}"))
}

fn load_model(dir: &Path) -> ModelSpec {
    let config = std::fs::read_to_string(dir.join("config.json")).unwrap();
    k3_models::load_spec_from_str(
        synth::BUILTIN_MANIFEST,
        "kimi-k3.toml",
        &config,
        &dir.join("config.json").display().to_string(),
    )
    .unwrap_or_else(|e| panic!("config.json written by synth does not load: {e}"))
}

fn sha_of_dir(dir: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        let bytes = std::fs::read(e.path()).unwrap();
        let h = Sha256::digest(&bytes);
        let hex: String = h.iter().map(|b| format!("{b:02x}")).collect();
        out.insert(e.file_name().to_string_lossy().into_owned(), hex);
    }
    out
}

#[test]
fn tiny_loads_through_the_strict_reader_with_release_layout() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("tiny");
    let report = write("tiny", 1, &out);
    let model = load_model(&out);
    assert_eq!(model.n_layers, 13);
    let ck = Checkpoint::open(&out, &model).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(ck.shards().len(), 4);
    assert_eq!(report.n_shards, 4);
    // Index total_size = payload bytes; every declared tensor plus 4 vision stubs.
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    assert_eq!(
        index["metadata"]["total_size"].as_u64(),
        Some(ck.total_tensor_bytes())
    );
    assert_eq!(ck.tensor_names().len(), model.tensors.len() + 4);
    assert!(ck.tensor_names().any(|n| n.starts_with("vision_tower.")));
    // Released names.
    assert!(
        ck.info("language_model.model.embed_tokens.weight")
            .is_some()
    );
    assert!(ck.info("language_model.lm_head.weight").is_some());
    assert_eq!(
        ck.info("language_model.model.layers.1.block_sparse_moe.experts.15.w2.weight_scale"),
        Some(("U8", &[64usize, 2][..]))
    );
    // No partial directory left behind.
    let leftovers: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(leftovers, ["tiny"]);
    check_layout(&ck, &model);
}

/// Each layer: one shard; trunk tensors one contiguous range; experts after it, each expert's
/// tensors contiguous.
fn check_layout(ck: &Checkpoint, model: &ModelSpec) {
    for l in 0..model.n_layers {
        let of_layer: Vec<&TensorDecl> = model
            .tensors
            .iter()
            .filter(|t| t.layer == Some(l))
            .collect();
        let trunk: Vec<&TensorDecl> = of_layer
            .iter()
            .copied()
            .filter(|t| t.role.scope() != RoleScope::Expert)
            .collect();
        let all = ck
            .contiguous_range(&of_layer)
            .unwrap_or_else(|e| panic!("layer {l}: {e}"));
        let tr = ck
            .contiguous_range(&trunk)
            .unwrap_or_else(|e| panic!("layer {l} trunk: {e}"));
        assert_eq!(
            tr.file_offset, all.file_offset,
            "layer {l}: trunk must come first"
        );
        let Some(moe) = &model.moe else { continue };
        for e in 0..moe.n_experts {
            let ex: Vec<&TensorDecl> = of_layer
                .iter()
                .copied()
                .filter(|t| t.expert == Some(e))
                .collect();
            if ex.is_empty() {
                continue;
            }
            let r = ck
                .contiguous_range(&ex)
                .unwrap_or_else(|err| panic!("layer {l} expert {e}: {err}"));
            assert!(r.file_offset >= tr.file_offset + tr.n_bytes);
        }
    }
}

#[test]
fn same_seed_same_bytes_other_seed_other_weights() {
    let tmp = tempfile::tempdir().unwrap();
    let a = tmp.path().join("a");
    let b = tmp.path().join("b");
    let c = tmp.path().join("c");
    write("odd9", 7, &a);
    write("odd9", 7, &b);
    write("odd9", 8, &c);
    let (ha, hb, hc) = (sha_of_dir(&a), sha_of_dir(&b), sha_of_dir(&c));
    assert!(ha.len() >= 9, "{ha:?}");
    assert_eq!(ha, hb);
    for (f, h) in &ha {
        if f.ends_with(".safetensors") {
            assert_ne!(h, &hc[f], "{f} did not change with the seed");
        } else if f != "synth_manifest.json" {
            assert_eq!(h, &hc[f], "{f} should not depend on the seed");
        }
    }
}

#[test]
fn refuses_a_non_empty_output_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("busy");
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("keep.txt"), b"mine").unwrap();
    let args = SynthArgs {
        spec: spec_path("tiny"),
        seed: 1,
        out: out.clone(),
        manifest: None,
        quiet: true,
    };
    let err = synth::run(&args).unwrap_err();
    assert!(matches!(err, synth::SynthError::OutExists { .. }), "{err}");
    assert_eq!(std::fs::read(out.join("keep.txt")).unwrap(), b"mine");
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 1);
}

fn std_of(v: &[f32]) -> f64 {
    let n = v.len() as f64;
    let m = v.iter().map(|&x| f64::from(x)).sum::<f64>() / n;
    (v.iter().map(|&x| (f64::from(x) - m).powi(2)).sum::<f64>() / n).sqrt()
}

fn widen(bits: &[u16]) -> Vec<f32> {
    bits.iter()
        .map(|&b| f32::from_bits(u32::from(b) << 16))
        .collect()
}

#[test]
fn conditioning_is_what_the_spec_says() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("odd9");
    write("odd9", 3, &out);
    let model = load_model(&out);
    let ck = Checkpoint::open(&out, &model).unwrap();
    let t = |role, layer: usize, expert| model.tensor(role, Some(layer), expert).unwrap();
    let d = model.d_model as f64;
    // Output projections: gain 0.25 / sqrt(fan_in).
    let o = widen(&ck.bf16_bits(t(TensorRole::KdaO, 0, None)));
    let fan_in = t(TensorRole::KdaO, 0, None).shape[1] as f64;
    let want = 0.25 / fan_in.sqrt();
    assert!(
        (std_of(&o) / want - 1.0).abs() < 0.1,
        "o_proj std {} want {want}",
        std_of(&o)
    );
    // KDA q correlated with k at 0.8.
    let q = widen(&ck.bf16_bits(t(TensorRole::KdaQ, 1, None)));
    let k = widen(&ck.bf16_bits(t(TensorRole::KdaK, 1, None)));
    let dot: f64 = q
        .iter()
        .zip(&k)
        .map(|(&a, &b)| f64::from(a) * f64::from(b))
        .sum();
    let corr = dot / (q.len() as f64 * std_of(&q) * std_of(&k));
    assert!((corr - 0.8).abs() < 0.05, "q/k correlation {corr}");
    // Router bias std 2, router gain 2.
    let bias = ck.f32_vec(t(TensorRole::RouterBias, 2, None));
    assert_eq!(bias.len(), 8);
    let router = widen(&ck.bf16_bits(t(TensorRole::Router, 2, None)));
    assert!((std_of(&router) * d.sqrt() / 2.0 - 1.0).abs() < 0.15);
    // Norm weights 1 +- 0.1.
    let nw = widen(&ck.bf16_bits(t(TensorRole::InputNorm, 4, None)));
    let mean = nw.iter().map(|&x| f64::from(x)).sum::<f64>() / nw.len() as f64;
    assert!((mean - 1.0).abs() < 0.05 && (std_of(&nw) - 0.1).abs() < 0.04);
    // A_log: 3 heads used, padding exactly zero; dt_bias has no zeros.
    let a_log = ck.f32_vec(t(TensorRole::KdaALog, 0, None));
    assert_eq!(a_log.len(), 32);
    assert!(
        a_log[..3]
            .iter()
            .all(|&x| x != 0.0 && (-0.7..1.4).contains(&x))
    );
    assert!(a_log[3..].iter().all(|&x| x.to_bits() == 0));
    assert!(
        ck.f32_vec(t(TensorRole::KdaDtBias, 0, None))
            .iter()
            .all(|&x| x != 0.0)
    );
    // Conv taps: current-token tap (last) raised by 1.
    let conv = ck.f32_vec(t(TensorRole::KdaVConv, 0, None));
    let kk = 3;
    let last_mean =
        conv.chunks(kk).map(|c| f64::from(c[kk - 1])).sum::<f64>() / (conv.len() / kk) as f64;
    assert!((last_mean - 1.0).abs() < 0.1, "last tap mean {last_mean}");
    // MXFP4 experts: decode, gain 2/sqrt(latent) for w1, scale bytes sane.
    let moe = model.moe.as_ref().unwrap();
    let packed = ck.bytes(t(TensorRole::ExpertW1Packed, 1, Some(5)));
    let scales = ck.bytes(t(TensorRole::ExpertW1Scale, 1, Some(5)));
    let cols = moe.d_latent.unwrap();
    assert_eq!(packed.len(), moe.d_expert_ff * cols / 2);
    assert!(scales.iter().all(|&b| b != 0xFF && (100..140).contains(&b)));
    let mut w = vec![0f32; packed.len() * 2];
    for (r, row) in w.chunks_mut(cols).enumerate() {
        mxfp4::dequantize_row(
            &packed[r * cols / 2..(r + 1) * cols / 2],
            &scales[r * cols / 32..(r + 1) * cols / 32],
            row,
        );
    }
    let want = 2.0 / (cols as f64).sqrt();
    assert!(
        (std_of(&w) / want - 1.0).abs() < 0.15,
        "w1 std {} want {want}",
        std_of(&w)
    );
}

#[test]
fn tokenizer_files_follow_the_k3_layout() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("odd9");
    write("odd9", 1, &out);
    let model = load_model(&out);
    let text = std::fs::read_to_string(out.join("tiktoken.model")).unwrap();
    let base = tokenizer::n_ranks(model.vocab_size);
    assert_eq!(base, 256);
    assert_eq!(text.lines().count(), base);
    assert_eq!(text.lines().nth(65), Some("QQ== 65"));
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("tokenizer_config.json")).unwrap()).unwrap();
    let dec = &cfg["added_tokens_decoder"];
    assert_eq!(dec[(base + 2).to_string()]["content"], "<|end_of_msg|>");
    assert_eq!(dec[(base + 255).to_string()]["content"], "[PAD]");
    // config.json's stop token is <|end_of_msg|>.
    assert_eq!(model.eos_token_ids, vec![base as u32 + 2]);
    // With a larger vocabulary: vocab = ranks + 256.
    assert_eq!(tokenizer::ranks(8192).len() + 256, 8192);
}

#[test]
fn every_shipped_synth_spec_builds_a_valid_model_and_k3_mini_has_the_stated_size() {
    let dir = repo().join("configs/synth");
    let mut seen = Vec::new();
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_none_or(|x| x != "toml") {
            continue;
        }
        let s = SynthSpec::load(&p).unwrap_or_else(|e| panic!("{e}"));
        let (_, model) = synth::config_and_spec(&s, None).unwrap_or_else(|e| panic!("{e}"));
        let sizes = synth::sizes(&model);
        seen.push(s.name.clone());
        if s.name.starts_with("k3-counts") {
            // the release's counts: 93 layers, 896 routed experts top-16 on the 92 MoE layers,
            // each expert 3 packed + 3 scale tensors
            let moe = model.moe.as_ref().expect("k3-counts has routed experts");
            assert_eq!(
                (model.n_layers, moe.n_experts, moe.n_experts_active),
                (93, 896, 16)
            );
            let routed = model.tensors.iter().filter(|t| t.expert.is_some()).count();
            assert_eq!(routed, 92 * 896 * 6);
        }
        if s.name.starts_with("k3-mini") {
            assert_eq!(model.n_layers, 93);
            let gb = |b: u64| b as f64 / 1e9;
            assert!(
                (2.0..3.0).contains(&gb(sizes.trunk_bytes)),
                "trunk {}",
                gb(sizes.trunk_bytes)
            );
            assert!(
                (2.0..3.0).contains(&gb(sizes.expert_bytes)),
                "experts {}",
                gb(sizes.expert_bytes)
            );
        }
    }
    seen.sort();
    assert_eq!(
        seen,
        [
            "k3-counts",
            "k3-counts-flat",
            "k3-mini",
            "k3-mini-flat",
            "k3-mini-loop",
            "k3-wide",
            "k3-wide-small",
            "odd9",
            "tiny"
        ]
    );
}
