//! `A_log` holds one entry per KDA head; the rest of the stored vector is storage-only zero
//! padding (docs/MODEL.md §3.3, docs/NUMERICS.md §3). The released K3 pads 96 heads to 128 and
//! the manifest's rule reproduces that; a checkpoint padded to another length is the same model
//! and must give the same tokens and logit bits. A short `A_log` (fewer entries than heads) and
//! non-zero padding stay errors that name the tensor.
//!
//! Black box: fixture A's checkpoint is copied under `CARGO_TARGET_TMPDIR` with every `A_log`
//! re-stored at another length (the shards rewritten by the `safetensors` crate), and the
//! binary runs on both copies.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde_json::Value;

fn fixture_a() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/models/A/ckpt")
}

/// Copy fixture A to `dst`, storing every `A_log` as `f(old values)` (F32, 1-D).
fn copy_with_a_log(dst: &Path, f: &dyn Fn(&[f32]) -> Vec<f32>) {
    let src = fixture_a();
    fs::create_dir_all(dst).unwrap();
    let mut total = 0u64;
    for e in fs::read_dir(&src).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_str().unwrap().to_string();
        if !name.ends_with(".safetensors") {
            fs::copy(&p, dst.join(&name)).unwrap();
            continue;
        }
        let bytes = fs::read(&p).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
        let mut owned: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
        for (n, t) in st.tensors() {
            let (shape, data) = if n.ends_with(".A_log") {
                assert_eq!(t.dtype(), Dtype::F32, "{n}");
                let old: Vec<f32> = t
                    .data()
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                let new = f(&old);
                let data: Vec<u8> = new.iter().flat_map(|v| v.to_le_bytes()).collect();
                (vec![new.len()], data)
            } else {
                (t.shape().to_vec(), t.data().to_vec())
            };
            total += data.len() as u64;
            owned.push((n, t.dtype(), shape, data));
        }
        let views: Vec<(String, TensorView<'_>)> = owned
            .iter()
            .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        let info: Option<HashMap<String, String>> = meta.metadata().clone();
        safetensors::serialize_to_file(views, info, &dst.join(&name)).unwrap();
    }
    // the index's total_size follows the payloads
    let ip = dst.join("model.safetensors.index.json");
    let mut idx: Value = serde_json::from_slice(&fs::read(&ip).unwrap()).unwrap();
    idx["metadata"]["total_size"] = Value::from(total);
    fs::write(&ip, serde_json::to_vec_pretty(&idx).unwrap()).unwrap();
}

fn heads_of_a() -> usize {
    let c: Value =
        serde_json::from_slice(&fs::read(fixture_a().join("config.json")).unwrap()).unwrap();
    let t = c.get("text_config").unwrap_or(&c);
    t["linear_attn_config"]["num_heads"]
        .as_u64()
        .expect("fixture A has KDA heads") as usize
}

fn run(ck: &Path, out_dir: &Path) -> (Output, Vec<u8>) {
    let dump = out_dir.join("step0.f32");
    let out = out_dir.join("run.json");
    let o = Command::new(env!("CARGO_BIN_EXE_k3-run"))
        .arg(ck)
        .args(["--ids", "11,22,33,44,55", "--gen", "6", "--incremental"])
        .arg("--out")
        .arg(&out)
        .arg("--dump-logits")
        .arg(&dump)
        .env_remove("K3_ISA")
        .output()
        .expect("spawn k3-run");
    let ids = if o.status.success() {
        let v: Value = serde_json::from_slice(&fs::read(&out).unwrap()).unwrap();
        let mut bytes = serde_json::to_vec(&v["generated_ids"]).unwrap();
        bytes.extend(fs::read(&dump).unwrap());
        bytes
    } else {
        Vec::new()
    };
    (o, ids)
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn a_log_stored_at_another_padded_length_gives_the_same_bits() {
    let root = Path::new(env!("CARGO_TARGET_TMPDIR")).join("a_log_padding");
    let _ = fs::remove_dir_all(&root);
    fs::create_dir_all(&root).unwrap();
    let heads = heads_of_a();
    let (base, base_bits) = run(&fixture_a(), &root);
    assert!(base.status.success(), "fixture A: {}", stderr(&base));

    // Longer and shorter padding than the rule's, and no padding at all.
    for len in [heads + 45, 2 * heads + 64, heads] {
        let ck = root.join(format!("len{len}"));
        copy_with_a_log(&ck, &|old| {
            let mut v = old[..heads].to_vec();
            v.resize(len, 0.0);
            v
        });
        let (o, bits) = run(&ck, &root);
        assert!(o.status.success(), "A_log [{len}]: {}", stderr(&o));
        assert_eq!(
            bits, base_bits,
            "A_log stored as [{len}]: ids or step-0 logit bits differ"
        );
    }

    // Fewer entries than heads: refused, naming the tensor.
    let ck = root.join("short");
    copy_with_a_log(&ck, &|old| old[..heads - 1].to_vec());
    let (o, _) = run(&ck, &root);
    let err = stderr(&o);
    assert!(!o.status.success(), "a short A_log must be refused");
    assert!(
        err.contains("A_log")
            && err.contains(&format!("[{}]", heads - 1))
            && err.contains(&format!("num_heads = {heads}")),
        "the error names the tensor, its shape and the head count:\n{err}"
    );

    // Non-zero padding in a re-padded checkpoint: still refused, naming the tensor and entry.
    let ck = root.join("dirty");
    copy_with_a_log(&ck, &|old| {
        let mut v = old[..heads].to_vec();
        v.resize(heads + 40, 0.0);
        v[heads + 7] = 0.5;
        v
    });
    let (o, _) = run(&ck, &root);
    let err = stderr(&o);
    assert!(
        !o.status.success(),
        "non-zero A_log padding must be refused"
    );
    assert!(
        err.contains("A_log") && err.contains("padding") && err.contains(&(heads + 7).to_string()),
        "the error names the tensor and the entry:\n{err}"
    );
    let _ = fs::remove_dir_all(&root);
}
