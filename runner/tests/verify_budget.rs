//! `k3-run verify` and `k3-run budget` (docs/DESIGN.md §8), black box:
//! - verify passes on fixture A, on a `k3-run synth` checkpoint and on fixture A as one
//!   `model.safetensors` without an index (that file truncated or extended is named); on
//!   copies of fixture A
//!   (under target/) a truncated shard, an extended shard, a missing shard and two shards
//!   altered by opposite amounts (the total still right) each exit 1 naming exactly the
//!   shards to fetch again; a `--sizes` file (object or Hugging Face tree listing) of the true
//!   sizes passes, one with a wrong size names that shard, a wrong `--expect-bytes` and
//!   `--release kimi-k3` (96 shards, 1560936091448 bytes) fail; no index and an unreadable
//!   `--sizes` exit 2, a corrupt index exits 1 naming it (a checkpoint that cannot be read);
//! - budget's class totals add up to every tensor's bytes as the test reads them from the
//!   shard headers itself, agree with `k3-run plan`'s dense trunk / routed experts / global,
//!   and count the shared experts (found by the seed's own name rule) resident, on fixture A,
//!   a synthetic checkpoint and fixture KL under the Kimi-Linear manifest.
//!
//! Owns: black-box checks through the binary; expectations come from the files themselves
//! (stat, headers read here) and the documented output. Must not: call the library.

use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::io::Read;
use std::path::Path;

use serde_json::Value;

mod bin_support;
mod verify_support;
use bin_support::{code, fixture_a, fresh_dir, k3, repo, s, stderr, synth_tiny};
use verify_support::{assert_match, copy_a, fetch_again, stdout, verify};

/// The shard files of a checkpoint directory, sorted.
fn shards(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".safetensors"))
        .collect();
    v.sort();
    v
}

fn size(p: &Path) -> u64 {
    std::fs::metadata(p).unwrap().len()
}

/// Shorten (negative) or lengthen (positive, zero bytes appended) a file by `delta` bytes.
fn alter(p: &Path, delta: i64) {
    let f = OpenOptions::new().write(true).open(p).unwrap();
    let len = f.metadata().unwrap().len();
    f.set_len(len.checked_add_signed(delta).unwrap()).unwrap();
}

#[test]
fn verify_passes_on_fixture_a_and_a_synthetic_checkpoint() {
    let a = fixture_a();
    let out = assert_match(&verify(&a, &[]));
    let names = shards(&a);
    let total: u64 = names.iter().map(|n| size(&a.join(n))).sum();
    assert!(
        out.contains(&format!("shards : {} (expect {}", names.len(), names.len())),
        "{out}"
    );
    assert!(
        out.contains(&format!("bytes  : {total} (expect {total}")),
        "{out}"
    );
    assert!(
        out.contains(&format!("shards : all {} match", names.len())),
        "{out}"
    );

    let syn = fresh_dir("verify_synth");
    synth_tiny(&syn, 7);
    let out = assert_match(&verify(&syn, &[]));
    let total: u64 = shards(&syn).iter().map(|n| size(&syn.join(n))).sum();
    assert!(
        out.contains(&format!("bytes  : {total} (expect {total}")),
        "{out}"
    );
}

