//! `--serve`: the OpenAI-compatible HTTP endpoint, black box. A request reproduces the `--chat`
//! turn with the same sampling flags (the same conversation, seed and turn index give the same
//! reply and reasoning, the second turn included); a streamed reply's deltas add up to the
//! plain reply; refused requests get a 4xx with an OpenAI-style error; Ctrl-C stops the server.
//! The client below is plain `std::net` (Content-Length and chunked bodies).

mod chat_support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use chat_support::{bin, chat_piped, synth_model};
use k3_text::history;
use serde_json::{Value, json};

struct Server {
    child: Child,
    port: u16,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(model: &std::path::Path, extra: &[&str]) -> Server {
    let mut child = Command::new(bin())
        .arg(model)
        .args(["--serve", "127.0.0.1:0", "--threads", "1"])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn k3-run --serve");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("read the listening line");
    let port = line
        .split("http://127.0.0.1:")
        .nth(1)
        .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no port in {line:?}"));
    Server { child, port }
}

/// One HTTP/1.1 request; returns (status, headers, body) with chunked bodies decoded.
fn http(port: u16, method: &str, path: &str, body: &str) -> (u16, String, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut r = BufReader::new(s);
    let mut head = String::new();
    loop {
        let mut l = String::new();
        r.read_line(&mut l).expect("header line");
        if l == "\r\n" || l.is_empty() {
            break;
        }
        head.push_str(&l);
    }
    let status: u16 = head.split(' ').nth(1).unwrap().parse().unwrap();
    let lower = head.to_ascii_lowercase();
    let mut out = Vec::new();
    if lower.contains("transfer-encoding: chunked") {
        loop {
            let mut size = String::new();
            r.read_line(&mut size).expect("chunk size");
            let n = usize::from_str_radix(size.trim(), 16).expect("hex chunk size");
            let mut chunk = vec![0u8; n + 2];
            r.read_exact(&mut chunk).expect("chunk");
            if n == 0 {
                break;
            }
            out.extend_from_slice(&chunk[..n]);
        }
    } else {
        let n: usize = lower
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .map(|v| v.trim().parse().unwrap())
            .expect("content-length");
        out.resize(n, 0);
        r.read_exact(&mut out).expect("body");
    }
    (status, head, String::from_utf8(out).expect("utf-8 body"))
}

fn post(port: u16, body: &Value) -> (u16, Value) {
    let (st, _, b) = http(port, "POST", "/v1/chat/completions", &body.to_string());
    (
        st,
        serde_json::from_str(&b).unwrap_or_else(|e| panic!("{e}: {b}")),
    )
}

/// (content, reasoning) of a non-streamed reply.
fn reply(v: &Value) -> (String, String) {
    let m = &v["choices"][0]["message"];
    (
        m["content"].as_str().unwrap().to_string(),
        m["reasoning_content"].as_str().unwrap_or("").to_string(),
    )
}

#[test]
fn requests_reproduce_chat_turns_and_stream() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = synth_model(dir.path());
    let sampling = ["--seed", "7", "--temperature", "1.5", "--gen", "12"];

    // The reference: two --chat turns with the same sampling, through a pipe.
    let hist = dir.path().join("h.jsonl");
    let (st, out, err) = chat_piped(&model, &hist, &sampling, "one\ntwo\n");
    assert!(st.success(), "{out}\n{err}");
    let h = history::load_jsonl(&hist).expect("history");
    assert_eq!(h.len(), 4);

    let srv = start(&model, &["--incremental"]);
    let p = srv.port;
    let (st, _, b) = http(p, "GET", "/v1/models", "");
    assert_eq!(st, 200, "{b}");
    let v: Value = serde_json::from_str(&b).unwrap();
    assert_eq!(v["data"][0]["id"], "kimi-k3", "{b}");

    let samp = json!({"seed": 7, "temperature": 1.5, "max_tokens": 12});
    let with = |messages: Value, stream: bool| {
        let mut r = samp.clone();
        r["messages"] = messages;
        r["stream"] = json!(stream);
        r
    };
    // Turn 1 = the chat's first reply.
    let m1 = json!([{"role": "user", "content": "one"}]);
    let (st, v1) = post(p, &with(m1.clone(), false));
    assert_eq!(st, 200, "{v1}");
    let want1 = (
        h[1].content.clone(),
        h[1].reasoning_content.clone().unwrap_or_default(),
    );
    assert!(
        !(want1.0.is_empty() && want1.1.is_empty()),
        "an empty reference reply"
    );
    assert_eq!(reply(&v1), want1, "turn 1 differs from --chat");
    assert_eq!(v1["object"], "chat.completion");
    let fin = v1["choices"][0]["finish_reason"].as_str().unwrap();
    assert!(fin == "stop" || fin == "length", "{v1}");
    let used = v1["usage"]["completion_tokens"].as_u64().unwrap();
    assert!((1..=12).contains(&used), "{v1}");
    assert!(v1["usage"]["prompt_tokens"].as_u64().unwrap() > 0);

