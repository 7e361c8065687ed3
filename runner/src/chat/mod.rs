//! Chat: the `render-chat` subcommand and the `--chat` REPL (issue 5).
//!
//! Owns: rendering transcripts with K3's XTML format (via k3-text), the REPL loop, history
//! files, sampling. Must not: model math (it drives [`crate::exec::Executor`]).
//!
//! PLACEHOLDER being replaced by the chat engineer: signatures are the contract with `cli.rs`.

use std::path::PathBuf;

use clap::Args;
use k3_models::spec::ModelSpec;

use crate::cli::{Failure, RunArgs};
use crate::exec::{Executor, Providers};

/// Chat flags of the main run command.
#[derive(Args, Debug, Default, Clone)]
pub struct ChatArgs {
    /// Interactive chat REPL in K3's XTML chat format (needs --tok).
    #[arg(long)]
    pub chat: bool,
}

/// `k3-run render-chat`: print exactly what the model will see.
#[derive(Args, Debug, Clone)]
pub struct RenderChatArgs {
    /// Transcript, one JSON record per line: {"role","content","reasoning_content"}.
    #[arg(long)]
    pub history: PathBuf,
}

/// Run `render-chat`; returns the exit code.
pub fn render_chat_main(_a: &RenderChatArgs) -> Result<u8, Failure> {
    Err(Failure::usage("render-chat is not implemented yet"))
}

/// Run the REPL on a loaded model; returns the exit code.
pub fn repl_main(
    _spec: &ModelSpec,
    _exec: &mut Executor<'_>,
    _providers: &mut Providers<'_>,
    _run: &RunArgs,
) -> Result<u8, Failure> {
    Err(Failure::usage("--chat is not implemented yet"))
}
