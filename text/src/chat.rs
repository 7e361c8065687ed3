//! Kimi K3 XTML chat rendering: transcript records → prompt segments → text or token ids.
//!
//! Owns: the chat records ([`Message`], [`ToolCall`]), the render options (thinking on/off,
//! effort, revision, tools, tool choice, response format, generation prompt) and the renderer
//! [`render_prompt`], whose output is a list of [`Segment`]s. Control segments (`<|open|>`,
//! `<|close|>`, `<|sep|>`, `<|end_of_msg|>`) become special ids; every other segment is
//! tokenized on its own as plain text, so BPE never merges across a segment boundary and
//! control-marker text typed by a user (`<|open|>`) stays plain text.
//!
//! Must not: read files, sample, or know any token id (ids come from the [`Tokenizer`]).
//!
//! Follows upstream `encoding_k3.py` (`build_chat_segments`) of moonshotai/Kimi-K3. The
//! released checkpoint (revision c5d1dd4) and the later HF-main copy vendored by vLLM
//! (commit 2ec5134c) differ in two ways, selected by [`Revision`]:
//! - attribute segmentation: c5d1dd4 emits ` key="value"` as ONE text segment; HF main emits
//!   four (` key`, `="`, value, `"`), which changes token ids;
//! - HF main renders a truthy `name` on assistant messages as an attribute; c5d1dd4 ignores it.
//!
//! The default is [`Revision::C5d1dd4`], the released checkpoint's behaviour.
//!
//! Rendering rules (in order): tool declaration (when tools are given) → thinking-effort
//! system message (thinking on and an effort set; default max, as `apply_chat_template`
//! does) → the messages (tool results first re-sorted into call order by `tool_call_id`) →
//! tool-choice message → response-format message → generation prompt (`<|open|>message
//! role="assistant"<|sep|>` then `<|open|>think<|sep|>`, or `<|open|>response<|sep|>` with
//! thinking off). With thinking off, earlier assistant turns have no think channel.
//!
//! Not supported (rejected at parse time or simply absent): list-of-parts / image content,
//! the flat tool-call form without a `function` object, the dynamic tool declaration carried
//! by a system message with a `tools` field, and a tool message's separate `tool` key (its
//! `name` is used).

use serde::{Deserialize, Deserializer, Serialize};

use crate::pyjson::PyJson;
use crate::tokenizer::{Tokenizer, TokenizerError, python_strip};

/// `<|open|>`: starts a tag.
pub const OPEN_TOKEN: &str = "<|open|>";
/// `<|close|>`: starts a closing tag.
pub const CLOSE_TOKEN: &str = "<|close|>";
/// `<|sep|>`: ends a tag.
pub const SEP_TOKEN: &str = "<|sep|>";
/// `<|end_of_msg|>`: ends a message; the model's stop token.
pub const END_OF_MSG_TOKEN: &str = "<|end_of_msg|>";

/// Errors from rendering or from parsing render options.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error(
        "unsupported thinking effort {value:?}: Kimi K3 accepts low, high or max \
         (the effort message text mentions medium, but upstream encoding_k3.py rejects it)"
    )]
    InvalidEffort { value: String },
    #[error(
        "message {message}, tool call {call}: Kimi K3 tool call arguments must be a JSON object \
         (got {found})"
    )]
    ToolArgumentsNotObject {
        message: usize,
        call: usize,
        found: &'static str,
    },
    #[error(
        "message {message}: tool message has no resolvable tool name (give `name`, a \
         `tool_call_id` matching a preceding assistant tool call, or keep call order)"
    )]
    UnresolvedToolName { message: usize },
    #[error("tokenizer has no special token {name:?}; is this a Kimi K3 tokenizer?")]
    MissingControlToken { name: String },
    #[error(transparent)]
    Tokenize(#[from] TokenizerError),
}

/// Message author.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    User,
    Assistant,
    Tool,
}

