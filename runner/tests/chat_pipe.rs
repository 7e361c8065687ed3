//! The `--chat` REPL scripted through a pipe (stdin not a terminal): seeded sampling
//! reproduces per turn, incremental reuse changes nothing, history validation, context
//! limits, and models that cannot chat (nor serve). Small synthetic model, small `--gen`.

mod chat_support;

use std::path::Path;
use std::process::ExitStatus;

use chat_support::{chat_piped, number_after, render_ids, synth_model};
use k3_text::chat::{Message, Role};
use k3_text::history;

fn chat(model: &Path, hist: &Path, extra: &[&str], stdin: &str) -> (ExitStatus, String, String) {
    chat_piped(model, hist, extra, stdin)
}

#[test]
fn seeded_sampling_reproduces_per_turn_and_after_a_restart() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = synth_model(dir.path());
    let flags = ["--seed", "7", "--temperature", "1.5", "--gen", "12"];
    let a = dir.path().join("a.jsonl");
    let b = dir.path().join("b.jsonl");
    let (st, out, err) = chat(&model, &a, &flags, "one\ntwo\n");
    assert!(st.success(), "{out}\n{err}");
    assert!(
        out.contains("sampling: temperature 1.5, top-p 0.95, seed 7"),
        "{out}"
    );
    // Piped input is echoed so a scripted transcript reads like a session.
    assert!(out.contains("> one\n") && out.contains("> two\n"), "{out}");
    let (st, _, err) = chat(&model, &b, &flags, "one\ntwo\n");
    assert!(st.success(), "{err}");
    let ha = std::fs::read(&a).expect("a");
    assert_eq!(
        ha,
        std::fs::read(&b).expect("b"),
        "same seed, same transcript"
    );
    let msgs = history::load_jsonl(&a).expect("load");
    assert_eq!(msgs.len(), 4);

    // Resume from turn 1 only: turn 2 (stream 1 of seed 7) comes out identical.
    let c = dir.path().join("c.jsonl");
    history::append_records(&c, &msgs[..2]).expect("write c");
    let (st, out, err) = chat(&model, &c, &flags, "two\n");
    assert!(st.success(), "{out}\n{err}");
    assert_eq!(std::fs::read(&c).expect("c"), ha, "resumed turn 2 differs");

    // Another seed gives other replies; greedy ignores the sampling flags.
    let d = dir.path().join("d.jsonl");
    let (st, _, _) = chat(
        &model,
        &d,
        &["--seed", "8", "--temperature", "1.5", "--gen", "12"],
        "one\n",
    );
    assert!(st.success());
    let other = history::load_jsonl(&d).expect("load d");
    assert_ne!(other[1], msgs[1], "seed 8 reproduced seed 7's reply");
    let g1 = dir.path().join("g1.jsonl");
    let g2 = dir.path().join("g2.jsonl");
    chat(&model, &g1, &["--gen", "12"], "one\n");
    let (_, out, _) = chat(
        &model,
        &g2,
        &[
            "--gen",
            "12",
            "--greedy",
            "--seed",
            "7",
            "--temperature",
            "1.5",
        ],
        "one\n",
    );
    assert!(out.contains("; greedy; "), "{out}");
    assert_eq!(
        std::fs::read(&g1).expect("g1"),
        std::fs::read(&g2).expect("g2")
    );
}

