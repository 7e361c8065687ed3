use super::*;

/// Exit codes (docs/DESIGN.md §6).
pub mod exit {
    pub const OK: u8 = 0;
    pub const FORWARD: u8 = 1;
    pub const USAGE: u8 = 2;
    pub const OUT_WRITE: u8 = 3;
    pub const EXPERT_LOAD: u8 = 4;
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