/// One transcript record. Serde-compatible with the portable history line
/// `{"role","content","reasoning_content"}` and with OpenAI-style tool fields.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Message {
    pub role: Role,
    /// Message text; JSON `null` or absent reads as empty (rendered identically upstream).
    #[serde(default, deserialize_with = "null_as_empty")]
    pub content: String,
    /// Assistant thinking channel. Also accepted as `reasoning` on input.
    #[serde(default, alias = "reasoning", skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub tool_calls: Vec<ToolCall>,
    /// User/system author name (attribute when non-empty); for tool messages, the tool name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Tool messages: the `id` of the assistant tool call this answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl Message {
    fn plain(role: Role, content: &str) -> Self {
        Message {
            role,
            content: content.to_string(),
            reasoning_content: None,
            tool_calls: Vec::new(),
            name: None,
            tool_call_id: None,
        }
    }

    /// A system message.
    pub fn system(content: &str) -> Self {
        Self::plain(Role::System, content)
    }

    /// A user message.
    pub fn user(content: &str) -> Self {
        Self::plain(Role::User, content)
    }

    /// An assistant message with its thinking channel (may be empty).
    pub fn assistant(content: &str, reasoning_content: &str) -> Self {
        Message {
            reasoning_content: Some(reasoning_content.to_string()),
            ..Self::plain(Role::Assistant, content)
        }
    }
}

/// An assistant tool call (OpenAI form: `{"id","type":"function","function":{...}}`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolCall {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    pub function: FunctionCall,
}

/// The called function.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FunctionCall {
    pub name: String,
    /// A JSON object, a string holding JSON (OpenAI), or null. A string that does not parse
    /// is rendered verbatim in a `json` block, as upstream does.
    #[serde(default)]
    pub arguments: PyJson,
}

fn null_as_empty<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    Ok(Option::<String>::deserialize(d)?.unwrap_or_default())
}

fn null_as_default<'de, D: Deserializer<'de>, T: Deserialize<'de> + Default>(
    d: D,
) -> Result<T, D::Error> {
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// Thinking effort accepted by K3's encoder.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Effort {
    Low,
    High,
    #[default]
    Max,
}

impl Effort {
    /// The value as written in the effort message.
    pub fn as_str(self) -> &'static str {
        match self {
            Effort::Low => "low",
            Effort::High => "high",
            Effort::Max => "max",
        }
    }
}

impl std::fmt::Display for Effort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Effort {
    type Err = ChatError;
    /// `low`, `high` or `max`; anything else (notably `medium`) is rejected like upstream.
    fn from_str(s: &str) -> Result<Self, ChatError> {
        match s {
            "low" => Ok(Effort::Low),
            "high" => Ok(Effort::High),
            "max" => Ok(Effort::Max),
            other => Err(ChatError::InvalidEffort {
                value: other.to_string(),
            }),
        }
    }
}

/// Thinking mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Thinking {
    /// No effort message, no think channel in earlier assistant turns, and the generation
    /// prompt opens the response channel directly.
    Off,
    /// Think channel everywhere; `effort: Some(e)` adds the thinking-effort system message
    /// (`None` omits it, as upstream does for an explicit `thinking_effort=None`).
    On { effort: Option<Effort> },
}

impl Default for Thinking {
    /// Thinking on with effort max: what the official `apply_chat_template` does by default.
    fn default() -> Self {
        Thinking::On {
            effort: Some(Effort::Max),
        }
    }
}

impl Thinking {
    /// From CLI flags `--no-think` and `--thinking-effort E`. An effort value is validated
    /// even with `--no-think` (where it is then unused).
    pub fn from_flags(no_think: bool, effort: Option<&str>) -> Result<Thinking, ChatError> {
        let effort = match effort {
            Some(e) => e.parse::<Effort>()?,
            None => Effort::Max,
        };
        Ok(if no_think {
            Thinking::Off
        } else {
            Thinking::On {
                effort: Some(effort),
            }
        })
    }

    fn is_on(self) -> bool {
        matches!(self, Thinking::On { .. })
    }
}

/// Which upstream `encoding_k3.py` revision to reproduce (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Revision {
    /// moonshotai/Kimi-K3 at c5d1dd4 (the released checkpoint): one text segment per
    /// attribute; assistant `name` not rendered.
    #[default]
    C5d1dd4,
    /// HF main as vendored by vLLM 2ec5134c: attribute as four segments ` key`, `="`,
    /// value, `"`; assistant `name` rendered as an attribute.
    HfMain,
}

/// `tool_choice` values that render a system message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolChoice {
    /// "You MUST call tools in the next message."
    Required,
    /// "You MUST NOT call any tools in the next message."
    None,
}

/// `response_format` values that render a system message.
#[derive(Debug, Clone, PartialEq)]
pub enum ResponseFormat {
    JsonObject,
    /// The JSON schema itself (keys are deep-sorted when rendered).
    JsonSchema(PyJson),
}

/// Everything besides the messages that shapes the prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct RenderOptions {
    pub thinking: Thinking,
    pub revision: Revision,
    /// Tool specs (a JSON array), rendered as the tool-declare system message when truthy.
    pub tools: Option<PyJson>,
    pub tool_choice: Option<ToolChoice>,
    pub response_format: Option<ResponseFormat>,
    /// Append the assistant generation prompt (default true).
    pub add_generation_prompt: bool,
}

