//! One chat conversation on a loaded model: the transcript, the model state that has been fed
//! and the generation of one assistant turn. No terminal here, so tests drive it directly.
//!
//! Owns: [`Session`] (transcript + tokenizer + render options + the fed ids and their
//! [`SeqState`]), prefix reuse (`--incremental`), one assistant turn ([`Session::turn`]):
//! render → prefill → sample → stream channel text → stop, and the commit rule.
//! Must not: print, read input, touch the history file (the REPL does, and commits a turn to
//! the session only after the file append succeeded), or do model math.
//!
//! Rules (docs/DESIGN.md §7, issue 5):
//! - The prompt of a turn is the whole transcript plus the new user message plus the
//!   generation prompt, rendered by k3-text (XTML, released revision c5d1dd4).
//! - With `incremental` the live state is reused when the new prompt ids start exactly with
//!   the ids already fed; only the tail is prefilled. Any mismatch (or `incremental` off)
//!   starts from a fresh state. Opaque KV/MLA/KDA state is never serialised: a restarted REPL
//!   re-prefills the re-rendered history.
//! - Within a turn decoding always keeps the state (one step per generated token).
//! - Generation stops on `<|end_of_msg|>` (from the tokenizer), on the config's eos ids and
//!   the `--stop-id`s, at the `--gen` limit, on the interrupt flag (Ctrl-C) or when the
//!   planned context is full. The stop token itself is not fed.
//! - A turn stopped by end of message, a stop id or the `--gen` limit is committed (user +
//!   assistant record). A turn stopped by Ctrl-C or by a full context is discarded whole:
//!   neither the user message nor the partial reply is kept, so the transcript never holds a
//!   reply the model did not finish and stays a valid alternation.
//! - Sampling stream of turn k = `Pcg32::new(seed, k)`, k = number of assistant records
//!   before the turn ([`super::sample`]).

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use k3_kernels::ops;
use k3_models::spec::ModelSpec;
use k3_text::chat::{self, Message, RenderOptions, Role, Thinking};
use k3_text::history;
use k3_text::reply::{Channel, Reply, ReplyEvent, ReplyParser};
use k3_text::tokenizer::Tokenizer;

use super::sample::{Sampler, Sampling};
use crate::exec::{ExecError, Executor, Providers, SeqState};
use crate::speculate::{SpecStats, Speculation, Speculator};

/// Errors of a session. [`SessionError::Exec`] is fatal for the REPL; the others refuse one
/// turn and leave the transcript as it was.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error(transparent)]
    Render(#[from] k3_text::ChatError),
    #[error(transparent)]
    History(#[from] k3_text::HistoryError),
    #[error(
        "the conversation needs {needed} positions but the context is planned for {max} \
         (--max-context); the history is kept: /reset to start a new conversation or restart \
         with a larger --max-context"
    )]
    ContextTooLong { needed: usize, max: usize },
    #[error(
        "token id {id} ({what}) is outside the model's vocabulary of {vocab} ids: this \
         tokenizer does not fit this model"
    )]
    TokenOutsideModel { id: u32, what: String, vocab: usize },
    #[error("forward pass failed: {0}")]
    Exec(#[from] ExecError),
}

/// Turn settings fixed for the session.
#[derive(Debug, Clone)]
pub struct SessionConfig {
    pub thinking: Thinking,
    /// Maximum generated tokens per turn.
    pub n_gen: usize,
    /// Reuse the live state across turns when the prompt extends what was fed.
    pub incremental: bool,
    pub sampling: Sampling,
    /// Stop ids besides `<|end_of_msg|>`: config eos ids and `--stop-id`s.
    pub extra_stop_ids: Vec<u32>,
    /// `--speculate K`: verify prompt-lookup guesses in one pass (greedy turns only; the same
    /// ids, see `crate::speculate`).
    pub speculate: Option<Speculation>,
}

/// What a prefill did.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Prefill {
    /// Positions kept from the live state.
    pub reused: usize,
    /// Positions fed now.
    pub fed: usize,
    /// Positions of the prompt (= reused + fed when not interrupted).
    pub total: usize,
    pub seconds: f64,
}

