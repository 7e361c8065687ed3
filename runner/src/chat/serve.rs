//! `k3-run MODEL_DIR --serve ADDR`: an OpenAI-compatible HTTP endpoint (docs/DESIGN.md §10), so
//! existing clients, load balancers and dashboards can use the model (docs/SERVER.md).
//!
//! - `POST /v1/chat/completions`: `messages` (system / user / assistant / tool records, the
//!   last one from the user or a tool result), `tools`, `tool_choice`, `response_format`,
//!   `max_tokens` / `max_completion_tokens`, `temperature`, `top_p`, `seed`, `stream`. Greedy
//!   unless `temperature` / `top_p` / `seed` is given; turn k of a conversation draws from
//!   PCG32 stream k of the seed, so a request reproduces the `--chat` turn with the same
//!   flags. The thinking channel is `reasoning_content`; the tool section is parsed into
//!   `tool_calls` ([`super::tools`]), streamed call by call.
//! - `POST /v1/completions`: a raw continuation of `prompt` (text, special names read as
//!   their ids, or token ids).
//! - `GET /v1/models`; `GET /health` (200 ready, 503 loading with the phase; no key needed);
//!   `GET /metrics` (Prometheus text, [`super::metrics`]).
//!
//! Threads: a front end started before the model loads (so `/health` answers while it
//! does) reads every request, checks the API key, answers what needs no model, refuses bad
//! requests with a 4xx naming the field, and queues the rest (bounded: 429 with
//! `Retry-After` when full). The thread that owns the model takes queued requests one at a
//! time, or up to `--serve-batch N` together ([`Batcher`]). A watcher thread marks a request
//! whose client closed its connection; its turn stops at the next step ([`super::limits`]).
//! Ctrl-C stops the server after the current step (replies cut, `finish_reason`
//! `interrupted`).

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TryRecvError, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use k3_models::spec::ModelSpec;
use k3_text::chat::{Message, Role, Thinking};
use k3_text::reply::Channel;
use k3_text::tokenizer::Tokenizer;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Value, json};

use super::batch::{Batcher, Job};
use super::limits::{ApiKey, Watcher, bind_warning};
use super::metrics::{Metrics, RequestTimes};
use super::repl::{
    fresh_seed, gen_given_on_command_line, gen_limit, session_config, tokenizer_dir,
};
use super::sample::Sampling;
use super::session::{Event, Session, SessionError, Stop, TurnOutcome};
use super::tools::{ParsedCall, PromptExtras, ToolEvent, ToolStream, parse_section};
use crate::cli::{Failure, RunArgs, exec_failure, exit};
use crate::exec::{Executor, Providers};

/// Largest request body read (a long conversation fits easily).
pub const MAX_BODY: usize = 16 << 20;
/// Requests that may wait for a slot unless `--max-queue` says otherwise.
pub const DEFAULT_MAX_QUEUE: usize = 64;
/// Most requests `--max-queue` allows to wait.
pub const MAX_QUEUE: usize = 100_000;
/// `max_tokens` of a `/v1/completions` request that gives none (OpenAI's default).
pub const COMPLETION_DEFAULT_MAX_TOKENS: usize = 16;
/// Most requests `--serve-batch` decodes together.
pub const MAX_SERVE_BATCH: usize = 64;

fn usage(e: impl std::fmt::Display) -> Failure {
    Failure::usage(e.to_string())
}

