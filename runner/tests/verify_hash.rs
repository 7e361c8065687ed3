//! `k3-run verify --hash`, black box: the content of every published file against the digests
//! of a Hugging Face tree listing (`lfs.oid`: SHA-256 of an LFS file; `oid`: the git blob id of
//! any other file).
//! - The listing is made here by other programs: `sha256sum` (coreutils) for the shards and `git
//!   hash-object` for the other files, so the engine's digests are checked against independent
//!   ones.
//! - A byte flipped inside a shard's tensor data (size and header intact) passes the size check
//!   and is named by `--hash`; so is one in config.json (the git blob id path).
//! - The digests kept in `.k3-run-verify.json` serve a second run; a file changed since is read
//!   again; `--rehash` reads everything; a damaged kept file is not trusted.
//! - Ctrl-C stops the pass (exit 5, `RESULT : INCOMPLETE`, the unread files named), and the next
//!   run continues from the kept digests.
//! - Usage errors (exit 2): `--hash` without `--sizes`, a listing with no digests, a malformed
//!   digest, `--rehash` without `--hash`.
//!
//! Owns: black-box checks through the binary. Must not: call the library.

use std::io::{Seek, SeekFrom, Write};
use std::path::Path;
use std::process::Command;

use serde_json::{Value, json};

mod bin_support;
mod verify_support;
use bin_support::{code, fixture_a, fresh_dir, k3_env, s, stderr};
use verify_support::{assert_match, copy_a, fetch_again, stdout, verify};

/// The output of an external program, which must succeed.
fn tool(program: &str, args: &[&str]) -> String {
    let o = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{program} (needed to make the listing): {e}"));
    assert!(o.status.success(), "{program} {args:?}: {}", stderr(&o));
    String::from_utf8(o.stdout).unwrap()
}

/// One tree-listing entry for `dir/name`, as the Hugging Face API gives it: shards in LFS with
/// their SHA-256 (from `sha256sum`), other files with their git blob id (`git hash-object`).
fn entry(dir: &Path, name: &str) -> Value {
    let path = dir.join(name);
    let size = std::fs::metadata(&path).unwrap().len();
    if name.ends_with(".safetensors") {
        let sum = tool("sha256sum", &[s(&path)]);
        let sha = sum.split_whitespace().next().unwrap();
        json!({"type": "file", "oid": "0123456789abcdef0123456789abcdef01234567", "size": size,
               "path": name, "lfs": {"oid": sha, "size": size, "pointerSize": 135}})
    } else {
        let oid = tool("git", &["hash-object", s(&path)]);
        json!({"type": "file", "oid": oid.trim(), "size": size, "path": name})
    }
}

/// A tree listing of every file in `dir` (hidden ones left out), written to `at`.
fn listing(dir: &Path, at: &Path) -> usize {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| !n.starts_with('.'))
        .collect();
    names.sort();
    let mut v: Vec<Value> = names.iter().map(|n| entry(dir, n)).collect();
    v.push(
        json!({"type": "directory", "oid": "89abcdef0123456789abcdef0123456789abcdef",
                  "size": 0, "path": "docs"}),
    );
    std::fs::write(at, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
    names.len()
}

/// A copy of fixture A named `name` and its tree listing: (directory, listing, files listed).
fn listed_copy(name: &str) -> (std::path::PathBuf, std::path::PathBuf, usize) {
    let d = copy_a(name);
    let tree = d.parent().unwrap().join(format!("{name}_tree.json"));
    let n = listing(&d, &tree);
    (d, tree, n)
}

/// Flip every bit of the byte at `offset` (the file keeps its size).
fn flip(p: &Path, offset: u64) {
    let mut b = [0u8; 1];
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(p)
        .unwrap();
    f.seek(SeekFrom::Start(offset)).unwrap();
    std::io::Read::read_exact(&mut f, &mut b).unwrap();
    f.seek(SeekFrom::Start(offset)).unwrap();
    f.write_all(&[!b[0]]).unwrap();
}

