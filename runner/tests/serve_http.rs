//! `--serve` as load balancers, dashboards and OpenAI clients use it, against a real server
//! process on loopback: `/health`, `/metrics` (read back with a Prometheus text parser),
//! `/v1/completions` (plain and streamed), the request log line (never the content), the API
//! key, the bind warning, 413 with its numbers, a bounded queue (429 + Retry-After), a client
//! that closes its socket mid-stream freeing its slot, and tool requests rendered as
//! `render-chat` renders them.

mod chat_support;
mod serve_support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use chat_support::{bin, synth_model};
use serde_json::{Value, json};
use serve_support::{http, http_with, metric, post, scrape, start_at, streamed};

const SECRET: &str = "CONTENT-MARKER-7341";

#[test]
fn health_metrics_completions_and_the_request_log() {
    let dir = tempfile::tempdir().unwrap();
    let model = synth_model(dir.path());
    let srv = start_at(
        bin(),
        &model,
        "127.0.0.1:0",
        &["--incremental", "--max-context", "600"],
        &[],
        &dir.path().join("err.txt"),
    );
    let p = srv.port;
    let h = http(p, "GET", "/health", "");
    assert_eq!(h.status, 200, "{}", h.body);
    assert_eq!(h.json()["status"], "ok");

    // A raw completion, plain then streamed: the same greedy text.
    let body = json!({"prompt": format!("{SECRET} once upon"), "max_tokens": 6});
    let a = post(p, "/v1/completions", &body);
    assert_eq!(a.status, 200, "{}", a.body);
    let v = a.json();
    assert_eq!(v["object"], "text_completion");
    let text = v["choices"][0]["text"].as_str().unwrap().to_string();
    let used = v["usage"]["completion_tokens"].as_u64().unwrap();
    assert!((1..=6).contains(&used), "{v}");
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let s = post(p, "/v1/completions", &sbody);
    assert_eq!(s.status, 200, "{}", s.body);
    let (stext, _, last) = streamed(&s);
    assert_eq!(stext, text, "streamed pieces add up to the reply");
    assert_eq!(
        last["choices"][0]["finish_reason"],
        v["choices"][0]["finish_reason"]
    );
    assert_eq!(last["usage"]["completion_tokens"], used);
    // Token ids work too; an id outside the vocabulary is a 400 naming it.
    let ids = post(
        p,
        "/v1/completions",
        &json!({"prompt": [11, 22, 33], "max_tokens": 2}),
    );
    assert_eq!(ids.status, 200, "{}", ids.body);
    let bad = post(
        p,
        "/v1/completions",
        &json!({"prompt": [99999], "max_tokens": 2}),
    );
    assert_eq!(bad.status, 400, "{}", bad.body);
    assert!(bad.body.contains("99999"), "{}", bad.body);

    // Chat: thinking is on, so the reply carries reasoning_content beside content.
    let c = post(
        p,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": SECRET}], "max_tokens": 5}),
    );
    assert_eq!(c.status, 200, "{}", c.body);
    let cv = c.json();
    assert!(cv["choices"][0]["message"]["content"].is_string(), "{cv}");

    // Refusals name the field (and the numbers).
    for (path, body, needle) in [
        (
            "/v1/completions",
            json!({"prompt": "x", "stop": ["a"]}),
            "`stop`",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "echo": true}),
            "`echo`",
        ),
        ("/v1/completions", json!({"prompt": "x", "n": 2}), "`n`"),
        ("/v1/completions", json!({"prompt": ""}), "`prompt`: empty"),
        (
            "/v1/completions",
            json!({"prompt": ["a", "b"]}),
            "one prompt",
        ),
        (
            "/v1/completions",
            json!({"prompt": "word ".repeat(1000), "max_tokens": 2}),
            "positions",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 5000}),
            "`max_tokens` 5000",
        ),
    ] {
        let r = post(p, path, &body);
        assert_eq!(r.status, 400, "{body} -> {}", r.body);
        let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
        assert!(msg.contains(needle), "{body} -> {msg}");
    }
    let long = post(
        p,
        "/v1/completions",
        &json!({"prompt": "word ".repeat(1000), "max_tokens": 2}),
    );
    let msg = long.json()["error"]["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        msg.contains("600") && msg.contains("--max-context"),
        "{msg}"
    );
    // 413 with both numbers, without reading the body.
    let big = http_with(p, "POST", "/v1/completions", &[("X-Pad", "1")], "");
    assert_eq!(big.status, 400, "an empty body is not JSON");
    let mut sock = TcpStream::connect(("127.0.0.1", p)).unwrap();
    write!(
        sock,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 16777217\r\n\
         Connection: close\r\n\r\n"
    )
    .unwrap();
    let r = serve_support::read_reply(&mut BufReader::new(sock));
    assert_eq!(r.status, 413, "{}", r.body);
    assert!(
        r.body.contains("16777217") && r.body.contains("16777216"),
        "{}",
        r.body
    );
    assert_eq!(http(p, "GET", "/nope", "").status, 404);
    assert_eq!(http(p, "POST", "/health", "").status, 405);

    // /metrics through a real Prometheus text parser.
    let m = scrape(p, &[]);
    let ok = |ep: &str| {
        metric(
            &m,
            "k3run_requests_total",
            &[("endpoint", ep), ("status", "200")],
        )
    };
    assert_eq!(ok("/v1/completions"), 3.0);
    assert_eq!(ok("/v1/chat/completions"), 1.0);
    let gen_total = metric(&m, "k3run_generation_tokens_total", &[]);
    let want = (2 * used) as f64
        + ids.json()["usage"]["completion_tokens"].as_f64().unwrap()
        + cv["usage"]["completion_tokens"].as_f64().unwrap();
    assert_eq!(gen_total, want, "generated tokens counted");
    assert_eq!(metric(&m, "k3run_queue_depth", &[]), 0.0);
    assert_eq!(metric(&m, "k3run_batch_slots", &[]), 1.0);
    let ttft = m
        .samples
        .iter()
        .find(|s| s.metric == "k3run_time_to_first_token_seconds")
        .expect("ttft histogram");
    match &ttft.value {
        prometheus_parse::Value::Histogram(h) => {
            let inf = h.iter().find(|b| b.less_than == f64::INFINITY).unwrap();
            assert_eq!(inf.count, 4.0, "four generations reached their first token");
        }
        other => panic!("not a histogram: {other:?}"),
    }
    for name in [
        "k3run_trunk_bytes_read_total",
        "k3run_expert_bytes_read_total",
        "k3run_expert_cache_hit_ratio",
        "k3run_batch_occupancy_ratio",
    ] {
        assert!(metric(&m, name, &[]) >= 0.0);
    }

    // One log line per request, with the numbers and never the content.
    let err = srv.wait_stderr("POST /v1/chat/completions 200", 10);
    assert!(!err.contains(SECRET), "content in the log:\n{err}");
    let line = err
        .lines()
        .find(|l| l.contains("POST /v1/completions 200"))
        .unwrap_or_else(|| panic!("{err}"));
    assert!(
        line.contains("prompt_tokens=") && line.contains(&format!("generated_tokens={used}")),
        "{line}"
    );
    assert!(
        line.contains("ttft_s=") && line.contains("s_per_token="),
        "{line}"
    );
    assert!(err.contains("POST /v1/completions 413"), "{err}");
}

