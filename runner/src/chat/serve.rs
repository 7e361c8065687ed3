//! `k3-run MODEL_DIR --serve ADDR`: an OpenAI-compatible HTTP endpoint (docs/DESIGN.md §10), so
//! existing clients can talk to the model.
//!
//! - `POST /v1/chat/completions`: `messages` (system / user / assistant records, the last one
//!   from the user; `reasoning_content` on assistant records is kept), `max_tokens` /
//!   `max_completion_tokens` (default `--gen`, chat's 4096), `temperature`, `top_p`, `seed`,
//!   `stream`. Without `temperature` / `top_p` / `seed` the reply is greedy (deterministic),
//!   like `--chat`; with them, turn k of a conversation draws from PCG32 stream k of the seed,
//!   so a request reproduces the `--chat` turn with the same flags. The reply's thinking
//!   channel is returned as `reasoning_content` (thinking follows `--no-think` /
//!   `--thinking-effort`, fixed for the server). `stream: true` sends server-sent events
//!   (`chat.completion.chunk` deltas, then `data: [DONE]`).
//! - `GET /v1/models`: the one model.
//!
//! One request at a time, on the thread that owns the model. With `--incremental` the decode
//! state is kept between requests and reused as far as the next prompt extends it (a client
//! that resends the whole conversation feeds only the new turn). Requests that ask for what
//! is not implemented (`n` > 1, tools, stop strings, logprobs) get a 400 naming the field.
//! Ctrl-C stops the server after the current request (a reply being generated is cut short).

