//! Shared helpers of the `--serve` integration tests: a server process on loopback (its
//! stderr kept in a file so the request log can be read), and a plain `std::net` HTTP/1.1
//! client (Content-Length and chunked bodies, any headers).

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

pub struct Server {
    pub child: Child,
    pub port: u16,
    pub stderr: PathBuf,
    pub stdout_line: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// What the server wrote to stderr so far.
    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// Wait until stderr contains `needle` (up to `secs`); the stderr text.
    pub fn wait_stderr(&self, needle: &str, secs: u64) -> String {
        let t0 = Instant::now();
        loop {
            let s = self.stderr();
            if s.contains(needle) || t0.elapsed() > Duration::from_secs(secs) {
                return s;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// `k3-run MODEL --serve ADDR --threads 1 EXTRA...` with `env` set; returns once the
/// "listening" line (the model is ready) is on stdout.
pub fn start_at(
    bin: &str,
    model: &Path,
    addr: &str,
    extra: &[&str],
    env: &[(&str, &str)],
    stderr_file: &Path,
) -> Server {
    let err = std::fs::File::create(stderr_file).expect("stderr file");
    let mut cmd = Command::new(bin);
    cmd.arg(model)
        .args(["--serve", addr, "--threads", "1"])
        .args(extra)
        .env_remove("K3RUN_API_KEY")
        .stdout(Stdio::piped())
        .stderr(Stdio::from(err));
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("spawn k3-run --serve");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("read the listening line");
    let port = line
        .split("http://")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|a| a.rsplit(':').next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| {
            panic!(
                "no port in {line:?}; stderr: {}",
                std::fs::read_to_string(stderr_file).unwrap_or_default()
            )
        });
    Server {
        child,
        port,
        stderr: stderr_file.to_path_buf(),
        stdout_line: line,
    }
}

/// A reply: status, head (lower-cased header names kept as sent), body.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub head: String,
    pub body: String,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }

    /// A header's value (name case-insensitive).
    pub fn header(&self, name: &str) -> Option<String> {
        let want = format!("{}:", name.to_ascii_lowercase());
        self.head.lines().find_map(|l| {
            l.to_ascii_lowercase()
                .starts_with(&want)
                .then(|| l[want.len()..].trim().to_string())
        })
    }

    /// The `data:` events of a server-sent-events body.
    pub fn events(&self) -> Vec<String> {
        self.body
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .map(str::to_string)
            .collect()
    }
}

/// Read one response from `r`.
pub fn read_reply(r: &mut impl BufRead) -> Reply {
    let mut head = String::new();
    loop {
        let mut l = String::new();
        r.read_line(&mut l).expect("header line");
        if l == "\r\n" || l.is_empty() {
            break;
        }
        head.push_str(&l);
    }
    let status: u16 = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status in {head:?}"));
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
            .unwrap_or(0);
        out.resize(n, 0);
        r.read_exact(&mut out).expect("body");
    }
    Reply {
        status,
        head,
        body: String::from_utf8(out).expect("utf-8 body"),
    }
}

/// One HTTP/1.1 request with extra headers; the connection is closed after it.
pub fn http_with(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Reply {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    s.write_all(req.as_bytes()).unwrap();
    read_reply(&mut BufReader::new(s))
}

pub fn http(port: u16, method: &str, path: &str, body: &str) -> Reply {
    http_with(port, method, path, &[], body)
}

pub fn post(port: u16, path: &str, body: &Value) -> Reply {
    http(port, "POST", path, &body.to_string())
}

/// The text of a streamed reply: chat `content` (+ `reasoning_content`) or completion `text`
/// deltas concatenated, and the last chunk before `[DONE]`.
pub fn streamed(r: &Reply) -> (String, String, Value) {
    let events = r.events();
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{}",
        r.body
    );
    let (mut a, mut b) = (String::new(), String::new());
    let mut last = Value::Null;
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap_or_else(|x| panic!("{x}: {e}"));
        let c = &v["choices"][0];
        a.push_str(c["delta"]["content"].as_str().unwrap_or(""));
        a.push_str(c["text"].as_str().unwrap_or(""));
        b.push_str(c["delta"]["reasoning_content"].as_str().unwrap_or(""));
        last = v;
    }
    (a, b, last)
}

/// A metric's value from `/metrics`, parsed with the Prometheus text parser; `labels` must
/// all match. Counters, gauges and untyped samples.
pub fn metric(scrape: &prometheus_parse::Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
    let s = scrape
        .samples
        .iter()
        .find(|s| s.metric == name && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
        .unwrap_or_else(|| panic!("no sample {name} {labels:?}"));
    match &s.value {
        prometheus_parse::Value::Counter(v)
        | prometheus_parse::Value::Gauge(v)
        | prometheus_parse::Value::Untyped(v) => *v,
        other => panic!("{name}: not a plain value: {other:?}"),
    }
}

/// `GET /metrics` parsed.
pub fn scrape(port: u16, headers: &[(&str, &str)]) -> prometheus_parse::Scrape {
    let r = http_with(port, "GET", "/metrics", headers, "");
    assert_eq!(r.status, 200, "{}", r.body);
    let ct = r.header("content-type").unwrap_or_default();
    assert!(ct.starts_with("text/plain; version=0.0.4"), "{ct}");
    prometheus_parse::Scrape::parse(r.body.lines().map(|l| Ok(l.to_string())))
        .unwrap_or_else(|e| panic!("{e}: {}", r.body))
}
