//! MXFP4 quantisation of synthetic routed-expert weights (compressed-tensors layout).
//!
//! Owns: turning one f32 weight row into `weight_packed` bytes (two E2M1 codes per byte, low
//! nibble = even element) and `weight_scale` bytes (one E8M0 per 32 elements), and the exact
//! inverse used by tests. Must not: be used to decode real checkpoints (the kernels own that).
//!
//! Follows `docs/MODEL.md` §4.8/§5 and the oracle's `synth_k3.py`:
//! per 32-element block, shared exponent `e = floor(log2(amax)) - 2` clipped to [-127, 127],
//! scale byte `127 + e` (never 0xFF), elements `x / 2^e` rounded to the nearest E2M1 magnitude
//! {0, .5, 1, 1.5, 2, 3, 4, 6} with ties to the even code and clamped to 6; negative sign only
//! on a non-zero code. An all-zero block gets scale byte 0 and zero codes. `floor(log2)` is
//! read from the float's bits, so no libm is involved.

/// Elements per E8M0 scale.
pub const GROUP: usize = 32;

/// E2M1 magnitudes of codes 0..7 (code | 8 is the negative).
pub const E2M1: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// floor(log2(a)) for a positive finite f32, from its bits.
fn floor_log2(a: f32) -> i32 {
    let bits = a.to_bits();
    let exp = ((bits >> 23) & 0xFF) as i32;
    if exp != 0 {
        exp - 127
    } else {
        let mant = bits & 0x7F_FFFF;
        (31 - mant.leading_zeros() as i32) - 149
    }
}

/// 2^k as f64, exact for |k| <= 1022.
fn pow2_f64(k: i32) -> f64 {
    f64::from_bits(((1023 + i64::from(k)) as u64) << 52)
}

/// Nearest E2M1 code of a magnitude, ties to the even code, clamped to 6.
fn e2m1_code(m: f64) -> u8 {
    if m <= 0.25 {
        0
    } else if m < 0.75 {
        1
    } else if m <= 1.25 {
        2
    } else if m < 1.75 {
        3
    } else if m <= 2.5 {
        4
    } else if m < 3.5 {
        5
    } else if m <= 5.0 {
        6
    } else {
        7
    }
}

/// Quantise one row. `row.len()` must be a multiple of 32 and the values finite;
/// `packed.len() == row.len() / 2`, `scales.len() == row.len() / 32`.
///
/// Fast form of [`quantize_row_reference`] (bit-identical, tested): the block is scaled in f32
/// (`x * 2^-e` is exact whenever the result is a normal float, and a subnormal result is far
/// below the first rounding threshold 0.25), and the code is a branch-free count of the
/// thresholds passed (`>` at a tie that goes down to the even code, `>=` at one that goes up).
pub fn quantize_row(row: &[f32], packed: &mut [u8], scales: &mut [u8]) {
    debug_assert_eq!(row.len() % GROUP, 0);
    debug_assert_eq!(packed.len() * 2, row.len());
    debug_assert_eq!(scales.len() * GROUP, row.len());
    for ((block, pk), sc) in row
        .chunks_exact(GROUP)
        .zip(packed.chunks_exact_mut(GROUP / 2))
        .zip(scales.iter_mut())
    {
        let amax = block.iter().fold(0f32, |m, &x| m.max(x.abs()));
        let e = if amax > 0.0 {
            (floor_log2(amax) - 2).clamp(-127, 127)
        } else {
            -127
        };
        *sc = (127 + e) as u8;
        let inv = pow2_f64(-e) as f32;
        let mut codes = [0u8; GROUP];
        for (c, &x) in codes.iter_mut().zip(block) {
            let v = x * inv;
            let m = v.abs();
            let code = u8::from(m > 0.25)
                + u8::from(m >= 0.75)
                + u8::from(m > 1.25)
                + u8::from(m >= 1.75)
                + u8::from(m > 2.5)
                + u8::from(m >= 3.5)
                + u8::from(m > 5.0);
            *c = code | (u8::from(v < 0.0 && code != 0) << 3);
        }
        for (p, pair) in pk.iter_mut().zip(codes.chunks_exact(2)) {
            *p = pair[0] | (pair[1] << 4);
        }
    }
}

/// The plain statement of the rule, in f64 with an if-chain; [`quantize_row`] must match it.
pub fn quantize_row_reference(row: &[f32], packed: &mut [u8], scales: &mut [u8]) {
    for (b, block) in row.chunks_exact(GROUP).enumerate() {
        let amax = block.iter().fold(0f32, |m, &x| m.max(x.abs()));
        let e = if amax > 0.0 {
            (floor_log2(amax) - 2).clamp(-127, 127)
        } else {
            -127
        };
        scales[b] = (127 + e) as u8;
        let inv = pow2_f64(-e);
        for (j, pair) in block.chunks_exact(2).enumerate() {
            let mut codes = [0u8; 2];
            for (c, &x) in codes.iter_mut().zip(pair) {
                let v = f64::from(x) * inv;
                let code = e2m1_code(v.abs());
                *c = if v < 0.0 && code != 0 { code | 8 } else { code };
            }
            packed[b * GROUP / 2 + j] = codes[0] | (codes[1] << 4);
        }
    }
}