use std::io::{Read, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use k3_models::spec::ModelSpec;
use k3_text::chat::{Message, Role, Thinking};
use k3_text::reply::Channel;
use k3_text::tokenizer::Tokenizer;
use serde::Deserialize;
use serde_json::{Value, json};

use super::batch::{Batcher, Job};
use super::repl::{
    fresh_seed, gen_given_on_command_line, gen_limit, session_config, tokenizer_dir,
};
use super::sample::Sampling;
use super::session::{Event, Session, SessionError, Stop, TurnOutcome};
use crate::cli::{Failure, RunArgs, exec_failure, exit};
use crate::exec::{Executor, Providers};

/// Largest request body read (a long conversation fits easily).
const MAX_BODY: usize = 16 << 20;

fn usage(e: impl std::fmt::Display) -> Failure {
    Failure::usage(e.to_string())
}

/// What the server needs before the model loads: tokenizer, thinking mode, default limit,
/// requests decoded together and the batch window.
struct Prepared {
    tok: Tokenizer,
    thinking: Thinking,
    n_gen: usize,
    batch: usize,
    window: Duration,
}

/// Most requests `--serve-batch` decodes together.
pub const MAX_SERVE_BATCH: usize = 64;

fn prepare(run: &RunArgs) -> Result<Prepared, Failure> {
    if run.ids.is_some() || run.prompt.is_some() || run.prompt_file.is_some() {
        return Err(Failure::usage(
            "--serve takes its prompts from HTTP requests; --ids, --prompt and --prompt-file \
             are not used with it",
        ));
    }
    let tok = Tokenizer::load(&tokenizer_dir(run)?).map_err(usage)?;
    let c = &run.chat;
    let thinking = Thinking::from_flags(c.no_think, c.thinking_effort.as_deref()).map_err(usage)?;
    let n_gen = gen_limit(run, gen_given_on_command_line())?;
    let batch = serve_batch(run)?;
    if batch > 1 && run.speculate.is_some() {
        return Err(Failure::usage(
            "--speculate works on one request at a time: not with --serve-batch above 1",
        ));
    }
    let window = run.chat.batch_window.unwrap_or(0);
    if window > 10_000 {
        return Err(Failure::usage(format!(
            "--batch-window {window}: at most 10000 ms"
        )));
    }
    Ok(Prepared {
        tok,
        thinking,
        n_gen,
        batch,
        window: Duration::from_millis(window),
    })
}

/// `--serve-batch N` (default 1): requests decoded together; each holds its own decode state.
pub fn serve_batch(run: &RunArgs) -> Result<usize, Failure> {
    match run.chat.serve_batch {
        None => Ok(1),
        Some(n) if (1..=MAX_SERVE_BATCH).contains(&n) => Ok(n),
        Some(n) => Err(Failure::usage(format!(
            "--serve-batch {n}: 1..={MAX_SERVE_BATCH} requests"
        ))),
    }
}

/// Check the flags and the tokenizer before the model is loaded.
pub fn preflight(run: &RunArgs) -> Result<(), Failure> {
    let c = &run.chat;
    for (given, flag) in [
        (c.system.is_some(), "--system"),
        (c.history.is_some(), "--history"),
        (c.temperature.is_some(), "--temperature"),
        (c.top_p.is_some(), "--top-p"),
        (c.seed.is_some(), "--seed"),
        (c.greedy, "--greedy"),
    ] {
        if given {
            return Err(Failure::usage(format!(
                "{flag} is a --chat flag: with --serve every request carries its own messages \
                 (a system message included) and sampling fields (docs/CHAT.md)"
            )));
        }
    }
    prepare(run).map(|_| ())
}

/// A request's fields; unknown fields are ignored (clients send many), the ones that would
/// change the meaning and are not implemented are refused in [`ChatRequest::check`].
#[derive(Deserialize, Debug)]
struct ChatRequest {
    messages: Vec<Message>,
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    max_tokens: Option<usize>,
    #[serde(default)]
    max_completion_tokens: Option<usize>,
    #[serde(default)]
    temperature: Option<f32>,
    #[serde(default)]
    top_p: Option<f32>,
    #[serde(default)]
    seed: Option<u64>,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    n: Option<u32>,
    #[serde(default)]
    tools: Option<Value>,
    #[serde(default)]
    stop: Option<Value>,
    #[serde(default)]
    logprobs: Option<bool>,
}

impl ChatRequest {
    fn check(&self) -> Result<(), String> {
        if self.n.is_some_and(|n| n != 1) {
            return Err("`n`: only one choice per request is supported".into());
        }
        if self.tools.as_ref().is_some_and(|t| !t.is_null()) {
            return Err("`tools`: tool calling is not supported by this server".into());
        }
        if self.stop.as_ref().is_some_and(|s| !s.is_null()) {
            return Err(
                "`stop`: stop strings are not supported (the server stops at <|end_of_msg|>, \
                 the model's eos ids and --stop-id)"
                    .into(),
            );
        }
        if self.logprobs == Some(true) {
            return Err("`logprobs`: not supported".into());
        }
        let Some(last) = self.messages.last() else {
            return Err("`messages`: empty".into());
        };
        if last.role != Role::User {
            return Err("`messages`: the last message must be from the user".into());
        }
        if let Some(i) = self.messages.iter().position(|m| m.role == Role::Tool) {
            return Err(format!(
                "`messages`[{i}]: a tool result (role \"tool\"): tool calling is not \
                 supported by this server"
            ));
        }
        Ok(())
    }
}

/// HTTP/1.1 chunked framing over the raw connection of a streamed response, so clients know
/// where it ends and the connection stays usable. Every `write` is one chunk.
struct Chunked(Box<dyn Write + Send>);

impl Write for Chunked {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        write!(self.0, "{:x}\r\n", buf.len())?;
        self.0.write_all(buf)?;
        self.0.write_all(b"\r\n")?;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush()
    }
}

impl Chunked {
    /// The terminating zero-length chunk.
    fn finish(&mut self) -> std::io::Result<()> {
        self.0.write_all(b"0\r\n\r\n")?;
        self.0.flush()
    }
}

/// An HTTP error with an OpenAI-style body.
struct HttpError {
    status: u16,
    kind: &'static str,
    message: String,
}

impl HttpError {
    fn bad(message: impl Into<String>) -> Self {
        HttpError {
            status: 400,
            kind: "invalid_request_error",
            message: message.into(),
        }
    }
    fn body(&self) -> String {
        json!({"error": {"message": self.message, "type": self.kind, "param": null, "code": null}})
            .to_string()
    }
}

fn json_header() -> tiny_http::Header {
    tiny_http::Header::from_bytes("Content-Type", "application/json").expect("static header")
}

fn respond_json(req: tiny_http::Request, status: u16, body: String) {
    let r = tiny_http::Response::from_string(body)
        .with_status_code(status)
        .with_header(json_header());
    // A client that went away is not the server's problem.
    let _ = req.respond(r);
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn finish_reason(stop: Stop) -> &'static str {
    match stop {
        Stop::EndOfMessage | Stop::StopId(_) => "stop",
        Stop::GenLimit | Stop::ContextFull { .. } => "length",
        Stop::Interrupted => "interrupted",
    }
}

