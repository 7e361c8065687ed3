//! Bad checkpoints get a clear error naming the file and the tensor, never a panic.
//!
//! Each test writes the tiny synthetic checkpoint into a temp dir (k3-run synth), corrupts it
//! in one way and asserts the error variant and that the message names the file and tensor.
// `CheckpointError` holds paths: 32 bytes each on Windows, over clippy's line there only.
#![cfg_attr(windows, allow(clippy::result_large_err))]

use std::fs;
use std::path::{Path, PathBuf};

use k3_engine::checkpoint::{Checkpoint, CheckpointError, OpenOptions, check_e8m0};
use k3_engine::synth::{self, SynthArgs};
use k3_models::spec::{DType, ModelSpec, TensorDecl, TensorRole};

struct Fixture {
    _tmp: tempfile::TempDir,
    dir: PathBuf,
    model: ModelSpec,
}

fn fixture() -> Fixture {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    let args = SynthArgs {
        spec: Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/synth/tiny.toml"),
        seed: 11,
        out: dir.clone(),
        manifest: None,
        quiet: true,
    };
    synth::run(&args).unwrap();
    let config = fs::read_to_string(dir.join("config.json")).unwrap();
    let model = k3_models::load_spec_from_str(
        synth::BUILTIN_MANIFEST,
        "kimi-k3.toml",
        &config,
        "config.json",
    )
    .unwrap();
    Fixture {
        _tmp: tmp,
        dir,
        model,
    }
}

impl Fixture {
    fn open(&self) -> Result<Checkpoint, CheckpointError> {
        Checkpoint::open(&self.dir, &self.model)
    }
    fn decl(&self, role: TensorRole, layer: Option<usize>, expert: Option<usize>) -> TensorDecl {
        self.model.tensor(role, layer, expert).unwrap().clone()
    }
    /// (shard path, tensor name) of a declared tensor, from a clean open.
    fn where_is(&self, d: &TensorDecl) -> (PathBuf, u64, u64) {
        let ck = self.open().unwrap();
        let loc = ck.location(d);
        (loc.shard_path, loc.file_offset, loc.n_bytes)
    }
    fn index(&self) -> serde_json::Value {
        serde_json::from_slice(&fs::read(self.dir.join("model.safetensors.index.json")).unwrap())
            .unwrap()
    }
    fn write_index(&self, v: &serde_json::Value) {
        fs::write(
            self.dir.join("model.safetensors.index.json"),
            serde_json::to_vec_pretty(v).unwrap(),
        )
        .unwrap();
    }
    fn shard_of(&self, name: &str) -> PathBuf {
        let idx = self.index();
        self.dir.join(idx["weight_map"][name].as_str().unwrap())
    }
}

/// Parse a shard's header; let `edit` change it; write header + the old data (+ `extra`).
fn rewrite_header(
    path: &Path,
    extra: &[u8],
    edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>),
) {
    let bytes = fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    edit(&mut header);
    let mut json = serde_json::to_string(&header).unwrap();
    while !json.len().is_multiple_of(8) {
        json.push(' ');
    }
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(json.as_bytes());
    out.extend_from_slice(&bytes[8 + n..]);
    out.extend_from_slice(extra);
    fs::write(path, out).unwrap();
}

fn data_len(path: &Path) -> u64 {
    let bytes = fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap());
    bytes.len() as u64 - 8 - n
}

/// The message names the file (by file name) and, when given, the tensor.
fn assert_names(err: &CheckpointError, file: &Path, tensor: Option<&str>) {
    let msg = err.to_string();
    let fname = file.file_name().unwrap().to_string_lossy();
    assert!(
        msg.contains(fname.as_ref()),
        "message does not name {fname}: {msg}"
    );
    if let Some(t) = tensor {
        assert!(msg.contains(t), "message does not name tensor {t}: {msg}");
    }
}

const Q0: &str = "language_model.model.layers.0.self_attn.q_proj.weight";

#[test]
fn clean_fixture_opens() {
    let f = fixture();
    let ck = f.open().unwrap();
    assert_eq!(ck.shards().len(), 4);
}