/// Exact inverse: the f32 values the packed row stands for.
pub fn dequantize_row(packed: &[u8], scales: &[u8], out: &mut [f32]) {
    for (i, o) in out.iter_mut().enumerate() {
        let byte = packed[i / 2];
        let code = if i % 2 == 0 { byte & 0x0F } else { byte >> 4 };
        let mag = E2M1[usize::from(code & 7)];
        let v = if code & 8 != 0 { -mag } else { mag };
        let e = i32::from(scales[i / GROUP]) - 127;
        *o = (f64::from(v) * pow2_f64(e)) as f32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn low_nibble_is_even_element() {
        // amax 6 -> e = floor(log2 6) - 2 = 0, scale byte 127; codes: 0.5 -> 1, -6 -> 15.
        let mut row = [0f32; 32];
        row[0] = 0.5;
        row[1] = -6.0;
        let mut packed = [0u8; 16];
        let mut scales = [0u8; 1];
        quantize_row(&row, &mut packed, &mut scales);
        assert_eq!(scales[0], 127);
        assert_eq!(packed[0], 0x01 | (0x0F << 4));
        assert!(packed[1..].iter().all(|&b| b == 0));
    }

    #[test]
    fn ties_go_to_even_code_and_roundtrip_is_close() {
        // amax 4 -> e = 0; 0.25 -> 0, 0.75 -> code 2 (1.0), 2.5 -> code 4 (2.0), 5.0 not present.
        let mut row = [0f32; 32];
        row[0] = 0.25;
        row[1] = 0.75;
        row[2] = 2.5;
        row[3] = 4.0;
        row[4] = -3.5;
        let mut packed = [0u8; 16];
        let mut scales = [0u8; 1];
        quantize_row(&row, &mut packed, &mut scales);
        let mut back = [0f32; 32];
        dequantize_row(&packed, &scales, &mut back);
        assert_eq!(&back[..5], &[0.0, 1.0, 2.0, 4.0, -4.0]);
    }

    #[test]
    fn scale_tracks_block_magnitude_and_never_ff() {
        let mut row = vec![0f32; 64];
        for (i, x) in row.iter_mut().enumerate() {
            *x = (i as f32 - 20.0) * 1e-3;
        }
        row[40] = 1e30;
        let mut packed = vec![0u8; 32];
        let mut scales = vec![0u8; 2];
        quantize_row(&row, &mut packed, &mut scales);
        // block 0 amax = 0.02 -> floor(log2) = -6 -> e = -8 -> byte 119
        assert_eq!(scales[0], 119);
        // block 1 amax 1e30 -> floor(log2) = 99 -> e = 97 -> byte 224
        assert_eq!(scales[1], 224);
        let mut back = vec![0f32; 64];
        dequantize_row(&packed, &scales, &mut back);
        for i in 0..32 {
            // codes are at most 2 apart below 8 (6 -> clamp), so the error is at most 2^e
            assert!((back[i] - row[i]).abs() <= 2f32.powi(-8), "i={i}");
        }
        assert_eq!(back[40], 6.0 * 2f32.powi(97));
    }

    #[test]
    fn fast_form_matches_the_reference_bit_for_bit() {
        let mut rng = super::super::rng::Rng::new(5);
        let mut row = vec![0f32; 32 * 64];
        for round in 0..200 {
            // Mix of magnitudes (down to subnormal and up to 1e30), exact ties and zeros.
            for (i, x) in row.iter_mut().enumerate() {
                let mag = [1e-42f32, 1e-30, 1e-3, 0.02, 1.0, 7.0, 3e4, 1e30][(i / 32 + round) % 8];
                *x = rng.normal() * mag;
                if i % 7 == 0 {
                    *x = [0.25f32, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.0][i % 8]
                        * 2f32.powi(round as i32 % 9 - 4);
                }
            }
            let (mut p1, mut s1) = (vec![0u8; row.len() / 2], vec![0u8; row.len() / 32]);
            let (mut p2, mut s2) = (p1.clone(), s1.clone());
            quantize_row(&row, &mut p1, &mut s1);
            quantize_row_reference(&row, &mut p2, &mut s2);
            assert_eq!(s1, s2, "round {round}");
            assert_eq!(p1, p2, "round {round}");
        }
    }

    #[test]
    fn subnormal_and_zero_blocks() {
        let mut row = vec![0f32; 64];
        row[33] = f32::from_bits(1); // smallest subnormal, floor(log2) = -149
        let mut packed = vec![0u8; 32];
        let mut scales = vec![0u8; 2];
        quantize_row(&row, &mut packed, &mut scales);
        assert_eq!(scales[0], 0);
        assert_eq!(scales[1], 0); // e clipped to -127
        assert!(packed.iter().all(|&b| b == 0));
    }
}