#[test]
fn api_key_bind_warning_and_no_log() {
    let dir = tempfile::tempdir().unwrap();
    let model = synth_model(dir.path());
    let key = "k3-test-key-1f9a";
    let srv = start_at(
        bin(),
        &model,
        "127.0.0.1:0",
        &["--api-key", key],
        &[],
        &dir.path().join("err.txt"),
    );
    let p = srv.port;
    assert_eq!(
        http(p, "GET", "/health", "").status,
        200,
        "no key for /health"
    );
    let none = http(p, "GET", "/v1/models", "");
    assert_eq!(none.status, 401, "{}", none.body);
    assert_eq!(none.json()["error"]["code"], "invalid_api_key");
    let wrong = http_with(
        p,
        "GET",
        "/v1/models",
        &[("Authorization", "Bearer k3-test-key-1f9b")],
        "",
    );
    assert_eq!(wrong.status, 401);
    let auth = format!("Bearer {key}");
    let right = http_with(p, "GET", "/v1/models", &[("Authorization", &auth)], "");
    assert_eq!(right.status, 200, "{}", right.body);
    assert_eq!(http(p, "GET", "/metrics", "").status, 401);
    scrape(p, &[("Authorization", &auth)]);
    let err = srv.wait_stderr("GET /v1/models 200", 10);
    assert!(!err.contains(key), "the key in the log:\n{err}");
    assert!(!srv.stdout_line.contains(key));
    drop(srv);

    // The key from the environment; no request log.
    let srv = start_at(
        bin(),
        &model,
        "127.0.0.1:0",
        &["--no-request-log"],
        &[("K3RUN_API_KEY", key)],
        &dir.path().join("err2.txt"),
    );
    assert_eq!(http(srv.port, "GET", "/v1/models", "").status, 401);
    let auth_ok = http_with(
        srv.port,
        "GET",
        "/v1/models",
        &[("Authorization", &auth)],
        "",
    );
    assert_eq!(auth_ok.status, 200);
    std::thread::sleep(Duration::from_millis(200));
    assert!(!srv.stderr().contains("GET /v1/models"), "{}", srv.stderr());
    drop(srv);

    // Every interface without a key: a warning; an empty key: a usage error.
    let srv = start_at(
        bin(),
        &model,
        "0.0.0.0:0",
        &[],
        &[],
        &dir.path().join("err3.txt"),
    );
    let err = srv.stderr();
    assert!(
        err.contains("WITHOUT an API key") && err.contains("--api-key"),
        "{err}"
    );
    drop(srv);
    let o = std::process::Command::new(bin())
        .arg(&model)
        .args(["--serve", "127.0.0.1:0", "--api-key", " "])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--api-key is empty"));
}