/// What the server needs before the model loads.
struct Prepared {
    tok: Tokenizer,
    thinking: Thinking,
    n_gen: usize,
    batch: usize,
    window: Duration,
    key: Option<ApiKey>,
    max_queue: usize,
    log: bool,
}

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
    let key = ApiKey::from_flag_or_env(c.api_key.as_deref()).map_err(Failure::usage)?;
    let max_queue = c.max_queue.unwrap_or(DEFAULT_MAX_QUEUE);
    if !(1..=MAX_QUEUE).contains(&max_queue) {
        return Err(Failure::usage(format!(
            "--max-queue {max_queue}: 1..={MAX_QUEUE} waiting requests"
        )));
    }
    Ok(Prepared {
        tok,
        thinking,
        n_gen,
        batch,
        window: Duration::from_millis(window),
        key,
        max_queue,
        log: !c.no_request_log,
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

/// The front end started by [`preflight`], taken by [`main`] once the model is loaded.
static FRONT: Mutex<Option<Front>> = Mutex::new(None);

/// Check the flags and the tokenizer, then start listening (so `GET /health` answers
/// "loading" while the model loads). An address that cannot be bound is a usage error here,
/// before any weight is read.
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
    let p = prepare(run)?;
    let mut front = FRONT.lock().unwrap_or_else(|e| e.into_inner());
    if front.is_none() {
        *front = Some(Front::start(run, &p)?);
    }
    Ok(())
}

/// Where the server is in its start-up.
#[derive(Debug, Clone)]
enum Phase {
    Loading(&'static str),
    Ready { model: String },
}

/// A request read, checked and waiting for the model.
struct Pending {
    req: tiny_http::Request,
    work: Work,
    arrived: Instant,
    /// Raised when the client's connection is gone (or to stop the request).
    gone: Arc<AtomicBool>,
    n: u64,
}

enum Work {
    Chat(ChatJob),
    Completion(CompletionJob),
}

impl Work {
    fn stream(&self) -> bool {
        match self {
            Work::Chat(c) => c.stream,
            Work::Completion(c) => c.stream,
        }
    }
    fn endpoint(&self) -> &'static str {
        match self {
            Work::Chat(_) => "/v1/chat/completions",
            Work::Completion(_) => "/v1/completions",
        }
    }
}

/// State shared by the front end and the model thread.
struct Shared {
    phase: Mutex<Phase>,
    metrics: Metrics,
    key: Option<ApiKey>,
    tx: SyncSender<Pending>,
    /// Requests sent to the model thread and not yet taken.
    queued: AtomicUsize,
    watcher: Watcher,
    log: bool,
    local: SocketAddr,
    next_id: AtomicU64,
    default_n_gen: usize,
    /// `--max-queue`.
    max_queue: usize,
}

struct Front {
    shared: Arc<Shared>,
    rx: Receiver<Pending>,
    bound: String,
}

impl Front {
    fn start(run: &RunArgs, p: &Prepared) -> Result<Front, Failure> {
        let addr = run.chat.serve.as_deref().unwrap_or("127.0.0.1:8080");
        let server = tiny_http::Server::http(addr)
            .map_err(|e| Failure::usage(format!("--serve {addr}: cannot listen: {e}")))?;
        let local = server
            .server_addr()
            .to_ip()
            .ok_or_else(|| Failure::usage(format!("--serve {addr}: not an IP address and port")))?;
        if let Some(w) = bind_warning(&local, p.key.as_ref()) {
            eprintln!("k3-run serve: {w}");
        }
        let (tx, rx) = std::sync::mpsc::sync_channel(p.max_queue);
        let shared = Arc::new(Shared {
            phase: Mutex::new(Phase::Loading("loading the model")),
            metrics: Metrics::new(p.batch, p.max_queue),
            key: p.key.clone(),
            tx,
            queued: AtomicUsize::new(0),
            watcher: Watcher::start(Duration::from_millis(20)),
            log: p.log,
            local,
            next_id: AtomicU64::new(0),
            default_n_gen: p.n_gen,
            max_queue: p.max_queue,
        });
        eprintln!(
            "k3-run serve: listening on http://{local} while the model loads (GET /health \
             answers 503 until it is ready)"
        );
        let s = Arc::clone(&shared);
        std::thread::Builder::new()
            .name("k3-serve-http".into())
            .spawn(move || {
                loop {
                    match server.recv() {
                        Ok(req) => s.handle(req),
                        Err(e) => {
                            eprintln!("k3-run serve: the listener failed: {e}");
                            break;
                        }
                    }
                }
            })
            .map_err(|e| Failure::usage(format!("cannot start the HTTP thread: {e}")))?;
        Ok(Front {
            shared,
            rx,
            bound: local.to_string(),
        })
    }
}

/// An HTTP error with an OpenAI-style body.
#[derive(Debug)]
struct HttpError {
    status: u16,
    kind: &'static str,
    message: String,
    code: Option<&'static str>,
    retry_after: Option<u64>,
}

impl HttpError {
    fn new(status: u16, kind: &'static str, message: impl Into<String>) -> Self {
        HttpError {
            status,
            kind,
            message: message.into(),
            code: None,
            retry_after: None,
        }
    }
    fn bad(message: impl Into<String>) -> Self {
        Self::new(400, "invalid_request_error", message)
    }
    fn body(&self) -> String {
        json!({"error": {"message": self.message, "type": self.kind, "param": null,
            "code": self.code}})
        .to_string()
    }
}

fn header(name: &str, value: &str) -> tiny_http::Header {
    tiny_http::Header::from_bytes(name, value).expect("header names and values are ASCII")
}

fn respond(
    req: tiny_http::Request,
    status: u16,
    body: String,
    ctype: &str,
    extra: &[(&str, String)],
) {
    let mut r = tiny_http::Response::from_string(body)
        .with_status_code(status)
        .with_header(header("Content-Type", ctype));
    for (k, v) in extra {
        r = r.with_header(header(k, v));
    }
    // A client that went away is not the server's problem.
    let _ = req.respond(r);
}

fn respond_json(req: tiny_http::Request, status: u16, body: String) {
    respond(req, status, body, "application/json", &[]);
}

fn respond_error(req: tiny_http::Request, e: &HttpError) {
    let mut extra = Vec::new();
    if let Some(s) = e.retry_after {
        extra.push(("Retry-After", s.to_string()));
    }
    if e.status == 401 {
        extra.push(("WWW-Authenticate", "Bearer".to_string()));
    }
    respond(req, e.status, e.body(), "application/json", &extra);
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

const ENDPOINTS: &str = "GET /health, GET /metrics, GET /v1/models, POST /v1/chat/completions, \
                         POST /v1/completions";

/// What a request log line reports beside the method, path and status.
#[derive(Debug, Default, Clone, Copy)]
struct LogStats {
    prompt: Option<usize>,
    generated: Option<usize>,
    ttft: Option<f64>,
    per_token: Option<f64>,
}

impl Shared {
    fn phase(&self) -> Phase {
        self.phase.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn set_phase(&self, p: Phase) {
        *self.phase.lock().unwrap_or_else(|e| e.into_inner()) = p;
    }

    /// Count a request and write its log line (method, path, status, token counts and times;
    /// never the content).
    fn finished(&self, method: &str, path: &str, status: u16, s: LogStats, arrived: Instant) {
        let endpoint = match path {
            "/health" | "/metrics" | "/v1/models" | "/v1/chat/completions" | "/v1/completions" => {
                path
            }
            _ => "other",
        };
        self.metrics.count_request(endpoint, status);
        let quiet = status == 200 && matches!(endpoint, "/health" | "/metrics");
        if !self.log || quiet {
            return;
        }
        let opt_n = |v: Option<usize>| v.map_or("-".to_string(), |n| n.to_string());
        let opt_s = |v: Option<f64>| v.map_or("-".to_string(), |x| format!("{x:.4}"));
        eprintln!(
            "k3-run serve: {method} {endpoint} {status} prompt_tokens={} generated_tokens={} \
             ttft_s={} s_per_token={} total_s={:.4}",
            opt_n(s.prompt),
            opt_n(s.generated),
            opt_s(s.ttft),
            opt_s(s.per_token),
            arrived.elapsed().as_secs_f64()
        );
    }

    /// Seconds a refused client should wait: the mean time of a request so far (at least 1).
    fn retry_after(&self) -> u64 {
        self.metrics
            .mean_latency()
            .map_or(1, |s| s.ceil().clamp(1.0, 600.0) as u64)
    }

    /// The front end: answer or queue one request.
    fn handle(&self, mut req: tiny_http::Request) {
        let arrived = Instant::now();
        let method = req.method().as_str().to_string();
        let path = req.url().split('?').next().unwrap_or("").to_string();
        let get = *req.method() == tiny_http::Method::Get;
        let post = *req.method() == tiny_http::Method::Post;
        let err = |e: HttpError, req: tiny_http::Request| {
            respond_error(req, &e);
            self.finished(&method, &path, e.status, LogStats::default(), arrived);
        };
        if path == "/health" {
            if !get {
                return err(
                    HttpError::new(405, "invalid_request_error", "/health: method not allowed"),
                    req,
                );
            }
            let (status, body) = match self.phase() {
                Phase::Ready { model } => (200, json!({"status": "ok", "model": model})),
                Phase::Loading(phase) => (503, json!({"status": "loading", "phase": phase})),
            };
            respond_json(req, status, body.to_string());
            return self.finished(&method, &path, status, LogStats::default(), arrived);
        }
        if let Some(key) = &self.key {
            let auth = req
                .headers()
                .iter()
                .find(|h| h.field.equiv("Authorization"))
                .map(|h| h.value.as_str().to_string());
            if !key.accepts(auth.as_deref()) {
                let mut e = HttpError::new(
                    401,
                    "invalid_request_error",
                    "missing or wrong API key: send the header `Authorization: Bearer KEY` \
                     (the server's --api-key / K3RUN_API_KEY)",
                );
                e.code = Some("invalid_api_key");
                return err(e, req);
            }
        }
        match (get, post, path.as_str()) {
            (true, _, "/metrics") => {
                respond(
                    req,
                    200,
                    self.metrics.render(),
                    "text/plain; version=0.0.4; charset=utf-8",
                    &[],
                );
                self.finished(&method, &path, 200, LogStats::default(), arrived);
            }
            (true, _, "/v1/models") => match self.phase() {
                Phase::Ready { model } => {
                    let body = json!({"object": "list", "data": [
                        {"id": model, "object": "model", "created": 0, "owned_by": "k3-run"}]});
                    respond_json(req, 200, body.to_string());
                    self.finished(&method, &path, 200, LogStats::default(), arrived);
                }
                Phase::Loading(phase) => err(self.loading(phase), req),
            },
            (_, true, "/v1/chat/completions" | "/v1/completions") => {
                if let Phase::Loading(phase) = self.phase() {
                    return err(self.loading(phase), req);
                }
                let work = read_body(&mut req).and_then(|body| {
                    if path == "/v1/completions" {
                        CompletionJob::parse(&body).map(Work::Completion)
                    } else {
                        ChatJob::parse(&body, self.default_n_gen).map(Work::Chat)
                    }
                });
                match work {
                    Ok(w) => self.enqueue(req, w, arrived),
                    Err(e) => err(e, req),
                }
            }
            (_, _, "/metrics" | "/v1/models" | "/v1/chat/completions" | "/v1/completions") => err(
                HttpError::new(
                    405,
                    "invalid_request_error",
                    format!("{path}: method {method} not allowed"),
                ),
                req,
            ),
            _ => err(
                HttpError::new(
                    404,
                    "invalid_request_error",
                    format!("{path}: not found ({ENDPOINTS})"),
                ),
                req,
            ),
        }
    }

    fn loading(&self, phase: &str) -> HttpError {
        let mut e = HttpError::new(
            503,
            "unavailable_error",
            format!("the model is not ready yet ({phase})"),
        );
        e.retry_after = Some(5);
        e
    }

    /// Queue a checked request for the model thread, or refuse it with 429 when the queue is
    /// full.
    fn enqueue(&self, req: tiny_http::Request, work: Work, arrived: Instant) {
        let gone = self
            .watcher
            .watch(Some(self.local), req.remote_addr().copied());
        let n = self.next_id.fetch_add(1, Ordering::Relaxed) + 1;
        let method = req.method().as_str().to_string();
        let endpoint = work.endpoint();
        self.queued.fetch_add(1, Ordering::Relaxed);
        let p = Pending {
            req,
            work,
            arrived,
            gone,
            n,
        };
        let (p, e) = match self.tx.try_send(p) {
            Ok(()) => {
                self.metrics
                    .set_queue_depth(self.queued.load(Ordering::Relaxed));
                return;
            }
            Err(TrySendError::Full(p)) => {
                self.metrics.count_rejected_full();
                let mut e = HttpError::new(
                    429,
                    "rate_limit_error",
                    format!(
                        "the server is busy: {} requests are already waiting (--max-queue); \
                         retry later",
                        self.max_queue
                    ),
                );
                e.retry_after = Some(self.retry_after());
                (p, e)
            }
            Err(TrySendError::Disconnected(p)) => (
                p,
                HttpError::new(503, "unavailable_error", "the server is stopping"),
            ),
        };
        self.queued.fetch_sub(1, Ordering::Relaxed);
        respond_error(p.req, &e);
        self.finished(&method, endpoint, e.status, LogStats::default(), arrived);
    }

    /// The model thread took a request from the queue.
    fn took(&self) {
        let left = self
            .queued
            .fetch_sub(1, Ordering::Relaxed)
            .saturating_sub(1);
        self.metrics.set_queue_depth(left);
    }
}

/// The request body, at most [`MAX_BODY`] bytes (413 above, with both numbers).
fn read_body(req: &mut tiny_http::Request) -> Result<Vec<u8>, HttpError> {
    let too_big = |n: String| {
        HttpError::new(
            413,
            "invalid_request_error",
            format!("request body is {n} bytes; at most {MAX_BODY} bytes are accepted"),
        )
    };
    if let Some(n) = req.body_length()
        && n > MAX_BODY
    {
        return Err(too_big(n.to_string()));
    }
    let mut body = Vec::new();
    req.as_reader()
        .take(MAX_BODY as u64 + 1)
        .read_to_end(&mut body)
        .map_err(|e| HttpError::bad(format!("cannot read the request body: {e}")))?;
    if body.len() > MAX_BODY {
        return Err(too_big(format!("more than {MAX_BODY}")));
    }
    Ok(body)
}

/// Sampling from a request's fields, errors in the request's terms.
fn sampling_of(t: Option<f32>, p: Option<f32>, seed: Option<u64>) -> Result<Sampling, HttpError> {
    Sampling::from_flags(false, t, p, seed, fresh_seed).map_err(|e| {
        HttpError::bad(
            e.to_string()
                .replace("--temperature", "`temperature`")
                .replace("--top-p", "`top_p`"),
        )
    })
}

/// The generation limit of a request: the field it sent (`max_completion_tokens` wins, as in
/// OpenAI's API) or `default`, in 1..=4096.
fn limit_of(
    max_completion_tokens: Option<usize>,
    max_tokens: Option<usize>,
    default: usize,
) -> Result<usize, HttpError> {
    let (field, n) = match (max_completion_tokens, max_tokens) {
        (Some(n), _) => ("max_completion_tokens", n),
        (None, Some(n)) => ("max_tokens", n),
        (None, None) => ("max_tokens", default),
    };
    if n == 0 || n > super::repl::MAX_GEN {
        return Err(HttpError::bad(format!(
            "`{field}` {n}: must be 1..={} tokens per reply",
            super::repl::MAX_GEN
        )));
    }
    Ok(n)
}

/// A chat request's fields; unknown fields are ignored (clients send many), the ones that
/// would change the meaning and are not implemented are refused.
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
    tools: Option<Box<RawValue>>,
    #[serde(default)]
    tool_choice: Option<Value>,
    #[serde(default)]
    response_format: Option<Box<RawValue>>,
    #[serde(default)]
    stop: Option<Value>,
    #[serde(default)]
    logprobs: Option<bool>,
}

/// A checked chat request.
struct ChatJob {
    messages: Vec<Message>,
    extras: PromptExtras,
    n_gen: usize,
    sampling: Sampling,
    stream: bool,
    model: Option<String>,
}

impl ChatJob {
    fn parse(body: &[u8], default_n_gen: usize) -> Result<ChatJob, HttpError> {
        let r: ChatRequest = serde_json::from_slice(body)
            .map_err(|e| HttpError::bad(format!("request body: {e}")))?;
        if r.n.is_some_and(|n| n != 1) {
            return Err(HttpError::bad(
                "`n`: only one choice per request is supported",
            ));
        }
        if r.stop.as_ref().is_some_and(|s| !s.is_null()) {
            return Err(HttpError::bad(
                "`stop`: stop strings are not supported (the server stops at <|end_of_msg|>, \
                 the model's eos ids and --stop-id)",
            ));
        }
        if r.logprobs == Some(true) {
            return Err(HttpError::bad("`logprobs`: not supported"));
        }
        let Some(last) = r.messages.last() else {
            return Err(HttpError::bad("`messages`: empty"));
        };
        if !matches!(last.role, Role::User | Role::Tool) {
            return Err(HttpError::bad(
                "`messages`: the last message must be from the user or a tool result",
            ));
        }
        let extras = PromptExtras::from_request(
            r.tools.as_deref(),
            r.tool_choice.as_ref(),
            r.response_format.as_deref(),
        )
        .map_err(HttpError::bad)?;
        Ok(ChatJob {
            n_gen: limit_of(r.max_completion_tokens, r.max_tokens, default_n_gen)?,
            sampling: sampling_of(r.temperature, r.top_p, r.seed)?,
            messages: r.messages,
            extras,
            stream: r.stream,
            model: r.model,
        })
    }

    /// 0-based index of the reply's assistant turn (its sampling stream).
    fn turn_index(&self) -> u64 {
        self.messages
            .iter()
            .filter(|m| m.role == Role::Assistant)
            .count() as u64
    }
}

/// A `/v1/completions` request's fields.
#[derive(Deserialize, Debug)]
struct CompletionRequest {
    prompt: Value,
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    max_tokens: Option<usize>,
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
    best_of: Option<u32>,
    #[serde(default)]
    stop: Option<Value>,
    #[serde(default)]
    logprobs: Option<Value>,
    #[serde(default)]
    echo: Option<bool>,
    #[serde(default)]
    suffix: Option<Value>,
}

/// A completion prompt: text (special names such as `<|open|>` read as their ids) or ids.
#[derive(Debug)]
enum PromptInput {
    Text(String),
    Ids(Vec<u32>),
}

struct CompletionJob {
    prompt: PromptInput,
    n_gen: usize,
    sampling: Sampling,
    stream: bool,
    model: Option<String>,
}

impl CompletionJob {
    fn parse(body: &[u8]) -> Result<CompletionJob, HttpError> {
        let r: CompletionRequest = serde_json::from_slice(body)
            .map_err(|e| HttpError::bad(format!("request body: {e}")))?;
        if r.n.is_some_and(|n| n != 1) || r.best_of.is_some_and(|n| n != 1) {
            return Err(HttpError::bad(
                "`n` / `best_of`: only one choice per request is supported",
            ));
        }
        if r.stop.as_ref().is_some_and(|s| !s.is_null()) {
            return Err(HttpError::bad(
                "`stop`: stop strings are not supported (generation stops at <|end_of_msg|>, \
                 the model's eos ids and --stop-id)",
            ));
        }
        if r.logprobs.as_ref().is_some_and(|l| !l.is_null()) {
            return Err(HttpError::bad("`logprobs`: not supported"));
        }
        if r.echo == Some(true) {
            return Err(HttpError::bad("`echo`: not supported"));
        }
        if r.suffix.as_ref().is_some_and(|s| !s.is_null()) {
            return Err(HttpError::bad("`suffix`: not supported"));
        }
        let one = |v: &Value| -> Option<PromptInput> {
            match v {
                Value::String(s) => Some(PromptInput::Text(s.clone())),
                Value::Array(ids) if !ids.is_empty() && ids.iter().all(Value::is_u64) => ids
                    .iter()
                    .map(|i| i.as_u64().and_then(|i| u32::try_from(i).ok()))
                    .collect::<Option<Vec<u32>>>()
                    .map(PromptInput::Ids),
                _ => None,
            }
        };
        let prompt = match &r.prompt {
            Value::Array(items) if items.len() == 1 && !items[0].is_u64() => one(&items[0]),
            Value::Array(items) if items.len() > 1 && !items[0].is_u64() => {
                return Err(HttpError::bad(
                    "`prompt`: one prompt per request (a list of several is not supported)",
                ));
            }
            v => one(v),
        }
        .ok_or_else(|| {
            HttpError::bad("`prompt`: expected a string or a non-empty array of token ids")
        })?;
        if matches!(&prompt, PromptInput::Text(t) if t.is_empty()) {
            return Err(HttpError::bad("`prompt`: empty"));
        }
        Ok(CompletionJob {
            prompt,
            n_gen: limit_of(None, r.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS)?,
            sampling: sampling_of(r.temperature, r.top_p, r.seed)?,
            stream: r.stream,
            model: r.model,
        })
    }

    fn ids(&self, tok: &Tokenizer) -> Result<Vec<u32>, HttpError> {
        match &self.prompt {
            PromptInput::Ids(ids) => Ok(ids.clone()),
            PromptInput::Text(t) => tok
                .encode_with_specials(t)
                .map_err(|e| HttpError::bad(format!("`prompt`: {e}"))),
        }
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

/// A turn's error as an HTTP client should read it. The chat session's context message is
/// written for the REPL (`/reset`, "the history is kept"); a request has no history on the
/// server and no `/reset`: it must send a shorter prompt.
fn http_message(e: &SessionError, field: &str) -> String {
    match e {
        SessionError::ContextTooLong { needed, max } => format!(
            "`{field}`: the prompt is {needed} tokens but the server's context holds {max} \
             positions (fixed when it started, --max-context): send a shorter {}",
            if field == "messages" {
                "conversation"
            } else {
                "prompt"
            }
        ),
        other => format!("`{field}`: {other}"),
    }
}

/// Where one reply goes: server-sent events on the raw connection (`stream: true`), or one
/// JSON body at the end; it also counts and logs the request when it ends.
struct ReplySink {
    shared: Arc<Shared>,
    chat: bool,
    writer: Option<Chunked>,
    req: Option<tiny_http::Request>,
    method: String,
    id: String,
    n: u64,
    created: u64,
    model: String,
    arrived: Instant,
    gone: Arc<AtomicBool>,
    /// Seconds from arrival to the end of the prompt.
    ttft: Option<f64>,
    /// The tool section of a streamed reply, parsed as it arrives.
    tools: ToolStream,
    calls: usize,
}

impl ReplySink {
    /// Start the reply; `None` when a streaming client is already gone.
    fn open(
        shared: &Arc<Shared>,
        p: Pending,
        model_name: &str,
        model: Option<String>,
    ) -> Option<ReplySink> {
        let chat = matches!(p.work, Work::Chat(_));
        let stream = p.work.stream();
        let mut sink = ReplySink {
            shared: Arc::clone(shared),
            chat,
            writer: None,
            req: None,
            method: p.req.method().as_str().to_string(),
            id: if chat {
                format!("chatcmpl-k3run-{}", p.n)
            } else {
                format!("cmpl-k3run-{}", p.n)
            },
            n: p.n,
            created: now_secs(),
            model: model.unwrap_or_else(|| model_name.to_string()),
            arrived: p.arrived,
            gone: p.gone,
            ttft: None,
            tools: ToolStream::default(),
            calls: 0,
        };
        if !stream {
            sink.req = Some(p.req);
            return Some(sink);
        }
        let mut raw = p.req.into_writer();
        let head = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: \
                    no-cache\r\nTransfer-Encoding: chunked\r\n\r\n";
        if raw
            .write_all(head.as_bytes())
            .and_then(|()| raw.flush())
            .is_err()
        {
            sink.end_log(499, LogStats::default());
            sink.shared.metrics.count_disconnect();
            return None;
        }
        let mut w = Chunked(raw);
        if chat {
            let first = sink.chunk(json!({"role": "assistant", "content": ""}), Value::Null);
            let _ = w.write_all(format!("data: {first}\n\n").as_bytes());
        }
        sink.writer = Some(w);
        Some(sink)
    }

    fn path(&self) -> &'static str {
        if self.chat {
            "/v1/chat/completions"
        } else {
            "/v1/completions"
        }
    }

    fn gone(&self) -> bool {
        self.gone.load(Ordering::Relaxed)
    }

    /// A streamed chunk: a chat delta, or a completion's text piece (`delta` is then
    /// `{"text": ...}`).
    fn chunk(&self, delta: Value, finish: Value) -> Value {
        if self.chat {
            json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "choices": [{"index": 0, "delta": delta,
                "finish_reason": finish}]})
        } else {
            json!({"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": [{"index": 0,
                "text": delta.get("text").cloned().unwrap_or(json!("")),
                "logprobs": null, "finish_reason": finish}]})
        }
    }

    fn send(&mut self, v: &Value) -> bool {
        let Some(w) = self.writer.as_mut() else {
            return true;
        };
        w.write_all(format!("data: {v}\n\n").as_bytes())
            .and_then(|()| w.flush())
            .is_ok()
    }

    fn call_id(&self, i: usize) -> String {
        format!("call_k3run_{}_{i}", self.n)
    }

    /// An event of the turn; false when the client is gone.
    fn event(&mut self, ev: Event<'_>) -> bool {
        let (channel, text) = match ev {
            Event::Prefilled(_) => {
                self.ttft = Some(self.arrived.elapsed().as_secs_f64());
                return !self.gone();
            }
            Event::Text { channel, text } => (channel, text),
        };
        if self.writer.is_none() {
            return !self.gone();
        }
        let mut deltas = Vec::new();
        if !self.chat {
            deltas.push(json!({"text": text}));
        } else {
            match channel {
                Channel::Think => deltas.push(json!({"reasoning_content": text})),
                Channel::Response => deltas.push(json!({"content": text})),
                Channel::Tools => {
                    for ev in self.tools.push(text) {
                        deltas.push(self.tool_delta(ev));
                    }
                }
                Channel::Between => {}
            }
        }
        for d in deltas {
            let c = self.chunk(d, Value::Null);
            if !self.send(&c) {
                return false;
            }
        }
        !self.gone()
    }

    fn tool_delta(&mut self, ev: ToolEvent) -> Value {
        match ev {
            ToolEvent::Call(c) => {
                let i = self.calls;
                self.calls += 1;
                json!({"tool_calls": [c.to_json(&self.call_id(i), i)]})
            }
            ToolEvent::Unparsed(t) => json!({"content": t}),
        }
    }

    fn end_log(&self, status: u16, s: LogStats) {
        self.shared
            .finished(&self.method, self.path(), status, s, self.arrived);
    }

    /// End the reply with the turn's outcome (or its error: 400, or 500 for a forward-pass
    /// failure). `batch` is the most requests decoded together with this one.
    fn done(mut self, outcome: &Result<TurnOutcome, SessionError>, batch: usize) {
        let o = match outcome {
            Ok(o) => o,
            Err(e) => {
                let fatal = matches!(e, SessionError::Exec(_));
                let field = if self.chat { "messages" } else { "prompt" };
                let mut err = HttpError::new(
                    if fatal { 500 } else { 400 },
                    if fatal {
                        "server_error"
                    } else {
                        "invalid_request_error"
                    },
                    http_message(e, field),
                );
                if fatal {
                    err.message = e.to_string();
                }
                return self.fail(err);
            }
        };
        let generated = o.generated.len();
        let per_token = (generated > 0).then(|| o.decode_seconds / generated as f64);
        let times = RequestTimes {
            prompt_tokens: o.prefill.total,
            generated_tokens: generated,
            ttft: self.ttft,
            per_token,
            latency: self.arrived.elapsed().as_secs_f64(),
        };
        self.shared.metrics.finish_generation(&times);
        let usage = json!({"prompt_tokens": o.prefill.total,
            "completion_tokens": generated,
            "total_tokens": o.prefill.total + generated});
        let k3 = json!({"reused_positions": o.prefill.reused, "fed_positions": o.prefill.fed,
            "prefill_seconds": o.prefill.seconds, "decode_seconds": o.decode_seconds,
            "speculation": o.speculation, "batch": batch});
        let client_left = o.stop == Stop::Interrupted && self.gone();
        let stats = LogStats {
            prompt: Some(o.prefill.total),
            generated: Some(generated),
            ttft: self.ttft,
            per_token,
        };
        if client_left {
            self.shared.metrics.count_disconnect();
        }
        let status = if client_left { 499 } else { 200 };
        let normal_stop = matches!(o.stop, Stop::EndOfMessage | Stop::StopId(_));
        if self.writer.is_some() {
            // The rest of a tool section that never closed a call.
            if let Some(ev) = std::mem::take(&mut self.tools).finish() {
                let d = self.tool_delta(ev);
                let c = self.chunk(d, Value::Null);
                self.send(&c);
            }
            let finish = if self.calls > 0 && normal_stop {
                "tool_calls"
            } else {
                finish_reason(o.stop)
            };
            let mut last = self.chunk(json!({}), json!(finish));
            last["usage"] = usage;
            last["k3"] = k3;
            if let Some(mut w) = self.writer.take() {
                let _ = w
                    .write_all(format!("data: {last}\n\ndata: [DONE]\n\n").as_bytes())
                    .and_then(|()| w.finish());
            }
        } else if let Some(req) = self.req.take() {
            let body = if self.chat {
                let (calls, rest) = o
                    .reply
                    .tools_xtml
                    .as_deref()
                    .map_or((Vec::new(), String::new()), parse_section);
                let mut message = json!({"role": "assistant",
                    "content": format!("{}{rest}", o.reply.content)});
                if !o.reply.reasoning_content.is_empty() {
                    message["reasoning_content"] = json!(o.reply.reasoning_content);
                }
                let finish = if !calls.is_empty() && normal_stop {
                    "tool_calls"
                } else {
                    finish_reason(o.stop)
                };
                if !calls.is_empty() {
                    message["tool_calls"] = self.tool_calls_json(&calls);
                }
                json!({"id": self.id, "object": "chat.completion",
                    "created": self.created, "model": self.model, "choices": [{"index": 0,
                    "message": message, "finish_reason": finish}], "usage": usage, "k3": k3})
            } else {
                json!({"id": self.id, "object": "text_completion",
                    "created": self.created, "model": self.model, "choices": [{"index": 0,
                    "text": o.reply.content, "logprobs": null,
                    "finish_reason": finish_reason(o.stop)}], "usage": usage, "k3": k3})
            };
            respond_json(req, 200, body.to_string());
        }
        self.end_log(status, stats);
    }

    fn tool_calls_json(&self, calls: &[ParsedCall]) -> Value {
        Value::Array(
            calls
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    let mut v = c.to_json(&self.call_id(i), i);
                    if let Some(o) = v.as_object_mut() {
                        o.remove("index");
                    }
                    v
                })
                .collect(),
        )
    }

    /// End the reply with an error.
    fn fail(mut self, e: HttpError) {
        if let Some(mut w) = self.writer.take() {
            let _ = w
                .write_all(format!("data: {}\n\n", e.body()).as_bytes())
                .and_then(|()| w.finish());
        } else if let Some(req) = self.req.take() {
            respond_error(req, &e);
        }
        self.end_log(e.status, LogStats::default());
    }
}

