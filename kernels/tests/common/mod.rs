//! Helpers shared by the kernel integration tests (deterministic generator, bit comparison).
#![allow(dead_code)]

use std::sync::OnceLock;

use k3_kernels::Pool;

/// xorshift64* generator: deterministic on every platform, no external crate.
pub struct Rng(pub u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn next_u32(&mut self) -> u32 {
        (self.next_u64() >> 32) as u32
    }
    /// Uniform in [-1, 1) with 24 random bits (exact construction, no libm).
    pub fn unit(&mut self) -> f32 {
        ((self.next_u32() >> 8) as f32) * (1.0 / 8_388_608.0) - 1.0
    }
    /// Uniform in [-scale, scale).
    pub fn f32s(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.unit() * scale).collect()
    }
    /// bf16 bits of values uniform in [-scale, scale) (truncated, exact).
    pub fn bf16s(&mut self, n: usize, scale: f32) -> Vec<u16> {
        (0..n)
            .map(|_| ((self.unit() * scale).to_bits() >> 16) as u16)
            .collect()
    }
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next_u32() as u8).collect()
    }
    /// E8M0 scale bytes: mostly 110..=130, sometimes the extremes 0 and 1.
    pub fn scales(&mut self, n: usize) -> Vec<u8> {
        (0..n)
            .map(|_| match self.next_u32() % 16 {
                0 => 0,
                1 => 1,
                _ => 110 + (self.next_u32() % 21) as u8,
            })
            .collect()
    }
}

/// Equal bits, except that any NaN equals any NaN (NaN payloads differ between CPUs).
pub fn same_bits(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

pub fn assert_same(what: &str, a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "{what}: lengths differ");
    for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
        assert!(
            same_bits(x, y),
            "{what}: element {i} differs: {x:e} ({:#010x}) vs {y:e} ({:#010x})",
            x.to_bits(),
            y.to_bits()
        );
    }
}

/// Pools of 1, 2, 3 and 8 threads, built once per test binary.
pub fn pools() -> &'static [Pool] {
    static POOLS: OnceLock<Vec<Pool>> = OnceLock::new();
    POOLS.get_or_init(|| [1, 2, 3, 8].into_iter().map(Pool::new).collect())
}

impl Rng {
    /// Replaces about 1 in `one_in` elements with a special value (signed zero, infinity,
    /// NaN, subnormal, huge) so the paths are compared on edge cases too.
    pub fn spice(&mut self, v: &mut [f32], one_in: u32) {
        const SPECIAL: [f32; 10] = [
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            1e-40,
            -1e-40,
            3e38,
            -3e38,
            1e-30,
        ];
        for x in v.iter_mut() {
            if self.next_u32().is_multiple_of(one_in) {
                *x = SPECIAL[(self.next_u32() % SPECIAL.len() as u32) as usize];
            }
        }
    }
}

/// The several-input kernels' argument forms: each input as a slice ...
#[allow(dead_code)] // not every test binary that includes `common` uses it
pub fn views(v: &[Vec<f32>]) -> Vec<&[f32]> {
    v.iter().map(|x| x.as_slice()).collect()
}

/// ... and each output as a mutable slice.
#[allow(dead_code)]
pub fn views_mut(v: &mut [Vec<f32>]) -> Vec<&mut [f32]> {
    v.iter_mut().map(|x| x.as_mut_slice()).collect()
}
