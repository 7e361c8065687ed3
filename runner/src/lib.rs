//! The `k3-run` command line over the [`k3_engine`] library: flags, run configs, subcommands,
//! what is printed and the exit codes.
//!
//! The engine's modules are re-exported under their names so the command-line code reads
//! `crate::exec`, `crate::stream` as before; nothing in the engine imports from here.

pub use k3_engine::{
    arena, bytes_bar, checkpoint, draft, exec, machine, model, pipeline, plan, plugins, resident,
    run, session, speculate, statefile, stream, synth, weights,
};

pub mod budget;
pub mod chat;
pub mod cli;
pub mod digest;
pub mod doctor;
pub mod download;
pub mod runconfig;
pub mod verify;
