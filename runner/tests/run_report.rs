//! The end-of-run report and `--out` JSON of a streamed run: `time_to_first_token_seconds`
//! (start-up + prefill + first token; the pinned-prefix load runs beside them, or within
//! start-up with `K3_PIN_SYNC=1`) next to the unchanged `first_token_seconds` /
//! `pinned_load_seconds`, and the memory-limit line and object.
//!
//! Owns: black-box checks through the `k3-run` binary on the tiny synthetic model (synth +
//! pack-trunk under target/, not tmpfs). Must not: call the library; expectations come from
//! the documented report contract (docs/STREAMING.md) and from the wall clock around the
//! process, never from numbers copied out of the code.

use std::path::PathBuf;
use std::process::Output;
use std::time::Instant;

use serde_json::Value;

mod bin_support;
use bin_support::{k3, k3_env, repo, s};

fn ok(o: &Output, what: &str) {
    assert!(
        o.status.success(),
        "{what} failed ({:?}):\nstdout:\n{}\nstderr:\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// A fresh directory under target/tmp.
fn test_dir(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("run_report")
        .join(name);
    if dir.exists() {
        std::fs::remove_dir_all(&dir).expect("remove stale test dir");
    }
    std::fs::create_dir_all(&dir).expect("create test dir under target/");
    dir
}

fn num(v: &Value, key: &str) -> f64 {
    v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("--out JSON: {key} is not a number: {}", v[key]))
}

#[test]
fn pinned_run_reports_time_to_first_token_including_the_pinned_load() {
    let dir = test_dir("ttft");
    let (model, trunk) = (dir.join("model"), dir.join("trunk"));
    let spec = repo().join("configs/synth/tiny.toml");
    ok(
        &k3(&[
            "synth",
            "--spec",
            s(&spec),
            "--seed",
            "3",
            "--out",
            s(&model),
        ]),
        "synth",
    );
    ok(&k3(&["pack-trunk", s(&model), s(&trunk)]), "pack-trunk");

    // No --trunk-gb: the whole trunk is pinned. By default it loads on background threads
    // beside start-up and the prompt; with K3_PIN_SYNC=1 while the session is built.
    let mut o: Option<(Output, Value)> = None;
    for background in [true, false] {
        let out = dir.join("out.json");
        let envs: &[(&str, &str)] = if background {
            &[]
        } else {
            &[("K3_PIN_SYNC", "1")]
        };
        let t0 = Instant::now();
        let run = k3_env(
            &[
                s(&model),
                "--ids",
                "1,2,3",
                "--gen",
                "2",
                "--incremental",
                "--trunk",
                s(&trunk),
                "--threads",
                "1",
                "--out",
                s(&out),
            ],
            envs,
        );
        let wall = t0.elapsed().as_secs_f64();
        ok(&run, "pinned run");
        let v: Value = serde_json::from_str(&std::fs::read_to_string(&out).expect("--out written"))
            .expect("--out is JSON");
        let first = num(&v, "first_token_seconds");
        let pinned = num(&v, "pinned_load_seconds");
        let ttft = num(&v, "time_to_first_token_seconds");
        let waited = v["trunk"]["pinned_wait_seconds"]
            .as_f64()
            .expect("trunk.pinned_wait_seconds");
        assert_eq!(
            v["trunk"]["pinned_background"].as_bool(),
            Some(background),
            "{v}"
        );
        assert!(pinned > 0.0, "the whole trunk was pinned: {pinned}");
        assert!(first > 0.0, "a token was generated: {first}");
        assert!(
            ttft <= wall,
            "time to first token {ttft} longer than the whole process ({wall} s)"
        );
        let trunk_read = v["trunk"]["read_seconds"]
            .as_f64()
            .expect("trunk.read_seconds");
        assert!(trunk_read >= pinned, "{trunk_read} vs pinned load {pinned}");
        let stdout = String::from_utf8_lossy(&run.stdout).into_owned();
        let line = stdout
            .lines()
            .find(|l| l.starts_with("time to first token "))
            .unwrap_or_else(|| panic!("no time-to-first-token line in the report:\n{stdout}"))
            .to_string();
        assert!(line.contains(&format!("{ttft:.3} s")), "{line} vs {ttft}");
        let io_share = num(&v, "io_share");
        if background {
            // Every layer is used by the first token, so the load ended before it; the run
            // waited at most the first token's time for it. The experts are resident: the
            // only I/O the run's clock holds is that wait.
            assert!(
                pinned <= ttft && ttft >= first && waited <= first,
                "pinned load {pinned}, waited {waited}, first token {first}, ttft {ttft}"
            );
            let total = num(&v, "total_seconds");
            assert!(
                (io_share * total - waited).abs() <= 1e-6 + 1e-9 * total,
                "io_share {io_share} x {total} s vs waited {waited}"
            );
            assert!(
                line.contains(&format!(
                    "the pinned prefix loaded beside them in {pinned:.3} s, the run waited {waited:.3} s"
                )),
                "{line}"
            );
        } else {
            assert_eq!(waited, 0.0, "{v}");
            assert!(
                ttft >= first + pinned,
                "time to first token {ttft} < first token {first} + pinned load {pinned}"
            );
            // Nothing is read while the run's clock runs, so the I/O share is 0 although the
            // trunk's read seconds hold the load.
            assert_eq!(io_share, 0.0, "start-up load counted in io_share");
            assert!(
                line.contains(&format!("pinned prefix load {pinned:.3} s")),
                "{line}"
            );
        }
        // The existing first-token line is unchanged.
        assert!(
            stdout.contains(&format!("first token {first:.3} s, decode ")),
            "{stdout}"
        );
        o = Some((run, v));
    }
    let (o, v) = o.expect("two runs");

    // The memory limit the state check used is reported at start and in the JSON.
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(stderr.contains("  memory limit: "), "{stderr}");
    let ml = &v["memory_limit"];
    assert!(ml.is_object(), "memory_limit object: {v}");
    if cfg!(target_os = "linux") {
        let avail = ml["mem_available_bytes"]
            .as_u64()
            .expect("MemAvailable is readable on Linux");
        let bytes = ml["bytes"].as_u64().expect("a limit on Linux");
        assert!(bytes > 0 && bytes <= avail, "{ml}");
        if let Some(c) = ml["cgroup"].as_object() {
            let lim = c["limit_bytes"].as_u64().expect("limit_bytes");
            let used = c["usage_bytes"].as_u64().expect("usage_bytes");
            assert_eq!(bytes, avail.min(lim.saturating_sub(used)), "{ml}");
            assert!(matches!(c["version"].as_str(), Some("v1" | "v2")), "{ml}");
        }
    }

    // With --gen 0 there is no first token: the field is null, the run still succeeds.
    let out0 = dir.join("out0.json");
    ok(
        &k3(&[
            s(&model),
            "--ids",
            "1,2,3",
            "--gen",
            "0",
            "--trunk",
            s(&trunk),
            "--threads",
            "1",
            "--out",
            s(&out0),
        ]),
        "--gen 0 run",
    );
    let v0: Value = serde_json::from_str(&std::fs::read_to_string(&out0).expect("--out written"))
        .expect("--out is JSON");
    assert!(
        v0.get("time_to_first_token_seconds")
            .is_some_and(Value::is_null),
        "{v0}"
    );
    std::fs::remove_dir_all(&dir).expect("remove the test dir");
}
