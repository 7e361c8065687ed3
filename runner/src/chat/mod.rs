//! Chat: the `render-chat` subcommand and the `--chat` REPL (issue 5; docs/CHAT.md).
//!
//! Owns: the chat flags ([`ChatArgs`], flattened into the main run command, and
//! [`RenderChatArgs`]) and the two entry points `cli.rs` calls. The work is split into
//! [`render`] (render-chat), [`session`] (transcript + model state + one assistant turn),
//! [`sample`] (greedy / PCG32 temperature + top-p) and [`repl`] (line editing, commands,
//! printing, the history file, Ctrl-C).
//!
//! Must not: model math (it drives [`crate::exec::Executor`]), XTML or tokenizer rules
//! (k3-text owns them), or serialise model state (a restart re-prefills the history).

pub mod limits;
pub mod metrics;
pub mod render;
pub mod repl;
pub mod serve;
pub mod tools;

pub use k3_engine::chat::{batch, sample, session};

use std::path::PathBuf;

use clap::Args;
use k3_models::spec::ModelSpec;

use crate::cli::{Failure, RunArgs};
use crate::exec::{Executor, Providers};

/// Chat flags of the main run command (`k3-run MODEL_DIR --chat ...`). Also used there:
/// `--tok DIR` (default: MODEL_DIR when it holds tiktoken.model), `--gen N` (chat default
/// 4096), `--incremental`, `--max-context N`, `--threads N`, `--stop-id N`.
#[derive(Args, Debug, Default, Clone)]
pub struct ChatArgs {
    /// Interactive chat REPL in K3's XTML chat format (see docs/CHAT.md).
    #[arg(long)]
    pub chat: bool,
    /// Chat: system prompt; must equal the initial system record of an existing --history.
    #[arg(long, requires = "chat")]
    pub system: Option<String>,
    /// Chat: transcript file (JSONL records {"role","content","reasoning_content"}); loaded,
    /// validated and re-prefilled at start, one turn appended per reply. Created 0600.
    #[arg(long, requires = "chat")]
    pub history: Option<PathBuf>,
    /// Chat / serve: no thinking (no effort message, earlier turns without the think
    /// channel, the reply starts in the response channel).
    #[arg(long)]
    pub no_think: bool,
    /// Chat / serve: thinking effort low, high or max (default max).
    #[arg(long, value_name = "E")]
    pub thinking_effort: Option<String>,
    /// Serve the model over HTTP at ADDR (e.g. 127.0.0.1:8080; port 0 picks a free one), with
    /// an OpenAI-compatible `POST /v1/chat/completions` (streaming too) and `GET /v1/models`.
    /// See docs/CHAT.md.
    #[arg(long, value_name = "ADDR", conflicts_with = "chat")]
    pub serve: Option<String>,
    /// Serve: decode up to N requests together (default 1, at most 64), each step one pass
    /// over the weights for all of them; every request holds its own decode state (checked
    /// against memory at start). Replies are the same as served one at a time.
    #[arg(long, value_name = "N", requires = "serve")]
    pub serve_batch: Option<usize>,
    /// Serve with --serve-batch: after a request reaches an idle server, wait up to MS
    /// milliseconds for more before the first step, so requests sent together start together
    /// (default 0).
    #[arg(long, value_name = "MS", requires = "serve")]
    pub batch_window: Option<u64>,
    /// Serve: the API key every request but `GET /health` must send as `Authorization:
    /// Bearer KEY` (default: the K3RUN_API_KEY environment variable; none: no key needed).
    /// Never printed.
    #[arg(long, value_name = "KEY", requires = "serve")]
    pub api_key: Option<String>,
    /// Serve: most requests waiting for a slot (default 64); one more is answered 429 with
    /// Retry-After.
    #[arg(long, value_name = "N", requires = "serve")]
    pub max_queue: Option<usize>,
    /// Serve: no log line per request on stderr.
    #[arg(long, requires = "serve")]
    pub no_request_log: bool,
    /// Chat: sample with this temperature (switches sampling on; default 1.0; 0 = greedy).
    #[arg(long, requires = "chat")]
    pub temperature: Option<f32>,
    /// Chat: nucleus sampling threshold (switches sampling on; default 0.95).
    #[arg(long, requires = "chat")]
    pub top_p: Option<f32>,
    /// Chat: sampling seed; turn k of the conversation uses PCG32 stream k of this seed, so
    /// a replayed transcript reproduces (switches sampling on).
    #[arg(long, requires = "chat")]
    pub seed: Option<u64>,
    /// Chat: force argmax even if sampling flags are given.
    #[arg(long, requires = "chat")]
    pub greedy: bool,
}

/// `k3-run render-chat`: print exactly what the model will see.
#[derive(Args, Debug, Clone)]
pub struct RenderChatArgs {
    /// Transcript, one JSON record per line: {"role","content","reasoning_content"}.
    #[arg(long)]
    pub history: PathBuf,
    /// System prompt: starts an empty history; must equal the initial system record of a
    /// non-empty one (as in --chat).
    #[arg(long)]
    pub system: Option<String>,
    /// No thinking (as in --chat).
    #[arg(long)]
    pub no_think: bool,
    /// Thinking effort low, high or max (default max).
    #[arg(long, value_name = "E")]
    pub thinking_effort: Option<String>,
    /// Tokenizer directory (tiktoken.model + tokenizer_config.json): checks the prompt
    /// tokenizes and counts its ids.
    #[arg(long)]
    pub tok: Option<PathBuf>,
    /// Also print the token ids (needs --tok): after the text, a newline, then the ids on
    /// one comma-separated line.
    #[arg(long)]
    pub ids: bool,
    /// Encoder revision: c5d1dd4 (the released checkpoint) or hf-main (vLLM's vendored copy;
    /// different attribute segmentation).
    #[arg(long, default_value = "c5d1dd4")]
    pub revision: String,
    /// Render the transcript only, without the assistant generation prompt.
    #[arg(long)]
    pub no_generation_prompt: bool,
    /// Tool declarations: a JSON file holding an array of OpenAI-style tool specs.
    #[arg(long, value_name = "FILE")]
    pub tools: Option<PathBuf>,
    /// Tool choice message: required or none.
    #[arg(long)]
    pub tool_choice: Option<String>,
    /// Response format: a JSON file, {"type":"json_object"} or
    /// {"type":"json_schema","schema":{...}}.
    #[arg(long, value_name = "FILE")]
    pub response_format: Option<PathBuf>,
}

/// Run `render-chat`; returns the exit code.
pub fn render_chat_main(a: &RenderChatArgs) -> Result<u8, Failure> {
    render::main(a)
}

/// Check the `--chat` flags, the tokenizer and an existing `--history` (read only) before the
/// model is loaded, so a typo fails in a second rather than after loading weights.
/// [`repl_main`] repeats these checks.
pub fn preflight(run: &RunArgs) -> Result<(), Failure> {
    if run.chat.serve.is_some() {
        return serve::preflight(run);
    }
    repl::preflight(run)
}

/// Run the REPL on a loaded model; returns the exit code.
pub fn repl_main(
    spec: &ModelSpec,
    exec: &mut Executor<'_>,
    providers: &mut Providers<'_>,
    run: &RunArgs,
) -> Result<u8, Failure> {
    if run.chat.serve.is_some() {
        return serve::main(spec, exec, providers, run);
    }
    repl::main(spec, exec, providers, run)
}
