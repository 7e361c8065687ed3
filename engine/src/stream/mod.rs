//! Streaming providers: how the weights get from disk into RAM when the model does not fit.
//!
//! Owns: aligned buffers and direct I/O ([`aligned`], [`direct`]), the trunk memory plan
//! ([`plan`]), presets and I/O policies ([`presets`], [`io_policy`]), the one-time trunk
//! packer ([`pack`]), the streamed trunk ([`trunk`]), the routed-expert store and cache
//! ([`experts`]) and the ultra-low-memory global tensors ([`global`]).
//! Must not: compute anything the output depends on (kernels do), or change a byte: every
//! provider hands the executor the checkpoint's own bytes, so output bits cannot depend on
//! the budget (docs/NUMERICS.md §1).
//! Follows upstream: docs/DESIGN.md §2-§5 and the two seed documents (pinned prefix + ring slots,
//! O_DIRECT, 2 MB pages, the one-slot fallback, the true resident hit rate).

pub mod aligned;
pub mod blocking;
pub mod check;
pub mod compress;
pub mod direct;
pub mod experts;
pub mod global;
pub mod io_policy;
pub mod pack;
pub mod plan;
pub mod plugin;
pub mod policy;
pub mod presets;
pub mod trace;
pub mod trunk;
#[cfg(all(feature = "io-uring", target_os = "linux"))]
pub mod uring;

use std::path::Path;

/// Errors of the streaming layer. Messages name the file, layer or key concerned.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    #[error("cannot {op} {path}: {source}")]
    Io {
        op: &'static str,
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Plan(#[from] plan::PlanError),
    #[error("{0}")]
    Config(String),
    #[error("pack-trunk: {0}")]
    Pack(String),
    /// A packed trunk that fails while it is read (a record that does not decode, a short map).
    #[error("packed trunk {path}: {msg}")]
    Trunk { path: String, msg: String },
    /// A packed trunk refused at open: trunk.json missing, unreadable, inconsistent in itself,
    /// with its trunk.bin or with the model (exit 2: a config that cannot be read with
    /// confidence).
    #[error("packed trunk {path}: {msg}")]
    TrunkManifest { path: String, msg: String },
    #[error("{0}")]
    Invalid(String),
}

impl StreamError {
    pub fn io(op: &'static str, path: &Path, source: std::io::Error) -> Self {
        StreamError::Io {
            op,
            path: path.display().to_string(),
            source,
        }
    }
}

/// Bytes in a decimal gigabyte (budgets are given in GB like the seeds' presets).
pub const GB: f64 = 1e9;

/// Convert a budget in (possibly fractional) GB to bytes; negative or non-finite is an error.
pub fn gb_to_bytes(gb: f64, what: &str) -> Result<u64, StreamError> {
    if !gb.is_finite() || gb < 0.0 {
        return Err(StreamError::Config(format!(
            "{what} must be a finite number of GB >= 0, got {gb}"
        )));
    }
    Ok((gb * GB).round() as u64)
}

/// Format a byte count for humans: GB with two decimals (the seeds' report style) down to
/// 1 GB, then MB / KB / bytes so tiny test models stay readable.
pub fn fmt_bytes(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= 1e9 {
        format!("{:.2} GB", b / 1e9)
    } else if b >= 1e6 {
        format!("{:.2} MB", b / 1e6)
    } else if b >= 1e3 {
        format!("{:.2} KB", b / 1e3)
    } else {
        format!("{bytes} B")
    }
}
