//! `--layers N` (docs/DESIGN.md, diagnostics): bind only the first N layers, for partial shard
//! sets. On fixture A (13 layers; shards 2 and 3 hold only layers 5..13):
//! - a copy without those shards runs with `--layers 5` and gives the ids and first-step
//!   logit bits of `--layers 5` on the complete checkpoint, resident and from a packed trunk
//!   of the whole model (pinned and through ring slots); without the flag the copy is refused
//!   naming the missing shard;
//! - `--layers 13` is the plain run; `--layers 5` is not (the later layers were dropped);
//! - 0 and 14 are usage errors naming the flag and the layer count.
//!
//! Owns: black-box checks through the `k3-run` binary (copies under target/, not tmpfs).
//! Must not: call the library.

use std::path::{Path, PathBuf};

use serde_json::Value;

mod bin_support;
use bin_support::{fixture_a, k3, k3_out, s};

/// Run the fixture request on `model` with `extra` flags; the `--out` JSON.
fn run(model: &Path, extra: &[&str], out: &Path) -> Value {
    let mut args = vec![
        s(model),
        "--ids",
        "11,22,33,44",
        "--gen",
        "4",
        "--incremental",
        "--threads",
        "2",
        "--out",
        s(out),
    ];
    args.extend_from_slice(extra);
    k3_out(&args, out)
}

/// (generated ids, first-step logits hash) of a run's JSON.
fn result(v: &Value) -> (Value, Value) {
    (v["generated_ids"].clone(), v["first_logits_hash"].clone())
}

#[test]
fn first_layers_of_a_partial_shard_set() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("layers");
    if dir.exists() {
        std::fs::remove_dir_all(&dir).expect("remove stale test dir");
    }
    let (full, part, trunk) = (dir.join("full"), dir.join("part"), dir.join("trunk"));
    std::fs::create_dir_all(&full).expect("create test dir under target/");
    for e in std::fs::read_dir(fixture_a()).expect("fixture A") {
        let e = e.expect("dir entry");
        std::fs::copy(e.path(), full.join(e.file_name())).expect("copy fixture A");
    }
    // The index must say that shards 2 and 3 hold only layers >= 5 (what the test relies on).
    let index: Value = serde_json::from_str(
        &std::fs::read_to_string(full.join("model.safetensors.index.json")).expect("index"),
    )
    .expect("index JSON");
    let dropped = [
        "model-00002-of-00004.safetensors",
        "model-00003-of-00004.safetensors",
    ];
    let mut in_dropped = 0;
    for (name, file) in index["weight_map"].as_object().expect("weight_map") {
        if dropped.contains(&file.as_str().expect("file name")) {
            in_dropped += 1;
            let layer: usize = name
                .split("layers.")
                .nth(1)
                .and_then(|r| r.split('.').next())
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("{name} in a dropped shard is not a layer tensor"));
            assert!(layer >= 5, "{name} (layer {layer}) is in a dropped shard");
        }
    }
    assert!(in_dropped > 0, "the dropped shards hold tensors");
    std::fs::create_dir_all(&part).expect("create part dir");
    for e in std::fs::read_dir(&full).expect("full copy") {
        let e = e.expect("dir entry");
        if !dropped.contains(&e.file_name().to_str().unwrap_or("")) {
            std::fs::copy(e.path(), part.join(e.file_name())).expect("copy");
        }
    }

    let plain = run(&full, &[], &dir.join("plain.json"));
    let all13 = run(&full, &["--layers", "13"], &dir.join("all13.json"));
    assert_eq!(
        result(&all13),
        result(&plain),
        "--layers 13 is the plain run"
    );
    assert_eq!(all13["layers_bound"], 13);

    let five = run(&full, &["--layers", "5"], &dir.join("five.json"));
    assert_eq!(five["layers_bound"], 5);
    assert_eq!(five["layers_in_model"], 13);
    assert_ne!(
        five["first_logits_hash"], plain["first_logits_hash"],
        "dropping 8 layers changes the logits"
    );
    let five_part = run(&part, &["--layers", "5"], &dir.join("five_part.json"));
    assert_eq!(result(&five_part), result(&five), "partial shard set");

    // A packed trunk of the whole model serves the first 5 layers: pinned and ring slots.
    let o = k3(&["pack-trunk", s(&full), s(&trunk)]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for (name, budget) in [("pinned", None), ("ring", Some("0.0008"))] {
        let mut extra = vec![
            "--layers",
            "5",
            "--trunk",
            s(&trunk),
            "--cache-gb",
            "0.0001",
        ];
        if let Some(b) = budget {
            extra.extend(["--trunk-gb", b]);
        }
        let v = run(&part, &extra, &dir.join(format!("{name}.json")));
        assert_eq!(result(&v), result(&five), "{name} trunk");
        let t = &v["trunk"];
        assert_eq!(
            t["n_layers"], 5,
            "{name}: the trunk plans the bound layers: {t}"
        );
        let pinned = t["pinned_layers"].as_u64().expect("pinned_layers");
        match budget {
            None => assert_eq!(pinned, 5, "{t}"),
            Some(_) => assert!(
                pinned < 5 && t["ring_slots"].as_u64() >= Some(1),
                "ring slots in use: {t}"
            ),
        }
    }

    // Without the flag the partial set is refused, naming a missing shard.
    let o = k3(&[s(&part), "--ids", "11,22", "--gen", "1"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "partial set accepted without --layers");
    assert!(err.contains("model-0000"), "{err}");

    for bad in ["0", "14"] {
        let o = k3(&[s(&full), "--ids", "11", "--gen", "1", "--layers", bad]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "--layers {bad}: {err}");
        assert!(
            err.contains(&format!("--layers {bad}")) && err.contains("13 layers"),
            "{err}"
        );
    }
    std::fs::remove_dir_all(&dir).expect("remove the test dir");
}
