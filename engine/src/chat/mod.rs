//! A conversation's model side: [`session`] (transcript + model state + one assistant turn),
//! [`batch`] (several conversations decoded together, one pass over the weights per step) and
//! [`sample`] (greedy / PCG32 temperature + top-p). The REPL and the HTTP server of the
//! `k3-run` binary drive these.
//!
//! Must not: model math (it drives [`crate::exec::Executor`]), XTML or tokenizer rules
//! (k3-text owns them), or terminal and network I/O.

pub mod batch;
pub mod sample;
pub mod session;
