//! Portable chat history files (JSONL, one [`Message`] per line).
//!
//! Owns: loading a history file with per-line validation ([`load_jsonl`]), appending one
//! record or one whole turn atomically ([`append_record`], [`append_records`]), and the
//! `--system` consistency check ([`check_system`]).
//!
//! Must not: rewrite or truncate an existing history (a corrupt file is reported, never
//! repaired), or store anything but the portable records (model state is never serialised).
//!
//! Format: UTF-8, one JSON object per line, `\n`-terminated:
//! `{"role":"user","content":"..."}`, `{"role":"assistant","content":"...","reasoning_content":"..."}`.
//! The file holds every message and all reasoning, so it is created with mode 0600.

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use crate::chat::{Message, Role};

/// Errors from reading or writing a history file.
#[derive(Debug, thiserror::Error)]
pub enum HistoryError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}:{line}: corrupt history record: {msg}", path.display())]
    Corrupt {
        path: PathBuf,
        line: usize,
        msg: String,
    },
    #[error(
        "{}: the file does not end with a newline (a torn last record?); refusing to append",
        path.display()
    )]
    TornTail { path: PathBuf },
    #[error("cannot serialise the record for {}: {msg}", path.display())]
    Serialize { path: PathBuf, msg: String },
    #[error("{}", system_mismatch(path, stored.as_deref()))]
    SystemMismatch {
        path: PathBuf,
        stored: Option<String>,
    },
}

/// Longest stored system prompt quoted whole in [`HistoryError::SystemMismatch`].
const SHOWN_SYSTEM_CHARS: usize = 200;

/// The plain-text message of [`HistoryError::SystemMismatch`]: the stored prompt as text
/// (cut after [`SHOWN_SYSTEM_CHARS`] characters), or that there is none.
fn system_mismatch(path: &Path, stored: Option<&str>) -> String {
    match stored {
        Some(s) => {
            let n = s.chars().count();
            let shown: String = s.chars().take(SHOWN_SYSTEM_CHARS).collect();
            let cut = if n > SHOWN_SYSTEM_CHARS {
                format!("... ({n} characters in all)")
            } else {
                String::new()
            };
            format!(
                "--system does not match the system prompt stored at the start of the history \
                 {}, which is: {shown}{cut} -- give that text to --system, or leave the flag \
                 out to resume with the stored one",
                path.display()
            )
        }
        None => format!(
            "--system was given but the history {} has no system prompt at its start -- leave \
             the flag out to resume it, or start a new history file",
            path.display()
        ),
    }
}

/// Read and validate every line of a history file. Empty file → no messages. A line that is
/// not UTF-8, not a JSON object, has an unknown role or field, or lacks the final newline
/// (torn write) is reported with its 1-based line number.
pub fn load_jsonl(path: &Path) -> Result<Vec<Message>, HistoryError> {
    let data = crate::read_regular(path).map_err(|source| HistoryError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    parse_jsonl(&data, path)
}

/// [`load_jsonl`] on bytes already read; `path` is only used in errors.
pub fn parse_jsonl(data: &[u8], path: &Path) -> Result<Vec<Message>, HistoryError> {
    let corrupt = |line: usize, msg: String| HistoryError::Corrupt {
        path: path.to_path_buf(),
        line,
        msg,
    };
    let mut out = Vec::new();
    if data.is_empty() {
        return Ok(out);
    }
    let body = match data.strip_suffix(b"\n") {
        Some(b) => b,
        None => {
            let line = data.iter().filter(|&&b| b == b'\n').count() + 1;
            return Err(corrupt(
                line,
                "last line has no terminating newline (torn write?)".to_string(),
            ));
        }
    };
    for (i, line) in body.split(|&b| b == b'\n').enumerate() {
        let line_no = i + 1;
        let text = std::str::from_utf8(line).map_err(|e| {
            corrupt(
                line_no,
                format!("invalid UTF-8 at byte {} of the line", e.valid_up_to()),
            )
        })?;
        if text.trim().is_empty() {
            return Err(corrupt(line_no, "empty line".to_string()));
        }
        let msg: Message =
            serde_json::from_str(text).map_err(|e| corrupt(line_no, e.to_string()))?;
        out.push(msg);
    }
    Ok(out)
}

/// Append one record as a single `\n`-terminated line with one `write` call, then fsync.
/// The file is created with mode 0600 if missing. Refuses to append after a torn last line.
pub fn append_record(path: &Path, message: &Message) -> Result<(), HistoryError> {
    append_records(path, std::slice::from_ref(message))
}

/// Append several records (e.g. a user turn and its assistant reply) as consecutive lines in
/// ONE `write` call, then fsync, so a crash leaves either all of them or none (a torn tail
/// is detected by [`load_jsonl`] and refused by the next append). With no records it only
/// creates the file (mode 0600) if missing and checks its tail.
pub fn append_records(path: &Path, messages: &[Message]) -> Result<(), HistoryError> {
    let io = |source: std::io::Error| HistoryError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut lines = String::new();
    for message in messages {
        let line = serde_json::to_string(message).map_err(|e| HistoryError::Serialize {
            path: path.to_path_buf(),
            msg: e.to_string(),
        })?;
        lines.push_str(&line);
        lines.push('\n');
    }

    let mut opts = std::fs::OpenOptions::new();
    opts.read(true).append(true).create(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    let mut file = opts.open(path).map_err(io)?;
    let len = file.metadata().map_err(io)?.len();
    if len > 0 {
        let mut last = [0u8; 1];
        file.seek(SeekFrom::Start(len - 1)).map_err(io)?;
        file.read_exact(&mut last).map_err(io)?;
        if last[0] != b'\n' {
            return Err(HistoryError::TornTail {
                path: path.to_path_buf(),
            });
        }
    }
    if lines.is_empty() {
        return Ok(());
    }
    // O_APPEND: the write lands at the end whatever the cursor says. write_all issues a
    // single write(2) for a regular file unless the kernel returns a short count.
    file.write_all(lines.as_bytes()).map_err(io)?;
    file.flush().map_err(io)?;
    file.sync_data().map_err(io)?;
    Ok(())
}

/// Start or resume a transcript with an optional `--system TEXT`: an empty history gets the
/// system record (if any) as its first message; a non-empty one must already start with the
/// same system record ([`check_system`]) and is returned unchanged.
pub fn with_system(
    messages: Vec<Message>,
    system: Option<&str>,
    path: &Path,
) -> Result<Vec<Message>, HistoryError> {
    if messages.is_empty() {
        return Ok(system.map(Message::system).into_iter().collect());
    }
    check_system(&messages, system, path)?;
    Ok(messages)
}

/// The content of the initial system record, if the history starts with one.
pub fn initial_system(messages: &[Message]) -> Option<&str> {
    messages
        .first()
        .filter(|m| m.role == Role::System)
        .map(|m| m.content.as_str())
}

/// `--system TEXT` must equal the stored initial system record (when the history is not
/// empty). `path` is only used in the error.
pub fn check_system(
    messages: &[Message],
    system: Option<&str>,
    path: &Path,
) -> Result<(), HistoryError> {
    if messages.is_empty() {
        return Ok(());
    }
    let stored = initial_system(messages);
    match system {
        Some(s) if stored != Some(s) => Err(HistoryError::SystemMismatch {
            path: path.to_path_buf(),
            stored: stored.map(str::to_string),
        }),
        _ => Ok(()),
    }
}
