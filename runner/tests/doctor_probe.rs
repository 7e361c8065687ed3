//! `k3-run doctor`'s disk probe, black box, with test files of a few MB: without `--dir`,
//! `--trunk` or `--model` nothing is written (not into the current directory either) and the
//! output names the flags; with `--trunk` the probe goes to that directory's disk (its nearest
//! existing parent before it is packed), announced with its size and place before it is
//! written; a file too small for the queue depths is refused before anything is written; no
//! test file is left behind after a finished run, and none is visible while the
//! probe runs nor after the process is killed in the middle of it.
//!
//! Owns: where the probe writes and that it cleans up. Must not: write more than a few MB.

mod bin_support;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bin_support::{code, fresh_dir, s, stderr};

/// Files in `dir` (names), sorted.
fn listing(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn doctor_in(cwd: &Path, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_k3-run"))
        .arg("doctor")
        .args(args)
        .current_dir(cwd)
        .env_remove("K3_ISA")
        .output()
        .expect("spawn k3-run")
}

#[test]
fn without_a_named_directory_doctor_writes_nothing_and_says_which_flag_to_give() {
    let cwd = fresh_dir("doctor_probe_cwd");
    let o = doctor_in(&cwd, &["--no-dram", "--size-gb", "0.01"]);
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        code(&o) == 0 || code(&o) == 1,
        "no disk named is not a failed measurement: exit {:?}\n{out}{}",
        o.status.code(),
        stderr(&o)
    );
    assert!(
        out.contains("disk       not measured") && out.contains("--dir DIR"),
        "{out}"
    );
    assert!(!out.contains("writing a"), "{out}");
    assert!(
        listing(&cwd).is_empty(),
        "wrote into the current directory: {:?}",
        listing(&cwd)
    );
}

#[test]
fn the_probe_goes_to_the_trunk_directory_is_announced_first_and_is_removed() {
    let root = fresh_dir("doctor_probe_trunk");
    let canon = std::fs::canonicalize(&root).unwrap();
    let trunk = root.join("not-packed-yet").join("k3trunk");
    let cwd = fresh_dir("doctor_probe_trunk_cwd");
    let o = doctor_in(
        &cwd,
        &[
            "--no-dram",
            "--trunk",
            s(&trunk),
            "--size-gb",
            "0.01",
            "--block-kib",
            "1024",
            "--qd",
            "1",
            "--order",
            "sequential",
            "--seconds",
            "0.2",
        ],
    );
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let announce = format!(
        "disk       writing a 0.01 GB test file in {} (the --trunk directory's disk; ",
        canon.display()
    );
    let at = out
        .find(&announce)
        .unwrap_or_else(|| panic!("no {announce:?} in:\n{out}{}", stderr(&o)));
    if let Some(read) = out.find("O_DIRECT reads") {
        assert!(at < read, "announced before the measurement:\n{out}");
    }
    assert!(
        listing(&root).is_empty(),
        "left behind: {:?}\n{out}",
        listing(&root)
    );
    assert!(listing(&cwd).is_empty(), "{:?}", listing(&cwd));
}

#[test]
fn a_killed_probe_leaves_no_test_file() {
    let dir = fresh_dir("doctor_probe_kill");
    // 4 KiB writes: slow enough that the process is still writing when it is killed
    let mut child = Command::new(env!("CARGO_BIN_EXE_k3-run"))
        .args([
            "doctor",
            "--no-dram",
            "--dir",
            s(&dir),
            "--size-gb",
            "0.1",
            "--block-kib",
            "4",
            "--qd",
            "1",
            "--seconds",
            "3600",
        ])
        .env_remove("K3_ISA")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn k3-run");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut seen = String::new();
    let announced = loop {
        match lines.next() {
            Some(Ok(l)) => {
                seen.push_str(&l);
                seen.push('\n');
                if l.starts_with("disk       writing a") {
                    break true;
                }
            }
            _ => break false,
        }
    };
    assert!(announced, "no announcement of the test file:\n{seen}");
    // the file is created right after the announcement and its name removed at once
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(300) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let running = child.try_wait().unwrap().is_none();
    let during = listing(&dir);
    child.kill().ok();
    child.wait().unwrap();
    assert!(
        during.is_empty(),
        "the test file is visible while doctor runs: {during:?}"
    );
    assert!(
        listing(&dir).is_empty(),
        "left behind after a kill: {:?}",
        listing(&dir)
    );
    if !running {
        eprintln!("note: doctor finished within 300 ms; the kill came after it");
    }
}

#[test]
fn a_test_file_too_small_for_the_queue_depths_is_refused_before_writing() {
    let dir = fresh_dir("doctor_probe_small");
    let o = doctor_in(
        &dir,
        &[
            "--no-dram",
            "--dir",
            s(&dir),
            "--size-gb",
            "0.01",
            "--qd",
            "1,16",
        ],
    );
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert_eq!(code(&o), 2, "a measurement asked for was not made:\n{out}");
    assert!(
        out.contains("NOT MEASURED") && out.contains("raise --size-gb"),
        "{out}"
    );
    assert!(!out.contains("writing a"), "nothing is written:\n{out}");
    assert!(listing(&dir).is_empty(), "{:?}", listing(&dir));
}
