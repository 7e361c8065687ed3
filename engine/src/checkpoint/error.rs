//! Errors of the checkpoint reader.
//!
//! Owns: [`CheckpointError`], one variant per way a checkpoint directory can be bad. Every
//! message names the file (shard, index or directory) and, where one exists, the tensor; a
//! header that is not JSON at all has no tensor to name and says `header` instead. Must not:
//! carry anything that needs the checkpoint to stay open (errors outlive it).

use std::path::PathBuf;

/// A tensor name as an error message shows it: as written when every character prints as
/// itself, else quoted with escapes (names come from the checkpoint's own JSON: a `\u0000`,
/// an escape sequence or a right-to-left override in one must not reach the terminal raw).
pub struct Shown<'a>(pub &'a str);

/// `true` when `Debug` would escape `c` for a reason other than quoting (`\`, `"`, `'`):
/// control characters and the invisible or layout-changing ones (U+202E, U+200B, U+2028, ...).
pub fn needs_escape(c: char) -> bool {
    !matches!(c, '\\' | '"' | '\'') && c.escape_debug().next() == Some('\\')
}

impl std::fmt::Display for Shown<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0.chars().any(needs_escape) {
            write!(f, "{:?}", self.0)
        } else {
            f.write_str(self.0)
        }
    }
}

