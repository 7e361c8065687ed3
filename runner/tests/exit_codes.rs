//! One mapping of failures to exit codes for every subcommand (docs/DESIGN.md §6), black box:
//! a checkpoint whose files cannot be read exits 1, naming the file, from every subcommand that
//! reads them: a run (resident, on a packed trunk, `--batch-ids`, `--chat`, `--serve`),
//! `pack-trunk`, `pack-trunk --check`, `budget` and `verify`. `plan` reads no tensor data (only
//! config.json, the manifest and the headers that open) and still prints the plan.
//!
//! Cases: a shard cut short by 100 bytes; an index whose `weight_map` is not an object; an
//! index whose `weight_map` names no shard.
//!
//! Owns: the exit-code contract across subcommands. Expectations come from the documented
//! codes, not from another run.

mod bin_support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use bin_support::{code, fresh_dir, k3, s, stderr, synth_tiny};

/// Runs `k3-run args` with stdin empty; a process still running after 120 s (a server that
/// kept listening, a REPL waiting) is killed and fails the test.
fn k3_deadline(args: &[&str]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_k3-run"))
        .args(args)
        .env_remove("K3_ISA")
        .env_remove("K3_PIN_SYNC")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn k3-run");
    let t0 = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t0.elapsed() > Duration::from_secs(120) {
            child.kill().ok();
            let o = child.wait_with_output().unwrap();
            panic!(
                "`k3-run {}` still running after 120 s: {}",
                args.join(" "),
                String::from_utf8_lossy(&o.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

/// Exit code of a checkpoint that cannot be read (docs/DESIGN.md §6).
const CHECKPOINT_UNREADABLE: i32 = 1;

const INDEX: &str = "model.safetensors.index.json";
const LAST_SHARD: &str = "model-00004-of-00004.safetensors";

/// stdout and stderr of a run, as text (verify names the files on stdout, errors on stderr).
fn all_output(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// A synthetic tiny checkpoint in `root/ck` and its packed trunk in `root/trunk`, both whole.
fn checkpoint_and_trunk(name: &str) -> (PathBuf, PathBuf, PathBuf) {
    let root = fresh_dir(name);
    let ck = root.join("ck");
    synth_tiny(&ck, 5);
    let trunk = root.join("trunk");
    let o = k3(&["pack-trunk", s(&ck), s(&trunk)]);
    assert_eq!(
        code(&o),
        0,
        "pack-trunk of the whole checkpoint: {}",
        stderr(&o)
    );
    (root, ck, trunk)
}

/// Every subcommand that reads the checkpoint's weights, as (label, arguments).
fn readers(root: &Path, ck: &Path, trunk: &Path) -> Vec<(&'static str, Vec<String>)> {
    let ck = s(ck).to_string();
    let out = s(&root.join("run.json")).to_string();
    let new_trunk = s(&root.join("trunk-again")).to_string();
    let trunk = s(trunk).to_string();
    let v = |a: &[&str]| a.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    vec![
        (
            "run",
            v(&[&ck, "--ids", "1,2,3", "--gen", "2", "--out", &out]),
        ),
        (
            "run --incremental --trunk",
            v(&[
                &ck,
                "--ids",
                "1,2,3",
                "--gen",
                "2",
                "--incremental",
                "--trunk",
                &trunk,
                "--trunk-gb",
                "0.001",
                "--out",
                &out,
            ]),
        ),
        (
            "run --batch-ids",
            v(&[
                &ck,
                "--batch-ids",
                "1,2;3",
                "--gen",
                "2",
                "--incremental",
                "--out",
                &out,
            ]),
        ),
        ("run --chat", v(&[&ck, "--chat", "--gen", "2"])),
        (
            "run --serve",
            v(&[&ck, "--serve", "127.0.0.1:0", "--gen", "2"]),
        ),
        ("pack-trunk", v(&["pack-trunk", &ck, &new_trunk])),
        (
            "pack-trunk --check",
            v(&["pack-trunk", "--check", &ck, &trunk]),
        ),
        ("budget", v(&["budget", &ck])),
        ("verify", v(&["verify", &ck])),
    ]
}

/// Runs every reader on the damaged checkpoint: each exits [`CHECKPOINT_UNREADABLE`] and names
/// `file`; `plan` exits 0.
fn assert_every_reader_fails_alike(root: &Path, ck: &Path, trunk: &Path, file: &str) {
    let mut seen = Vec::new();
    for (label, args) in readers(root, ck, trunk) {
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = k3_deadline(&argv);
        let text = all_output(&o);
        seen.push(format!("{label}: exit {:?}", o.status.code()));
        assert_eq!(
            code(&o),
            CHECKPOINT_UNREADABLE,
            "`k3-run {}` with a damaged {file}: exit code (so far: {seen:?}); output:\n{text}",
            argv.join(" ")
        );
        assert!(
            text.contains(file),
            "`k3-run {}` does not name {file}:\n{text}",
            argv.join(" ")
        );
    }
    let o = k3(&["plan", s(ck)]);
    assert_eq!(
        code(&o),
        0,
        "plan reads no weights; it prints the plan: {}",
        stderr(&o)
    );
}

#[test]
fn a_truncated_shard_exits_1_naming_it_in_every_subcommand_that_reads_it() {
    let (root, ck, trunk) = checkpoint_and_trunk("exit_codes_truncated");
    let shard = ck.join(LAST_SHARD);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&shard)
        .unwrap();
    let len = f.metadata().unwrap().len();
    f.set_len(len - 100).unwrap();
    drop(f);
    assert_every_reader_fails_alike(&root, &ck, &trunk, LAST_SHARD);
}

#[test]
fn an_index_that_cannot_be_read_exits_1_naming_it_in_every_subcommand_that_reads_it() {
    let (root, ck, trunk) = checkpoint_and_trunk("exit_codes_index");
    for bad in [&b"{\"weight_map\": 3}"[..], &b"{\"weight_map\": {}}"[..]] {
        std::fs::write(ck.join(INDEX), bad).unwrap();
        assert_every_reader_fails_alike(&root, &ck, &trunk, INDEX);
    }
}
