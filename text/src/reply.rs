//! Parsing what the model generates after the XTML generation prompt back into an assistant
//! record (thinking channel, response channel, raw tool section), streaming, on token ids.
//!
//! Owns: [`ReplyParser`] (feed ids as they are sampled, get channel-tagged text events as soon
//! as the UTF-8 is complete) and [`Reply`] (the finished record).
//!
//! Must not: sample, stop generation (the caller stops on `<|end_of_msg|>`, which this parser
//! reports as [`ReplyEvent::End`]), or treat text that merely spells a marker as a marker:
//! it works on ids, so only the real control ids change channels.
//!
//! Follows the grammar the renderer emits (see [`crate::chat`]): after
//! `<|open|>message role="assistant"<|sep|><|open|>think<|sep|>` the model writes
//! `REASONING<|close|>think<|sep|><|open|>response<|sep|>ANSWER<|close|>response<|sep|>`
//! `[<|open|>tools<|sep|>...<|close|>tools<|sep|>]<|close|>message<|sep|><|end_of_msg|>`;
//! without thinking the prompt already opened the response channel. Anything off-grammar
//! (an unknown tag, a stray `<|sep|>`, another special id) is kept as its literal text in the
//! current channel rather than dropped. Tool calls are returned as raw XTML text; turning them
//! back into structured [`crate::chat::ToolCall`]s is not implemented.

use crate::chat::{CLOSE_TOKEN, ChatError, END_OF_MSG_TOKEN, Message, OPEN_TOKEN, SEP_TOKEN};
use crate::tokenizer::{Decoder, Tokenizer};

/// Where a piece of generated text belongs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Channel {
    /// The thinking channel (`reasoning_content`).
    Think,
    /// The response channel (`content`).
    Response,
    /// Inside `<|open|>tools<|sep|>` … `<|close|>tools<|sep|>` (raw XTML, markers included).
    Tools,
    /// Between channels (normally nothing is generated here).
    Between,
}

/// One streaming event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplyEvent {
    Text {
        channel: Channel,
        text: String,
    },
    /// `<|end_of_msg|>` was generated: the record is complete; stop generating.
    End,
}

/// A parsed assistant reply.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Reply {
    pub reasoning_content: String,
    pub content: String,
    /// Raw XTML of the tool section (between the `tools` tags), if any.
    pub tools_xtml: Option<String>,
    /// True once `<|end_of_msg|>` was seen.
    pub complete: bool,
}