#[test]
fn truncated_shard() {
    let f = fixture();
    let path = f.dir.join("model-00004-of-00004.safetensors");
    let len = fs::metadata(&path).unwrap().len();
    fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(len - 100)
        .unwrap();
    let err = f.open().unwrap_err();
    let CheckpointError::Truncated {
        tensor,
        expected_len,
        actual_len,
        ..
    } = &err
    else {
        panic!("wrong variant: {err:?}");
    };
    assert_eq!((*expected_len, *actual_len), (len, len - 100));
    assert_names(&err, &path, Some(tensor));
    assert!(!tensor.is_empty());
}

#[test]
fn corrupted_header_bad_json() {
    let f = fixture();
    let path = f.shard_of(Q0);
    let mut bytes = fs::read(&path).unwrap();
    bytes[8] = b'['; // the header's opening brace
    bytes[20] = b'}';
    fs::write(&path, bytes).unwrap();
    let err = f.open().unwrap_err();
    assert!(matches!(err, CheckpointError::HeaderJson { .. }), "{err:?}");
    assert_names(&err, &path, Some("header"));
}

#[test]
fn corrupted_header_absurd_length() {
    let f = fixture();
    let path = f.shard_of(Q0);
    let mut bytes = fs::read(&path).unwrap();
    bytes[..8].copy_from_slice(&(u64::MAX - 3).to_le_bytes());
    fs::write(&path, bytes).unwrap();
    let err = f.open().unwrap_err();
    assert!(
        matches!(err, CheckpointError::HeaderLength { .. }),
        "{err:?}"
    );
    assert_names(&err, &path, Some("header"));
}

#[test]
fn offsets_out_of_range() {
    let f = fixture();
    let path = f.shard_of(Q0);
    let dl = data_len(&path);
    rewrite_header(&path, &[], |h| {
        let e = h.get_mut(Q0).unwrap();
        let offs = e["data_offsets"].as_array().unwrap();
        let n = offs[1].as_u64().unwrap() - offs[0].as_u64().unwrap();
        e["data_offsets"] = serde_json::json!([dl + 64, dl + 64 + n]);
    });
    let err = f.open().unwrap_err();
    assert!(
        matches!(err, CheckpointError::OffsetsOutOfRange { .. }),
        "{err:?}"
    );
    assert_names(&err, &path, Some(Q0));
}

#[test]
fn offsets_inconsistent_with_dtype_and_shape() {
    let f = fixture();
    let path = f.shard_of(Q0);
    rewrite_header(&path, &[], |h| {
        h.get_mut(Q0).unwrap()["shape"] = serde_json::json!([3, 5]);
    });
    let err = f.open().unwrap_err();
    assert!(matches!(err, CheckpointError::DataSize { .. }), "{err:?}");
    assert_names(&err, &path, Some(Q0));
}

#[test]
fn overlapping_offsets() {
    let f = fixture();
    let path = f.shard_of(Q0);
    let k0 = "language_model.model.layers.0.self_attn.k_proj.weight";
    rewrite_header(&path, &[], |h| {
        let q = h[Q0]["data_offsets"].clone();
        h.get_mut(k0).unwrap()["data_offsets"] = q;
    });
    let err = f.open().unwrap_err();
    assert!(
        matches!(err, CheckpointError::OffsetsOverlap { .. }),
        "{err:?}"
    );
    assert_names(&err, &path, Some(Q0));
}

#[test]
fn wrong_dtype() {
    let f = fixture();
    let path = f.shard_of(Q0);
    rewrite_header(&path, &[], |h| {
        h.get_mut(Q0).unwrap()["dtype"] = serde_json::json!("F16"); // same size as BF16
    });
    let err = f.open().unwrap_err();
    let CheckpointError::WrongDtype {
        expected, found, ..
    } = &err
    else {
        panic!("wrong variant: {err:?}");
    };
    assert_eq!((expected.as_str(), found.as_str()), ("BF16", "F16"));
    assert_names(&err, &path, Some(Q0));
}

#[test]
fn wrong_shape() {
    let f = fixture();
    let path = f.shard_of(Q0);
    let d = f.decl(TensorRole::KdaQ, Some(0), None);
    rewrite_header(&path, &[], |h| {
        // Same element count, different shape.
        h.get_mut(Q0).unwrap()["shape"] = serde_json::json!([d.shape[0] * 2, d.shape[1] / 2]);
    });
    let err = f.open().unwrap_err();
    assert!(matches!(err, CheckpointError::WrongShape { .. }), "{err:?}");
    assert_names(&err, &path, Some(Q0));
}

