//! Small K3-family checkpoints load with the same kimi-k3.toml, and the inventory equals the
//! tensors the independent oracle writer (fixtures/oracle/synth_k3.py) put in the safetensors
//! headers. Committed data: tests/data/synth-{A,C}/config.json (written by synth_k3.py) and
//! tensors.tsv (name, dtype, shape of every tensor in that run's headers). Regenerate with
//! `python synth_k3.py --preset A --out DIR` and the header dump described in the tsv header.

mod common;

use k3_models::spec::{AttnKind, TensorRole};

#[test]
fn preset_a_inventory_equals_the_oracle_headers() {
    let spec = common::load("kimi-k3", "synth-A/config.json");
    assert_eq!(spec.n_layers, 13);
    assert_eq!(spec.layers_with_attn(AttnKind::Mla), vec![3, 7, 11, 12]);
    assert_eq!(spec.attn_res.as_ref().map(|a| a.block_size), Some(5));
    let ckpt = common::read_tsv("synth-A/tensors.tsv");
    let diff = common::diff_inventory(&spec, &ckpt);
    assert!(diff.is_empty(), "{diff:#?}");
    // The oracle also writes vision stubs; they are the only extra tensors.
    assert_eq!(ckpt.len() - spec.tensors.len(), 4);
}

#[test]
fn preset_c_inventory_equals_the_oracle_headers() {
    // Preset C: conv kernel 3, 8 KDA heads of 16 (A_log stored as 16 entries), top-8 of 24.
    let spec = common::load("kimi-k3", "synth-C/config.json");
    let kda = spec.kda.as_ref().expect("KDA");
    assert_eq!(
        (kda.n_heads, kda.head_dim, kda.conv_kernel, kda.a_log_len),
        (8, 16, 3, 16)
    );
    let a_log = spec
        .tensor(TensorRole::KdaALog, Some(0), None)
        .expect("A_log");
    assert_eq!(a_log.shape.to_vec(), vec![16]);
    let diff = common::diff_inventory(&spec, &common::read_tsv("synth-C/tensors.tsv"));
    assert!(diff.is_empty(), "{diff:#?}");
}

#[test]
fn a_wrong_inventory_is_detected_by_the_comparison() {
    // The comparison used above must be able to fail.
    let spec = common::load("kimi-k3", "synth-C/config.json");
    let mut ckpt = common::read_tsv("synth-C/tensors.tsv");
    let name = "language_model.model.layers.0.self_attn.A_log".to_string();
    ckpt.insert(name.clone(), ("F32".into(), vec![8]));
    ckpt.insert(
        "language_model.model.layers.0.extra.weight".into(),
        ("BF16".into(), vec![1]),
    );
    let diff = common::diff_inventory(&spec, &ckpt);
    assert_eq!(diff.len(), 2, "{diff:#?}");
}

/// Fixtures written by the fixture generator (fixtures/models/*/ckpt/), when present, plus
/// any checkpoint directories listed in `K3_CHECK_CKPT_DIRS` (colon-separated): compare
/// against their real safetensors headers.
#[test]
fn generated_fixtures_match_their_headers() {
    let root = common::repo().join("fixtures/models");
    let mut dirs: Vec<std::path::PathBuf> = std::fs::read_dir(&root)
        .map(|d| d.flatten().map(|e| e.path().join("ckpt")).collect())
        .unwrap_or_default();
    if let Ok(extra) = std::env::var("K3_CHECK_CKPT_DIRS") {
        dirs.extend(extra.split(':').filter(|s| !s.is_empty()).map(Into::into));
    }
    let mut checked = 0;
    for ckpt in dirs {
        if !ckpt.join("config.json").is_file() {
            continue;
        }
        let has_shards = std::fs::read_dir(&ckpt)
            .map(|d| {
                d.flatten()
                    .any(|f| f.path().extension().is_some_and(|x| x == "safetensors"))
            })
            .unwrap_or(false);
        if !has_shards {
            continue;
        }
        // Kimi-Linear-style fixtures (flat config, `KimiLinearForCausalLM`) have their own
        // manifest; every other fixture is K3-family.
        let config = std::fs::read_to_string(ckpt.join("config.json")).unwrap();
        let manifest = if config.contains("\"KimiLinearForCausalLM\"")
            && !config.contains("\"text_config\"")
        {
            "kimi-linear-48b"
        } else {
            "kimi-k3"
        };
        let spec = k3_models::load_spec(&common::manifest(manifest), &ckpt.join("config.json"))
            .unwrap_or_else(|e| panic!("{}: {e}", ckpt.display()));
        let diff = common::diff_inventory(&spec, &common::read_headers(&ckpt));
        assert!(diff.is_empty(), "{}: {diff:#?}", ckpt.display());
        checked += 1;
    }
    eprintln!("note: compared {checked} generated fixture checkpoint(s)");
}
