//! `k3-run download [REPO] DIR`: fetch a model repository from the Hugging Face hub into DIR,
//! resumably, and check the result with `verify` (docs/DOWNLOAD.md).
//!
//! Owns: the repository listing (the hub's revision API with `blobs=true`: every file's path,
//! size, git blob id and, for LFS files, SHA-256), the file selection (`--include` globs), the
//! disk-space check before anything is fetched, parallel file downloads with a progress bar per
//! file and one for the whole download, retries with backoff, moving finished files into DIR,
//! and the check at the end (`crate::verify` for a checkpoint, a size/digest check of the listed
//! files for a partial selection).
//! Must not: write a file into DIR under its final name before it is complete, print or log the
//! token.
//!
//! The hub's protocol is spoken by the `hf-hub` crate's blocking API (0.4, on `ureq`): the
//! revision listing (`ApiRepo::info_request`), the token header, `HF_ENDPOINT`, and each file's
//! download (`ApiRepo::download_with_progress`: a `Range: bytes=0-0` probe for the ETag, the
//! commit and the size, following the hub's redirect to its file store; the body written to
//! `<blob>.part`, resumed from that file's length with a `Range` request, retried with backoff
//! within a run and continued by the next run; renamed to the blob when complete). hf-hub 1.x
//! is async only (tokio, reqwest and the Xet transfer stack), which this synchronous program
//! does not otherwise need. What hf-hub 0.4 does not do is done here: a file lands in its
//! cache layout (`blobs/`, `snapshots/`), so the cache is kept inside DIR
//! (`DIR/.k3-run-download/`) and each finished blob is renamed to `DIR/<path>` (same file
//! system: no copy); hf-hub retries only a body that breaks off, so a request that fails
//! outright (connection refused, 5xx, 429) is retried here; it has no multi-file progress, so
//! its per-file `Progress` callbacks drive an `indicatif` bar per file and the overall bar; its
//! repository info lacks sizes and digests unless asked for (`blobs=true`), so that request is
//! made here with its request builder; and the token comes from `--token`, `HF_TOKEN` or the
//! usual token file, where hf-hub reads only the file.

use std::collections::BTreeSet;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use clap::Args;
use hf_hub::api::Progress;
use hf_hub::api::sync::{Api, ApiBuilder, ApiError};
use hf_hub::{Cache, Repo, RepoType};
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::{Value, json};

use crate::checkpoint::{INDEX_FILE, SINGLE_FILE};
use crate::cli::{Failure, exit};
use crate::digest::{self, Digest};

/// The repository fetched when none is named.
pub const DEFAULT_REPO: &str = "moonshotai/Kimi-K3";
/// hf-hub's cache (partial files, blobs not yet moved) inside the output directory.
pub const WORK_DIR: &str = ".k3-run-download";
/// The listing of the fetched files, in the hub's tree-listing form, kept in the output
/// directory for `k3-run verify DIR --sizes DIR/.k3-run-tree.json --hash`.
pub const LISTING_FILE: &str = ".k3-run-tree.json";
/// Test hook: the free bytes the disk-space check assumes instead of asking the file system.
pub const FREE_BYTES_ENV: &str = "K3RUN_DOWNLOAD_FREE_BYTES";
/// Exit code of a download that did not finish (a file could not be fetched).
pub const FAILED: u8 = 1;

/// Flags of `k3-run download`.
#[derive(Args, Debug, Clone)]
pub struct DownloadArgs {
    /// Repository on the hub, OWNER/NAME.
    #[arg(default_value = DEFAULT_REPO)]
    pub repo: String,
    /// Output directory (created if missing); the model directory to run and verify.
    #[arg(value_name = "DIR", required_unless_present = "out")]
    pub dir: Option<PathBuf>,
    /// Output directory (instead of the DIR argument).
    #[arg(long, value_name = "DIR", conflicts_with = "dir")]
    pub out: Option<PathBuf>,
    /// Branch, tag or commit to fetch; resolved to its commit once, and every file is fetched
    /// from that commit.
    #[arg(long, default_value = "main")]
    pub revision: String,
    /// Fetch only the files whose repository path matches one of these globs (repeatable),
    /// e.g. --include '*.json' --include 'tiktoken.model'.
    #[arg(long, value_name = "GLOB")]
    pub include: Vec<String>,
    /// Access token for a gated or private repository (prefer the HF_TOKEN environment
    /// variable: a flag is visible to other users in the process list). Never printed.
    #[arg(long, value_name = "TOKEN")]
    pub token: Option<String>,
    /// Files downloaded at once.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub jobs: u16,
    /// Retries of a failed request or a broken-off transfer before a file is given up (with
    /// backoff; a 401, 403 or 404 is not retried).
    #[arg(long, default_value_t = 5)]
    pub retries: u32,
    /// At the end, also read every fetched file and compare it with the listing's digests
    /// (SHA-256 for LFS files, the git blob id for the others), as `verify --hash` does.
    #[arg(long)]
    pub hash: bool,
}