#[test]
fn missing_tensor() {
    let f = fixture();
    let path = f.shard_of(Q0);
    rewrite_header(&path, &[], |h| {
        h.remove(Q0);
    });
    let mut idx = f.index();
    idx["weight_map"].as_object_mut().unwrap().remove(Q0);
    f.write_index(&idx);
    let err = f.open().unwrap_err();
    assert!(
        matches!(err, CheckpointError::MissingTensor { more: 0, .. }),
        "{err:?}"
    );
    assert_names(&err, &f.dir.join("model.safetensors.index.json"), Some(Q0));
}

#[test]
fn unexpected_tensor_under_the_model_namespace() {
    let f = fixture();
    let path = f.shard_of(Q0);
    let extra = "language_model.model.layers.0.self_attn.q_norm.weight";
    let vision = "vision_tower.encoder.extra.weight";
    let dl = data_len(&path);
    rewrite_header(&path, &[0u8; 8], |h| {
        h.insert(
            extra.into(),
            serde_json::json!({"dtype": "BF16", "shape": [2], "data_offsets": [dl, dl + 4]}),
        );
        h.insert(
            vision.into(),
            serde_json::json!({"dtype": "BF16", "shape": [2], "data_offsets": [dl + 4, dl + 8]}),
        );
    });
    let mut idx = f.index();
    let file = path.file_name().unwrap().to_string_lossy().into_owned();
    idx["weight_map"][extra] = file.clone().into();
    idx["weight_map"][vision] = file.into();
    f.write_index(&idx);
    let err = f.open().unwrap_err();
    assert!(
        matches!(err, CheckpointError::UnexpectedTensor { more: 0, .. }),
        "{err:?}"
    );
    assert_names(&err, &path, Some(extra));
    assert!(
        !err.to_string().contains(vision),
        "vision tensors are ignored: {err}"
    );
}

#[test]
fn e8m0_nan_scale_byte() {
    let f = fixture();
    let d = f.decl(TensorRole::ExpertW3Scale, Some(5), Some(7));
    let (path, off, n) = f.where_is(&d);
    let mut bytes = fs::read(&path).unwrap();
    bytes[(off + n - 1) as usize] = 0xFF;
    fs::write(&path, bytes).unwrap();
    // Resident open checks every scale.
    let err = f.open().unwrap_err();
    let CheckpointError::E8m0Nan { index, .. } = &err else {
        panic!("wrong variant: {err:?}");
    };
    assert_eq!(*index as u64, n - 1);
    assert_names(&err, &path, Some(&d.name));
    // Streaming open defers the check to the expert's read.
    let opts = OpenOptions {
        validate_expert_scales: false,
    };
    let ck = Checkpoint::open_with(&f.dir, &f.model, &opts).unwrap();
    ck.validate_expert_scales(&f.model, 5, 6).unwrap();
    let err = ck.validate_expert_scales(&f.model, 5, 7).unwrap_err();
    assert!(matches!(err, CheckpointError::E8m0Nan { .. }), "{err:?}");
    assert_names(&err, &path, Some(&d.name));
    let err = check_e8m0(&path, &d.name, ck.bytes(&d)).unwrap_err();
    assert_names(&err, &path, Some(&d.name));
}

#[test]
fn a_log_padding_not_zero() {
    let f = fixture();
    let d = f.decl(TensorRole::KdaALog, Some(2), None);
    let n_heads = f.model.kda.as_ref().unwrap().n_heads;
    let (path, off, _) = f.where_is(&d);
    let mut bytes = fs::read(&path).unwrap();
    let at = (off as usize) + 4 * (n_heads + 1);
    bytes[at..at + 4].copy_from_slice(&0.5f32.to_le_bytes());
    fs::write(&path, bytes).unwrap();
    let err = f.open().unwrap_err();
    let CheckpointError::ALogPadding { index, value, .. } = &err else {
        panic!("wrong variant: {err:?}");
    };
    assert_eq!((*index, *value), (n_heads + 1, 0.5));
    assert_names(&err, &path, Some(&d.name));
}

#[test]
fn missing_shard_file() {
    let f = fixture();
    let path = f.dir.join("model-00002-of-00004.safetensors");
    fs::remove_file(&path).unwrap();
    let err = f.open().unwrap_err();
    let CheckpointError::MissingShard {
        tensor, n_tensors, ..
    } = &err
    else {
        panic!("wrong variant: {err:?}");
    };
    assert!(*n_tensors > 0);
    assert_names(&err, &path, Some(tensor));
}