impl Reply {
    /// The portable assistant record (`reasoning_content` is kept even when empty).
    pub fn to_message(&self) -> Message {
        Message::assistant(&self.content, &self.reasoning_content)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TagKind {
    Open,
    Close,
}

/// Streaming parser for generated ids; see the module docs.
#[derive(Debug, Clone)]
pub struct ReplyParser {
    open: u32,
    close: u32,
    sep: u32,
    eom: u32,
    channel: Channel,
    decoder: Decoder,
    /// A tag being read: its kind and the bytes of its name/attributes so far.
    tag: Option<(TagKind, Vec<u8>)>,
    reply: Reply,
}

impl ReplyParser {
    /// A parser for a generation that starts right after the generation prompt rendered with
    /// `thinking` on (think channel open) or off (response channel open).
    pub fn new(tok: &Tokenizer, thinking: bool) -> Result<Self, ChatError> {
        let id = |name: &str| {
            tok.id_of(name)
                .ok_or_else(|| ChatError::MissingControlToken {
                    name: name.to_string(),
                })
        };
        Ok(ReplyParser {
            open: id(OPEN_TOKEN)?,
            close: id(CLOSE_TOKEN)?,
            sep: id(SEP_TOKEN)?,
            eom: id(END_OF_MSG_TOKEN)?,
            channel: if thinking {
                Channel::Think
            } else {
                Channel::Response
            },
            decoder: Decoder::default(),
            tag: None,
            reply: Reply::default(),
        })
    }

    /// The channel text is currently going to.
    pub fn channel(&self) -> Channel {
        self.channel
    }

    fn emit(&mut self, channel: Channel, text: String, events: &mut Vec<ReplyEvent>) {
        if text.is_empty() {
            return;
        }
        match channel {
            Channel::Think => self.reply.reasoning_content.push_str(&text),
            Channel::Response => self.reply.content.push_str(&text),
            Channel::Tools => self
                .reply
                .tools_xtml
                .get_or_insert_with(String::new)
                .push_str(&text),
            // Off-grammar text between channels is kept in the answer.
            Channel::Between => self.reply.content.push_str(&text),
        }
        events.push(ReplyEvent::Text { channel, text });
    }

    fn flush_text(&mut self, events: &mut Vec<ReplyEvent>) {
        let text = self.decoder.finish();
        self.emit(self.channel, text, events);
    }

    /// Feed one generated id.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<Vec<ReplyEvent>, ChatError> {
        let mut events = Vec::new();
        if let Some((_, buf)) = &mut self.tag {
            if id == self.sep {
                let (kind, buf) = self.tag.take().expect("tag checked above");
                self.finish_tag(kind, &buf, &mut events);
            } else if id == self.open || id == self.close || id == self.eom || tok.is_special(id) {
                // A tag interrupted by another marker: give back its literal text.
                let (kind, buf) = self.tag.take().expect("tag checked above");
                let literal = literal_tag(kind, &buf, false);
                self.emit(self.channel, literal, &mut events);
                events.extend(self.push(tok, id)?);
            } else {
                buf.extend_from_slice(tok.token_bytes(id)?);
            }
            return Ok(events);
        }
        if id == self.open || id == self.close {
            self.flush_text(&mut events);
            let kind = if id == self.open {
                TagKind::Open
            } else {
                TagKind::Close
            };
            self.tag = Some((kind, Vec::new()));
        } else if id == self.eom {
            self.flush_text(&mut events);
            self.reply.complete = true;
            events.push(ReplyEvent::End);
        } else {
            let text = self.decoder.push(tok, id)?;
            self.emit(self.channel, text, &mut events);
        }
        Ok(events)
    }

    fn finish_tag(&mut self, kind: TagKind, buf: &[u8], events: &mut Vec<ReplyEvent>) {
        let body = String::from_utf8_lossy(buf);
        let name = body.split(' ').next().unwrap_or("");
        let next = match (self.channel, kind, name) {
            (Channel::Tools, TagKind::Close, "tools") => Some(Channel::Between),
            (Channel::Tools, _, _) => None,
            (Channel::Think, TagKind::Close, "think") => Some(Channel::Between),
            (Channel::Response, TagKind::Close, "response") => Some(Channel::Between),
            (Channel::Between, TagKind::Open, "response") => Some(Channel::Response),
            (Channel::Between, TagKind::Open, "think") => Some(Channel::Think),
            (Channel::Between, TagKind::Open, "tools") => Some(Channel::Tools),
            (Channel::Between, TagKind::Close, "message") => Some(Channel::Between),
            _ => None,
        };
        match next {
            Some(ch) => {
                if ch == Channel::Tools {
                    self.reply.tools_xtml.get_or_insert_with(String::new);
                }
                self.channel = ch;
            }
            None => {
                let literal = literal_tag(kind, buf, true);
                self.emit(self.channel, literal, events);
            }
        }
    }

    /// Finish: flushes held-back bytes (an unfinished character becomes U+FFFD) and any
    /// unterminated tag text, and returns the reply.
    pub fn finish(mut self) -> Reply {
        let mut sink = Vec::new();
        if let Some((kind, buf)) = self.tag.take() {
            let literal = literal_tag(kind, &buf, false);
            self.emit(self.channel, literal, &mut sink);
        }
        self.flush_text(&mut sink);
        self.reply
    }
}

fn literal_tag(kind: TagKind, buf: &[u8], with_sep: bool) -> String {
    let mut s = String::from(match kind {
        TagKind::Open => OPEN_TOKEN,
        TagKind::Close => CLOSE_TOKEN,
    });
    s.push_str(&String::from_utf8_lossy(buf));
    if with_sep {
        s.push_str(SEP_TOKEN);
    }
    s
}

/// Parse a whole generation at once (see [`ReplyParser`]).
pub fn parse_reply(tok: &Tokenizer, ids: &[u32], thinking: bool) -> Result<Reply, ChatError> {
    let mut p = ReplyParser::new(tok, thinking)?;
    for &id in ids {
        p.push(tok, id)?;
    }
    Ok(p.finish())
}
