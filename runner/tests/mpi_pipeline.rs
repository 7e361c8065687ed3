//! `--pipeline` through the binary under `mpirun` (docs/SCALE-OUT.md): `-np 2` and `-np 3` on the
//! committed fixtures over the shared-memory transport give the single-process ids and
//! first-step logit bytes at batch 1, 3 and 4; a rank killed mid-run and a rank that cannot
//! load its layers end the job with rank 0's message and a non-zero exit, within a timeout.
//! The MPI tests say plainly that they are skipped when this build has no `mpi` feature or
//! `mpirun` is not on the PATH. `plan --hosts` and the feature-less `--pipeline` refusal run
//! in every build.

#![cfg(unix)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_k3-run")
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/models")
        .join(name)
        .join("ckpt")
}

/// Why the MPI tests cannot run here, if they cannot.
fn mpi_missing() -> Option<&'static str> {
    if !cfg!(feature = "mpi") {
        return Some("this k3-run was built without the `mpi` feature (cargo test --features mpi)");
    }
    let found = Command::new("mpirun")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !found {
        return Some("mpirun is not on the PATH (apt-get install -y libopenmpi-dev openmpi-bin)");
    }
    None
}

/// A skip said past the test harness's output capture (it captures `eprintln!`, not writes
/// to the stderr handle), so `cargo test` shows it even when the test passes.
fn skipped(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{line}");
}

macro_rules! need_mpi {
    ($test:literal) => {
        if let Some(why) = mpi_missing() {
            skipped(&format!("SKIPPED {}: {why}", $test));
            return;
        }
    };
}

/// `mpirun` on this machine: any number of ranks on 2 cores, shared memory only, as root too.
fn mpirun(np: usize) -> Command {
    let mut c = Command::new("mpirun");
    c.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .args(["--oversubscribe", "--mca", "btl", "self,vader", "-np"])
        .arg(np.to_string());
    c
}