    // Turn 2, with the whole conversation resent (stream 1 of seed 7, as in the chat).
    let m2 = json!([{"role": "user", "content": "one"},
        serde_json::to_value(&h[1]).unwrap(),
        {"role": "user", "content": "two"}]);
    let (st, v2) = post(p, &with(m2, false));
    assert_eq!(st, 200, "{v2}");
    let want2 = (
        h[3].content.clone(),
        h[3].reasoning_content.clone().unwrap_or_default(),
    );
    assert_ne!(want2, want1, "the two reference turns should differ");
    assert_eq!(reply(&v2), want2, "turn 2 differs from --chat");

    // Streamed: the deltas add up to the same reply; the last chunk carries the finish
    // reason and the usage; then [DONE].
    let (st, head, body) = http(
        p,
        "POST",
        "/v1/chat/completions",
        &with(m1, true).to_string(),
    );
    assert_eq!(st, 200, "{body}");
    assert!(
        head.to_ascii_lowercase().contains("text/event-stream"),
        "{head}"
    );
    let events: Vec<&str> = body
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .collect();
    assert_eq!(events.last(), Some(&"[DONE]"), "{body}");
    let (mut content, mut reasoning) = (String::new(), String::new());
    let mut last = Value::Null;
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap();
        assert_eq!(v["object"], "chat.completion.chunk");
        let d = &v["choices"][0]["delta"];
        content.push_str(d["content"].as_str().unwrap_or(""));
        reasoning.push_str(d["reasoning_content"].as_str().unwrap_or(""));
        last = v;
    }
    assert_eq!((content, reasoning), want1, "streamed deltas differ");
    assert_eq!(last["choices"][0]["finish_reason"], fin);
    assert_eq!(last["usage"]["completion_tokens"], used);

    // Refusals: 4xx with an OpenAI-style error naming the field.
    for (body, needle) in [
        (
            json!({"messages": [{"role": "assistant", "content": "x"}]}),
            "last message",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "n": 2}),
            "`n`",
        ),
        (json!({"messages": []}), "empty"),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "stop": ["a"]}),
            "`stop`",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}),
            "max_tokens",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "temperature": -1}),
            "temperature",
        ),
    ] {
        let (st, v) = post(p, &body);
        assert_eq!(st, 400, "{body} -> {v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains(needle), "{body} -> {msg}");
    }
    let (st, _, b) = http(p, "POST", "/v1/chat/completions", "not json");
    assert_eq!(st, 400, "{b}");
    let (st, _, _) = http(p, "GET", "/nope", "");
    assert_eq!(st, 404);
    let (st, _, _) = http(p, "GET", "/v1/chat/completions", "");
    assert_eq!(st, 405);

    // Still serving after the refusals: the same request gives the same reply.
    let (st, again) = post(p, &with(json!([{"role": "user", "content": "one"}]), false));
    assert_eq!(st, 200);
    assert_eq!(reply(&again), want1);

    // Ctrl-C stops it with the documented exit code (5) (SIGINT sent with kill: Unix).
    #[cfg(unix)]
    {
        let mut srv = srv;
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(srv.child.id() as i32, libc::SIGINT) };
        let status = srv.child.wait().expect("wait");
        assert_eq!(status.code(), Some(5), "{status:?}");
    }
}

