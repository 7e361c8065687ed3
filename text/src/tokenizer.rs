//! Kimi K3 tokenizer: `tiktoken.model` byte-level BPE, Kimi's pre-tokenizer regex and the
//! 256 reserved special ids, with K3's splitting rules for long inputs.
//!
//! Owns: loading and validating `tiktoken.model` + `tokenizer_config.json`, encoding text
//! (specials as plain text, or specials recognised), decoding ids to bytes, and a streaming
//! decoder that only emits text once a UTF-8 character is complete.
//!
//! Must not: know about chat structure (that is [`crate::chat`]), hard-code any K3 id (every
//! special id is derived from the files: the first special id is the number of BPE ranks),
//! or panic on any input.
//!
//! Follows upstream `tokenization_kimi.py` (`TikTokenTokenizer`):
//! - ranks from `tiktoken.model` (`<base64 token> <rank>` per line, as tiktoken's
//!   `load_tiktoken_bpe`), specials at ids `n_ranks .. n_ranks + 256`, named from
//!   `added_tokens_decoder`, unnamed ones `<|reserved_token_{id}|>`;
//! - the pre-tokenizer pattern [`KIMI_PAT_STR`] run by `fancy-regex` (the engine Python
//!   tiktoken uses too, so the splits agree by construction);
//! - every encode splits its input into windows of at most 400,000 characters, then each
//!   window into slices with at most 25,000 consecutive whitespace or non-whitespace
//!   characters (whitespace = Python `str.isspace`), and encodes each slice independently.
//!   That upstream rule is also what keeps fancy-regex inside its backtracking limit: a
//!   1,000,000-space string becomes 40 slices of 25,000 spaces. Any regex error that still
//!   happens is returned as [`TokenizerError::Encode`], never a panic.
//!
//! Invalid UTF-8 policy: Rust `&str` input is always valid. Byte input (a prompt file) goes
//! through [`Tokenizer::encode_bytes`], which rejects invalid UTF-8 with an error naming the
//! source and byte offset; [`Tokenizer::encode_bytes_lossy`] is the explicit opt-in that
//! replaces each maximal invalid subsequence by U+FFFD (the same result as Python's
//! `bytes.decode("utf-8", "replace")`).

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use base64::Engine as _;
use rustc_hash::FxHashMap;
use tiktoken_rs::CoreBPE;

/// Kimi's pre-tokenizer pattern (`TikTokenTokenizer.pat_str`), alternatives joined by `|`.
pub const KIMI_PAT_STR: &str = concat!(
    r"[\p{Han}]+",
    "|",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    "|",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    "|",
    r"\p{N}{1,3}",
    "|",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    "|",
    r"\s*[\r\n]+",
    "|",
    r"\s+(?!\S)",
    "|",
    r"\s+",
);

/// Number of reserved special ids after the BPE ranks (`num_reserved_special_tokens`).
pub const NUM_RESERVED_SPECIAL_TOKENS: u32 = 256;
/// Upstream `TIKTOKEN_MAX_ENCODE_CHARS`: encode windows of at most this many characters.
pub const MAX_WINDOW_CHARS: usize = 400_000;
/// Upstream `MAX_NO_WHITESPACES_CHARS`: at most this many consecutive whitespace or
/// non-whitespace characters per independently encoded slice.
pub const MAX_RUN_CHARS: usize = 25_000;

/// File names inside a tokenizer directory (`--tok DIR`).
pub const MODEL_FILE: &str = "tiktoken.model";
/// See [`MODEL_FILE`].
pub const CONFIG_FILE: &str = "tokenizer_config.json";

/// Errors from loading or using a [`Tokenizer`].
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}:{line}: {msg}", path.display())]
    VocabLine {
        path: PathBuf,
        line: usize,
        msg: String,
    },
    #[error("{}: {msg}", path.display())]
    Vocab { path: PathBuf, msg: String },
    #[error("{}: {msg}", path.display())]
    Config { path: PathBuf, msg: String },
    #[error("building the BPE for {}: {msg}", path.display())]
    Bpe { path: PathBuf, msg: String },
    #[error("tokenizing a {len}-byte slice failed: {msg}")]
    Encode { len: usize, msg: String },
    #[error("{source_name}: invalid UTF-8 at byte offset {offset}")]
    InvalidUtf8 { source_name: String, offset: usize },
    #[error("token id {id} is outside the vocabulary (size {vocab_size})")]
    UnknownId { id: u32, vocab_size: usize },
}