/// A request the model thread dropped before starting it: its client had already gone.
fn dropped(shared: &Shared, p: Pending) {
    shared.metrics.count_disconnect();
    let method = p.req.method().as_str().to_string();
    shared.finished(
        &method,
        p.work.endpoint(),
        499,
        LogStats::default(),
        p.arrived,
    );
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
        ..
    } = prepare(run)?;
    let front = {
        let mut f = FRONT.lock().unwrap_or_else(|e| e.into_inner());
        match f.take() {
            Some(front) => front,
            None => Front::start(run, &prepare(run)?)?,
        }
    };
    let Front { shared, rx, bound } = front;
    shared.set_phase(Phase::Loading("preparing the request slots"));
    // Each request sets its own sampling and limit.
    let cfg = session_config(spec, &tok, run, thinking, n_gen, Sampling::Greedy)?;
    // Before answering: a tokenizer whose chat control tokens the model cannot embed is
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
    shared.set_phase(Phase::Ready {
        model: spec.name.clone(),
    });
    println!(
        "k3-run serve: listening on http://{bound} (model {}, {} layers; {}; default max_tokens \
         {n_gen}; context {} positions; {}; {}; {}); {ENDPOINTS}; Ctrl-C stops",
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
        },
        if shared.key.is_some() {
            "API key required"
        } else {
            "no API key"
        }
    );
    let _ = std::io::stdout().flush();

    let stop = Arc::new(AtomicBool::new(false));
    let sig_ids: Vec<_> = [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM]
        .into_iter()
        .map(|s| signal_hook::flag::register(s, Arc::clone(&stop)))
        .collect::<Result<_, _>>()
        .map_err(|e| Failure::usage(format!("cannot install the Ctrl-C handler: {e}")))?;
    let mut srv = Model {
        spec,
        shared: &shared,
        rx: &rx,
        window,
        stop: &stop,
    };
    let result = match mode {
        Mode::Batched(mut batcher) => srv.batched(&mut batcher, exec, providers),
        Mode::Serial(mut session) => srv.serial(&mut session, exec, providers),
    };
    for id in sig_ids {
        signal_hook::low_level::unregister(id);
    }
    eprintln!(
        "k3-run serve: stopped after {} request(s)",
        shared.next_id.load(Ordering::Relaxed)
    );
    result
}

