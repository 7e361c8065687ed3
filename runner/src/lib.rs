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
pub mod exec;
pub mod plan;
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
