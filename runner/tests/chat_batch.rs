//! `k3_run::chat::batch` (the server's continuous batching) on a synthetic chat model
//! in-process: requests admitted at different steps, with prompts longer than a prefill chunk,
//! greedy and sampled, give exactly the ids, replies and stops of the same turns run alone by
//! `Session::turn`; streamed text adds up to the reply; a free slot's state is reused as a
//! chat session reuses its own; a full context and a departed client end only their request.

mod chat_support;

use std::sync::atomic::AtomicBool;

use k3_engine::exec::{Executor, PREFILL_CHUNK, Providers, SeqState};
use k3_engine::plan::Plan;
use k3_models::spec::ModelSpec;
use k3_run::chat::batch::{Batcher, Finished, Job};
use k3_run::chat::sample::Sampling;
use k3_run::chat::session::{Event, Session, SessionConfig, Stop, TurnOutcome};
use k3_text::chat::{Message, Role};
use k3_text::reply::Channel;
use k3_text::tokenizer::Tokenizer;

use chat_support::{resident, synth_chat_model};

fn config(n_gen: usize, sampling: Sampling, incremental: bool) -> SessionConfig {
    chat_support::session_config(n_gen, sampling, incremental)
}

/// A request: the conversation (ending with the user's message), its limit and sampling.
struct Req {
    messages: Vec<Message>,
    n_gen: usize,
    sampling: Sampling,
}

fn turn_index(messages: &[Message]) -> u64 {
    messages
        .iter()
        .filter(|m| m.role == Role::Assistant)
        .count() as u64
}

/// The request served alone: a fresh session on its history, one turn.
fn alone(
    spec: &ModelSpec,
    model: &std::path::Path,
    exec: &mut Executor<'_>,
    w: &mut Providers<'_>,
    r: &Req,
) -> TurnOutcome {
    let tok = Tokenizer::load(model).expect("tokenizer");
    let (history, user) = r.messages.split_at(r.messages.len() - 1);
    let mut s = Session::new(
        spec,
        tok,
        config(r.n_gen, r.sampling, false),
        history.to_vec(),
    )
    .expect("session");
    s.turn(
        exec,
        w,
        &user[0].content,
        &AtomicBool::new(false),
        &mut |_| {},
    )
    .expect("turn")
}

/// What a sink collected: (request index, think text, response text).
type Sink = (usize, String, String);

fn collect(sink: &mut Sink, ev: Event<'_>) {
    if let Event::Text { channel, text } = ev {
        match channel {
            Channel::Think => sink.1.push_str(text),
            Channel::Response => sink.2.push_str(text),
            _ => {}
        }
    }
}

fn job(b: &Batcher<'_, Sink>, i: usize, r: &Req) -> Job<Sink> {
    Job {
        prompt: b.render(&r.messages).expect("render"),
        n_gen: r.n_gen,
        sampling: r.sampling,
        turn_index: turn_index(&r.messages),
        sink: (i, String::new(), String::new()),
    }
}

fn assert_same(what: &str, got: &TurnOutcome, want: &TurnOutcome) {
    assert_eq!(got.generated, want.generated, "{what}: ids");
    assert_eq!(got.stop, want.stop, "{what}: stop");
    assert_eq!(got.reply.content, want.reply.content, "{what}: content");
    assert_eq!(
        got.reply.reasoning_content, want.reply.reasoning_content,
        "{what}: reasoning"
    );
    assert_eq!(
        (got.prefill.total, got.prefill.reused + got.prefill.fed),
        (want.prefill.total, want.prefill.total),
        "{what}: prompt positions"
    );
}

