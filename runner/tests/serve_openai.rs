//! The official `openai` Python client against a `k3-run --serve` process on loopback: a
//! plain, a streamed and a tool-round chat request and a raw completion, parsed by the client
//! and equal to what the same greedy requests give over raw HTTP; a wrong key is the client's
//! `AuthenticationError`. The client lives in the fixtures' Python environment
//! (`fixtures/setup-venv.sh`, pinned in fixtures/requirements.txt; `.ci/run` sets it up);
//! without it this test says so and passes without running.

mod chat_support;
mod serve_support;

use std::path::PathBuf;
use std::process::Command;

use chat_support::{bin, repo, synth_model};
use serde_json::{Value, json};
use serve_support::start_at;

/// The fixtures' Python with `openai` importable: `K3_TEST_PYTHON`, else `<repo>/.venv`.
fn python() -> Result<PathBuf, String> {
    let p = std::env::var_os("K3_TEST_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join(".venv/bin/python"));
    if !p.exists() {
        return Err(format!(
            "{} not found (run fixtures/setup-venv.sh)",
            p.display()
        ));
    }
    let ok = Command::new(&p)
        .args(["-c", "import openai"])
        .output()
        .map_err(|e| format!("{}: {e}", p.display()))?;
    if !ok.status.success() {
        return Err(format!(
            "{} cannot import openai (run fixtures/setup-venv.sh)",
            p.display()
        ));
    }
    Ok(p)
}

#[test]
fn the_official_openai_client_reads_the_server() {
    let py = match python() {
        Ok(p) => p,
        Err(why) => {
            println!("skipped: the openai client test needs the fixtures' venv: {why}");
            return;
        }
    };
    let dir = tempfile::tempdir().unwrap();
    let model = synth_model(dir.path());
    let key = "k3-openai-test";
    let srv = start_at(
        bin(),
        &model,
        "127.0.0.1:0",
        &["--api-key", key],
        &[],
        &dir.path().join("err.txt"),
    );
    let base = format!("http://127.0.0.1:{}/v1", srv.port);
    let o = Command::new(&py)
        .arg(repo().join("runner/tests/data/openai_client.py"))
        .args([&base, key])
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    let got: Value = serde_json::from_slice(&o.stdout).unwrap();

    // The same greedy requests over raw HTTP.
    let auth = format!("Bearer {key}");
    let raw = |path: &str, body: Value| {
        let r = serve_support::http_with(
            srv.port,
            "POST",
            path,
            &[("Authorization", &auth)],
            &body.to_string(),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()
    };
    let msgs = json!([{"role": "user", "content": "hello"}]);
    let plain = raw(
        "/v1/chat/completions",
        json!({"messages": msgs, "max_tokens": 8}),
    );
    let m = &plain["choices"][0]["message"];
    assert_eq!(got["plain"]["content"], m["content"], "{got}");
    assert_eq!(
        got["plain"]["reasoning"].as_str().unwrap_or(""),
        m["reasoning_content"].as_str().unwrap_or("")
    );
    assert_eq!(got["plain"]["finish"], plain["choices"][0]["finish_reason"]);
    assert_eq!(
        got["plain"]["completion_tokens"],
        plain["usage"]["completion_tokens"]
    );
    assert_eq!(got["stream"]["content"], m["content"]);
    assert_eq!(
        got["stream"]["reasoning"].as_str().unwrap(),
        m["reasoning_content"].as_str().unwrap_or("")
    );
    assert_eq!(
        got["stream"]["finish"],
        plain["choices"][0]["finish_reason"]
    );
    assert!(got["tools"]["prompt_tokens"].as_u64().unwrap() > 0, "{got}");
    assert!(got["tools"]["tool_calls"].is_array(), "{got}");
    let c = raw(
        "/v1/completions",
        json!({"prompt": "once upon", "max_tokens": 6}),
    );
    assert_eq!(got["completion"]["text"], c["choices"][0]["text"]);
    assert_eq!(got["wrong_key"], 401);
}
