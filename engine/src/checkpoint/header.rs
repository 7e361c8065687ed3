//! Safetensors shard headers, read without touching the tensor data.
//!
//! Owns: reading the 8-byte length and the JSON header of one shard with positional reads
//! (`pread`), parsing it into [`ShardHeader`] and checking it against the file: header length
//! sane, every entry well formed, every span of `data_offsets` holding exactly `dtype x shape`
//! bytes, no overlaps, nothing past the end of the file. Must not: read tensor data, know about
//! models.
//!
//! Follows upstream safetensors (format v0.8): little-endian u64 header length `n`, then `n`
//! bytes of JSON `{name: {dtype, shape, data_offsets: [begin, end)}, "__metadata__": {...}}`,
//! offsets relative to byte `8 + n`; header limit 100,000,000 bytes (`MAX_HEADER_SIZE`). The
//! JSON is parsed into our own struct (dtype as a string) rather than
//! `safetensors::tensor::Metadata`, so an unknown dtype or a bad entry is reported with the
//! tensor's name instead of failing the whole header anonymously.

use std::fs::File;
use std::path::{Path, PathBuf};

use super::error::CheckpointError;

/// Same limit as upstream safetensors `MAX_HEADER_SIZE`.
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

/// One tensor entry of a shard header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeaderEntry {
    pub name: String,
    /// The dtype's static spelling (one of the safetensors 0.8 dtypes).
    pub dtype: &'static str,
    pub shape: Vec<usize>,
    /// Offsets relative to the start of the data section.
    pub begin: u64,
    pub end: u64,
}

/// A parsed and range-checked shard header.
#[derive(Clone, Debug)]
pub struct ShardHeader {
    pub path: PathBuf,
    pub file_len: u64,
    /// Absolute file offset of the data section (`8 + n`).
    pub data_start: u64,
    /// Entries sorted by `begin` (file order).
    pub entries: Vec<HeaderEntry>,
}

/// Every safetensors 0.8 dtype with its bits per element.
const DTYPES: [(&str, u64); 22] = [
    ("BOOL", 8),
    ("F4", 4),
    ("F6_E2M3", 6),
    ("F6_E3M2", 6),
    ("U8", 8),
    ("I8", 8),
    ("F8_E5M2", 8),
    ("F8_E4M3", 8),
    ("F8_E8M0", 8),
    ("F8_E4M3FNUZ", 8),
    ("F8_E5M2FNUZ", 8),
    ("I16", 16),
    ("U16", 16),
    ("F16", 16),
    ("BF16", 16),
    ("I32", 32),
    ("U32", 32),
    ("F32", 32),
    ("I64", 64),
    ("U64", 64),
    ("F64", 64),
    ("C64", 64),
];

/// Bits per element of a safetensors dtype string.
pub fn dtype_bits(dtype: &str) -> Option<u64> {
    DTYPES.iter().find(|(n, _)| *n == dtype).map(|&(_, b)| b)
}

/// A known dtype's index in the safetensors dtype list (a one-byte per-tensor record).
pub(crate) fn dtype_id(dtype: &str) -> Option<u8> {
    DTYPES
        .iter()
        .position(|(n, _)| *n == dtype)
        .and_then(|i| u8::try_from(i).ok())
}

/// The dtype of index `id` ([`dtype_id`]); an unknown index reads as `"?"`.
pub(crate) fn dtype_name(id: u8) -> &'static str {
    DTYPES.get(usize::from(id)).map_or("?", |&(n, _)| n)
}

/// The static spelling of a known dtype (so per-tensor records need no allocation).
pub fn canonical_dtype(dtype: &str) -> Option<&'static str> {
    DTYPES.iter().find(|(n, _)| *n == dtype).map(|&(n, _)| n)
}

fn io_err(file: &Path, what: &'static str, source: std::io::Error) -> CheckpointError {
    CheckpointError::Io {
        file: file.to_path_buf(),
        what,
        source,
    }
}