/// Why a turn ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// `<|end_of_msg|>` was generated.
    EndOfMessage,
    /// Another stop id (config eos or `--stop-id`).
    StopId(u32),
    /// `--gen` tokens were generated.
    GenLimit,
    /// The interrupt flag (Ctrl-C) was raised, during prefill or generation.
    Interrupted,
    /// The planned context filled up during generation.
    ContextFull { max: usize },
}

impl Stop {
    /// Whether the turn is kept in the transcript (see the module docs).
    pub fn commits(self) -> bool {
        matches!(self, Stop::EndOfMessage | Stop::StopId(_) | Stop::GenLimit)
    }
}

/// Streamed to the caller during a turn.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Event<'a> {
    /// The prompt is fed; generation starts.
    Prefilled(Prefill),
    /// Generated text, complete UTF-8, in its channel.
    Text { channel: Channel, text: &'a str },
}

/// The result of one turn.
#[derive(Debug, Clone)]
pub struct TurnOutcome {
    pub stop: Stop,
    pub prefill: Prefill,
    pub reply: Reply,
    /// Generated ids, including the stop token if one ended the turn.
    pub generated: Vec<u32>,
    pub decode_seconds: f64,
    /// The records to commit (user, assistant) when [`Stop::commits`].
    pub records: Option<[Message; 2]>,
    /// What speculation did, when the turn speculated.
    pub speculation: Option<SpecStats>,
}

/// Load a history file for `render-chat` and the REPL: every line validated (a corrupt line
/// is an error naming its line number), then `--system` applied: an empty history starts
/// with the system record, a non-empty one must already start with the same one.
pub fn load_transcript(path: &Path, system: Option<&str>) -> Result<Vec<Message>, SessionError> {
    let messages = history::load_jsonl(path)?;
    Ok(history::with_system(messages, system, path)?)
}

/// The `<|end_of_msg|>` id, after checking that the tokenizer has every chat control token
/// and the model can embed it.
pub fn end_of_msg_id(spec: &ModelSpec, tok: &Tokenizer) -> Result<u32, SessionError> {
    let mut eom = 0;
    for name in [
        chat::OPEN_TOKEN,
        chat::CLOSE_TOKEN,
        chat::SEP_TOKEN,
        chat::END_OF_MSG_TOKEN,
    ] {
        let id = tok
            .id_of(name)
            .ok_or_else(|| k3_text::ChatError::MissingControlToken {
                name: name.to_string(),
            })?;
        if id as usize >= spec.vocab_size {
            return Err(SessionError::TokenOutsideModel {
                id,
                what: format!("chat control token {name}"),
                vocab: spec.vocab_size,
            });
        }
        if name == chat::END_OF_MSG_TOKEN {
            eom = id;
        }
    }
    Ok(eom)
}

/// The ids of `messages` rendered with `opts` (plus the generation prompt when
/// `generation_prompt`), checked against the model's vocabulary.
pub fn prompt_ids(
    spec: &ModelSpec,
    tok: &Tokenizer,
    opts: &RenderOptions,
    messages: &[Message],
    generation_prompt: bool,
) -> Result<Vec<u32>, SessionError> {
    let opts = RenderOptions {
        add_generation_prompt: generation_prompt,
        ..opts.clone()
    };
    let ids = chat::render_prompt(messages, &opts)?.render_ids(tok)?;
    if let Some(&id) = ids.iter().find(|&&id| id as usize >= spec.vocab_size) {
        return Err(SessionError::TokenOutsideModel {
            id,
            what: format!("{:?}", tok.decode_lossy(&[id]).unwrap_or_default()),
            vocab: spec.vocab_size,
        });
    }
    Ok(ids)
}

/// The id side of one assistant turn, shared by [`Session::turn`] and the batched server
/// (`super::batch`): the sampler of the turn's stream, the reply parser (channel text as it
/// completes) and the stop rules of the module docs, one generated id at a time. Feeding the
/// model is the caller's.
#[derive(Debug)]
pub struct TurnDecoder {
    parser: Parse,
    sampler: Sampler,
    n_allowed: usize,
    n_gen: usize,
    extra_stop_ids: Vec<u32>,
    eom: u32,
    /// Generated ids, including the stop token if one ended the turn.
    pub generated: Vec<u32>,
}

/// How generated ids become text: the chat reply grammar (channels), or plain decoding for
/// a raw completion (`POST /v1/completions`).
#[derive(Debug)]
enum Parse {
    Chat(ReplyParser),
    Raw {
        decoder: k3_text::tokenizer::Decoder,
        text: String,
    },
}

