//! History file behaviour: portable records round-trip, per-line validation with line
//! numbers, atomic append with owner-only permissions, and nothing overwritten on error.

use k3_text::chat::{self, Message, RenderOptions, Role};
use k3_text::history::{self, HistoryError};

#[test]
fn records_round_trip_and_file_is_private() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("chat.jsonl");
    let msgs = vec![
        Message::system("Be brief."),
        Message::user("Hi \"there\" <|open|> 😀\nsecond line"),
        Message::assistant("Hello.", "Greeting; answer briefly."),
    ];
    for m in &msgs {
        history::append_record(&path, m).expect("append");
    }
    let text = std::fs::read_to_string(&path).expect("read back");
    assert_eq!(text.lines().count(), 3, "one line per record");
    assert_eq!(
        text.lines().nth(2),
        Some(
            r#"{"role":"assistant","content":"Hello.","reasoning_content":"Greeting; answer briefly."}"#
        )
    );
    assert_eq!(history::load_jsonl(&path).expect("load"), msgs);
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path)
            .expect("metadata")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
    }
    // Re-rendering the loaded history is what a restart re-prefills.
    let a = chat::render_prompt(&msgs, &RenderOptions::default()).expect("render");
    let b = chat::render_prompt(
        &history::load_jsonl(&path).expect("load"),
        &RenderOptions::default(),
    )
    .expect("render");
    assert_eq!(a, b);
}

#[test]
fn portable_records_from_other_tools_load() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("h.jsonl");
    std::fs::write(
        &path,
        concat!(
            "{\"role\":\"user\",\"content\":\"q\",\"reasoning_content\":null}\n",
            "{\"role\": \"assistant\", \"content\": null, \"reasoning\": \"r\", \"tool_calls\": ",
            "[{\"id\": \"c1\", \"type\": \"function\", \"function\": {\"name\": \"f\", ",
            "\"arguments\": \"{\\\"b\\\": 1, \\\"a\\\": 2}\"}}]}\n",
            "{\"role\":\"tool\",\"tool_call_id\":\"c1\",\"content\":\"ok\"}\n",
        ),
    )
    .expect("write");
    let msgs = history::load_jsonl(&path).expect("load");
    assert_eq!(msgs.len(), 3);
    assert_eq!(msgs[1].role, Role::Assistant);
    assert_eq!(msgs[1].content, "");
    assert_eq!(msgs[1].reasoning_content.as_deref(), Some("r"));
    let text = chat::render_prompt(&msgs, &RenderOptions::default())
        .expect("render")
        .render_text();
    // Argument order follows the JSON text, not sorted keys.
    let b = text.find("key=\"b\"").expect("b rendered");
    let a = text.find("key=\"a\"").expect("a rendered");
    assert!(b < a);
    assert!(text.contains("<|open|>message role=\"tool\" tool=\"f\" index=\"1\"<|sep|>ok"));
}

#[test]
fn corrupt_lines_are_reported_with_line_numbers() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("bad.jsonl");
    let cases: [(&[u8], usize, &str); 6] = [
        (
            b"{\"role\":\"user\",\"content\":\"a\"}\n{\"role\":\"user\",\"content\":\n",
            2,
            "EOF",
        ),
        (
            b"{\"role\":\"user\",\"content\":\"a\"}\n\n",
            2,
            "empty line",
        ),
        (b"{\"role\":\"robot\",\"content\":\"a\"}\n", 1, "robot"),
        (
            b"{\"role\":\"user\",\"content\":\"a\",\"colour\":1}\n",
            1,
            "colour",
        ),
        (b"{\"role\":\"user\",\"content\":\"\xff\"}\n", 1, "UTF-8"),
        (
            b"{\"role\":\"user\",\"content\":\"a\"}\n{\"role\":\"user\"",
            2,
            "newline",
        ),
    ];
    for (data, line, needle) in cases {
        std::fs::write(&path, data).expect("write");
        let e = history::load_jsonl(&path).unwrap_err();
        let msg = e.to_string();
        match &e {
            HistoryError::Corrupt { line: l, .. } => assert_eq!(*l, line, "{msg}"),
            other => panic!("expected Corrupt, got {other}"),
        }
        assert!(msg.contains(&format!("bad.jsonl:{line}:")), "{msg}");
        assert!(msg.contains(needle), "{msg} should mention {needle}");
    }
}

