//! k3-run library: storage, planning, execution.
//!
//! Map: [`checkpoint`] reads real-layout safetensors checkpoints; [`synth`] writes synthetic
//! ones; [`plan`] compiles a spec into an execution plan; [`exec`] runs the forward pass over
//! the [`weights`] providers ([`resident`], optionally over an [`arena`], or [`stream`]);
//! [`run`] is the decode loop ([`speculate`]: several greedy tokens per trunk pass, the same
//! tokens); [`cli`] is the `k3-run` command line; [`verify`] checks a download and [`budget`]
//! classifies its tensors for the resident floor.

pub mod arena;
pub mod budget;
pub mod chat;
pub mod checkpoint;
pub mod cli;
pub mod digest;
pub mod doctor;
pub mod draft;
pub mod exec;
pub mod plan;
pub mod plugins;
pub mod plugins_cmd;
pub mod resident;
pub mod run;
pub mod runconfig;
pub mod session;
pub mod speculate;
pub mod statefile;
pub mod stream;
pub mod synth;
pub mod verify;
pub mod weights;

/// A byte-count progress bar on stderr (`MSG [=====>   ] 1.2 GiB/4 GiB (1.1 GiB/s, 3s)`), or a
/// hidden one when `show` is false.
pub(crate) fn bytes_bar(total: u64, show: bool, msg: &'static str) -> indicatif::ProgressBar {
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