#[test]
fn incremental_reuse_gives_the_same_replies_as_full_prefill() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = synth_model(dir.path());
    let script = "first question\nsecond question\n";
    let full = dir.path().join("full.jsonl");
    let inc = dir.path().join("inc.jsonl");
    let (st, out_full, _) = chat(&model, &full, &["--gen", "10", "--no-think"], script);
    assert!(st.success());
    assert!(!out_full.contains("(transcript) [prefill"), "{out_full}");
    let (st, out_inc, _) = chat(
        &model,
        &inc,
        &["--gen", "10", "--no-think", "--incremental"],
        script,
    );
    assert!(st.success());
    // Nothing to prefill at start (no system prompt, no effort message without thinking).
    assert!(!out_inc.contains("(transcript)"), "{out_inc}");
    assert_eq!(
        std::fs::read(&full).expect("full"),
        std::fs::read(&inc).expect("inc")
    );

    // Restart both on the stored history and add a turn: the incremental run re-prefills
    // exactly the rendered history at start, reuses all of it for the new turn, and still
    // agrees with the full prefill.
    let want = render_ids(&inc, &model, &["--no-think", "--no-generation-prompt"]).len();
    let (_, out_full, _) = chat(&model, &full, &["--gen", "10", "--no-think"], "third\n");
    let (_, out_inc, _) = chat(
        &model,
        &inc,
        &["--gen", "10", "--no-think", "--incremental"],
        "third\n",
    );
    assert_eq!(
        number_after(&out_inc, "(transcript) [prefill: reused 0 positions, fed "),
        want,
        "{out_inc}"
    );
    assert_eq!(number_after(&out_inc, "> third\n[prefill: reused "), want);
    assert!(
        out_full.contains("> third\n[prefill: reused 0 positions"),
        "{out_full}"
    );
    assert_eq!(
        std::fs::read(&full).expect("full"),
        std::fs::read(&inc).expect("inc")
    );
    assert_eq!(history::load_jsonl(&inc).expect("load").len(), 6);
}

#[test]
fn corrupt_history_is_reported_with_its_line_and_left_alone() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = synth_model(dir.path());
    let h = dir.path().join("bad.jsonl");
    let bytes =
        b"{\"role\":\"user\",\"content\":\"hi\"}\n{\"role\":\"wizard\",\"content\":\"x\"}\n";
    std::fs::write(&h, bytes).expect("write");
    let (st, out, err) = chat(&model, &h, &["--gen", "4"], "hello\n");
    assert_eq!(st.code(), Some(2), "{out}\n{err}");
    assert!(err.contains("bad.jsonl:2:"), "{err}");
    assert_eq!(std::fs::read(&h).expect("read"), bytes);

    // A torn last line (no newline) is refused too, and not repaired.
    let torn = b"{\"role\":\"user\",\"content\":\"hi\"}\n{\"role\":\"assistant\",\"con";
    std::fs::write(&h, torn).expect("write");
    let (st, _, err) = chat(&model, &h, &["--gen", "4"], "hello\n");
    assert_eq!(st.code(), Some(2));
    assert!(err.contains("bad.jsonl:2:"), "{err}");
    assert_eq!(std::fs::read(&h).expect("read"), torn);
}

#[test]
fn context_limits_refuse_the_turn_and_keep_the_history() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = synth_model(dir.path());
    let h = dir.path().join("ctx.jsonl");
    // Prompt of the first turn, measured with render-chat on the would-be transcript.
    let probe = dir.path().join("probe.jsonl");
    history::append_records(&probe, &[Message::user("hello")]).expect("probe");
    let p = render_ids(&probe, &model, &["--no-think"]).len();

    // Context smaller than the prompt: refused before any work, REPL continues.
    let small = (p - 1).to_string();
    let (st, out, err) = chat(
        &model,
        &h,
        &["--no-think", "--max-context", &small, "--gen", "4"],
        "hello\n/help\n",
    );
    assert!(st.success(), "{out}\n{err}");
    assert!(
        out.contains(&format!(
            "[the conversation needs {p} positions but the context is planned for {}",
            p - 1
        )),
        "{out}"
    );
    assert!(out.contains("Commands:"), "the REPL must continue:\n{out}");
    assert_eq!(history::load_jsonl(&h).expect("load").len(), 0);

    // Context exactly the prompt: the first token is generated, feeding it overflows. The
    // turn is discarded (unless the first token happened to end the message).
    let exact = p.to_string();
    let (st, out, _) = chat(
        &model,
        &h,
        &["--no-think", "--max-context", &exact, "--gen", "8"],
        "hello\n",
    );
    assert!(st.success());
    let msgs = history::load_jsonl(&h).expect("load");
    if out.contains("[end of message; 1 tokens") || out.contains("[stop id ") {
        assert_eq!(msgs.len(), 2);
    } else {
        assert!(
            out.contains(&format!("[context full at {p} positions (--max-context)")),
            "{out}"
        );
        assert!(msgs.is_empty(), "{msgs:?}");
    }
}

