//! Tool calling for `--serve`: a request's `tools`, `tool_choice` and `response_format` as
//! K3's render options, and the model's tool section parsed back into OpenAI `tool_calls`
//! (whole, or call by call while streaming).
//!
//! Owns: [`PromptExtras`] (request fields -> [`RenderOptions`] fields; the rendering itself is
//! k3-text's [`k3_text::chat::render_prompt`], the official `encoding_k3.py` rules with
//! goldens against an independent reference) and [`ToolStream`] (the XTML the model writes
//! between `<|open|>tools<|sep|>` and `<|close|>tools<|sep|>` -> calls).
//! Must not: render prompts itself, sample, or touch HTTP.
//!
//! The tool section is the renderer's own grammar (text/src/chat.rs, `render_assistant`), so a
//! call the model writes, returned to a client and sent back in the next request's
//! `messages`, renders to the same text:
//!
//! ```text
//! <|open|>call tool="NAME" index="1"<|sep|>
//!   <|open|>argument key="K" type="string|number|boolean|null|object|array"<|sep|>VALUE<|close|>argument<|sep|>...
//!   (or <|open|>json type="object"<|sep|>RAW JSON<|close|>json<|sep|>)
//! <|close|>call<|sep|>
//! ```
//!
//! A string argument's VALUE is the text itself; any other type's VALUE is its JSON. The
//! reply parser ([`k3_text::reply::ReplyParser`]) hands the section over as text with the
//! control ids spelled out, which is what is parsed here.

use k3_text::chat::{CLOSE_TOKEN, OPEN_TOKEN, ResponseFormat, SEP_TOKEN, ToolChoice};
use k3_text::pyjson::PyJson;
use serde_json::value::RawValue;
use serde_json::{Value, json};

/// The prompt-shaping fields of a chat request, checked.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PromptExtras {
    pub tools: Option<PyJson>,
    pub tool_choice: Option<ToolChoice>,
    pub response_format: Option<ResponseFormat>,
}

impl PromptExtras {
    /// From the raw JSON of `tools`, `tool_choice` and `response_format` (each `None` when
    /// absent). Errors name the field and say what is accepted.
    pub fn from_request(
        tools: Option<&RawValue>,
        tool_choice: Option<&Value>,
        response_format: Option<&RawValue>,
    ) -> Result<PromptExtras, String> {
        let tools = match tools {
            None => None,
            Some(raw) => {
                let v = PyJson::parse(raw.get()).map_err(|e| format!("`tools`: {e}"))?;
                match &v {
                    PyJson::Null => None,
                    PyJson::Array(items) => {
                        for (i, t) in items.iter().enumerate() {
                            check_tool(t).map_err(|e| format!("`tools`[{i}]: {e}"))?;
                        }
                        Some(v)
                    }
                    _ => return Err("`tools`: expected an array of tool specs".into()),
                }
            }
        };
        let has_tools = matches!(&tools, Some(PyJson::Array(a)) if !a.is_empty());
        let tool_choice = match tool_choice {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) if s == "auto" => None,
            Some(Value::String(s)) if s == "none" => Some(ToolChoice::None),
            Some(Value::String(s)) if s == "required" => {
                if !has_tools {
                    return Err(
                        "`tool_choice` \"required\": the request declares no `tools`".into(),
                    );
                }
                Some(ToolChoice::Required)
            }
            Some(Value::Object(_)) => {
                return Err(
                    "`tool_choice`: naming one function is not supported (Kimi K3's \
                            chat template renders only \"auto\", \"none\" and \"required\")"
                        .into(),
                );
            }
            Some(other) => {
                return Err(format!(
                    "`tool_choice` {other}: expected \"auto\", \"none\" or \"required\""
                ));
            }
        };
        let response_format = match response_format {
            None => None,
            Some(raw) => response_format_of(raw)?,
        };
        Ok(PromptExtras {
            tools,
            tool_choice,
            response_format,
        })
    }

    /// Whether the request declared tools (so its reply's tool section is parsed).
    pub fn has_tools(&self) -> bool {
        matches!(&self.tools, Some(PyJson::Array(a)) if !a.is_empty())
    }
}

