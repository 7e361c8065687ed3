//! The `--chat` REPL driven as a user would: through a pseudo-terminal, on a small synthetic
//! model with a small vocabulary. The model is random, so replies are garbage; these tests
//! check the mechanics: prompt, streamed records, stops, Ctrl-C, the history file, restart
//! with re-prefill and reused positions.

// The REPL is driven through a pseudo-terminal (openpty): Unix only.
#![cfg(unix)]

mod chat_support;

use std::ffi::OsStr;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use chat_support::{Pty, bin, number_after, render_ids, synth_model};
use k3_text::chat::{Message, Role};
use k3_text::history;

const T: Duration = Duration::from_secs(120);

fn chat_cmd(model: &Path, extra: &[&OsStr]) -> Command {
    let mut c = Command::new(bin());
    c.arg(model).args(["--chat", "--threads", "1"]).args(extra);
    c
}

fn mode(path: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path)
        .expect("metadata")
        .permissions()
        .mode()
        & 0o777
}

/// What the REPL prints for a record's channel text (controls made visible, as in
/// `k3_run::chat::repl::display_text`).
fn shown(s: &str) -> String {
    k3_run::chat::repl::display_text(s).into_owned()
}

#[test]
fn pty_session_history_ctrl_c_and_restart() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = synth_model(dir.path());
    let hist = dir.path().join("chat.jsonl");
    let h = hist.as_os_str();

    // --- first session: system prompt, incremental, small --gen ---
    let mut pty = Pty::spawn(&mut chat_cmd(
        &model,
        &[
            OsStr::new("--gen"),
            OsStr::new("24"),
            OsStr::new("--history"),
            h,
            OsStr::new("--system"),
            OsStr::new("Be brief."),
            OsStr::new("--incremental"),
        ],
    ));
    pty.expect("/help for commands", T);
    // The transcript (effort message + system record) is prefilled at start.
    let pre = pty.expect(" total", T);
    let n0 = number_after(&pre, "(transcript) [prefill: reused 0 positions, fed ");
    assert!(n0 > 0);
    pty.prompt(T);

    pty.send(b"hello\r");
    // Turn 1 reuses exactly what was prefilled at start.
    let pre = pty.expect(" total", T);
    assert_eq!(number_after(&pre, "[prefill: reused "), n0, "{pre}");
    let turn1 = pty.expect(" tok/s); context ", T);
    assert!(
        turn1.contains("[end of message; ")
            || turn1.contains("[--gen limit (24 tokens); ")
            || turn1.contains("[stop id "),
        "turn 1 must stop on end_of_msg, a stop id or the --gen limit:\n{turn1}"
    );

    // Ctrl-C at the prompt clears the line, like a shell.
    pty.prompt(T);
    pty.send(b"discard me");
    pty.expect("discard me", T);
    // (rustyline drops input it read ahead of the Ctrl-C: wait for the fresh prompt)
    pty.ctrl_c_at_prompt(T);
    pty.send(b"/help\r");
    pty.expect("Commands:", T);
    pty.expect("/reset", T);
    pty.prompt(T);
    pty.send(b"xyz");
    pty.expect("xyz", T);
    pty.ctrl_c_at_prompt(T);
    pty.send(b"second\r");
    let turn2 = pty.expect(" tok/s); context ", T);
    assert!(turn2.contains("[prefill: reused "), "{turn2}");

    // Ctrl-C during a turn (here: the prefill of a long pasted message) stops it, discards it
    // and keeps the REPL.
    pty.prompt(T);
    let long = "lorem ipsum ".repeat(560);
    let mut paste = b"\x1b[200~".to_vec();
    paste.extend_from_slice(long.as_bytes());
    paste.extend_from_slice(b"\x1b[201~\r");
    pty.send(&paste);
    // rustyline writes "bracketed paste off" after it restored the cooked mode, where the
    // terminal turns Ctrl-C into SIGINT; the prefill of ~7000 positions takes seconds.
    pty.expect("\x1b[?2004l", T);
    pty.pump_for(Duration::from_millis(100));
    pty.send(b"\x03");
    pty.expect(
        "[interrupted (Ctrl-C): this turn is discarded, nothing stored]",
        T,
    );
    pty.prompt(T);
    // Ctrl-D on an empty line quits with exit code 0.
    pty.send(b"\x04");
    let st = pty.wait_exit(T);
    assert_eq!(st.code(), Some(0), "{}", pty.all_output());

    // --- the history file: private, system + two complete turns, nothing else ---
    assert_eq!(mode(&hist), 0o600);
    let msgs = history::load_jsonl(&hist).expect("history loads");
    let roles: Vec<Role> = msgs.iter().map(|m| m.role).collect();
    assert_eq!(
        roles,
        [
            Role::System,
            Role::User,
            Role::Assistant,
            Role::User,
            Role::Assistant
        ]
    );
    assert_eq!(msgs[0], Message::system("Be brief."));
    assert_eq!(msgs[1].content, "hello");
    assert_eq!(msgs[3].content, "second", "Ctrl-C must have cleared 'xyz'");
    // The stored records are what was printed, channel by channel.
    for (turn, rec) in [(&turn1, &msgs[2]), (&turn2, &msgs[4])] {
        let reasoning = rec.reasoning_content.as_deref().expect("reasoning stored");
        if !reasoning.is_empty() {
            assert!(
                turn.contains(&format!("[think]\n{}", shown(reasoning))),
                "printed turn lacks its think channel:\n{turn}\nrecord: {rec:?}"
            );
        }
        if !rec.content.is_empty() {
            assert!(
                turn.contains(&format!("[response]\n{}", shown(&rec.content))),
                "printed turn lacks its response channel:\n{turn}\nrecord: {rec:?}"
            );
        }
    }

    // --- restart: the history is re-rendered and re-prefilled; turn 3 reuses all of it ---
    let want = render_ids(&hist, &model, &["--no-generation-prompt"]).len();
    let mut pty = Pty::spawn(&mut chat_cmd(
        &model,
        &[
            OsStr::new("--gen"),
            OsStr::new("8"),
            OsStr::new("--history"),
            h,
            OsStr::new("--incremental"),
        ],
    ));
    pty.expect("history: ", T);
    pty.expect("(5 records;", T);
    let pre = pty.expect(" total", T);
    assert_eq!(
        number_after(&pre, "(transcript) [prefill: reused 0 positions, fed "),
        want,
        "the restart prefill must be exactly render-chat's ids of the history"
    );
    pty.prompt(T);
    pty.send(b"third\r");
    let pre = pty.expect(" total", T);
    assert_eq!(number_after(&pre, "[prefill: reused "), want, "{pre}");
    pty.expect(" tok/s); context ", T);
    pty.prompt(T);
    pty.send(b"/exit\r");
    assert_eq!(pty.wait_exit(T).code(), Some(0));
    let msgs = history::load_jsonl(&hist).expect("history loads");
    assert_eq!(msgs.len(), 7);
    assert_eq!(msgs[5], Message::user("third"));

    // --- a different --system is refused with a clear error; the file is untouched ---
    let before = std::fs::read(&hist).expect("read");
    let mut pty = Pty::spawn(&mut chat_cmd(
        &model,
        &[
            OsStr::new("--history"),
            h,
            OsStr::new("--system"),
            OsStr::new("Be verbose."),
        ],
    ));
    let st = pty.wait_exit(T);
    assert_eq!(st.code(), Some(2));
    assert!(
        pty.all_output().contains("--system does not match"),
        "{}",
        pty.all_output()
    );
    assert_eq!(std::fs::read(&hist).expect("read"), before);
}