#[test]
fn batched_requests_equal_the_same_turns_alone() {
    let (_dir, model, spec, ckpt) = synth_chat_model();
    let mut w = resident(&spec, &ckpt);
    let mut exec = Executor::new(&spec, Plan::new(&spec, 4096), 1);
    let long =
        "a longer question, so that its prompt needs more than one prefill chunk: ".repeat(3);
    let sample = |seed| Sampling::Sample {
        temperature: 1.3,
        top_p: 0.9,
        seed,
    };
    let reqs = [
        Req {
            messages: vec![Message::system("S"), Message::user("hi")],
            n_gen: 24,
            sampling: Sampling::Greedy,
        },
        Req {
            messages: vec![Message::user(&long)],
            n_gen: 16,
            sampling: sample(5),
        },
        Req {
            messages: vec![
                Message::user("one"),
                Message::assistant("first answer", "thought"),
                Message::user("two"),
            ],
            n_gen: 30,
            sampling: sample(9),
        },
        Req {
            messages: vec![Message::user("x")],
            n_gen: 3,
            sampling: Sampling::Greedy,
        },
        Req {
            messages: vec![
                Message::user(&long),
                Message::assistant("ok", ""),
                Message::user("and?"),
            ],
            n_gen: 20,
            sampling: Sampling::Greedy,
        },
    ];
    let want: Vec<TurnOutcome> = reqs
        .iter()
        .map(|r| alone(&spec, &model, &mut exec, &mut w, r))
        .collect();
    assert!(
        want.iter().any(|o| o.generated.len() > 3),
        "the reference turns should decode several ids"
    );

    let tok = Tokenizer::load(&model).expect("tokenizer");
    let cfg = config(1, Sampling::Greedy, false);
    let mut b: Batcher<'_, Sink> = Batcher::new(&spec, tok, cfg, 3, 4096).expect("batcher");
    assert!(
        b.render(&reqs[1].messages).unwrap().len() > PREFILL_CHUNK,
        "the long prompt should span prefill chunks"
    );
    // Arrivals: request i may be admitted from step `at[i]` on, when a slot is free.
    let at = [0, 2, 2, 3, 5];
    let mut next = 0;
    let mut got: Vec<Option<Finished<Sink>>> = (0..reqs.len()).map(|_| None).collect();
    let mut step = 0;
    while got.iter().any(Option::is_none) {
        while next < reqs.len() && at[next] <= step && b.has_room() {
            b.admit(job(&b, next, &reqs[next])).expect("admit");
            next += 1;
        }
        assert!(!b.is_idle(), "step {step}: nothing running");
        for f in b
            .step(&mut exec, &mut w, &mut |s, ev| {
                collect(s, ev);
                true
            })
            .expect("step")
        {
            let i = f.sink.0;
            got[i] = Some(f);
        }
        step += 1;
        assert!(step < 500, "the batch does not finish");
    }
    let mut most = 0;
    for (i, (f, want)) in got.iter().zip(&want).enumerate() {
        let f = f.as_ref().unwrap();
        let o = f.outcome.as_ref().expect("outcome");
        assert_same(&format!("request {i}"), o, want);
        // The streamed text is the reply.
        assert_eq!(
            (&f.sink.1, &f.sink.2),
            (&o.reply.reasoning_content, &o.reply.content),
            "request {i}: streamed text"
        );
        most = most.max(f.max_batch);
    }
    assert_eq!(most, 3, "three requests should have shared steps");
    assert!(b.is_idle());
    assert_states_are_their_ids(&spec, &mut exec, &mut w, &b);
}