#[test]
fn serve_refuses_prompt_flags_and_a_busy_address() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = synth_model(dir.path());
    let o = Command::new(bin())
        .arg(&model)
        .args(["--serve", "127.0.0.1:0", "--ids", "1,2"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--serve"));
    let o = Command::new(bin())
        .arg(&model)
        .args(["--serve", "127.0.0.1:0", "--chat"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "--serve and --chat conflict");
    // An address already in use is a clear error, not a panic.
    let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = held.local_addr().unwrap().to_string();
    let o = Command::new(bin())
        .arg(&model)
        .args(["--serve", &addr])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("cannot listen") && err.contains(&addr),
        "{err}"
    );
}

#[test]
fn speculating_server_gives_the_same_greedy_replies() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = synth_model(dir.path());
    let plain = start(&model, &["--incremental", "--gen", "40"]);
    let spec = start(
        &model,
        &["--incremental", "--gen", "40", "--speculate", "4"],
    );
    let mut guesses = 0;
    // Two conversations; the second resends the first reply, so its context repeats text.
    let m1 = json!([{"role": "user", "content": "abc abc abc abc"}]);
    let (st, a1) = post(plain.port, &json!({"messages": m1}));
    assert_eq!(st, 200, "{a1}");
    let mut m2 = m1.as_array().unwrap().clone();
    m2.push(json!({"role": "assistant", "content": reply(&a1).0}));
    m2.push(json!({"role": "user", "content": "again: abc abc"}));
    for messages in [m1, json!(m2)] {
        let body = json!({"messages": messages});
        let (st, a) = post(plain.port, &body);
        assert_eq!(st, 200, "{a}");
        let (st, b) = post(spec.port, &body);
        assert_eq!(st, 200, "{b}");
        assert_eq!(reply(&a), reply(&b));
        assert_eq!(a["usage"], b["usage"]);
        assert_eq!(
            a["choices"][0]["finish_reason"],
            b["choices"][0]["finish_reason"]
        );
        assert!(a["k3"]["speculation"].is_null(), "{a}");
        let s = &b["k3"]["speculation"];
        assert!(s["passes"].as_u64().is_some(), "{b}");
        guesses += s["drafted"].as_u64().unwrap();
    }
    // A sampled request decodes one id per pass.
    let sampled = json!({"messages": [{"role": "user", "content": "hi"}],
        "temperature": 1.2, "seed": 3});
    let (st, c) = post(spec.port, &sampled);
    assert_eq!(st, 200, "{c}");
    assert!(c["k3"]["speculation"].is_null(), "{c}");
    println!("guesses made: {guesses}");
}

/// `--serve-batch 3`: three requests sent together (the batch window lets them start
/// together) decode in shared steps and get exactly the replies the one-at-a-time server
/// gives, streamed or not, greedy or sampled; a fourth waits for a free slot.
#[test]
fn batched_server_gives_the_replies_of_the_serial_one() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = synth_model(dir.path());
    let serial = start(&model, &["--incremental", "--gen", "24"]);
    let batched = start(
        &model,
        &[
            "--incremental",
            "--gen",
            "24",
            "--serve-batch",
            "3",
            "--batch-window",
            "5000",
        ],
    );
    let bodies = [
        json!({"messages": [{"role": "user", "content": "first question"}]}),
        json!({"messages": [{"role": "system", "content": "S"},
            {"role": "user", "content": "second, a little longer than the first one"}],
            "temperature": 1.2, "seed": 11, "max_tokens": 20}),
        json!({"messages": [{"role": "user", "content": "one"},
            {"role": "assistant", "content": "an answer", "reasoning_content": "why"},
            {"role": "user", "content": "third"}], "stream": true}),
        json!({"messages": [{"role": "user", "content": "fourth"}], "max_tokens": 5}),
    ];
    // The content, reasoning, finish reason and usage of a reply, streamed or not.
    let answer = |port: u16, body: &Value| -> (String, String, Value, Value, Value) {
        let (st, _, text) = http(port, "POST", "/v1/chat/completions", &body.to_string());
        assert_eq!(st, 200, "{text}");
        if body["stream"] == json!(true) {
            let (mut content, mut reasoning) = (String::new(), String::new());
            let mut last = Value::Null;
            for e in text.split("\n\n").filter_map(|e| e.strip_prefix("data: ")) {
                if e == "[DONE]" {
                    break;
                }
                let v: Value = serde_json::from_str(e).unwrap();
                let d = &v["choices"][0]["delta"];
                content.push_str(d["content"].as_str().unwrap_or(""));
                reasoning.push_str(d["reasoning_content"].as_str().unwrap_or(""));
                last = v;
            }
            let fin = last["choices"][0]["finish_reason"].clone();
            (
                content,
                reasoning,
                fin,
                last["usage"].clone(),
                last["k3"].clone(),
            )
        } else {
            let v: Value = serde_json::from_str(&text).unwrap();
            let (c, r) = reply(&v);
            let fin = v["choices"][0]["finish_reason"].clone();
            (c, r, fin, v["usage"].clone(), v["k3"].clone())
        }
    };
    let want: Vec<_> = bodies.iter().map(|b| answer(serial.port, b)).collect();
    for w in &want {
        assert_eq!(w.4["batch"], 1, "{:?}", w.4);
    }
    let port = batched.port;
    let got: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = bodies
            .iter()
            .map(|b| s.spawn(move || answer(port, b)))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(
            (&g.0, &g.1, &g.2, &g.3),
            (&w.0, &w.1, &w.2, &w.3),
            "request {i}"
        );
    }
    // At least three requests decoded together (which three depends on arrival order).
    let together = got.iter().filter(|g| g.4["batch"] == 3).count();
    assert!(
        together >= 2,
        "{:?}",
        got.iter().map(|g| &g.4).collect::<Vec<_>>()
    );
    assert!(got.iter().all(|g| g.4["batch"].as_u64().unwrap() >= 1));
}

