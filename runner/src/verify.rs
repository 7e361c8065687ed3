//! `k3-run verify MODEL_DIR`: is a downloaded checkpoint byte-exact, and if not, which shards
//! must be fetched again (docs/DESIGN.md §8)?
//!
//! Owns: the download check. Every shard the index (`model.safetensors.index.json`, or a single
//! `model.safetensors`) names must exist as a regular file (a symlink to one, as in the HF
//! cache, counts); its safetensors header must parse, and its file size must be exactly
//! `8 + header length + end of the last tensor's data`, so a truncated or over-long file is
//! caught on its own and named, even when two shards are wrong by opposite amounts and the
//! total is right. The index and every header must agree on which tensors each shard holds
//! (the engine refuses a checkpoint where they do not); the index's `metadata.total_size`, when
//! it differs from the headers' tensor bytes, is only a note (the engine never reads it). Published numbers, when given (`--sizes FILE`, `--expect-shards`,
//! `--expect-bytes`, `--release kimi-k3`), are compared too: the shard count, the exact total
//! and every listed file's size. Only headers are read and files stat'ed: no tensor data is
//! read or hashed, so the 1.56 TB release is checked in seconds.
//! With `--hash` and a Hugging Face tree listing as `--sizes`, every listed file that passed
//! those checks is then read whole and its content compared with the listing's digest
//! (`crate::digest`: SHA-256 for LFS files, the git blob id for the others), which finds what
//! sizes cannot: a flipped or zeroed byte.
//! Must not: read tensor data without `--hash`, know about models (that is `k3-run budget` /
//! the spec check at open).
//!
//! Output follows the C engine's download script (seed 002): `shards : 96 (expect 96)`,
//! `bytes  : N (expect N)`, `shards : all 96 match ... individually`, then
//! `RESULT : byte-exact match` (exit 0) or `RESULT : FAIL: fetch again: <files>` (exit 1).
//! A usage error or an unreadable index exits 2.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};

use clap::Args;

use crate::checkpoint::{self, CheckpointError, INDEX_FILE, SINGLE_FILE};
use crate::cli::{Failure, exit};
use crate::digest::{self, Digest};

/// Exit code of a check that found a mismatch (docs/DESIGN.md §6 code 1: the files are not the
/// model's; the same code as a run that cannot bind them).
pub const MISMATCH: u8 = exit::MISMATCH;

/// Published numbers of a release that are known for certain.
#[derive(Clone, Copy, Debug)]
pub struct Release {
    pub name: &'static str,
    pub shards: usize,
    pub total_bytes: u64,
}

/// moonshotai/Kimi-K3 as the C engine's download script verifies it (seed 002: "shards : 96
/// (expect 96)", "bytes : 1560936091448 (expect 1560936091448)"). Per-shard sizes are not
/// known here: give them with `--sizes`.
pub const KIMI_K3: Release = Release {
    name: "kimi-k3",
    shards: 96,
    total_bytes: 1_560_936_091_448,
};

/// Flags of `k3-run verify`.
#[derive(Args, Debug, Clone)]
pub struct VerifyArgs {
    /// Checkpoint directory (model.safetensors.index.json + shards, or model.safetensors).
    pub model_dir: PathBuf,
    /// Published file sizes: a JSON object {"file name": bytes, ...}, or a Hugging Face tree
    /// listing (an array of {"path": ..., "size": ...}). Every listed file must exist with
    /// exactly that size; the listed .safetensors files give the expected shard count and
    /// total unless --expect-shards / --expect-bytes say otherwise.
    #[arg(long, value_name = "FILE")]
    pub sizes: Option<PathBuf>,
    /// Expected number of shards.
    #[arg(long, value_name = "N")]
    pub expect_shards: Option<usize>,
    /// Expected total bytes of all shards.
    #[arg(long, value_name = "BYTES")]
    pub expect_bytes: Option<u64>,
    /// A release whose published shard count and total to expect: kimi-k3 (96 shards,
    /// 1560936091448 bytes).
    #[arg(long, value_parser = ["kimi-k3"], conflicts_with_all = ["expect_shards", "expect_bytes"])]
    pub release: Option<String>,
    /// Also read every published file whole and compare its content with the digest the
    /// --sizes tree listing gives (`lfs.oid`, SHA-256, for LFS files; `oid`, the git blob id,
    /// for the others). The release is 1.56 TB: about 15-20 minutes at 1.5 GB/s. Digests are
    /// kept in MODEL_DIR/.k3-run-verify.json per file (size, inode, modification time; in
    /// $XDG_CACHE_HOME or ~/.cache/k3-run/verify/ when MODEL_DIR cannot be written), so a
    /// check stopped by Ctrl-C continues where it stopped when run again.
    #[arg(long, requires = "sizes")]
    pub hash: bool,
    /// With --hash: read every file again, ignoring the digests kept by earlier runs.
    #[arg(long, requires = "hash")]
    pub rehash: bool,
}

