//! The reply parser inverts the renderer: the ids of a rendered assistant turn, minus the
//! generation prompt, parse back into the same record. This is also the prefix property
//! `--incremental` relies on (transcript + generation prompt is a prefix of the transcript
//! with the answered turn).

use std::path::PathBuf;

use k3_text::chat::{self, Message, RenderOptions, Thinking};
use k3_text::reply::{self, Channel, ReplyEvent, ReplyParser};
use k3_text::tokenizer::Tokenizer;

fn tok() -> Tokenizer {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/text/vocab");
    Tokenizer::load(&dir).expect("fixture vocab")
}

/// Ids the model would generate for `answer` after the prompt for `history`.
fn generated_ids(
    tok: &Tokenizer,
    history: &[Message],
    answer: &Message,
    opts: &RenderOptions,
) -> Vec<u32> {
    let prompt = chat::render_prompt(history, opts)
        .expect("render prompt")
        .render_ids(tok)
        .expect("prompt ids");
    let mut full_msgs = history.to_vec();
    full_msgs.push(answer.clone());
    let full = chat::render_prompt(
        &full_msgs,
        &RenderOptions {
            add_generation_prompt: false,
            ..opts.clone()
        },
    )
    .expect("render full")
    .render_ids(tok)
    .expect("full ids");
    assert!(
        full.starts_with(&prompt),
        "prompt ids are a prefix of the answered transcript"
    );
    full[prompt.len()..].to_vec()
}

#[test]
fn thinking_reply_round_trips() {
    let tok = tok();
    let history = vec![Message::user("Capital of France?")];
    let answer = Message::assistant(
        "Paris. 🇫🇷 <|open|> is just text",
        "Easy: it is Paris.\n日本語も",
    );
    let ids = generated_ids(&tok, &history, &answer, &RenderOptions::default());
    let r = reply::parse_reply(&tok, &ids, true).expect("parse");
    assert!(r.complete);
    assert_eq!(r.to_message(), answer);
    assert_eq!(r.tools_xtml, None);
}

#[test]
fn no_think_reply_round_trips_and_streams_per_channel() {
    let tok = tok();
    let opts = RenderOptions {
        thinking: Thinking::Off,
        ..Default::default()
    };
    let history = vec![Message::system("S"), Message::user("hi")];
    let answer = Message::assistant("Hello — ça va? 😀", "");
    let ids = generated_ids(&tok, &history, &answer, &opts);
    let mut p = ReplyParser::new(&tok, false).expect("parser");
    let mut streamed = String::new();
    let mut ended = false;
    for &id in &ids {
        for ev in p.push(&tok, id).expect("push") {
            match ev {
                ReplyEvent::Text { channel, text } => {
                    assert_eq!(channel, Channel::Response);
                    assert!(!ended);
                    streamed.push_str(&text);
                }
                ReplyEvent::End => ended = true,
            }
        }
    }
    assert!(ended);
    let r = p.finish();
    assert_eq!(streamed, answer.content);
    assert_eq!(r.content, answer.content);
    assert_eq!(r.reasoning_content, "");
}

#[test]
fn tool_section_is_kept_raw_and_truncation_is_reported() {
    let tok = tok();
    let mut answer = Message::assistant("", "need a tool");
    answer.tool_calls = serde_json::from_str(
        r#"[{"id":"c","type":"function","function":{"name":"f","arguments":{"x":1}}}]"#,
    )
    .expect("tool call JSON");
    let ids = generated_ids(
        &tok,
        &[Message::user("q")],
        &answer,
        &RenderOptions::default(),
    );
    let r = reply::parse_reply(&tok, &ids, true).expect("parse");
    assert!(r.complete);
    assert_eq!(r.reasoning_content, "need a tool");
    assert_eq!(r.content, "");
    assert_eq!(
        r.tools_xtml.as_deref(),
        Some(
            "<|open|>call tool=\"f\" index=\"1\"<|sep|><|open|>argument key=\"x\" type=\"number\"<|sep|>1\
<|close|>argument<|sep|><|close|>call<|sep|>"
        )
    );
    // Cut mid-answer: not complete, text so far kept.
    let cut = reply::parse_reply(&tok, &ids[..3], true).expect("parse");
    assert!(!cut.complete);
    assert!("need a tool".starts_with(&cut.reasoning_content) && !cut.reasoning_content.is_empty());
}