fn field<'a>(obj: &'a PyJson, key: &str) -> Option<&'a PyJson> {
    match obj {
        PyJson::Object(items) => items.iter().find(|(k, _)| k == key).map(|(_, v)| v),
        _ => None,
    }
}

/// An OpenAI tool spec: `{"type": "function", "function": {"name": "...", ...}}`.
fn check_tool(t: &PyJson) -> Result<(), String> {
    match field(t, "type") {
        Some(PyJson::Str(s)) if s == "function" => {}
        _ => return Err("expected {\"type\": \"function\", \"function\": {...}}".into()),
    }
    match field(t, "function").and_then(|f| field(f, "name")) {
        Some(PyJson::Str(n)) if !n.is_empty() => Ok(()),
        _ => Err("`function.name`: missing or empty".into()),
    }
}

/// `{"type": "text"}` (nothing rendered), `{"type": "json_object"}`, or `{"type":
/// "json_schema", "json_schema": {"schema": {...}, ...}}` (OpenAI's form; `"schema"` beside
/// `"type"` is accepted too, as `render-chat --response-format` takes it).
fn response_format_of(raw: &RawValue) -> Result<Option<ResponseFormat>, String> {
    let v = PyJson::parse(raw.get()).map_err(|e| format!("`response_format`: {e}"))?;
    match field(&v, "type") {
        Some(PyJson::Str(t)) if t == "text" => Ok(None),
        Some(PyJson::Str(t)) if t == "json_object" => Ok(Some(ResponseFormat::JsonObject)),
        Some(PyJson::Str(t)) if t == "json_schema" => {
            let schema = field(&v, "json_schema")
                .and_then(|j| field(j, "schema"))
                .or_else(|| field(&v, "schema"));
            match schema {
                Some(s) => Ok(Some(ResponseFormat::JsonSchema(s.clone()))),
                None => {
                    Err("`response_format`: type json_schema needs `json_schema.schema`".into())
                }
            }
        }
        _ if matches!(v, PyJson::Null) => Ok(None),
        _ => Err(
            "`response_format`: expected {\"type\": \"text\"}, {\"type\": \"json_object\"} or \
             {\"type\": \"json_schema\", \"json_schema\": {\"schema\": {...}}}"
                .into(),
        ),
    }
}

/// One parsed call (OpenAI form once given an id).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedCall {
    pub name: String,
    /// The arguments as a JSON object's text (OpenAI sends them as a string).
    pub arguments: String,
}

impl ParsedCall {
    /// The OpenAI `tool_calls` entry (`index` is the position in the reply, for streaming).
    pub fn to_json(&self, id: &str, index: usize) -> Value {
        json!({"index": index, "id": id, "type": "function",
            "function": {"name": self.name, "arguments": self.arguments}})
    }
}

/// What feeding tool-section text produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolEvent {
    /// A complete call.
    Call(ParsedCall),
    /// Text of the section that is not a well-formed call (kept as reply text, not dropped).
    Unparsed(String),
}

/// Incremental parser of the tool section: feed its text as it is generated, get each call
/// once its `<|close|>call<|sep|>` arrives.
#[derive(Debug, Default, Clone)]
pub struct ToolStream {
    buf: String,
}

const CALL_END: &str = "<|close|>call<|sep|>";

impl ToolStream {
    /// Feed text of the tool section.
    pub fn push(&mut self, text: &str) -> Vec<ToolEvent> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        while let Some(end) = self.buf.find(CALL_END) {
            let block: String = self.buf.drain(..end + CALL_END.len()).collect();
            out.push(match parse_call(block.trim_start()) {
                Ok(c) => ToolEvent::Call(c),
                Err(_) => ToolEvent::Unparsed(block),
            });
        }
        out
    }

    /// The end of the section (or of the reply): text left over that is not a complete call.
    pub fn finish(self) -> Option<ToolEvent> {
        (!self.buf.trim().is_empty()).then_some(ToolEvent::Unparsed(self.buf))
    }
}

