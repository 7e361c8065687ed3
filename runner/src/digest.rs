//! `k3-run verify --hash`: read published files whole and compare their content with the
//! digests a Hugging Face tree listing publishes for them.
//!
//! Owns: the digests (`lfs.oid`, the SHA-256 of an LFS file's content; `oid`, the git blob id of
//! any other file: SHA-1 of `blob <size>\0` + content), reading files for them on a few
//! threads with a progress bar, Ctrl-C between chunks, and the digests kept from earlier runs
//! (`MODEL_DIR/.k3-run-verify.json`, one entry per file with its size, inode and modification
//! time; in the user's cache directory when MODEL_DIR cannot be written), so an interrupted
//! check of the 1.56 TB release continues where it stopped.
//! Must not: decide what a mismatch means (that is `verify`), read a file that failed a cheaper
//! check first.

use std::collections::BTreeMap;
use std::fmt;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, mpsc};
use std::time::Instant;

use sha1::Sha1;

use crate::stream::aligned::AlignedBuf;
use crate::stream::direct::DirectFile;
use sha2::{Digest as _, Sha256};

/// The file in a checkpoint directory that keeps the digests of earlier `--hash` runs.
pub const KEPT_FILE: &str = ".k3-run-verify.json";

/// Bytes read per call (and the granularity of Ctrl-C and of the progress bar).
const CHUNK: usize = 8 << 20;

/// A published digest of a file's content.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Digest {
    /// SHA-256 of the content (a Hugging Face listing's `lfs.oid`).
    Sha256([u8; 32]),
    /// Git blob id: SHA-1 of `blob <size>\0` followed by the content (a listing's `oid` of a
    /// file not in LFS).
    GitSha1([u8; 20]),
}

impl Digest {
    /// `sha256` or `git sha1`.
    pub fn kind(&self) -> &'static str {
        match self {
            Digest::Sha256(_) => "sha256",
            Digest::GitSha1(_) => "git sha1",
        }
    }

    fn bytes(&self) -> &[u8] {
        match self {
            Digest::Sha256(b) => b,
            Digest::GitSha1(b) => b,
        }
    }

    /// A SHA-256 from 64 hex digits.
    pub fn sha256_hex(s: &str) -> Option<Digest> {
        parse_hex::<32>(s).map(Digest::Sha256)
    }

    /// A git blob id from 40 hex digits.
    pub fn git_sha1_hex(s: &str) -> Option<Digest> {
        parse_hex::<20>(s).map(Digest::GitSha1)
    }

    fn same_kind(&self, hex: &str) -> Option<Digest> {
        match self {
            Digest::Sha256(_) => Digest::sha256_hex(hex),
            Digest::GitSha1(_) => Digest::git_sha1_hex(hex),
        }
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.bytes() {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

fn parse_hex<const N: usize>(s: &str) -> Option<[u8; N]> {
    if s.len() != 2 * N || !s.is_ascii() {
        return None;
    }
    let mut out = [0u8; N];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// One file to read: `dir/name`, expected to hold `size` bytes with digest `want`.
#[derive(Clone, Debug)]
pub struct Job {
    pub name: String,
    pub size: u64,
    pub want: Digest,
}

/// What reading one file gave.
#[derive(Debug)]
pub struct Outcome {
    pub name: String,
    pub want: Digest,
    /// The digest of the content, or why the file could not be read whole.
    pub got: Result<Digest, String>,
    /// Taken from an earlier run's kept digests, not read now.
    pub kept: bool,
}

/// All of a `--hash` pass.
#[derive(Debug)]
pub struct Report {
    /// One per file finished (read or kept), in the jobs' order.
    pub outcomes: Vec<Outcome>,
    /// Files not finished because of Ctrl-C.
    pub unfinished: Vec<String>,
    pub bytes_read: u64,
    pub seconds: f64,
    /// Why the digests could not be kept (an interrupted check would then start over).
    pub keep_error: Option<String>,
    /// Where the digests were kept instead of the checkpoint directory, and why.
    pub kept_elsewhere: Option<String>,
}

/// How to run a pass.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    pub threads: usize,
    /// Use the digests kept by earlier runs (`--rehash` turns this off; new ones are kept
    /// either way).
    pub reuse: bool,
    pub progress: bool,
}

impl Options {
    /// One hashing thread per core, up to 4, each with its reader (SHA-256 with the SHA
    /// extensions runs at ~1.2 GB/s per core here: two keep up with a ~1.6 GB/s disk); the bar
    /// on a terminal only.
    pub fn for_this_machine(reuse: bool) -> Options {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Options {
            threads: cores.clamp(1, 4),
            reuse,
            progress: std::io::stderr().is_terminal(),
        }
    }
}

/// A file's identity for the kept digests: a file of another size, inode or modification time
/// is read again.
#[derive(serde::Serialize, serde::Deserialize, Clone, PartialEq, Eq, Debug)]
struct Stamp {
    size: u64,
    ino: u64,
    mtime_ns: i64,
}

fn stamp_of(path: &Path) -> std::io::Result<Stamp> {
    let m = std::fs::metadata(path)?;
    Ok(Stamp {
        size: m.len(),
        ino: inode(&m),
        mtime_ns: mtime_ns(&m),
    })
}

/// The file's inode number (Unix); 0 on Windows, where std has no stable file index (the size
/// and the modification time still tell a changed file).
fn inode(m: &std::fs::Metadata) -> u64 {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        m.ino()
    }
    #[cfg(not(unix))]
    {
        let _ = m;
        0
    }
}

/// Modification time in nanoseconds since the epoch (negative before it).
fn mtime_ns(m: &std::fs::Metadata) -> i64 {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        m.mtime()
            .saturating_mul(1_000_000_000)
            .saturating_add(m.mtime_nsec())
    }
    #[cfg(not(unix))]
    {
        match m
            .modified()
            .map(|t| t.duration_since(std::time::UNIX_EPOCH))
        {
            Ok(Ok(d)) => i64::try_from(d.as_nanos()).unwrap_or(i64::MAX),
            Ok(Err(e)) => -i64::try_from(e.duration().as_nanos()).unwrap_or(i64::MAX),
            Err(_) => 0,
        }
    }
}