/// The server. Returns the exit code when Ctrl-C stops it; a forward-pass failure (e.g. an
/// expert that cannot be read) answers 500 and stops it with that failure's exit code.
pub fn main(
    spec: &ModelSpec,
    exec: &mut Executor<'_>,
    providers: &mut Providers<'_>,
    run: &RunArgs,
) -> Result<u8, Failure> {
    let Prepared {
        tok,
        thinking,
        n_gen,
        batch,
        window,
    } = prepare(run)?;
    let addr = run.chat.serve.as_deref().unwrap_or("127.0.0.1:8080");
    // Each request sets its own sampling and limit.
    let cfg = session_config(spec, &tok, run, thinking, n_gen, Sampling::Greedy)?;
    // Before listening: a tokenizer whose chat control tokens the model cannot embed is
    // refused at start, not at the first request.
    let max_positions = exec.plan().max_positions;
    let mode = if batch > 1 {
        Mode::Batched(Box::new(
            Batcher::new(spec, tok, cfg, batch, max_positions).map_err(usage)?,
        ))
    } else {
        Mode::Serial(Box::new(
            Session::new(spec, tok, cfg, Vec::new()).map_err(usage)?,
        ))
    };
    let server = tiny_http::Server::http(addr)
        .map_err(|e| Failure::usage(format!("--serve {addr}: cannot listen: {e}")))?;
    let bound = server
        .server_addr()
        .to_ip()
        .map_or_else(|| addr.to_string(), |a| a.to_string());
    println!(
        "k3-run serve: listening on http://{bound} (model {}, {} layers; {}; default max_tokens \
         {n_gen}; context {} positions; {}; {}); POST /v1/chat/completions, GET /v1/models; \
         Ctrl-C stops",
        spec.name,
        spec.n_layers,
        match thinking {
            Thinking::Off => "thinking off".to_string(),
            Thinking::On { effort: Some(e) } => format!("thinking effort {e}"),
            Thinking::On { effort: None } => "thinking on".to_string(),
        },
        exec.plan().max_positions,
        if run.incremental {
            "state reused across requests"
        } else {
            "full prefill per request"
        },
        if batch > 1 {
            format!("up to {batch} requests decoded together")
        } else {
            "one request at a time".to_string()
        }
    );
    let _ = std::io::stdout().flush();

    let stop = Arc::new(AtomicBool::new(false));
    let sig_ids: Vec<_> = [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM]
        .into_iter()
        .map(|s| signal_hook::flag::register(s, Arc::clone(&stop)))
        .collect::<Result<_, _>>()
        .map_err(|e| Failure::usage(format!("cannot install the Ctrl-C handler: {e}")))?;
    let mut served = 0u64;
    let result = match mode {
        Mode::Batched(batcher) => {
            let mut srv = Batched {
                spec,
                server: &server,
                bound: &bound,
                batcher: *batcher,
                default_n_gen: n_gen,
                window,
                served: &mut served,
            };
            srv.serve(exec, providers, &stop)
        }
        Mode::Serial(mut session) => loop {
            if stop.load(Ordering::Relaxed) {
                break Ok(exit::INTERRUPTED);
            }
            let req = match server.recv_timeout(Duration::from_millis(200)) {
                Ok(Some(r)) => r,
                Ok(None) => continue,
                Err(e) => break Err(Failure::usage(format!("--serve {bound}: {e}"))),
            };
            served += 1;
            let Some((req, r)) = route(spec, req) else {
                continue;
            };
            if let Err(f) = complete(
                spec,
                &mut session,
                exec,
                providers,
                (req, r),
                n_gen,
                &stop,
                served,
            ) {
                break Err(f);
            }
        },
    };
    for id in sig_ids {
        signal_hook::low_level::unregister(id);
    }
    eprintln!("k3-run serve: stopped after {served} request(s)");
    result
}

