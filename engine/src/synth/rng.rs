//! Deterministic, portable random numbers for synthetic checkpoints.
//!
//! Owns: a xoshiro256** generator seeded through splitmix64, one independent stream per tensor
//! (seeded from the run seed and the tensor's key, so a tensor's bytes do not depend on shard
//! layout, write order or threads), uniform floats and an approximately normal variate.
//! Must not: call any platform math library. Every operation here is integer arithmetic or a
//! single IEEE-754 f32/f64 operation (add, multiply, convert), so the bytes of a synthetic
//! checkpoint are identical on every platform and toolchain.
//!
//! The "normal" variate is Irwin-Hall with four terms: the sum of four 16-bit uniforms taken
//! from one 64-bit draw, centred and scaled to unit variance. It has mean 0, variance 1,
//! excess kurtosis -0.3 and support |z| <= sqrt(12) ~ 3.46. Random weights need nothing more,
//! and it avoids `ln`/`cos` (Box-Muller), whose last bits differ between libms.

/// splitmix64 step (Vigna), used for seeding and hashing.
pub fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// FNV-1a 64 of a key (tensor name).
pub fn fnv1a64(key: &str) -> u64 {
    let mut h: u64 = 0xCBF2_9CE4_8422_2325;
    for b in key.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01B3);
    }
    h
}

/// xoshiro256** (Blackman & Vigna).
#[derive(Clone, Debug)]
pub struct Rng {
    s: [u64; 4],
}

/// sqrt(3) / 65536: scales a centred sum of four u16 to unit variance
/// (variance of one u16 uniform is (65536^2 - 1) / 12; the -1 is negligible).
const IRWIN_HALL4_SCALE: f32 = 1.732_050_8 / 65536.0;

impl Rng {
    /// A generator from a 64-bit seed.
    pub fn new(seed: u64) -> Rng {
        let mut sm = seed;
        let s = [
            splitmix64(&mut sm),
            splitmix64(&mut sm),
            splitmix64(&mut sm),
            splitmix64(&mut sm),
        ];
        Rng { s }
    }

    /// The stream of one tensor: independent of every other key for the same run seed.
    pub fn for_key(run_seed: u64, key: &str) -> Rng {
        let mut sm = run_seed ^ fnv1a64(key).rotate_left(17);
        let mixed = splitmix64(&mut sm);
        Rng::new(mixed)
    }

    pub fn next_u64(&mut self) -> u64 {
        let result = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1) with 24 random bits (exact in f32).
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / 16_777_216.0)
    }

    /// Approximately standard normal (Irwin-Hall, 4 terms; see module doc).
    pub fn normal(&mut self) -> f32 {
        let r = self.next_u64();
        let sum = (r & 0xFFFF) + ((r >> 16) & 0xFFFF) + ((r >> 32) & 0xFFFF) + (r >> 48);
        // sum is at most 4 * 65535 < 2^24, so both conversions are exact.
        (sum as f32 - 131_070.0) * IRWIN_HALL4_SCALE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normal_has_unit_moments() {
        let mut r = Rng::new(7);
        let n = 200_000;
        let (mut s1, mut s2) = (0f64, 0f64);
        for _ in 0..n {
            let z = f64::from(r.normal());
            s1 += z;
            s2 += z * z;
        }
        let mean = s1 / n as f64;
        let var = s2 / n as f64 - mean * mean;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var - 1.0).abs() < 0.02, "var {var}");
    }

    #[test]
    fn streams_depend_on_key_and_seed() {
        let a = Rng::for_key(1, "x").next_u64();
        assert_ne!(a, Rng::for_key(1, "y").next_u64());
        assert_ne!(a, Rng::for_key(2, "x").next_u64());
        assert_eq!(a, Rng::for_key(1, "x").next_u64());
    }

    #[test]
    fn uniform_in_unit_interval() {
        let mut r = Rng::new(3);
        for _ in 0..10_000 {
            let u = r.uniform();
            assert!((0.0..1.0).contains(&u));
        }
    }
}
