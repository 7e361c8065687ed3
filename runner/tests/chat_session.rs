//! `k3_run::chat::session` on a synthetic model in-process: the stop rules and the commit
//! rule of a turn, interruption during decoding, and what an incremental session reuses.

mod chat_support;

use std::sync::atomic::{AtomicBool, Ordering};

use k3_engine::exec::{Executor, Providers};
use k3_engine::plan::Plan;
use k3_run::chat::sample::Sampling;
use k3_run::chat::session::{Event, Session, SessionConfig, Stop};
use k3_text::chat::{Message, RenderOptions};
use k3_text::tokenizer::Tokenizer;

use chat_support::{resident, synth_chat_model};

fn config(n_gen: usize, incremental: bool) -> SessionConfig {
    chat_support::session_config(n_gen, Sampling::Greedy, incremental)
}

#[test]
fn turn_stops_commit_rule_interrupt_and_reuse() {
    let (_dir, model, spec, ckpt) = synth_chat_model();
    let mut w = resident(&spec, &ckpt);
    let mut exec = Executor::new(&spec, Plan::new(&spec, 4096), 1);
    let tok = || Tokenizer::load(&model).expect("tokenizer");
    let never = AtomicBool::new(false);
    let system = vec![Message::system("S")];

    // Greedy, 3 tokens: the first generated id is deterministic.
    let mut s = Session::new(&spec, tok(), config(3, false), system.clone()).expect("session");
    let o = s
        .turn(&mut exec, &mut w, "hi", &never, &mut |_| {})
        .expect("turn");
    let first = o.generated[0];
    assert!(o.stop == Stop::GenLimit || o.stop == Stop::EndOfMessage);
    assert!(o.generated.len() <= 3);
    assert!(o.records.is_some(), "a --gen limited turn is committed");
    // The transcript only changes on commit.
    assert_eq!(s.messages(), &system[..]);

    // A stop id ends the turn before the parser sees it; the turn is committed.
    if first != s.end_of_msg_id() {
        let mut cfg = config(3, false);
        cfg.extra_stop_ids = vec![first];
        let mut s2 = Session::new(&spec, tok(), cfg, system.clone()).expect("session");
        let o = s2
            .turn(&mut exec, &mut w, "hi", &never, &mut |_| {})
            .expect("turn");
        assert_eq!(o.stop, Stop::StopId(first));
        assert_eq!(o.generated, [first]);
        assert_eq!(o.reply.reasoning_content, "");
        assert!(o.records.is_some());
    }

    // Interrupt raised while decoding (from the first streamed event after the prefill):
    // the turn stops after that token and is not committed.
    let mut s3 = Session::new(&spec, tok(), config(64, true), system.clone()).expect("session");
    let pre = s3
        .prefill_transcript(&mut exec, &mut w, &never)
        .expect("prefill")
        .expect("incremental prefills");
    let want = k3_text::chat::render_prompt(
        &system,
        &RenderOptions {
            add_generation_prompt: false,
            ..RenderOptions::default()
        },
    )
    .expect("render")
    .render_ids(&tok())
    .expect("ids")
    .len();
    assert_eq!((pre.reused, pre.fed, pre.total), (0, want, want));
    assert_eq!(s3.positions(), want);
    let flag = AtomicBool::new(false);
    let mut prefilled = None;
    let o = s3
        .turn(&mut exec, &mut w, "hi", &flag, &mut |ev| match ev {
            Event::Prefilled(p) => prefilled = Some(p),
            Event::Text { .. } => flag.store(true, Ordering::Relaxed),
        })
        .expect("turn");
    let p = prefilled.expect("prefill event");
    assert_eq!(p.reused, want, "the turn reuses the transcript prefill");
    assert_eq!(p.reused + p.fed, p.total);
    if o.stop != Stop::EndOfMessage {
        assert_eq!(o.stop, Stop::Interrupted);
        assert!(o.records.is_none(), "an interrupted turn is discarded");
        // Decoding stopped right after the first token that produced text.
        assert!(o.generated.len() < 64);
    }
    // The state now holds the discarded turn: the next turn cannot reuse it and starts over.
    let o = s3
        .turn(&mut exec, &mut w, "again", &never, &mut |_| {})
        .expect("turn");
    assert_eq!(o.prefill.reused, 0);
    if let Some(r) = o.records {
        s3.commit(r);
    }
    assert_eq!(s3.next_turn_index(), 1);

    // A prompt longer than the planned context is refused before any work.
    let mut small = Executor::new(&spec, Plan::new(&spec, 16), 1);
    let mut s4 = Session::new(&spec, tok(), config(4, true), system.clone()).expect("session");
    let e = s4
        .turn(&mut small, &mut w, "hi", &never, &mut |_| {})
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("but the context is planned for 16 (--max-context)"),
        "{e}"
    );
    assert_eq!(s4.positions(), 0);
}

const MAX_CTX: usize = 1755;

/// `--speculate` in the chat session: greedy turns with guesses verified in one pass give the
/// same ids, stop reasons and replies as plain turns, over several incremental turns (the
/// state each turn leaves is reused by the next, so a wrong state would change later turns),
/// with the context filling up in the last turn.
#[test]
fn speculative_turns_equal_plain_turns() {
    let (_dir, model, spec, ckpt) = synth_chat_model();
    let mut w = resident(&spec, &ckpt);
    let tok = || Tokenizer::load(&model).expect("tokenizer");
    let never = AtomicBool::new(false);
    let users = [
        "abc abc abc abc",
        "one two one two one two",
        "the the the",
        "x y z x y z x y z",
    ];
    let run = |speculate: Option<usize>, w: &mut Providers<'_>| {
        // A context that fills up during the last turns.
        let mut exec = Executor::new(&spec, Plan::new(&spec, MAX_CTX), 1);
        let mut cfg = config(48, true);
        cfg.speculate = k3_engine::speculate::from_flag(speculate).expect("K");
        let mut s = Session::new(&spec, tok(), cfg, vec![Message::system("S")]).expect("session");
        let mut out = Vec::new();
        let mut stats = k3_engine::speculate::SpecStats::default();
        for u in users {
            let o = match s.turn(&mut exec, w, u, &never, &mut |_| {}) {
                Ok(o) => o,
                Err(e) => {
                    // The transcript no longer fits: the same refusal either way.
                    out.push((Vec::new(), Stop::Interrupted, e.to_string(), s.positions()));
                    break;
                }
            };
            if let Some(st) = &o.speculation {
                stats.passes += st.passes;
                stats.drafted += st.drafted;
                stats.accepted += st.accepted;
                stats.rewinds += st.rewinds;
            }
            out.push((
                o.generated.clone(),
                o.stop,
                o.reply.content.clone(),
                s.positions(),
            ));
            if let Some(r) = o.records {
                s.commit(r);
            }
        }
        (out, stats)
    };
    let (plain, none) = run(None, &mut w);
    assert_eq!(none, k3_engine::speculate::SpecStats::default());
    for k in [2, 5] {
        let (got, stats) = run(Some(k), &mut w);
        assert_eq!(got, plain, "K {k}");
        // Guesses were made, some held (turn 3 repeats turn 2's opening) and some not.
        assert!(stats.accepted > 0 && stats.rewinds > 0, "K {k}: {stats:?}");
    }
    assert!(
        plain
            .iter()
            .any(|(_, stop, _, _)| matches!(stop, Stop::ContextFull { .. })),
        "the context should fill up: {plain:?}"
    );
}