/// One file of a `--sizes` listing: its size and, from a Hugging Face tree listing, the digest
/// of its content.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Published {
    pub size: u64,
    pub digest: Option<Digest>,
}

/// What was found for one file.
#[derive(Debug, Default)]
struct FileCheck {
    name: String,
    /// Size on disk; `None` when missing or not a regular file.
    size: Option<u64>,
    /// `8 + header + end of the last tensor` when the header could be read.
    header_size: Option<u64>,
    problems: Vec<String>,
    /// The header and the index disagree on its tensors: either may be the stale one.
    index_disagrees: bool,
}

fn signed_diff(have: u64, want: u64) -> String {
    let (n, how) = if have < want {
        (want - have, "short")
    } else {
        (have - want, "too long")
    };
    format!("{n} byte{} {how}", if n == 1 { "" } else { "s" })
}

/// Published sizes from `--sizes`: `{"name": size}` or `[{"path": name, "size": size}, ...]`
/// (a Hugging Face tree listing, whose entries also give `lfs.oid`, the SHA-256 of an LFS
/// file, or `oid`, the git blob id of any other file).
pub fn read_sizes(path: &Path) -> Result<BTreeMap<String, Published>, String> {
    let text = k3_models::load::read_regular_bytes(path)
        .map_err(|e| format!("cannot read --sizes {}: {e}", path.display()))?;
    let v: serde_json::Value = serde_json::from_slice(&text)
        .map_err(|e| format!("--sizes {}: not JSON: {e}", path.display()))?;
    let bad = |msg: String| format!("--sizes {}: {msg}", path.display());
    let mut out = BTreeMap::new();
    match v {
        serde_json::Value::Object(map) => {
            for (name, size) in map {
                let n = size
                    .as_u64()
                    .ok_or_else(|| bad(format!("{name:?}: size {size} is not a byte count")))?;
                out.insert(
                    name,
                    Published {
                        size: n,
                        digest: None,
                    },
                );
            }
        }
        serde_json::Value::Array(items) => {
            for (i, it) in items.iter().enumerate() {
                // a tree listing also holds directories (no size): skip those
                if it.get("type").and_then(|t| t.as_str()) == Some("directory") {
                    continue;
                }
                let name = it
                    .get("path")
                    .and_then(|p| p.as_str())
                    .ok_or_else(|| bad(format!("entry {i} has no \"path\" string")))?;
                let n = it
                    .get("size")
                    .and_then(serde_json::Value::as_u64)
                    .ok_or_else(|| bad(format!("{name:?} has no \"size\" byte count")))?;
                let digest = listed_digest(it).map_err(|m| bad(format!("{name:?}: {m}")))?;
                out.insert(name.to_string(), Published { size: n, digest });
            }
        }
        _ => {
            return Err(bad(
                "expected an object {\"file\": bytes} or an array of {\"path\", \"size\"}".into(),
            ));
        }
    }
    for name in out.keys() {
        if !is_relative_file_path(name) {
            return Err(bad(format!(
                "{name:?} is not a file name or a relative path inside the checkpoint directory"
            )));
        }
    }
    Ok(out)
}