#[derive(serde::Serialize, serde::Deserialize, Clone, Debug)]
struct KeptEntry {
    #[serde(flatten)]
    stamp: Stamp,
    kind: String,
    digest: String,
}

#[derive(serde::Serialize, serde::Deserialize, Default, Debug)]
struct KeptFile {
    version: u32,
    files: BTreeMap<String, KeptEntry>,
}

const KEPT_VERSION: u32 = 1;

/// The kept digests of one directory, saved after every file (write to a temporary name,
/// rename), so Ctrl-C or a crash loses at most the files being read. They go into the
/// directory itself, or, when it cannot be written (a read-only mount), into the user's cache
/// directory ([`fallback_path`]).
struct Kept {
    path: PathBuf,
    fallback: Option<PathBuf>,
    file: KeptFile,
    /// Where the digests went instead of the directory, and why.
    moved: Option<String>,
    error: Option<String>,
}

/// `$XDG_CACHE_HOME/k3-run/verify/<dir name>-<hash of its full path>.json` (or under
/// `$HOME/.cache`): where the digests of a directory that cannot be written are kept.
fn fallback_path(dir: &Path) -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
        .or_else(|| {
            std::env::var_os("HOME")
                .map(PathBuf::from)
                .filter(|p| p.is_absolute())
                .map(|h| h.join(".cache"))
        })?;
    let full = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    // FNV-1a 64 of the path: a stable name per directory
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in full.as_os_str().as_encoded_bytes() {
        h = (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
    }
    let name: String = full
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .take(64)
        .collect();
    Some(
        base.join("k3-run/verify")
            .join(format!("{name}-{h:016x}.json")),
    )
}

fn read_kept(path: &Path) -> Option<KeptFile> {
    std::fs::read(path)
        .ok()
        .and_then(|b| serde_json::from_slice::<KeptFile>(&b).ok())
        .filter(|f| f.version == KEPT_VERSION)
}

