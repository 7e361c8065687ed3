//! The `multiversion!` macro: one kernel body compiled once per instruction set.
//!
//! Owns: stamping out `#[target_feature]` copies of a plain Rust body (AVX2+FMA, AVX-512F on
//! x86-64; aarch64 always has NEON so its copy is the body itself) plus the `match` on [`Isa`]
//! that picks one. Because Rust never contracts or reorders float operations, every copy
//! performs exactly the same IEEE operations as the scalar reference; the compiler is only
//! free to execute independent lanes together. Tests still check every copy bit for bit.
//!
//! Must not: be used for kernels that need a different instruction sequence per ISA (those are
//! hand-written in `simd`).
//!
//! [`Isa`]: crate::isa::Isa

/// `multiversion! { pub fn name(a: A, b: B) -> R { body } }` defines
/// `pub fn name(isa: Isa, a: A, b: B) -> R` that runs `body` compiled for `isa`.
macro_rules! multiversion {
    (
        $(#[$meta:meta])*
        $vis:vis fn $name:ident($($arg:ident : $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block
    ) => {
        $(#[$meta])*
        $vis fn $name(isa: $crate::isa::Isa, $($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn imp($($arg: $ty),*) $(-> $ret)? $body

            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma")]
            fn imp_avx2($($arg: $ty),*) $(-> $ret)? {
                imp($($arg),*)
            }

            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
            fn imp_avx512($($arg: $ty),*) $(-> $ret)? {
                imp($($arg),*)
            }

            match $crate::isa::resolve(isa) {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: resolve() returns Avx2 only when avx2 and fma were detected at run time.
                $crate::isa::Isa::Avx2 => unsafe { imp_avx2($($arg),*) },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: resolve() returns Avx512 only when avx512f/vl, avx2, fma were detected.
                $crate::isa::Isa::Avx512 => unsafe { imp_avx512($($arg),*) },
                _ => imp($($arg),*),
            }
        }
    };
}
