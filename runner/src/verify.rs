//! `k3-run verify MODEL_DIR`: is a downloaded checkpoint byte-exact, and if not, which shards
//! must be fetched again (SYSTEM.md §8)?
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
//! Must not: read tensor data, know about models (that is `k3-run budget` / the spec check at
//! open).
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

/// Exit code of a check that found a mismatch (SYSTEM.md §6 code 1: the files are not the
/// model's).
pub const MISMATCH: u8 = 1;

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

/// Published sizes from `--sizes`: `{"name": size}` or `[{"path": name, "size": size}, ...]`.
pub fn read_sizes(path: &Path) -> Result<BTreeMap<String, u64>, String> {
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
                out.insert(name, n);
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
                out.insert(name.to_string(), n);
            }
        }
        _ => {
            return Err(bad(
                "expected an object {\"file\": bytes} or an array of {\"path\", \"size\"}".into(),
            ));
        }
    }
    for name in out.keys() {
        if !checkpoint::is_plain_file_name(name) {
            return Err(bad(format!(
                "{name:?} is not a plain file name in the checkpoint directory"
            )));
        }
    }
    Ok(out)
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
    let index_path = dir.join(INDEX_FILE);
    let (index, meta_total) = if index_path.is_file() {
        let (map, total) = checkpoint::read_index_with_total(&index_path)
            .map_err(|e| Failure::usage(format!("cannot read the index: {e}")))?;
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
        return Err(Failure::usage(format!(
            "{}: the weight_map names no shard",
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
            match (pubs.get(&c.name), c.size) {
                (Some(&want), Some(have)) if have != want => c.problems.push(format!(
                    "{have} bytes on disk, published {want} ({})",
                    signed_diff(have, want)
                )),
                (None, _) if pubs.keys().any(|k| is_shard_name(k)) => c
                    .problems
                    .push("not among the published files (an index from another revision?)".into()),
                _ => {}
            }
        }
        for (name, &want) in pubs {
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

    // Expectations: explicit flags, else the release, else the published listing.
    let release = a.release.as_deref().map(|_| KIMI_K3);
    let pub_shards: Option<(usize, u64)> = published.as_ref().and_then(|p| {
        let shards: Vec<u64> = p
            .iter()
            .filter(|(k, _)| is_shard_name(k))
            .map(|(_, v)| *v)
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
    let what = if published.is_some() {
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
            println!("file   : {} matches its published size", o.name);
        }
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
