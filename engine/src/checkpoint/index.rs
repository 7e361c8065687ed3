//! `model.safetensors.index.json`: the `weight_map` read into an [`IndexMap`], the shard
//! kinds, and the index checked against each shard header.

use super::*;

/// The index as [`Checkpoint::open`] keeps it while it reads the headers: the shard file
/// names, and each tensor name (one text, no allocation per name; a name given twice keeps
/// its last file, as a JSON object does) with its file. The released index maps ~500,000
/// names: a `BTreeMap<String, String>` of them held ~200 bytes per name through the open.
#[derive(Debug, Default)]
pub struct IndexMap {
    /// Distinct shard file names, in first-seen order.
    pub(super) files: Vec<String>,
    pub(super) names: Names,
    /// File of each name (index into `files`).
    pub(super) file_of: Vec<u32>,
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
    pub(super) fn name(&self, i: usize) -> &str {
        self.names.name(i)
    }
    /// The position of `name` and the file it maps to.
    pub(super) fn find(&self, name: &str) -> Option<(u32, &str)> {
        let i = self.names.find(name)?;
        Some((i, self.files[self.file_of[i as usize] as usize].as_str()))
    }
    /// Add `name -> files[file]`; a name already present takes the new file.
    pub(super) fn insert(&mut self, name: &str, file: u32) {
        match self.names.intern(name) {
            (i, true) => self.file_of[i as usize] = file,
            (_, false) => self.file_of.push(file),
        }
    }
}

/// The index: tensor name -> shard file name.
pub(super) fn read_index(index: &Path) -> Result<IndexMap, CheckpointError> {
    read_index_map(index).map(|(map, _)| map)
}

/// The index (tensor name -> shard file name) and its `metadata.total_size` if it states one
/// (the sum of the tensor payloads, as the HF writers record it). Used by `k3-run verify`.
pub fn read_index_with_total(index: &Path) -> Result<(IndexMap, Option<u64>), CheckpointError> {
    read_index_map(index)
}

pub(super) fn read_index_map(index: &Path) -> Result<(IndexMap, Option<u64>), CheckpointError> {
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
pub(super) enum ShardKind {
    /// A regular file (or a symlink to one).
    Regular,
    /// Nothing at all.
    Missing,
    /// Something that cannot be a shard, described ("is a directory, not a regular file").
    Other(String),
}

pub(super) fn shard_kind(path: &Path) -> ShardKind {
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
        Err(e) if crate::platform::is_symlink_loop(&e) => {
            ShardKind::Other(format!("is a symlink loop ({e})"))
        }
        Err(e) => ShardKind::Other(format!("cannot be examined ({e})")),
    }
}

/// The index and the shard header agree on which tensors live in this shard. `names` are the
/// positions in `map` of the names it maps to `file_name`; `positions` receives each header
/// entry's position in `map`.
pub(super) fn cross_check_index(
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
