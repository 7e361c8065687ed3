//! `k3-run download`, black box, against a loopback hub: a small server on 127.0.0.1 that
//! answers in the Hugging Face hub's URL layout what hf-hub's blocking client asks, serving a
//! synthetic checkpoint written by `k3-run synth --spec configs/synth/tiny.toml` plus a file in
//! a subdirectory:
//! - `GET /api/models/OWNER/NAME/revision/REV?blobs=true`: the commit and every file with its
//!   size, git blob id and, for `.safetensors`, `lfs.sha256`;
//! - `GET /OWNER/NAME/resolve/REV/PATH`: a shard answers `302` to `/cdn/PATH` with
//!   `X-Linked-Etag` (its SHA-256), `X-Linked-Size` and `X-Repo-Commit`, as the hub sends LFS
//!   files to its file store; another file is served there with `ETag` (its blob id) and
//!   `X-Repo-Commit`; both honour `Range: bytes=A-` / `bytes=A-B` (206 + `Content-Range`);
//! - a token, when the hub is gated: `Authorization: Bearer T` or 401.
//!
//! The server is written on `std::net` rather than tiny_http because the tests need it to
//! break a connection off in the middle of a body on demand (tiny_http keeps a connection open
//! for the next request); each response closes its connection.
//!
//! What is checked: a whole download is byte-exact (`RESULT : byte-exact match`, the files equal
//! to the source, the redirect followed, nothing left in `.k3-run-download`); a connection
//! dropped mid-file is resumed in the same run with a `Range` request from where it broke; a run
//! that gives up (`--retries 0`) leaves only a partial file under a temporary name, and the next
//! run continues it from its length; a corrupted byte passes the size check and is named by
//! `--hash`; a served file of the wrong size is named; too little disk is refused before any
//! file is requested (the free-space figure set by the test hook `K3RUN_DOWNLOAD_FREE_BYTES`);
//! a gated repository answers 401 without a token and works with `HF_TOKEN`, and the token is
//! never in the output; `--include` fetches only the files it matches.
//!
//! Owns: black-box checks through the binary. Must not: call the library.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Arc, Mutex, OnceLock};

use serde_json::{Value, json};
use sha1::Sha1;
use sha2::{Digest, Sha256};

mod bin_support;
use bin_support::{code, fresh_dir, s, stderr, synth_tiny};

const REPO: &str = "test-org/tiny-k3";
const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";
const DOC: &str = "docs/README.md";

/// The synthetic checkpoint (written once) and a file in a subdirectory: path -> content.
fn source() -> &'static BTreeMap<String, Vec<u8>> {
    static SRC: OnceLock<BTreeMap<String, Vec<u8>>> = OnceLock::new();
    SRC.get_or_init(|| {
        let dir = fresh_dir("download_source");
        synth_tiny(&dir, 7);
        let mut m = BTreeMap::new();
        for e in std::fs::read_dir(&dir).unwrap() {
            let e = e.unwrap();
            let name = e.file_name().into_string().unwrap();
            m.insert(name, std::fs::read(e.path()).unwrap());
        }
        assert!(m.keys().filter(|k| k.ends_with(".safetensors")).count() >= 2);
        m.insert(DOC.into(), b"# tiny-k3\nA synthetic checkpoint.\n".to_vec());
        m
    })
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The git blob id of `content`.
fn blob_id(content: &[u8]) -> String {
    let mut h = Sha1::new();
    h.update(format!("blob {}\0", content.len()).as_bytes());
    h.update(content);
    hex(&h.finalize())
}

fn sha256(content: &[u8]) -> String {
    hex(&Sha256::digest(content))
}

fn shards() -> Vec<String> {
    source()
        .keys()
        .filter(|k| k.ends_with(".safetensors"))
        .cloned()
        .collect()
}

#[derive(Default)]
struct State {
    /// What the listing says: the source's files.
    listed: BTreeMap<String, Vec<u8>>,
    /// What is served (a test may alter a file here).
    served: BTreeMap<String, Vec<u8>>,
    /// A token the hub requires.
    token: Option<String>,
    /// Break the next full-body transfer of this file off after this many bytes (once).
    drop_once: Option<(String, usize)>,
    /// `PATH RANGE` of every request.
    log: Vec<String>,
}

struct Hub {
    endpoint: String,
    state: Arc<Mutex<State>>,
}