impl Default for RenderOptions {
    fn default() -> Self {
        RenderOptions {
            thinking: Thinking::default(),
            revision: Revision::default(),
            tools: None,
            tool_choice: None,
            response_format: None,
            add_generation_prompt: true,
        }
    }
}

/// One independently tokenized piece of the prompt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Segment {
    pub text: String,
    /// True for control markers (encoded as special ids), false for ordinary text.
    pub control: bool,
}

/// A rendered prompt.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct Rendered {
    pub segments: Vec<Segment>,
}

impl Rendered {
    /// The prompt as one string (upstream `"".join(segment.text ...)`).
    pub fn render_text(&self) -> String {
        self.segments.iter().map(|s| s.text.as_str()).collect()
    }

    /// The prompt's token ids: each control segment is its special id, each text segment is
    /// tokenized on its own with special names treated as plain text.
    pub fn render_ids(&self, tok: &Tokenizer) -> Result<Vec<u32>, ChatError> {
        let mut ids = Vec::new();
        for seg in &self.segments {
            if seg.control {
                let id = tok
                    .id_of(&seg.text)
                    .ok_or_else(|| ChatError::MissingControlToken {
                        name: seg.text.clone(),
                    })?;
                ids.push(id);
            } else {
                ids.extend(tok.encode_text(&seg.text)?);
            }
        }
        Ok(ids)
    }
}

struct Builder {
    segs: Vec<Segment>,
    revision: Revision,
}

impl Builder {
    fn control(&mut self, text: &str) {
        self.segs.push(Segment {
            text: text.to_string(),
            control: true,
        });
    }

    /// Upstream `_text`: an empty string adds no segment.
    fn text(&mut self, text: &str) {
        if !text.is_empty() {
            self.segs.push(Segment {
                text: text.to_string(),
                control: false,
            });
        }
    }

    fn open(&mut self, tag: &str, attrs: &[(&str, &str)]) {
        self.control(OPEN_TOKEN);
        self.text(tag);
        for (key, value) in attrs {
            let escaped = value.replace('&', "&amp;").replace('"', "&quot;");
            match self.revision {
                Revision::C5d1dd4 => self.text(&format!(" {key}=\"{escaped}\"")),
                Revision::HfMain => {
                    self.text(&format!(" {key}"));
                    self.text("=\"");
                    self.text(&escaped);
                    self.text("\"");
                }
            }
        }
        self.control(SEP_TOKEN);
    }

    fn close(&mut self, tag: &str) {
        self.control(CLOSE_TOKEN);
        self.text(tag);
        self.control(SEP_TOKEN);
    }

    fn end_of_msg(&mut self) {
        self.control(END_OF_MSG_TOKEN);
    }

    fn internal_system(&mut self, kind: &str, body: &str) {
        self.open("message", &[("role", "system"), ("type", kind)]);
        self.text(python_strip(body));
        self.close("message");
        self.end_of_msg();
    }
}

/// Python truthiness of a JSON value (`if tools:`).
fn py_truthy(v: &PyJson) -> bool {
    match v {
        PyJson::Null => false,
        PyJson::Bool(b) => *b,
        PyJson::Int(s) => s != "0",
        PyJson::Float(f) => *f != 0.0,
        PyJson::Str(s) => !s.is_empty(),
        PyJson::Array(a) => !a.is_empty(),
        PyJson::Object(o) => !o.is_empty(),
    }
}