/// Read and check the header of the shard at `path`.
pub fn read_shard_header(path: &Path) -> Result<ShardHeader, CheckpointError> {
    let file = File::open(path).map_err(|e| io_err(path, "open shard", e))?;
    let file_len = file
        .metadata()
        .map_err(|e| io_err(path, "stat shard", e))?
        .len();
    let limit = MAX_HEADER_BYTES;
    let bad_len = |header_len| CheckpointError::HeaderLength {
        file: path.to_path_buf(),
        header_len,
        file_len,
        limit,
    };
    if file_len < 8 {
        return Err(bad_len(0));
    }
    let mut len_bytes = [0u8; 8];
    crate::platform::read_exact_at(&file, &mut len_bytes, 0)
        .map_err(|e| io_err(path, "read header length", e))?;
    let header_len = u64::from_le_bytes(len_bytes);
    if header_len < 2 || header_len > limit || header_len > file_len - 8 {
        return Err(bad_len(header_len));
    }
    let n = usize::try_from(header_len).map_err(|_| bad_len(header_len))?;
    let mut json = vec![0u8; n];
    crate::platform::read_exact_at(&file, &mut json, 8)
        .map_err(|e| io_err(path, "read header", e))?;
    let data_start = 8 + header_len;
    let entries = parse_header_json(path, &json)?;
    let header = ShardHeader {
        path: path.to_path_buf(),
        file_len,
        data_start,
        entries,
    };
    check_ranges(&header)?;
    Ok(header)
}

/// Parse the JSON header into entries sorted by data offset.
pub fn parse_header_json(path: &Path, json: &[u8]) -> Result<Vec<HeaderEntry>, CheckpointError> {
    let json_err = |msg: String| CheckpointError::HeaderJson {
        file: path.to_path_buf(),
        msg,
    };
    // The top-level object is walked entry by entry (each entry a small JSON value checked by
    // `parse_entry`), not built into one map: a released K3 shard holds ~5,000 entries and
    // the checkpoint ~500,000, and a sorted map of them all cost more than the parse.
    // JSON text is UTF-8 (RFC 8259), also where the walk below skips (`__metadata__`).
    let json = std::str::from_utf8(json).map_err(|e| {
        json_err(format!(
            "not UTF-8 text (byte {} of the header)",
            e.valid_up_to()
        ))
    })?;
    let mut de = serde_json::Deserializer::from_str(json);
    let raw = serde::Deserializer::deserialize_any(&mut de, EntriesVisitor)
        .and_then(|r| de.end().map(|()| r))
        .map_err(|e| json_err(e.to_string()))?;
    let Some(raw) = raw else {
        return Err(json_err("top level is not a JSON object".into()));
    };
    let mut entries = Vec::with_capacity(raw.len());
    for (name, v) in raw {
        entries.push(parse_entry(path, name, v)?);
    }
    let mut seen = hashbrown::HashSet::with_capacity(entries.len());
    if let Some(e) = entries.iter().find(|e| !seen.insert(e.name.as_str())) {
        return Err(CheckpointError::HeaderEntry {
            file: path.to_path_buf(),
            tensor: e.name.clone(),
            msg: "appears twice in the header".to_string(),
        });
    }
    drop(seen);
    entries.sort_by(|a, b| (a.begin, a.end, &a.name).cmp(&(b.begin, b.end, &b.name)));
    Ok(entries)
}

/// The header's entries as (name, unparsed value) in file order, `__metadata__` skipped;
/// `None` when the top level is not an object.
struct EntriesVisitor;

impl<'de> serde::de::Visitor<'de> for EntriesVisitor {
    type Value = Option<Vec<(String, &'de serde_json::value::RawValue)>>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON object of tensor entries")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut out = Vec::with_capacity(map.size_hint().unwrap_or(0));
        while let Some(name) = map.next_key::<String>()? {
            if name == "__metadata__" {
                map.next_value::<serde::de::IgnoredAny>()?;
            } else {
                out.push((name, map.next_value::<&'de serde_json::value::RawValue>()?));
            }
        }
        Ok(Some(out))
    }

    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
        Ok(None)
    }
}

/// A well-formed entry, parsed without building a JSON tree (the common case: the release's
/// 500,000 entries). Anything else is parsed again as a tree by [`parse_entry_tree`], whose
/// messages name what is wrong.
#[derive(serde::Deserialize)]
struct TypedEntry<'a> {
    #[serde(borrow)]
    dtype: &'a str,
    shape: Vec<u64>,
    data_offsets: (u64, u64),
}

fn parse_entry(
    path: &Path,
    name: String,
    raw: &serde_json::value::RawValue,
) -> Result<HeaderEntry, CheckpointError> {
    if let Ok(t) = serde_json::from_str::<TypedEntry>(raw.get())
        && let Some(dtype) = canonical_dtype(t.dtype)
        && let Ok(shape) = t.shape.iter().map(|&d| usize::try_from(d)).collect()
    {
        return Ok(HeaderEntry {
            name,
            dtype,
            shape,
            begin: t.data_offsets.0,
            end: t.data_offsets.1,
        });
    }
    let v: serde_json::Value =
        serde_json::from_str(raw.get()).map_err(|e| CheckpointError::HeaderJson {
            file: path.to_path_buf(),
            msg: e.to_string(),
        })?;
    parse_entry_tree(path, name, &v)
}

