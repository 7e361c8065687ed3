//! `k3-run doctor`: can this machine run the model, and how fast can it read?
//!
//! PLACEHOLDER being replaced by the benchmark engineer; the signatures are the contract with
//! `cli.rs`.

use clap::Args;

use crate::cli::Failure;

/// Flags of `k3-run doctor`.
#[derive(Args, Debug, Clone)]
pub struct DoctorArgs {}

/// Run `doctor`; returns the exit code.
pub fn main(_a: &DoctorArgs) -> Result<u8, Failure> {
    Err(Failure::usage("doctor is not implemented yet"))
}
