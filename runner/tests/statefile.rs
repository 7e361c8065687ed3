//! `--save-state` / `--load-state`: a prefix prefilled once and resumed gives exactly the ids
//! and first-step logit bits of feeding the whole prompt at once (incremental and full
//! recompute); a state from another model, or a damaged file, is refused with exit 2.

use std::path::{Path, PathBuf};
use std::process::Command;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_k3-run"))
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/models")
        .join(name)
        .join("ckpt")
}

fn run_json(args: &[&str], out: &Path) -> serde_json::Value {
    let o = bin()
        .args(args)
        .arg("--out")
        .arg(out)
        .output()
        .expect("run k3-run");
    assert!(
        o.status.success(),
        "k3-run {args:?} failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_str(&std::fs::read_to_string(out).expect("--out written")).expect("json")
}

#[test]
fn resumed_state_equals_whole_prompt() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("statefile");
    std::fs::create_dir_all(&dir).expect("mkdir");
    let a = fixture("A");
    let a = a.to_str().expect("utf-8 path");
    let state = dir.join("prefix.state");
    let state_s = state.to_str().expect("utf-8 path");
    let whole = run_json(
        &[
            a,
            "--ids",
            "11,22,33,44,55,66,77,88",
            "--gen",
            "6",
            "--incremental",
        ],
        &dir.join("whole.json"),
    );
    let _ = run_json(
        &[
            a,
            "--ids",
            "11,22,33,44,55",
            "--gen",
            "0",
            "--save-state",
            state_s,
        ],
        &dir.join("save.json"),
    );
    for mode in [&["--incremental"][..], &[][..]] {
        let mut args = vec![
            a,
            "--ids",
            "66,77,88",
            "--gen",
            "6",
            "--load-state",
            state_s,
        ];
        args.extend_from_slice(mode);
        let resumed = run_json(&args, &dir.join("resumed.json"));
        assert_eq!(
            resumed["generated_ids"], whole["generated_ids"],
            "mode {mode:?}"
        );
        assert_eq!(
            resumed["first_logits_hash"], whole["first_logits_hash"],
            "mode {mode:?}"
        );
        assert_eq!(resumed["resumed_positions"], 5);
    }
    // Loading `state` into `model` is refused with exit 2 and a message holding `needles`.
    let refused = |model: &str, state: &Path, needles: &[&str]| {
        let o = bin()
            .args([model, "--ids", "1", "--gen", "1", "--load-state"])
            .arg(state)
            .arg("--out")
            .arg(dir.join("refused.json"))
            .output()
            .expect("run");
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{err}");
        for n in needles {
            assert!(
                err.contains(n),
                "{} should mention {n:?}: {err}",
                state.display()
            );
        }
    };
    // a state from another model is refused, naming the file
    let b = fixture("B");
    refused(
        b.to_str().expect("utf-8"),
        &state,
        &["different model", "prefix.state"],
    );
    // a truncated file is refused
    let bytes = std::fs::read(&state).expect("read state");
    let cut = dir.join("cut.state");
    std::fs::write(&cut, &bytes[..bytes.len() - 7]).expect("write");
    refused(a, &cut, &["truncated"]);
    // a header id outside the vocabulary (256 for fixture A) is refused
    let hl = u32::from_le_bytes(bytes[12..16].try_into().expect("4 bytes")) as usize;
    let mut h: serde_json::Value = serde_json::from_slice(&bytes[16..16 + hl]).expect("header");
    h["ids"][0] = serde_json::json!(999);
    let hj = serde_json::to_vec(&h).expect("json");
    let mut forged = bytes[..12].to_vec();
    forged.extend_from_slice(&(hj.len() as u32).to_le_bytes());
    forged.extend_from_slice(&hj);
    forged.extend_from_slice(&bytes[16 + hl..]);
    let bad_ids = dir.join("ids.state");
    std::fs::write(&bad_ids, forged).expect("write");
    refused(a, &bad_ids, &["999", "vocabulary"]);
    // this build writes version 2 (the latent MLA cache) ...
    assert_eq!(&bytes[..8], b"K3STATE\0", "magic");
    assert_eq!(
        u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]),
        2
    );
    // ... and refuses a version 1 file (the expanded MLA cache), naming the file and both
    // versions and saying to save it again
    let mut v1 = bytes.clone();
    v1[8..12].copy_from_slice(&1u32.to_le_bytes());
    let old = dir.join("v1.state");
    std::fs::write(&old, v1).expect("write");
    refused(
        a,
        &old,
        &[
            old.to_str().expect("utf-8 path"),
            "version 1",
            "version 2",
            "latent MLA cache",
            "--save-state",
        ],
    );
    // a device or FIFO is refused before anything is read (/dev/zero used to be read until
    // memory ran out)
    refused(a, Path::new("/dev/zero"), &["not a regular file"]);
    // --save-state needs --gen 0
    let o = bin()
        .args([a, "--ids", "1", "--gen", "2", "--save-state", state_s])
        .output()
        .expect("run");
    assert_eq!(o.status.code(), Some(2));
}