#[test]
fn serve_batch_flags_are_checked() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = synth_model(dir.path());
    for (args, needle) in [
        (&["--serve-batch", "0"][..], "--serve-batch 0"),
        (&["--serve-batch", "65"][..], "1..=64"),
        (
            &["--serve-batch", "2", "--speculate", "2", "--incremental"][..],
            "--speculate",
        ),
        (
            &["--serve-batch", "2", "--batch-window", "20000"][..],
            "--batch-window",
        ),
        // --chat flags the server would ignore: each request carries its own.
        (&["--system", "Be brief."][..], "--system is a --chat flag"),
        (
            &["--temperature", "1.5"][..],
            "--temperature is a --chat flag",
        ),
        (&["--seed", "3"][..], "--seed is a --chat flag"),
        (&["--history", "h.jsonl"][..], "--history is a --chat flag"),
    ] {
        let o = Command::new(bin())
            .arg(&model)
            .args(["--serve", "127.0.0.1:0"])
            .args(args)
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(needle), "{args:?}: {err}");
    }
    // --serve-batch needs --serve.
    let o = Command::new(bin())
        .arg(&model)
        .args(["--ids", "1", "--serve-batch", "2"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    // The thinking flags shape a chat prompt: a plain run refuses them.
    for flag in [&["--no-think"][..], &["--thinking-effort", "low"][..]] {
        let o = Command::new(bin())
            .arg(&model)
            .args(["--ids", "1", "--gen", "1"])
            .args(flag)
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(2), "{flag:?}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains("--chat or --serve"), "{flag:?}: {err}");
    }
}

/// The 400s an HTTP client reads: a limit names the field it sent (`max_completion_tokens`,
/// not `max_tokens`), and a conversation longer than the server's context says so in server
/// terms (no REPL `/reset`, no "history is kept"), served alone and batched.
#[test]
fn refusals_name_what_the_client_sent() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = synth_model(dir.path());
    for extra in [
        &["--max-context", "600"][..],
        &["--max-context", "600", "--serve-batch", "2"],
    ] {
        let srv = start(&model, extra);
        let p = srv.port;
        let user = json!([{"role": "user", "content": "x"}]);
        for (body, needle, not) in [
            (
                json!({"messages": user, "max_completion_tokens": 0}),
                "`max_completion_tokens` 0",
                "`max_tokens`",
            ),
            (
                json!({"messages": user, "max_tokens": 5000}),
                "`max_tokens` 5000",
                "max_completion_tokens",
            ),
            // Forcing one named function: K3's template has no rendering for it.
            (
                json!({"messages": user, "tools": [{"type": "function",
                    "function": {"name": "f"}}],
                    "tool_choice": {"type": "function", "function": {"name": "f"}}}),
                "`tool_choice`: naming one function",
                "max_tokens",
            ),
            (
                json!({"messages": [{"role": "user", "content": "word ".repeat(1000)}],
                    "max_tokens": 2}),
                "--max-context",
                "/reset",
            ),
        ] {
            let (st, v) = post(p, &body);
            assert_eq!(st, 400, "{extra:?}: {body} -> {v}");
            let msg = v["error"]["message"].as_str().unwrap();
            assert!(msg.contains(needle), "{extra:?}: {body} -> {msg}");
            assert!(!msg.contains(not), "{extra:?}: {body} -> {msg}");
            assert!(!msg.contains("history is kept"), "{extra:?}: {msg}");
        }
        // Still serving: a request that fits is answered.
        let (st, v) = post(p, &json!({"messages": user, "max_tokens": 2}));
        assert_eq!(st, 200, "{extra:?}: {v}");
    }
}