/// Every call of a whole tool section, and the text that did not parse (empty when all did).
pub fn parse_section(xtml: &str) -> (Vec<ParsedCall>, String) {
    let mut s = ToolStream::default();
    let mut calls = Vec::new();
    let mut rest = String::new();
    for ev in s.push(xtml).into_iter().chain(s.finish()) {
        match ev {
            ToolEvent::Call(c) => calls.push(c),
            ToolEvent::Unparsed(t) => rest.push_str(&t),
        }
    }
    (calls, rest)
}

/// A parsed tag: (open?, name, attributes, the text after it).
type Tag<'a> = (bool, &'a str, Vec<(String, String)>, &'a str);

/// A tag `<|open|>NAME attrs<|sep|>` or `<|close|>NAME<|sep|>` at the start of `s`.
fn tag(s: &str) -> Result<Tag<'_>, String> {
    let (open, body) = if let Some(b) = s.strip_prefix(OPEN_TOKEN) {
        (true, b)
    } else if let Some(b) = s.strip_prefix(CLOSE_TOKEN) {
        (false, b)
    } else {
        return Err(format!("expected a tag at {:?}", head(s)));
    };
    let end = body
        .find(SEP_TOKEN)
        .ok_or_else(|| format!("unterminated tag {:?}", head(s)))?;
    let (inner, rest) = (&body[..end], &body[end + SEP_TOKEN.len()..]);
    let name_end = inner.find(' ').unwrap_or(inner.len());
    let name = &inner[..name_end];
    let attrs = attributes(&inner[name_end..])?;
    Ok((open, name, attrs, rest))
}

fn head(s: &str) -> &str {
    let mut n = s.len().min(40);
    while !s.is_char_boundary(n) {
        n -= 1;
    }
    &s[..n]
}

/// ` key="value"` pairs, values unescaped (`&quot;`, `&amp;`, as the renderer escapes them).
fn attributes(mut s: &str) -> Result<Vec<(String, String)>, String> {
    let mut out = Vec::new();
    loop {
        s = s.trim_start_matches(' ');
        if s.is_empty() {
            return Ok(out);
        }
        let eq = s
            .find("=\"")
            .ok_or_else(|| format!("attribute without a value at {:?}", head(s)))?;
        let key = &s[..eq];
        let after = &s[eq + 2..];
        let close = after
            .find('"')
            .ok_or_else(|| format!("unterminated attribute {key:?}"))?;
        let value = after[..close].replace("&quot;", "\"").replace("&amp;", "&");
        out.push((key.to_string(), value));
        s = &after[close + 1..];
    }
}

fn attr<'a>(attrs: &'a [(String, String)], key: &str) -> Option<&'a str> {
    attrs
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
}