fn parse_entry_tree(
    path: &Path,
    name: String,
    v: &serde_json::Value,
) -> Result<HeaderEntry, CheckpointError> {
    let bad = |tensor: &str, msg: &str| CheckpointError::HeaderEntry {
        file: path.to_path_buf(),
        tensor: tensor.to_string(),
        msg: msg.to_string(),
    };
    let obj = v
        .as_object()
        .ok_or_else(|| bad(&name, "entry is not an object"))?;
    let dtype_str = obj
        .get("dtype")
        .and_then(|d| d.as_str())
        .ok_or_else(|| bad(&name, "missing or non-string \"dtype\""))?;
    let dtype = canonical_dtype(dtype_str)
        .ok_or_else(|| bad(&name, &format!("unknown dtype {dtype_str:?}")))?;
    let shape_v = obj
        .get("shape")
        .and_then(|s| s.as_array())
        .ok_or_else(|| bad(&name, "missing or non-array \"shape\""))?;
    let mut shape = Vec::with_capacity(shape_v.len());
    for d in shape_v {
        let d = d
            .as_u64()
            .and_then(|d| usize::try_from(d).ok())
            .ok_or_else(|| bad(&name, "shape entry is not a non-negative integer"))?;
        shape.push(d);
    }
    let offs = obj
        .get("data_offsets")
        .and_then(|s| s.as_array())
        .ok_or_else(|| bad(&name, "missing or non-array \"data_offsets\""))?;
    let (begin, end) = match offs.as_slice() {
        [b, e] => (
            b.as_u64()
                .ok_or_else(|| bad(&name, "data_offsets[0] is not a u64"))?,
            e.as_u64()
                .ok_or_else(|| bad(&name, "data_offsets[1] is not a u64"))?,
        ),
        _ => return Err(bad(&name, "data_offsets must hold exactly two integers")),
    };
    Ok(HeaderEntry {
        name,
        dtype,
        shape,
        begin,
        end,
    })
}

/// Bytes `dtype x shape` occupies, `None` on overflow or a partial byte.
pub fn expected_bytes(dtype: &str, shape: &[usize]) -> Option<u64> {
    let bits = dtype_bits(dtype)?;
    let mut n: u64 = 1;
    for &d in shape {
        n = n.checked_mul(u64::try_from(d).ok()?)?;
    }
    let total_bits = n.checked_mul(bits)?;
    (total_bits % 8 == 0).then_some(total_bits / 8)
}

/// Every span holds `dtype x shape` bytes, no two spans overlap, and every span lies inside
/// the data section. A self-consistent header (spans contiguous from 0) whose end lies past the
/// end of the file is a truncated file; any other span past the end is a corrupt offset.
fn check_ranges(h: &ShardHeader) -> Result<(), CheckpointError> {
    let file = || h.path.clone();
    let data_len = h.file_len - h.data_start;
    for e in &h.entries {
        let want = expected_bytes(e.dtype, &e.shape);
        if e.end < e.begin || want != Some(e.end - e.begin) {
            return Err(CheckpointError::DataSize {
                file: file(),
                tensor: e.name.clone(),
                dtype: e.dtype.to_string(),
                shape: e.shape.clone(),
                begin: e.begin,
                end: e.end,
                expected_bytes: want.unwrap_or(u64::MAX),
            });
        }
    }
    let mut contiguous = true;
    let mut prev: Option<&HeaderEntry> = None;
    for e in &h.entries {
        match prev {
            None => contiguous &= e.begin == 0,
            Some(p) => {
                if e.begin < p.end {
                    return Err(CheckpointError::OffsetsOverlap {
                        file: file(),
                        tensor: e.name.clone(),
                        other: p.name.clone(),
                    });
                }
                contiguous &= e.begin == p.end;
            }
        }
        prev = Some(e);
    }
    let Some(past) = h.entries.iter().find(|e| e.end > data_len) else {
        return Ok(());
    };
    if contiguous {
        let declared_end = h.entries.last().map_or(0, |e| e.end);
        return Err(CheckpointError::Truncated {
            file: file(),
            tensor: past.name.clone(),
            expected_len: h.data_start + declared_end,
            actual_len: h.file_len,
        });
    }
    Err(CheckpointError::OffsetsOutOfRange {
        file: file(),
        tensor: past.name.clone(),
        begin: past.begin,
        end: past.end,
        data_len,
    })
}
