//! Tool calls in `--serve`, in-process: (1) a request's `tools` / `tool_choice` /
//! `response_format` fields, mapped by the server's [`PromptExtras`], render every golden
//! transcript of the independent reference (fixtures/text/expected/xtml_golden.json) byte for
//! byte; (2) a round trip on the fixture model's tokenizer: the ids of an assistant turn with
//! tool calls, fed through the reply parser as if generated, parse into `tool_calls` that,
//! sent back by a client, render to the same ids.

mod chat_support;

use k3_run::chat::tools::{PromptExtras, parse_section};
use k3_text::chat::{Message, RenderOptions, Thinking, render_prompt};
use k3_text::reply::parse_reply;
use k3_text::tokenizer::Tokenizer;
use serde_json::value::RawValue;
use serde_json::{Value, json};

fn fixtures() -> std::path::PathBuf {
    chat_support::repo().join("fixtures/text")
}

#[test]
fn request_fields_render_the_reference_goldens() {
    let golden: Vec<Value> = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("expected/xtml_golden.json")).unwrap(),
    )
    .unwrap();
    let mut checked = 0;
    let mut with_tools = 0;
    for case in &golden {
        let name = case["name"].as_str().unwrap();
        if case.get("error").is_some() {
            continue;
        }
        let text =
            std::fs::read_to_string(fixtures().join(format!("transcripts/{name}.json"))).unwrap();
        let t: Value = serde_json::from_str(&text).unwrap();
        // The messages from their raw text, as the server reads a body (key order kept).
        let fields: std::collections::HashMap<String, Box<RawValue>> =
            serde_json::from_str(&text).unwrap();
        let o = &t["options"];
        if o.get("revision").is_some_and(|r| r != "c5d1dd4") {
            continue; // the server renders the released revision only
        }
        let messages: Vec<Message> = serde_json::from_str(fields["messages"].get()).unwrap();
        // As a client sends them: json_schema in OpenAI's nesting.
        let rf = o.get("response_format").map(|f| {
            if f["type"] == "json_schema" {
                json!({"type": "json_schema", "json_schema": {"name": "s", "schema": f["schema"]}})
            } else {
                f.clone()
            }
        });
        let raw = |v: Option<&Value>| v.map(|v| RawValue::from_string(v.to_string()).unwrap());
        let tools = raw(o.get("tools"));
        let rf = raw(rf.as_ref());
        let extras =
            PromptExtras::from_request(tools.as_deref(), o.get("tool_choice"), rf.as_deref())
                .unwrap_or_else(|e| panic!("{name}: {e}"));
        with_tools += usize::from(extras.has_tools());
        let thinking = if o.get("thinking") == Some(&json!(false)) {
            Thinking::Off
        } else {
            match o.get("effort") {
                Some(Value::Null) => Thinking::On { effort: None },
                Some(Value::String(e)) => Thinking::On {
                    effort: Some(e.parse().unwrap()),
                },
                _ => Thinking::default(),
            }
        };
        let opts = RenderOptions {
            thinking,
            tools: extras.tools,
            tool_choice: extras.tool_choice,
            response_format: extras.response_format,
            add_generation_prompt: o.get("add_generation_prompt") != Some(&json!(false)),
            ..RenderOptions::default()
        };
        let text = render_prompt(&messages, &opts)
            .unwrap_or_else(|e| panic!("{name}: {e}"))
            .render_text();
        assert_eq!(text, case["text"].as_str().unwrap(), "{name}");
        checked += 1;
    }
    assert!(
        checked >= 15 && with_tools >= 2,
        "{checked} cases, {with_tools} with tools"
    );
}

#[test]
fn generated_tool_calls_round_trip_through_ids() {
    let dir = tempfile::tempdir().unwrap();
    let model = chat_support::synth_model(dir.path());
    let tok = Tokenizer::load(&model).unwrap();
    let opts = RenderOptions {
        thinking: Thinking::Off,
        add_generation_prompt: false,
        ..RenderOptions::default()
    };
    let user = Message::user("weather?");
    let turn: Message = serde_json::from_value(json!({"role": "assistant", "content": "ok",
        "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_weather",
             "arguments": "{\"city\": \"Paris & \\\"Lyon\\\"\", \"days\": 3, \"exact\": true, \"opts\": {\"u\": [1, 2.5]}}"}},
            {"id": "b", "type": "function", "function": {"name": "now", "arguments": "{}"}}
        ]}))
    .unwrap();
    let prompt = render_prompt(
        std::slice::from_ref(&user),
        &RenderOptions {
            add_generation_prompt: true,
            ..opts.clone()
        },
    )
    .unwrap()
    .render_ids(&tok)
    .unwrap();
    let full = render_prompt(&[user.clone(), turn], &opts)
        .unwrap()
        .render_ids(&tok)
        .unwrap();
    assert!(full.starts_with(&prompt));
    // What the model would generate after the prompt, through the server's parsers.
    let generated = &full[prompt.len()..];
    let reply = parse_reply(&tok, generated, false).unwrap();
    assert_eq!(reply.content, "ok");
    let (calls, rest) = parse_section(reply.tools_xtml.as_deref().unwrap());
    assert_eq!(rest, "");
    assert_eq!(calls.len(), 2);
    let args: Value = serde_json::from_str(&calls[0].arguments).unwrap();
    assert_eq!(args["city"], "Paris & \"Lyon\"");
    assert_eq!(args["opts"]["u"][1], 2.5);
    // The client sends the calls back: the same ids.
    let back: Vec<Value> = calls
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let mut v = c.to_json(&format!("call_{i}"), i);
            v.as_object_mut().unwrap().remove("index");
            v
        })
        .collect();
    let again: Message = serde_json::from_value(json!({"role": "assistant", "content": "ok",
        "tool_calls": back}))
    .unwrap();
    let rerendered = render_prompt(&[user, again], &opts)
        .unwrap()
        .render_ids(&tok)
        .unwrap();
    assert_eq!(rerendered, full);
}