/// Why a checkpoint cannot be opened or a tensor cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// The directory holds neither `model.safetensors.index.json` nor `model.safetensors`.
    #[error(
        "{}: no checkpoint: neither model.safetensors.index.json nor model.safetensors is present",
        dir.display()
    )]
    NoCheckpoint { dir: PathBuf },

    /// `model.safetensors.index.json` or `model.safetensors` exists but is no regular file.
    #[error("{}: {what}", file.display())]
    NotRegular { file: PathBuf, what: String },

    /// An operating-system error reading a file.
    #[error("{}: cannot read ({what}): {source}", file.display())]
    Io {
        file: PathBuf,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },

    /// `model.safetensors.index.json` is not the expected JSON shape.
    #[error("{}: invalid index: {msg}", file.display())]
    IndexInvalid { file: PathBuf, msg: String },

    /// The index maps tensors to a shard file that does not exist (nothing at the path).
    #[error(
        "{}: shard file is missing; the index {} maps {n_tensors} tensor(s) to it, e.g. tensor {tensor}",
        file.display(), index.display(), tensor = Shown(.tensor)
    )]
    MissingShard {
        file: PathBuf,
        index: PathBuf,
        tensor: String,
        n_tensors: usize,
    },

    /// The index maps tensors to a path that exists but is no regular file (a directory, a
    /// device, a FIFO, a symlink loop or a symlink to nothing) or cannot be examined.
    #[error(
        "{}: shard {what}; the index {} maps {n_tensors} tensor(s) to it, e.g. tensor {tensor}",
        file.display(), index.display(), tensor = Shown(.tensor)
    )]
    ShardNotRegular {
        file: PathBuf,
        index: PathBuf,
        /// What the path is, e.g. "is a directory, not a regular file".
        what: String,
        tensor: String,
        n_tensors: usize,
    },

    /// The 8-byte header length is absurd: larger than the limit or than the file.
    #[error(
        "{}: header length {header_len} bytes is not sane (file is {file_len} bytes, limit {limit}); \
         corrupted header or not a safetensors file",
        file.display()
    )]
    HeaderLength {
        file: PathBuf,
        header_len: u64,
        file_len: u64,
        limit: u64,
    },

    /// The header bytes are not a JSON object (or not UTF-8).
    #[error("{}: header (no tensor can be named) is not valid safetensors JSON: {msg}", file.display())]
    HeaderJson { file: PathBuf, msg: String },

    /// One header entry is malformed (dtype unknown, shape or data_offsets not integers, ...).
    #[error("{}: header entry for tensor {tensor} is malformed: {msg}", file.display(), tensor = Shown(.tensor))]
    HeaderEntry {
        file: PathBuf,
        tensor: String,
        msg: String,
    },

    /// A tensor's `data_offsets` span does not hold `dtype x shape` bytes.
    #[error(
        "{}: tensor {tensor}: data_offsets [{begin}, {end}) do not match its dtype and shape \
         ({dtype} {shape:?} needs {expected_bytes} bytes)",
        file.display(), tensor = Shown(.tensor)
    )]
    DataSize {
        file: PathBuf,
        tensor: String,
        dtype: String,
        shape: Vec<usize>,
        begin: u64,
        end: u64,
        expected_bytes: u64,
    },

    /// A tensor's `data_offsets` point outside the file's data section (and the header's
    /// offsets are not one contiguous run, so this is a corrupt offset, not a short file).
    #[error(
        "{}: tensor {tensor}: data_offsets [{begin}, {end}) are out of range: the data section \
         holds {data_len} bytes",
        file.display(), tensor = Shown(.tensor)
    )]
    OffsetsOutOfRange {
        file: PathBuf,
        tensor: String,
        begin: u64,
        end: u64,
        data_len: u64,
    },

    /// Two tensors claim the same bytes.
    #[error("{}: tensors {tensor} and {other} overlap in the data section", file.display(), tensor = Shown(.tensor), other = Shown(.other))]
    OffsetsOverlap {
        file: PathBuf,
        tensor: String,
        other: String,
    },

    /// The file is shorter than its (self-consistent) header says: an interrupted download/copy.
    #[error(
        "{}: truncated shard: the header describes {expected_len} bytes but the file has \
         {actual_len}; tensor {tensor} is cut off",
        file.display(), tensor = Shown(.tensor)
    )]
    Truncated {
        file: PathBuf,
        tensor: String,
        expected_len: u64,
        actual_len: u64,
    },

    /// A shard holds a tensor the index does not map to it.
    #[error(
        "{}: tensor {tensor} is in this shard but the index {} does not map it here",
        file.display(), index.display(), tensor = Shown(.tensor)
    )]
    NotInIndex {
        file: PathBuf,
        index: PathBuf,
        tensor: String,
    },

    /// The index maps a tensor to a shard whose header does not contain it.
    #[error(
        "{}: tensor {tensor} is mapped to this shard by the index {} but the shard does not contain it",
        file.display(), index.display(), tensor = Shown(.tensor)
    )]
    NotInShard {
        file: PathBuf,
        index: PathBuf,
        tensor: String,
    },

    /// A tensor the model needs is absent from every shard.
    #[error(
        "{}: tensor {tensor} required by model {model} is missing ({more} more missing)",
        file.display(), tensor = Shown(.tensor)
    )]
    MissingTensor {
        file: PathBuf,
        model: String,
        tensor: String,
        more: usize,
    },

    /// A tensor under the model's namespace that the model does not declare.
    #[error(
        "{}: unexpected tensor {tensor}: not part of model {model} ({more} more unexpected)",
        file.display(), tensor = Shown(.tensor)
    )]
    UnexpectedTensor {
        file: PathBuf,
        model: String,
        tensor: String,
        more: usize,
    },

    /// Stored dtype differs from the declared one.
    #[error("{}: tensor {tensor} has dtype {found}, the model declares {expected}", file.display(), tensor = Shown(.tensor))]
    WrongDtype {
        file: PathBuf,
        tensor: String,
        expected: String,
        found: String,
    },

    /// Stored shape differs from the declared one.
    #[error("{}: tensor {tensor} has shape {found:?}, the model declares {expected:?}", file.display(), tensor = Shown(.tensor))]
    WrongShape {
        file: PathBuf,
        tensor: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },

    /// A KDA `A_log` stored with fewer entries than heads, or in another layout.
    #[error(
        "{}: tensor {tensor} has shape {found:?}: A_log needs one entry per KDA head \
         (linear_attn_config.num_heads = {n_heads}), zero padding after them allowed, \
         stored like {expected:?}",
        file.display(), tensor = Shown(.tensor)
    )]
    ALogShape {
        file: PathBuf,
        tensor: String,
        expected: Vec<usize>,
        found: Vec<usize>,
        n_heads: usize,
    },

    /// An E8M0 scale byte is 0xFF (NaN in OCP MX v1.0).
    #[error(
        "{}: tensor {tensor}: E8M0 scale byte 0xFF (NaN) at element {index}; rejected",
        file.display(), tensor = Shown(.tensor)
    )]
    E8m0Nan {
        file: PathBuf,
        tensor: String,
        index: usize,
    },

    /// A KDA `A_log` padding entry (index >= n_heads) is not zero.
    #[error(
        "{}: tensor {tensor}: A_log padding entry {index} (n_heads = {n_heads}) is {value}, must be 0",
        file.display(), tensor = Shown(.tensor)
    )]
    ALogPadding {
        file: PathBuf,
        tensor: String,
        index: usize,
        n_heads: usize,
        value: f32,
    },

    /// A range of tensors that must be contiguous in one shard is not.
    #[error("{}: tensors {tensor} .. {other} are not one contiguous range: {msg}", file.display(), tensor = Shown(.tensor), other = Shown(.other))]
    NotContiguous {
        file: PathBuf,
        tensor: String,
        other: String,
        msg: String,
    },

    /// A tensor was requested that this checkpoint does not hold.
    #[error("{}: tensor {tensor} is not in this checkpoint", file.display(), tensor = Shown(.tensor))]
    UnknownTensor { file: PathBuf, tensor: String },
}
