//! Routed experts stored as BF16 (`expert_format = "bf16"`, roles `expert_w1/w3/w2`, as in
//! Kimi-Linear) run through the same executor, resident and streamed.
//!
//! The proof needs no new reference: every MXFP4 weight (an E2M1 value times a power of two)
//! is exactly a bf16, and the bf16 and MXFP4 matvecs accumulate in the same canonical order
//! (docs/NUMERICS.md §1). So fixture A with its experts decoded to BF16 (by the decoder below,
//! written from docs/MODEL.md's MXFP4 section, not the engine's) and described by a
//! manifest that differs from the built-in one only in the expert format must give fixture
//! A's ids and step-0 logit bits, which the conformance tests hold to the numpy reference.
//! A wrong nibble order, scale or role mapping changes the bits.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use safetensors::tensor::{Dtype, SafeTensors};
use serde_json::Value;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn fixture_a() -> PathBuf {
    repo().join("fixtures/models/A/ckpt")
}

/// OCP MX E2M1 code points (bit 3 = sign).
const E2M1: [f64; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// Decode one MXFP4 matrix `[rows, cols]` (packed `[rows, cols/2]`, low nibble = even
/// element; scales `[rows, cols/32]`, E8M0 = 2^(s-127)) to bf16 bits, asserting exactness.
fn mxfp4_to_bf16(packed: &[u8], scales: &[u8], rows: usize, cols: usize) -> Vec<u16> {
    let mut out = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        for c in 0..cols {
            let byte = packed[r * cols / 2 + c / 2];
            let nib = if c % 2 == 0 { byte & 0xF } else { byte >> 4 };
            let mag = E2M1[(nib & 7) as usize];
            let v = if nib & 8 != 0 { -mag } else { mag };
            let s = scales[r * cols / 32 + c / 32];
            assert_ne!(s, 0xFF, "E8M0 NaN in the fixture");
            let f = (v * 2f64.powi(i32::from(s) - 127)) as f32;
            assert_eq!(
                f64::from(f),
                v * 2f64.powi(i32::from(s) - 127),
                "not exact in f32"
            );
            let bits = f.to_bits();
            assert_eq!(bits & 0xFFFF, 0, "{f} is not exactly a bf16");
            out.push((bits >> 16) as u16);
        }
    }
    out
}

