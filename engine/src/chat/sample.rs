//! Next-token choice for the chat REPL: greedy argmax, or seeded temperature + top-p sampling
//! on a hand-written PCG32.
//!
//! Owns: [`Pcg32`], [`Sampling`] (the mode and its parameters) and [`Sampler`] (one random
//! stream per assistant turn). Must not: touch model state or know about tokens' meaning (the
//! caller restricts the logits to the ids it allows).
//!
//! Reproducibility: the stream of turn `k` (the k-th assistant reply of the conversation,
//! counted from 0) is `Pcg32::new(seed, k)`, so replaying a transcript with the same seed, the
//! same flags and the same model reproduces every reply, and resuming a conversation from its
//! history file gives turn `k` the same stream as in the original session. Every step of
//! [`Sampler::sample`] is a fixed sequence of IEEE operations (the project's own
//! [`k3_kernels::math::exp`], sums in a fixed order, a stable sort with an index tie-break), so
//! the choice depends only on the logit bits, never on the platform's libm or thread count.
//!
//! Follows the PCG reference `pcg32_random_r` / `pcg32_srandom_r` (M. E. O'Neill,
//! pcg-random.org, `pcg_basic.c`): XSH RR output on a 64-bit LCG.

use k3_kernels::{math, ops};

/// PCG32 (XSH RR 64/32): 64-bit LCG state, odd increment selecting one of 2^63 streams.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pcg32 {
    state: u64,
    inc: u64,
}

impl Pcg32 {
    /// The LCG multiplier of the PCG reference (Knuth's MMIX multiplier).
    pub const MULTIPLIER: u64 = 6_364_136_223_846_793_005;

    /// `pcg32_srandom_r(initstate = seed, initseq = stream)`.
    pub fn new(seed: u64, stream: u64) -> Pcg32 {
        let mut rng = Pcg32 {
            state: 0,
            inc: (stream << 1) | 1,
        };
        rng.next_u32();
        rng.state = rng.state.wrapping_add(seed);
        rng.next_u32();
        rng
    }

    /// `pcg32_random_r`: advance the LCG, output xorshift-high then rotate by the top 5 bits.
    pub fn next_u32(&mut self) -> u32 {
        let old = self.state;
        self.state = old.wrapping_mul(Self::MULTIPLIER).wrapping_add(self.inc);
        let xorshifted = (((old >> 18) ^ old) >> 27) as u32;
        let rot = (old >> 59) as u32;
        xorshifted.rotate_right(rot)
    }

    /// A uniform f64 in [0, 1) with 32 random bits.
    pub fn next_f64(&mut self) -> f64 {
        self.next_u32() as f64 * (1.0 / 4_294_967_296.0)
    }
}

/// How the next token is chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Sampling {
    /// Argmax (ties to the lowest id).
    Greedy,
    /// Softmax(logits / temperature), restricted to the smallest set of most likely ids
    /// whose probability reaches `top_p`, drawn with the turn's PCG32 stream.
    Sample {
        temperature: f32,
        top_p: f32,
        seed: u64,
    },
}

/// Errors in sampling flags.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SamplingError {
    #[error("--temperature {0} must be a finite number >= 0 (0 means greedy)")]
    Temperature(f32),
    #[error("--top-p {0} must be in (0, 1]")]
    TopP(f32),
}

/// Default temperature when sampling is switched on.
pub const DEFAULT_TEMPERATURE: f32 = 1.0;
/// Default top-p when sampling is switched on.
pub const DEFAULT_TOP_P: f32 = 0.95;

impl Sampling {
    /// From the CLI flags: greedy unless one of `temperature`, `top_p`, `seed` is given;
    /// `greedy` forces argmax; temperature 0 is argmax. `fallback_seed` is used when sampling
    /// is on without `--seed` (the REPL prints it so the session can be replayed).
    pub fn from_flags(
        greedy: bool,
        temperature: Option<f32>,
        top_p: Option<f32>,
        seed: Option<u64>,
        fallback_seed: impl FnOnce() -> u64,
    ) -> Result<Sampling, SamplingError> {
        let t = temperature.unwrap_or(DEFAULT_TEMPERATURE);
        if !(t.is_finite() && t >= 0.0) {
            return Err(SamplingError::Temperature(t));
        }
        let p = top_p.unwrap_or(DEFAULT_TOP_P);
        if !(p > 0.0 && p <= 1.0) {
            return Err(SamplingError::TopP(p));
        }
        let on = temperature.is_some() || top_p.is_some() || seed.is_some();
        if greedy || !on || t == 0.0 {
            return Ok(Sampling::Greedy);
        }
        Ok(Sampling::Sample {
            temperature: t,
            top_p: p,
            seed: seed.unwrap_or_else(fallback_seed),
        })
    }
}