#[test]
fn verify_hash_finds_what_sizes_cannot() {
    let (d, tree, n) = listed_copy("verify_hash");
    let shards: Vec<String> = {
        let mut v: Vec<String> = std::fs::read_dir(&d)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.ends_with(".safetensors"))
            .collect();
        v.sort();
        v
    };
    let flags = ["--sizes", s(&tree), "--hash"];

    // intact: every digest matches, all read now
    let o = verify(&d, &flags);
    let out = assert_match(&o);
    let want = format!(
        "digest : all {n} files match their published digests ({} sha256, {} git sha1)",
        shards.len(),
        n - shards.len()
    );
    assert!(out.contains(&want), "{out}");
    assert!(out.contains(", 0 kept from an earlier run"), "{out}");
    assert!(d.join(".k3-run-verify.json").is_file());

    // a second run takes the kept digests and reads nothing
    let o = verify(&d, &flags);
    let out = assert_match(&o);
    assert!(
        out.contains(&format!(", {n} kept from an earlier run")),
        "{out}"
    );
    assert!(
        stderr(&o).contains("every digest kept from an earlier run"),
        "{}",
        stderr(&o)
    );
    // --rehash reads them all again
    let o = verify(&d, &["--sizes", s(&tree), "--hash", "--rehash"]);
    assert!(
        assert_match(&o).contains(", 0 kept from an earlier run"),
        "{}",
        stdout(&o)
    );

    // one byte inside the second shard's tensor data: sizes and headers still agree
    let victim = d.join(&shards[1]);
    let len = std::fs::metadata(&victim).unwrap().len();
    flip(&victim, len - 5);
    assert_match(&verify(&d, &["--sizes", s(&tree)]));
    let o = verify(&d, &flags);
    assert_eq!(fetch_again(&o), vec![shards[1].clone()]);
    let out = stdout(&o);
    assert!(
        out.contains(&format!(
            "FAIL   : {}: content differs from the published sha256",
            shards[1]
        )),
        "{out}"
    );
    assert!(
        out.contains(&format!(", {} kept from an earlier run", n - 1)),
        "only the changed file is read again:\n{out}"
    );

    // restored, then config.json damaged: the git blob id names it
    flip(&victim, len - 5);
    flip(&d.join("config.json"), 3);
    let o = verify(&d, &flags);
    assert_eq!(fetch_again(&o), vec!["config.json".to_string()]);
    assert!(
        stdout(&o).contains("content differs from the published git sha1"),
        "{}",
        stdout(&o)
    );
    flip(&d.join("config.json"), 3);

    // kept digests that are not JSON are not trusted: everything is read again
    std::fs::write(d.join(".k3-run-verify.json"), b"{not json").unwrap();
    let o = verify(&d, &flags);
    assert!(
        assert_match(&o).contains(", 0 kept from an earlier run"),
        "{}",
        stdout(&o)
    );
}

