//! Checkpoint directories laid out like the released Kimi K3: sharded safetensors plus
//! `model.safetensors.index.json` (or a single `model.safetensors`).
//!
//! Owns: finding the shards, reading and checking every shard header *without reading tensor
//! data*, checking the checkpoint against a [`ModelSpec`] (every declared tensor present with
//! exactly its dtype and shape, nothing unexpected), the two payload checks the spec demands
//! (E8M0 scale byte 0xFF is NaN and rejected; `A_log` padding entries must be 0), and access to
//! tensor bytes through one read-only `mmap` per shard, plus absolute file locations for the
//! O_DIRECT streaming reader and the trunk packer. Must not: decode weights beyond exact
//! widening, decide what is resident, or panic on any file content.
//!
//! Follows upstream: the HF sharded-checkpoint convention (`weight_map` name -> shard file),
//! safetensors 0.8 headers (see [`header`]), K3 names under `language_model.` (see
//! `docs/MODEL.md` §3) and docs/NUMERICS.md §3 (A_log padding, E8M0 0xFF).
//!
//! Namespace rule: every tensor must be declared by the spec unless its name starts with one of
//! the spec's `ignored_tensor_prefixes` (for K3 the manifest lists `vision_tower.` and
//! `mm_projector.`: the MoonViT tower and projector a text-only engine does not use). Ignored
//! tensors' headers are range-checked like any other, but they are not required, not bound
//! and not reported as unexpected. A shard the index names may be missing when every tensor
//! the index maps to it is ignored (a partial shard set: `--layers N` ignores the names of the
//! layers it does not bind).
//!
//! When payload checks run: `A_log` padding is always checked at open (69 tiny tensors in K3).
//! E8M0 scales are checked when they are read. A resident load reads them at open
//! ([`OpenOptions::validate_expert_scales`], the default of [`Checkpoint::open`]); the
//! streaming path opens with it off and calls [`check_e8m0`] on each expert it reads from disk
//! (or [`Checkpoint::validate_expert_scales`] when it reads through the mmap).
//!
//! The mmaps assume the files are not modified while the checkpoint is open (a file truncated
//! underneath a live mapping faults on access, as with every mmap reader).

pub mod error;
pub mod header;

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fs::File;
use std::hash::BuildHasher;
use std::path::{Path, PathBuf};

use k3_models::spec::{DType, ModelSpec, Shape, TensorDecl, TensorRole};
use memmap2::Mmap;

/// A shard name an index or manifest may point at: a file directly in the checkpoint
/// directory (not empty, no path separator, not `.` or `..`), with no control or invisible
/// character (it is shown in messages; see [`error::needs_escape`]).
pub fn is_plain_file_name(name: &str) -> bool {
    !name.is_empty()
        && !name.contains(['/', '\\'])
        && name != "."
        && name != ".."
        && !name.chars().any(error::needs_escape)
}

pub use error::CheckpointError;
pub use header::{HeaderEntry, MAX_HEADER_BYTES, ShardHeader};

/// File name of the shard index.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// File name of an unsharded checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";

/// Where one tensor's bytes live on disk (absolute file offsets).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorLocation {
    pub shard_path: PathBuf,
    pub file_offset: u64,
    pub n_bytes: u64,
}

/// One open shard.
#[derive(Debug)]
pub struct Shard {
    pub path: PathBuf,
    pub file_len: u64,
    /// Absolute offset of the data section.
    pub data_start: u64,
    mmap: Mmap,
}

/// Threads of the open-time expert scale check ([`Checkpoint::check_all_scales`]): reads at
/// queue depth 8, like the expert store's pool.
pub const SCALE_CHECK_THREADS: usize = 8;

/// Options of [`Checkpoint::open_with`].
#[derive(Clone, Copy, Debug)]
pub struct OpenOptions {
    /// Read every routed-expert `weight_scale` tensor at open and reject 0xFF bytes. Right for
    /// resident loads; the streaming path turns it off and checks each expert as it reads it.
    pub validate_expert_scales: bool,
}

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            validate_expert_scales: true,
        }
    }
}

#[derive(Clone, Debug)]
struct Entry {
    /// Relative to the shard's data section.
    begin: u64,
    end: u64,
    shape: Shape,
    shard: u32,
    /// Index into the safetensors dtypes ([`header::dtype_name`]).
    dtype: u8,
}

impl Entry {
    fn shard(&self) -> usize {
        self.shard as usize
    }
    fn dtype(&self) -> &'static str {
        header::dtype_name(self.dtype)
    }
}

/// Tensor names in one text (name `i` is `text[starts[i]..starts[i + 1]]`: no allocation
/// per name) with a hash table of positions for lookups. K3 has 497,220 tensors: a `String`
/// per name cost ~100 bytes each; a name-sorted binary search spent 1.3 s of a start-up in
/// `memcmp` at that count (the names share long prefixes).
#[derive(Debug)]
struct Names {
    text: String,
    starts: Vec<usize>,
    lookup: hashbrown::HashTable<u32>,
    hasher: hashbrown::DefaultHashBuilder,
}

impl Default for Names {
    fn default() -> Self {
        Names {
            text: String::new(),
            starts: vec![0],
            lookup: hashbrown::HashTable::new(),
            hasher: hashbrown::DefaultHashBuilder::default(),
        }
    }
}

impl Names {
    fn name(&self, i: usize) -> &str {
        &self.text[self.starts[i]..self.starts[i + 1]]
    }
    fn find(&self, name: &str) -> Option<u32> {
        let h = self.hasher.hash_one(name);
        self.lookup
            .find(h, |&j| self.name(j as usize) == name)
            .copied()
    }
    /// The position of `name`, added if new; `true` when it was already there.
    fn intern(&mut self, name: &str) -> (u32, bool) {
        let h = self.hasher.hash_one(name);
        let (text, starts, hasher) = (&self.text, &self.starts, &self.hasher);
        let name_of = |j: u32| &text[starts[j as usize]..starts[j as usize + 1]];
        match self
            .lookup
            .entry(h, |&j| name_of(j) == name, |&j| hasher.hash_one(name_of(j)))
        {
            hashbrown::hash_table::Entry::Occupied(o) => (*o.get(), true),
            hashbrown::hash_table::Entry::Vacant(v) => {
                let i = u32::try_from(starts.len() - 1).expect("invariant: fewer than 2^32 names");
                v.insert(i);
                self.text.push_str(name);
                self.starts.push(self.text.len());
                (i, false)
            }
        }
    }
}

/// No entry ([`Table::entry_of`]).
const NO_ENTRY: u32 = u32::MAX;