/// One file of the repository listing.
#[derive(Clone, Debug)]
struct Entry {
    path: String,
    size: u64,
    /// The git blob id (`blobId`).
    blob_id: Option<String>,
    /// The SHA-256 of an LFS file's content (`lfs.sha256`).
    sha256: Option<String>,
}

impl Entry {
    /// The ETag the hub gives the file (the LFS SHA-256, else the git blob id): the name of its
    /// blob, and of the partial file, in hf-hub's cache.
    fn etag(&self) -> Option<&str> {
        self.sha256.as_deref().or(self.blob_id.as_deref())
    }

    fn digest(&self) -> Option<Digest> {
        match (&self.sha256, &self.blob_id) {
            (Some(s), _) => Digest::sha256_hex(s),
            (None, Some(b)) => Digest::git_sha1_hex(b),
            (None, None) => None,
        }
    }

    /// The entry as a tree listing gives it (what `verify --sizes` reads).
    fn tree_json(&self) -> Value {
        let mut v = json!({"type": "file", "path": self.path, "size": self.size});
        if let Some(b) = &self.blob_id {
            v["oid"] = json!(b);
        }
        if let Some(s) = &self.sha256 {
            v["lfs"] = json!({"oid": s, "size": self.size});
        }
        v
    }
}

/// The repository at one commit.
#[derive(Debug)]
struct Listing {
    commit: String,
    files: Vec<Entry>,
}

/// Why a request failed, and whether trying again may help.
#[derive(Debug)]
struct Fault {
    msg: String,
    transient: bool,
}

fn fault_of_ureq(e: &ureq::Error, what: &str) -> Fault {
    match e {
        ureq::Error::Status(code, _) => {
            let msg = match code {
                401 => format!(
                    "{what}: HTTP 401 Unauthorized: the repository is gated or private, or the \
                     token is not valid: give a token with access in HF_TOKEN (or --token, or \
                     the token file)"
                ),
                403 => format!(
                    "{what}: HTTP 403 Forbidden: the token has no access to this repository \
                     (accept its conditions on the hub first)"
                ),
                404 => format!("{what}: HTTP 404 Not Found (repository, revision or file)"),
                c => format!("{what}: HTTP {c}"),
            };
            Fault {
                msg,
                transient: *code == 408 || *code == 429 || *code >= 500,
            }
        }
        // The transport error names the URL (no token: that travels in a header).
        ureq::Error::Transport(t) => Fault {
            msg: format!("{what}: {t}"),
            transient: true,
        },
    }
}

fn fault_of_api(e: &ApiError, what: &str) -> Fault {
    match e {
        ApiError::RequestError(u) => fault_of_ureq(u, what),
        ApiError::TooManyRetries(inner) => {
            let f = fault_of_api(inner, what);
            Fault {
                msg: format!("{} (after hf-hub's retries)", f.msg),
                transient: f.transient,
            }
        }
        ApiError::IoError(io) => {
            use std::io::ErrorKind as K;
            // a full or read-only disk does not get better by asking again
            let local = matches!(
                io.kind(),
                K::StorageFull | K::ReadOnlyFilesystem | K::PermissionDenied | K::QuotaExceeded
            );
            Fault {
                msg: format!("{what}: {io}"),
                transient: !local,
            }
        }
        ApiError::MissingHeader(h) | ApiError::InvalidHeader(h) => Fault {
            msg: format!(
                "{what}: the endpoint's answer lacks a valid `{h}` header (is HF_ENDPOINT a \
                 Hugging Face hub?)"
            ),
            transient: false,
        },
        ApiError::InvalidResume => Fault {
            msg: format!("{what}: the partial file is longer than the file"),
            transient: true,
        },
        ApiError::LockAcquisition(p) => Fault {
            msg: format!(
                "{what}: {} is locked: is another download into the same directory running?",
                p.display()
            ),
            transient: false,
        },
        other => Fault {
            msg: format!("{what}: {other}"),
            transient: false,
        },
    }
}

