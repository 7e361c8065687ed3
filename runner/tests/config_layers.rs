//! The one layering of run settings, through the binary: `config show --json` reports each
//! merged value and its source (defaults < preset < run config < K3RUN_* < flags), a preset
//! edited on disk is read without a rebuild, and a run config starts the job it describes.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_k3-run")
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `config show --json` in `cwd` with `env`: key -> (value, source).
fn show(cwd: &Path, args: &[&str], env: &[(&str, &str)]) -> Vec<(String, Value, String)> {
    let mut c = Command::new(bin());
    c.current_dir(cwd)
        .args(["config", "show", "--json"])
        .args(args);
    for (k, v) in env {
        c.env(k, v);
    }
    let o = c.output().expect("run k3-run");
    assert!(
        o.status.success(),
        "config show {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let v: Value = serde_json::from_slice(&o.stdout).expect("json");
    v.as_array()
        .expect("rows")
        .iter()
        .map(|r| {
            (
                r["key"].as_str().unwrap().to_string(),
                r["value"].clone(),
                r["source"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

fn get<'a>(rows: &'a [(String, Value, String)], key: &str) -> (&'a Value, &'a str) {
    let r = rows
        .iter()
        .find(|r| r.0 == key)
        .unwrap_or_else(|| panic!("{key} not in {rows:?}"));
    (&r.1, &r.2)
}

#[test]
fn each_layer_wins_over_the_ones_below() {
    let d = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(d.path().join("presets")).unwrap();
    std::fs::write(
        d.path().join("presets/small.toml"),
        "name = \"small\"\ntrunk_gb = 1.25\ncache_gb = 0.5\nultra_low_memory = false\n",
    )
    .unwrap();
    let job = d.path().join("job.toml");
    std::fs::write(
        &job,
        "schema_version = 1\npreset = \"small\"\nthreads = 1\ncache_gb = 0.75\n",
    )
    .unwrap();
    let j = job.to_str().unwrap();
    let rows = show(d.path(), &["--config", j], &[]);
    assert_eq!(get(&rows, "trunk_ring"), (&Value::from(2), "default"));
    let (v, src) = get(&rows, "trunk_gb");
    assert_eq!(v, &Value::from(1.25));
    assert!(
        src.starts_with("preset small (") && src.ends_with("small.toml:2)"),
        "{src}"
    );
    let (v, src) = get(&rows, "cache_gb");
    assert_eq!(v, &Value::from(0.75));
    assert!(src.ends_with("job.toml:4"), "{src}");
    // the environment over the run config
    let rows = show(d.path(), &["--config", j], &[("K3RUN_CACHE_GB", "1.5")]);
    assert_eq!(
        get(&rows, "cache_gb"),
        (&Value::from(1.5), "environment K3RUN_CACHE_GB")
    );
    // a flag over the environment, in either order with --preset
    for args in [
        ["--config", j, "--preset", "small", "--cache-gb", "2"],
        ["--config", j, "--cache-gb", "2", "--preset", "small"],
    ] {
        let rows = show(d.path(), &args, &[("K3RUN_CACHE_GB", "1.5")]);
        assert_eq!(
            get(&rows, "cache_gb"),
            (&Value::from(2.0), "flag --cache-gb")
        );
        assert_eq!(get(&rows, "trunk_gb").0, &Value::from(1.25));
    }
    // a section key from the environment
    let rows = show(d.path(), &[], &[("K3RUN_SERVE__MAX_QUEUE", "3")]);
    assert_eq!(
        get(&rows, "serve.max_queue"),
        (&Value::from(3), "environment K3RUN_SERVE__MAX_QUEUE")
    );
}

#[test]
fn a_preset_edited_on_disk_is_read_without_a_rebuild() {
    let d = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(d.path().join("configs/presets")).unwrap();
    std::fs::write(
        d.path().join("configs/presets/laptop.toml"),
        "name = \"laptop\"\ntrunk_gb = 0.125\ncache_gb = 0.0625\nultra_low_memory = false\n",
    )
    .unwrap();
    let rows = show(d.path(), &["--preset", "laptop"], &[]);
    assert_eq!(get(&rows, "trunk_gb").0, &Value::from(0.125));
    // elsewhere, the built-in copy (the shipped file's numbers)
    let e = tempfile::tempdir().unwrap();
    let rows = show(e.path(), &["--preset", "laptop"], &[]);
    let shipped: toml::Table = std::fs::read_to_string(repo().join("configs/presets/laptop.toml"))
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(
        get(&rows, "trunk_gb").0.as_f64(),
        shipped["trunk_gb"].as_float()
    );
}

#[test]
fn bad_keys_and_variables_are_named_with_the_nearest_key() {
    let d = tempfile::tempdir().unwrap();
    let job = d.path().join("job.toml");
    std::fs::write(&job, "schema_version = 1\ncache_gbb = 1\n").unwrap();
    let o = Command::new(bin())
        .args(["config", "show", "--config"])
        .arg(&job)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("job.toml") && err.contains("`cache_gbb`") && err.contains("`cache_gb`"),
        "{err}"
    );
    let o = Command::new(bin())
        .args(["config", "show"])
        .env("K3RUN_THREDS", "2")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("K3RUN_THREDS") && err.contains("K3RUN_THREADS"),
        "{err}"
    );
    // a preset given to --config names --preset
    let o = Command::new(bin())
        .arg("--config")
        .arg(repo().join("configs/presets/laptop.toml"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("use `--preset"), "{err}");
}

#[test]
fn a_shipped_run_config_runs_as_is_and_a_flag_overrides_its_prompt() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("r.json");
    let run = |extra: &[&str]| {
        let o = Command::new(bin())
            .arg("--config")
            .arg(repo().join("configs/resident.toml"))
            .args(["--gen", "3", "--out"])
            .arg(&out)
            .args(extra)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let v: Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
        v["generated_ids"].clone()
    };
    let summary: Value = serde_json::from_slice(
        &std::fs::read(repo().join("fixtures/models/A/ref/summary.json")).unwrap(),
    )
    .unwrap();
    let from_config = run(&[]);
    // the config's prompt is the reference prompt: the reference's first ids come back
    let want: Vec<Value> = summary["generated_ids"].as_array().unwrap()[..3].to_vec();
    assert_eq!(from_config, Value::from(want));
    let other = run(&["--ids", "5,6,7"]);
    assert_ne!(from_config, other);
}

/// A run config in each mode, written by hand: chat (a piped turn lands in the config's
/// history file, relative to the config) and serve (the config's listen address answers
/// `/health` and a chat completion).
#[test]
fn a_run_config_drives_each_mode() {
    use std::io::{Read, Write};
    let d = tempfile::tempdir().unwrap();
    let model = repo().join("fixtures/models/chat/ckpt");
    let model_toml = model.display().to_string().replace('\\', "/");

    // chat: the history path is relative to the config file's directory
    let chat_cfg = d.path().join("chat.toml");
    std::fs::write(
        &chat_cfg,
        format!(
            "schema_version = 1\nmodel = \"{model_toml}\"\nmode = \"chat\"\nthreads = 1\n\
             [chat]\nhistory = \"talk.jsonl\"\n"
        ),
    )
    .unwrap();
    let mut child = Command::new(bin())
        .arg("--config")
        .arg(&chat_cfg)
        .args(["--gen", "3"])
        .current_dir(std::env::temp_dir())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"hello\n").unwrap();
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    let hist = std::fs::read_to_string(d.path().join("talk.jsonl"))
        .unwrap_or_else(|e| panic!("the config's history file: {e}\n{err}"));
    assert_eq!(
        hist.lines().count(),
        2,
        "one user and one assistant record: {hist}"
    );
    assert!(hist.contains("hello"), "{hist}");

    // serve: the config's listen address (port 0: any free port) serves the model
    let serve_cfg = d.path().join("serve.toml");
    std::fs::write(
        &serve_cfg,
        format!(
            "schema_version = 1\nmodel = \"{model_toml}\"\nmode = \"serve\"\nthreads = 1\n\
             [serve]\nlisten = \"127.0.0.1:0\"\nrequest_log = false\n"
        ),
    )
    .unwrap();
    let mut child = Command::new(bin())
        .arg("--config")
        .arg(&serve_cfg)
        .env_remove("K3RUN_API_KEY")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    let addr = line
        .split("http://")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .map(str::to_string);
    let reply = addr.as_ref().map(|addr| {
        let body = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":2}"#;
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        write!(
            s,
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut r = String::new();
        s.read_to_string(&mut r).unwrap();
        r
    });
    let _ = child.kill();
    let _ = child.wait();
    let reply = reply.unwrap_or_else(|| panic!("no listening address in {line:?}"));
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    assert!(reply.contains("\"chat.completion\""), "{reply}");
}
