use super::*;

/// Exit codes (docs/DESIGN.md §6), the same in every subcommand. The rule: 2 is about what
/// was asked (flags, and the text files that describe the job: the model's config.json, a
/// manifest, a preset, an I/O policy, a run config, a packed trunk's trunk.json); 1 is about
/// the model's weights (a checkpoint index or shard that cannot be read, is truncated or does
/// not match the model, a forward pass that fails, a check that finds files that are not the
/// model's).
pub mod exit {
    /// Success.
    pub const OK: u8 = 0;
    /// Tensor binding or forward failure, including a checkpoint file (index or shard) that
    /// cannot be read, is truncated or malformed, or does not hold the model's tensors.
    pub const FORWARD: u8 = 1;
    /// A check (`verify`, `budget`, `pack-trunk --check`) that found files that are not the
    /// model's: the same code as a run that cannot bind them.
    pub const MISMATCH: u8 = FORWARD;
    /// Usage error, or a description file that cannot be read with confidence.
    pub const USAGE: u8 = 2;
    /// The work finished but `--out` (or another output file) could not be written.
    pub const OUT_WRITE: u8 = 3;
    /// A run finished but a routed expert failed to load.
    pub const EXPERT_LOAD: u8 = 4;
    /// Stopped early by Ctrl-C.
    pub const INTERRUPTED: u8 = 5;
}

/// A failure with its exit code.
#[derive(Debug)]
pub struct Failure {
    pub code: u8,
    pub msg: String,
}

impl Failure {
    pub fn usage(msg: impl Into<String>) -> Failure {
        Failure {
            code: exit::USAGE,
            msg: msg.into(),
        }
    }
}

/// A checkpoint whose files cannot be opened, read or bound (missing or malformed index, a
/// missing, truncated or malformed shard): exit 1 in every subcommand that reads the weights
/// (a run, `pack-trunk`, `budget`, `verify`). The message names the file.
pub fn checkpoint_failure(e: impl std::fmt::Display) -> Failure {
    Failure {
        code: exit::FORWARD,
        msg: e.to_string(),
    }
}

pub(crate) fn exec_failure(e: ExecError) -> Failure {
    let code = match &e {
        ExecError::Weight(WeightError::Expert { .. }) => exit::EXPERT_LOAD,
        _ => exit::FORWARD,
    };
    Failure {
        code,
        msg: e.to_string(),
    }
}

pub(crate) fn stream_failure(e: crate::stream::StreamError) -> Failure {
    use crate::stream::StreamError;
    let code = match &e {
        StreamError::Config(_) | StreamError::Plan(_) | StreamError::TrunkManifest { .. } => {
            exit::USAGE
        }
        _ => exit::FORWARD,
    };
    Failure {
        code,
        msg: e.to_string(),
    }
}