/// Wait before attempt `attempt` (1, 2, ...): 0.5 s doubling, at most 30 s.
fn backoff(attempt: u32) -> Duration {
    Duration::from_millis(500u64.saturating_mul(1 << attempt.min(8).saturating_sub(1)))
        .min(Duration::from_secs(30))
}

/// Run `f` until it succeeds, fails for good, or `retries` retries are used up; `say` tells of
/// each retry.
fn with_retries<T>(
    retries: u32,
    say: &dyn Fn(&str),
    mut f: impl FnMut() -> Result<T, Fault>,
) -> Result<T, Fault> {
    let mut attempt = 0;
    loop {
        match f() {
            Ok(v) => return Ok(v),
            Err(e) if e.transient && attempt < retries => {
                attempt += 1;
                let wait = backoff(attempt);
                say(&format!(
                    "{}; retry {attempt} of {retries} in {:.1} s",
                    e.msg,
                    wait.as_secs_f64()
                ));
                std::thread::sleep(wait);
            }
            Err(e) => return Err(e),
        }
    }
}

/// A repository id as the hub spells it: OWNER/NAME of letters, digits, `-`, `_`, `.`.
fn valid_repo_id(id: &str) -> bool {
    let ok = |p: &str| {
        !p.is_empty()
            && p != "."
            && p != ".."
            && p.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    matches!(id.split_once('/'), Some((o, n)) if ok(o) && ok(n))
}

/// The token: `--token`, else `HF_TOKEN`, else the token file (`$HF_HOME/token`, else
/// `~/.cache/huggingface/token`). Returns it and where it came from (never the value).
fn find_token(flag: Option<&str>) -> (Option<String>, &'static str) {
    let clean = |t: &str| {
        let t = t.trim();
        (!t.is_empty()).then(|| t.to_string())
    };
    if let Some(t) = flag.and_then(clean) {
        return (Some(t), "--token");
    }
    if let Some(t) = std::env::var("HF_TOKEN").ok().as_deref().and_then(clean) {
        return (Some(t), "HF_TOKEN");
    }
    match Cache::from_env().token() {
        Some(t) => (Some(t), "the token file"),
        None => (None, "none"),
    }
}

/// The listing of `repo` at `revision` (the hub's `GET /api/models/REPO/revision/REV` with
/// `blobs=true`: sizes, blob ids, LFS SHA-256s).
fn fetch_listing(
    api: &Api,
    repo: &str,
    revision: &str,
    retries: u32,
    say: &dyn Fn(&str),
) -> Result<Listing, Fault> {
    let r = api.repo(Repo::with_revision(
        repo.to_string(),
        RepoType::Model,
        revision.to_string(),
    ));
    let what = format!("listing {repo} at {revision}");
    let v: Value = with_retries(retries, say, || {
        let resp = r
            .info_request()
            .query("blobs", "true")
            .call()
            .map_err(|e| fault_of_ureq(&e, &what))?;
        serde_json::from_reader(resp.into_reader()).map_err(|e| Fault {
            msg: format!("{what}: the answer is not JSON: {e}"),
            transient: false,
        })
    })?;
    parse_listing(&v).map_err(|m| Fault {
        msg: format!("{what}: {m}"),
        transient: false,
    })
}

fn parse_listing(v: &Value) -> Result<Listing, String> {
    let commit = v
        .get("sha")
        .and_then(Value::as_str)
        .ok_or("no \"sha\" (commit) in the answer")?
        .to_string();
    if commit.is_empty() || !commit.chars().all(|c| c.is_ascii_alphanumeric()) {
        return Err(format!("the commit {commit:?} is not a commit id"));
    }
    let siblings = v
        .get("siblings")
        .and_then(Value::as_array)
        .ok_or("no \"siblings\" (files) in the answer")?;
    let mut files = Vec::with_capacity(siblings.len());
    for s in siblings {
        let path = s
            .get("rfilename")
            .and_then(Value::as_str)
            .ok_or("a file without \"rfilename\"")?;
        if !crate::verify::is_relative_file_path(path) {
            return Err(format!(
                "{path:?} is not a relative path inside the repository"
            ));
        }
        let size = s
            .get("size")
            .and_then(Value::as_u64)
            .ok_or_else(|| format!("{path:?} has no \"size\""))?;
        let blob_id = s.get("blobId").and_then(Value::as_str).map(str::to_string);
        let sha256 = s
            .get("lfs")
            .and_then(|l| l.get("sha256"))
            .and_then(Value::as_str)
            .map(str::to_string);
        let e = Entry {
            path: path.to_string(),
            size,
            blob_id,
            sha256,
        };
        // the etag names a file in the cache: it must be a plain name
        if let Some(t) = e.etag()
            && !t.chars().all(|c| c.is_ascii_hexdigit())
        {
            return Err(format!("{path:?}: digest {t:?} is not hexadecimal"));
        }
        files.push(e);
    }
    files.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(Listing { commit, files })
}

/// Free bytes for an unprivileged user on the file system of `dir` (or the test hook's
/// figure).
fn free_bytes(dir: &Path) -> Result<u64, String> {
    if let Ok(v) = std::env::var(FREE_BYTES_ENV) {
        return v
            .trim()
            .parse()
            .map_err(|_| format!("{FREE_BYTES_ENV}={v:?} is not a byte count"));
    }
    crate::platform::disk_free_bytes(dir).map_err(|e| format!("statvfs {}: {e}", dir.display()))
}

fn gb(n: u64) -> String {
    format!("{:.2} GB", n as f64 / 1e9)
}

/// The per-file and overall bars, fed by hf-hub's `Progress` callbacks.
struct FileProgress {
    bar: ProgressBar,
    total: ProgressBar,
    /// hf-hub reports the resumed offset as the first `update` after each `init`: it moves
    /// this file's bar only (the overall bar already counts those bytes, or counts only what
    /// this run fetches).
    offset_next: bool,
}

impl Progress for FileProgress {
    fn init(&mut self, size: usize, _filename: &str) {
        self.bar.set_length(size as u64);
        self.bar.set_position(0);
        self.offset_next = true;
    }

    fn update(&mut self, n: usize) {
        if self.offset_next {
            self.offset_next = false;
            self.bar.set_position(n as u64);
        } else {
            self.bar.inc(n as u64);
            self.total.inc(n as u64);
        }
    }

    fn finish(&mut self) {}
}

fn bar_style(template: &str) -> ProgressStyle {
    ProgressStyle::with_template(template)
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ")
}

/// Shared state of the download threads.
struct Fetch<'a> {
    api: &'a Api,
    repo: &'a str,
    commit: &'a str,
    dir: &'a Path,
    work: &'a Path,
    retries: u32,
    mp: &'a MultiProgress,
    total: &'a ProgressBar,
    /// A fault that will not go away (401, 403, 404, a full disk): the other threads stop
    /// taking files.
    abort: &'a AtomicBool,
}

