//! k3-text: the Kimi K3 tokenizer, the XTML chat renderer and portable chat history records.
//!
//! Owns: text in and out of the model: [`tokenizer`] (tiktoken.model + Kimi pre-tokenizer +
//! the 256 reserved specials), [`chat`] (records and the XTML prompt renderer), [`history`]
//! (JSONL transcript files), [`reply`] (generated ids back into an assistant record) and
//! [`pyjson`] (Python `json` semantics the format depends on).
//!
//! Must not: run the model, sample, or hard-code K3 token ids (they come from the checkpoint's
//! tokenizer files).
//!
//! Follows upstream moonshotai/Kimi-K3 `tokenization_kimi.py` and `encoding_k3.py`
//! (revision c5d1dd4 by default); see each module for the details and known differences.
//!
//! Typical use (what `k3-run render-chat` does):
//! ```no_run
//! use k3_text::{chat, history, tokenizer::Tokenizer};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let messages = history::load_jsonl(std::path::Path::new("chat.jsonl"))?;
//! let opts = chat::RenderOptions {
//!     thinking: chat::Thinking::from_flags(false, Some("high"))?,
//!     ..Default::default()
//! };
//! let rendered = chat::render_prompt(&messages, &opts)?;
//! print!("{}", rendered.render_text());
//! let tok = Tokenizer::load(std::path::Path::new("/models/k3"))?;
//! let ids = rendered.render_ids(&tok)?;
//! # let _ = ids; Ok(()) }
//! ```

pub mod chat;
pub mod history;
pub mod pyjson;
pub mod reply;
pub mod tokenizer;

pub use chat::{
    ChatError, Effort, Message, RenderOptions, Rendered, Revision, Role, Segment, Thinking,
    render_prompt,
};
pub use history::HistoryError;
pub use reply::{Reply, ReplyEvent, ReplyParser};
pub use tokenizer::{Decoder, Tokenizer, TokenizerError};

/// `std::fs::read` of a regular file only: a FIFO or a device named as a tokenizer or history
/// file is an error saying so, not a read that blocks (a FIFO without a writer) or never ends
/// (`/dev/zero`). (The same rule as `k3_models::load::read_regular_bytes`; this crate depends on
/// no other k3 crate.)
/// What a non-regular file is ("a directory", "a FIFO (named pipe)", ...).
fn special_file_kind(t: std::fs::FileType) -> &'static str {
    if t.is_dir() {
        return "a directory";
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return "a FIFO (named pipe)";
        } else if t.is_char_device() {
            return "a character device";
        } else if t.is_block_device() {
            return "a block device";
        } else if t.is_socket() {
            return "a socket";
        }
    }
    "a special file"
}

pub(crate) fn read_regular(path: &std::path::Path) -> std::io::Result<Vec<u8>> {
    let t = std::fs::metadata(path)?.file_type();
    if !t.is_file() {
        let what = special_file_kind(t);
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("is {what}, not a regular file"),
        ));
    }
    std::fs::read(path)
}
