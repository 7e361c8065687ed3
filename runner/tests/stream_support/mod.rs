//! Shared helpers of the stream_* tests: synthetic checkpoints under target/ (not tmpfs, where
//! O_DIRECT alignment bugs hide), a tiny safetensors rewriter, byte comparisons.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use k3_engine::checkpoint::{Checkpoint, OpenOptions};
use k3_engine::synth::{self, SynthArgs, SynthSpec};
use k3_engine::weights::TrunkSource;
use k3_models::spec::ModelSpec;

pub const TINY: &str = include_str!("../../../configs/synth/tiny.toml");

/// A fresh directory under target/tmp for one test.
pub fn test_dir(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("stream")
        .join(name);
    if dir.exists() {
        std::fs::remove_dir_all(&dir).expect("remove stale test dir");
    }
    std::fs::create_dir_all(&dir).expect("create test dir under target/");
    dir
}

/// Write the tiny synthetic K3 (13 layers, 16 experts) into `dir/model` and return its spec.
pub fn synth_tiny(dir: &Path, seed: u64) -> (PathBuf, ModelSpec) {
    let spec_path = Path::new("configs/synth/tiny.toml");
    let s = SynthSpec::parse(TINY, spec_path).expect("tiny synth spec parses");
    let (config, model) = synth::config_and_spec(&s, None).expect("tiny spec validates");
    let out = dir.join("model");
    let args = SynthArgs {
        spec: spec_path.to_path_buf(),
        seed,
        out: out.clone(),
        manifest: None,
        quiet: true,
    };
    synth::write_checkpoint(&s, &config, &model, &args).expect("synth writes the checkpoint");
    (out, model)
}

/// Open without reading every expert scale (the streaming path's options).
pub fn open_ckpt(dir: &Path, spec: &ModelSpec) -> Checkpoint {
    Checkpoint::open_with(
        dir,
        spec,
        &OpenOptions {
            validate_expert_scales: false,
        },
    )
    .expect("checkpoint opens")
}

/// A fresh test directory `name` with the tiny synthetic K3 of `seed` written into it and
/// opened with [`open_ckpt`]: (model directory, spec, checkpoint).
pub fn tiny_opened(name: &str, seed: u64) -> (PathBuf, ModelSpec, Checkpoint) {
    let dir = test_dir(name);
    let (model, spec) = synth_tiny(&dir, seed);
    let ck = open_ckpt(&model, &spec);
    (model, spec, ck)
}

/// One tensor of a safetensors file: (name, dtype, shape, bytes).
pub type Raw = (String, String, Vec<usize>, Vec<u8>);

/// Read every tensor of a safetensors file, in file order.
pub fn read_safetensors(path: &Path) -> Vec<Raw> {
    let bytes = std::fs::read(path).expect("read shard");
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).expect("header json");
    let data = &bytes[8 + n..];
    let mut out: Vec<(u64, Raw)> = header
        .into_iter()
        .filter(|(k, _)| k != "__metadata__")
        .map(|(k, v)| {
            let dtype = v["dtype"].as_str().expect("dtype").to_string();
            let shape: Vec<usize> = v["shape"]
                .as_array()
                .expect("shape")
                .iter()
                .map(|x| x.as_u64().expect("dim") as usize)
                .collect();
            let o = v["data_offsets"].as_array().expect("offsets");
            let (a, b) = (
                o[0].as_u64().expect("begin") as usize,
                o[1].as_u64().expect("end") as usize,
            );
            (a as u64, (k, dtype, shape, data[a..b].to_vec()))
        })
        .collect();
    out.sort_by_key(|x| x.0);
    out.into_iter().map(|x| x.1).collect()
}

/// Write tensors in the given order (header padded to 8 bytes like the Python writer).
pub fn write_safetensors(path: &Path, tensors: &[Raw]) {
    let mut header = serde_json::Map::new();
    let mut meta = serde_json::Map::new();
    meta.insert("format".into(), "pt".into());
    header.insert("__metadata__".into(), meta.into());
    let mut off = 0usize;
    for (name, dtype, shape, b) in tensors {
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [off, off + b.len()]}),
        );
        off += b.len();
    }
    // serde_json's Map keeps insertion order only with preserve_order; offsets carry the
    // order anyway, readers sort by offset.
    let mut h = serde_json::to_vec(&header).expect("header json");
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + h.len() + off);
    out.extend_from_slice(&(h.len() as u64).to_le_bytes());
    out.extend_from_slice(&h);
    for t in tensors {
        out.extend_from_slice(&t.3);
    }
    std::fs::write(path, out).expect("write shard");
}

/// The shard file holding a tensor (from the index).
pub fn shard_of(model_dir: &Path, tensor: &str) -> PathBuf {
    let idx: serde_json::Value = serde_json::from_slice(
        &std::fs::read(model_dir.join("model.safetensors.index.json")).expect("index"),
    )
    .expect("index json");
    model_dir.join(idx["weight_map"][tensor].as_str().expect("tensor in index"))
}

/// Walk `tokens` cyclic passes over the layers and compare every tensor with the checkpoint.
pub fn check_passes(t: &mut dyn TrunkSource, spec: &ModelSpec, ck: &Checkpoint, tokens: usize) {
    for _ in 0..tokens {
        for l in 0..spec.n_layers {
            let lw = t.layer(l).expect("layer");
            let n_decl = spec
                .tensors
                .iter()
                .filter(|d| d.layer == Some(l) && d.expert.is_none())
                .count();
            assert_eq!(lw.tensors.len(), n_decl, "layer {l}");
            for tb in &lw.tensors {
                let want = ck.try_bytes(&tb.decl.name).expect("in checkpoint");
                assert!(
                    tb.bytes == want,
                    "layer {l} tensor {} differs",
                    tb.decl.name
                );
                assert_eq!(
                    lw.get(tb.decl.role).map(|x| x.bytes.len()),
                    Some(want.len())
                );
            }
        }
    }
}