impl Fetch<'_> {
    fn say(&self, msg: &str) {
        self.mp.suspend(|| eprintln!("download: {msg}"));
    }

    /// Fetch one file into `DIR/<path>`; returns the bytes it has.
    fn one(&self, e: &Entry) -> Result<u64, Fault> {
        let repo = Repo::with_revision(
            self.repo.to_string(),
            RepoType::Model,
            self.commit.to_string(),
        );
        let what = e.path.as_str();
        // a blob a stopped run completed but did not move yet
        let cached = Cache::new(self.work.to_path_buf())
            .repo(repo.clone())
            .get(what);
        let pointer = match cached {
            Some(p) => p,
            None => {
                let bar = self.mp.add(ProgressBar::new(e.size));
                bar.set_style(bar_style(
                    "{msg:>24} [{bar:30}] {bytes}/{total_bytes} ({bytes_per_sec}, {eta})",
                ));
                bar.set_message(short_name(what, 24));
                let r = with_retries(self.retries, &|m| self.say(m), || {
                    if self.abort.load(Ordering::Relaxed) {
                        return Err(Fault {
                            msg: format!("{what}: not fetched (stopped by another file's failure)"),
                            transient: false,
                        });
                    }
                    let progress = FileProgress {
                        bar: bar.clone(),
                        total: self.total.clone(),
                        offset_next: false,
                    };
                    self.api
                        .repo(repo.clone())
                        .download_with_progress(what, progress)
                        .map_err(|err| {
                            if matches!(err, ApiError::InvalidResume)
                                && let Some(t) = e.etag()
                            {
                                // a partial file longer than the file: start it again
                                let _ = std::fs::remove_file(self.part_path(t));
                            }
                            fault_of_api(&err, what)
                        })
                });
                bar.finish_and_clear();
                self.mp.remove(&bar);
                r?
            }
        };
        let blob = std::fs::canonicalize(&pointer).map_err(|err| Fault {
            msg: format!("{what}: {}: {err}", pointer.display()),
            transient: false,
        })?;
        let dest = self.dir.join(what);
        if let Some(parent) = dest.parent() {
            std::fs::create_dir_all(parent).map_err(|err| Fault {
                msg: format!("{what}: mkdir {}: {err}", parent.display()),
                transient: false,
            })?;
        }
        std::fs::rename(&blob, &dest).map_err(|err| Fault {
            msg: format!(
                "{what}: moving {} to {}: {err}",
                blob.display(),
                dest.display()
            ),
            transient: false,
        })?;
        let _ = std::fs::remove_file(&pointer);
        let got = std::fs::metadata(&dest).map(|m| m.len()).unwrap_or(0);
        self.say(&format!("{what}: {got} bytes"));
        Ok(got)
    }

    /// hf-hub's partial file of the blob named `etag`.
    fn part_path(&self, etag: &str) -> PathBuf {
        part_path(self.work, self.repo, etag)
    }
}