/// A listing's path of a file inside the checkpoint directory: plain file names joined by `/`
/// (a repository's `docs/guide.md`), none of them empty, `.` or `..`.
pub fn is_relative_file_path(name: &str) -> bool {
    name.split('/').all(checkpoint::is_plain_file_name)
}

/// The content digest of one tree-listing entry: `lfs.oid` (SHA-256) when the file is in LFS,
/// else `oid` (the git blob id); none when the entry has neither. A digest that is there but
/// malformed is an error: a listing that cannot be read with confidence is not guessed at.
fn listed_digest(it: &serde_json::Value) -> Result<Option<Digest>, String> {
    if let Some(lfs) = it.get("lfs").filter(|v| !v.is_null()) {
        let oid = lfs
            .get("oid")
            .and_then(|o| o.as_str())
            .ok_or("\"lfs\" has no \"oid\" string")?;
        let oid = oid.strip_prefix("sha256:").unwrap_or(oid);
        return Digest::sha256_hex(oid)
            .map(Some)
            .ok_or_else(|| format!("lfs.oid {oid:?} is not a SHA-256 (64 hex digits)"));
    }
    match it.get("oid") {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(o) => {
            let oid = o.as_str().ok_or("\"oid\" is not a string")?;
            Digest::git_sha1_hex(oid)
                .map(Some)
                .ok_or_else(|| format!("oid {oid:?} is not a git blob id (40 hex digits)"))
        }
    }
}

fn is_shard_name(name: &str) -> bool {
    name.ends_with(".safetensors")
}

/// Size of a regular file (following symlinks), or why there is none.
fn stat_regular(path: &Path) -> Result<u64, String> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_file() => Ok(m.len()),
        Ok(_) => Err("not a regular file".into()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err("missing".into()),
        Err(e) => Err(format!("cannot stat: {e}")),
    }
}

/// Check one shard: exists, header readable, size exactly what the header needs, and the
/// header holds exactly the tensors the index maps to it. Returns the check and the tensor
/// payload bytes of its header (`None` when the header could not be read whole).
fn check_shard(
    dir: &Path,
    name: &str,
    index_names: Option<&[&str]>,
    index: Option<&checkpoint::IndexMap>,
) -> (FileCheck, Option<u64>) {
    let path = dir.join(name);
    let mut c = FileCheck {
        name: name.to_string(),
        ..FileCheck::default()
    };
    match stat_regular(&path) {
        Ok(n) => c.size = Some(n),
        Err(why) => {
            let n = index_names.map_or(0, <[&str]>::len);
            c.problems.push(if n > 0 {
                format!("{why} (the index maps {n} tensors to it)")
            } else {
                why
            });
            return (c, None);
        }
    }
    let header = match checkpoint::header::read_shard_header(&path) {
        Ok(h) => h,
        Err(CheckpointError::Truncated {
            expected_len,
            actual_len,
            ..
        }) => {
            c.header_size = Some(expected_len);
            c.problems.push(format!(
                "truncated: {actual_len} bytes on disk, its header needs {expected_len} ({})",
                signed_diff(actual_len, expected_len)
            ));
            return (c, None);
        }
        Err(e) => {
            c.problems.push(format!("unreadable header: {e}"));
            return (c, None);
        }
    };
    let end = header.data_start + header.entries.iter().map(|e| e.end).max().unwrap_or(0);
    c.header_size = Some(end);
    if header.file_len != end {
        c.problems.push(format!(
            "{} bytes on disk, its header needs {end} ({})",
            header.file_len,
            signed_diff(header.file_len, end)
        ));
    }
    let payload = header.entries.iter().map(|e| e.end - e.begin).sum();
    if let (Some(map), Some(names)) = (index, index_names) {
        let foreign: Vec<&str> = header
            .entries
            .iter()
            .filter(|e| map.file(&e.name) != Some(name))
            .map(|e| e.name.as_str())
            .collect();
        c.index_disagrees = !foreign.is_empty();
        if let Some(first) = foreign.first() {
            let where_ = map.file(first).map_or_else(
                || "not in the index".to_string(),
                |f| format!("the index says {f}"),
            );
            c.problems.push(format!(
                "holds {} tensors the index does not map to it (first: {first}, {where_})",
                foreign.len()
            ));
        }
        let held: HashSet<&str> = header.entries.iter().map(|e| e.name.as_str()).collect();
        let absent: Vec<&&str> = names.iter().filter(|n| !held.contains(**n)).collect();
        if let Some(first) = absent.first() {
            c.index_disagrees = true;
            c.problems.push(format!(
                "lacks {} tensors the index maps to it (first: {first})",
                absent.len()
            ));
        }
    }
    (c, Some(payload))
}