#[test]
fn verify_names_exactly_the_damaged_shards() {
    let names = shards(&fixture_a());
    assert_eq!(names.len(), 4);

    // truncated
    let d = copy_a("verify_truncated");
    alter(&d.join(&names[1]), -1000);
    let o = verify(&d, &[]);
    assert_eq!(fetch_again(&o), vec![names[1].clone()]);
    assert!(stdout(&o).contains("1000 bytes short"), "{}", stdout(&o));

    // extended (an over-long download: bytes after the last tensor)
    let d = copy_a("verify_extended");
    alter(&d.join(&names[2]), 17);
    let o = verify(&d, &[]);
    assert_eq!(fetch_again(&o), vec![names[2].clone()]);
    assert!(stdout(&o).contains("17 bytes too long"), "{}", stdout(&o));

    // missing
    let d = copy_a("verify_missing");
    std::fs::remove_file(d.join(&names[3])).unwrap();
    let o = verify(&d, &[]);
    assert_eq!(fetch_again(&o), vec![names[3].clone()]);
    assert!(stdout(&o).contains("missing"), "{}", stdout(&o));
    assert!(
        stdout(&o).contains("shards : 3 (expect 4"),
        "{}",
        stdout(&o)
    );

    // two shards wrong by opposite amounts: the total is right, the shards are not
    let d = copy_a("verify_opposite");
    let total: u64 = names.iter().map(|n| size(&d.join(n))).sum();
    alter(&d.join(&names[0]), -4096);
    alter(&d.join(&names[2]), 4096);
    let o = verify(&d, &[]);
    let out = stdout(&o);
    assert!(
        out.contains(&format!("bytes  : {total} (expect {total}")),
        "the total alone cannot see it:\n{out}"
    );
    assert_eq!(fetch_again(&o), vec![names[0].clone(), names[2].clone()]);
}

#[test]
fn verify_compares_published_sizes() {
    let a = fixture_a();
    let names = shards(&a);
    let sizes: BTreeMap<String, u64> = names
        .iter()
        .map(|n| (n.clone(), size(&a.join(n))))
        .collect();
    let total: u64 = sizes.values().sum();
    let dir = fresh_dir("verify_sizes");
    let write = |name: &str, v: &Value| {
        let p = dir.join(name);
        std::fs::write(&p, serde_json::to_vec(v).unwrap()).unwrap();
        p
    };

    // the true sizes, as an object and as a Hugging Face tree listing (with other files)
    let good = write("good.json", &serde_json::to_value(&sizes).unwrap());
    let out = assert_match(&verify(&a, &["--sizes", s(&good)]));
    assert!(
        out.contains(&format!("bytes  : {total} (expect {total})")),
        "{out}"
    );
    assert!(out.contains("published sizes individually"), "{out}");
    let mut tree: Vec<Value> = sizes
        .iter()
        .map(|(n, b)| serde_json::json!({"type": "file", "path": n, "size": b}))
        .collect();
    tree.push(serde_json::json!({
        "type": "file", "path": "config.json", "size": size(&a.join("config.json"))
    }));
    let listing = write("tree.json", &Value::Array(tree.clone()));
    let out = assert_match(&verify(&a, &["--sizes", s(&listing)]));
    assert!(
        out.contains("config.json matches its published size"),
        "{out}"
    );

    // one wrong published size names that shard (the file itself is intact)
    let mut wrong = sizes.clone();
    *wrong.get_mut(&names[1]).unwrap() += 1;
    let bad = write("bad.json", &serde_json::to_value(&wrong).unwrap());
    let o = verify(&a, &["--sizes", s(&bad)]);
    assert_eq!(fetch_again(&o), vec![names[1].clone()]);
    assert!(stdout(&o).contains("published"), "{}", stdout(&o));

    // a wrong config.json size in the listing names config.json
    tree.last_mut().unwrap()["size"] = serde_json::json!(1);
    let listing = write("tree_bad.json", &Value::Array(tree));
    let o = verify(&a, &["--sizes", s(&listing)]);
    assert_eq!(fetch_again(&o), vec!["config.json".to_string()]);

    // published totals
    let t1 = (total + 1).to_string();
    let o = verify(&a, &["--expect-bytes", &t1]);
    assert_eq!(code(&o), 1, "{}", stdout(&o));
    assert!(stdout(&o).contains("RESULT : FAIL"), "{}", stdout(&o));
    let o = verify(&a, &["--release", "kimi-k3"]);
    assert_eq!(code(&o), 1, "{}", stdout(&o));
    let out = stdout(&o);
    assert!(out.contains("shards : 4 (expect 96)"), "{out}");
    assert!(
        out.contains(&format!("bytes  : {total} (expect 1560936091448)")),
        "{out}"
    );
    let o = verify(
        &a,
        &["--expect-shards", "4", "--expect-bytes", &total.to_string()],
    );
    assert_match(&o);
}