impl Kept {
    /// Load `dir/.k3-run-verify.json` and the cache directory's file of `dir`, the
    /// directory's entries first; a missing, unreadable or foreign file is an empty one (it is
    /// rewritten at the first finished file).
    fn load(dir: &Path) -> Kept {
        let path = dir.join(KEPT_FILE);
        let fallback = fallback_path(dir);
        let mut file = fallback.as_deref().and_then(read_kept).unwrap_or_default();
        if let Some(here) = read_kept(&path) {
            file.files.extend(here.files);
        }
        Kept {
            path,
            fallback,
            file,
            moved: None,
            error: None,
        }
    }

    fn get(&self, name: &str, stamp: &Stamp, want: &Digest) -> Option<Digest> {
        let e = self.file.files.get(name)?;
        (e.stamp == *stamp && e.kind == want.kind())
            .then(|| want.same_kind(&e.digest))
            .flatten()
    }

    fn put(&mut self, name: &str, stamp: Stamp, got: &Digest) {
        self.file.files.insert(
            name.to_string(),
            KeptEntry {
                stamp,
                kind: got.kind().to_string(),
                digest: got.to_string(),
            },
        );
        if self.error.is_some() {
            return;
        }
        let Err(e) = self.save() else { return };
        if self.moved.is_none()
            && let Some(fb) = self.fallback.clone()
        {
            let why = format!("{} cannot be written: {e}", self.path.display());
            self.path = fb;
            let made = self.path.parent().map_or(Ok(()), std::fs::create_dir_all);
            if made.and_then(|()| self.save()).is_ok() {
                self.moved = Some(format!("digests kept in {} ({why})", self.path.display()));
                return;
            }
        }
        self.error = Some(format!(
            "cannot keep digests in {}: {e}",
            self.path.display()
        ));
    }

    fn save(&mut self) -> std::io::Result<()> {
        self.file.version = KEPT_VERSION;
        let tmp = self
            .path
            .with_file_name(format!("{KEPT_FILE}.tmp-{}", std::process::id()));
        let text = serde_json::to_vec_pretty(&self.file).map_err(std::io::Error::other)?;
        std::fs::write(&tmp, text)?;
        std::fs::rename(&tmp, &self.path).inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })
    }
}

enum Hasher {
    Sha256(Sha256),
    GitSha1(Sha1),
}

impl Hasher {
    fn new(want: &Digest, size: u64) -> Hasher {
        match want {
            Digest::Sha256(_) => Hasher::Sha256(Sha256::new()),
            Digest::GitSha1(_) => {
                let mut h = Sha1::new();
                h.update(format!("blob {size}\0").as_bytes());
                Hasher::GitSha1(h)
            }
        }
    }

    fn update(&mut self, b: &[u8]) {
        match self {
            Hasher::Sha256(h) => h.update(b),
            Hasher::GitSha1(h) => h.update(b),
        }
    }

    fn finish(self) -> Digest {
        match self {
            Hasher::Sha256(h) => Digest::Sha256(h.finalize().into()),
            Hasher::GitSha1(h) => Digest::GitSha1(h.finalize().into()),
        }
    }
}

/// Why a read stopped early.
enum Stop {
    Interrupted,
    Failed(String),
}

/// Read buffers per file being read: one hashed while the next ones are read.
const DEPTH: usize = 3;