/// Progress on a terminal only (stderr): the checks are fast, but 96 shards on a slow disk
/// still take a moment.
struct Progress {
    on: bool,
}

impl Progress {
    fn tick(&self, i: usize, n: usize, name: &str) {
        if self.on {
            eprint!("\rverify: {i}/{n} {name}\x1b[K");
            let _ = std::io::stderr().flush();
        }
    }
    fn done(&self) {
        if self.on {
            eprint!("\r\x1b[K");
        }
    }
}

/// `k3-run verify`.
pub fn main(a: &VerifyArgs) -> Result<u8, Failure> {
    let dir = &a.model_dir;
    if !dir.is_dir() {
        return Err(Failure::usage(format!(
            "{} is not a directory",
            dir.display()
        )));
    }
    let published = match &a.sizes {
        Some(p) => Some(read_sizes(p).map_err(Failure::usage)?),
        None => None,
    };
    if a.hash
        && let (Some(p), Some(pubs)) = (&a.sizes, &published)
        && pubs.values().all(|v| v.digest.is_none())
    {
        return Err(Failure::usage(format!(
            "--hash: --sizes {} gives no digest: it takes a Hugging Face tree listing, whose \
             entries carry \"lfs\": {{\"oid\": <sha256>}} or \"oid\": <git blob id> (e.g. \
             curl -s https://huggingface.co/api/models/OWNER/NAME/tree/main)",
            p.display()
        )));
    }
    let index_path = dir.join(INDEX_FILE);
    let (index, meta_total) = if index_path.is_file() {
        let (map, total) = checkpoint::read_index_with_total(&index_path).map_err(|e| {
            crate::cli::checkpoint_failure(format!(
                "cannot read the index: {e}; fetch {INDEX_FILE} again"
            ))
        })?;
        (Some(map), total)
    } else if dir.join(SINGLE_FILE).exists() {
        (None, None)
    } else {
        return Err(Failure::usage(format!(
            "{}: neither {INDEX_FILE} nor {SINGLE_FILE}",
            dir.display()
        )));
    };
    // shard file -> the tensors the index maps to it
    let mut by_file: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    match &index {
        Some(map) => {
            for (t, f) in map.iter() {
                by_file.entry(f).or_default().push(t);
            }
            // each shard's tensors by name, as a sorted map gave them
            for names in by_file.values_mut() {
                names.sort_unstable();
            }
        }
        None => {
            by_file.insert(SINGLE_FILE, Vec::new());
        }
    }
    let n_tensors = index.as_ref().map_or(0, checkpoint::IndexMap::len);
    let n_shards = by_file.len();
    if n_shards == 0 {
        return Err(crate::cli::checkpoint_failure(format!(
            "{}: the weight_map names no shard; fetch {INDEX_FILE} again",
            index_path.display()
        )));
    }
    println!(
        "verifying {} ({}: {n_shards} shard{}{})",
        dir.display(),
        if index.is_some() {
            INDEX_FILE
        } else {
            SINGLE_FILE
        },
        if n_shards == 1 { "" } else { "s" },
        if index.is_some() {
            format!(", {n_tensors} tensors")
        } else {
            String::new()
        }
    );

    let progress = Progress {
        on: std::io::stderr().is_terminal(),
    };
    let mut checks = Vec::with_capacity(n_shards);
    let mut payload = 0u64;
    let mut all_read = true;
    for (i, (name, names)) in by_file.iter().enumerate() {
        progress.tick(i + 1, n_shards, name);
        let (c, p) = check_shard(dir, name, Some(names.as_slice()), index.as_ref());
        all_read &= p.is_some();
        payload += p.unwrap_or(0);
        checks.push(c);
    }
    progress.done();

    // Published files: every listed one must be there with its size.
    let mut other_files: Vec<FileCheck> = Vec::new();
    let mut index_problems: Vec<String> = Vec::new();
    if let Some(pubs) = &published {
        for c in &mut checks {
            match (pubs.get(&c.name).map(|p| p.size), c.size) {
                (Some(want), Some(have)) if have != want => c.problems.push(format!(
                    "{have} bytes on disk, published {want} ({})",
                    signed_diff(have, want)
                )),
                (None, _) if pubs.keys().any(|k| is_shard_name(k)) => c
                    .problems
                    .push("not among the published files (an index from another revision?)".into()),
                _ => {}
            }
        }
        for (name, p) in pubs {
            let want = p.size;
            if by_file.contains_key(name.as_str()) {
                continue;
            }
            if is_shard_name(name) {
                index_problems.push(format!(
                    "published shard {name} is not named by the index (an index from another \
                     revision?)"
                ));
                continue;
            }
            let mut c = FileCheck {
                name: name.clone(),
                ..FileCheck::default()
            };
            match stat_regular(&dir.join(name)) {
                Ok(have) => {
                    c.size = Some(have);
                    if have != want {
                        c.problems.push(format!(
                            "{have} bytes on disk, published {want} ({})",
                            signed_diff(have, want)
                        ));
                    }
                }
                Err(why) => c.problems.push(why),
            }
            other_files.push(c);
        }
    }

    // Content digests (--hash): every published file that passed the checks above.
    let mut digest_summary: Vec<String> = Vec::new();
    let mut unread: HashSet<String> = HashSet::new();
    if a.hash
        && let Some(pubs) = &published
    {
        let d = hash_published(dir, pubs, &mut checks, &mut other_files, a.rehash);
        digest_summary = d.lines;
        unread = d.unread;
    }
    let interrupted = !unread.is_empty();

    // Expectations: explicit flags, else the release, else the published listing.
    let release = a.release.as_deref().map(|_| KIMI_K3);
    let pub_shards: Option<(usize, u64)> = published.as_ref().and_then(|p| {
        let shards: Vec<u64> = p
            .iter()
            .filter(|(k, _)| is_shard_name(k))
            .map(|(_, v)| v.size)
            .collect();
        (!shards.is_empty()).then(|| (shards.len(), shards.iter().sum()))
    });
    let expect_shards = a
        .expect_shards
        .or(release.map(|r| r.shards))
        .or(pub_shards.map(|p| p.0));
    let expect_bytes = a
        .expect_bytes
        .or(release.map(|r| r.total_bytes))
        .or(pub_shards.map(|p| p.1));

    let present = checks.iter().filter(|c| c.size.is_some()).count();
    let total: u64 = checks.iter().filter_map(|c| c.size).sum();
    let header_total: Option<u64> = checks.iter().map(|c| c.header_size).sum();
    let mut failed_totals = false;
    match expect_shards {
        Some(n) => {
            println!("shards : {present} (expect {n})");
            failed_totals |= present != n || n_shards != n;
            if n_shards != n {
                index_problems.push(format!("the index names {n_shards} shards, expected {n}"));
            }
        }
        None => println!("shards : {present} (expect {n_shards}, from the index)"),
    }
    if present != n_shards {
        failed_totals = true;
    }
    match (expect_bytes, header_total) {
        (Some(b), _) => {
            println!("bytes  : {total} (expect {b})");
            failed_totals |= total != b;
        }
        (None, Some(h)) => {
            println!("bytes  : {total} (expect {h}, from the headers)");
            failed_totals |= total != h;
        }
        (None, None) => println!("bytes  : {total} (expect unknown: a header could not be read)"),
    }
    let bad: Vec<&FileCheck> = checks.iter().filter(|c| !c.problems.is_empty()).collect();
    let ok = n_shards - bad.len();
    let what = if a.hash && !interrupted {
        "their headers, their published sizes and digests"
    } else if interrupted {
        "their headers and their published sizes (digests: below)"
    } else if published.is_some() {
        "their headers and their published sizes"
    } else {
        "the sizes their headers declare"
    };
    if bad.is_empty() {
        println!("shards : all {n_shards} match {what} individually");
    } else {
        println!("shards : {ok} of {n_shards} pass every check individually (FAIL lines below)");
    }
    for o in &other_files {
        if o.problems.is_empty() {
            println!(
                "file   : {} matches its published size{}",
                o.name,
                if a.hash && !unread.contains(&o.name) {
                    " and digest"
                } else {
                    ""
                }
            );
        }
    }
    for l in &digest_summary {
        println!("{l}");
    }
    if index.is_some() {
        // Only a note: the engine never reads `total_size`, and writers other than HF's may
        // count it another way; a good download must not FAIL on it.
        let meta_differs = matches!(meta_total, Some(m) if all_read && m != payload);
        if meta_differs {
            println!(
                "note   : {INDEX_FILE} metadata.total_size is {} but the shards' headers hold \
                 {payload} tensor bytes (not used by the engine)",
                meta_total.unwrap_or(0)
            );
        }
        if bad.is_empty() && index_problems.is_empty() && !meta_differs {
            println!(
                "tensors: all {n_tensors} in the shards the index names; {payload} bytes of \
                 tensor data{}",
                meta_total.map_or(String::new(), |m| format!(" (index metadata {m})"))
            );
        }
    }
    for name in unreferenced_shards(dir, &by_file) {
        println!("note   : {name} is not named by the index (not checked, not used)");
    }

    let mut fetch: BTreeSet<String> = BTreeSet::new();
    for c in bad.iter().copied().chain(other_files.iter()) {
        for p in &c.problems {
            println!("FAIL   : {}: {p}", c.name);
        }
        if !c.problems.is_empty() {
            fetch.insert(c.name.clone());
        }
        if c.index_disagrees {
            fetch.insert(INDEX_FILE.to_string());
        }
    }
    for p in &index_problems {
        println!("FAIL   : {INDEX_FILE}: {p}");
    }
    if !index_problems.is_empty() {
        fetch.insert(INDEX_FILE.to_string());
    }
    if interrupted {
        println!(
            "RESULT : INCOMPLETE: stopped by Ctrl-C before every file was read; the same \
             command continues from there"
        );
        return Ok(exit::INTERRUPTED);
    }
    if fetch.is_empty() && !failed_totals {
        println!("RESULT : byte-exact match");
        return Ok(exit::OK);
    }
    if fetch.is_empty() {
        // the totals differ from a published expectation while every shard matches its
        // header: nothing names one file (e.g. an index of another revision)
        println!(
            "RESULT : FAIL: the totals differ from the published numbers but every shard \
             matches its header; fetch the index and the files again"
        );
    } else {
        let list: Vec<&str> = fetch.iter().map(String::as_str).collect();
        println!("RESULT : FAIL: fetch again: {}", list.join(", "));
    }
    Ok(MISMATCH)
}