impl TurnDecoder {
    /// A raw continuation (no chat grammar): every generated id's text goes to the response
    /// channel as it completes, control ids spelled out; it stops on `<|end_of_msg|>`, the
    /// stop ids and the limit as a chat turn does. Sampling stream `turn_index` of the seed.
    pub fn raw(cfg: &SessionConfig, turn_index: u64, n_allowed: usize, eom: u32) -> TurnDecoder {
        TurnDecoder {
            parser: Parse::Raw {
                decoder: k3_text::tokenizer::Decoder::default(),
                text: String::new(),
            },
            sampler: Sampler::for_turn(cfg.sampling, turn_index),
            n_allowed,
            n_gen: cfg.n_gen,
            extra_stop_ids: cfg.extra_stop_ids.clone(),
            eom,
            generated: Vec::new(),
        }
    }

    /// The decoder of assistant turn `turn_index` (its sampling stream) generating at most
    /// `n_gen` ids among the first `n_allowed`; thinking as `cfg.thinking`.
    pub fn new(
        tok: &Tokenizer,
        cfg: &SessionConfig,
        turn_index: u64,
        n_allowed: usize,
        eom: u32,
    ) -> Result<TurnDecoder, SessionError> {
        let thinking = matches!(cfg.thinking, Thinking::On { .. });
        Ok(TurnDecoder {
            parser: Parse::Chat(ReplyParser::new(tok, thinking)?),
            sampler: Sampler::for_turn(cfg.sampling, turn_index),
            n_allowed,
            n_gen: cfg.n_gen,
            extra_stop_ids: cfg.extra_stop_ids.clone(),
            eom,
            generated: Vec::new(),
        })
    }

    /// The next id drawn from `logits` (the logits after the last fed id).
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        self.sampler.sample(&logits[..self.n_allowed])
    }

    /// Take `next` as generated: its text goes to `on_event`; returns the stop when `next`
    /// ends the turn (a stop id, or the end of the message).
    pub fn accept(
        &mut self,
        tok: &Tokenizer,
        next: u32,
        on_event: &mut dyn FnMut(Event<'_>),
    ) -> Result<Option<Stop>, SessionError> {
        self.generated.push(next);
        if next != self.eom && self.extra_stop_ids.contains(&next) {
            return Ok(Some(Stop::StopId(next)));
        }
        let parser = match &mut self.parser {
            Parse::Chat(p) => p,
            Parse::Raw { decoder, text } => {
                if next == self.eom {
                    return Ok(Some(Stop::EndOfMessage));
                }
                let piece = decoder.push(tok, next).map_err(k3_text::ChatError::from)?;
                if !piece.is_empty() {
                    text.push_str(&piece);
                    on_event(Event::Text {
                        channel: Channel::Response,
                        text: &piece,
                    });
                }
                return Ok(None);
            }
        };
        let mut ended = false;
        for ev in parser.push(tok, next)? {
            match ev {
                ReplyEvent::Text { channel, text } => on_event(Event::Text {
                    channel,
                    text: &text,
                }),
                ReplyEvent::End => ended = true,
            }
        }
        Ok(ended.then_some(Stop::EndOfMessage))
    }

    /// Whether the turn has generated its `n_gen` ids.
    pub fn at_limit(&self) -> bool {
        self.generated.len() >= self.n_gen
    }

    /// The reply parsed so far (channel text and reasoning).
    pub fn finish(self) -> (Reply, Vec<u32>) {
        let reply = match self.parser {
            Parse::Chat(p) => p.finish(),
            Parse::Raw {
                mut decoder,
                mut text,
            } => {
                text.push_str(&decoder.finish());
                Reply {
                    content: text,
                    complete: self.generated.last() == Some(&self.eom),
                    ..Reply::default()
                }
            }
        };
        (reply, self.generated)
    }
}

/// What [`Session::generate`] produces: a REPL turn answering a user message (committable),
/// the reply to the transcript as set, or a raw continuation; with the sampling stream.
enum Gen {
    Turn(Message, u64),
    Reply(u64),
    Raw,
}