/// Upstream `normalize_xtml_tool_result_messages`: each run of consecutive tool messages
/// whose `tool_call_id`s all match calls of the most recent assistant message is re-sorted
/// into call order (stable), and each gets that call's function name. A run with any
/// unmatched message is left as is. Returns (original index, forced tool name) in render
/// order.
fn order_tool_results(messages: &[Message]) -> Vec<(usize, Option<String>)> {
    let mut out = Vec::with_capacity(messages.len());
    // call id → (1-based position, function name); first occurrence wins.
    let mut call_index: Vec<(String, usize, String)> = Vec::new();
    let mut i = 0;
    while i < messages.len() {
        let m = &messages[i];
        match m.role {
            Role::Assistant => {
                call_index.clear();
                for (pos, call) in m.tool_calls.iter().enumerate() {
                    if let Some(id) = &call.id
                        && !call_index.iter().any(|(k, _, _)| k == id)
                    {
                        call_index.push((id.clone(), pos + 1, call.function.name.clone()));
                    }
                }
                out.push((i, None));
                i += 1;
            }
            Role::Tool => {
                let mut run: Vec<(usize, Option<(usize, String)>)> = Vec::new();
                while i < messages.len() && messages[i].role == Role::Tool {
                    let target = messages[i].tool_call_id.as_ref().and_then(|id| {
                        call_index
                            .iter()
                            .find(|(k, _, _)| k == id)
                            .map(|(_, pos, name)| (*pos, name.clone()))
                    });
                    run.push((i, target));
                    i += 1;
                }
                if run.iter().any(|(_, t)| t.is_none()) {
                    out.extend(run.into_iter().map(|(idx, _)| (idx, None)));
                } else {
                    run.sort_by_key(|(_, t)| t.as_ref().map_or(0, |(pos, _)| *pos));
                    out.extend(
                        run.into_iter()
                            .map(|(idx, t)| (idx, t.map(|(_, name)| name))),
                    );
                }
            }
            _ => {
                out.push((i, None));
                i += 1;
            }
        }
    }
    out
}

/// Upstream `_normalize_arguments`: the argument object of one call, or the raw text for a
/// `json` block when a string does not parse.
enum Args {
    Object(Vec<(String, PyJson)>),
    JsonBlock(String),
}

fn normalize_arguments(args: &PyJson, message: usize, call: usize) -> Result<Args, ChatError> {
    match args {
        PyJson::Null => Ok(Args::Object(Vec::new())),
        PyJson::Object(items) => Ok(Args::Object(items.clone())),
        PyJson::Str(s) => {
            if python_strip(s).is_empty() {
                return Ok(Args::Object(Vec::new()));
            }
            match PyJson::parse(s) {
                Err(_) => Ok(Args::JsonBlock(s.clone())),
                Ok(PyJson::Object(items)) => Ok(Args::Object(items)),
                Ok(other) => Err(ChatError::ToolArgumentsNotObject {
                    message,
                    call,
                    found: other.xtml_type(),
                }),
            }
        }
        other => Err(ChatError::ToolArgumentsNotObject {
            message,
            call,
            found: other.xtml_type(),
        }),
    }
}

fn render_assistant(
    b: &mut Builder,
    m: &Message,
    message_index: usize,
    thinking: bool,
) -> Result<(), ChatError> {
    if thinking {
        b.open("think", &[]);
        if let Some(r) = &m.reasoning_content
            && !python_strip(r).is_empty()
        {
            b.text(r);
        }
        b.close("think");
    }
    b.open("response", &[]);
    b.text(&m.content);
    b.close("response");
    if !m.tool_calls.is_empty() {
        b.open("tools", &[]);
        for (ci, call) in m.tool_calls.iter().enumerate() {
            let index = (ci + 1).to_string();
            b.open("call", &[("tool", &call.function.name), ("index", &index)]);
            match normalize_arguments(&call.function.arguments, message_index, ci + 1)? {
                Args::JsonBlock(raw) => {
                    b.open("json", &[("type", "object")]);
                    b.text(&raw);
                    b.close("json");
                }
                Args::Object(items) => {
                    for (key, value) in &items {
                        b.open("argument", &[("key", key), ("type", value.xtml_type())]);
                        match value {
                            PyJson::Str(s) => b.text(s),
                            other => b.text(&other.dumps()),
                        }
                        b.close("argument");
                    }
                }
            }
            b.close("call");
        }
        b.close("tools");
    }
    Ok(())
}

const EFFORT_BODY_HEAD: &str = "`thinking_effort` guides on how much to think in your thinking \
channel (not including the response channel), supported values include `low`, `medium`, \
`high`, and `max`.\nNow the system is invoked with `thinking_effort=";