/// Read `path` whole into the hasher `want` asks for. A reader thread fills `CHUNK`-sized
/// pieces of `bufs` (aligned; topped up to `DEPTH`) ahead of the hashing, so the disk is not
/// idle while a piece is hashed. Reads bypass the page cache (O_DIRECT, as the engine reads
/// the trunk) where the filesystem allows: a 1.56 TB pass would otherwise push everything
/// else out of it. The buffers are handed back in `bufs` when the file was read whole.
fn read_digest(
    path: &Path,
    size: u64,
    want: &Digest,
    bufs: &mut Vec<AlignedBuf>,
    stop: &AtomicBool,
    on_bytes: &dyn Fn(u64),
) -> Result<Digest, Stop> {
    let f = DirectFile::open(path, true).map_err(|e| Stop::Failed(e.to_string()))?;
    if f.size() != size {
        return Err(Stop::Failed(format!(
            "{} bytes where {size} were expected (the file changed)",
            f.size()
        )));
    }
    while bufs.len() < DEPTH {
        let b = AlignedBuf::new(CHUNK)
            .map_err(|e| Stop::Failed(format!("cannot allocate a read buffer: {e}")))?;
        bufs.push(b);
    }
    type Piece = Result<(AlignedBuf, usize, usize), String>;
    let (free_tx, free_rx) = mpsc::channel::<AlignedBuf>();
    let (full_tx, full_rx) = mpsc::channel::<Piece>();
    for b in bufs.drain(..) {
        let _ = free_tx.send(b);
    }
    let f = &f;
    std::thread::scope(|sc| {
        let reader = sc.spawn(move || {
            let mut at = 0u64;
            while at < size && !stop.load(Ordering::Relaxed) {
                let Ok(mut b) = free_rx.recv() else { break };
                let len = (size - at).min(CHUNK as u64) as usize;
                let piece = f
                    .read_into(at, len, b.full_mut())
                    .map(|lead| (b, lead, len))
                    .map_err(|e| format!("read error at byte {at}: {e}"));
                let failed = piece.is_err();
                if full_tx.send(piece).is_err() || failed {
                    break;
                }
                at += len as u64;
            }
            free_rx
        });
        let mut h = Hasher::new(want, size);
        let mut done = 0u64;
        let mut result = Ok(());
        while done < size {
            if stop.load(Ordering::Relaxed) {
                result = Err(Stop::Interrupted);
                break;
            }
            match full_rx.recv() {
                Ok(Ok((b, lead, len))) => {
                    h.update(&b.full()[lead..lead + len]);
                    done += len as u64;
                    on_bytes(len as u64);
                    let _ = free_tx.send(b);
                }
                Ok(Err(e)) => {
                    result = Err(Stop::Failed(e));
                    break;
                }
                Err(_) if stop.load(Ordering::Relaxed) => {
                    result = Err(Stop::Interrupted);
                    break;
                }
                Err(_) => {
                    result = Err(Stop::Failed("the reader stopped early".into()));
                    break;
                }
            }
        }
        // the reader ends: nothing more to read, no receiver, or no buffer coming back
        drop(full_rx);
        drop(free_tx);
        if let Ok(free_rx) = reader.join() {
            bufs.extend(free_rx.try_iter());
        }
        result.map(|()| h.finish())
    })
}