/// Every tensor of the checkpoint: entries in file order (shard by shard, by offset), each
/// with its name's position in `names`. With an index, `names` are the index's own (the
/// index names every tensor; a name it maps to a shard not opened has no entry), so the
/// ~500,000 names of the release are held once and looked up through the index's table.
#[derive(Debug, Default)]
struct Table {
    names: Names,
    /// Position in `names` of each entry's name.
    name_of: Vec<u32>,
    /// Entry of each name in `names` ([`NO_ENTRY`] for none).
    entry_of: Vec<u32>,
    entries: Vec<Entry>,
    /// The first name found in two entries (kept as an error, see `open_files`).
    dup: Option<u32>,
}

impl Table {
    /// Add an entry named `name`, at position `pos` in `names` if known (else interned).
    fn push(&mut self, name: &str, pos: Option<u32>, e: Entry) {
        let pos = pos.unwrap_or_else(|| self.names.intern(name).0);
        let i = u32::try_from(self.entries.len()).expect("invariant: fewer than 2^32 tensors");
        if self.entry_of.len() <= pos as usize {
            self.entry_of.resize(pos as usize + 1, NO_ENTRY);
        }
        let slot = &mut self.entry_of[pos as usize];
        if *slot == NO_ENTRY {
            *slot = i;
        } else {
            self.dup.get_or_insert(pos);
        }
        self.name_of.push(pos);
        self.entries.push(e);
    }
    fn len(&self) -> usize {
        self.entries.len()
    }
    fn name(&self, i: usize) -> &str {
        self.names.name(self.name_of[i] as usize)
    }
    fn names(&self) -> TensorNames<'_> {
        TensorNames {
            table: self,
            next: 0,
        }
    }
    /// A name given to two entries, if any.
    fn duplicate(&self) -> Option<&str> {
        self.dup.map(|p| self.names.name(p as usize))
    }
    fn get(&self, name: &str) -> Option<&Entry> {
        let pos = self.names.find(name)?;
        let &i = self.entry_of.get(pos as usize)?;
        self.entries.get(i as usize)
    }
}

/// The checkpoint's tensor names in file order ([`Checkpoint::tensor_names`]).
#[derive(Clone, Debug)]
pub struct TensorNames<'a> {
    table: &'a Table,
    next: usize,
}

impl<'a> Iterator for TensorNames<'a> {
    type Item = &'a str;
    fn next(&mut self) -> Option<&'a str> {
        let i = self.next;
        (i < self.table.len()).then(|| {
            self.next += 1;
            self.table.name(i)
        })
    }
    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = self.table.len() - self.next;
        (n, Some(n))
    }
}

impl ExactSizeIterator for TensorNames<'_> {}

/// An opened, validated checkpoint.
pub struct Checkpoint {
    dir: PathBuf,
    shards: Vec<Shard>,
    table: Table,
    /// Every routed-expert scale was checked at open ([`OpenOptions::validate_expert_scales`]).
    scales_checked: bool,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("dir", &self.dir)
            .field("n_shards", &self.shards.len())
            .field("n_tensors", &self.table.len())
            .finish()
    }
}

fn io_err(file: &Path, what: &'static str, source: std::io::Error) -> CheckpointError {
    CheckpointError::Io {
        file: file.to_path_buf(),
        what,
        source,
    }
}

/// The index as [`Checkpoint::open`] keeps it while it reads the headers: the shard file
/// names, and each tensor name (one text, no allocation per name; a name given twice keeps
/// its last file, as a JSON object does) with its file. The released index maps ~500,000
/// names: a `BTreeMap<String, String>` of them held ~200 bytes per name through the open.
#[derive(Debug, Default)]
pub struct IndexMap {
    /// Distinct shard file names, in first-seen order.
    files: Vec<String>,
    names: Names,
    /// File of each name (index into `files`).
    file_of: Vec<u32>,
}

impl IndexMap {
    /// Number of distinct names.
    pub fn len(&self) -> usize {
        self.file_of.len()
    }
    pub fn is_empty(&self) -> bool {
        self.file_of.is_empty()
    }
    /// The shard file `name` maps to.
    pub fn file(&self, name: &str) -> Option<&str> {
        self.find(name).map(|(_, f)| f)
    }
    /// Every (name, shard file), in the index's order (a name given twice at its first
    /// place, with its last file).
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        (0..self.len()).map(|i| (self.name(i), self.files[self.file_of[i] as usize].as_str()))
    }
    fn name(&self, i: usize) -> &str {
        self.names.name(i)
    }
    /// The position of `name` and the file it maps to.
    fn find(&self, name: &str) -> Option<(u32, &str)> {
        let i = self.names.find(name)?;
        Some((i, self.files[self.file_of[i as usize] as usize].as_str()))
    }
    /// Add `name -> files[file]`; a name already present takes the new file.
    fn insert(&mut self, name: &str, file: u32) {
        match self.names.intern(name) {
            (i, true) => self.file_of[i as usize] = file,
            (_, false) => self.file_of.push(file),
        }
    }
}

/// The index: tensor name -> shard file name.
fn read_index(index: &Path) -> Result<IndexMap, CheckpointError> {
    read_index_map(index).map(|(map, _)| map)
}

/// The index (tensor name -> shard file name) and its `metadata.total_size` if it states one
/// (the sum of the tensor payloads, as the HF writers record it). Used by `k3-run verify`.
pub fn read_index_with_total(index: &Path) -> Result<(IndexMap, Option<u64>), CheckpointError> {
    read_index_map(index)
}

