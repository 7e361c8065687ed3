//! `k3-run pack-trunk --check MODEL_DIR TRUNK_DIR`, black box: every layer of a packed trunk,
//! read as a run reads it, against the checkpoint's bytes.
//! - A fresh raw pack and a compressed one (several records per layer) pass, every layer and
//!   tensor counted (the counts come from trunk.json, read here).
//! - One byte flipped inside a tensor of a raw trunk is named: the layer, the tensor, the byte
//!   index inside it; the result names only that layer and says how to pack again (exit 1).
//! - One byte flipped inside a coded record of a compressed trunk fails that layer (exit 1).
//! - A trunk packed from other weights of the same shape is refused before any byte is read
//!   (exit 2, as a run refuses it); no trunk directory and `--check --compress` exit 2.
//!
//! Owns: black-box checks through the binary. Must not: call the library.

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;
use std::process::Output;

use serde_json::Value;

mod bin_support;
use bin_support::{code, fresh_dir, k3, s, stderr, synth_tiny};

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn pack(model: &Path, trunk: &Path, extra: &[&str]) {
    let mut args = vec!["pack-trunk"];
    args.extend_from_slice(extra);
    args.extend_from_slice(&[s(model), s(trunk)]);
    let o = k3(&args);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
}

fn check(model: &Path, trunk: &Path) -> Output {
    k3(&["pack-trunk", "--check", s(model), s(trunk)])
}

fn manifest(trunk: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(trunk.join("trunk.json")).unwrap()).unwrap()
}

fn flip(p: &Path, offset: u64) {
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(p)
        .unwrap();
    let mut b = [0u8; 1];
    f.seek(SeekFrom::Start(offset)).unwrap();
    f.read_exact(&mut b).unwrap();
    f.seek(SeekFrom::Start(offset)).unwrap();
    f.write_all(&[b[0] ^ 0x10]).unwrap();
}

/// The RESULT line, asserting the exit code.
fn result(o: &Output, want: i32) -> String {
    let out = stdout(o);
    assert_eq!(code(o), want, "{out}\n{}", stderr(o));
    out.lines()
        .find(|l| l.starts_with("RESULT : "))
        .unwrap_or_else(|| panic!("no RESULT line:\n{out}"))
        .to_string()
}

#[test]
fn check_passes_fresh_packs_and_names_a_flipped_byte() {
    let dir = fresh_dir("pack_check");
    let model = dir.join("model");
    synth_tiny(&model, 3);
    let raw = dir.join("raw");
    let z = dir.join("z");
    pack(&model, &raw, &[]);
    pack(&model, &z, &["--compress", "--chunk-kib", "16"]);

    for (trunk, decoded) in [(&raw, false), (&z, true)] {
        let m = manifest(trunk);
        let layers = m["layers"].as_array().unwrap();
        let tensors: usize = layers
            .iter()
            .map(|l| l["tensors"].as_array().unwrap().len())
            .sum();
        let o = check(&model, trunk);
        assert_eq!(
            result(&o, 0),
            "RESULT : the packed trunk matches the checkpoint"
        );
        let out = stdout(&o);
        let n = layers.len();
        let want = format!(
            "check  : {n} of {n} layers{}, {tensors} tensors,",
            if decoded {
                " (compressed records decoded)"
            } else {
                ""
            }
        );
        assert!(out.contains(&want), "{want}\n{out}");
    }

    // raw: one byte in the middle of layer 2's last tensor
    let m = manifest(&raw);
    let l2 = &m["layers"][2];
    let t = l2["tensors"].as_array().unwrap().last().unwrap();
    let half = t["size"].as_u64().unwrap() / 2;
    let at = l2["offset"].as_u64().unwrap() + t["offset"].as_u64().unwrap() + half;
    flip(&raw.join("trunk.bin"), at);
    let o = check(&model, &raw);
    let res = result(&o, 1);
    assert!(
        res.starts_with("RESULT : FAIL: layer 2 differs from the checkpoint: pack again"),
        "{res}"
    );
    let name = t["name"].as_str().unwrap();
    let out = stdout(&o);
    let fails: Vec<&str> = out.lines().filter(|l| l.starts_with("FAIL   : ")).collect();
    assert_eq!(fails.len(), 1, "{fails:?}");
    assert!(
        fails[0].starts_with(&format!(
            "FAIL   : layer 2: {name} differs from the checkpoint at byte {half} of "
        )),
        "{fails:?}"
    );

    // compressed: one byte inside layer 1's first coded record
    let m = manifest(&z);
    let l1 = &m["layers"][1];
    let rec = l1["stored"]["chunks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["z"] == true)
        .expect("a coded record in layer 1");
    let at = l1["offset"].as_u64().unwrap()
        + rec["at"].as_u64().unwrap()
        + rec["len"].as_u64().unwrap() / 2;
    flip(&z.join("trunk.bin"), at);
    let o = check(&model, &z);
    let res = result(&o, 1);
    assert!(res.starts_with("RESULT : FAIL: layer 1 differs"), "{res}");
}

#[test]
fn check_refuses_other_weights_and_bad_flags() {
    let dir = fresh_dir("pack_check_other");
    let (a, b) = (dir.join("a"), dir.join("b"));
    synth_tiny(&a, 4);
    synth_tiny(&b, 5);
    let trunk_b = dir.join("trunk_b");
    pack(&b, &trunk_b, &[]);
    let o = check(&a, &trunk_b);
    assert_eq!(code(&o), 2, "{}", stdout(&o));
    assert!(
        stderr(&o).contains("packed from other weights"),
        "{}",
        stderr(&o)
    );

    let o = check(&a, &dir.join("nope"));
    assert_eq!(code(&o), 2, "{}", stdout(&o));
    assert!(stderr(&o).contains("nope"), "{}", stderr(&o));
    let o = k3(&["pack-trunk", "--check", "--compress", s(&a), s(&trunk_b)]);
    assert_eq!(code(&o), 2, "{}", stdout(&o));
}
