//! Instruction-set selection: which code path (scalar reference or a SIMD fast path) runs.
//!
//! Owns: run-time feature detection, the process-wide active path, the `K3_ISA` override.
//! Must not: pick a path at compile time (`target-cpu=native` is forbidden); every path gives
//! the same bits, so the choice only changes speed.
//!
//! `K3_ISA=scalar|avx2|avx512|neon` forces a path (read once, at the first [`active`] call).
//! A forced path this CPU cannot run is ignored by [`active`] (it falls back to the best
//! available path); binaries call [`env_override`] at start-up to turn that case into an error.

use std::sync::atomic::{AtomicU8, Ordering};

use crate::KernelError;

/// One code path of every kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    /// Portable scalar reference (defines the canonical order).
    Scalar,
    /// x86-64 with AVX2 and FMA.
    Avx2,
    /// x86-64 with AVX-512F and AVX-512VL (plus AVX2 and FMA).
    Avx512,
    /// aarch64 Advanced SIMD.
    Neon,
}

impl Isa {
    /// Every path, in order of preference from lowest to highest.
    pub const ALL: [Isa; 4] = [Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Neon];

    /// Lower-case name as accepted by [`parse_isa`].
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Neon => "neon",
        }
    }

    fn code(self) -> u8 {
        match self {
            Isa::Scalar => 0,
            Isa::Avx2 => 1,
            Isa::Avx512 => 2,
            Isa::Neon => 3,
        }
    }

    fn from_code(code: u8) -> Option<Isa> {
        Isa::ALL.into_iter().find(|isa| isa.code() == code)
    }
}

/// Parses `scalar`, `avx2`, `avx512` or `neon` (case-insensitive, surrounding space ignored).
pub fn parse_isa(s: &str) -> Option<Isa> {
    let s = s.trim().to_ascii_lowercase();
    Isa::ALL.into_iter().find(|isa| isa.name() == s)
}

/// Whether this CPU can run `isa` (run-time detection; cheap after the first call).
pub fn is_available(isa: Isa) -> bool {
    match isa {
        Isa::Scalar => true,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => {
            is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
        }
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => std::arch::is_aarch64_feature_detected!("neon"),
        #[allow(unreachable_patterns)]
        _ => false,
    }
}

/// All paths this CPU can run, `Scalar` first, the best last.
pub fn available() -> Vec<Isa> {
    Isa::ALL
        .into_iter()
        .filter(|&isa| is_available(isa))
        .collect()
}

/// The fastest available path.
pub fn best() -> Isa {
    available().pop().unwrap_or(Isa::Scalar)
}

/// The `K3_ISA` environment override: `Ok(None)` when unset or empty, `Err` when it names an
/// unknown or unavailable path.
pub fn env_override() -> Result<Option<Isa>, KernelError> {
    let raw = match std::env::var("K3_ISA") {
        Ok(raw) if !raw.trim().is_empty() => raw,
        _ => return Ok(None),
    };
    let isa = parse_isa(&raw).ok_or_else(|| KernelError::UnknownIsa(raw.clone()))?;
    check(isa)?;
    Ok(Some(isa))
}

const UNSET: u8 = u8::MAX;
static ACTIVE: AtomicU8 = AtomicU8::new(UNSET);

/// The path the dispatching kernels use: the `set_active` override, else `K3_ISA` when it names
/// an available path, else [`best`].
pub fn active() -> Isa {
    if let Some(isa) = Isa::from_code(ACTIVE.load(Ordering::Relaxed)) {
        return isa;
    }
    let isa = env_override().ok().flatten().unwrap_or_else(best);
    ACTIVE.store(isa.code(), Ordering::Relaxed);
    isa
}

/// Process-wide override of the active path (tests, `--isa` flags). Errors if unavailable.
pub fn set_active(isa: Isa) -> Result<(), KernelError> {
    check(isa)?;
    ACTIVE.store(isa.code(), Ordering::Relaxed);
    Ok(())
}

fn check(isa: Isa) -> Result<(), KernelError> {
    if is_available(isa) {
        return Ok(());
    }
    let names: Vec<&str> = available().into_iter().map(Isa::name).collect();
    Err(KernelError::IsaUnavailable(isa, names.join(", ")))
}

/// `isa` if this CPU can run it, otherwise `Scalar`. Every `_with(isa, ..)` kernel goes
/// through this, so forcing an unavailable path can never execute an illegal instruction.
#[inline]
pub(crate) fn resolve(isa: Isa) -> Isa {
    if is_available(isa) { isa } else { Isa::Scalar }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_round_trips_every_name() {
        for isa in Isa::ALL {
            assert_eq!(parse_isa(isa.name()), Some(isa));
            assert_eq!(
                parse_isa(&format!(" {} ", isa.name().to_uppercase())),
                Some(isa)
            );
        }
        assert_eq!(parse_isa("sse2"), None);
    }

    #[test]
    fn scalar_always_available_and_resolve_falls_back() {
        let av = available();
        assert_eq!(av[0], Isa::Scalar);
        for isa in Isa::ALL {
            assert_eq!(resolve(isa) == isa, av.contains(&isa));
        }
        #[cfg(target_arch = "x86_64")]
        assert!(!av.contains(&Isa::Neon));
        #[cfg(target_arch = "aarch64")]
        assert!(av.contains(&Isa::Neon));
    }

    #[test]
    fn set_active_rejects_unavailable() {
        for isa in Isa::ALL {
            if !is_available(isa) {
                assert!(matches!(
                    set_active(isa),
                    Err(KernelError::IsaUnavailable(..))
                ));
            }
        }
    }
}
