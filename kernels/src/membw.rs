//! The memory read-bandwidth probe's load loop, shared by the kernel benchmark
//! (`kernels/benches/matvec.rs`) and `k3-run doctor`, so both measure DRAM the same way.
//!
//! Owns: [`xor_reduce`], a streaming read of a `u64` slice. Must not: allocate, time or
//! spawn (callers do). Not part of any model computation.

/// XOR of every element: 8 independent accumulators of 4 u64 lanes, wide enough that the loads,
/// not the ALU, limit. Uses AVX2 when the CPU has it (detected at run time).
pub fn xor_reduce(v: &[u64]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 was detected at run time.
        return unsafe { xor_reduce_avx2(v) };
    }
    xor_reduce_plain(v)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn xor_reduce_avx2(v: &[u64]) -> u64 {
    xor_reduce_plain(v)
}

#[inline(always)]
fn xor_reduce_plain(v: &[u64]) -> u64 {
    let mut acc = [0u64; 32];
    let mut it = v.chunks_exact(32);
    for c in &mut it {
        for j in 0..32 {
            acc[j] ^= c[j];
        }
    }
    it.remainder()
        .iter()
        .fold(acc.iter().fold(0, |a, b| a ^ b), |a, b| a ^ b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xor_of_every_element_for_any_length() {
        for n in [0usize, 1, 31, 32, 33, 1000] {
            let v: Vec<u64> = (0..n as u64)
                .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
                .collect();
            let want = v.iter().fold(0, |a, b| a ^ b);
            assert_eq!(xor_reduce(&v), want, "n = {n}");
        }
    }
}