/// Ctrl-C while a large file is read: exit 5 and the unread file named; the next run keeps
/// what the first finished and reads the rest.
#[cfg(unix)] // interrupted with SIGINT (kill)
#[test]
fn verify_hash_interrupted_continues() {
    use std::process::Stdio;
    use std::time::{Duration, Instant};
    let (d, tree, n) = listed_copy("verify_hash_interrupt");
    let n = n + 1;
    // 3 GB of zeros that take no disk (sparse), listed with a wrong digest: reading it takes
    // seconds, so Ctrl-C lands while it is read
    const BIG: u64 = 3_000_000_000;
    std::fs::File::create(d.join("big.bin"))
        .unwrap()
        .set_len(BIG)
        .unwrap();
    let mut v: Value = serde_json::from_slice(&std::fs::read(&tree).unwrap()).unwrap();
    v.as_array_mut()
        .unwrap()
        .push(json!({"type": "file", "path": "big.bin", "size": BIG,
        "oid": "0123456789abcdef0123456789abcdef01234567",
        "lfs": {"oid": "ab".repeat(32), "size": BIG, "pointerSize": 134}}));
    std::fs::write(&tree, serde_json::to_vec(&v).unwrap()).unwrap();

    let child = Command::new(env!("CARGO_BIN_EXE_k3-run"))
        .args(["verify", s(&d), "--sizes", s(&tree), "--hash"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // the small files finish on the other thread while big.bin is read (largest first)
    let kept = d.join(".k3-run-verify.json");
    let t0 = Instant::now();
    while !kept.is_file() && t0.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(kept.is_file(), "no digest kept within 60 s");
    // SAFETY: a signal to our own child process.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
    let o = child.wait_with_output().unwrap();
    let out = stdout(&o);
    assert_eq!(code(&o), 5, "{out}\n{}", stderr(&o));
    assert!(out.contains("RESULT : INCOMPLETE"), "{out}");
    let line = out
        .lines()
        .find(|l| l.starts_with("digest : interrupted: "))
        .unwrap_or_else(|| panic!("{out}"));
    let unread = line.split_once("not read: ").map(|x| x.1).unwrap_or("");
    assert!(unread.split(", ").any(|f| f == "big.bin"), "{line}");
    assert!(
        out.contains("file   : big.bin matches its published size\n"),
        "an unread file is not claimed to match its digest:\n{out}"
    );
    let kept_files: Value = serde_json::from_slice(&std::fs::read(&kept).unwrap()).unwrap();
    let done = kept_files["files"].as_object().unwrap().len();
    assert!(
        done >= 1 && done < n,
        "{done} of {n} kept: {kept_files}\n{out}"
    );

    // the next run reads only what was not finished, and finds big.bin's digest wrong
    let o = verify(&d, &["--sizes", s(&tree), "--hash"]);
    assert_eq!(fetch_again(&o), vec!["big.bin".to_string()]);
    let out = stdout(&o);
    assert!(
        out.contains(&format!("{} of {n} files match", n - 1)),
        "{out}"
    );
    assert!(
        out.contains(&format!(", {done} kept from an earlier run")),
        "{out}"
    );
}

#[test]
fn verify_hash_usage_errors_exit_2() {
    let a = fixture_a();
    let dir = fresh_dir("verify_hash_usage");
    let o = verify(&a, &["--hash"]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains("--sizes"), "{}", stderr(&o));
    let o = verify(&a, &["--rehash"]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));

    // sizes only (an object, or a listing without oids): nothing to compare with
    let sizes = dir.join("sizes.json");
    std::fs::write(&sizes, br#"{"config.json": 1}"#).unwrap();
    let o = verify(&a, &["--sizes", s(&sizes), "--hash"]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(
        stderr(&o).contains(s(&sizes)) && stderr(&o).contains("no digest"),
        "{}",
        stderr(&o)
    );
    let cfg = std::fs::metadata(a.join("config.json")).unwrap().len();
    for (bad, says) in [
        (
            json!([{"path": "config.json", "size": cfg, "oid": "xyz"}]),
            "not a git blob id",
        ),
        (
            json!([{"path": "config.json", "size": cfg, "lfs": {"oid": "12"}}]),
            "not a SHA-256",
        ),
        (
            json!([{"path": "config.json", "size": cfg, "lfs": {"size": cfg}}]),
            "no \"oid\"",
        ),
    ] {
        std::fs::write(&sizes, serde_json::to_vec(&bad).unwrap()).unwrap();
        let o = verify(&a, &["--sizes", s(&sizes), "--hash"]);
        assert_eq!(code(&o), 2, "{bad}: {}", stdout(&o));
        assert!(
            stderr(&o).contains(says) && stderr(&o).contains("config.json"),
            "{bad}: {}",
            stderr(&o)
        );
    }
}

/// A checkpoint directory where the kept digests cannot be written (here: their file name is
/// taken by a directory) keeps them in the user's cache directory instead, and the next run
/// finds them there.
#[test]
fn verify_hash_keeps_digests_in_the_cache_dir_when_the_model_dir_refuses() {
    let (d, tree, n) = listed_copy("verify_hash_ro");
    std::fs::create_dir(d.join(".k3-run-verify.json")).unwrap();
    let cache = fresh_dir("verify_hash_ro_cache");
    let run = || {
        k3_env(
            &["verify", s(&d), "--sizes", s(&tree), "--hash"],
            &[("XDG_CACHE_HOME", s(&cache))],
        )
    };
    let o = run();
    let out = assert_match(&o);
    let at = cache.join("k3-run/verify");
    assert!(
        out.contains(&format!("note   : digests kept in {}/", at.display())),
        "{out}"
    );
    let kept: Vec<_> = std::fs::read_dir(&at).unwrap().collect();
    assert_eq!(kept.len(), 1, "{kept:?}");
    let o = run();
    let out = assert_match(&o);
    assert!(
        out.contains(&format!(", {n} kept from an earlier run")),
        "{out}"
    );
}