/// A loaded Kimi tokenizer. Cheap to share by reference across threads.
pub struct Tokenizer {
    bpe: CoreBPE,
    /// Bytes of every id: ranks first, then the special names' UTF-8.
    id_bytes: Vec<Vec<u8>>,
    num_ranks: u32,
    /// Special names, index = id - num_ranks.
    special_names: Vec<String>,
    special_ids: FxHashMap<String, u32>,
    dir: PathBuf,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("dir", &self.dir)
            .field("num_ranks", &self.num_ranks)
            .field("vocab_size", &self.vocab_size())
            .finish()
    }
}

impl Tokenizer {
    /// Load `DIR/tiktoken.model` and `DIR/tokenizer_config.json`.
    pub fn load(dir: &Path) -> Result<Self, TokenizerError> {
        Self::load_files(&dir.join(MODEL_FILE), &dir.join(CONFIG_FILE))
    }

    /// Load from explicit file paths (same rules as [`Tokenizer::load`]).
    pub fn load_files(model_path: &Path, config_path: &Path) -> Result<Self, TokenizerError> {
        let model_bytes = crate::read_regular(model_path).map_err(|source| TokenizerError::Io {
            path: model_path.to_path_buf(),
            source,
        })?;
        let config_bytes =
            crate::read_regular(config_path).map_err(|source| TokenizerError::Io {
                path: config_path.to_path_buf(),
                source,
            })?;
        let ranks = parse_tiktoken_model(&model_bytes, model_path)?;
        let num_ranks = ranks.len() as u32;
        let names = parse_added_tokens(&config_bytes, config_path, num_ranks)?;
        Self::from_parts(ranks, names, model_path)
    }

    fn from_parts(
        ranks: Vec<Vec<u8>>,
        special_names: Vec<String>,
        model_path: &Path,
    ) -> Result<Self, TokenizerError> {
        let num_ranks = ranks.len() as u32;
        let mut encoder: FxHashMap<Vec<u8>, u32> = FxHashMap::default();
        encoder.reserve(ranks.len());
        for (rank, bytes) in ranks.iter().enumerate() {
            encoder.insert(bytes.clone(), rank as u32);
        }
        let mut special_ids: FxHashMap<String, u32> = FxHashMap::default();
        for (i, name) in special_names.iter().enumerate() {
            special_ids.insert(name.clone(), num_ranks + i as u32);
        }
        let bpe = CoreBPE::new(encoder, special_ids.clone(), KIMI_PAT_STR).map_err(|e| {
            TokenizerError::Bpe {
                path: model_path.to_path_buf(),
                msg: e.to_string(),
            }
        })?;
        let mut id_bytes = ranks;
        id_bytes.extend(special_names.iter().map(|n| n.as_bytes().to_vec()));
        Ok(Self {
            bpe,
            id_bytes,
            num_ranks,
            special_names,
            special_ids,
            dir: model_path
                .parent()
                .map(Path::to_path_buf)
                .unwrap_or_default(),
        })
    }

    /// Total number of ids: BPE ranks + 256 reserved specials.
    pub fn vocab_size(&self) -> usize {
        self.id_bytes.len()
    }

    /// Number of BPE ranks = the first special id.
    pub fn num_ranks(&self) -> u32 {
        self.num_ranks
    }

    /// Id of a special token by name (e.g. `"<|end_of_msg|>"`, `"<|reserved_token_163590|>"`).
    pub fn id_of(&self, special_name: &str) -> Option<u32> {
        self.special_ids.get(special_name).copied()
    }

    /// Name of a special id, `None` for BPE ranks and out-of-range ids.
    pub fn special_name(&self, id: u32) -> Option<&str> {
        id.checked_sub(self.num_ranks)
            .and_then(|i| self.special_names.get(i as usize))
            .map(String::as_str)
    }

    /// True for the 256 reserved special ids.
    pub fn is_special(&self, id: u32) -> bool {
        self.special_name(id).is_some()
    }

    /// Encode text with every special-token name treated as ordinary text
    /// (upstream `allow_special_tokens=False`, i.e. tiktoken `disallowed_special=()`).
    /// Literal `<|open|>` typed by a user becomes ordinary BPE ids here.
    pub fn encode_text(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        self.encode_impl(text, false)
    }