/// Render a transcript (plus, by default, the generation prompt) as XTML segments.
pub fn render_prompt(messages: &[Message], opts: &RenderOptions) -> Result<Rendered, ChatError> {
    let mut b = Builder {
        segs: Vec::new(),
        revision: opts.revision,
    };
    let thinking = opts.thinking.is_on();

    if let Some(tools) = opts.tools.as_ref().filter(|t| py_truthy(t)) {
        let body = format!(
            "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{}\n```",
            tools.deep_sorted().dumps_compact()
        );
        b.internal_system("tool-declare", &body);
    }

    if let Thinking::On {
        effort: Some(effort),
    } = opts.thinking
    {
        b.internal_system("thinking-effort", &format!("{EFFORT_BODY_HEAD}{effort}`."));
    }

    let mut prior_calls: &[ToolCall] = &[];
    let mut tool_index = 0usize;
    for (idx, forced_tool) in order_tool_results(messages) {
        let m = &messages[idx];
        match m.role {
            Role::User | Role::System => {
                let role = if m.role == Role::User {
                    "user"
                } else {
                    "system"
                };
                match m.name.as_deref().filter(|n| !n.is_empty()) {
                    Some(name) => b.open("message", &[("role", role), ("name", name)]),
                    None => b.open("message", &[("role", role)]),
                }
                b.text(&m.content);
                b.close("message");
                b.end_of_msg();
            }
            Role::Assistant => {
                prior_calls = &m.tool_calls;
                tool_index = 0;
                let name = m.name.as_deref().filter(|n| !n.is_empty());
                match (opts.revision, name) {
                    (Revision::HfMain, Some(name)) => {
                        b.open("message", &[("role", "assistant"), ("name", name)])
                    }
                    _ => b.open("message", &[("role", "assistant")]),
                }
                render_assistant(&mut b, m, idx, thinking)?;
                b.close("message");
                b.end_of_msg();
            }
            Role::Tool => {
                tool_index += 1;
                let name = forced_tool
                    .or_else(|| m.name.clone())
                    .or_else(|| {
                        prior_calls
                            .get(tool_index - 1)
                            .map(|c| c.function.name.clone())
                    })
                    .ok_or(ChatError::UnresolvedToolName { message: idx })?;
                let index = tool_index.to_string();
                b.open(
                    "message",
                    &[("role", "tool"), ("tool", &name), ("index", &index)],
                );
                b.text(&m.content);
                b.close("message");
                b.end_of_msg();
            }
        }
    }

    match opts.tool_choice {
        Some(ToolChoice::Required) => b.internal_system(
            "tool-choice",
            "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.",
        ),
        Some(ToolChoice::None) => b.internal_system(
            "tool-choice",
            "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.",
        ),
        None => {}
    }

    const RAW_JSON: &str = "Your response must be raw JSON data without markdown code blocks \
(```json) or any additional formatting.";
    match &opts.response_format {
        Some(ResponseFormat::JsonObject) => b.internal_system(
            "response-format",
            &format!("The system is invoked with `response_format=json_object`.\n{RAW_JSON}"),
        ),
        Some(ResponseFormat::JsonSchema(schema)) => b.internal_system(
            "response-format",
            &format!(
                "The system is invoked with `response_format=json_schema`.\n{RAW_JSON}\n\
The JSON data must match the following schema:\n```json\n{}\n```",
                schema.deep_sorted().dumps_compact()
            ),
        ),
        None => {}
    }

    if opts.add_generation_prompt {
        b.open("message", &[("role", "assistant")]);
        b.open(if thinking { "think" } else { "response" }, &[]);
    }
    Ok(Rendered { segments: b.segs })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_prompt_has_effort_message_and_think_generation_prompt() {
        let r = render_prompt(&[Message::user("hi")], &RenderOptions::default()).unwrap();
        let text = r.render_text();
        assert!(text.starts_with(
            "<|open|>message role=\"system\" type=\"thinking-effort\"<|sep|>`thinking_effort` guides"
        ));
        assert!(text.ends_with(
            "<|open|>message role=\"user\"<|sep|>hi<|close|>message<|sep|><|end_of_msg|>\
<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>"
        ));
        assert!(text.contains("`thinking_effort=max`.<|close|>message"));
    }

    #[test]
    fn medium_effort_is_rejected() {
        let e = "medium".parse::<Effort>().unwrap_err().to_string();
        assert!(
            e.contains("medium") && e.contains("low, high or max"),
            "{e}"
        );
        assert!(Thinking::from_flags(true, Some("medium")).is_err());
        assert_eq!(
            Thinking::from_flags(true, Some("low")).unwrap(),
            Thinking::Off
        );
    }

    #[test]
    fn hf_main_splits_attributes_into_four_segments() {
        let opts = RenderOptions {
            revision: Revision::HfMain,
            thinking: Thinking::Off,
            add_generation_prompt: false,
            ..Default::default()
        };
        let r = render_prompt(&[Message::user("x")], &opts).unwrap();
        let texts: Vec<&str> = r.segments.iter().map(|s| s.text.as_str()).collect();
        assert_eq!(
            texts,
            [
                "<|open|>",
                "message",
                " role",
                "=\"",
                "user",
                "\"",
                "<|sep|>",
                "x",
                "<|close|>",
                "message",
                "<|sep|>",
                "<|end_of_msg|>"
            ]
        );
    }
}
