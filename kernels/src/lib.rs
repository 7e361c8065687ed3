//! k3-kernels: the pure numerics of Kimi K3.
//!
//! Owns: every numeric kernel the forward pass calls (matvec on bf16 / MXFP4 / f32 weights,
//! norms, activations, the KDA recurrence, MLA attention for one query, the MoE router, the
//! AttnRes mix) and the project's own deterministic `exp`/`tanh`/`ln`/... in [`math`].
//!
//! Must not: do I/O (the one exception is reading the `K3_ISA` override once, see [`isa`]),
//! know about model files or tensor names, allocate in hot paths, or call platform libm
//! transcendental functions.
//!
//! Follows: `docs/NUMERICS.md`. Every reduction has one canonical order, written in the
//! kernel's doc comment; the scalar code is the reference and every SIMD path (AVX2+FMA,
//! AVX-512F, NEON) reproduces it bit for bit. Multiply-accumulate is always a fused
//! multiply-add (FMA, correctly rounded: `f32::mul_add` in scalar code); the polynomial
//! evaluations inside [`math`] use separate multiply and add. Threads split output rows (or
//! heads), never a reduction, so results are identical for every thread count.
//!
//! NaN payloads are not part of the bit-exact contract: x86-64 and aarch64 produce different
//! default NaN bits, so tests compare NaN as "any NaN".

#[macro_use]
mod multiversion;

pub mod attn;
pub mod attnres;
pub mod isa;
pub mod kda;
pub mod math;
pub mod matvec;
pub mod membw;
pub mod ops;
pub mod par;
pub mod reduce;
pub mod router;

mod simd;

pub use isa::Isa;
pub use par::Pool;

/// Errors of the kernel crate (only configuration can fail; kernels assert shapes).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KernelError {
    /// An instruction-set path was requested that this CPU does not support.
    #[error("instruction set {0:?} is not available on this CPU (available: {1})")]
    IsaUnavailable(Isa, String),
    /// `K3_ISA` (or another ISA string) names no known instruction set.
    #[error("unknown instruction set {0:?} (expected scalar, avx2, avx512 or neon)")]
    UnknownIsa(String),
    /// The worker thread pool could not be built.
    #[error("could not build a thread pool with {n_threads} threads: {reason}")]
    ThreadPool {
        /// Requested number of threads.
        n_threads: usize,
        /// The error reported by the OS.
        reason: String,
    },
}