    /// Encode text recognising every special-token name as its id
    /// (upstream `allow_special_tokens=True`, i.e. tiktoken `allowed_special="all"`).
    pub fn encode_with_specials(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        self.encode_impl(text, true)
    }

    /// Encode raw bytes (e.g. a prompt file) as plain text. Invalid UTF-8 is rejected with
    /// an error naming `source_name` and the byte offset of the first invalid sequence.
    pub fn encode_bytes(
        &self,
        bytes: &[u8],
        source_name: &str,
    ) -> Result<Vec<u32>, TokenizerError> {
        let text = std::str::from_utf8(bytes).map_err(|e| TokenizerError::InvalidUtf8 {
            source_name: source_name.to_string(),
            offset: e.valid_up_to(),
        })?;
        self.encode_text(text)
    }

    /// Encode raw bytes as plain text, replacing each maximal invalid UTF-8 subsequence by
    /// U+FFFD first (Python `bytes.decode("utf-8", "replace")`).
    pub fn encode_bytes_lossy(&self, bytes: &[u8]) -> Result<Vec<u32>, TokenizerError> {
        self.encode_text(&String::from_utf8_lossy(bytes))
    }

    fn encode_impl(&self, text: &str, allow_special: bool) -> Result<Vec<u32>, TokenizerError> {
        let allowed: HashSet<&str> = if allow_special {
            self.special_names.iter().map(String::as_str).collect()
        } else {
            HashSet::new()
        };
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        for window in char_windows(text, MAX_WINDOW_CHARS) {
            for slice in split_whitespace_runs(window, MAX_RUN_CHARS) {
                let (ids, _) =
                    self.bpe
                        .encode(slice, &allowed)
                        .map_err(|e| TokenizerError::Encode {
                            len: slice.len(),
                            msg: e.message,
                        })?;
                out.extend(ids);
            }
        }
        Ok(out)
    }

    /// Bytes of one id (a special id gives its name's UTF-8).
    pub fn token_bytes(&self, id: u32) -> Result<&[u8], TokenizerError> {
        self.id_bytes
            .get(id as usize)
            .map(Vec::as_slice)
            .ok_or(TokenizerError::UnknownId {
                id,
                vocab_size: self.id_bytes.len(),
            })
    }

    /// Concatenated bytes of `ids` (specials as their names). Not necessarily valid UTF-8.
    pub fn decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>, TokenizerError> {
        let mut out = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            out.extend_from_slice(self.token_bytes(id)?);
        }
        Ok(out)
    }

    /// Decode to a string, replacing invalid UTF-8 by U+FFFD.
    pub fn decode_lossy(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        Ok(String::from_utf8_lossy(&self.decode_bytes(ids)?).into_owned())
    }

    /// A fresh streaming decoder (see [`Decoder`]).
    pub fn decoder(&self) -> Decoder {
        Decoder::default()
    }
}

/// Streaming decoder: feed ids one at a time, get text as soon as it is complete UTF-8.
///
/// A token may end inside a multi-byte character; those bytes are held back until the
/// character completes. Bytes that can never become valid UTF-8 are emitted as U+FFFD, so
/// the concatenation of everything emitted (including [`Decoder::finish`]) equals
/// `String::from_utf8_lossy` of all the bytes.
#[derive(Debug, Default, Clone)]
pub struct Decoder {
    pending: Vec<u8>,
}

impl Decoder {
    /// Feed one id; returns the newly completed text (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String, TokenizerError> {
        let bytes = tok.token_bytes(id)?;
        Ok(self.push_bytes(bytes))
    }

    /// Feed raw bytes; returns the newly completed text (possibly empty).
    pub fn push_bytes(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let mut start = 0;
        loop {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(s) => {
                    out.push_str(s);
                    start = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    out.push_str(
                        std::str::from_utf8(&self.pending[start..start + valid])
                            .expect("from_utf8 reported this prefix as valid"),
                    );
                    match e.error_len() {
                        // Incomplete character at the end: keep it for the next push.
                        None => {
                            start += valid;
                            break;
                        }
                        Some(n) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            start += valid + n;
                        }
                    }
                }
            }
        }
        self.pending.drain(..start);
        out
    }

    /// True when bytes of an unfinished character are held back.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Flush: held-back bytes of an unfinished character become U+FFFD.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}