/// One request at a time on a chat session, or several together on the batch scheduler.
enum Mode<'s> {
    Serial(Box<Session<'s>>),
    Batched(Box<Batcher<'s, ReplySink>>),
}

/// Answer every request but a well-formed chat completion (models list, errors); return that
/// one with its parsed body.
fn route(
    spec: &ModelSpec,
    mut req: tiny_http::Request,
) -> Option<(tiny_http::Request, ChatRequest)> {
    let path = req.url().split('?').next().unwrap_or("").to_string();
    let method = req.method().clone();
    let err = match (method, path.as_str()) {
        (tiny_http::Method::Get, "/v1/models") => {
            let body = json!({"object": "list", "data": [
                {"id": spec.name, "object": "model", "created": 0, "owned_by": "k3-run"}]});
            respond_json(req, 200, body.to_string());
            return None;
        }
        (tiny_http::Method::Post, "/v1/chat/completions") => {
            let mut body = Vec::new();
            let read = req
                .as_reader()
                .take(MAX_BODY as u64 + 1)
                .read_to_end(&mut body);
            let parsed = match read {
                Err(e) => Err(HttpError::bad(format!("cannot read the request body: {e}"))),
                Ok(_) if body.len() > MAX_BODY => Err(HttpError {
                    status: 413,
                    kind: "invalid_request_error",
                    message: format!("request body larger than {MAX_BODY} bytes"),
                }),
                Ok(_) => serde_json::from_slice::<ChatRequest>(&body)
                    .map_err(|e| HttpError::bad(format!("request body: {e}")))
                    .and_then(|r| r.check().map(|()| r).map_err(HttpError::bad)),
            };
            match parsed {
                Ok(r) => return Some((req, r)),
                Err(e) => e,
            }
        }
        (_, "/v1/models" | "/v1/chat/completions") => HttpError {
            status: 405,
            kind: "invalid_request_error",
            message: format!("{path}: method not allowed"),
        },
        _ => HttpError {
            status: 404,
            kind: "invalid_request_error",
            message: format!("{path}: not found (POST /v1/chat/completions, GET /v1/models)"),
        },
    };
    respond_json(req, err.status, err.body());
    None
}

/// A request's turn: the conversation before the user's message, that message, and the
/// settings of the reply.
struct Turn {
    history: Vec<Message>,
    user: Message,
    n_gen: usize,
    sampling: Sampling,
    stream: bool,
    model: String,
}

impl Turn {
    fn of(spec: &ModelSpec, r: ChatRequest, default_n_gen: usize) -> Result<Turn, HttpError> {
        // The error names the field the client sent (`max_completion_tokens` wins when both
        // are given, as in OpenAI's API).
        let (field, n_gen) = match (r.max_completion_tokens, r.max_tokens) {
            (Some(n), _) => ("max_completion_tokens", n),
            (None, Some(n)) => ("max_tokens", n),
            (None, None) => ("max_tokens", default_n_gen),
        };
        if n_gen == 0 || n_gen > super::repl::MAX_GEN {
            return Err(HttpError::bad(format!(
                "`{field}` {n_gen}: must be 1..={} tokens per reply",
                super::repl::MAX_GEN
            )));
        }
        let sampling = Sampling::from_flags(false, r.temperature, r.top_p, r.seed, fresh_seed)
            .map_err(|e| {
                HttpError::bad(
                    e.to_string()
                        .replace("--temperature", "`temperature`")
                        .replace("--top-p", "`top_p`"),
                )
            })?;
        let mut history = r.messages;
        let user = history
            .pop()
            .expect("checked: the last message is the user's");
        Ok(Turn {
            history,
            user,
            n_gen,
            sampling,
            stream: r.stream,
            model: r.model.unwrap_or_else(|| spec.name.clone()),
        })
    }
}

/// Where one reply goes: server-sent events on the raw connection (`stream: true`), or one
/// JSON body at the end.
struct ReplySink {
    writer: Option<Chunked>,
    req: Option<tiny_http::Request>,
    id: String,
    created: u64,
    model: String,
}

impl ReplySink {
    /// Start the reply to request number `n`; `None` when a streaming client is already gone.
    fn open(req: tiny_http::Request, stream: bool, model: String, n: u64) -> Option<ReplySink> {
        let mut sink = ReplySink {
            writer: None,
            req: None,
            id: format!("chatcmpl-k3run-{n}"),
            created: now_secs(),
            model,
        };
        if !stream {
            sink.req = Some(req);
            return Some(sink);
        }
        let mut raw = req.into_writer();
        let head = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: \
                    no-cache\r\nTransfer-Encoding: chunked\r\n\r\n";
        raw.write_all(head.as_bytes())
            .and_then(|()| raw.flush())
            .ok()?;
        let mut w = Chunked(raw);
        let first = sink.chunk(json!({"role": "assistant", "content": ""}), Value::Null);
        let _ = w.write_all(format!("data: {first}\n\n").as_bytes());
        sink.writer = Some(w);
        Some(sink)
    }

    fn chunk(&self, delta: Value, finish: Value) -> Value {
        json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
            "model": self.model, "choices": [{"index": 0, "delta": delta,
            "finish_reason": finish}]})
    }

    /// Stream a piece of the reply; false when the client is gone.
    fn text(&mut self, ev: Event<'_>) -> bool {
        let Event::Text { channel, text } = ev else {
            return true;
        };
        let delta = match channel {
            Channel::Think => json!({"reasoning_content": text}),
            Channel::Response => json!({"content": text}),
            Channel::Tools | Channel::Between => return true,
        };
        let chunk = self.chunk(delta, Value::Null);
        let Some(w) = self.writer.as_mut() else {
            return true;
        };
        w.write_all(format!("data: {chunk}\n\n").as_bytes())
            .and_then(|()| w.flush())
            .is_ok()
    }

    /// End the reply with the turn's outcome (or its error: 400, or 500 for a forward-pass
    /// failure). `batch` is the most requests decoded together with this one.
    fn done(mut self, outcome: &Result<TurnOutcome, SessionError>, batch: usize) {
        let o = match outcome {
            Ok(o) => o,
            Err(e) => {
                let fatal = matches!(e, SessionError::Exec(_));
                return self.fail(HttpError {
                    status: if fatal { 500 } else { 400 },
                    kind: if fatal {
                        "server_error"
                    } else {
                        "invalid_request_error"
                    },
                    message: http_message(e),
                });
            }
        };
        let usage = json!({"prompt_tokens": o.prefill.total,
            "completion_tokens": o.generated.len(),
            "total_tokens": o.prefill.total + o.generated.len()});
        let k3 = json!({"reused_positions": o.prefill.reused, "fed_positions": o.prefill.fed,
            "prefill_seconds": o.prefill.seconds, "decode_seconds": o.decode_seconds,
            "speculation": o.speculation, "batch": batch});
        let finish = finish_reason(o.stop);
        if let Some(mut w) = self.writer.take() {
            let mut last = self.chunk(json!({}), json!(finish));
            last["usage"] = usage;
            last["k3"] = k3;
            let _ = w
                .write_all(format!("data: {last}\n\ndata: [DONE]\n\n").as_bytes())
                .and_then(|()| w.finish());
        } else if let Some(req) = self.req.take() {
            let mut message = json!({"role": "assistant", "content": o.reply.content});
            if !o.reply.reasoning_content.is_empty() {
                message["reasoning_content"] = json!(o.reply.reasoning_content);
            }
            let body = json!({"id": self.id, "object": "chat.completion",
                "created": self.created, "model": self.model, "choices": [{"index": 0,
                "message": message, "finish_reason": finish}], "usage": usage, "k3": k3});
            respond_json(req, 200, body.to_string());
        }
    }

    /// End the reply with an error.
    fn fail(mut self, e: HttpError) {
        if let Some(mut w) = self.writer.take() {
            let _ = w
                .write_all(format!("data: {}\n\n", e.body()).as_bytes())
                .and_then(|()| w.finish());
        } else if let Some(req) = self.req.take() {
            respond_json(req, e.status, e.body());
        }
    }
}