#[test]
fn verify_usage_errors_exit_2() {
    let empty = fresh_dir("verify_empty");
    let o = verify(&empty, &[]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("model.safetensors.index.json"),
        "{}",
        stderr(&o)
    );

    let o = verify(&fixture_a(), &["--sizes", s(&empty.join("nope.json"))]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains("--sizes"), "{}", stderr(&o));
}

/// An index that is there but cannot be read is a checkpoint that cannot be read: exit 1 (as
/// in a run), naming the index to fetch again.
#[test]
fn verify_with_a_corrupt_index_exits_1_naming_it() {
    let d = copy_a("verify_bad_index");
    for (index, says) in [
        (&b"{\"weight_map\": 3}"[..], "weight_map"),
        (&b"{\"weight_map\": {}}"[..], "names no shard"),
    ] {
        std::fs::write(d.join("model.safetensors.index.json"), index).unwrap();
        let o = verify(&d, &[]);
        assert_eq!(
            code(&o),
            1,
            "{}: {}",
            String::from_utf8_lossy(index),
            stdout(&o)
        );
        let err = stderr(&o);
        assert!(err.contains(says), "{err}");
        assert!(
            err.contains("fetch model.safetensors.index.json again"),
            "{err}"
        );
    }
}

/// Every tensor of a checkpoint, read from the shard headers here: (name, bytes).
fn header_tensors(dir: &Path) -> Vec<(String, u64)> {
    let mut out = Vec::new();
    for n in shards(dir) {
        let mut f = std::fs::File::open(dir.join(n)).unwrap();
        let mut len = [0u8; 8];
        f.read_exact(&mut len).unwrap();
        let mut json = vec![0u8; u64::from_le_bytes(len) as usize];
        f.read_exact(&mut json).unwrap();
        let v: Value = serde_json::from_slice(&json).unwrap();
        for (name, e) in v.as_object().unwrap() {
            if name == "__metadata__" {
                continue;
            }
            let o = &e["data_offsets"];
            out.push((
                name.clone(),
                o[1].as_u64().unwrap() - o[0].as_u64().unwrap(),
            ));
        }
    }
    out
}

fn json_of(args: &[&str]) -> Value {
    let o = k3(args);
    assert_eq!(code(&o), 0, "{args:?}: {}", stderr(&o));
    serde_json::from_str(&stdout(&o)).expect("--json prints JSON")
}

fn u(v: &Value) -> u64 {
    v.as_u64()
        .unwrap_or_else(|| panic!("expected a byte count, got {v}"))
}

