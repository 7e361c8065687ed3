//! Shared helpers of the black-box tests of the `k3-run` binary (run_report, layers).
#![allow(dead_code)]

use std::path::Path;
use std::process::{Command, Output};

/// Run the `k3-run` binary with `args` on the default kernel path (`K3_ISA` removed).
pub fn k3(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_k3-run"))
        .args(args)
        .env_remove("K3_ISA")
        .output()
        .expect("spawn k3-run")
}

/// A test path as a command-line argument.
pub fn s(p: &Path) -> &str {
    p.to_str().expect("test paths are UTF-8")
}