/// A turn's error as an HTTP client should read it. The chat session's context message is
/// written for the REPL (`/reset`, "the history is kept"); a request has no history on the
/// server and no `/reset`: it must send a shorter conversation.
fn http_message(e: &SessionError) -> String {
    match e {
        SessionError::ContextTooLong { needed, max } => format!(
            "`messages`: the rendered conversation is {needed} tokens but the server's context \
             holds {max} positions (fixed when it started, --max-context): send a shorter \
             conversation"
        ),
        other => other.to_string(),
    }
}

/// One request, served alone. `Err` only for a failure that must stop the server.
#[allow(clippy::too_many_arguments)]
fn complete(
    spec: &ModelSpec,
    session: &mut Session<'_>,
    exec: &mut Executor<'_>,
    providers: &mut Providers<'_>,
    (req, r): (tiny_http::Request, ChatRequest),
    default_n_gen: usize,
    stop: &AtomicBool,
    n: u64,
) -> Result<(), Failure> {
    // The server's default, not the session's: that holds the previous request's limit.
    let t = match Turn::of(spec, r, default_n_gen) {
        Ok(t) => t,
        Err(e) => {
            respond_json(req, e.status, e.body());
            return Ok(());
        }
    };
    if let Err(e) = session.set_messages(t.history) {
        let e = HttpError::bad(format!("`messages`: {e}"));
        respond_json(req, e.status, e.body());
        return Ok(());
    }
    session.set_turn_settings(t.n_gen, t.sampling);
    let Some(mut sink) = ReplySink::open(req, t.stream, t.model, n) else {
        return Ok(());
    };
    // The turn stops early when the client goes away or Ctrl-C is pressed.
    let cut = AtomicBool::new(false);
    let outcome = session.turn(exec, providers, &t.user.content, &cut, &mut |ev| {
        if stop.load(Ordering::Relaxed) || !sink.text(ev) {
            cut.store(true, Ordering::Relaxed);
        }
    });
    sink.done(&outcome, 1);
    match outcome {
        Err(SessionError::Exec(e)) => Err(exec_failure(e)),
        _ => Ok(()),
    }
}

