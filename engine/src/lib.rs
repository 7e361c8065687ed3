//! k3-engine: run Kimi-family checkpoints on one CPU, streaming weights from disk, with the
//! same output bits at every memory budget, thread count and instruction set.
//!
//! Map: [`checkpoint`] reads real-layout safetensors checkpoints; [`model`] binds a manifest
//! and config.json into a spec; [`synth`] writes synthetic checkpoints; [`plan`] compiles a
//! spec into an execution plan; [`exec`] runs the forward pass (one file per block) over the
//! [`weights`] providers ([`resident`], optionally over an [`arena`], or [`stream`]);
//! [`session`] builds the providers a memory budget allows; [`run`] is the decode loop
//! ([`speculate`]: several greedy tokens per trunk pass, the same tokens); [`chat`] holds a
//! conversation's state and batches several; [`statefile`] saves and loads decode state;
//! [`platform`] is the one place that asks the operating system (Linux, macOS, Windows) for
//! uncached reads, aligned and large-page memory, and the memory this process may use.
//!
//! **Embedding**: [`api`] is the stable, documented surface (open a model with settings,
//! generate with a per-token callback, save and load the decode state, read the report);
//! `examples/generate.rs` uses it. The other modules are internals of the `k3-run` binary, the
//! tests and the benches, and may change.
#![deny(missing_docs)]

pub mod api;

// Internals: public so the `k3-run` binary, the tests and the benches reach them; their items
// are documented where they are not obvious, and they are not covered by `missing_docs`.
#[allow(missing_docs)]
pub mod arena;
#[allow(missing_docs)]
pub mod chat;
// A `PathBuf` is 32 bytes on Windows (24 elsewhere), which takes `CheckpointError` over
// clippy's 128-byte `result_large_err` line there only; the error path is cold.
#[allow(missing_docs)]
#[cfg_attr(windows, allow(clippy::result_large_err))]
pub mod checkpoint;
#[allow(missing_docs)]
pub mod draft;
#[allow(missing_docs)]
pub mod exec;
#[allow(missing_docs)]
pub mod model;
#[allow(missing_docs)]
pub mod pipeline;
#[allow(missing_docs)]
pub mod plan;
#[allow(missing_docs)]
pub mod platform;
#[allow(missing_docs)]
pub mod plugins;
#[allow(missing_docs)]
pub mod resident;
#[allow(missing_docs)]
pub mod run;
#[allow(missing_docs)]
pub mod session;
#[allow(missing_docs)]
pub mod speculate;
#[allow(missing_docs)]
pub mod statefile;
#[allow(missing_docs)]
pub mod stream;
#[allow(missing_docs)]
pub mod synth;
#[allow(missing_docs)]
pub mod weights;

/// A byte-count progress bar on stderr (`MSG [=====>   ] 1.2 GiB/4 GiB (1.1 GiB/s, 3s)`), or a
/// hidden one when `show` is false.
pub fn bytes_bar(total: u64, show: bool, msg: &'static str) -> indicatif::ProgressBar {
    let bar = if show {
        indicatif::ProgressBar::new(total)
    } else {
        indicatif::ProgressBar::hidden()
    };
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{msg:>12} [{bar:40}] {bytes}/{total_bytes} ({bytes_per_sec}, {eta})",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_message(msg);
    bar
}