#[test]
fn pty_reset_archives_the_history_and_starts_over() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = synth_model(dir.path());
    let hist = dir.path().join("r.jsonl");
    let mut pty = Pty::spawn(&mut chat_cmd(
        &model,
        &[
            OsStr::new("--gen"),
            OsStr::new("6"),
            OsStr::new("--no-think"),
            OsStr::new("--history"),
            hist.as_os_str(),
            OsStr::new("--system"),
            OsStr::new("S"),
            OsStr::new("--incremental"),
        ],
    ));
    pty.prompt(T);
    pty.send(b"one\r");
    pty.expect(" tok/s); context ", T);
    pty.prompt(T);
    pty.send(b"/reset\r");
    pty.expect("[new conversation; the previous history is in ", T);
    pty.prompt(T);
    pty.send(b"two\r");
    // After /reset nothing of the old state is reused.
    let pre = pty.expect(" total", T);
    assert_eq!(number_after(&pre, "[prefill: reused "), 0, "{pre}");
    pty.expect(" tok/s); context ", T);
    pty.prompt(T);
    pty.send(b"/exit\r");
    assert_eq!(pty.wait_exit(T).code(), Some(0));

    let archived = dir.path().join("r.jsonl.reset-1");
    let old = history::load_jsonl(&archived).expect("archive loads");
    let new = history::load_jsonl(&hist).expect("new history loads");
    assert_eq!(old.len(), 3);
    assert_eq!(old[1], Message::user("one"));
    assert_eq!(new.len(), 3);
    assert_eq!(new[0], Message::system("S"));
    assert_eq!(new[1], Message::user("two"));
    assert_eq!(new[2].role, Role::Assistant);
    // --no-think: the reply has no thinking channel.
    assert_eq!(new[2].reasoning_content.as_deref(), Some(""));
    assert_eq!(mode(&hist), 0o600);
    assert_eq!(mode(&archived), 0o600);
}