#[test]
fn reuse_context_full_and_a_departed_client() {
    let (_dir, model, spec, ckpt) = synth_chat_model();
    let mut w = resident(&spec, &ckpt);
    let mut exec = Executor::new(&spec, Plan::new(&spec, 4096), 1);
    let tok = || Tokenizer::load(&model).expect("tokenizer");
    let run_all = |b: &mut Batcher<'_, Sink>,
                   exec: &mut Executor<'_>,
                   w: &mut Providers<'_>,
                   gone: Option<usize>| {
        let mut out = Vec::new();
        while !b.is_idle() {
            out.extend(
                b.step(exec, w, &mut |s, ev| {
                    let keep = !(gone == Some(s.0) && matches!(ev, Event::Text { .. }));
                    collect(s, ev);
                    keep
                })
                .expect("step"),
            );
        }
        out.sort_by_key(|f: &Finished<Sink>| f.sink.0);
        out
    };

    // Reuse: after a request, its slot holds the prompt and every generated id but the last;
    // a later prompt that extends them feeds only the rest, and gives the ids a fresh state
    // gives. Another request takes the other slot first (it must not take the held state).
    let first = Req {
        messages: vec![Message::system("S"), Message::user("hello there")],
        n_gen: 12,
        sampling: Sampling::Greedy,
    };
    let o1 = alone(&spec, &model, &mut exec, &mut w, &first);
    let mut b: Batcher<'_, Sink> =
        Batcher::new(&spec, tok(), config(1, Sampling::Greedy, true), 2, 4096).expect("batcher");
    let p1 = b.render(&first.messages).unwrap();
    b.admit(job(&b, 0, &first)).unwrap();
    let r1 = run_all(&mut b, &mut exec, &mut w, None);
    let got1 = r1[0].outcome.as_ref().unwrap();
    assert_same("first", got1, &o1);
    let held: Vec<u32> = p1
        .iter()
        .chain(&got1.generated[..got1.generated.len() - 1])
        .copied()
        .collect();
    assert!(
        b.slots().any(|(fed, _)| fed == held.as_slice()),
        "the slot keeps its ids"
    );
    let tail = b.render(&[Message::user("more")]).unwrap();
    let raw = |i| Job {
        prompt: held.iter().chain(&tail).copied().collect(),
        n_gen: 10,
        sampling: Sampling::Greedy,
        turn_index: 0,
        sink: (i, String::new(), String::new()),
    };
    b.admit(job(&b, 1, &reqs_x())).unwrap();
    b.admit(raw(2)).unwrap();
    let r2 = run_all(&mut b, &mut exec, &mut w, None);
    let reused = r2[1].outcome.as_ref().unwrap();
    assert_eq!(
        (reused.prefill.reused, reused.prefill.fed),
        (held.len(), tail.len())
    );
    let mut fresh: Batcher<'_, Sink> =
        Batcher::new(&spec, tok(), config(1, Sampling::Greedy, false), 2, 4096).expect("batcher");
    fresh.admit(raw(2)).unwrap();
    let r3 = run_all(&mut fresh, &mut exec, &mut w, None);
    let want = r3[0].outcome.as_ref().unwrap();
    assert_eq!(want.prefill.reused, 0);
    assert_same("reused state", reused, want);
    assert_states_are_their_ids(&spec, &mut exec, &mut w, &b);

    // A full context ends the request as a chat turn ends (same ids); a client that goes
    // away after its first text ends as interrupted; the other request is unaffected.
    let req = Req {
        messages: vec![Message::user("fill")],
        n_gen: 50,
        sampling: Sampling::Greedy,
    };
    let probe: Batcher<'_, Sink> =
        Batcher::new(&spec, tok(), config(1, Sampling::Greedy, false), 1, 4096).expect("batcher");
    let n_prompt = probe.render(&req.messages).unwrap().len();
    let max = n_prompt + 4;
    let mut small = Executor::new(&spec, Plan::new(&spec, max), 1);
    let want = alone(&spec, &model, &mut small, &mut w, &req);
    let mut b: Batcher<'_, Sink> =
        Batcher::new(&spec, tok(), config(1, Sampling::Greedy, false), 2, max).expect("batcher");
    b.admit(job(&b, 0, &req)).unwrap();
    b.admit(job(&b, 1, &reqs_x())).unwrap();
    let r = run_all(&mut b, &mut small, &mut w, Some(1));
    let full = r[0].outcome.as_ref().unwrap();
    if want.stop != Stop::EndOfMessage {
        assert_eq!(want.stop, Stop::ContextFull { max });
    }
    assert_same("context full", full, &want);
    let gone = r[1].outcome.as_ref().unwrap();
    let plain = alone(&spec, &model, &mut small, &mut w, &reqs_x());
    assert!(
        plain.generated.starts_with(&gone.generated),
        "the departed client's ids are a prefix of its turn alone"
    );
    if gone.stop == Stop::Interrupted {
        // Ended right after its first text.
        assert!(!(r[1].sink.1.is_empty() && r[1].sink.2.is_empty()));
        assert!(gone.generated.len() < plain.generated.len() || plain.stop != Stop::Interrupted);
    } else {
        // Its first text came with the id that ended the turn anyway (or there was none).
        assert_eq!((gone.stop, &gone.generated), (plain.stop, &plain.generated));
    }

    // A prompt longer than the context is refused at admission, the batcher unchanged.
    let huge = Req {
        messages: vec![Message::user(&"z ".repeat(max))],
        n_gen: 1,
        sampling: Sampling::Greedy,
    };
    let (sink, e) = b.admit(job(&b, 7, &huge)).unwrap_err();
    assert_eq!(sink.0, 7);
    assert!(e.to_string().contains("positions"), "{e}");
    assert!(b.is_idle());
}

/// A short request used beside the others.
fn reqs_x() -> Req {
    Req {
        messages: vec![Message::user("x y")],
        n_gen: 6,
        sampling: Sampling::Greedy,
    }
}

/// Every slot's state equals, bit for bit, a fresh state fed its ids (the ids alone say
/// little on this small random model, whose next id depends mostly on the last few).
fn assert_states_are_their_ids(
    spec: &ModelSpec,
    exec: &mut Executor<'_>,
    w: &mut Providers<'_>,
    b: &Batcher<'_, Sink>,
) {
    let mut checked = 0;
    for (fed, st) in b.slots() {
        let mut fresh = SeqState::new(spec);
        let mut logits = vec![0.0; spec.vocab_size];
        for c in fed.chunks(PREFILL_CHUNK) {
            exec.prefill(c, &mut fresh, w, &mut logits)
                .expect("prefill");
        }
        assert!(st.same_bits(&fresh), "a slot's state is not its ids' state");
        checked += usize::from(!fed.is_empty());
    }
    assert!(checked > 0);
}