/// `WORK/models--OWNER--NAME/blobs/ETAG.part`: where hf-hub keeps a partial file.
fn part_path(work: &Path, repo: &str, etag: &str) -> PathBuf {
    let folder = Repo::model(repo.to_string()).folder_name();
    work.join(folder).join("blobs").join(format!("{etag}.part"))
}

fn short_name(name: &str, max: usize) -> String {
    let n = name.chars().count();
    if n <= max {
        name.to_string()
    } else {
        let tail: String = name.chars().skip(n + 2 - max).collect();
        format!("..{tail}")
    }
}

/// The selected files: every listed file, or those matching an `--include` glob.
fn select(files: &[Entry], include: &[String]) -> Result<Vec<Entry>, Failure> {
    if include.is_empty() {
        return Ok(files.to_vec());
    }
    let mut b = globset::GlobSetBuilder::new();
    for g in include {
        let glob = globset::GlobBuilder::new(g)
            .literal_separator(false)
            .build()
            .map_err(|e| Failure::usage(format!("--include {g:?}: {e}")))?;
        b.add(glob);
    }
    let set = b
        .build()
        .map_err(|e| Failure::usage(format!("--include: {e}")))?;
    Ok(files
        .iter()
        .filter(|e| set.is_match(&e.path))
        .cloned()
        .collect())
}