fn read_index_map(index: &Path) -> Result<(IndexMap, Option<u64>), CheckpointError> {
    let bad = |msg: String| CheckpointError::IndexInvalid {
        file: index.to_path_buf(),
        msg,
    };
    let text = std::fs::read(index).map_err(|e| io_err(index, "read index", e))?;
    // Typed, not a `serde_json::Value`: the released index maps ~500,000 names, and a
    // sorted map built during the parse and another after it cost more than the parse. The
    // names and files are borrowed from the text where they hold no escapes.
    #[derive(serde::Deserialize)]
    struct IndexFile {
        weight_map: Option<WeightMap>,
        metadata: Option<serde_json::Value>,
    }
    /// The names and files, built during the parse (no list of them all in between), or the
    /// message for the first entry in file order whose value is not a plain file name.
    struct WeightMap(Result<IndexMap, String>);
    /// A value (or a key): `Some` string, borrowed from the text when it holds no escapes,
    /// `None` for anything else (consumed).
    struct File<'a>(Option<Cow<'a, str>>);
    struct FileVisitor;
    impl<'de> serde::de::Visitor<'de> for FileVisitor {
        type Value = File<'de>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a JSON value")
        }
        fn visit_borrowed_str<E>(self, v: &'de str) -> Result<File<'de>, E> {
            Ok(File(Some(Cow::Borrowed(v))))
        }
        fn visit_str<E>(self, v: &str) -> Result<File<'de>, E> {
            Ok(File(Some(Cow::Owned(v.to_string()))))
        }
        fn visit_string<E>(self, v: String) -> Result<File<'de>, E> {
            Ok(File(Some(Cow::Owned(v))))
        }
        fn visit_bool<E>(self, _: bool) -> Result<File<'de>, E> {
            Ok(File(None))
        }
        fn visit_i64<E>(self, _: i64) -> Result<File<'de>, E> {
            Ok(File(None))
        }
        fn visit_u64<E>(self, _: u64) -> Result<File<'de>, E> {
            Ok(File(None))
        }
        fn visit_f64<E>(self, _: f64) -> Result<File<'de>, E> {
            Ok(File(None))
        }
        fn visit_unit<E>(self) -> Result<File<'de>, E> {
            Ok(File(None))
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(
            self,
            mut seq: A,
        ) -> Result<File<'de>, A::Error> {
            while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
            Ok(File(None))
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(
            self,
            mut map: A,
        ) -> Result<File<'de>, A::Error> {
            while map
                .next_entry::<serde::de::IgnoredAny, serde::de::IgnoredAny>()?
                .is_some()
            {}
            Ok(File(None))
        }
    }
    impl<'de: 'a, 'a> serde::Deserialize<'de> for File<'a> {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            d.deserialize_any(FileVisitor)
        }
    }
    impl<'de> serde::Deserialize<'de> for WeightMap {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V;
            impl<'de> serde::de::Visitor<'de> for V {
                type Value = WeightMap;
                fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                    f.write_str("an object of tensor name -> shard file")
                }
                fn visit_map<A: serde::de::MapAccess<'de>>(
                    self,
                    mut map: A,
                ) -> Result<WeightMap, A::Error> {
                    let mut out = IndexMap::default();
                    let mut first_bad: Option<String> = None;
                    // File name -> index into `out.files`; consecutive names mostly share a
                    // file.
                    let mut file_ids: hashbrown::HashMap<String, u32> = hashbrown::HashMap::new();
                    let mut last: Option<u32> = None;
                    while let Some(File(name)) = map.next_key::<File<'de>>()? {
                        // JSON object keys are always strings
                        let name = name.ok_or_else(|| {
                            <A::Error as serde::de::Error>::custom("a key that is not a string")
                        })?;
                        // A value that is not a plain file name is refused by name once the
                        // whole text has parsed (a syntax error anywhere is reported first).
                        let File(file) = map.next_value::<File<'de>>()?;
                        if first_bad.is_some() {
                            continue;
                        }
                        let Some(file) = file else {
                            first_bad = Some(format!("weight_map[{name:?}] is not a string"));
                            continue;
                        };
                        let id = match last {
                            Some(id) if out.files[id as usize] == file => id,
                            _ => {
                                if !is_plain_file_name(&file) {
                                    first_bad = Some(format!(
                                        "weight_map[{name:?}] = {file:?} is not a plain file name in the checkpoint directory"
                                    ));
                                    continue;
                                }
                                let next = u32::try_from(out.files.len())
                                    .expect("invariant: fewer than 2^32 files");
                                let id = *file_ids.entry(file.to_string()).or_insert_with(|| {
                                    out.files.push(file.to_string());
                                    next
                                });
                                last = Some(id);
                                id
                            }
                        };
                        out.insert(&name, id);
                    }
                    Ok(WeightMap(match first_bad {
                        Some(msg) => Err(msg),
                        None => Ok(out),
                    }))
                }
            }
            d.deserialize_map(V)
        }
    }
    let text = String::from_utf8(text).map_err(|e| {
        bad(format!(
            "not UTF-8 text (byte {})",
            e.utf8_error().valid_up_to()
        ))
    })?;
    let v: IndexFile = serde_json::from_str(&text).map_err(|e| {
        // Say what is wrong in the index's terms, not the parser's.
        match serde_json::from_str::<serde_json::Value>(&text) {
            Err(syntax) => bad(syntax.to_string()),
            Ok(v)
                if !v
                    .get("weight_map")
                    .is_some_and(serde_json::Value::is_object) =>
            {
                bad("no \"weight_map\" object".into())
            }
            Ok(_) => bad(e.to_string()),
        }
    })?;
    let total = v
        .metadata
        .as_ref()
        .and_then(|m| m.get("total_size"))
        .and_then(serde_json::Value::as_u64);
    let map = v
        .weight_map
        .ok_or_else(|| bad("no \"weight_map\" object".into()))?;
    drop(text);
    let mut out = map.0.map_err(bad)?;
    out.names.text.shrink_to_fit();
    Ok((out, total))
}

/// What is at a shard path.
enum ShardKind {
    /// A regular file (or a symlink to one).
    Regular,
    /// Nothing at all.
    Missing,
    /// Something that cannot be a shard, described ("is a directory, not a regular file").
    Other(String),
}