/// Read every job's file in `dir` (largest first, on `opts.threads` threads) and return the
/// digests, using and updating the kept ones. `stop` (Ctrl-C) ends the pass between chunks; the
/// files finished by then are in the report and kept. `announce(files, bytes, kept)` is called
/// once before the reads: the files and bytes to read, and the files whose kept digests serve.
pub fn hash_files(
    dir: &Path,
    jobs: &[Job],
    opts: Options,
    stop: &AtomicBool,
    announce: &dyn Fn(usize, u64, usize),
) -> Report {
    let started = Instant::now();
    let kept = Mutex::new(Kept::load(dir));
    let mut outcomes: Vec<Option<Outcome>> = jobs.iter().map(|_| None).collect();
    // the files to read, with their stamps taken before reading
    let mut todo: Vec<(usize, Stamp)> = Vec::new();
    for (i, j) in jobs.iter().enumerate() {
        let path = dir.join(&j.name);
        match stamp_of(&path) {
            Ok(st) => {
                let have = if opts.reuse {
                    kept.lock().unwrap().get(&j.name, &st, &j.want)
                } else {
                    None
                };
                match have {
                    Some(d) => {
                        outcomes[i] = Some(Outcome {
                            name: j.name.clone(),
                            want: j.want,
                            got: Ok(d),
                            kept: true,
                        });
                    }
                    None => todo.push((i, st)),
                }
            }
            Err(e) => {
                outcomes[i] = Some(Outcome {
                    name: j.name.clone(),
                    want: j.want,
                    got: Err(format!("cannot stat: {e}")),
                    kept: false,
                });
            }
        }
    }
    todo.sort_by_key(|(i, _)| std::cmp::Reverse(jobs[*i].size));
    let total: u64 = todo.iter().map(|(i, _)| jobs[*i].size).sum();
    announce(
        todo.len(),
        total,
        outcomes.iter().flatten().filter(|o| o.kept).count(),
    );
    let bar = crate::bytes_bar(total, opts.progress && total > 0, "hashing");
    let next = AtomicUsize::new(0);
    let read = AtomicU64::new(0);
    let finished: Mutex<Vec<(usize, Result<Digest, String>)>> = Mutex::new(Vec::new());
    let threads = opts.threads.clamp(1, todo.len().max(1));
    std::thread::scope(|sc| {
        for _ in 0..threads {
            sc.spawn(|| {
                let mut bufs = Vec::with_capacity(DEPTH);
                loop {
                    let k = next.fetch_add(1, Ordering::Relaxed);
                    let Some((i, st)) = todo.get(k) else { break };
                    let j = &jobs[*i];
                    let on_bytes = |n: u64| {
                        bar.inc(n);
                        read.fetch_add(n, Ordering::Relaxed);
                    };
                    let r = read_digest(
                        &dir.join(&j.name),
                        j.size,
                        &j.want,
                        &mut bufs,
                        stop,
                        &on_bytes,
                    );
                    let r = match r {
                        Ok(d) => {
                            // keep it only if the file is still the one stamped before reading
                            if stamp_of(&dir.join(&j.name)).ok().as_ref() == Some(st) {
                                kept.lock().unwrap().put(&j.name, st.clone(), &d);
                            }
                            Ok(d)
                        }
                        Err(Stop::Failed(why)) => Err(why),
                        Err(Stop::Interrupted) => break,
                    };
                    finished.lock().unwrap().push((*i, r));
                }
            });
        }
    });
    bar.finish_and_clear();
    for (i, got) in finished.into_inner().unwrap() {
        outcomes[i] = Some(Outcome {
            name: jobs[i].name.clone(),
            want: jobs[i].want,
            got,
            kept: false,
        });
    }
    let unfinished = jobs
        .iter()
        .zip(&outcomes)
        .filter(|(_, o)| o.is_none())
        .map(|(j, _)| j.name.clone())
        .collect();
    let kept = kept.into_inner().unwrap();
    Report {
        outcomes: outcomes.into_iter().flatten().collect(),
        unfinished,
        bytes_read: read.into_inner(),
        seconds: started.elapsed().as_secs_f64(),
        keep_error: kept.error,
        kept_elsewhere: kept.moved,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trips_and_refuses_bad_digests() {
        let s = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
        let d = Digest::sha256_hex(s).unwrap();
        assert_eq!(d.to_string(), s);
        assert_eq!(Digest::sha256_hex(&s.to_uppercase()).unwrap(), d);
        assert!(Digest::sha256_hex(&s[..62]).is_none());
        assert!(Digest::sha256_hex(&format!("{}zz", &s[..62])).is_none());
        assert!(Digest::git_sha1_hex(s).is_none());
        assert!(Digest::git_sha1_hex("é".repeat(20).as_str()).is_none());
        let g = "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391";
        assert_eq!(Digest::git_sha1_hex(g).unwrap().to_string(), g);
    }

    /// The empty content's digests are the well-known ones: SHA-256 of nothing, and git's id
    /// of the empty blob (`git hash-object /dev/null`).
    #[test]
    fn empty_file_digests_are_the_published_constants() {
        let dir = std::env::temp_dir().join(format!("k3-digest-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("empty"), b"").unwrap();
        let jobs = [
            Job {
                name: "empty".into(),
                size: 0,
                want: Digest::sha256_hex(&"0".repeat(64)).unwrap(),
            },
            Job {
                name: "empty".into(),
                size: 0,
                want: Digest::git_sha1_hex(&"0".repeat(40)).unwrap(),
            },
        ];
        let opts = Options {
            threads: 2,
            reuse: false,
            progress: false,
        };
        let r = hash_files(&dir, &jobs, opts, &AtomicBool::new(false), &|_, _, _| {});
        let got: Vec<String> = r
            .outcomes
            .iter()
            .map(|o| o.got.as_ref().unwrap().to_string())
            .collect();
        assert_eq!(
            got,
            [
                "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
                "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391"
            ]
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