/// The built-in K3 manifest with BF16 routed experts (`.weight` names, three roles).
fn bf16_manifest(dst: &Path) -> PathBuf {
    let text = fs::read_to_string(repo().join("configs/models/kimi-k3.toml")).unwrap();
    let mut out = String::new();
    for line in text.lines() {
        if line.starts_with("expert_format") {
            out.push_str("expert_format = \"bf16\"\n");
        } else if line.starts_with("mxfp4_group") || line.contains("quantization_config") {
            continue; // MXFP4 only; a BF16 checkpoint declares no quantization
        } else if let Some(rest) = line.strip_prefix("expert_w") {
            // expert_w1_packed = { name = "...w1.weight_packed", dtype = "U8" } -> expert_w1
            if rest.contains("_packed") {
                let w = &rest[..1];
                let name = line
                    .split('"')
                    .nth(1)
                    .unwrap()
                    .replace(".weight_packed", ".weight");
                out.push_str(&format!(
                    "expert_w{w} = {{ name = \"{name}\", dtype = \"BF16\" }}\n"
                ));
            }
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    assert!(out.contains("expert_w2 = {") && !out.contains("_scale = {"));
    let p = dst.join("k3-bf16-experts.toml");
    fs::write(&p, out).unwrap();
    p
}

/// Write a safetensors file with the tensors in the given order (the release groups each
/// layer's trunk tensors together, which `pack-trunk` relies on; the crate's serializer
/// reorders by dtype).
fn write_in_order(
    path: &Path,
    tensors: &[(String, Dtype, Vec<usize>, Vec<u8>)],
    meta: &Option<HashMap<String, String>>,
) {
    let mut header = serde_json::Map::new();
    if let Some(m) = meta {
        header.insert("__metadata__".into(), serde_json::to_value(m).unwrap());
    }
    let mut off = 0usize;
    for (n, d, shape, data) in tensors {
        let dtype = match d {
            Dtype::BF16 => "BF16",
            Dtype::F32 => "F32",
            Dtype::U8 => "U8",
            other => panic!("unexpected dtype {other:?} in fixture A"),
        };
        header.insert(
            n.clone(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [off, off + data.len()]}),
        );
        off += data.len();
    }
    let mut h = serde_json::to_vec(&Value::Object(header)).unwrap();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    for (_, _, _, data) in tensors {
        out.extend(data);
    }
    fs::write(path, out).unwrap();
}

/// Fixture A with every routed expert's w1/w3/w2 decoded to BF16 `[out, in]` `.weight`.
fn convert(dst: &Path) {
    let src = fixture_a();
    fs::create_dir_all(dst).unwrap();
    let ip = src.join("model.safetensors.index.json");
    let mut idx: Value = serde_json::from_slice(&fs::read(&ip).unwrap()).unwrap();
    let mut map = serde_json::Map::new();
    let mut total = 0u64;
    let mut converted = 0usize;
    for e in fs::read_dir(&src).unwrap() {
        let p = e.unwrap().path();
        let fname = p.file_name().unwrap().to_str().unwrap().to_string();
        if fname == "config.json" {
            // unquantized experts: no quantization_config
            let mut c: Value = serde_json::from_slice(&fs::read(&p).unwrap()).unwrap();
            if let Some(top) = c.as_object_mut() {
                top.remove("quantization_config");
            }
            let t = c.get_mut("text_config").expect("nested text_config");
            assert!(
                t.as_object_mut()
                    .unwrap()
                    .remove("quantization_config")
                    .is_some()
            );
            fs::write(dst.join(&fname), serde_json::to_vec_pretty(&c).unwrap()).unwrap();
            continue;
        }
        if !fname.ends_with(".safetensors") {
            if fname != "model.safetensors.index.json" {
                fs::copy(&p, dst.join(&fname)).unwrap();
            }
            continue;
        }
        let bytes = fs::read(&p).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
        let mut owned: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
        let mut in_file = st.tensors();
        in_file.sort_by_key(|(_, t)| t.data().as_ptr() as usize);
        for (n, t) in in_file {
            if n.ends_with(".weight_scale") {
                continue;
            }
            if let Some(base) = n.strip_suffix(".weight_packed") {
                let s = st.tensor(&format!("{base}.weight_scale")).unwrap();
                let (rows, cols) = (t.shape()[0], t.shape()[1] * 2);
                assert_eq!(s.shape(), [rows, cols / 32], "{n}");
                let w = mxfp4_to_bf16(t.data(), s.data(), rows, cols);
                let data: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
                owned.push((
                    format!("{base}.weight"),
                    Dtype::BF16,
                    vec![rows, cols],
                    data,
                ));
                converted += 1;
            } else {
                owned.push((n, t.dtype(), t.shape().to_vec(), t.data().to_vec()));
            }
        }
        for (n, _, _, d) in &owned {
            map.insert(n.clone(), Value::from(fname.clone()));
            total += d.len() as u64;
        }
        write_in_order(&dst.join(&fname), &owned, meta.metadata());
    }
    assert!(converted > 0, "fixture A has routed experts");
    idx["weight_map"] = Value::Object(map);
    idx["metadata"]["total_size"] = Value::from(total);
    fs::write(
        dst.join("model.safetensors.index.json"),
        serde_json::to_vec_pretty(&idx).unwrap(),
    )
    .unwrap();
}

fn k3(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_k3-run"))
        .args(args)
        .env_remove("K3_ISA")
        .output()
        .expect("spawn k3-run")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// (generated ids, step-0 logit bytes) of one run; panics with stderr on failure.
fn run(ck: &Path, out_dir: &Path, extra: &[&str]) -> (Value, Vec<u8>) {
    let out = out_dir.join("run.json");
    let dump = out_dir.join("step0.f32");
    let mut args = vec![
        ck.to_str().unwrap(),
        "--ids",
        "11,22,33,44,55,66,77,88,99,110",
        "--gen",
        "12",
        "--incremental",
        "--out",
        out.to_str().unwrap(),
        "--dump-logits",
        dump.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let o = k3(&args);
    assert!(o.status.success(), "{args:?}:\n{}", stderr(&o));
    let v: Value = serde_json::from_slice(&fs::read(&out).unwrap()).unwrap();
    (v["generated_ids"].clone(), fs::read(&dump).unwrap())
}

#[test]
fn bf16_experts_holding_the_mxfp4_values_give_the_same_bits_resident_and_streamed() {
    let root = Path::new(env!("CARGO_TARGET_TMPDIR")).join("bf16_experts");
    let _ = fs::remove_dir_all(&root);
    fs::create_dir_all(&root).unwrap();
    let ck = root.join("ckpt");
    convert(&ck);
    let manifest = bf16_manifest(&root);
    let m = manifest.to_str().unwrap();

    let (want_ids, want_logits) = run(&fixture_a(), &root, &[]);
    assert!(want_ids.as_array().is_some_and(|a| a.len() == 12));

    // The built-in (MXFP4) manifest refuses the converted checkpoint up front, naming the
    // quantization keys it pins.
    let o = k3(&[ck.to_str().unwrap(), "--ids", "1", "--gen", "1"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("quantization_config.format"),
        "{}",
        stderr(&o)
    );

    // Resident: memory maps and the huge-page arena.
    for resident in ["mmap", "arena"] {
        let (ids, logits) = run(&ck, &root, &["--manifest", m, "--resident", resident]);
        assert_eq!(ids, want_ids, "resident {resident}: ids");
        assert!(
            logits == want_logits,
            "resident {resident}: step-0 logit bits differ"
        );
    }

    // Streamed: packed trunk, expert store and cache (no cache, a small one, look-ahead).
    let trunk = root.join("trunk");
    let o = k3(&[
        "pack-trunk",
        ck.to_str().unwrap(),
        trunk.to_str().unwrap(),
        "--manifest",
        m,
    ]);
    assert!(o.status.success(), "pack-trunk: {}", stderr(&o));
    let t = trunk.to_str().unwrap();
    for extra in [
        &["--trunk-gb", "0.0005", "--cache-gb", "0"][..],
        &["--trunk-gb", "0.002", "--cache-gb", "0.0005"][..],
        &[
            "--trunk-gb",
            "1",
            "--cache-gb",
            "0.001",
            "--expert-prefetch",
            "2",
        ][..],
    ] {
        let mut args = vec!["--manifest", m, "--trunk", t];
        args.extend_from_slice(extra);
        let (ids, logits) = run(&ck, &root, &args);
        assert_eq!(ids, want_ids, "streamed {extra:?}: ids");
        assert!(
            logits == want_logits,
            "streamed {extra:?}: step-0 logit bits differ"
        );
    }
    let _ = fs::remove_dir_all(&root);
}