#[test]
fn append_refuses_a_torn_file_and_changes_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("torn.jsonl");
    let torn = b"{\"role\":\"user\",\"content\":\"a\"}\n{\"role\":\"us";
    std::fs::write(&path, torn).expect("write");
    let e = history::append_record(&path, &Message::user("b")).unwrap_err();
    assert!(matches!(e, HistoryError::TornTail { .. }), "{e}");
    assert_eq!(std::fs::read(&path).expect("read"), torn);
}

#[test]
fn system_flag_must_match_stored_record() {
    let p = std::path::Path::new("h.jsonl");
    let msgs = vec![Message::system("S"), Message::user("u")];
    assert!(history::check_system(&msgs, Some("S"), p).is_ok());
    assert!(history::check_system(&msgs, None, p).is_ok());
    let e = history::check_system(&msgs, Some("T"), p)
        .unwrap_err()
        .to_string();
    assert!(e.contains("h.jsonl") && e.contains("which is: S "), "{e}");
    // Plain text: no Rust Debug rendering (`Some(..)`, quotes, escaped newlines).
    let multi = vec![
        Message::system("Be brief.\nUse \"plain\" words."),
        Message::user("u"),
    ];
    let e = history::check_system(&multi, Some("T"), p)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("which is: Be brief.\nUse \"plain\" words. --"),
        "{e}"
    );
    assert!(
        !e.contains("Some(") && !e.contains("\\n") && !e.contains("\\\""),
        "{e}"
    );
    let long = vec![Message::system(&"x".repeat(500)), Message::user("u")];
    let e = history::check_system(&long, Some("T"), p)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&format!("{}... (500 characters in all)", "x".repeat(200))),
        "{e}"
    );
    let no_system = vec![Message::user("u")];
    let e = history::check_system(&no_system, Some("S"), p)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("h.jsonl") && e.contains("has no system prompt"),
        "{e}"
    );
    assert!(!e.contains("None"), "{e}");
    assert!(history::check_system(&[], Some("S"), p).is_ok());
}

#[test]
fn with_system_starts_or_checks_the_transcript() {
    let p = std::path::Path::new("h.jsonl");
    assert_eq!(
        history::with_system(Vec::new(), Some("S"), p).expect("new"),
        vec![Message::system("S")]
    );
    assert!(
        history::with_system(Vec::new(), None, p)
            .expect("new")
            .is_empty()
    );
    let stored = vec![Message::system("S"), Message::user("u")];
    assert_eq!(
        history::with_system(stored.clone(), Some("S"), p).expect("resume"),
        stored
    );
    assert!(history::with_system(stored, Some("other"), p).is_err());
}

#[test]
fn a_whole_turn_is_appended_in_one_piece() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("turns.jsonl");
    // No records: the file is created (private) and stays empty.
    history::append_records(&path, &[]).expect("create");
    assert_eq!(std::fs::read(&path).expect("read"), b"");
    let turn = [
        Message::user("first line\nsecond"),
        Message::assistant("answer", "thoughts"),
    ];
    history::append_records(&path, &turn).expect("append turn");
    history::append_records(&path, &turn[..1]).expect("append one");
    let back = history::load_jsonl(&path).expect("load");
    assert_eq!(back, [turn[0].clone(), turn[1].clone(), turn[0].clone()]);
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).expect("meta").permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }
    // A torn tail is refused and left as it was, for a whole turn too.
    std::fs::write(&path, b"{\"role\":\"user\",\"content\":\"x\"}").expect("write torn");
    let err = history::append_records(&path, &turn).unwrap_err();
    assert!(matches!(err, HistoryError::TornTail { .. }), "{err}");
    assert_eq!(
        std::fs::read(&path).expect("read"),
        b"{\"role\":\"user\",\"content\":\"x\"}"
    );
}