/// One `<|open|>call ...<|sep|> ... <|close|>call<|sep|>` block.
fn parse_call(block: &str) -> Result<ParsedCall, String> {
    let (open, name, attrs, mut rest) = tag(block)?;
    if !open || name != "call" {
        return Err(format!("expected <|open|>call, got {name:?}"));
    }
    let tool = attr(&attrs, "tool")
        .filter(|t| !t.is_empty())
        .ok_or("a call without its tool name")?
        .to_string();
    let mut args: Vec<String> = Vec::new();
    let mut raw_json: Option<String> = None;
    loop {
        rest = rest.trim_start();
        let (open, name, attrs, after) = tag(rest)?;
        match (open, name) {
            (false, "call") => {
                if !after.trim().is_empty() {
                    return Err("text after the call".into());
                }
                break;
            }
            (true, "argument") if raw_json.is_none() => {
                let key = attr(&attrs, "key").ok_or("an argument without a key")?;
                let kind = attr(&attrs, "type").ok_or("an argument without a type")?;
                let end = after
                    .find("<|close|>argument<|sep|>")
                    .ok_or_else(|| format!("argument {key:?} is not closed"))?;
                let value = &after[..end];
                let json_value = match kind {
                    "string" => Value::String(value.to_string()).to_string(),
                    "number" | "boolean" | "null" | "object" | "array" => {
                        let raw: &RawValue = serde_json::from_str(value).map_err(|e| {
                            format!("argument {key:?} of type {kind}: {value:?} is not JSON: {e}")
                        })?;
                        raw.get().to_string()
                    }
                    other => return Err(format!("argument {key:?}: unknown type {other:?}")),
                };
                args.push(format!("{}: {json_value}", Value::String(key.to_string())));
                rest = &after[end + "<|close|>argument<|sep|>".len()..];
            }
            (true, "json") if args.is_empty() && raw_json.is_none() => {
                let end = after
                    .find("<|close|>json<|sep|>")
                    .ok_or("the json block is not closed")?;
                raw_json = Some(after[..end].to_string());
                rest = &after[end + "<|close|>json<|sep|>".len()..];
            }
            (o, n) => {
                return Err(format!(
                    "unexpected {}{n} in a call",
                    if o { OPEN_TOKEN } else { CLOSE_TOKEN }
                ));
            }
        }
    }
    let arguments = raw_json.unwrap_or_else(|| format!("{{{}}}", args.join(", ")));
    Ok(ParsedCall {
        name: tool,
        arguments,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use k3_text::chat::{Message, RenderOptions, Thinking, render_prompt};

    /// The tool section the renderer writes for `m` (an assistant message with calls).
    fn rendered_section(m: &Message) -> String {
        let opts = RenderOptions {
            thinking: Thinking::Off,
            add_generation_prompt: false,
            ..Default::default()
        };
        let text = render_prompt(std::slice::from_ref(m), &opts)
            .unwrap()
            .render_text();
        let start = text.find("<|open|>tools<|sep|>").unwrap() + "<|open|>tools<|sep|>".len();
        let end = text.find("<|close|>tools<|sep|>").unwrap();
        text[start..end].to_string()
    }

    fn assistant_with(calls: Value) -> Message {
        serde_json::from_value(json!({"role": "assistant", "content": "", "tool_calls": calls}))
            .unwrap()
    }

    #[test]
    fn rendered_calls_parse_back_and_render_the_same() {
        let m = assistant_with(json!([
            {"id": "a", "type": "function", "function": {"name": "get_weather",
             "arguments": "{\"city\": \"東京 \\\"x\\\" & y\", \"days\": 3, \"ratio\": 0.5, \"ok\": true, \"none\": null, \"opts\": {\"z\": [1, 2.0]}, \"tags\": [\"a\"]}"}},
            {"id": "b", "type": "function", "function": {"name": "say \"hi\"", "arguments": {}}},
            {"id": "c", "type": "function", "function": {"name": "raw", "arguments": "not json {"}}
        ]));
        let section = rendered_section(&m);
        let (calls, rest) = parse_section(&section);
        assert_eq!(rest, "", "{section}");
        assert_eq!(calls.len(), 3);
        assert_eq!(calls[0].name, "get_weather");
        let args: Value = serde_json::from_str(&calls[0].arguments).unwrap();
        assert_eq!(args["city"], "東京 \"x\" & y");
        assert_eq!(args["days"], 3);
        assert_eq!(args["opts"]["z"][1], 2.0);
        assert_eq!(calls[1].name, "say \"hi\"");
        assert_eq!(calls[1].arguments, "{}");
        assert_eq!(calls[2].arguments, "not json {");
        // Sent back by a client, the parsed calls render to the same section.
        let back: Vec<Value> = calls
            .iter()
            .enumerate()
            .map(|(i, c)| c.to_json(&format!("id{i}"), i))
            .map(|mut v| {
                v.as_object_mut().unwrap().remove("index");
                v
            })
            .collect();
        assert_eq!(rendered_section(&assistant_with(json!(back))), section);
    }

    #[test]
    fn streaming_gives_each_call_when_it_closes() {
        let m = assistant_with(json!([
            {"function": {"name": "f", "arguments": {"a": 1}}},
            {"function": {"name": "g", "arguments": {"b": "x"}}}
        ]));
        let section = rendered_section(&m);
        let mut s = ToolStream::default();
        let mut seen = Vec::new();
        // One character at a time: nothing before a call is complete.
        let mut at_first = None;
        for (i, ch) in section.char_indices() {
            for ev in s.push(&ch.to_string()) {
                if at_first.is_none() {
                    at_first = Some(i + ch.len_utf8());
                }
                seen.push(ev);
            }
        }
        assert_eq!(s.finish(), None);
        assert_eq!(
            at_first,
            Some(section.find(CALL_END).unwrap() + CALL_END.len())
        );
        assert_eq!(
            seen,
            [
                ToolEvent::Call(ParsedCall {
                    name: "f".into(),
                    arguments: "{\"a\": 1}".into()
                }),
                ToolEvent::Call(ParsedCall {
                    name: "g".into(),
                    arguments: "{\"b\": \"x\"}".into()
                }),
            ]
        );
    }

    #[test]
    fn malformed_sections_are_kept_as_text_not_dropped() {
        for bad in [
            "<|open|>call index=\"1\"<|sep|><|close|>call<|sep|>",
            "<|open|>call tool=\"f\"<|sep|><|open|>argument key=\"a\" type=\"number\"<|sep|>abc<|close|>argument<|sep|><|close|>call<|sep|>",
            "<|open|>call tool=\"f\"<|sep|><|open|>argument key=\"a\" type=\"date\"<|sep|>1<|close|>argument<|sep|><|close|>call<|sep|>",
            "<|open|>call tool=\"f\"<|sep|>stray<|close|>call<|sep|>",
        ] {
            let (calls, rest) = parse_section(bad);
            assert!(calls.is_empty(), "{bad}");
            assert_eq!(rest, bad);
        }
        let (calls, rest) = parse_section("<|open|>call tool=\"f\"<|sep|><|open|>argu");
        assert!(calls.is_empty());
        assert_eq!(rest, "<|open|>call tool=\"f\"<|sep|><|open|>argu");
    }

    #[test]
    fn request_fields_map_to_render_options() {
        let raw = |s: &str| RawValue::from_string(s.to_string()).unwrap();
        let tools = raw(r#"[{"type":"function","function":{"name":"f","parameters":{}}}]"#);
        let x = PromptExtras::from_request(Some(&tools), Some(&json!("required")), None).unwrap();
        assert_eq!(x.tool_choice, Some(ToolChoice::Required));
        assert!(x.has_tools());
        let x = PromptExtras::from_request(Some(&tools), Some(&json!("auto")), None).unwrap();
        assert_eq!(x.tool_choice, None);
        for (t, c, f, needle) in [
            (None, Some(json!("required")), None, "declares no `tools`"),
            (Some(raw("{}")), None, None, "expected an array"),
            (Some(raw(r#"[{"type":"x"}]"#)), None, None, "`tools`[0]"),
            (
                Some(raw(r#"[{"type":"function","function":{}}]"#)),
                None,
                None,
                "`function.name`",
            ),
            (
                Some(tools.clone()),
                Some(json!({"type": "function", "function": {"name": "f"}})),
                None,
                "naming one function",
            ),
            (None, Some(json!("sometimes")), None, "`tool_choice`"),
            (
                None,
                None,
                Some(raw(r#"{"type":"xml"}"#)),
                "`response_format`",
            ),
            (
                None,
                None,
                Some(raw(r#"{"type":"json_schema"}"#)),
                "json_schema.schema",
            ),
        ] {
            let e = PromptExtras::from_request(t.as_deref(), c.as_ref(), f.as_deref()).unwrap_err();
            assert!(e.contains(needle), "{e}");
        }
        let f = raw(r#"{"type":"json_schema","json_schema":{"name":"x","schema":{"b":1,"a":2}}}"#);
        let x = PromptExtras::from_request(None, None, Some(&f)).unwrap();
        assert_eq!(
            x.response_format,
            Some(ResponseFormat::JsonSchema(
                PyJson::parse(r#"{"b":1,"a":2}"#).unwrap()
            ))
        );
    }
}
