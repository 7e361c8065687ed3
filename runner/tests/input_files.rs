//! Files named on the command line, black box: every file flag reads a regular file only. A
//! device (`/dev/zero`: a read that never ends) or a FIFO (a read that blocks without a
//! writer) is refused at once, naming the path and what it is; `--prompt-file` alone also
//! reads a pipe (`/dev/stdin`), to its end, with a bound.
//!
//! Owns: these refusals and the pipe case. Each case runs under a deadline: without the
//! checks the process reads `/dev/zero` until memory runs out, and the test fails on the
//! deadline instead of waiting for that.

mod bin_support;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use bin_support::{fresh_dir, repo, s};

fn spawn(args: &[&str], stdin: Stdio) -> Child {
    Command::new(env!("CARGO_BIN_EXE_k3-run"))
        .args(args)
        .env_remove("K3_ISA")
        .stdin(stdin)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn k3-run")
}

/// Wait for `child` at most 60 s (killed after that), then collect its output.
fn finish(mut child: Child, what: &str) -> Output {
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.try_wait().expect("try_wait").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("{what}: still running after 60 s (reading a device or a FIFO?)");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("output")
}

/// The odd-vocabulary synthetic model with its tokenizer (`configs/synth/odd9.toml`).
fn odd9(dir: &Path) -> PathBuf {
    let out = dir.join("odd9");
    let spec = repo().join("configs/synth/odd9.toml");
    let o = finish(
        spawn(
            &[
                "synth",
                "--spec",
                s(&spec),
                "--seed",
                "1",
                "--quiet",
                "--out",
                s(&out),
            ],
            Stdio::null(),
        ),
        "synth",
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    out
}

#[cfg(unix)] // /dev/zero and a FIFO
#[test]
fn a_device_or_fifo_named_as_a_file_is_refused_at_once() {
    let dir = fresh_dir("input_files_devices");
    let a = repo().join("fixtures/models/A/ckpt");
    let a = s(&a);
    let m = odd9(&dir);
    let m = s(&m);
    // a tokenizer directory whose tiktoken.model is a device
    let tok = dir.join("tok");
    std::fs::create_dir_all(&tok).expect("mkdir");
    std::os::unix::fs::symlink("/dev/zero", tok.join("tiktoken.model")).expect("symlink");
    std::fs::copy(
        Path::new(m).join("tokenizer_config.json"),
        tok.join("tokenizer_config.json"),
    )
    .expect("copy tokenizer_config.json");
    // a FIFO nobody writes to
    let fifo = dir.join("fifo.toml");
    let c = std::ffi::CString::new(s(&fifo)).expect("path");
    // SAFETY: mkfifo on a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
    let fifo = s(&fifo);
    let run = |extra: &[&'static str]| -> Vec<String> {
        [a, "--ids", "1,2", "--gen", "1"]
            .iter()
            .chain(extra)
            .map(|x| x.to_string())
            .collect()
    };
    let own = |v: &[&str]| -> Vec<String> { v.iter().map(|x| x.to_string()).collect() };
    let tok_s = s(&tok);
    let out = dir.join("synth-out");
    let cases: Vec<(Vec<String>, &str, &str)> = vec![
        (
            run(&["--preset", "/dev/zero"]),
            "/dev/zero",
            "character device",
        ),
        (run(&["--io", "/dev/zero"]), "/dev/zero", "character device"),
        (
            run(&["--manifest", "/dev/zero"]),
            "/dev/zero",
            "character device",
        ),
        (
            run(&["--config", "/dev/zero"]),
            "/dev/zero",
            "character device",
        ),
        (own(&[a, "--ids", "1", "--preset", fifo]), fifo, "FIFO"),
        (own(&["plan", a, "--manifest", fifo]), fifo, "FIFO"),
        (
            own(&["sim-cache", "/dev/zero"]),
            "/dev/zero",
            "character device",
        ),
        (
            own(&["verify", a, "--sizes", "/dev/zero"]),
            "/dev/zero",
            "character device",
        ),
        (
            own(&[
                "synth",
                "--spec",
                "/dev/zero",
                "--seed",
                "1",
                "--out",
                s(&out),
            ]),
            "/dev/zero",
            "character device",
        ),
        (
            own(&["render-chat", "--history", "/dev/zero"]),
            "/dev/zero",
            "character device",
        ),
        (
            own(&[m, "--chat", "--history", "/dev/zero"]),
            "/dev/zero",
            "device",
        ),
        (
            own(&[m, "--tok", tok_s, "--prompt", "hi", "--gen", "1"]),
            "tiktoken.model",
            "device",
        ),
    ];
    for (args, path, what) in &cases {
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = finish(spawn(&argv, Stdio::null()), &argv.join(" "));
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{argv:?}:\n{err}");
        assert!(
            err.contains(path) && err.contains(what),
            "{argv:?}: the error should name {path} and say it is a {what}:\n{err}"
        );
    }
}

#[test]
fn prompt_file_reads_a_pipe_to_its_end_with_a_bound() {
    let dir = fresh_dir("input_files_prompt");
    let m = odd9(&dir);
    let m = s(&m);
    let text = "The capital of France is";
    let args = |src: &[&'static str]| -> Vec<String> {
        [m, "--tok", m, "--gen", "2", "--incremental"]
            .iter()
            .chain(src)
            .map(|x| x.to_string())
            .collect()
    };
    let ids_of = |o: &Output| -> String {
        let out = String::from_utf8_lossy(&o.stdout);
        out.lines()
            .filter(|l| l.starts_with("generated ids") || l.starts_with("token "))
            .map(|l| l.split('(').next().unwrap_or(l).to_string())
            .collect::<Vec<_>>()
            .join("\n")
    };
    // the same prompt given as text and through a pipe: the same ids
    let a: Vec<String> = args(&["--prompt", text]);
    let av: Vec<&str> = a.iter().map(String::as_str).collect();
    let direct = finish(spawn(&av, Stdio::null()), "--prompt");
    assert!(
        direct.status.success(),
        "{}",
        String::from_utf8_lossy(&direct.stderr)
    );
    let p: Vec<String> = args(&["--prompt-file", "/dev/stdin"]);
    let pv: Vec<&str> = p.iter().map(String::as_str).collect();
    let mut child = spawn(&pv, Stdio::piped());
    let mut stdin = child.stdin.take().expect("stdin");
    stdin.write_all(text.as_bytes()).expect("write prompt");
    drop(stdin);
    let piped = finish(child, "--prompt-file /dev/stdin");
    assert!(
        piped.status.success(),
        "{}",
        String::from_utf8_lossy(&piped.stderr)
    );
    assert!(
        !ids_of(&direct).is_empty(),
        "no token lines in:\n{}",
        String::from_utf8_lossy(&direct.stdout)
    );
    assert_eq!(ids_of(&piped), ids_of(&direct));
    // an endless source stops at the bound, named
    let z: Vec<String> = args(&["--prompt-file", "/dev/zero"]);
    let zv: Vec<&str> = z.iter().map(String::as_str).collect();
    let o = finish(spawn(&zv, Stdio::null()), "--prompt-file /dev/zero");
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--prompt-file /dev/zero") && err.contains("MiB"),
        "{err}"
    );
    // a directory is named as one
    let o = finish(
        spawn(
            &args(&["--prompt-file", "/tmp"])
                .iter()
                .map(String::as_str)
                .collect::<Vec<_>>(),
            Stdio::null(),
        ),
        "--prompt-file /tmp",
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("is a directory"), "{err}");
}