/// A conversation on one model. See the module docs.
pub struct Session<'s> {
    spec: &'s ModelSpec,
    tok: Tokenizer,
    opts: RenderOptions,
    cfg: SessionConfig,
    messages: Vec<Message>,
    fed: Vec<u32>,
    state: SeqState,
    /// Logits after the last id of `fed` (valid when `fed` is not empty).
    logits: Vec<f32>,
    eom: u32,
    /// Ids the sampler may choose: those both the model and the tokenizer know.
    n_allowed: usize,
}

impl std::fmt::Debug for Session<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("messages", &self.messages.len())
            .field("fed", &self.fed.len())
            .finish_non_exhaustive()
    }
}

impl<'s> Session<'s> {
    /// A session starting from `messages` (already validated, e.g. by [`load_transcript`]).
    /// Fails when the tokenizer's control tokens cannot be embedded by the model or the
    /// transcript does not render.
    pub fn new(
        spec: &'s ModelSpec,
        tok: Tokenizer,
        cfg: SessionConfig,
        messages: Vec<Message>,
    ) -> Result<Session<'s>, SessionError> {
        let opts = RenderOptions {
            thinking: cfg.thinking,
            ..RenderOptions::default()
        };
        let eom = end_of_msg_id(spec, &tok)?;
        chat::render_prompt(&messages, &opts)?;
        let n_allowed = spec.vocab_size.min(tok.vocab_size());
        Ok(Session {
            spec,
            tok,
            opts,
            cfg,
            messages,
            fed: Vec::new(),
            state: SeqState::new(spec),
            logits: vec![0.0; spec.vocab_size],
            eom,
            n_allowed,
        })
    }

    /// The transcript so far.
    pub fn messages(&self) -> &[Message] {
        &self.messages
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tok
    }

    /// The `<|end_of_msg|>` id.
    pub fn end_of_msg_id(&self) -> u32 {
        self.eom
    }

    /// Positions currently held by the live state.
    pub fn positions(&self) -> usize {
        self.fed.len()
    }

    /// The settings.
    pub fn config(&self) -> &SessionConfig {
        &self.cfg
    }

    /// 0-based index of the next assistant turn (its sampling stream).
    pub fn next_turn_index(&self) -> u64 {
        self.messages
            .iter()
            .filter(|m| m.role == Role::Assistant)
            .count() as u64
    }

    /// Start a new conversation from `messages` (e.g. just the system record) and drop the
    /// model state.
    pub fn reset(&mut self, messages: Vec<Message>) -> Result<(), SessionError> {
        chat::render_prompt(&messages, &self.opts)?;
        self.messages = messages;
        self.drop_state();
        Ok(())
    }

    /// Replace the transcript WITHOUT dropping the model state: the next turn still reuses
    /// the state as far as its prompt extends what was fed (with `incremental`). For callers
    /// that receive whole conversations (the HTTP server).
    pub fn set_messages(&mut self, messages: Vec<Message>) -> Result<(), SessionError> {
        chat::render_prompt(&messages, &self.opts)?;
        self.messages = messages;
        Ok(())
    }

    /// Settings of the next turns: the generation limit and the sampling (the HTTP server
    /// takes them per request).
    pub fn set_turn_settings(&mut self, n_gen: usize, sampling: Sampling) {
        self.cfg.n_gen = n_gen;
        self.cfg.sampling = sampling;
    }

    /// The prompt-shaping request fields of the next turns (tools, tool choice, response
    /// format: the HTTP server takes them per request). The transcript must still render.
    pub fn set_prompt_extras(
        &mut self,
        tools: Option<k3_text::pyjson::PyJson>,
        tool_choice: Option<chat::ToolChoice>,
        response_format: Option<chat::ResponseFormat>,
    ) -> Result<(), SessionError> {
        let opts = RenderOptions {
            tools,
            tool_choice,
            response_format,
            ..self.opts.clone()
        };
        chat::render_prompt(&self.messages, &opts)?;
        self.opts = opts;
        Ok(())
    }

    fn drop_state(&mut self) {
        self.state = SeqState::new(self.spec);
        self.fed.clear();
    }

    /// Append a finished turn's records (after the caller stored them).
    pub fn commit(&mut self, records: [Message; 2]) {
        self.messages.extend(records);
    }

    /// The prompt ids for `messages`, checked against the model's vocabulary.
    fn prompt_ids(
        &self,
        messages: &[Message],
        generation_prompt: bool,
    ) -> Result<Vec<u32>, SessionError> {
        prompt_ids(
            self.spec,
            &self.tok,
            &self.opts,
            messages,
            generation_prompt,
        )
    }

    /// Bring the live state to `target`: reuse it when `incremental` and `target` extends
    /// what was fed, else start fresh; then feed the rest. Stops early (returning a prefill
    /// with `reused + fed < total`) when `interrupt` is raised; `fed` stays exact, so the
    /// state remains reusable.
    fn sync(
        &mut self,
        exec: &mut Executor<'_>,
        w: &mut Providers<'_>,
        target: &[u32],
        interrupt: &AtomicBool,
    ) -> Result<Prefill, SessionError> {
        let max = exec.plan().max_positions;
        if target.len() > max {
            return Err(SessionError::ContextTooLong {
                needed: target.len(),
                max,
            });
        }
        let t0 = Instant::now();
        let reuse = self.cfg.incremental && !self.fed.is_empty() && target.starts_with(&self.fed);
        if !reuse {
            self.drop_state();
        }
        let reused = self.fed.len();
        let mut p = Prefill {
            reused,
            fed: 0,
            total: target.len(),
            seconds: 0.0,
        };
        // Layer-major chunks: the trunk is read once per chunk, not once per token.
        for chunk in target[reused..].chunks(exec.prefill_chunk()) {
            if interrupt.load(Ordering::Relaxed) {
                break;
            }
            exec.prefill(chunk, &mut self.state, w, &mut self.logits)?;
            self.fed.extend_from_slice(chunk);
            p.fed += chunk.len();
        }
        p.seconds = t0.elapsed().as_secs_f64();
        Ok(p)
    }

    /// With `incremental`: prefill the transcript as it stands (no generation prompt), so a
    /// restarted conversation's first turn only feeds its new tail. Returns `None` when
    /// `incremental` is off (every turn then prefills from scratch).
    pub fn prefill_transcript(
        &mut self,
        exec: &mut Executor<'_>,
        w: &mut Providers<'_>,
        interrupt: &AtomicBool,
    ) -> Result<Option<Prefill>, SessionError> {
        if !self.cfg.incremental {
            return Ok(None);
        }
        let ids = self.prompt_ids(&self.messages, false)?;
        self.sync(exec, w, &ids, interrupt).map(Some)
    }

    /// One assistant turn answering `user_text`. Events are streamed to `on_event`. The
    /// transcript is not changed: commit `outcome.records` with [`Session::commit`].
    pub fn turn(
        &mut self,
        exec: &mut Executor<'_>,
        w: &mut Providers<'_>,
        user_text: &str,
        interrupt: &AtomicBool,
        on_event: &mut dyn FnMut(Event<'_>),
    ) -> Result<TurnOutcome, SessionError> {
        let user = Message::user(user_text);
        let mut candidate = self.messages.clone();
        candidate.push(user.clone());
        let target = self.prompt_ids(&candidate, true)?;
        let turn_index = self.next_turn_index();
        self.generate(
            exec,
            w,
            &target,
            Gen::Turn(user, turn_index),
            interrupt,
            on_event,
        )
    }

    /// The assistant's reply to the transcript as it stands (set by [`Self::set_messages`];
    /// it ends with a user message or tool results): the HTTP server's turn. Sampling stream
    /// = the number of assistant records in the transcript. The transcript is not changed
    /// (`records` is `None`).
    pub fn reply(
        &mut self,
        exec: &mut Executor<'_>,
        w: &mut Providers<'_>,
        interrupt: &AtomicBool,
        on_event: &mut dyn FnMut(Event<'_>),
    ) -> Result<TurnOutcome, SessionError> {
        let target = self.prompt_ids(&self.messages, true)?;
        let turn_index = self.next_turn_index();
        self.generate(
            exec,
            w,
            &target,
            Gen::Reply(turn_index),
            interrupt,
            on_event,
        )
    }

    /// A raw continuation of `prompt` (ids, checked against the model's vocabulary): no chat
    /// grammar, sampling stream 0 (see [`TurnDecoder::raw`]). The transcript is not used or
    /// changed; the state is reused as for a turn.
    pub fn complete_raw(
        &mut self,
        exec: &mut Executor<'_>,
        w: &mut Providers<'_>,
        prompt: &[u32],
        interrupt: &AtomicBool,
        on_event: &mut dyn FnMut(Event<'_>),
    ) -> Result<TurnOutcome, SessionError> {
        if let Some(&id) = prompt.iter().find(|&&id| id as usize >= self.n_allowed) {
            return Err(SessionError::TokenOutsideModel {
                id,
                what: "a prompt id".into(),
                vocab: self.n_allowed,
            });
        }
        self.generate(exec, w, prompt, Gen::Raw, interrupt, on_event)
    }

    /// Prefill `target` and generate what `kind` says.
    fn generate(
        &mut self,
        exec: &mut Executor<'_>,
        w: &mut Providers<'_>,
        target: &[u32],
        kind: Gen,
        interrupt: &AtomicBool,
        on_event: &mut dyn FnMut(Event<'_>),
    ) -> Result<TurnOutcome, SessionError> {
        let prefill = self.sync(exec, w, target, interrupt)?;
        let mut out = TurnOutcome {
            stop: Stop::Interrupted,
            prefill,
            reply: Reply::default(),
            generated: Vec::new(),
            decode_seconds: 0.0,
            records: None,
            speculation: None,
        };
        if prefill.reused + prefill.fed < prefill.total {
            return Ok(out);
        }
        on_event(Event::Prefilled(prefill));

        let mut dec = match &kind {
            Gen::Turn(_, k) | Gen::Reply(k) => {
                TurnDecoder::new(&self.tok, &self.cfg, *k, self.n_allowed, self.eom)?
            }
            Gen::Raw => TurnDecoder::raw(&self.cfg, 0, self.n_allowed, self.eom),
        };
        let max = exec.plan().max_positions;
        let t0 = Instant::now();
        let mut stop = Stop::GenLimit;
        // Speculation (greedy turns only): `queue` holds verified guesses still to emit; the
        // logits are already past them.
        let mut spec = match (self.cfg.speculate, self.cfg.sampling) {
            (Some(o), Sampling::Greedy) => Some(Speculator::new(o)),
            _ => None,
        };
        let fed_before = self.fed.len();
        let n_allowed = self.n_allowed;
        let choose = |l: &[f32]| ops::argmax(&l[..n_allowed]) as u32;
        let mut queue = std::collections::VecDeque::new();
        while !dec.at_limit() {
            let (next, guessed) = match queue.pop_front() {
                Some(d) => (d, true),
                None => (dec.sample(&self.logits), false),
            };
            if let Some(s) = dec.accept(&self.tok, next, on_event)? {
                stop = s;
                break;
            }
            if interrupt.load(Ordering::Relaxed) {
                stop = Stop::Interrupted;
                break;
            }
            if dec.at_limit() {
                break;
            }
            let r = match spec.as_mut() {
                // A verified guess: already fed (or pending in the speculator).
                Some(_) if guessed => continue,
                Some(sp) => {
                    let context: Vec<u32> = self.fed[..fed_before]
                        .iter()
                        .chain(&dec.generated)
                        .copied()
                        .collect();
                    let room = self.cfg.n_gen - dec.generated.len();
                    sp.advance(
                        exec,
                        &mut self.state,
                        w,
                        next,
                        &context,
                        room,
                        &mut self.logits,
                        &choose,
                    )
                    .map(|acc| queue.extend(acc))
                }
                None => exec
                    .step(next, &mut self.state, w, &mut self.logits)
                    .map(|()| self.fed.push(next)),
            };
            match r {
                Ok(()) => {}
                Err(ExecError::ContextFull { .. }) => {
                    stop = Stop::ContextFull { max };
                    break;
                }
                Err(e) => return Err(e.into()),
            }
        }
        (out.reply, out.generated) = dec.finish();
        if let Some(mut sp) = spec {
            // The state plain decoding leaves: the prompt and every generated id but the last.
            let all: Vec<u32> = self.fed[..fed_before]
                .iter()
                .chain(&out.generated)
                .copied()
                .collect();
            sp.finish(exec, &mut self.state, w, &all, 0)?;
            self.fed = all[..all.len().saturating_sub(1).max(fed_before)].to_vec();
            out.speculation = Some(sp.stats);
        }
        out.decode_seconds = t0.elapsed().as_secs_f64();
        out.stop = stop;
        if stop.commits()
            && let Gen::Turn(user, _) = kind
        {
            out.records = Some([user, out.reply.to_message()]);
        }
        Ok(out)
    }
}