fn shard_kind(path: &Path) -> ShardKind {
    match std::fs::metadata(path) {
        Ok(m) if m.is_file() => ShardKind::Regular,
        Ok(m) => ShardKind::Other(format!(
            "{}, not a regular file",
            describe_file_type(m.file_type())
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => match std::fs::read_link(path) {
            Ok(target) => ShardKind::Other(format!(
                "is a symlink to {}, which does not exist",
                target.display()
            )),
            Err(_) => ShardKind::Missing,
        },
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            ShardKind::Other(format!("is a symlink loop ({e})"))
        }
        Err(e) => ShardKind::Other(format!("cannot be examined ({e})")),
    }
}

pub use k3_models::load::describe_file_type;

/// `madvise(MADV_WILLNEED)` over the pages of `bytes`, a slice of a checkpoint mapping
/// ([`Checkpoint::try_bytes`]): the kernel starts reading the ones not in the page cache and
/// returns without waiting, so several tensors' reads are in flight together before the first
/// fault on them, and a fault on a page already read or in flight does not read the kernel's
/// read-around window (the device's `read_ahead_kb`, often several MiB) around it. Advice
/// only: never changes the bytes, and a refusal is ignored. Sound for any slice (on anonymous
/// memory the advice and the residency check do nothing harmful), useful only on a mapping.
pub fn advise_willneed(bytes: &[u8]) {
    if bytes.is_empty() {
        return;
    }
    // SAFETY: sysconf has no memory effects.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
        .ok()
        .filter(|p| p.is_power_of_two())
        .unwrap_or(4096);
    let addr = bytes.as_ptr() as usize;
    let start = addr & !(page - 1);
    let last = (addr + bytes.len() - 1) & !(page - 1);
    let len = addr + bytes.len() - start;
    // The advice walks every page of the range in the page cache (~50 ns a page here): when
    // the second and the second-to-last page are cached, take the tensor as read and skip it,
    // so a warm run does not pay for the walk. Not the first and last: tensors are not
    // page-aligned, and those pages are shared with the neighbours, which may have been read
    // without this one.
    let cached = |p: usize| {
        let mut v = 0u8;
        // SAFETY: `p` is a page of the mapping `bytes` lies in (see below); mincore writes one
        // byte per page of the one-page range into `v`.
        let rc = unsafe { libc::mincore(p as *mut libc::c_void, page, &mut v) };
        rc == 0 && v & 1 == 1
    };
    if last >= start + 2 * page && cached(start + page) && cached(last - page) {
        return;
    }
    // SAFETY: [start, start + len) lies inside the mapping `bytes` was taken from (mappings
    // begin on a page boundary, and `start` is `bytes`' first page); MADV_WILLNEED does not
    // change the memory's contents or validity.
    unsafe {
        libc::madvise(start as *mut libc::c_void, len, libc::MADV_WILLNEED);
    }
}

fn map_shard(header: &ShardHeader) -> Result<Mmap, CheckpointError> {
    let file = File::open(&header.path).map_err(|e| io_err(&header.path, "open shard", e))?;
    // SAFETY: the mapping is read-only and private to this process; the checkpoint contract
    // (module doc) is that shard files are not modified while open. Every slice taken from it
    // is bounds-checked against the length validated in `read_shard_header`.
    let mmap = unsafe { Mmap::map(&file) }.map_err(|e| io_err(&header.path, "mmap shard", e))?;
    if (mmap.len() as u64) < header.file_len {
        return Err(CheckpointError::Truncated {
            file: header.path.clone(),
            tensor: header
                .entries
                .last()
                .map_or_else(String::new, |e| e.name.clone()),
            expected_len: header.file_len,
            actual_len: mmap.len() as u64,
        });
    }
    Ok(mmap)
}

/// Reject any 0xFF byte in an E8M0 scale tensor read by the caller (streaming path).
pub fn check_e8m0(file: &Path, tensor: &str, bytes: &[u8]) -> Result<(), CheckpointError> {
    match e8m0_nan_at(bytes) {
        None => Ok(()),
        Some(index) => Err(CheckpointError::E8m0Nan {
            file: file.to_path_buf(),
            tensor: tensor.to_string(),
            index,
        }),
    }
}

/// Index of the first 0xFF (NaN) byte of an E8M0 scale tensor, if any. SIMD byte search: every
/// streamed expert's scales are checked on each read (k3-mini: 17.7 MB per token; a byte loop
/// took ~2% of the pinned-trunk decode's samples).
pub fn e8m0_nan_at(bytes: &[u8]) -> Option<usize> {
    memchr::memchr(0xFF, bytes)
}

fn is_scale_role(role: TensorRole) -> bool {
    matches!(
        role,
        TensorRole::ExpertW1Scale | TensorRole::ExpertW2Scale | TensorRole::ExpertW3Scale
    )
}

fn is_ignored(spec: &ModelSpec, name: &str) -> bool {
    spec.ignored_tensor_prefixes
        .iter()
        .any(|p| name.starts_with(p.as_str()))
}

impl Checkpoint {
    /// Open `dir` for a resident load: headers, spec and `A_log` checks, and every expert
    /// scale checked for 0xFF.
    pub fn open(dir: &Path, spec: &ModelSpec) -> Result<Checkpoint, CheckpointError> {
        Self::open_with(dir, spec, &OpenOptions::default())
    }

    /// Open `dir` with explicit options (see [`OpenOptions`]).
    pub fn open_with(
        dir: &Path,
        spec: &ModelSpec,
        opts: &OpenOptions,
    ) -> Result<Checkpoint, CheckpointError> {
        Self::open_files(dir, Some(spec))?.checked(spec, opts)
    }

    /// The model checks of [`Checkpoint::open_with`] on files already opened by
    /// [`Checkpoint::open_unchecked`] (which opened every shard: the same files `open_with`
    /// would open), so a caller that looked at the headers first does not parse them twice.
    pub fn checked(
        self,
        spec: &ModelSpec,
        opts: &OpenOptions,
    ) -> Result<Checkpoint, CheckpointError> {
        let mut ck = self;
        ck.check_against_spec(spec)?;
        ck.check_a_log(spec)?;
        if opts.validate_expert_scales {
            ck.check_all_scales(spec)?;
            ck.scales_checked = true;
        }
        Ok(ck)
    }

    /// Open `dir` checking only the files (index, headers, ranges), not a model. For tools
    /// that inspect a checkpoint before a spec exists.
    pub fn open_unchecked(dir: &Path) -> Result<Checkpoint, CheckpointError> {
        Self::open_files(dir, None)
    }

    /// The files of `dir`. With a spec, a shard the index names may be missing when every
    /// tensor the index maps to it is one the spec ignores (a partial shard set under
    /// `--layers N`); it is then not opened at all.
    fn open_files(dir: &Path, spec: Option<&ModelSpec>) -> Result<Checkpoint, CheckpointError> {
        let index_path = dir.join(INDEX_FILE);
        let single = dir.join(SINGLE_FILE);
        // An index (else a single file) that is there but no regular file is said so, not
        // reported as "no checkpoint".
        for p in [&index_path, &single] {
            match shard_kind(p) {
                ShardKind::Regular => break,
                ShardKind::Missing => {}
                ShardKind::Other(what) => {
                    return Err(CheckpointError::NotRegular {
                        file: p.clone(),
                        what,
                    });
                }
            }
        }
        let index = if index_path.is_file() {
            Some(read_index(&index_path)?)
        } else if single.is_file() {
            None
        } else {
            return Err(CheckpointError::NoCheckpoint {
                dir: dir.to_path_buf(),
            });
        };
        // Shard file names in sorted order, each with the tensors the index maps to it (as
        // positions in the index, in index order).
        let mut by_file: BTreeMap<&str, Vec<u32>> = BTreeMap::new();
        match &index {
            Some(map) => {
                let mut per_file: Vec<Vec<u32>> = vec![Vec::new(); map.files.len()];
                for (i, &f) in (0u32..).zip(&map.file_of) {
                    per_file[f as usize].push(i);
                }
                // A file all of whose names were mapped again to another file is not named.
                by_file.extend(
                    map.files
                        .iter()
                        .map(String::as_str)
                        .zip(per_file)
                        .filter(|(_, names)| !names.is_empty()),
                );
            }
            None => {
                by_file.insert(SINGLE_FILE, Vec::new());
            }
        }
        let name_of = |i: &u32| index.as_ref().map_or("", |m| m.name(*i as usize));
        let mut shards = Vec::with_capacity(by_file.len());
        let mut table = Table::default();
        if let Some(map) = &index {
            table.entry_of = vec![NO_ENTRY; map.len()];
            table.entries.reserve_exact(map.len());
            table.name_of.reserve_exact(map.len());
        }
        // Positions in the index of a shard's header entries.
        let mut positions: Vec<u32> = Vec::new();
        // Every shard the index names must exist before any header is judged, so an index
        // pointing at a missing file is reported as that, not as a mismatch elsewhere.
        let not_needed = |names: &[u32]| {
            spec.is_some_and(|sp| {
                !names.is_empty() && names.iter().all(|n| is_ignored(sp, name_of(n)))
            })
        };
        by_file.retain(|file_name, names| dir.join(file_name).is_file() || !not_needed(names));
        for (file_name, names) in &by_file {
            let path = dir.join(file_name);
            // The first of the shard's tensors by name.
            let tensor = names
                .iter()
                .map(name_of)
                .min()
                .map_or_else(String::new, str::to_string);
            match shard_kind(&path) {
                ShardKind::Regular => {}
                ShardKind::Missing => {
                    return Err(CheckpointError::MissingShard {
                        file: path,
                        index: index_path.clone(),
                        tensor,
                        n_tensors: names.len(),
                    });
                }
                ShardKind::Other(what) => {
                    return Err(CheckpointError::ShardNotRegular {
                        file: path,
                        index: index_path.clone(),
                        what,
                        tensor,
                        n_tensors: names.len(),
                    });
                }
            }
        }
        for (file_name, names) in &by_file {
            let path = dir.join(file_name);
            let header = header::read_shard_header(&path)?;
            positions.clear();
            if let Some(map) = &index {
                cross_check_index(&header, &index_path, map, file_name, names, &mut positions)?;
            }
            let shard_idx = shards.len();
            let mmap = map_shard(&header)?;
            shards.push(Shard {
                path,
                file_len: header.file_len,
                data_start: header.data_start,
                mmap,
            });
            let shard = u32::try_from(shard_idx).expect("invariant: fewer than 2^32 shards");
            table.entries.reserve(header.entries.len());
            for (k, e) in header.entries.iter().enumerate() {
                table.push(
                    &e.name,
                    positions.get(k).copied(),
                    Entry {
                        begin: e.begin,
                        end: e.end,
                        shape: Shape::from_slice(&e.shape),
                        shard,
                        dtype: header::dtype_id(e.dtype)
                            .expect("invariant: header entries hold canonical dtypes"),
                    },
                );
            }
        }
        // The table's names are the index's (with an index, the entries' positions are
        // positions in it); the rest of the index is freed.
        drop(by_file);
        if let Some(map) = index {
            table.names = map.names;
        }
        if let Some(dup) = table.duplicate() {
            // Only reachable with an index whose cross-check passed for two shards holding
            // the same name, which a JSON map cannot express; kept as an error, not a panic.
            let tensor = dup.to_string();
            return Err(CheckpointError::NotInIndex {
                file: table
                    .get(&tensor)
                    .map_or_else(|| dir.to_path_buf(), |e| shards[e.shard()].path.clone()),
                index: index_path,
                tensor,
            });
        }
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            shards,
            table,
            scales_checked: false,
        })
    }

    fn index_or_dir(&self) -> PathBuf {
        let idx = self.dir.join(INDEX_FILE);
        if idx.is_file() {
            idx
        } else {
            self.dir.join(SINGLE_FILE)
        }
    }

    /// Every declared tensor present with its dtype and shape; nothing undeclared. A missing
    /// tensor is reported before a wrong dtype or shape. One lookup per declared tensor (the
    /// release declares ~500,000).
    fn check_against_spec(&self, spec: &ModelSpec) -> Result<(), CheckpointError> {
        let mut missing: Vec<&TensorDecl> = Vec::new();
        let mut wrong: Option<CheckpointError> = None;
        for d in &spec.tensors {
            let Some(e) = self.table.get(&d.name) else {
                missing.push(d);
                continue;
            };
            if wrong.is_none() {
                wrong = self.wrong_dtype_or_shape(spec, d, e);
            }
        }
        if let Some(first) = missing.first() {
            return Err(CheckpointError::MissingTensor {
                file: self.index_or_dir(),
                model: spec.name.clone(),
                tensor: first.name.clone(),
                more: missing.len() - 1,
            });
        }
        if let Some(e) = wrong {
            return Err(e);
        }
        // Every declared tensor is present and names are unique, so the checkpoint holds no
        // undeclared tensor exactly when it holds as many tensors the manifest does not
        // ignore as the spec declares (ignored ones not counted): the names are only
        // compared one by one when the counts differ.
        let kept = |n: &&str| !is_ignored(spec, n);
        let declared_kept = spec
            .tensors
            .iter()
            .filter(|d| kept(&d.name.as_str()))
            .count();
        if self.table.names().filter(kept).count() == declared_kept {
            return Ok(());
        }
        let declared: hashbrown::HashSet<&str> =
            spec.tensors.iter().map(|d| d.name.as_str()).collect();
        let unexpected: Vec<&str> = self
            .table
            .names()
            .filter(|n| kept(n) && !declared.contains(n))
            .collect();
        if let Some(first) = unexpected.first() {
            return Err(CheckpointError::UnexpectedTensor {
                file: self.path_of(first),
                model: spec.name.clone(),
                tensor: first.to_string(),
                more: unexpected.len() - 1,
            });
        }
        Ok(())
    }

    /// The error for a present tensor whose dtype or shape is not the declared one.
    fn wrong_dtype_or_shape(
        &self,
        spec: &ModelSpec,
        d: &TensorDecl,
        e: &Entry,
    ) -> Option<CheckpointError> {
        let file = || self.shards[e.shard()].path.clone();
        if e.dtype() != d.dtype.as_str() {
            return Some(CheckpointError::WrongDtype {
                file: file(),
                tensor: d.name.clone(),
                expected: d.dtype.as_str().to_string(),
                found: e.dtype().to_string(),
            });
        }
        if *e.shape == *d.shape {
            return None;
        }
        Some(match (d.role, spec.kda.as_ref()) {
            (TensorRole::KdaALog, Some(k)) => CheckpointError::ALogShape {
                file: file(),
                tensor: d.name.clone(),
                expected: d.shape.to_vec(),
                found: e.shape.to_vec(),
                n_heads: k.n_heads,
            },
            _ => CheckpointError::WrongShape {
                file: file(),
                tensor: d.name.clone(),
                expected: d.shape.to_vec(),
                found: e.shape.to_vec(),
            },
        })
    }

    fn check_a_log(&self, spec: &ModelSpec) -> Result<(), CheckpointError> {
        let Some(kda) = &spec.kda else {
            return Ok(());
        };
        for d in spec
            .tensors
            .iter()
            .filter(|d| d.role == TensorRole::KdaALog)
        {
            let vals = self.f32_vec_pread(d)?;
            if let Some((index, &value)) = vals
                .iter()
                .enumerate()
                .skip(kda.n_heads)
                .find(|(_, v)| **v != 0.0)
            {
                return Err(CheckpointError::ALogPadding {
                    file: self.path_of(&d.name),
                    tensor: d.name.clone(),
                    index,
                    n_heads: kda.n_heads,
                    value,
                });
            }
        }
        Ok(())
    }

    /// A small F32 tensor read with one positional read, not through the mapping: a fault
    /// on a cold mapping reads a whole read-ahead window (8 MiB on some VMs), so checking one
    /// 1 KB tensor per layer that way read hundreds of MB at start-up.
    fn f32_vec_pread(&self, decl: &TensorDecl) -> Result<Vec<f32>, CheckpointError> {
        use std::os::unix::fs::FileExt;
        let Some(loc) = self.try_location(&decl.name) else {
            return Ok(self.f32_vec(decl)); // unreachable after check_against_spec
        };
        let io = |source| CheckpointError::Io {
            file: loc.shard_path.clone(),
            what: "A_log",
            source,
        };
        let mut b = vec![0u8; loc.n_bytes as usize];
        File::open(&loc.shard_path)
            .and_then(|f| f.read_exact_at(&mut b, loc.file_offset))
            .map_err(io)?;
        Ok(b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    /// Whether every routed-expert scale was checked at open.
    pub fn scales_checked(&self) -> bool {
        self.scales_checked
    }

    /// Check one routed-expert scale tensor held elsewhere (e.g. loaded into RAM), naming
    /// the shard it came from.
    pub fn check_scale_bytes(
        &self,
        decl: &TensorDecl,
        bytes: &[u8],
    ) -> Result<(), CheckpointError> {
        check_e8m0(&self.path_of(&decl.name), &decl.name, bytes)
    }

    /// Check every routed-expert scale of `spec` through the mmap (what `validate_expert_scales`
    /// does at open).
    ///
    /// Only the scale bytes are read, with positional reads on descriptors advised
    /// `POSIX_FADV_RANDOM`, on [`SCALE_CHECK_THREADS`] threads: through the maps every scale
    /// tensor's fault read a whole read-ahead window (8 MiB here), i.e. most of the experts,
    /// before the first token (k3-mini: 2.7 s of a 4-6 s start). The error reported is the
    /// first bad tensor in declaration order, as a sequential check would find.
    pub fn check_all_scales(&self, spec: &ModelSpec) -> Result<(), CheckpointError> {
        let decls: Vec<&TensorDecl> = spec
            .tensors
            .iter()
            .filter(|d| is_scale_role(d.role))
            .collect();
        if decls.is_empty() {
            return Ok(());
        }
        let n_threads = SCALE_CHECK_THREADS.min(decls.len());
        let next = std::sync::atomic::AtomicUsize::new(0);
        // The first error's declaration index; workers skip declarations after it.
        let first_bad = std::sync::atomic::AtomicUsize::new(usize::MAX);
        let errors: Vec<Option<(usize, CheckpointError)>> = std::thread::scope(|sc| {
            let handles: Vec<_> = (0..n_threads)
                .map(|_| {
                    sc.spawn(|| -> Option<(usize, CheckpointError)> {
                        use std::sync::atomic::Ordering::Relaxed;
                        let mut files: Vec<Option<File>> = Vec::new();
                        let mut buf = Vec::new();
                        let mut bad: Option<(usize, CheckpointError)> = None;
                        loop {
                            let i = next.fetch_add(1, Relaxed);
                            if i >= decls.len() || i > first_bad.load(Relaxed) {
                                return bad;
                            }
                            if let Err(e) = self.check_scale_pread(decls[i], &mut files, &mut buf) {
                                first_bad.fetch_min(i, Relaxed);
                                if bad.as_ref().is_none_or(|(j, _)| i < *j) {
                                    bad = Some((i, e));
                                }
                            }
                        }
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or(None))
                .collect()
        });
        match errors.into_iter().flatten().min_by_key(|(i, _)| *i) {
            Some((_, e)) => Err(e),
            None => Ok(()),
        }
    }

    /// One scale tensor read with a positional read (descriptors cached in `files`, by shard).
    fn check_scale_pread(
        &self,
        decl: &TensorDecl,
        files: &mut Vec<Option<File>>,
        buf: &mut Vec<u8>,
    ) -> Result<(), CheckpointError> {
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::FileExt;
        let e = self
            .table
            .get(&decl.name)
            .ok_or_else(|| self.unknown(&decl.name))?;
        let shard = &self.shards[e.shard()];
        let io = |source| CheckpointError::Io {
            file: shard.path.clone(),
            what: "expert scales",
            source,
        };
        if files.len() < self.shards.len() {
            files.resize_with(self.shards.len(), || None);
        }
        let f = match &mut files[e.shard()] {
            Some(f) => f,
            slot @ None => {
                let f = File::open(&shard.path).map_err(io)?;
                // SAFETY: a valid descriptor owned by `f`. Advice only: no read-ahead for
                // these small scattered reads.
                unsafe {
                    libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_RANDOM);
                }
                slot.insert(f)
            }
        };
        buf.resize((e.end - e.begin) as usize, 0);
        f.read_exact_at(buf, shard.data_start + e.begin)
            .map_err(io)?;
        check_e8m0(&shard.path, &decl.name, buf)
    }

    /// Whether `decl` is a routed-expert scale tensor.
    pub fn is_scale(decl: &TensorDecl) -> bool {
        is_scale_role(decl.role)
    }

    /// Check the three `weight_scale` tensors of one routed expert through the mmap.
    pub fn validate_expert_scales(
        &self,
        spec: &ModelSpec,
        layer: usize,
        expert: usize,
    ) -> Result<(), CheckpointError> {
        for d in spec
            .tensors
            .iter()
            .filter(|d| d.layer == Some(layer) && d.expert == Some(expert) && is_scale_role(d.role))
        {
            let bytes = self
                .try_bytes(&d.name)
                .ok_or_else(|| self.unknown(&d.name))?;
            check_e8m0(&self.path_of(&d.name), &d.name, bytes)?;
        }
        Ok(())
    }

    fn unknown(&self, name: &str) -> CheckpointError {
        CheckpointError::UnknownTensor {
            file: self.index_or_dir(),
            tensor: name.to_string(),
        }
    }

    fn path_of(&self, name: &str) -> PathBuf {
        self.table.get(name).map_or_else(
            || self.index_or_dir(),
            |e| self.shards[e.shard()].path.clone(),
        )
    }

    /// The directory this checkpoint was opened from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The shards, in file-name order.
    pub fn shards(&self) -> &[Shard] {
        &self.shards
    }

    /// Sum of the shard file sizes.
    pub fn total_file_bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.file_len).sum()
    }

    /// Sum of all tensor payloads (what the index's `metadata.total_size` counts).
    pub fn total_tensor_bytes(&self) -> u64 {
        self.table.entries.iter().map(|e| e.end - e.begin).sum()
    }

    /// Every tensor name, in file order (shard by shard, by offset).
    pub fn tensor_names(&self) -> TensorNames<'_> {
        self.table.names()
    }

    /// Header facts of a tensor: (dtype string, shape).
    pub fn info(&self, name: &str) -> Option<(&str, &[usize])> {
        self.table.get(name).map(|e| (e.dtype(), &*e.shape))
    }

    /// A cheap identity of the checkpoint's weights: FNV-1a 64 of every trunk layer's
    /// [`Checkpoint::layer_fingerprints`] and the same over the global tensors. Two checkpoints
    /// of the same shape with other weights differ here (unless they agree at every sampled
    /// byte), so a saved state made with one is not silently used with the other. `None` when
    /// a tensor is absent (a partial shard set) or a sample cannot be read.
    pub fn weights_fingerprint(&self, spec: &ModelSpec) -> Option<String> {
        let mut files = SampleFiles::default();
        let mut h = Fnv::new();
        for fp in self.layer_fingerprints_with(&mut files, spec) {
            h.eat(fp?.as_bytes());
        }
        let globals = spec
            .tensors
            .iter()
            .filter(|t| t.expert.is_none() && t.layer.is_none());
        h.eat(self.fingerprint(&mut files, globals)?.as_bytes());
        Some(h.hex())
    }

    /// A cheap identity of each layer's trunk tensors (what a packed trunk holds of that
    /// layer), in layer order: FNV-1a 64 of every tensor's name and length, then 64 bytes
    /// from the middle of the largest. One small positional read per layer with read-ahead
    /// off: sampling through the mmap would fault in whole read-ahead windows (8 MiB each on
    /// the development VM: seconds at start-up). `None` for a layer when a tensor is absent or
    /// the sample cannot be read. The tensors are grouped by layer in one pass over the spec
    /// (a pass per layer cost 93 x 500,000 steps at the release's tensor count).
    pub fn layer_fingerprints(&self, spec: &ModelSpec) -> Vec<Option<String>> {
        self.layer_fingerprints_with(&mut SampleFiles::default(), spec)
    }

    fn layer_fingerprints_with(
        &self,
        files: &mut SampleFiles,
        spec: &ModelSpec,
    ) -> Vec<Option<String>> {
        let mut by_layer: Vec<Vec<&TensorDecl>> = vec![Vec::new(); spec.n_layers];
        for t in spec.tensors.iter().filter(|t| t.expert.is_none()) {
            if let Some(v) = t.layer.and_then(|l| by_layer.get_mut(l)) {
                v.push(t);
            }
        }
        by_layer
            .into_iter()
            .map(|ts| self.fingerprint(files, ts.into_iter()))
            .collect()
    }

    fn fingerprint<'a>(
        &self,
        files: &mut SampleFiles,
        tensors: impl Iterator<Item = &'a TensorDecl>,
    ) -> Option<String> {
        let mut h = Fnv::new();
        let mut largest: Option<(u64, u64, usize)> = None; // (length, file offset, shard)
        for t in tensors {
            let e = self.table.get(&t.name)?;
            let len = e.end - e.begin;
            h.eat(t.name.as_bytes());
            h.eat(&len.to_le_bytes());
            if largest.is_none_or(|(l, _, _)| len > l) {
                largest = Some((len, self.shards[e.shard()].data_start + e.begin, e.shard()));
            }
        }
        if let Some((len, at, shard)) = largest {
            let n = len.min(64);
            let at = at + (len - n) / 2;
            let sample = files.read(&self.shards[shard].path, shard, at, n as usize)?;
            h.eat(&sample);
        }
        Some(h.hex())
    }

    /// The raw bytes of a tensor by name, `None` if the checkpoint does not hold it.
    pub fn try_bytes(&self, name: &str) -> Option<&[u8]> {
        let e = self.table.get(name)?;
        let s = &self.shards[e.shard()];
        let start = usize::try_from(s.data_start + e.begin).ok()?;
        let end = usize::try_from(s.data_start + e.end).ok()?;
        s.mmap.get(start..end)
    }

    /// The raw bytes of a declared tensor.
    ///
    /// Panics if `decl` is not in this checkpoint: [`Checkpoint::open`] verified every
    /// declaration of the spec it was given, so this only happens for a foreign declaration.
    pub fn bytes(&self, decl: &TensorDecl) -> &[u8] {
        self.try_bytes(&decl.name)
            .expect("invariant: open() verified every declared tensor is present and in range")
    }

    /// Absolute location of a tensor (for O_DIRECT readers and the trunk packer).
    pub fn try_location(&self, name: &str) -> Option<TensorLocation> {
        let e = self.table.get(name)?;
        let s = &self.shards[e.shard()];
        Some(TensorLocation {
            shard_path: s.path.clone(),
            file_offset: s.data_start + e.begin,
            n_bytes: e.end - e.begin,
        })
    }

    /// Where `name`'s bytes live as (index into [`Checkpoint::shards`], absolute file offset,
    /// length): [`Checkpoint::try_location`] without building a path, for callers that
    /// locate every routed expert (~500,000 tensors in the release).
    pub fn shard_span(&self, name: &str) -> Option<(usize, u64, u64)> {
        let e = self.table.get(name)?;
        Some((
            e.shard(),
            self.shards[e.shard()].data_start + e.begin,
            e.end - e.begin,
        ))
    }

    /// [`Checkpoint::try_location`], or a message naming the tensor and the checkpoint
    /// directory (callers wrap it in their own error type).
    pub fn locate(&self, name: &str) -> Result<TensorLocation, String> {
        self.try_location(name).ok_or_else(|| {
            format!(
                "tensor {name} is not in the checkpoint {}",
                self.dir().display()
            )
        })
    }

    /// Absolute location of a declared tensor. Panics like [`Checkpoint::bytes`].
    pub fn location(&self, decl: &TensorDecl) -> TensorLocation {
        self.try_location(&decl.name)
            .expect("invariant: open() verified every declared tensor is present")
    }

    /// The one contiguous byte range covering `decls` (in any order): all in one shard and no
    /// hole between them. The trunk packer uses this per layer; the synth guarantees it.
    pub fn contiguous_range(
        &self,
        decls: &[&TensorDecl],
    ) -> Result<TensorLocation, CheckpointError> {
        let mut es: Vec<(&str, &Entry)> = Vec::with_capacity(decls.len());
        for d in decls {
            let e = self
                .table
                .get(&d.name)
                .ok_or_else(|| self.unknown(&d.name))?;
            es.push((&d.name, e));
        }
        es.sort_by_key(|(_, e)| (e.shard, e.begin, e.end));
        let (Some(&(first_name, first)), Some(&(last_name, last))) = (es.first(), es.last()) else {
            return Err(CheckpointError::NotContiguous {
                file: self.index_or_dir(),
                tensor: String::new(),
                other: String::new(),
                msg: "empty tensor list".into(),
            });
        };
        let file = self.shards[first.shard()].path.clone();
        for w in es.windows(2) {
            let ((an, a), (bn, b)) = (w[0], w[1]);
            let msg = if a.shard != b.shard {
                Some("they are in different shards".to_string())
            } else if b.begin != a.end {
                Some(format!(
                    "hole of {} bytes between {an} and {bn}",
                    b.begin.saturating_sub(a.end)
                ))
            } else {
                None
            };
            if let Some(msg) = msg {
                return Err(CheckpointError::NotContiguous {
                    file,
                    tensor: first_name.to_string(),
                    other: last_name.to_string(),
                    msg,
                });
            }
        }
        let s = &self.shards[first.shard()];
        Ok(TensorLocation {
            shard_path: s.path.clone(),
            file_offset: s.data_start + first.begin,
            n_bytes: last.end - first.begin,
        })
    }

    /// BF16 bit patterns of a declared BF16 tensor; borrowed when the bytes are 2-aligned on
    /// a little-endian host, copied otherwise. Panics if `decl` is not BF16 (programming error).
    pub fn bf16_bits(&self, decl: &TensorDecl) -> Cow<'_, [u16]> {
        assert_eq!(
            decl.dtype,
            DType::BF16,
            "bf16_bits on non-BF16 tensor {}",
            decl.name
        );
        let b = self.bytes(decl);
        if cfg!(target_endian = "little")
            && let Ok(s) = bytemuck::try_cast_slice::<u8, u16>(b)
        {
            return Cow::Borrowed(s);
        }
        Cow::Owned(
            b.chunks_exact(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]]))
                .collect(),
        )
    }

    /// Values of a declared F32 tensor (always a copy; alignment does not matter).
    /// Panics if `decl` is not F32 (programming error).
    pub fn f32_vec(&self, decl: &TensorDecl) -> Vec<f32> {
        assert_eq!(
            decl.dtype,
            DType::F32,
            "f32_vec on non-F32 tensor {}",
            decl.name
        );
        let b = self.bytes(decl);
        if cfg!(target_endian = "little")
            && let Ok(s) = bytemuck::try_cast_slice::<u8, f32>(b)
        {
            return s.to_vec();
        }
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }
}