#[test]
fn index_names_a_missing_shard() {
    let f = fixture();
    let mut idx = f.index();
    idx["weight_map"][Q0] = "model-00009-of-00004.safetensors".into();
    f.write_index(&idx);
    let err = f.open().unwrap_err();
    assert!(
        matches!(err, CheckpointError::MissingShard { n_tensors: 1, .. }),
        "{err:?}"
    );
    assert_names(
        &err,
        &f.dir.join("model-00009-of-00004.safetensors"),
        Some(Q0),
    );
}

#[test]
fn tensor_in_shard_but_not_in_index() {
    let f = fixture();
    let path = f.shard_of(Q0);
    let mut idx = f.index();
    idx["weight_map"].as_object_mut().unwrap().remove(Q0);
    f.write_index(&idx);
    let err = f.open().unwrap_err();
    assert!(matches!(err, CheckpointError::NotInIndex { .. }), "{err:?}");
    assert_names(&err, &path, Some(Q0));
}

#[test]
fn tensor_in_index_but_not_in_shard() {
    let f = fixture();
    let path = f.shard_of(Q0);
    rewrite_header(&path, &[], |h| {
        h.remove(Q0);
    });
    let err = f.open().unwrap_err();
    assert!(matches!(err, CheckpointError::NotInShard { .. }), "{err:?}");
    assert_names(&err, &path, Some(Q0));
}