/// `k3-run download`.
pub fn main(a: &DownloadArgs) -> Result<u8, Failure> {
    let Some(dir) = a.out.clone().or_else(|| a.dir.clone()) else {
        return Err(Failure::usage("no output directory: give DIR or --out DIR"));
    };
    if !valid_repo_id(&a.repo) {
        return Err(Failure::usage(format!(
            "{:?} is not a repository id (OWNER/NAME, e.g. {DEFAULT_REPO})",
            a.repo
        )));
    }
    if a.revision.is_empty() || a.revision.contains("..") || a.revision.starts_with('/') {
        return Err(Failure::usage(format!(
            "--revision {:?} is not a branch, tag or commit",
            a.revision
        )));
    }
    std::fs::create_dir_all(&dir)
        .map_err(|e| Failure::usage(format!("cannot create {}: {e}", dir.display())))?;
    let work = dir.join(WORK_DIR);
    let (token, token_from) = find_token(a.token.as_deref());
    let endpoint = std::env::var("HF_ENDPOINT")
        .ok()
        .map(|e| e.trim().trim_end_matches('/').to_string())
        .filter(|e| !e.is_empty());
    let mut builder = ApiBuilder::from_cache(Cache::new(work.clone()))
        .with_token(token)
        .with_retries(a.retries as usize)
        .with_progress(false);
    if let Some(e) = &endpoint {
        builder = builder.with_endpoint(e.clone());
    }
    let api = builder
        .build()
        .map_err(|e| Failure::usage(format!("cannot set up the HTTP client: {e}")))?;
    let say = |m: &str| eprintln!("download: {m}");
    let failed = |f: Fault| Failure {
        code: FAILED,
        msg: f.msg,
    };

    let listing = fetch_listing(&api, &a.repo, &a.revision, a.retries, &say).map_err(failed)?;
    let all_bytes: u64 = listing.files.iter().map(|e| e.size).sum();
    println!(
        "download: {} at {} (commit {}): {} files, {all_bytes} bytes ({}), from {}; token: {token_from}",
        a.repo,
        a.revision,
        listing.commit,
        listing.files.len(),
        gb(all_bytes),
        endpoint.as_deref().unwrap_or("the hub")
    );
    let files = select(&listing.files, &a.include)?;
    if files.is_empty() {
        let some: Vec<&str> = listing
            .files
            .iter()
            .take(8)
            .map(|e| e.path.as_str())
            .collect();
        return Err(Failure::usage(format!(
            "--include matches none of the {} files (e.g. {})",
            listing.files.len(),
            some.join(", ")
        )));
    }
    if !a.include.is_empty() {
        println!(
            "download: {} of them selected by --include ({} bytes)",
            files.len(),
            files.iter().map(|e| e.size).sum::<u64>()
        );
    }

    // What is here already: a file of the listed size is kept (the check at the end reads it
    // with --hash); one of another size is fetched again; a partial file is continued.
    let mut todo: Vec<Entry> = Vec::new();
    let (mut here, mut partial, mut need) = (0usize, 0u64, 0u64);
    for e in &files {
        let dest = dir.join(&e.path);
        match std::fs::metadata(&dest) {
            Ok(m) if m.is_file() && m.len() == e.size => {
                here += 1;
                continue;
            }
            Ok(m) if m.is_file() => {
                say(&format!(
                    "{}: {} bytes here, listed {}: fetching it again",
                    e.path,
                    m.len(),
                    e.size
                ));
                std::fs::remove_file(&dest).map_err(|err| {
                    Failure::usage(format!("cannot remove {}: {err}", dest.display()))
                })?;
            }
            Ok(_) => {
                return Err(Failure::usage(format!(
                    "{} is in the way (not a regular file)",
                    dest.display()
                )));
            }
            Err(_) => {}
        }
        let have = e
            .etag()
            .and_then(|t| std::fs::metadata(part_path(&work, &a.repo, t)).ok())
            .map_or(0, |m| m.len().min(e.size));
        partial += have;
        need += e.size - have;
        todo.push(e.clone());
    }
    let listing_path = dir.join(LISTING_FILE);
    let tree: Vec<Value> = files.iter().map(Entry::tree_json).collect();
    std::fs::write(
        &listing_path,
        serde_json::to_vec_pretty(&tree).unwrap_or_default(),
    )
    .map_err(|e| Failure::usage(format!("cannot write {}: {e}", listing_path.display())))?;

    if !todo.is_empty() {
        let free = free_bytes(&dir).map_err(Failure::usage)?;
        println!(
            "download: {} to fetch ({need} bytes, {}; {partial} bytes already in partial files), {here} already here",
            todo.len(),
            gb(need)
        );
        println!(
            "disk    : {need} bytes needed, {free} free in {} ({} needed, {} free)",
            dir.display(),
            gb(need),
            gb(free)
        );
        if need > free {
            return Err(Failure::usage(format!(
                "not enough disk space in {}: the download needs {need} more bytes ({}) and \
                 {free} are free ({}); free {} or choose another directory",
                dir.display(),
                gb(need),
                gb(free),
                gb(need - free)
            )));
        }
        fetch_all(&api, a, &listing.commit, &dir, &work, &todo, need)?;
    } else {
        println!("download: all {here} files already here");
    }
    // nothing partial is left: the cache inside DIR is empty but for bookkeeping
    let _ = std::fs::remove_dir_all(&work);

    println!("download: checking {}", dir.display());
    let names: BTreeSet<&str> = files.iter().map(|e| e.path.as_str()).collect();
    let is_ckpt_file = |p: &str| p.ends_with(".safetensors") || p == INDEX_FILE;
    let whole = listing
        .files
        .iter()
        .filter(|e| is_ckpt_file(&e.path))
        .all(|e| names.contains(e.path.as_str()));
    let has_ckpt = names.contains(INDEX_FILE) || names.contains(SINGLE_FILE);
    if whole && has_ckpt {
        crate::verify::main(&crate::verify::VerifyArgs {
            model_dir: dir.clone(),
            sizes: Some(listing_path),
            expect_shards: None,
            expect_bytes: None,
            release: None,
            hash: a.hash,
            rehash: false,
        })
    } else {
        Ok(check_files(&dir, &files, a.hash))
    }
}