#[test]
fn models_and_flags_that_cannot_chat_are_refused_clearly() {
    let dir = tempfile::tempdir().expect("tempdir");
    // tiny.toml has vocabulary 256: its special ids (from 256) cannot be embedded.
    let tiny = dir.path().join("tiny");
    let st = std::process::Command::new(chat_support::bin())
        .args(["synth", "--seed", "1", "--quiet", "--spec"])
        .arg(chat_support::repo().join("configs/synth/tiny.toml"))
        .arg("--out")
        .arg(&tiny)
        .output()
        .expect("synth tiny");
    assert!(st.status.success());
    let h = dir.path().join("t.jsonl");
    let (st, _, err) = chat(&tiny, &h, &[], "hi\n");
    assert_eq!(st.code(), Some(2));
    assert!(
        err.contains("outside the model's vocabulary of 256 ids"),
        "{err}"
    );
    // The server refuses it at start, before listening, one request at a time or batched.
    for extra in [&[][..], &["--serve-batch", "2"][..]] {
        let o = std::process::Command::new(chat_support::bin())
            .arg(&tiny)
            .args(["--serve", "127.0.0.1:0"])
            .args(extra)
            .output()
            .expect("run --serve");
        let (out, err) = (
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr),
        );
        assert_eq!(o.status.code(), Some(2), "{extra:?}: {out}{err}");
        assert!(!out.contains("listening"), "{extra:?}: {out}");
        assert!(err.contains("outside the model's vocabulary"), "{err}");
    }

    let model = synth_model(dir.path());
    for (flags, needle) in [
        (&["--thinking-effort", "medium"][..], "medium"),
        (&["--top-p", "1.5"][..], "--top-p 1.5"),
        (&["--gen", "5000"][..], "--gen 5000"),
        (&["--ids", "1,2"][..], "--chat reads its input"),
    ] {
        let (st, _, err) = chat(&model, &h, flags, "hi\n");
        assert_eq!(st.code(), Some(2), "{flags:?}: {err}");
        assert!(err.contains(needle), "{flags:?}: {err}");
    }
    // Chat flags without --chat are a usage error.
    let out = std::process::Command::new(chat_support::bin())
        .arg(&model)
        .args(["--ids", "1", "--seed", "3"])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));

    // A literal control marker typed by the user is stored and rendered as plain text.
    let (st, _, err) = chat(
        &model,
        &h,
        &["--gen", "2", "--no-think"],
        "a <|end_of_msg|> b\n",
    );
    assert!(st.success(), "{err}");
    let msgs = history::load_jsonl(&h).expect("load");
    assert_eq!(msgs[0], Message::user("a <|end_of_msg|> b"));
    assert_eq!(msgs[1].role, Role::Assistant);
    let ids = render_ids(&h, &model, &["--no-think"]);
    let tok = k3_text::tokenizer::Tokenizer::load(&model).expect("tokenizer");
    let eom = tok.id_of("<|end_of_msg|>").expect("end_of_msg id");
    let n_eom = ids.iter().filter(|&&i| i == eom).count();
    assert_eq!(n_eom, 2, "only the two records' own ends are control ids");
}

#[test]
fn reset_keeps_the_stored_system_prompt_and_piped_eof_quits() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = synth_model(dir.path());
    let h = dir.path().join("s.jsonl");
    history::append_records(&h, &[Message::system("Stored.")]).expect("write");
    // No --system: the stored one is used, and /reset starts over with it.
    let (st, out, err) = chat(
        &model,
        &h,
        &["--gen", "3", "--no-think"],
        "one\n/reset\ntwo\n",
    );
    assert!(st.success(), "{out}\n{err}");
    assert!(out.contains("[new conversation; the previous history is in "));
    let old = history::load_jsonl(&dir.path().join("s.jsonl.reset-1")).expect("archive");
    let new = history::load_jsonl(&h).expect("new");
    assert_eq!(old[0], Message::system("Stored."));
    assert_eq!(old[1], Message::user("one"));
    assert_eq!(new[0], Message::system("Stored."));
    assert_eq!(new[1], Message::user("two"));
    assert_eq!(new.len(), 3);
}