/// The index and the shard header agree on which tensors live in this shard. `names` are the
/// positions in `map` of the names it maps to `file_name`; `positions` receives each header
/// entry's position in `map`.
fn cross_check_index(
    header: &ShardHeader,
    index_path: &Path,
    map: &IndexMap,
    file_name: &str,
    names: &[u32],
    positions: &mut Vec<u32>,
) -> Result<(), CheckpointError> {
    positions.reserve(header.entries.len());
    for e in &header.entries {
        match map.find(&e.name) {
            Some((pos, file)) if file == file_name => positions.push(pos),
            _ => {
                return Err(CheckpointError::NotInIndex {
                    file: header.path.clone(),
                    index: index_path.to_path_buf(),
                    tensor: e.name.clone(),
                });
            }
        }
    }
    // Every header name is one of `names` (above) and the header's names are distinct
    // (`header::parse_header_json`), as are the index's: equal counts mean equal sets.
    if header.entries.len() == names.len() {
        return Ok(());
    }
    let in_shard: std::collections::HashSet<&str> =
        header.entries.iter().map(|e| e.name.as_str()).collect();
    // The first missing name by name order, as a sorted map's walk would find it.
    if let Some(n) = names
        .iter()
        .map(|&i| map.name(i as usize))
        .filter(|n| !in_shard.contains(*n))
        .min()
    {
        return Err(CheckpointError::NotInShard {
            file: header.path.clone(),
            index: index_path.to_path_buf(),
            tensor: n.to_string(),
        });
    }
    Ok(())
}