impl std::fmt::Display for Sampling {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Sampling::Greedy => f.write_str("greedy"),
            Sampling::Sample {
                temperature,
                top_p,
                seed,
            } => write!(
                f,
                "sampling: temperature {temperature}, top-p {top_p}, seed {seed}"
            ),
        }
    }
}

/// The sampler of one assistant turn.
#[derive(Debug, Clone)]
pub struct Sampler {
    mode: Sampling,
    rng: Option<Pcg32>,
    /// Scratch: (weight, id) candidates.
    cand: Vec<(f32, u32)>,
}

impl Sampler {
    /// The sampler for assistant turn `turn` (0-based within the conversation).
    pub fn for_turn(mode: Sampling, turn: u64) -> Sampler {
        let rng = match mode {
            Sampling::Greedy => None,
            Sampling::Sample { seed, .. } => Some(Pcg32::new(seed, turn)),
        };
        Sampler {
            mode,
            rng,
            cand: Vec::new(),
        }
    }

    /// Choose the next id from `logits` (every index is an allowed id). NaN logits never win;
    /// if no logit is finite the argmax rule decides.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let (temperature, top_p) = match self.mode {
            Sampling::Greedy => return ops::argmax(logits) as u32,
            Sampling::Sample {
                temperature, top_p, ..
            } => (temperature, top_p),
        };
        let rng = self
            .rng
            .as_mut()
            .expect("a sampling Sampler always has its stream");
        let max = logits
            .iter()
            .copied()
            .filter(|v| v.is_finite())
            .fold(f32::NEG_INFINITY, f32::max);
        if max == f32::NEG_INFINITY {
            return ops::argmax(logits) as u32;
        }
        self.cand.clear();
        for (i, &l) in logits.iter().enumerate() {
            // exp(-inf) = 0 and NaN fails the comparison: both drop out.
            let w = math::exp((l - max) / temperature);
            if w > 0.0 {
                self.cand.push((w, i as u32));
            }
        }
        if top_p < 1.0 {
            // Most likely first; equal weights by id, so the order is total and fixed.
            self.cand
                .sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            let total: f64 = self.cand.iter().map(|c| c.0 as f64).sum();
            let target = top_p as f64 * total;
            let mut cum = 0.0f64;
            let mut keep = self.cand.len();
            for (k, c) in self.cand.iter().enumerate() {
                cum += c.0 as f64;
                if cum >= target {
                    keep = k + 1;
                    break;
                }
            }
            self.cand.truncate(keep);
        }
        let total: f64 = self.cand.iter().map(|c| c.0 as f64).sum();
        let u = rng.next_f64() * total;
        let mut cum = 0.0f64;
        for c in &self.cand {
            cum += c.0 as f64;
            if u < cum {
                return c.1;
            }
        }
        // Rounding can leave u == total: the last candidate.
        self.cand.last().map_or(0, |c| c.1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The published output of the PCG reference demo (`pcg32-demo`, seed 42, sequence 54).
    #[test]
    fn pcg32_matches_the_reference_demo() {
        let mut r = Pcg32::new(42, 54);
        let got: Vec<u32> = (0..6).map(|_| r.next_u32()).collect();
        assert_eq!(
            got,
            [
                0xa15c_02b7,
                0x7b47_f409,
                0xba1d_3330,
                0x83d2_f293,
                0xbfa4_784b,
                0xcbed_606e
            ]
        );
    }

    #[test]
    fn streams_differ_and_repeat() {
        let a: Vec<u32> = {
            let mut r = Pcg32::new(7, 0);
            (0..8).map(|_| r.next_u32()).collect()
        };
        let b: Vec<u32> = {
            let mut r = Pcg32::new(7, 1);
            (0..8).map(|_| r.next_u32()).collect()
        };
        let a2: Vec<u32> = {
            let mut r = Pcg32::new(7, 0);
            (0..8).map(|_| r.next_u32()).collect()
        };
        assert_ne!(a, b);
        assert_eq!(a, a2);
    }

    #[test]
    fn flags_switch_sampling_on_and_greedy_wins() {
        let never = || panic!("fallback seed must not be drawn");
        assert_eq!(
            Sampling::from_flags(false, None, None, None, never),
            Ok(Sampling::Greedy)
        );
        assert_eq!(
            Sampling::from_flags(false, None, None, Some(3), never),
            Ok(Sampling::Sample {
                temperature: 1.0,
                top_p: 0.95,
                seed: 3
            })
        );
        assert_eq!(
            Sampling::from_flags(false, Some(0.7), None, None, || 99),
            Ok(Sampling::Sample {
                temperature: 0.7,
                top_p: 0.95,
                seed: 99
            })
        );
        assert_eq!(
            Sampling::from_flags(true, Some(0.7), Some(0.5), Some(1), never),
            Ok(Sampling::Greedy)
        );
        assert_eq!(
            Sampling::from_flags(false, Some(0.0), None, Some(1), never),
            Ok(Sampling::Greedy)
        );
        assert_eq!(
            Sampling::from_flags(false, Some(-1.0), None, None, never),
            Err(SamplingError::Temperature(-1.0))
        );
        assert_eq!(
            Sampling::from_flags(false, None, Some(0.0), None, never),
            Err(SamplingError::TopP(0.0))
        );
        assert!(Sampling::from_flags(false, None, Some(f32::NAN), None, never).is_err());
    }

    #[test]
    fn greedy_is_argmax_and_nan_never_wins() {
        let mut s = Sampler::for_turn(Sampling::Greedy, 0);
        assert_eq!(s.sample(&[0.5, f32::NAN, 2.0, 2.0, -1.0]), 2);
    }

    #[test]
    fn top_p_keeps_only_the_nucleus() {
        // Weights e^0 = 1 for id 3, e^-20 ~ 2e-9 for the rest: top-p 0.5 keeps only id 3.
        let logits = [
            -20.0f32,
            -20.0,
            -20.0,
            0.0,
            -20.0,
            f32::NAN,
            f32::NEG_INFINITY,
        ];
        let mode = Sampling::Sample {
            temperature: 1.0,
            top_p: 0.5,
            seed: 5,
        };
        for turn in 0..50 {
            assert_eq!(Sampler::for_turn(mode, turn).sample(&logits), 3);
        }
    }

    #[test]
    fn sampling_follows_the_distribution() {
        // Two ids with probabilities 0.25 / 0.75 (logits ln 1, ln 3): over 4000 draws the
        // frequency of id 1 must be near 0.75 (5 sigma is about 0.034).
        let logits = [0.0f32, 3.0f32.ln(), f32::NEG_INFINITY];
        let mode = Sampling::Sample {
            temperature: 1.0,
            top_p: 1.0,
            seed: 11,
        };
        let mut s = Sampler::for_turn(mode, 0);
        let n = 4000;
        let ones = (0..n).filter(|_| s.sample(&logits) == 1).count();
        let f = ones as f64 / n as f64;
        assert!((f - 0.75).abs() < 0.034, "frequency {f}");
        // The -inf id is never drawn; the same turn replays the same ids.
        let mut a = Sampler::for_turn(mode, 4);
        let mut b = Sampler::for_turn(mode, 4);
        let xa: Vec<u32> = (0..64).map(|_| a.sample(&logits)).collect();
        let xb: Vec<u32> = (0..64).map(|_| b.sample(&logits)).collect();
        assert_eq!(xa, xb);
        assert!(xa.iter().all(|&i| i < 2));
    }

    #[test]
    fn low_temperature_concentrates() {
        let logits = [1.0f32, 1.5, 0.9];
        let mode = Sampling::Sample {
            temperature: 0.01,
            top_p: 1.0,
            seed: 2,
        };
        let mut s = Sampler::for_turn(mode, 0);
        assert!((0..200).all(|_| s.sample(&logits) == 1));
    }
}