/// What `--hash` found, for the report.
struct DigestPass {
    /// `digest : ...` and `note   : ...` lines.
    lines: Vec<String>,
    /// Files not read because Ctrl-C stopped the pass.
    unread: HashSet<String>,
}

/// Read every published file with a digest that passed the size and header checks, and add a
/// problem to each whose content differs or cannot be read. Ctrl-C stops the pass between
/// chunks (a second one kills); the digests finished by then are kept for the next run.
fn hash_published(
    dir: &Path,
    pubs: &BTreeMap<String, Published>,
    checks: &mut [FileCheck],
    other_files: &mut [FileCheck],
    rehash: bool,
) -> DigestPass {
    let mut jobs = Vec::new();
    let mut undigested = 0usize;
    for c in checks.iter().chain(other_files.iter()) {
        let Some(p) = pubs.get(&c.name) else { continue };
        match p.digest {
            Some(want) if c.problems.is_empty() && c.size == Some(p.size) => {
                jobs.push(digest::Job {
                    name: c.name.clone(),
                    size: p.size,
                    want,
                })
            }
            Some(_) => {} // already failed: fetched again anyway
            None => undigested += 1,
        }
    }
    let stop = crate::cli::ctrl_c_flag(130);
    let announce = |files: usize, bytes: u64, kept: usize| {
        if files == 0 {
            if kept > 0 {
                eprintln!(
                    "verify: every digest kept from an earlier run ({kept} files of the same \
                     size, inode and modification time; --rehash reads them again)"
                );
            }
            return;
        }
        let kept = if kept > 0 {
            format!(", {kept} more kept from an earlier run")
        } else {
            String::new()
        };
        eprintln!(
            "verify: reading {files} file{} ({:.2} GB) for their digests{kept} (Ctrl-C stops; \
             the next run continues)",
            if files == 1 { "" } else { "s" },
            bytes as f64 / 1e9
        );
    };
    let opts = digest::Options::for_this_machine(!rehash);
    let r = digest::hash_files(dir, &jobs, opts, &stop, &announce);
    let mut lines = Vec::new();
    let mut matched = 0usize;
    let (mut sha256, mut sha1) = (0usize, 0usize);
    let mut kept = 0usize;
    for o in &r.outcomes {
        let problem = match &o.got {
            Ok(got) if *got == o.want => {
                matched += 1;
                kept += usize::from(o.kept);
                match got {
                    Digest::Sha256(_) => sha256 += 1,
                    Digest::GitSha1(_) => sha1 += 1,
                }
                continue;
            }
            Ok(got) => format!(
                "content differs from the published {}: read {got}, published {}",
                o.want.kind(),
                o.want
            ),
            Err(why) => why.clone(),
        };
        if let Some(c) = checks
            .iter_mut()
            .chain(other_files.iter_mut())
            .find(|c| c.name == o.name)
        {
            c.problems.push(problem);
        }
    }
    let rate = if r.seconds > 0.0 {
        r.bytes_read as f64 / 1e6 / r.seconds
    } else {
        0.0
    };
    let read = format!(
        "{:.2} GB read in {:.1} s ({rate:.0} MB/s), {kept} kept from an earlier run",
        r.bytes_read as f64 / 1e9,
        r.seconds
    );
    if matched == jobs.len() {
        lines.push(format!(
            "digest : all {matched} files match their published digests ({sha256} sha256, \
             {sha1} git sha1); {read}"
        ));
    } else if r.unfinished.is_empty() {
        lines.push(format!(
            "digest : {matched} of {} files match their published digests (FAIL lines \
             below); {read}",
            jobs.len()
        ));
    } else {
        lines.push(format!(
            "digest : interrupted: {} of {} files done ({matched} match); {read}; not read: {}",
            r.outcomes.len(),
            jobs.len(),
            r.unfinished.join(", ")
        ));
    }
    if undigested > 0 {
        lines.push(format!(
            "note   : {undigested} listed file{} no digest in the listing (size checked only)",
            if undigested == 1 { " has" } else { "s have" }
        ));
    }
    if let Some(m) = r.kept_elsewhere {
        lines.push(format!("note   : {m}"));
    }
    if let Some(e) = r.keep_error {
        lines.push(format!(
            "note   : {e}; an interrupted check will read every file again"
        ));
    }
    DigestPass {
        lines,
        unread: r.unfinished.into_iter().collect(),
    }
}

/// `.safetensors` files in `dir` the index does not name (left over from another revision).
fn unreferenced_shards(dir: &Path, by_file: &BTreeMap<&str, Vec<&str>>) -> Vec<String> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<String> = rd
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| is_shard_name(n) && !by_file.contains_key(n.as_str()))
        .collect();
    out.sort();
    out
}
