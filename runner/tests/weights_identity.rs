//! A packed trunk or a saved state belongs to the weights that made it: two checkpoints of the
//! same shape (synthetic, seeds 1 and 2) must not be mixed. A trunk packed from one and run
//! with the other, or a state saved from one and loaded into the other, is refused with exit 2
//! naming both fingerprints; each with its own checkpoint runs and matches the resident run; a
//! trunk.json of an older pack (no fingerprint) is still accepted, and the start-up says so.

use std::path::Path;

mod bin_support;
use bin_support::{fresh_dir, k3, s, synth_tiny};

fn ok(args: &[&str]) -> String {
    let o = k3(args);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "k3-run {args:?} failed: {err}");
    err
}

fn ids(args: &[&str], out: &Path) -> serde_json::Value {
    let mut a = args.to_vec();
    a.extend(["--out", s(out)]);
    ok(&a);
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out).expect("--out written")).expect("json");
    v["generated_ids"].clone()
}

fn args(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

fn refused(args: &[&str], what: &str) -> String {
    let o = k3(args);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(2), "k3-run {args:?}: {err}");
    assert!(err.contains(what), "k3-run {args:?}: {err}");
    err
}

#[test]
fn trunks_and_states_are_not_mixed_between_checkpoints_of_one_shape() {
    let dir = fresh_dir("weights_identity");
    let (t1, t2) = (dir.join("t1"), dir.join("t2"));
    synth_tiny(&t1, 1);
    synth_tiny(&t2, 2);
    let (raw, z) = (dir.join("trunk1"), dir.join("trunk1z"));
    ok(&["pack-trunk", s(&t1), s(&raw)]);
    ok(&[
        "pack-trunk",
        "--compress",
        "--chunk-kib",
        "8",
        s(&t1),
        s(&z),
    ]);
    let req = ["--ids", "1,2,3", "--gen", "3", "--incremental"];
    let with = |model: &Path, extra: &[&str]| -> Vec<String> {
        let mut a = vec![s(model).to_string()];
        a.extend(req.iter().map(|x| x.to_string()));
        a.extend(extra.iter().map(|x| x.to_string()));
        a
    };

    // Each trunk with its own checkpoint: the resident run's ids.
    let resident = ids(&args(&with(&t1, &[])), &dir.join("r.json"));
    for trunk in [&raw, &z] {
        let got = ids(
            &args(&with(&t1, &["--trunk", s(trunk), "--trunk-gb", "0.0012"])),
            &dir.join("t.json"),
        );
        assert_eq!(got, resident, "{}", trunk.display());
        // With the other checkpoint: refused, naming the trunk, the checkpoint and the fix.
        let err = refused(
            &args(&with(&t2, &["--trunk", s(trunk)])),
            "was packed from other weights",
        );
        assert!(
            err.contains(s(trunk)) && err.contains(s(&t2)) && err.contains("pack-trunk"),
            "{err}"
        );
    }

    // An older pack without the fingerprint is accepted, and the start-up says it was not
    // checked.
    let json = raw.join("trunk.json");
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("trunk.json")).expect("json");
    for l in m["layers"].as_array_mut().expect("layers") {
        assert!(
            l["source_fingerprint"].is_string(),
            "pack-trunk records a fingerprint per layer"
        );
        l.as_object_mut()
            .expect("object")
            .remove("source_fingerprint");
    }
    std::fs::write(&json, serde_json::to_vec_pretty(&m).expect("json")).expect("write");
    let err = ok(&args(&with(
        &t2,
        &["--trunk", s(&raw), "--out", s(&dir.join("old.json"))],
    )));
    assert!(err.contains("no source fingerprints"), "{err}");

    // A state saved from t2 is refused by t1 (same shape), accepted by t2.
    let state = dir.join("t2.state");
    ok(&[
        s(&t2),
        "--ids",
        "1,2,3",
        "--gen",
        "0",
        "--incremental",
        "--save-state",
        s(&state),
        "--out",
        s(&dir.join("save.json")),
    ]);
    let resume = |model: &Path| {
        vec![
            s(model).to_string(),
            "--ids".into(),
            "4,5".into(),
            "--gen".into(),
            "3".into(),
            "--incremental".into(),
            "--load-state".into(),
            s(&state).to_string(),
        ]
    };
    let err = refused(&args(&resume(&t1)), "saved from other weights");
    assert!(err.contains("t2.state"), "{err}");
    let whole = ids(
        &[s(&t2), "--ids", "1,2,3,4,5", "--gen", "3", "--incremental"],
        &dir.join("w.json"),
    );
    assert_eq!(ids(&args(&resume(&t2)), &dir.join("s.json")), whole);
}
