//! A second model family by manifest alone (docs/DESIGN.md §10): the `k3-run` binary with
//! `--manifest configs/models/kimi-linear-48b.toml` runs fixtures/models/KL, a Kimi-Linear-style
//! checkpoint (plain residuals, SiLU-GLU, softplus KDA gate, low-rank KDA output gate, A_log
//! `[1, 1, H, 1]`, MLA with a direct q_proj and no output gate, BF16 experts at the hidden
//! width, flat config.json), and agrees with the independent numpy reference
//! (`fixtures/kl/kl.py`): every greedy id, and the step-0 logits within 1e-3 (the
//! reference keeps float64 math with f32 rounding per op; the engine's f32 kernels land within
//! a few 1e-6). The usual invariances hold through the binary: full recompute, 1 thread,
//! the scalar ISA path and the streamed trunk and expert cache give the same bits.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn manifest() -> String {
    repo()
        .join("configs/models/kimi-linear-48b.toml")
        .to_str()
        .unwrap()
        .to_string()
}

fn fixture() -> PathBuf {
    repo().join("fixtures/models/KL")
}

fn summary() -> Value {
    serde_json::from_slice(&std::fs::read(fixture().join("ref/summary.json")).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .expect("id array")
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

fn csv(v: &[u64]) -> String {
    v.iter().map(u64::to_string).collect::<Vec<_>>().join(",")
}

fn k3(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_k3-run"));
    c.args(args).env_remove("K3_ISA");
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("spawn k3-run")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// (generated ids, step-0 logit bytes) of a run on the KL fixture.
fn run(dir: &Path, extra: &[&str], env: &[(&str, &str)]) -> (Vec<u64>, Vec<u8>) {
    let s = summary();
    let prompt = csv(&ids(&s["prompt_ids"]));
    let n = ids(&s["generated_ids"]).len().to_string();
    let out = dir.join("run.json");
    let dump = dir.join("step0.f32");
    let ck = fixture().join("ckpt");
    let m = manifest();
    let mut args = vec![
        ck.to_str().unwrap(),
        "--manifest",
        &m,
        "--ids",
        &prompt,
        "--gen",
        &n,
        "--out",
        out.to_str().unwrap(),
        "--dump-logits",
        dump.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let o = k3(&args, env);
    assert!(o.status.success(), "{extra:?}:\n{}", stderr(&o));
    let v: Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    (ids(&v["generated_ids"]), std::fs::read(&dump).unwrap())
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[test]
fn kimi_linear_fixture_matches_the_reference_through_the_manifest() {
    let tmp = tempfile::tempdir().unwrap();
    let s = summary();
    let want = ids(&s["generated_ids"]);
    let margins: Vec<f64> = s["step_margins"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m.as_f64().unwrap())
        .collect();

    let (got, logits) = run(tmp.path(), &["--incremental", "--threads", "2"], &[]);
    // Greedy ids equal the reference up to the first step the reference calls a near tie.
    let stable = margins.iter().take_while(|&&m| m >= 1e-3).count();
    assert!(
        stable >= want.len() / 2,
        "fixture too unstable: {margins:?}"
    );
    assert_eq!(got[..stable], want[..stable], "greedy ids vs reference");

    let r = f32s(&std::fs::read(fixture().join("ref/step0_logits.f32")).unwrap());
    let e = f32s(&logits);
    assert_eq!(e.len(), r.len(), "vocab-sized step-0 logits");
    let worst = e
        .iter()
        .zip(&r)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(
        worst <= 1e-3,
        "step-0 logits differ from the reference by {worst}"
    );

    // Same bits: full recompute, one thread, the scalar kernels.
    for (extra, env) in [
        (&["--threads", "2"][..], &[][..]),
        (&["--incremental", "--threads", "1"][..], &[][..]),
        (&["--incremental"][..], &[("K3_ISA", "scalar")][..]),
    ] {
        let (g, l) = run(tmp.path(), extra, env);
        assert_eq!(g, got, "{extra:?} {env:?}: ids");
        assert!(l == logits, "{extra:?} {env:?}: step-0 logit bits differ");
    }

    // Streamed: packed trunk (one ring slot, two, a pinned layer + two; 385 KB packed, the
    // largest layer 102 KB) and the expert cache (none, 6 of the 40 experts).
    let trunk = tmp.path().join("trunk");
    let m = manifest();
    let ck = fixture().join("ckpt");
    let o = k3(
        &[
            "pack-trunk",
            ck.to_str().unwrap(),
            trunk.to_str().unwrap(),
            "--manifest",
            &m,
        ],
        &[],
    );
    assert!(o.status.success(), "pack-trunk: {}", stderr(&o));
    let t = trunk.to_str().unwrap();
    for budget in [
        &["--trunk-gb", "0.000105", "--cache-gb", "0"][..],
        &["--trunk-gb", "0.00021", "--cache-gb", "0.0001"][..],
        &["--trunk-gb", "0.0003", "--cache-gb", "0.0001"][..],
    ] {
        let mut extra = vec!["--incremental", "--trunk", t];
        extra.extend_from_slice(budget);
        let (g, l) = run(tmp.path(), &extra, &[]);
        assert_eq!(g, got, "streamed {budget:?}: ids");
        assert!(l == logits, "streamed {budget:?}: step-0 logit bits differ");
    }

    // Without the manifest the built-in K3 one refuses the flat Kimi-Linear config (exit 2).
    let o = k3(&[ck.to_str().unwrap(), "--ids", "1", "--gen", "1"], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
}