/// Download `todo` on `--jobs` threads; an error names every file not fetched.
fn fetch_all(
    api: &Api,
    a: &DownloadArgs,
    commit: &str,
    dir: &Path,
    work: &Path,
    todo: &[Entry],
    need: u64,
) -> Result<(), Failure> {
    let target = if std::io::stderr().is_terminal() {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    };
    let mp = MultiProgress::with_draw_target(target);
    let total = mp.add(ProgressBar::new(need));
    total.set_style(bar_style(
        "{msg:>24} [{bar:30}] {bytes}/{total_bytes} ({bytes_per_sec}, {eta})",
    ));
    total.set_message(format!("all {} files", todo.len()));
    let abort = AtomicBool::new(false);
    let f = Fetch {
        api,
        repo: &a.repo,
        commit,
        dir,
        work,
        retries: a.retries,
        mp: &mp,
        total: &total,
        abort: &abort,
    };
    let next = AtomicUsize::new(0);
    let failures: Mutex<Vec<(String, String)>> = Mutex::new(Vec::new());
    let fetched = AtomicUsize::new(0);
    let started = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..usize::from(a.jobs).min(todo.len()) {
            s.spawn(|| {
                loop {
                    if abort.load(Ordering::Relaxed) {
                        break;
                    }
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(e) = todo.get(i) else { break };
                    match f.one(e) {
                        Ok(n) => {
                            fetched.fetch_add(n as usize, Ordering::Relaxed);
                        }
                        Err(fault) => {
                            if !fault.transient {
                                abort.store(true, Ordering::Relaxed);
                            }
                            f.say(&format!("FAILED: {}", fault.msg));
                            failures.lock().unwrap().push((e.path.clone(), fault.msg));
                        }
                    }
                }
            });
        }
    });
    total.finish_and_clear();
    let secs = started.elapsed().as_secs_f64();
    let mut failures = failures.into_inner().unwrap();
    // files no thread took because of an abort
    let taken = next.load(Ordering::Relaxed).min(todo.len());
    for e in &todo[taken..] {
        failures.push((e.path.clone(), "not started".into()));
    }
    let bytes = total.position();
    println!(
        "download: fetched {} of {} files, {bytes} bytes in {secs:.1} s ({:.1} MB/s)",
        todo.len() - failures.len(),
        todo.len(),
        bytes as f64 / 1e6 / secs.max(1e-9)
    );
    if failures.is_empty() {
        return Ok(());
    }
    failures.sort();
    let first = failures
        .iter()
        .find(|(_, m)| m != "not started")
        .map_or("", |(_, m)| m.as_str());
    let names: Vec<&str> = failures.iter().map(|(n, _)| n.as_str()).collect();
    Err(Failure {
        code: FAILED,
        msg: format!(
            "{} file{} not downloaded: {} ({first}); partial files are kept in {}: the same \
             command continues from there",
            failures.len(),
            if failures.len() == 1 { "" } else { "s" },
            names.join(", "),
            work.display()
        ),
    })
}