/// Budget on `dir` (with `extra` flags) against the headers and `plan`.
fn check_budget(dir: &Path, extra: &[&str], ignored: &[&str]) {
    let mut args = vec!["budget", s(dir), "--json"];
    args.extend_from_slice(extra);
    let b = json_of(&args);
    let mut args = vec!["plan", s(dir), "--json"];
    args.extend_from_slice(extra);
    let p = json_of(&args);

    // the class totals add up to every tensor's bytes
    let tensors = header_tensors(dir);
    let all: u64 = tensors.iter().map(|t| t.1).sum();
    let classes = b["classes"].as_object().unwrap();
    let sum: u64 = classes.values().map(|c| u(&c["bytes"])).sum();
    let count: u64 = classes.values().map(|c| u(&c["tensors"])).sum();
    assert_eq!(sum, all, "class bytes vs the headers: {b}");
    assert_eq!(u(&b["total_bytes"]), all);
    assert_eq!(count, tensors.len() as u64);

    // plan's split
    let trunk: u64 = p["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| u(&l["trunk_bytes"]))
        .sum();
    let experts: u64 = p["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| u(&l["expert_bytes"]))
        .sum();
    let global = u(&p["global_bytes"]);
    assert_eq!(u(&b["plan"]["trunk_bytes"]), trunk, "{b}");
    assert_eq!(u(&b["plan"]["routed_expert_bytes"]), experts, "{b}");
    assert_eq!(u(&b["plan"]["global_bytes"]), global, "{b}");
    assert_eq!(u(&classes["routed_expert"]["bytes"]), experts, "{b}");
    assert_eq!(
        u(&b["resident_floor_bytes"]),
        trunk + global,
        "floor = trunk + global: {b}"
    );

    // the seed's name rule (budget.py classify) on the header names, the manifest's ignored
    // prefixes left out
    let mut by_rule: BTreeMap<&str, u64> = BTreeMap::new();
    for (name, bytes) in &tensors {
        let class = if ignored.iter().any(|p| name.starts_with(p)) {
            "unused"
        } else if name.contains(".block_sparse_moe.experts.") {
            "routed_expert"
        } else if name.contains(".block_sparse_moe.shared_expert") {
            "shared_expert"
        } else if name.contains(".self_attn.") {
            "attention"
        } else if name.contains("embed_tokens") || name.contains("lm_head") {
            "embedding"
        } else {
            "other"
        };
        *by_rule.entry(class).or_default() += bytes;
    }
    for (class, bytes) in &by_rule {
        assert_eq!(u(&classes[*class]["bytes"]), *bytes, "class {class}: {b}");
    }
    let shared = by_rule["shared_expert"];
    assert!(shared > 0, "the test model has shared experts");
    assert_eq!(classes["shared_expert"]["resident"], Value::Bool(true));
    assert_eq!(classes["routed_expert"]["resident"], Value::Bool(false));
    let unused = by_rule.get("unused").copied().unwrap_or(0);
    assert_eq!(
        u(&b["resident_floor_bytes"]),
        all - experts - unused,
        "the floor is everything but the routed experts (and unused tensors): {b}"
    );
}

#[test]
fn budget_agrees_with_the_headers_and_plan() {
    let a = fixture_a();
    check_budget(&a, &[], &["vision_tower.", "mm_projector."]);
    let syn = fresh_dir("budget_synth");
    synth_tiny(&syn, 3);
    check_budget(&syn, &[], &["vision_tower.", "mm_projector."]);
    let kl = repo().join("fixtures/models/KL/ckpt");
    let m = repo().join("configs/models/kimi-linear-48b.toml");
    check_budget(&kl, &["--manifest", s(&m)], &[]);

    // the text report states the same floor
    let b = json_of(&["budget", s(&a), "--json"]);
    let o = k3(&["budget", s(&a), "--per-layer"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let out = stdout(&o);
    let floor = u(&b["resident_floor_bytes"]);
    assert!(
        out.contains(&format!("resident floor : {floor} bytes")),
        "{out}"
    );
    assert!(out.contains("shared_expert"), "{out}");
    let rows = out
        .lines()
        .filter(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len() == 5 && f.iter().all(|x| x.parse::<u64>().is_ok())
        })
        .count();
    assert_eq!(rows, 13, "one line per layer:\n{out}");
}

#[test]
fn budget_on_a_checkpoint_the_manifest_does_not_describe_exits_2() {
    let kl = repo().join("fixtures/models/KL/ckpt");
    let o = k3(&["budget", s(&kl)]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
}

#[test]
fn budget_without_shards_uses_the_manifest_inventory() {
    // fixture A's config.json alone: the declared tensors' bytes, the same classes as from
    // the headers, only the tensors the manifest ignores (never loaded) are not counted
    let a = fixture_a();
    let dir = fresh_dir("budget_config_only");
    std::fs::copy(a.join("config.json"), dir.join("config.json")).unwrap();
    let from_headers = json_of(&["budget", s(&a), "--json"]);
    let from_spec = json_of(&["budget", s(&dir), "--json"]);
    assert_eq!(from_spec["source"], "manifest", "{from_spec}");
    assert_eq!(from_headers["source"], "headers", "{from_headers}");
    for class in [
        "routed_expert",
        "shared_expert",
        "attention",
        "embedding",
        "other",
    ] {
        assert_eq!(
            from_spec["classes"][class], from_headers["classes"][class],
            "class {class}"
        );
    }
    assert_eq!(u(&from_spec["classes"]["unused"]["tensors"]), 0);
    assert!(u(&from_headers["classes"]["unused"]["tensors"]) > 0);
    for k in [
        "resident_floor_bytes",
        "active_expert_bytes_per_token",
        "plan",
    ] {
        assert_eq!(from_spec[k], from_headers[k], "{k}");
    }
}

#[test]
fn budget_of_a_checkpoint_that_is_not_the_manifests_model_exits_1() {
    // config.json says 8 experts, the shards hold 16: experts 8..15 are undeclared (counted
    // resident: the larger floor), the routers are mis-sized; the report is still printed
    let d = copy_a("budget_undeclared");
    let p = d.join("config.json");
    let mut c: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    assert_eq!(c["text_config"]["num_experts"], 16);
    c["text_config"]["num_experts"] = serde_json::json!(8);
    std::fs::write(&p, serde_json::to_vec_pretty(&c).unwrap()).unwrap();
    let o = k3(&["budget", s(&d), "--json"]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("not declared by the manifest"), "{err}");
    assert!(err.contains("of another size"), "{err}");
    let b: Value = serde_json::from_str(&stdout(&o)).unwrap();
    let undeclared = &b["classes"]["undeclared"];
    let moe_layers = 12;
    assert_eq!(u(&undeclared["tensors"]), 8 * 6 * moe_layers, "{b}");
    assert_eq!(undeclared["resident"], Value::Bool(true));
    let all: u64 = header_tensors(&d).iter().map(|t| t.1).sum();
    assert_eq!(u(&b["total_bytes"]), all);
    assert_eq!(
        u(&b["resident_floor_bytes"]),
        all - u(&b["classes"]["routed_expert"]["bytes"]) - u(&b["classes"]["unused"]["bytes"]),
        "{b}"
    );
}

#[test]
fn verify_index_total_size_is_only_a_note() {
    // the engine never reads metadata.total_size: a different value is reported, not a FAIL
    let d = copy_a("verify_total_size");
    let p = d.join("model.safetensors.index.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    let t = u(&v["metadata"]["total_size"]);
    v["metadata"]["total_size"] = serde_json::json!(t + 1);
    std::fs::write(&p, serde_json::to_vec(&v).unwrap()).unwrap();
    let out = assert_match(&verify(&d, &[]));
    assert!(
        out.contains(&format!("metadata.total_size is {}", t + 1)),
        "{out}"
    );
    // a tensor the index maps to another shard than the one holding it is a FAIL naming both
    // the shards involved and the index
    let names = shards(&d);
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    let map = v["weight_map"].as_object_mut().unwrap();
    let moved = map
        .iter()
        .find(|(_, f)| f.as_str() == Some(names[0].as_str()))
        .map(|(k, _)| k.clone())
        .unwrap();
    map.insert(moved, Value::String(names[1].clone()));
    std::fs::write(&p, serde_json::to_vec(&v).unwrap()).unwrap();
    let o = verify(&d, &[]);
    assert_eq!(
        fetch_again(&o),
        vec![
            names[0].clone(),
            names[1].clone(),
            "model.safetensors.index.json".to_string()
        ]
    );
}

mod stream_support;

/// A checkpoint stored as one `model.safetensors` (no index, as small upstream models ship):
/// verify checks it from its header and size; a truncated or extended copy is named.
#[test]
fn verify_a_single_file_checkpoint() {
    let dir = fresh_dir("verify_single");
    let a = fixture_a();
    let mut all = Vec::new();
    for n in shards(&a) {
        all.extend(stream_support::read_safetensors(&a.join(n)));
    }
    let file = dir.join("model.safetensors");
    stream_support::write_safetensors(&file, &all);
    std::fs::copy(a.join("config.json"), dir.join("config.json")).unwrap();
    let out = assert_match(&verify(&dir, &[]));
    let total = size(&file);
    assert!(out.contains("shards : 1 (expect 1"), "{out}");
    assert!(
        out.contains(&format!("bytes  : {total} (expect {total}")),
        "{out}"
    );
    alter(&file, -1);
    assert_eq!(fetch_again(&verify(&dir, &[])), vec!["model.safetensors"]);
    alter(&file, 2);
    assert_eq!(fetch_again(&verify(&dir, &[])), vec!["model.safetensors"]);
}
