//! `k3-run render-chat`: print exactly what the model will see for a transcript plus the
//! generation prompt, so users can inspect prompts and tests can compare bytes.
//!
//! Owns: turning the render-chat flags into [`RenderOptions`] and the output format:
//! - stdout is the prompt text, byte for byte, with nothing added (no trailing newline);
//! - with `--ids` (needs `--tok`) the text is followed by `\n` and then the token ids on one
//!   line, comma-separated, ending in `\n` (the ids are the last line; the text may itself
//!   contain newlines);
//! - a one-line summary goes to stderr.
//!
//! Must not: load a model. It renders through the same code path as the REPL
//! ([`super::session::load_transcript`] and [`k3_text::chat::render_prompt`]), so what it
//! prints is what `--chat` feeds for the same history and flags.

use std::io::Write;
use std::path::Path;

use k3_text::chat::{RenderOptions, ResponseFormat, Revision, Thinking, ToolChoice};
use k3_text::pyjson::PyJson;
use k3_text::tokenizer::Tokenizer;

use super::RenderChatArgs;
use crate::cli::{Failure, exit};

fn read_json(path: &Path, flag: &str) -> Result<PyJson, Failure> {
    let text = k3_models::load::read_regular_file(path)
        .map_err(|e| Failure::usage(format!("cannot read {flag} {}: {e}", path.display())))?;
    PyJson::parse(&text).map_err(|e| Failure::usage(format!("{flag} {}: {e}", path.display())))
}

fn field<'a>(obj: &'a PyJson, key: &str) -> Option<&'a PyJson> {
    match obj {
        PyJson::Object(items) => items.iter().find(|(k, _)| k == key).map(|(_, v)| v),
        _ => None,
    }
}

/// The render options selected by the render-chat flags.
pub fn render_options(a: &RenderChatArgs) -> Result<RenderOptions, Failure> {
    let thinking = Thinking::from_flags(a.no_think, a.thinking_effort.as_deref())
        .map_err(|e| Failure::usage(e.to_string()))?;
    let revision = match a.revision.as_str() {
        "c5d1dd4" => Revision::C5d1dd4,
        "hf-main" => Revision::HfMain,
        other => {
            return Err(Failure::usage(format!(
                "--revision {other:?}: expected c5d1dd4 (the released checkpoint) or hf-main"
            )));
        }
    };
    let tools = match &a.tools {
        Some(p) => {
            let v = read_json(p, "--tools")?;
            if !matches!(v, PyJson::Array(_)) {
                return Err(Failure::usage(format!(
                    "--tools {}: expected a JSON array of tool specs",
                    p.display()
                )));
            }
            Some(v)
        }
        None => None,
    };
    let tool_choice = match a.tool_choice.as_deref() {
        None => None,
        Some("required") => Some(ToolChoice::Required),
        Some("none") => Some(ToolChoice::None),
        Some(other) => {
            return Err(Failure::usage(format!(
                "--tool-choice {other:?}: expected required or none"
            )));
        }
    };
    let response_format = match &a.response_format {
        None => None,
        Some(p) => {
            let v = read_json(p, "--response-format")?;
            match field(&v, "type") {
                Some(PyJson::Str(t)) if t == "json_object" => Some(ResponseFormat::JsonObject),
                Some(PyJson::Str(t)) if t == "json_schema" => match field(&v, "schema") {
                    Some(schema) => Some(ResponseFormat::JsonSchema(schema.clone())),
                    None => {
                        return Err(Failure::usage(format!(
                            "--response-format {}: type json_schema needs a \"schema\" field",
                            p.display()
                        )));
                    }
                },
                _ => {
                    return Err(Failure::usage(format!(
                        "--response-format {}: expected {{\"type\": \"json_object\"}} or \
                         {{\"type\": \"json_schema\", \"schema\": {{...}}}}",
                        p.display()
                    )));
                }
            }
        }
    };
    Ok(RenderOptions {
        thinking,
        revision,
        tools,
        tool_choice,
        response_format,
        add_generation_prompt: !a.no_generation_prompt,
    })
}

/// Run `render-chat`; returns the exit code.
pub fn main(a: &RenderChatArgs) -> Result<u8, Failure> {
    if a.ids && a.tok.is_none() {
        return Err(Failure::usage("--ids needs --tok DIR"));
    }
    let opts = render_options(a)?;
    let messages = super::session::load_transcript(&a.history, a.system.as_deref())
        .map_err(|e| Failure::usage(e.to_string()))?;
    let rendered = k3_text::chat::render_prompt(&messages, &opts)
        .map_err(|e| Failure::usage(format!("{}: {e}", a.history.display())))?;
    let text = rendered.render_text();
    let ids = match &a.tok {
        Some(dir) => {
            let tok = Tokenizer::load(dir).map_err(|e| Failure::usage(e.to_string()))?;
            Some(
                rendered
                    .render_ids(&tok)
                    .map_err(|e| Failure::usage(e.to_string()))?,
            )
        }
        None => None,
    };
    let mut out = Vec::with_capacity(text.len() + 16);
    out.extend_from_slice(text.as_bytes());
    if a.ids
        && let Some(ids) = &ids
    {
        out.push(b'\n');
        let line: Vec<String> = ids.iter().map(u32::to_string).collect();
        out.extend_from_slice(line.join(",").as_bytes());
        out.push(b'\n');
    }
    let mut stdout = std::io::stdout().lock();
    stdout
        .write_all(&out)
        .and_then(|()| stdout.flush())
        .map_err(|e| Failure {
            code: exit::OUT_WRITE,
            msg: format!("cannot write to stdout: {e}"),
        })?;
    match &ids {
        Some(ids) => eprintln!(
            "render-chat: {} messages, {} bytes, {} ids",
            messages.len(),
            text.len(),
            ids.len()
        ),
        None => eprintln!(
            "render-chat: {} messages, {} bytes",
            messages.len(),
            text.len()
        ),
    }
    Ok(exit::OK)
}