/// A tensor name from the checkpoint's JSON is shown escaped when it holds a control
/// character: an index key `lang\u0000uage` must not put a raw NUL on the terminal. A plain
/// name is shown as written (the other tests).
#[test]
fn a_name_with_a_control_character_is_shown_escaped() {
    let f = fixture();
    let mut idx = f.index();
    let file = idx["weight_map"][Q0].clone();
    let path = f.dir.join(file.as_str().unwrap());
    idx["weight_map"]["lang\u{0}uage\u{1b}[2J"] = file;
    f.write_index(&idx);
    let err = f.open().unwrap_err();
    assert!(matches!(err, CheckpointError::NotInShard { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        !msg.chars().any(char::is_control),
        "raw control characters in: {msg:?}"
    );
    assert!(
        msg.contains(r#""lang\0uage\u{1b}[2J""#),
        "the name, quoted with escapes: {msg}"
    );
    assert!(msg.contains(&path.display().to_string()), "{msg}");
    // Invisible and layout-changing characters are escaped too; quotes and accents are not.
    use k3_engine::checkpoint::error::Shown;
    assert_eq!(Shown("a\u{202e}b").to_string(), r#""a\u{202e}b""#);
    assert_eq!(Shown("a\u{200b}b").to_string(), r#""a\u{200b}b""#);
    assert_eq!(
        Shown(r#"modèle "1" it's"#).to_string(),
        r#"modèle "1" it's"#
    );
}

#[test]
fn no_checkpoint_at_all() {
    let tmp = tempfile::tempdir().unwrap();
    let f = fixture();
    let err = Checkpoint::open(tmp.path(), &f.model).unwrap_err();
    assert!(
        matches!(err, CheckpointError::NoCheckpoint { .. }),
        "{err:?}"
    );
}

/// A single `model.safetensors` written by the upstream `safetensors` crate (an independent
/// writer, with its own tensor order) opens without an index, and the bytes agree.
#[test]
fn single_file_without_index_from_the_upstream_writer() {
    let f = fixture();
    let ck = f.open().unwrap();
    let names: Vec<String> = ck.tensor_names().map(str::to_string).collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = names
        .iter()
        .map(|n| {
            let (dtype, shape) = ck.info(n).unwrap();
            let dt = match dtype {
                "BF16" => safetensors::Dtype::BF16,
                "F32" => safetensors::Dtype::F32,
                _ => safetensors::Dtype::U8,
            };
            let v =
                safetensors::tensor::TensorView::new(dt, shape.to_vec(), ck.try_bytes(n).unwrap())
                    .unwrap();
            (n.clone(), v)
        })
        .collect();
    let single = tempfile::tempdir().unwrap();
    safetensors::serialize_to_file(views, None, &single.path().join("model.safetensors")).unwrap();
    let one = Checkpoint::open(single.path(), &f.model).unwrap();
    assert_eq!(one.shards().len(), 1);
    for d in &f.model.tensors {
        assert_eq!(one.bytes(d), ck.bytes(d), "{}", d.name);
    }
    let emb = f.decl(TensorRole::Embed, None, None);
    assert_eq!(one.bf16_bits(&emb), ck.bf16_bits(&emb));
}

/// Unaligned tensor data (a U8 tensor of odd length first) is read correctly by the typed
/// helpers (copied, not cast), and locations are absolute.
#[test]
fn unaligned_tensors_are_copied_correctly() {
    let tmp = tempfile::tempdir().unwrap();
    let bf: [u16; 2] = [0x3F80, 0xC000]; // 1.0, -2.0
    let fl: [f32; 1] = [0.375];
    let mut data = vec![7u8];
    data.extend(bf.iter().flat_map(|b| b.to_le_bytes()));
    data.extend(fl.iter().flat_map(|b| b.to_le_bytes()));
    let mut json = String::from(
        r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"b":{"dtype":"BF16","shape":[2],"data_offsets":[1,5]},"c":{"dtype":"F32","shape":[1],"data_offsets":[5,9]}}"#,
    );
    while !json.len().is_multiple_of(8) {
        json.push(' ');
    }
    let mut file = (json.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(json.as_bytes());
    file.extend_from_slice(&data);
    fs::write(tmp.path().join("model.safetensors"), &file).unwrap();
    let ck = Checkpoint::open_unchecked(tmp.path()).unwrap();
    let decl = |name: &str, dtype, shape: Vec<usize>| TensorDecl {
        name: name.into(),
        role: TensorRole::Embed,
        layer: None,
        expert: None,
        dtype,
        shape: shape.into(),
    };
    let b = decl("b", DType::BF16, vec![2]);
    let c = decl("c", DType::F32, vec![1]);
    assert_eq!(&*ck.bf16_bits(&b), &bf);
    assert_eq!(ck.f32_vec(&c), fl.to_vec());
    let loc = ck.location(&c);
    assert_eq!(loc.file_offset, 8 + json.len() as u64 + 5);
    assert_eq!(loc.n_bytes, 4);
    assert_eq!(
        &file[loc.file_offset as usize..][..4],
        &0.375f32.to_le_bytes()
    );
}

/// Random byte flips in the header region and random truncations never panic: every
/// outcome is Ok or a typed error.
#[test]
fn random_corruption_never_panics() {
    let f = fixture();
    let path = f.dir.join("model-00004-of-00004.safetensors");
    let pristine = fs::read(&path).unwrap();
    let n = u64::from_le_bytes(pristine[..8].try_into().unwrap()) as usize;
    let mut state: u64 = 0x1234_5678_9ABC_DEF0;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let (mut ok, mut errs) = (0, 0);
    for round in 0..300 {
        let mut bytes = pristine.clone();
        match round % 3 {
            0 => {
                for _ in 0..1 + next() % 4 {
                    let at = (next() as usize) % (8 + n);
                    bytes[at] ^= 1 << (next() % 8);
                }
            }
            1 => {
                let len = (next() as usize) % bytes.len();
                bytes.truncate(len);
            }
            _ => {
                let at = (next() as usize) % bytes.len();
                bytes[at] = next() as u8;
                let len = bytes.len() - (next() as usize) % 64;
                bytes.truncate(len);
            }
        }
        fs::write(&path, &bytes).unwrap();
        match f.open() {
            Ok(_) => ok += 1,
            Err(e) => {
                errs += 1;
                assert!(!e.to_string().is_empty());
            }
        }
    }
    assert!(
        errs > 250,
        "only {errs} of 300 corruptions detected ({ok} opened)"
    );
}

/// A shard path that exists but is no regular file is said to be what it is, naming the path
/// (it used to be reported as "shard file is missing"); a dangling symlink names its target.
#[cfg(unix)] // symlinks and FIFOs
#[test]
fn shard_path_that_is_not_a_regular_file_says_what_it_is() {
    use std::os::unix::fs::symlink;
    let name = "model-00002-of-00004.safetensors";
    type Make = fn(&Path);
    let cases: [(&str, Make, &str); 5] = [
        ("dir", |p| fs::create_dir(p).unwrap(), "is a directory"),
        (
            "fifo",
            |p| {
                let ok = std::process::Command::new("mkfifo")
                    .arg(p)
                    .status()
                    .unwrap();
                assert!(ok.success(), "mkfifo");
            },
            "is a FIFO",
        ),
        (
            "devnull",
            |p| symlink("/dev/null", p).unwrap(),
            "is a character device",
        ),
        (
            "loop",
            |p| symlink(p.file_name().unwrap(), p).unwrap(),
            "symlink loop",
        ),
        (
            "dangling",
            |p| symlink("/nonexistent/nowhere.safetensors", p).unwrap(),
            "symlink to /nonexistent/nowhere.safetensors, which does not exist",
        ),
    ];
    for (case, make, says) in cases {
        let f = fixture();
        let path = f.dir.join(name);
        fs::remove_file(&path).unwrap();
        make(&path);
        let err = f.open().unwrap_err();
        let CheckpointError::ShardNotRegular { tensor, .. } = &err else {
            panic!("{case}: wrong variant: {err:?}");
        };
        assert_names(&err, &path, Some(tensor));
        let msg = err.to_string();
        assert!(msg.contains(says), "{case}: says {says:?}: {msg}");
        assert!(!msg.contains("missing"), "{case}: not 'missing': {msg}");
    }
    // The index itself as a directory: said so, not "no checkpoint".
    let f = fixture();
    let index = f.dir.join("model.safetensors.index.json");
    fs::remove_file(&index).unwrap();
    fs::create_dir(&index).unwrap();
    let err = f.open().unwrap_err();
    assert!(matches!(err, CheckpointError::NotRegular { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains(index.to_str().unwrap()) && msg.contains("is a directory"),
        "{msg}"
    );
}

/// A header that is valid JSON but no object, or names a tensor twice (the header parser
/// walks the entries one by one; a JSON map would have kept the last silently).
#[test]
fn header_not_an_object_or_with_a_tensor_twice() {
    let f = fixture();
    let path = f.shard_of(Q0);
    let bytes = fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let text = std::str::from_utf8(&bytes[8..8 + n]).unwrap().trim_end();
    // Q0's entry written a second time, before the closing brace.
    let q0 = serde_json::from_str::<serde_json::Value>(text).unwrap()[Q0].clone();
    let twice = format!("{},\"{Q0}\":{q0}}}", &text[..text.len() - 1]);
    for (json, want) in [
        (twice, "appears twice in the header"),
        ("[1, 2, 3]".to_string(), "top level is not a JSON object"),
    ] {
        let mut json = json;
        while !json.len().is_multiple_of(8) {
            json.push(' ');
        }
        let mut out = (json.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(json.as_bytes());
        out.extend_from_slice(&bytes[8 + n..]);
        fs::write(&path, out).unwrap();
        let err = f.open().unwrap_err();
        assert!(err.to_string().contains(want), "{want}: {err}");
        assert_names(&err, &path, None);
        if want.contains("twice") {
            assert_names(&err, &path, Some(Q0));
        }
    }
}

/// The index: a file name that is no string is refused naming the tensor; no `weight_map`
/// object is said so; a name given twice keeps its last file, as a JSON object does.
#[test]
fn index_values_and_duplicate_names() {
    let f = fixture();
    let index = f.dir.join("model.safetensors.index.json");
    let clean = fs::read_to_string(&index).unwrap();
    let mut idx = f.index();
    idx["weight_map"][Q0] = serde_json::json!(7);
    f.write_index(&idx);
    let err = f.open().unwrap_err();
    assert!(
        matches!(err, CheckpointError::IndexInvalid { .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("is not a string"), "{err}");
    assert_names(&err, &index, Some(Q0));
    for bad in [
        serde_json::json!({"metadata": {}}),
        serde_json::json!({"weight_map": "model-00001-of-00004.safetensors"}),
        serde_json::json!([1, 2]),
    ] {
        f.write_index(&bad);
        let err = f.open().unwrap_err();
        assert!(
            err.to_string().contains("no \"weight_map\" object"),
            "{bad}: {err}"
        );
        assert_names(&err, &index, None);
    }
    // Q0 first mapped to a shard that does not hold it, then to the right one: the last wins.
    fs::write(&index, &clean).unwrap();
    let right = f.index()["weight_map"][Q0].as_str().unwrap().to_string();
    let wrong = if right.contains("00001") {
        right.replace("00001", "00002")
    } else {
        right.replace(&right[6..11], "00001")
    };
    let needle = format!("\"{Q0}\": \"{right}\"");
    assert!(clean.contains(&needle), "pretty index holds {needle}");
    let twice = clean.replacen(&needle, &format!("\"{Q0}\": \"{wrong}\",\n    {needle}"), 1);
    fs::write(&index, &twice).unwrap();
    f.open()
        .expect("the last file given for a name is the one used");
    let twice = clean.replacen(&needle, &format!("{needle},\n    \"{Q0}\": \"{wrong}\""), 1);
    fs::write(&index, &twice).unwrap();
    let err = f.open().unwrap_err();
    assert_names(&err, &index, Some(Q0));
    fs::write(&index, &clean).unwrap();
}

/// Two NaN scale bytes: the open (whose check reads the scales on several threads) always
/// names the one declared first, as a check in declaration order would.
#[test]
fn two_nan_scales_name_the_first_declared() {
    let f = fixture();
    let early = f.decl(TensorRole::ExpertW1Scale, Some(2), Some(1));
    let late = f.decl(TensorRole::ExpertW3Scale, Some(5), Some(7));
    let pos = |d: &TensorDecl| {
        f.model
            .tensors
            .iter()
            .position(|t| t.name == d.name)
            .unwrap()
    };
    assert!(pos(&early) < pos(&late), "declaration order");
    let places = [f.where_is(&late), f.where_is(&early)];
    for (path, off, _) in places {
        let mut bytes = fs::read(&path).unwrap();
        bytes[off as usize] = 0xFF;
        fs::write(&path, bytes).unwrap();
    }
    for _ in 0..5 {
        let err = f.open().unwrap_err();
        assert!(matches!(err, CheckpointError::E8m0Nan { .. }), "{err:?}");
        assert!(err.to_string().contains(&early.name), "{err}");
    }
}

/// The index's weight_map is parsed straight into names and shard files: keys with JSON
/// escapes read as their text, and a value that is not a plain file name in the checkpoint
/// directory (a path, `..`, a number) is refused naming the tensor, the first in file order.
#[test]
fn index_names_unescape_and_non_plain_files_are_refused_by_name() {
    use k3_engine::checkpoint::{is_plain_file_name, read_index_with_total};
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("model.safetensors.index.json");
    let write = |text: &str| std::fs::write(&path, text).unwrap();

    write(
        r#"{"metadata": {"total_size": 12}, "weight_map": {"a\u002eb": "s1.safetensors",
            "plain": "s1.safetensors", "q\"uote": "s2.safetensors"}}"#,
    );
    let (map, total) = read_index_with_total(&path).expect("valid index");
    assert_eq!(total, Some(12));
    let got: Vec<(&str, &str)> = map.iter().collect();
    assert_eq!(
        got,
        [
            ("a.b", "s1.safetensors"),
            ("plain", "s1.safetensors"),
            ("q\"uote", "s2.safetensors")
        ]
    );

    for (value, shown) in [
        (r#""../s1.safetensors""#, "../s1.safetensors"),
        (r#""sub/s1.safetensors""#, "sub/s1.safetensors"),
        (r#""..""#, "\"..\""),
        ("7", "not a string"),
    ] {
        write(&format!(
            r#"{{"weight_map": {{"ok": "s1.safetensors", "bad.one": {value}, "bad.two": 3}}}}"#
        ));
        let e = read_index_with_total(&path).expect_err(value).to_string();
        assert!(e.contains("bad.one") && e.contains(shown), "{value}: {e}");
        assert!(!e.contains("bad.two"), "the first bad entry is named: {e}");
    }

    for name in [
        "s1.safetensors",
        "model-00001-of-00093.safetensors",
        ".hidden",
        "modèle \"1\" it's.safetensors",
    ] {
        assert!(is_plain_file_name(name), "{name}");
    }
    for name in [
        "",
        ".",
        "..",
        "a/b",
        "a\\b",
        "/abs",
        "x\u{1b}[2Jy.safetensors",
        "a\0b",
        "a\nb",
        "a\u{202e}b",
    ] {
        assert!(!is_plain_file_name(name), "{name:?}");
    }
}