/// The batched server (`--serve-batch N`, N > 1): requests are admitted between steps while a
/// slot is free (the rest wait in the listener's queue, in order) and decode together, one
/// layer-major pass per step ([`Batcher`]).
struct Batched<'a, 's> {
    spec: &'s ModelSpec,
    server: &'a tiny_http::Server,
    bound: &'a str,
    batcher: Batcher<'s, ReplySink>,
    default_n_gen: usize,
    /// `--batch-window`: after a request reaches an idle server, wait this long for others
    /// before the first step, so requests sent together start together.
    window: Duration,
    served: &'a mut u64,
}

impl Batched<'_, '_> {
    fn serve(
        &mut self,
        exec: &mut Executor<'_>,
        providers: &mut Providers<'_>,
        stop: &AtomicBool,
    ) -> Result<u8, Failure> {
        loop {
            if stop.load(Ordering::Relaxed) {
                for f in self.batcher.interrupt_all() {
                    f.sink.done(&f.outcome, f.max_batch);
                }
                return Ok(exit::INTERRUPTED);
            }
            let idle = self.batcher.is_idle();
            self.admit(idle)?;
            if self.batcher.is_idle() {
                continue;
            }
            let step = self.batcher.step(exec, providers, &mut |sink, ev| {
                !stop.load(Ordering::Relaxed) && sink.text(ev)
            });
            match step {
                Ok(done) => {
                    for f in done {
                        f.sink.done(&f.outcome, f.max_batch);
                    }
                }
                Err(e) => {
                    let msg = format!("forward pass failed: {e}");
                    for sink in self.batcher.abort() {
                        sink.fail(HttpError {
                            status: 500,
                            kind: "server_error",
                            message: msg.clone(),
                        });
                    }
                    return Err(exec_failure(e));
                }
            }
        }
    }

    /// Take requests while a slot is free: waiting up to 200 ms when `idle` (then the batch
    /// window), else only those already queued.
    fn admit(&mut self, idle: bool) -> Result<(), Failure> {
        let mut deadline: Option<std::time::Instant> = None;
        while self.batcher.has_room() {
            let got = match (idle, deadline) {
                (true, None) => self.server.recv_timeout(Duration::from_millis(200)),
                (true, Some(d)) => {
                    let left = d.saturating_duration_since(std::time::Instant::now());
                    if left.is_zero() {
                        break;
                    }
                    self.server.recv_timeout(left)
                }
                (false, _) => self.server.try_recv(),
            };
            let req = match got {
                Ok(Some(r)) => r,
                Ok(None) => break,
                Err(e) => return Err(Failure::usage(format!("--serve {}: {e}", self.bound))),
            };
            *self.served += 1;
            let Some((req, r)) = route(self.spec, req) else {
                continue;
            };
            let t = match Turn::of(self.spec, r, self.default_n_gen) {
                Ok(t) => t,
                Err(e) => {
                    respond_json(req, e.status, e.body());
                    continue;
                }
            };
            let turn_index = t
                .history
                .iter()
                .filter(|m| m.role == Role::Assistant)
                .count() as u64;
            let mut messages = t.history;
            messages.push(t.user);
            let prompt = match self.batcher.render(&messages) {
                Ok(p) => p,
                Err(e) => {
                    let e = HttpError::bad(format!("`messages`: {e}"));
                    respond_json(req, e.status, e.body());
                    continue;
                }
            };
            let Some(sink) = ReplySink::open(req, t.stream, t.model, *self.served) else {
                continue;
            };
            let job = Job {
                prompt,
                n_gen: t.n_gen,
                sampling: t.sampling,
                turn_index,
                sink,
            };
            if let Err((sink, e)) = self.batcher.admit(job) {
                sink.done(&Err(e), 0);
            }
            if idle && deadline.is_none() {
                deadline = Some(std::time::Instant::now() + self.window);
            }
        }
        Ok(())
    }
}