impl Hub {
    fn start(token: Option<&str>) -> Hub {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let endpoint = format!("http://{addr}");
        let state = Arc::new(Mutex::new(State {
            listed: source().clone(),
            served: source().clone(),
            token: token.map(str::to_string),
            ..State::default()
        }));
        let st = Arc::clone(&state);
        let ep = endpoint.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                let st = Arc::clone(&st);
                let ep = ep.clone();
                std::thread::spawn(move || {
                    let _ = handle(conn, &st, &ep);
                });
            }
        });
        Hub { endpoint, state }
    }

    fn log(&self) -> Vec<String> {
        self.state.lock().unwrap().log.clone()
    }
}

fn respond(
    w: &mut TcpStream,
    status: &str,
    headers: &[(&str, String)],
    body: &[u8],
) -> std::io::Result<()> {
    let mut head = format!("HTTP/1.1 {status}\r\nConnection: close\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
    w.write_all(head.as_bytes())?;
    w.write_all(body)?;
    w.flush()
}

fn handle(mut conn: TcpStream, st: &Mutex<State>, endpoint: &str) -> std::io::Result<()> {
    let mut reader = BufReader::new(conn.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let target = line.split_whitespace().nth(1).unwrap_or("/").to_string();
    let mut headers: BTreeMap<String, String> = BTreeMap::new();
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h)? == 0 || h == "\r\n" {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    let range = headers.get("range").cloned();
    let (path, query) = target.split_once('?').unwrap_or((&target, ""));
    let mut state = st.lock().unwrap();
    state.log.push(format!(
        "{path}{} {}",
        if query.is_empty() {
            String::new()
        } else {
            format!("?{query}")
        },
        range.as_deref().unwrap_or("-")
    ));
    let authorized = match &state.token {
        None => true,
        Some(t) => headers.get("authorization") == Some(&format!("Bearer {t}")),
    };
    let not_found =
        |w: &mut TcpStream| respond(w, "404 Not Found", &[], b"{\"error\":\"not found\"}");
    let revs = ["main", COMMIT];

    if let Some(rest) = path.strip_prefix("/api/models/") {
        let Some((repo, rev)) = rest.split_once("/revision/") else {
            return not_found(&mut conn);
        };
        if !authorized {
            return respond(&mut conn, "401 Unauthorized", &[], b"{\"error\":\"gated\"}");
        }
        if repo != REPO || !revs.contains(&rev) {
            return not_found(&mut conn);
        }
        let siblings: Vec<Value> = state
            .listed
            .iter()
            .map(|(name, c)| {
                let mut v = json!({"rfilename": name, "size": c.len(), "blobId": blob_id(c)});
                if name.ends_with(".safetensors") {
                    v["lfs"] = json!({"sha256": sha256(c), "size": c.len(), "pointerSize": 134});
                }
                v
            })
            .collect();
        let body = json!({"id": REPO, "sha": COMMIT, "siblings": siblings}).to_string();
        return respond(
            &mut conn,
            "200 OK",
            &[("Content-Type", "application/json".into())],
            body.as_bytes(),
        );
    }
    if let Some(rest) = path.strip_prefix(&format!("/{REPO}/resolve/")) {
        let Some((rev, file)) = rest.split_once('/') else {
            return not_found(&mut conn);
        };
        if !authorized {
            return respond(&mut conn, "401 Unauthorized", &[], b"");
        }
        let (Some(listed), true) = (state.listed.get(file), revs.contains(&rev)) else {
            return not_found(&mut conn);
        };
        let commit = ("X-Repo-Commit", COMMIT.to_string());
        if file.ends_with(".safetensors") {
            // the hub sends an LFS file to its file store
            let hdrs = [
                commit,
                ("ETag", format!("\"{}\"", blob_id(listed))),
                ("X-Linked-Etag", format!("\"{}\"", sha256(listed))),
                ("X-Linked-Size", listed.len().to_string()),
                ("Location", format!("{endpoint}/cdn/{file}")),
            ];
            return respond(&mut conn, "302 Found", &hdrs, b"");
        }
        let etag = ("ETag", format!("\"{}\"", blob_id(listed)));
        return serve(
            &mut conn,
            &mut state,
            file,
            range.as_deref(),
            &[commit, etag],
        );
    }
    if let Some(file) = path.strip_prefix("/cdn/") {
        return serve(&mut conn, &mut state, file, range.as_deref(), &[]);
    }
    not_found(&mut conn)
}

/// A file's body, or the part a `Range` asks for; breaks off a transfer if told to.
fn serve(
    w: &mut TcpStream,
    state: &mut State,
    file: &str,
    range: Option<&str>,
    extra: &[(&str, String)],
) -> std::io::Result<()> {
    let Some(data) = state.served.get(file).cloned() else {
        return respond(w, "404 Not Found", &[], b"");
    };
    let n = data.len();
    let (start, end) = match range.and_then(|r| r.strip_prefix("bytes=")) {
        Some(r) => {
            let (a, b) = r.split_once('-').unwrap();
            let a: usize = a.parse().unwrap();
            let b: usize = if b.is_empty() {
                n - 1
            } else {
                b.parse::<usize>().unwrap().min(n - 1)
            };
            (a, b)
        }
        None => (0, n - 1),
    };
    let mut hdrs: Vec<(&str, String)> = extra.to_vec();
    let status = if range.is_some() {
        hdrs.push(("Content-Range", format!("bytes {start}-{end}/{n}")));
        "206 Partial Content"
    } else {
        "200 OK"
    };
    let body = &data[start..=end];
    if let Some((f, after)) = state.drop_once.clone()
        && f == file
        && body.len() > after
    {
        state.drop_once = None;
        let mut head = format!("HTTP/1.1 {status}\r\nConnection: close\r\n");
        for (k, v) in &hdrs {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
        w.write_all(head.as_bytes())?;
        w.write_all(&body[..after])?;
        w.flush()?;
        return w.shutdown(std::net::Shutdown::Both);
    }
    respond(w, status, &hdrs, body)
}

/// `k3-run download REPO DIR args...` against `hub`, with no token but `token` and no token
/// file (HF_HOME is an empty directory).
fn download(hub: &Hub, dir: &Path, args: &[&str], token: Option<&str>) -> Output {
    let home = dir.with_extension("hf-home");
    std::fs::create_dir_all(&home).unwrap();
    let mut c = Command::new(env!("CARGO_BIN_EXE_k3-run"));
    c.args(["download", REPO, s(dir)])
        .args(args)
        .env("HF_ENDPOINT", &hub.endpoint)
        .env("HF_HOME", &home)
        .env_remove("HF_TOKEN");
    for p in [
        "ALL_PROXY",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "all_proxy",
        "http_proxy",
        "https_proxy",
    ] {
        c.env_remove(p);
    }
    if let Some(t) = token {
        c.env("HF_TOKEN", t);
    }
    c.output().expect("spawn k3-run")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn both(o: &Output) -> String {
    format!("{}\n{}", stdout(o), stderr(o))
}

/// Exit 0, `RESULT : byte-exact match`, and every source file (or those `only` keeps) equal in
/// `dir`.
fn assert_exact(o: &Output, dir: &Path, only: impl Fn(&str) -> bool) {
    assert_eq!(code(o), 0, "download should pass:\n{}", both(o));
    assert!(
        stdout(o).lines().any(|l| l == "RESULT : byte-exact match"),
        "{}",
        both(o)
    );
    for (name, content) in source() {
        let p = dir.join(name);
        if only(name) {
            assert!(
                std::fs::read(&p).unwrap() == *content,
                "{name} differs from the source"
            );
        } else {
            assert!(!p.exists(), "{name} should not have been fetched");
        }
    }
    assert!(
        !dir.join(".k3-run-download").exists(),
        "the work directory should be gone after a complete download"
    );
}

/// The files of `RESULT : FAIL: fetch again: a, b` (asserts exit 1).
fn fetch_again(o: &Output) -> Vec<String> {
    assert_eq!(code(o), 1, "should fail:\n{}", both(o));
    let out = stdout(o);
    let line = out
        .lines()
        .find(|l| l.starts_with("RESULT : FAIL: fetch again: "))
        .unwrap_or_else(|| panic!("no RESULT : FAIL line:\n{}", both(o)));
    line["RESULT : FAIL: fetch again: ".len()..]
        .split(", ")
        .map(str::to_string)
        .collect()
}

fn out_dir(name: &str) -> PathBuf {
    fresh_dir(name).join("model")
}

#[test]
fn a_whole_download_is_byte_exact_with_hash() {
    let hub = Hub::start(None);
    let dir = out_dir("download_whole");
    let o = download(&hub, &dir, &["--hash"], None);
    assert_exact(&o, &dir, |_| true);
    let out = stdout(&o);
    assert!(out.contains(&format!("(commit {COMMIT})")), "{out}");
    assert!(out.contains("match their published digests"), "{out}");
    assert!(out.contains(&format!("file   : {DOC} matches")), "{out}");
    let log = hub.log();
    assert!(
        log.iter()
            .any(|l| l.starts_with("/api/models/") && l.contains("blobs=true")),
        "{log:?}"
    );
    for sh in shards() {
        assert!(
            log.iter().any(|l| l.starts_with(&format!("/cdn/{sh} "))),
            "{sh}: the redirect to the file store should be followed: {log:?}"
        );
        // every file comes from the resolved commit
        assert!(
            log.iter()
                .any(|l| l.starts_with(&format!("/{REPO}/resolve/{COMMIT}/{sh} "))),
            "{log:?}"
        );
    }
    // a second run has nothing to fetch and verifies again
    let again = download(&hub, &dir, &[], None);
    assert_exact(&again, &dir, |_| true);
    assert!(stdout(&again).contains("already here"), "{}", both(&again));
}

#[test]
fn a_connection_dropped_mid_file_is_resumed_in_the_same_run() {
    let hub = Hub::start(None);
    let shard = shards()[1].clone();
    let cut = 10_000;
    assert!(source()[&shard].len() > 2 * cut);
    hub.state.lock().unwrap().drop_once = Some((shard.clone(), cut));
    let dir = out_dir("download_dropped");
    let o = download(&hub, &dir, &["--hash", "--retries", "3"], None);
    assert_exact(&o, &dir, |_| true);
    let log = hub.log();
    assert!(
        log.contains(&format!("/cdn/{shard} bytes={cut}-")),
        "the transfer should continue from byte {cut}: {log:?}"
    );
}

#[test]
fn a_run_that_gives_up_leaves_a_partial_file_the_next_run_continues() {
    let hub = Hub::start(None);
    let shard = shards()[0].clone();
    let cut = 12_345;
    hub.state.lock().unwrap().drop_once = Some((shard.clone(), cut));
    let dir = out_dir("download_resume");
    let o = download(&hub, &dir, &["--retries", "0"], None);
    assert_eq!(code(&o), 1, "{}", both(&o));
    let err = stderr(&o);
    assert!(
        err.contains("1 file not downloaded") && err.contains(&shard),
        "{err}"
    );
    assert!(
        !dir.join(&shard).exists(),
        "an unfinished file must not have its final name"
    );
    let part = dir
        .join(".k3-run-download/models--test-org--tiny-k3/blobs")
        .join(format!("{}.part", sha256(&source()[&shard])));
    assert_eq!(
        std::fs::metadata(&part).map(|m| m.len()).ok(),
        Some(cut as u64),
        "the partial file should hold what arrived"
    );
    // the other files arrived whole
    for (name, content) in source() {
        if *name != shard {
            assert!(std::fs::read(dir.join(name)).unwrap() == *content, "{name}");
        }
    }
    let o = download(&hub, &dir, &["--hash"], None);
    assert!(
        stdout(&o).contains(&format!("{cut} bytes already in partial files")),
        "{}",
        both(&o)
    );
    assert_exact(&o, &dir, |_| true);
    assert!(
        hub.log().contains(&format!("/cdn/{shard} bytes={cut}-")),
        "{:?}",
        hub.log()
    );
}

#[test]
fn a_corrupted_byte_passes_the_sizes_and_is_named_by_hash() {
    let hub = Hub::start(None);
    let shard = shards()[1].clone();
    {
        let mut st = hub.state.lock().unwrap();
        let data = st.served.get_mut(&shard).unwrap();
        let last = data.len() - 1; // tensor data: the header is at the front
        data[last] ^= 0x40;
    }
    let dir = out_dir("download_corrupt");
    let o = download(&hub, &dir, &[], None);
    assert_eq!(
        code(&o),
        0,
        "sizes cannot see a flipped byte:\n{}",
        both(&o)
    );
    let o = download(&hub, &dir, &["--hash"], None);
    assert_eq!(fetch_again(&o), vec![shard.clone()]);
    assert!(
        stdout(&o).contains(&format!("FAIL   : {shard}: content differs")),
        "{}",
        both(&o)
    );
}

#[test]
fn a_served_file_of_the_wrong_size_is_named() {
    let hub = Hub::start(None);
    let shard = shards()[0].clone();
    hub.state
        .lock()
        .unwrap()
        .served
        .get_mut(&shard)
        .unwrap()
        .push(0);
    let dir = out_dir("download_wrong_size");
    let o = download(&hub, &dir, &[], None);
    assert_eq!(fetch_again(&o), vec![shard.clone()]);
    assert!(stdout(&o).contains("1 byte too long"), "{}", both(&o));
}

#[test]
fn too_little_disk_is_refused_before_any_file_is_requested() {
    let hub = Hub::start(None);
    let dir = out_dir("download_disk");
    let total: usize = source().values().map(Vec::len).sum();
    let free = (total / 2).to_string();
    let c_args = ["--hash"];
    let home = dir.with_extension("hf-home");
    std::fs::create_dir_all(&home).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_k3-run"))
        .args(["download", REPO, "--out", s(&dir)])
        .args(c_args)
        .env("HF_ENDPOINT", &hub.endpoint)
        .env("HF_HOME", &home)
        .env("K3RUN_DOWNLOAD_FREE_BYTES", &free)
        .output()
        .unwrap();
    assert_eq!(code(&o), 2, "{}", both(&o));
    let err = stderr(&o);
    assert!(
        err.contains("not enough disk space")
            && err.contains(&format!("needs {total} more bytes"))
            && err.contains(&format!("{free} are free")),
        "{err}"
    );
    let log = hub.log();
    assert!(
        log.iter().all(|l| l.starts_with("/api/")),
        "no file may be requested: {log:?}"
    );
    // with enough room it goes ahead
    let o = Command::new(env!("CARGO_BIN_EXE_k3-run"))
        .args(["download", REPO, "--out", s(&dir)])
        .env("HF_ENDPOINT", &hub.endpoint)
        .env("HF_HOME", &home)
        .env("K3RUN_DOWNLOAD_FREE_BYTES", total.to_string())
        .output()
        .unwrap();
    assert_exact(&o, &dir, |_| true);
}

#[test]
fn a_gated_repository_needs_the_token_which_is_never_printed() {
    let token = "hf_loopbackSecret0123456789";
    let hub = Hub::start(Some(token));
    let dir = out_dir("download_gated");
    let o = download(&hub, &dir, &[], None);
    assert_eq!(code(&o), 1, "{}", both(&o));
    let err = stderr(&o);
    assert!(err.contains("401") && err.contains("HF_TOKEN"), "{err}");
    let wrong = "hf_wrongToken9876543210";
    let o = download(&hub, &dir, &[], Some(wrong));
    assert_eq!(code(&o), 1, "{}", both(&o));
    assert!(
        !both(&o).contains(wrong),
        "the token was printed:\n{}",
        both(&o)
    );
    let o = download(&hub, &dir, &["--hash"], Some(token));
    assert_exact(&o, &dir, |_| true);
    assert!(stdout(&o).contains("token: HF_TOKEN"), "{}", both(&o));
    assert!(
        !both(&o).contains(token),
        "the token was printed:\n{}",
        both(&o)
    );
}

#[test]
fn include_fetches_only_the_matching_files() {
    let hub = Hub::start(None);
    let dir = out_dir("download_include");
    let o = download(
        &hub,
        &dir,
        &["--include", "*.json", "--include", "docs/*", "--hash"],
        None,
    );
    let small = |n: &str| n.ends_with(".json") || n == DOC;
    assert_exact(&o, &dir, small);
    assert!(
        stdout(&o).contains(&format!(
            "file   : {DOC} matches its published size and digest"
        )),
        "{}",
        both(&o)
    );
    let log = hub.log();
    for sh in shards() {
        assert!(log.iter().all(|l| !l.contains(&sh)), "{sh}: {log:?}");
    }
    let o = download(&hub, &dir, &["--include", "*.bin"], None);
    assert_eq!(code(&o), 2, "{}", both(&o));
    assert!(stderr(&o).contains("matches none"), "{}", both(&o));
}
