//! Shared helpers of the `k3-run verify` tests (verify_budget.rs, verify_hash.rs): run it on a
//! directory, read its verdict, copy fixture A to alter it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Output;

use super::bin_support::{code, fixture_a, fresh_dir, k3, s, stderr};

/// A run's stdout as text.
pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A copy of fixture A's checkpoint under target/ (the tests alter it).
pub fn copy_a(name: &str) -> PathBuf {
    let dir = fresh_dir(name);
    for e in std::fs::read_dir(fixture_a()).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
    }
    dir
}

/// `k3-run verify DIR extra...`.
pub fn verify(dir: &Path, extra: &[&str]) -> Output {
    let mut args = vec!["verify", s(dir)];
    args.extend_from_slice(extra);
    k3(&args)
}

/// The files of the `RESULT : FAIL: fetch again: a, b` line (asserts exit 1 and FAIL).
pub fn fetch_again(o: &Output) -> Vec<String> {
    let out = stdout(o);
    assert_eq!(code(o), 1, "verify should fail:\n{out}\n{}", stderr(o));
    let line = out
        .lines()
        .find(|l| l.starts_with("RESULT : FAIL"))
        .unwrap_or_else(|| panic!("no RESULT : FAIL line:\n{out}"));
    let list = line
        .split_once("fetch again: ")
        .unwrap_or_else(|| panic!("no file named: {line}"))
        .1;
    list.split(", ").map(str::to_string).collect()
}

/// Asserts exit 0 and `RESULT : byte-exact match`; returns stdout.
pub fn assert_match(o: &Output) -> String {
    let out = stdout(o);
    assert_eq!(code(o), 0, "verify should pass:\n{out}\n{}", stderr(o));
    assert!(
        out.lines().any(|l| l == "RESULT : byte-exact match"),
        "{out}"
    );
    out
}
