//! The `k3-run` command line over the [`k3_engine`] library: flags, run configs, subcommands,
//! what is printed and the exit codes.
//!
//! Nothing in the engine imports from here. Inside this crate the engine's modules are in
//! scope by name (`crate::stream`, `crate::exec`); they are not re-exported: a program that
//! embeds the engine depends on `k3-engine` (its `api` module) directly.

pub(crate) use k3_engine::{
    bytes_bar, checkpoint, draft, exec, pipeline, plan, platform, plugins, resident, run, session,
    speculate, statefile, stream, synth, weights,
};

pub mod budget;
pub mod chat;
pub mod cli;
pub mod digest;
pub mod doctor;
pub mod download;
pub mod runconfig;
pub mod verify;