/// Wait for `child` at most `secs`; kill it and fail past that (a hang is a failure).
fn wait_bounded(mut child: std::process::Child, secs: u64) -> (i32, String, String) {
    let t0 = Instant::now();
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            let out = child.wait_with_output().unwrap();
            return (
                st.code().unwrap_or(-1),
                String::from_utf8_lossy(&out.stdout).into_owned(),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            );
        }
        if t0.elapsed() > Duration::from_secs(secs) {
            let _ = child.kill();
            panic!("mpirun still running after {secs} s: the pipeline hung");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn run_args(model: &Path, batch: &str, n_gen: usize, out: &Path, logits: &Path) -> Vec<String> {
    vec![
        model.display().to_string(),
        "--batch-ids".into(),
        batch.into(),
        "--gen".into(),
        n_gen.to_string(),
        "--threads".into(),
        "1".into(),
        "--out".into(),
        out.display().to_string(),
        "--dump-logits".into(),
        logits.display().to_string(),
    ]
}

fn ids_and_hashes(out: &Path) -> Vec<(Vec<u64>, String)> {
    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out).unwrap()).expect("--out JSON");
    v["sequences"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["generated_ids"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_u64().unwrap())
                    .collect(),
                s["first_logits_hash"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

#[test]
fn mpirun_np2_and_np3_give_the_single_process_ids_and_logits() {
    need_mpi!("mpirun_np2_and_np3_give_the_single_process_ids_and_logits");
    let dir = tempfile::tempdir().unwrap();
    for (name, batch, n_gen) in [
        ("A", "1,2,3", 6),
        ("A", "1,2,3;4,5;7", 5),
        ("B", "3,14,15;92,65,35,89;2,7;1", 4),
    ] {
        let model = fixture(name);
        let (so, sl) = (
            dir.path().join("single.json"),
            dir.path().join("single.f32"),
        );
        let st = Command::new(bin())
            .args(run_args(&model, batch, n_gen, &so, &sl))
            .arg("--incremental")
            .output()
            .unwrap();
        assert!(
            st.status.success(),
            "{}",
            String::from_utf8_lossy(&st.stderr)
        );
        let want = ids_and_hashes(&so);
        assert_eq!(want.len(), batch.split(';').count());
        assert!(want.iter().all(|(ids, _)| ids.len() == n_gen));
        for np in [2, 3] {
            let (po, pl) = (dir.path().join("pipe.json"), dir.path().join("pipe.f32"));
            let _ = std::fs::remove_file(&po);
            let child = mpirun(np)
                .arg(bin())
                .args(run_args(&model, batch, n_gen, &po, &pl))
                .arg("--pipeline")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            let (code, out, err) = wait_bounded(child, 120);
            let what = format!("fixture {name}, batch {batch:?}, -np {np}");
            assert_eq!(code, 0, "{what}: {out}\n{err}");
            assert_eq!(ids_and_hashes(&po), want, "{what}");
            assert_eq!(
                std::fs::read(&pl).unwrap(),
                std::fs::read(&sl).unwrap(),
                "{what}: first-step logits bytes"
            );
            for r in 0..np {
                assert!(out.contains(&format!("rank {r}: layers ")), "{what}: {out}");
            }
            assert!(
                out.contains(&format!("pipeline: {np} ranks")),
                "{what}: {out}"
            );
            // every rank's layers pinned: no trunk byte read per token
            assert_eq!(
                out.matches("trunk read during the run 0.000 GB").count(),
                np,
                "{what}: {out}"
            );
        }
    }
}

#[test]
fn a_rank_killed_mid_run_ends_the_job_with_a_message_on_rank_0() {
    need_mpi!("a_rank_killed_mid_run_ends_the_job_with_a_message_on_rank_0");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("o.json");
    let mut child = mpirun(3)
        .arg(bin())
        .args([
            fixture("A").display().to_string(),
            "--pipeline".into(),
            "--batch-ids".into(),
            "1,2,3;4,5;7".into(),
            "--gen".into(),
            "4000".into(),
            "--threads".into(),
            "1".into(),
            "--out".into(),
            out.display().to_string(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // rank 1's pid from its start-up line; kill it once ids flow
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut all = String::new();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(rest) = line.strip_prefix("pipeline rank 1 (pid ") {
                let pid: i32 = rest.split(')').next().unwrap().parse().unwrap();
                let _ = tx.send(pid);
            }
            all.push_str(&line);
            all.push('\n');
        }
        all
    });
    let stdout = child.stdout.take().unwrap();
    let mut lines = BufReader::new(stdout).lines();
    let pid = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("rank 1's pid");
    // a few ids first: the kill lands mid-run
    for _ in 0..30 {
        let l = lines.next().expect("ids before the kill").unwrap();
        assert!(l.starts_with("sequence "), "{l}");
    }
    // SAFETY: kill(2) on a pid of a process this test started (through mpirun).
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    // the rest of the output on a thread: the bounded wait below must not sit behind it
    let rest = std::thread::spawn(move || lines.map_while(Result::ok).collect::<Vec<String>>());
    let t0 = Instant::now();
    let (code, _, _) = wait_bounded(child, 60);
    let rest = rest.join().unwrap();
    let err = reader.join().unwrap();
    assert_ne!(code, 0, "the job must fail: {err}");
    assert!(t0.elapsed() < Duration::from_secs(60));
    assert!(
        err.contains("k3-run: error: pipeline rank 0: the job was ended from outside"),
        "{err}"
    );
    assert!(err.contains("rank 1"), "mpirun names the dead rank: {err}");
    assert!(
        !rest.iter().any(|l| l.contains("generated ids")),
        "no final ids after a rank died: {rest:?}"
    );
    assert!(!out.exists(), "no --out after a failed run");
}

#[test]
fn a_rank_that_cannot_load_its_layers_ends_the_job_on_rank_0() {
    need_mpi!("a_rank_that_cannot_load_its_layers_ends_the_job_on_rank_0");
    // rank 1's copy of the checkpoint has a cut shard (MPMD: each rank its own directory)
    let dir = tempfile::tempdir().unwrap();
    let broken = dir.path().join("broken");
    std::fs::create_dir(&broken).unwrap();
    for e in std::fs::read_dir(fixture("A")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), broken.join(e.file_name())).unwrap();
    }
    let shard = broken.join("model-00003-of-00004.safetensors");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&shard)
        .unwrap()
        .set_len(100_000)
        .unwrap();
    let out = dir.path().join("o.json");
    let args = |m: &Path| {
        vec![
            m.display().to_string(),
            "--pipeline".into(),
            "--ids".into(),
            "1,2,3".into(),
            "--gen".into(),
            "3".into(),
            "--threads".into(),
            "1".into(),
            "--out".into(),
            out.display().to_string(),
        ]
    };
    let mut c = mpirun(1);
    c.arg(bin()).args(args(&fixture("A")));
    c.args([":", "-np", "1"]).arg(bin()).args(args(&broken));
    let child = c
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (code, _, err) = wait_bounded(child, 60);
    assert_ne!(code, 0, "{err}");
    assert!(
        err.contains("k3-run: error: pipeline: rank 1 could not load its layers:")
            && err.contains("truncated shard"),
        "{err}"
    );
    assert!(!out.exists());
}

#[test]
fn plan_prints_the_split_for_a_host_list() {
    let run = |extra: &[&str]| {
        let o = Command::new(bin())
            .arg("plan")
            .arg(fixture("A"))
            .args(extra)
            .output()
            .unwrap();
        (
            o.status.code(),
            String::from_utf8_lossy(&o.stdout).into_owned(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    let (code, out, err) = run(&["--hosts", "3"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("pipeline split over 3 hosts"), "{out}");
    for (r, layers) in [(0, "layers 0..4"), (1, "layers 4..8"), (2, "layers 8..13")] {
        assert!(out.contains(&format!("rank {r}: {layers} ")), "{out}");
    }
    // a budget too small for its share is said
    let (code, out, err) = run(&["--host-gb", "0.0001,0.02"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        out.contains("rank 0: layers 0..") && out.contains("does not fit"),
        "{out}"
    );
    let (code, _, err) = run(&["--hosts", "20"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("20 hosts for 13 layers"), "{err}");
}

#[test]
fn pipeline_without_the_feature_says_how_to_build_it() {
    if cfg!(feature = "mpi") {
        skipped("SKIPPED pipeline_without_the_feature_says_how_to_build_it: built with `mpi`");
        return;
    }
    let o = Command::new(bin())
        .arg(fixture("A"))
        .args(["--pipeline", "--ids", "1,2"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("--features mpi"), "{err}");
}
