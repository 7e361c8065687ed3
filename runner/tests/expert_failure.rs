//! A routed expert that cannot be loaded (here: its E8M0 scales made NaN on disk) is never
//! zeroed: the run stops after the ids it could compute, still prints its report and writes
//! `--out` (`stopped_by` says why, `experts.load_failures` counts), and exits 4 (docs/DESIGN.md §6).
//! Each expert of one MoE layer of a tiny synthetic checkpoint is damaged in turn: an expert
//! the request never routes to changes nothing; one routed in the prompt stops before the
//! first id; one first routed while decoding stops after a prefix of the clean run's ids.

use std::path::Path;

mod bin_support;
use bin_support::{fresh_dir, k3, s, synth_tiny};

/// Overwrite tensor `name`'s bytes in its shard with 0xFF (the E8M0 NaN for scales; a bf16
/// NaN too).
fn damage(model: &Path, name: &str) {
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(model.join("model.safetensors.index.json")).expect("index"),
    )
    .expect("index json");
    let shard = model.join(
        index["weight_map"][name]
            .as_str()
            .expect("tensor in the index"),
    );
    let mut bytes = std::fs::read(&shard).expect("read shard");
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).expect("header");
    let off = &header[name]["data_offsets"];
    let (b, e) = (
        off[0].as_u64().expect("begin") as usize,
        off[1].as_u64().expect("end") as usize,
    );
    bytes[8 + n + b..8 + n + e].fill(0xFF);
    std::fs::write(&shard, bytes).expect("write shard");
}

fn copy_dir(from: &Path, to: &Path) {
    let _ = std::fs::remove_dir_all(to);
    std::fs::create_dir_all(to).expect("mkdir");
    for e in std::fs::read_dir(from).expect("read_dir") {
        let e = e.expect("entry");
        std::fs::copy(e.path(), to.join(e.file_name())).expect("copy");
    }
}

#[test]
fn an_expert_that_fails_to_load_stops_the_run_with_a_report_and_exit_4() {
    let dir = fresh_dir("expert_failure");
    let clean = dir.join("clean");
    synth_tiny(&clean, 1);
    let out = dir.join("run.json");
    // (exit code, stdout + stderr, --out JSON or null)
    let run = |model: &Path| -> (Option<i32>, String, serde_json::Value) {
        let _ = std::fs::remove_file(&out);
        let o = k3(&[
            s(model),
            "--ids",
            "5",
            "--gen",
            "16",
            "--incremental",
            "--cache-gb",
            "0.0002",
            "--out",
            s(&out),
        ]);
        let err =
            String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr);
        let json = std::fs::read_to_string(&out)
            .map(|t| serde_json::from_str(&t).expect("--out json"))
            .unwrap_or(serde_json::Value::Null);
        (o.status.code(), err, json)
    };
    let (code, err, want) = run(&clean);
    assert_eq!(code, Some(0), "{err}");
    let want: Vec<u64> = want["generated_ids"]
        .as_array()
        .expect("ids")
        .iter()
        .map(|v| v.as_u64().expect("id"))
        .collect();

    let bad = dir.join("bad");
    let (mut unused, mut in_prompt, mut while_decoding) = (0, 0, 0);
    for e in 0..16 {
        copy_dir(&clean, &bad);
        damage(
            &bad,
            &format!("language_model.model.layers.5.block_sparse_moe.experts.{e}.w2.weight_scale"),
        );
        let (code, err, json) = run(&bad);
        if code == Some(0) {
            assert_eq!(json["generated_ids"], serde_json::json!(want), "expert {e}");
            unused += 1;
            continue;
        }
        assert_eq!(code, Some(4), "expert {e}: {err}");
        assert!(!err.contains("panicked"), "expert {e}: {err}");
        assert!(
            err.contains("layer 5") && err.contains("not trustworthy"),
            "expert {e}: {err}"
        );
        // The report and --out are written.
        assert!(
            err.contains("PEAK RSS"),
            "expert {e}: report missing: {err}"
        );
        let stopped = json["stopped_by"].as_str().unwrap_or_default();
        assert!(
            stopped.starts_with("expert load failed"),
            "expert {e}: {json}"
        );
        assert!(
            json["experts"]["load_failures"].as_u64() > Some(0),
            "{json}"
        );
        let got: Vec<u64> = json["generated_ids"]
            .as_array()
            .expect("ids")
            .iter()
            .map(|v| v.as_u64().expect("id"))
            .collect();
        assert!(
            got.len() < want.len() && got[..] == want[..got.len()],
            "expert {e}: the ids before the failure are the clean run's: {got:?} vs {want:?}"
        );
        if got.is_empty() {
            in_prompt += 1;
        } else {
            while_decoding += 1;
        }
    }
    assert!(
        in_prompt > 0 && while_decoding > 0 && unused > 0,
        "the damaged experts should cover every case: unused {unused}, prompt {in_prompt}, \
         decoding {while_decoding}"
    );
}

/// A NaN in a trunk weight (the final norm: every logit becomes NaN) is not turned into id 0
/// by the argmax: the run stops with an error naming the position, exit 1; the same with
/// `--batch-ids`.
#[test]
fn non_finite_logits_stop_the_run_instead_of_choosing_id_0() {
    let dir = fresh_dir("non_finite");
    let model = dir.join("m");
    synth_tiny(&model, 1);
    let out = dir.join("o.json");
    let clean = k3(&[s(&model), "--ids", "1,2", "--gen", "2", "--out", s(&out)]);
    assert_eq!(clean.status.code(), Some(0));
    damage(&model, "language_model.model.norm.weight");
    for extra in [&["--ids", "1,2"][..], &["--batch-ids", "1,2;3"][..]] {
        let o = k3(&[
            &[s(&model), "--gen", "2", "--incremental", "--out", s(&out)][..],
            extra,
        ]
        .concat());
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{extra:?}: {err}");
        assert!(
            err.contains("not finite") && err.contains("after position 2"),
            "{extra:?}: {err}"
        );
    }
}
