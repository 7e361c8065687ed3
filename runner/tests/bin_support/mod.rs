//! Shared helpers of the black-box tests of the `k3-run` binary: run it, read its output and exit
//! code, name paths, the repository and fixture A.
#![allow(dead_code)]

use std::path::Path;
use std::process::{Command, Output};

/// Run the `k3-run` binary with `args` on the default kernel path (`K3_ISA` removed).
pub fn k3(args: &[&str]) -> Output {
    k3_env(args, &[])
}

/// [`k3`] with extra environment variables (the caller's `K3_ISA` and `K3_PIN_SYNC` are
/// never passed on).
pub fn k3_env(args: &[&str], envs: &[(&str, &str)]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_k3-run"))
        .args(args)
        .env_remove("K3_ISA")
        .env_remove("K3_PIN_SYNC")
        .envs(envs.iter().copied())
        .output()
        .expect("spawn k3-run")
}

/// The repository root.
pub fn repo() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("runner/ lives inside the repository")
        .to_path_buf()
}

/// Fixture A's checkpoint (written by the independent numpy reference).
pub fn fixture_a() -> std::path::PathBuf {
    repo().join("fixtures/models/A/ckpt")
}

/// Run `k3-run args` (which must include `--out out`), assert it succeeded, and return the
/// `--out` JSON.
pub fn k3_out(args: &[&str], out: &Path) -> serde_json::Value {
    let o = k3(args);
    assert!(
        o.status.success(),
        "k3-run {args:?} failed ({:?}):\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&std::fs::read(out).expect("--out written")).expect("--out is JSON")
}

/// A run's stderr as text.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A run's exit code (a signal fails the test).
pub fn code(o: &Output) -> i32 {
    o.status
        .code()
        .unwrap_or_else(|| panic!("k3-run killed by a signal; stderr:\n{}", stderr(o)))
}

/// Asserts the exit code and that stderr mentions every needle; returns stderr.
pub fn expect_fail(o: &Output, want: i32, needles: &[&str]) -> String {
    let err = stderr(o);
    assert_eq!(code(o), want, "exit code; stderr:\n{err}");
    for n in needles {
        assert!(err.contains(n), "stderr should mention {n:?}:\n{err}");
    }
    err
}

/// A test path as a command-line argument.
pub fn s(p: &Path) -> &str {
    p.to_str().expect("test paths are UTF-8")
}

/// An empty directory `name` under the test target's scratch space.
pub fn fresh_dir(name: &str) -> std::path::PathBuf {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("mkdir");
    dir
}

/// Write the synthetic tiny checkpoint (`configs/synth/tiny.toml`) of `seed` to `out`.
pub fn synth_tiny(out: &Path, seed: u64) {
    let spec = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/synth/tiny.toml");
    let seed = seed.to_string();
    let o = k3(&[
        "synth",
        "--spec",
        s(&spec),
        "--seed",
        &seed,
        "--out",
        s(out),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}