/// Python `str.isspace` for one character: Unicode bidi class WS, B or S, or category Zs.
/// That is Rust's `char::is_whitespace` (the White_Space property) plus U+001C..U+001F.
pub fn python_isspace(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Python `str.strip()` with no arguments (strips [`python_isspace`] characters).
pub fn python_strip(s: &str) -> &str {
    s.trim_matches(python_isspace)
}

/// Split `text` into consecutive windows of at most `max_chars` characters
/// (upstream `s[i:i + TIKTOKEN_MAX_ENCODE_CHARS]`). Empty input gives no window.
pub fn char_windows(text: &str, max_chars: usize) -> Vec<&str> {
    let max_chars = max_chars.max(1);
    let mut out = Vec::new();
    let mut start = 0;
    let mut count = 0;
    for (i, _) in text.char_indices() {
        if count == max_chars {
            out.push(&text[start..i]);
            start = i;
            count = 0;
        }
        count += 1;
    }
    if start < text.len() {
        out.push(&text[start..]);
    }
    out
}

/// Upstream `_split_whitespaces_or_nonwhitespaces`: cut `s` so that no slice holds more
/// than `max_run` consecutive whitespace (Python `str.isspace`) or non-whitespace
/// characters. A run longer than `max_run` is cut every `max_run` characters; nothing
/// else is cut. Returns `[s]` when no run is too long (including `[""]` for empty input,
/// as upstream yields the empty tail).
pub fn split_whitespace_runs(s: &str, max_run: usize) -> Vec<&str> {
    let max_run = max_run.max(1);
    let mut out = Vec::new();
    let mut run_len = 0usize;
    let mut run_is_space = s.chars().next().is_some_and(python_isspace);
    let mut slice_start = 0usize;
    for (i, c) in s.char_indices() {
        let is_space = python_isspace(c);
        if run_is_space != is_space {
            run_len = 1;
            run_is_space = is_space;
        } else {
            run_len += 1;
            if run_len > max_run {
                out.push(&s[slice_start..i]);
                slice_start = i;
                run_len = 1;
            }
        }
    }
    out.push(&s[slice_start..]);
    out
}

/// Parse `tiktoken.model`: one `<base64 token> <rank>` per line, blank lines skipped
/// (tiktoken `load_tiktoken_bpe`). Validates: two fields per line, base64, decimal rank,
/// unique ranks and token bytes, ranks exactly `0..n` (so the first special id `n` cannot
/// collide with a rank), and all 256 single bytes present. Returns bytes indexed by rank.
pub fn parse_tiktoken_model(data: &[u8], path: &Path) -> Result<Vec<Vec<u8>>, TokenizerError> {
    let line_err = |line: usize, msg: String| TokenizerError::VocabLine {
        path: path.to_path_buf(),
        line,
        msg,
    };
    let text = std::str::from_utf8(data).map_err(|e| TokenizerError::Vocab {
        path: path.to_path_buf(),
        msg: format!("not UTF-8 text (byte offset {})", e.valid_up_to()),
    })?;
    let mut entries: Vec<(u32, Vec<u8>, usize)> = Vec::new();
    for (idx, raw_line) in text.split('\n').enumerate() {
        let line_no = idx + 1;
        let line = raw_line.strip_suffix('\r').unwrap_or(raw_line);
        if line.is_empty() {
            continue;
        }
        let mut fields = line.split_ascii_whitespace();
        let (Some(b64), Some(rank), None) = (fields.next(), fields.next(), fields.next()) else {
            return Err(line_err(
                line_no,
                "expected `<base64 token> <rank>` (two fields)".to_string(),
            ));
        };
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .map_err(|e| line_err(line_no, format!("bad base64 token {b64:?}: {e}")))?;
        if bytes.is_empty() {
            return Err(line_err(line_no, "empty token".to_string()));
        }
        let rank: u32 = rank.parse().map_err(|_| {
            line_err(
                line_no,
                format!("bad rank {rank:?} (expected a decimal u32)"),
            )
        })?;
        entries.push((rank, bytes, line_no));
    }
    let n = entries.len();
    if n == 0 {
        return Err(TokenizerError::Vocab {
            path: path.to_path_buf(),
            msg: "no ranks".to_string(),
        });
    }
    let mut by_rank: Vec<Option<(Vec<u8>, usize)>> = vec![None; n];
    let mut seen_bytes: FxHashMap<&[u8], usize> = FxHashMap::default();
    for (rank, bytes, line_no) in &entries {
        if let Some(first) = seen_bytes.insert(bytes.as_slice(), *line_no) {
            return Err(line_err(
                *line_no,
                format!("token bytes {bytes:?} already defined on line {first}"),
            ));
        }
        let slot = by_rank.get_mut(*rank as usize).ok_or_else(|| {
            line_err(
                *line_no,
                format!("rank {rank} out of range: {n} ranks must be exactly 0..{n}"),
            )
        })?;
        if let Some((_, first)) = slot {
            return Err(line_err(
                *line_no,
                format!("duplicate rank {rank} (first on line {first})"),
            ));
        }
        *slot = Some((bytes.clone(), *line_no));
    }
    let ranks: Vec<Vec<u8>> = by_rank
        .into_iter()
        .map(|e| e.map(|(b, _)| b).unwrap_or_default())
        .collect();
    // Unique ranks all < n means every slot is filled; check the single bytes.
    let missing: Vec<String> = (0u8..=255)
        .filter(|b| !seen_bytes.contains_key([*b].as_slice()))
        .map(|b| format!("0x{b:02x}"))
        .collect();
    if !missing.is_empty() {
        return Err(TokenizerError::Vocab {
            path: path.to_path_buf(),
            msg: format!(
                "{} of the 256 single-byte tokens are missing (first: {})",
                missing.len(),
                missing[0]
            ),
        });
    }
    Ok(ranks)
}

/// Read `added_tokens_decoder` from `tokenizer_config.json` and name the 256 reserved ids
/// `num_ranks .. num_ranks + 256`; unnamed ids get `<|reserved_token_{id}|>`. Entries
/// outside that range are ignored, as upstream does. Names must be unique.
pub fn parse_added_tokens(
    data: &[u8],
    path: &Path,
    num_ranks: u32,
) -> Result<Vec<String>, TokenizerError> {
    let cfg_err = |msg: String| TokenizerError::Config {
        path: path.to_path_buf(),
        msg,
    };
    let value: serde_json::Value =
        serde_json::from_slice(data).map_err(|e| cfg_err(format!("invalid JSON: {e}")))?;
    let mut names: Vec<Option<String>> = vec![None; NUM_RESERVED_SPECIAL_TOKENS as usize];
    match value.get("added_tokens_decoder") {
        None | Some(serde_json::Value::Null) => {}
        Some(serde_json::Value::Object(map)) => {
            for (key, entry) in map {
                let id: u32 = key.parse().map_err(|_| {
                    cfg_err(format!(
                        "added_tokens_decoder key {key:?} is not a token id"
                    ))
                })?;
                let content = entry
                    .get("content")
                    .and_then(serde_json::Value::as_str)
                    .ok_or_else(|| {
                        cfg_err(format!(
                            "added_tokens_decoder[{key:?}].content is missing or not a string"
                        ))
                    })?;
                if let Some(slot) = id
                    .checked_sub(num_ranks)
                    .and_then(|i| names.get_mut(i as usize))
                {
                    *slot = Some(content.to_string());
                }
            }
        }
        Some(_) => return Err(cfg_err("added_tokens_decoder is not an object".to_string())),
    }
    let names: Vec<String> = names
        .into_iter()
        .enumerate()
        .map(|(i, n)| n.unwrap_or_else(|| format!("<|reserved_token_{}|>", num_ranks as usize + i)))
        .collect();
    let mut seen: FxHashMap<&str, usize> = FxHashMap::default();
    for (i, name) in names.iter().enumerate() {
        if name.is_empty() {
            return Err(cfg_err(format!(
                "special token id {} has an empty name",
                num_ranks as usize + i
            )));
        }
        if let Some(first) = seen.insert(name.as_str(), i) {
            return Err(cfg_err(format!(
                "special token name {name:?} is used by ids {} and {}",
                num_ranks as usize + first,
                num_ranks as usize + i
            )));
        }
    }
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokenizer_and_decoder_are_shareable_across_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Tokenizer>();
        assert_send_sync::<Decoder>();
    }

    #[test]
    fn isspace_matches_python_definition_on_known_points() {
        for c in [
            '\t', '\n', '\x0b', '\x0c', '\r', '\x1c', '\x1f', ' ', '\u{85}', '\u{a0}',
        ] {
            assert!(python_isspace(c), "{c:?}");
        }
        for c in ['a', '\x1b', '\u{200b}', '\u{180e}', '\u{feff}'] {
            assert!(!python_isspace(c), "{c:?}");
        }
    }

    #[test]
    fn split_runs_cuts_only_long_runs() {
        assert_eq!(split_whitespace_runs("", 3), vec![""]);
        assert_eq!(split_whitespace_runs("ab  cd", 3), vec!["ab  cd"]);
        assert_eq!(split_whitespace_runs("abcdefg", 3), vec!["abc", "def", "g"]);
        assert_eq!(
            split_whitespace_runs("x       y", 3),
            vec!["x   ", "   ", " y"]
        );
        // The run counter restarts at each whitespace/non-whitespace switch.
        assert_eq!(split_whitespace_runs("abc abc", 3), vec!["abc abc"]);
    }

    #[test]
    fn windows_count_characters_not_bytes() {
        assert_eq!(char_windows("", 2), Vec::<&str>::new());
        assert_eq!(char_windows("日本語", 2), vec!["日本", "語"]);
        assert_eq!(char_windows("abcd", 2), vec!["ab", "cd"]);
    }

    #[test]
    fn decoder_holds_partial_characters() {
        let mut d = Decoder::default();
        let euro = "€".as_bytes();
        assert_eq!(d.push_bytes(&euro[..1]), "");
        assert!(d.has_pending());
        assert_eq!(d.push_bytes(&euro[1..2]), "");
        assert_eq!(d.push_bytes(&euro[2..]), "€");
        assert_eq!(d.push_bytes(b"\xffa"), "\u{fffd}a");
        assert_eq!(d.push_bytes(&euro[..2]), "");
        assert_eq!(d.finish(), "\u{fffd}");
    }

    #[test]
    fn vocab_errors_name_file_and_line() {
        let p = Path::new("v/tiktoken.model");
        let mut good = String::new();
        for b in 0u8..=255 {
            good.push_str(&format!(
                "{} {}\n",
                base64::engine::general_purpose::STANDARD.encode([b]),
                b
            ));
        }
        assert_eq!(parse_tiktoken_model(good.as_bytes(), p).unwrap().len(), 256);
        let dup_rank = format!("{good}YWI= 5\n");
        let e = parse_tiktoken_model(dup_rank.as_bytes(), p)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("v/tiktoken.model:257") && e.contains("rank 5"),
            "{e}"
        );
        let bad_b64 = format!("{good}!!! 256\n");
        let e = parse_tiktoken_model(bad_b64.as_bytes(), p)
            .unwrap_err()
            .to_string();
        assert!(e.contains(":257") && e.contains("base64"), "{e}");
        let gap = format!("{good}YWI= 300\n");
        let e = parse_tiktoken_model(gap.as_bytes(), p)
            .unwrap_err()
            .to_string();
        assert!(e.contains(":257") && e.contains("out of range"), "{e}");
        // Rank 0 is a two-byte token instead of the byte 0x00: ranks stay 0..256.
        let missing: String = std::iter::once("YWI= 0\n".to_string())
            .chain(good.lines().skip(1).map(|l| format!("{l}\n")))
            .collect();
        let e = parse_tiktoken_model(missing.as_bytes(), p)
            .unwrap_err()
            .to_string();
        assert!(e.contains("single-byte") && e.contains("0x00"), "{e}");
        let three = format!("{good}YWI= 256 x\n");
        let e = parse_tiktoken_model(three.as_bytes(), p)
            .unwrap_err()
            .to_string();
        assert!(e.contains(":257") && e.contains("two fields"), "{e}");
    }

    #[test]
    fn config_names_reserved_ids_and_rejects_duplicates() {
        let p = Path::new("tokenizer_config.json");
        let cfg =
            br#"{"added_tokens_decoder": {"300": {"content": "<|open|>"}, "5": {"content": "x"}}}"#;
        let names = parse_added_tokens(cfg, p, 298).unwrap();
        assert_eq!(names.len(), 256);
        assert_eq!(names[2], "<|open|>");
        assert_eq!(names[0], "<|reserved_token_298|>");
        assert_eq!(names[255], "<|reserved_token_553|>");
        let dup =
            br#"{"added_tokens_decoder": {"300": {"content": "a"}, "301": {"content": "a"}}}"#;
        let e = parse_added_tokens(dup, p, 298).unwrap_err().to_string();
        assert!(e.contains("300") && e.contains("301"), "{e}");
        let e = parse_added_tokens(b"{", p, 298).unwrap_err().to_string();
        assert!(
            e.contains("tokenizer_config.json") && e.contains("invalid JSON"),
            "{e}"
        );
    }
}