/// One request at a time on a chat session, or several together on the batch scheduler.
enum Mode<'s> {
    Serial(Box<Session<'s>>),
    Batched(Box<Batcher<'s, ReplySink>>),
}

/// The model thread's side of the server.
struct Model<'a, 's> {
    spec: &'s ModelSpec,
    shared: &'a Arc<Shared>,
    rx: &'a Receiver<Pending>,
    /// `--batch-window`: after a request reaches an idle server, wait this long for others
    /// before the first step, so requests sent together start together.
    window: Duration,
    stop: &'a AtomicBool,
}

impl Model<'_, '_> {
    fn stopping(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }

    /// The next queued request whose client is still there, waiting up to `wait`.
    fn next(&self, wait: Option<Duration>) -> Result<Option<Pending>, Failure> {
        loop {
            let got = match wait {
                Some(d) => self.rx.recv_timeout(d).map_err(|e| match e {
                    RecvTimeoutError::Timeout => None,
                    RecvTimeoutError::Disconnected => Some(()),
                }),
                None => self.rx.try_recv().map_err(|e| match e {
                    TryRecvError::Empty => None,
                    TryRecvError::Disconnected => Some(()),
                }),
            };
            match got {
                Ok(p) => {
                    self.shared.took();
                    if p.gone.load(Ordering::Relaxed) {
                        dropped(self.shared, p);
                        continue;
                    }
                    return Ok(Some(p));
                }
                Err(None) => return Ok(None),
                Err(Some(())) => return Err(Failure::usage("--serve: the HTTP listener stopped")),
            }
        }
    }

    fn engine_counters(&self, providers: &Providers<'_>) {
        self.shared
            .metrics
            .set_engine(providers.trunk.stats(), providers.experts.stats());
    }

    fn serial(
        &mut self,
        session: &mut Session<'_>,
        exec: &mut Executor<'_>,
        providers: &mut Providers<'_>,
    ) -> Result<u8, Failure> {
        loop {
            if self.stopping() {
                return Ok(exit::INTERRUPTED);
            }
            let Some(p) = self.next(Some(Duration::from_millis(200)))? else {
                continue;
            };
            self.shared.metrics.set_running(1);
            let r = self.one(session, exec, providers, p);
            self.shared.metrics.set_running(0);
            self.engine_counters(providers);
            r?;
        }
    }

    /// Answer a queued request with an error before its reply started.
    fn refuse(&self, p: Pending, e: &HttpError) {
        let method = p.req.method().as_str().to_string();
        let path = p.work.endpoint();
        let arrived = p.arrived;
        respond_error(p.req, e);
        self.shared
            .finished(&method, path, e.status, LogStats::default(), arrived);
    }

    /// One request, served alone. `Err` only for a failure that must stop the server.
    fn one(
        &self,
        session: &mut Session<'_>,
        exec: &mut Executor<'_>,
        providers: &mut Providers<'_>,
        p: Pending,
    ) -> Result<(), Failure> {
        // Render or tokenize before any reply is started, so a bad request is a plain 400.
        let prepared = match &p.work {
            Work::Chat(c) => session
                .set_messages(c.messages.clone())
                .and_then(|()| {
                    session.set_prompt_extras(
                        c.extras.tools.clone(),
                        c.extras.tool_choice,
                        c.extras.response_format.clone(),
                    )
                })
                .map(|()| {
                    session.set_turn_settings(c.n_gen, c.sampling);
                    None
                })
                .map_err(|e| HttpError::bad(format!("`messages`: {e}"))),
            Work::Completion(c) => c.ids(session.tokenizer()).map(|ids| {
                session.set_turn_settings(c.n_gen, c.sampling);
                Some(ids)
            }),
        };
        let raw_prompt = match prepared {
            Ok(r) => r,
            Err(e) => {
                self.refuse(p, &e);
                return Ok(());
            }
        };
        let model = match &p.work {
            Work::Chat(c) => c.model.clone(),
            Work::Completion(c) => c.model.clone(),
        };
        let Some(mut sink) = ReplySink::open(self.shared, p, &self.spec.name, model) else {
            return Ok(());
        };
        let cut = Arc::clone(&sink.gone);
        let stop = self.stop;
        let mut on_event = |ev: Event<'_>| {
            if stop.load(Ordering::Relaxed) || !sink.event(ev) {
                cut.store(true, Ordering::Relaxed);
            }
        };
        let outcome = match &raw_prompt {
            None => session.reply(exec, providers, &cut, &mut on_event),
            Some(ids) => session.complete_raw(exec, providers, ids, &cut, &mut on_event),
        };
        if let Ok(o) = &outcome {
            let chunk = exec.prefill_chunk().max(1);
            for _ in 0..(o.prefill.fed.div_ceil(chunk) + o.generated.len()) {
                self.shared.metrics.count_step(1);
            }
        }
        sink.done(&outcome, 1);
        match outcome {
            Err(SessionError::Exec(e)) => Err(exec_failure(e)),
            _ => Ok(()),
        }
    }

    /// The batched server (`--serve-batch N`, N > 1): requests are admitted between steps
    /// while a slot is free (the rest wait in the queue, in order) and decode together, one
    /// layer-major pass per step ([`Batcher`]).
    fn batched(
        &mut self,
        batcher: &mut Batcher<'_, ReplySink>,
        exec: &mut Executor<'_>,
        providers: &mut Providers<'_>,
    ) -> Result<u8, Failure> {
        loop {
            if self.stopping() {
                for f in batcher.interrupt_all() {
                    f.sink.done(&f.outcome, f.max_batch);
                }
                return Ok(exit::INTERRUPTED);
            }
            let idle = batcher.is_idle();
            self.admit(batcher, idle)?;
            // A client that went away frees its slot before the step.
            for f in batcher.drop_gone(ReplySink::gone) {
                f.sink.done(&f.outcome, f.max_batch);
            }
            self.shared.metrics.set_running(batcher.active());
            if batcher.is_idle() {
                continue;
            }
            let n = batcher.active();
            let stop = self.stop;
            let step = batcher.step(exec, providers, &mut |sink, ev| {
                !stop.load(Ordering::Relaxed) && sink.event(ev)
            });
            self.shared.metrics.count_step(n);
            self.engine_counters(providers);
            match step {
                Ok(done) => {
                    for f in done {
                        f.sink.done(&f.outcome, f.max_batch);
                    }
                }
                Err(e) => {
                    let msg = format!("forward pass failed: {e}");
                    for sink in batcher.abort() {
                        sink.fail(HttpError::new(500, "server_error", msg.clone()));
                    }
                    return Err(exec_failure(e));
                }
            }
            self.shared.metrics.set_running(batcher.active());
        }
    }

    /// Take requests while a slot is free: waiting up to 200 ms when `idle` (then the batch
    /// window), else only those already queued.
    fn admit(&self, batcher: &mut Batcher<'_, ReplySink>, idle: bool) -> Result<(), Failure> {
        let mut deadline: Option<Instant> = None;
        while batcher.has_room() {
            let wait = match (idle, deadline) {
                (true, None) => Some(Duration::from_millis(200)),
                (true, Some(d)) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        break;
                    }
                    Some(left)
                }
                (false, _) => None,
            };
            let Some(p) = self.next(wait)? else {
                break;
            };
            let (prompt, raw, turn_index, n_gen, sampling, model) = match &p.work {
                Work::Chat(c) => (
                    batcher
                        .render_with(
                            &c.messages,
                            c.extras.tools.clone(),
                            c.extras.tool_choice,
                            c.extras.response_format.clone(),
                        )
                        .map_err(|e| HttpError::bad(format!("`messages`: {e}"))),
                    false,
                    c.turn_index(),
                    c.n_gen,
                    c.sampling,
                    c.model.clone(),
                ),
                Work::Completion(c) => (
                    c.ids(batcher.tokenizer()),
                    true,
                    0,
                    c.n_gen,
                    c.sampling,
                    c.model.clone(),
                ),
            };
            let prompt = match prompt {
                Ok(ids) => ids,
                Err(e) => {
                    self.refuse(p, &e);
                    continue;
                }
            };
            let Some(sink) = ReplySink::open(self.shared, p, &self.spec.name, model) else {
                continue;
            };
            let job = Job {
                prompt,
                n_gen,
                sampling,
                turn_index,
                sink,
            };
            let admitted = if raw {
                batcher.admit_raw(job)
            } else {
                batcher.admit(job)
            };
            if let Err((sink, e)) = admitted {
                sink.done(&Err(e), 0);
            }
            if idle && deadline.is_none() {
                deadline = Some(Instant::now() + self.window);
            }
        }
        Ok(())
    }
}