/// The check of a selection that is not a whole checkpoint: every selected file is there with
/// its listed size and, with `--hash`, its listed digest. Prints `verify`'s lines; returns its
/// exit code.
fn check_files(dir: &Path, files: &[Entry], hash: bool) -> u8 {
    let mut problems: Vec<(String, String)> = Vec::new();
    let mut sized: Vec<&Entry> = Vec::new();
    for e in files {
        match std::fs::metadata(dir.join(&e.path)) {
            Ok(m) if m.is_file() && m.len() == e.size => sized.push(e),
            Ok(m) if m.is_file() => problems.push((
                e.path.clone(),
                format!("{} bytes on disk, published {}", m.len(), e.size),
            )),
            Ok(_) => problems.push((e.path.clone(), "not a regular file".into())),
            Err(_) => problems.push((e.path.clone(), "missing".into())),
        }
    }
    let mut digested: BTreeSet<String> = BTreeSet::new();
    if hash {
        let jobs: Vec<digest::Job> = sized
            .iter()
            .filter_map(|e| {
                e.digest().map(|want| digest::Job {
                    name: e.path.clone(),
                    size: e.size,
                    want,
                })
            })
            .collect();
        let never = AtomicBool::new(false);
        let r = digest::hash_files(
            dir,
            &jobs,
            digest::Options::for_this_machine(true),
            &never,
            &|_, _, _| {},
        );
        for o in r.outcomes {
            match o.got {
                Ok(got) if got == o.want => {
                    digested.insert(o.name);
                }
                Ok(got) => problems.push((
                    o.name,
                    format!(
                        "content differs from the published {}: read {got}, published {}",
                        o.want.kind(),
                        o.want
                    ),
                )),
                Err(why) => problems.push((o.name, why)),
            }
        }
    }
    let bad: BTreeSet<&str> = problems.iter().map(|(n, _)| n.as_str()).collect();
    for e in &sized {
        if !bad.contains(e.path.as_str()) {
            println!(
                "file   : {} matches its published size{}",
                e.path,
                if digested.contains(&e.path) {
                    " and digest"
                } else {
                    ""
                }
            );
        }
    }
    for (n, p) in &problems {
        println!("FAIL   : {n}: {p}");
    }
    if bad.is_empty() {
        println!("RESULT : byte-exact match");
        exit::OK
    } else {
        let list: Vec<&str> = bad.into_iter().collect();
        println!("RESULT : FAIL: fetch again: {}", list.join(", "));
        crate::verify::MISMATCH
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repo_ids_and_names() {
        assert!(valid_repo_id("moonshotai/Kimi-K3"));
        assert!(valid_repo_id("a.b/c_d-e.1"));
        for bad in ["Kimi-K3", "/x", "a/", "a/b/c", "../x", "a/..", "a b/c", ""] {
            assert!(!valid_repo_id(bad), "{bad:?}");
        }
        assert_eq!(short_name("model.safetensors", 24), "model.safetensors");
        assert_eq!(short_name("abcdefghij", 6), "..ghij");
    }

    #[test]
    fn backoff_doubles_and_is_capped() {
        assert_eq!(backoff(1), Duration::from_millis(500));
        assert_eq!(backoff(2), Duration::from_millis(1000));
        assert_eq!(backoff(3), Duration::from_millis(2000));
        assert_eq!(backoff(40), Duration::from_secs(30));
    }

    #[test]
    fn listing_refuses_paths_outside_the_directory() {
        let v = |p: &str| json!({"sha": "abc123", "siblings": [{"rfilename": p, "size": 1, "blobId": "00"}]});
        assert!(parse_listing(&v("docs/guide.md")).is_ok());
        for bad in ["../x", "/etc/passwd", "a//b", "a/./b", ""] {
            assert!(parse_listing(&v(bad)).is_err(), "{bad:?}");
        }
        let no_size = json!({"sha": "abc", "siblings": [{"rfilename": "a"}]});
        assert!(parse_listing(&no_size).unwrap_err().contains("size"));
    }
}