/// FNV-1a 64 (the weights fingerprints; not a checksum against tampering).
struct Fnv(u64);

impl Fnv {
    fn new() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
    fn eat(&mut self, b: &[u8]) {
        for &x in b {
            self.0 ^= u64::from(x);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    fn hex(&self) -> String {
        format!("{:016x}", self.0)
    }
}

/// Shards opened for fingerprint samples, with read-ahead off (`POSIX_FADV_RANDOM`).
#[derive(Default)]
struct SampleFiles(std::collections::HashMap<usize, std::fs::File>);

impl SampleFiles {
    fn read(&mut self, path: &Path, shard: usize, at: u64, n: usize) -> Option<Vec<u8>> {
        use std::collections::hash_map::Entry;
        use std::os::unix::fs::FileExt;
        use std::os::unix::io::AsRawFd;
        let f = match self.0.entry(shard) {
            Entry::Occupied(o) => o.into_mut(),
            Entry::Vacant(v) => {
                let f = std::fs::File::open(path).ok()?;
                // SAFETY: a valid open descriptor; advice only changes read-ahead.
                unsafe {
                    libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_RANDOM);
                }
                v.insert(f)
            }
        };
        let mut buf = vec![0u8; n];
        f.read_exact_at(&mut buf, at).ok()?;
        Some(buf)
    }
}