/// A streamed request whose client closes the socket ends at the next step: the request
/// queued behind it starts at once, the log shows 499 with fewer tokens than asked; with the
/// queue full a third request gets 429 and Retry-After.
#[test]
fn a_client_that_leaves_frees_its_slot_and_a_full_queue_is_429() {
    let dir = tempfile::tempdir().unwrap();
    let model = synth_model(dir.path());
    let srv = start_at(
        bin(),
        &model,
        "127.0.0.1:0",
        &["--max-queue", "1"],
        &[],
        &dir.path().join("err.txt"),
    );
    let p = srv.port;
    // A long raw continuation, streamed.
    let long = json!({"prompt": [11, 22, 33, 44], "max_tokens": 4096, "stream": true,
        "temperature": 1.0, "seed": 5});
    let body = long.to_string();
    let mut a = TcpStream::connect(("127.0.0.1", p)).unwrap();
    write!(
        a,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut ra = BufReader::new(a.try_clone().unwrap());
    let mut line = String::new();
    ra.read_line(&mut line).unwrap();
    assert!(line.contains("200"), "{line}");
    // Wait for the first streamed piece: A is generating.
    let mut got = Vec::new();
    let mut buf = [0u8; 256];
    while !String::from_utf8_lossy(&got).contains("data: ") {
        let n = ra.read(&mut buf).unwrap();
        assert!(n > 0, "stream ended early");
        got.extend_from_slice(&buf[..n]);
    }
    // B waits in the queue (one place); C finds it full.
    let b = std::thread::spawn(move || {
        let t0 = Instant::now();
        let r = post(
            p,
            "/v1/completions",
            &json!({"prompt": "b", "max_tokens": 3}),
        );
        (r.status, t0.elapsed())
    });
    let t0 = Instant::now();
    loop {
        let m = scrape(p, &[]);
        if metric(&m, "k3run_queue_depth", &[]) == 1.0 {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "B never queued");
        std::thread::sleep(Duration::from_millis(20));
    }
    let c = post(
        p,
        "/v1/completions",
        &json!({"prompt": "c", "max_tokens": 3}),
    );
    assert_eq!(c.status, 429, "{}", c.body);
    assert!(
        c.header("retry-after")
            .is_some_and(|v| v.parse::<u64>().unwrap() >= 1),
        "{}",
        c.head
    );
    assert_eq!(c.json()["error"]["type"], "rate_limit_error");
    // A's client leaves: B is served promptly.
    drop(ra);
    a.shutdown(std::net::Shutdown::Both).unwrap();
    drop(a);
    let (st, waited) = b.join().unwrap();
    assert_eq!(st, 200);
    assert!(waited < Duration::from_secs(30), "{waited:?}");
    let err = srv.wait_stderr("POST /v1/completions 200", 10);
    let gone = err
        .lines()
        .find(|l| l.contains("POST /v1/completions 499"))
        .unwrap_or_else(|| panic!("no 499 line:\n{err}"));
    let n: usize = gone
        .split("generated_tokens=")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{gone}"));
    assert!(n < 4096, "{gone}");
    let m = scrape(p, &[]);
    assert_eq!(metric(&m, "k3run_client_disconnects_total", &[]), 1.0);
    assert_eq!(metric(&m, "k3run_queue_rejections_total", &[]), 1.0);
    assert_eq!(
        metric(
            &m,
            "k3run_requests_total",
            &[("endpoint", "/v1/completions"), ("status", "429")]
        ),
        1.0
    );
}

/// Tools: a request with `tools`, `tool_choice` and a tool round in its messages renders the
/// prompt `render-chat --tools --tool-choice` renders for the same transcript (its ids are
/// golden-tested against the reference renderer), plain and batched.
#[test]
fn tool_requests_render_as_render_chat_does() {
    let dir = tempfile::tempdir().unwrap();
    let model = synth_model(dir.path());
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "description": "Weather for a city", "parameters": {"type": "object",
        "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]);
    let messages = json!([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "call it",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather",
         "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18C"}
    ]);
    let hist = dir.path().join("h.jsonl");
    let lines: Vec<String> = messages
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m.to_string())
        .collect();
    std::fs::write(&hist, lines.join("\n") + "\n").unwrap();
    let tools_file = dir.path().join("tools.json");
    std::fs::write(&tools_file, tools.to_string()).unwrap();
    let want = chat_support::render_ids(
        &hist,
        &model,
        &[
            "--tools",
            tools_file.to_str().unwrap(),
            "--tool-choice",
            "required",
        ],
    );
    for extra in [&[][..], &["--serve-batch", "2"][..]] {
        let srv = start_at(
            bin(),
            &model,
            "127.0.0.1:0",
            extra,
            &[],
            &dir.path().join("e.txt"),
        );
        for stream in [false, true] {
            let r = post(
                srv.port,
                "/v1/chat/completions",
                &json!({"messages": messages, "tools": tools, "tool_choice": "required",
                    "max_tokens": 4, "stream": stream}),
            );
            assert_eq!(r.status, 200, "{extra:?}: {}", r.body);
            let usage: Value = if stream {
                streamed(&r).2["usage"].clone()
            } else {
                r.json()["usage"].clone()
            };
            assert_eq!(
                usage["prompt_tokens"],
                want.len(),
                "{extra:?} stream {stream}"
            );
        }
        // Without tool_choice the prompt is shorter by the tool-choice message.
        let r = post(
            srv.port,
            "/v1/chat/completions",
            &json!({"messages": messages, "tools": tools, "max_tokens": 2}),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        let n = r.json()["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
        assert!(n < want.len());
    }
}
