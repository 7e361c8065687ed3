//! The layer split of a pipeline: which contiguous range of layers each host runs.
//!
//! Owns: choosing, from each layer's packed size and each host's memory budget, the cut that
//! makes the most loaded host as light as possible relative to its budget (the slowest stage
//! sets a pipeline's pace, and a host whose share fits its budget reads no trunk byte per
//! token). Must not: read weights or talk to other hosts.

use std::ops::Range;

use crate::stream::aligned::{IO_ALIGN, align_up};
use crate::stream::fmt_bytes;

/// Why no split exists.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SplitError {
    #[error("a pipeline needs at least one host")]
    NoHosts,
    #[error(
        "{hosts} hosts for {layers} layers: every host must run at least one layer; use at \
         most {layers} ranks"
    )]
    TooManyHosts { hosts: usize, layers: usize },
    #[error("host {host}'s budget is zero bytes")]
    ZeroBudget { host: usize },
}

/// A split of the layers over the hosts, with what each host holds.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Split {
    /// Host `h` runs layers `ranges[h]` (contiguous, in order, covering every layer).
    pub ranges: Vec<Range<usize>>,
    /// Trunk bytes of each host's layers (each layer rounded up to the 4096-byte I/O
    /// alignment, as the pinned buffers hold them).
    pub trunk_bytes: Vec<u64>,
    /// Each host's budget for its layers (its memory budget less what else it holds).
    pub budgets: Vec<u64>,
}

impl Split {
    /// Whether host `h`'s layers all fit its budget (then no trunk byte is read per token).
    pub fn fits(&self, h: usize) -> bool {
        self.trunk_bytes[h] <= self.budgets[h]
    }

    /// One line per host, as `k3-run plan --hosts` prints them.
    pub fn report_lines(&self) -> Vec<String> {
        let n = self.ranges.len();
        (0..n)
            .map(|h| {
                let r = &self.ranges[h];
                let role = match (h == 0, h + 1 == n) {
                    (true, true) => " + embedding, lm_head",
                    (true, false) => " + embedding, tokenizer, request",
                    (false, true) => " + lm_head",
                    (false, false) => "",
                };
                format!(
                    "rank {h}: layers {}..{} ({} layers{role}), trunk {} of a {} budget: {}",
                    r.start,
                    r.end,
                    r.len(),
                    fmt_bytes(self.trunk_bytes[h]),
                    fmt_bytes(self.budgets[h]),
                    if self.fits(h) {
                        "all pinned, no trunk reads per token"
                    } else {
                        "does not fit: the layers past the pinned prefix are served from the \
                         checkpoint's memory maps"
                    }
                )
            })
            .collect()
    }
}

/// Split `layer_bytes.len()` layers over `budgets.len()` hosts, contiguous and in order, every
/// host at least one layer, minimising the largest `trunk_bytes[h] / budgets[h]` (exactly, by
/// dynamic programming over the cut points; ties go to the earliest cut). `budgets[h]` is the
/// bytes host `h` can give its layers.
pub fn split_layers(layer_bytes: &[u64], budgets: &[u64]) -> Result<Split, SplitError> {
    let (n, hosts) = (layer_bytes.len(), budgets.len());
    if hosts == 0 {
        return Err(SplitError::NoHosts);
    }
    if hosts > n {
        return Err(SplitError::TooManyHosts { hosts, layers: n });
    }
    if let Some(host) = budgets.iter().position(|&b| b == 0) {
        return Err(SplitError::ZeroBudget { host });
    }
    let a = IO_ALIGN as u64;
    let mut prefix = vec![0u64; n + 1];
    for i in 0..n {
        prefix[i + 1] = prefix[i].saturating_add(align_up(layer_bytes[i], a));
    }
    // A load ratio bytes / budget, compared exactly.
    #[derive(Clone, Copy)]
    struct Ratio(u64, u64);
    let less = |x: Ratio, y: Ratio| (x.0 as u128) * (y.1 as u128) < (y.0 as u128) * (x.1 as u128);
    let max = |x: Ratio, y: Ratio| if less(x, y) { y } else { x };
    // best[h][i]: the least worst ratio placing layers 0..i on hosts 0..=h; cut[h][i] the
    // start of host h's range in it.
    let none = Ratio(u64::MAX, 1);
    let mut best = vec![vec![none; n + 1]; hosts];
    let mut cut = vec![vec![0usize; n + 1]; hosts];
    for i in 1..=n {
        best[0][i] = Ratio(prefix[i], budgets[0]);
    }
    for h in 1..hosts {
        for i in (h + 1)..=n {
            for j in h..i {
                let c = max(best[h - 1][j], Ratio(prefix[i] - prefix[j], budgets[h]));
                if less(c, best[h][i]) {
                    best[h][i] = c;
                    cut[h][i] = j;
                }
            }
        }
    }
    let mut ranges = vec![0..0; hosts];
    let mut end = n;
    for h in (0..hosts).rev() {
        let start = if h == 0 { 0 } else { cut[h][end] };
        ranges[h] = start..end;
        end = start;
    }
    let trunk_bytes = ranges
        .iter()
        .map(|r| prefix[r.end] - prefix[r.start])
        .collect();
    Ok(Split {
        ranges,
        trunk_bytes,
        budgets: budgets.to_vec(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every contiguous split with non-empty ranges, by brute force.
    fn all_splits(n: usize, hosts: usize) -> Vec<Vec<usize>> {
        if hosts == 1 {
            return vec![vec![n]];
        }
        let mut out = Vec::new();
        for first in 1..=n - (hosts - 1) {
            for mut rest in all_splits(n - first, hosts - 1) {
                let mut v = vec![first];
                v.append(&mut rest);
                out.push(v);
            }
        }
        out
    }

    #[test]
    fn the_split_is_the_best_contiguous_one() {
        let sizes: Vec<u64> = [9, 3, 7, 7, 1, 12, 5, 5, 2]
            .iter()
            .map(|k| k * 4096)
            .collect();
        for budgets in [
            vec![1u64, 1],
            vec![1, 1, 1],
            vec![3, 1, 2],
            vec![5, 5, 1, 1],
        ] {
            let budgets: Vec<u64> = budgets.iter().map(|b| b * 100_000).collect();
            let s = split_layers(&sizes, &budgets).unwrap();
            let worst = |lens: &[usize]| -> f64 {
                let mut at = 0;
                lens.iter()
                    .zip(&budgets)
                    .map(|(&k, &b)| {
                        let bytes: u64 = sizes[at..at + k].iter().sum();
                        at += k;
                        bytes as f64 / b as f64
                    })
                    .fold(0.0, f64::max)
            };
            let lens: Vec<usize> = s.ranges.iter().map(|r| r.len()).collect();
            let brute = all_splits(sizes.len(), budgets.len())
                .iter()
                .map(|l| worst(l))
                .fold(f64::INFINITY, f64::min);
            assert_eq!(worst(&lens), brute, "budgets {budgets:?}: split {lens:?}");
            assert_eq!(s.ranges[0].start, 0);
            assert_eq!(s.ranges.last().unwrap().end, sizes.len());
            assert!(s.ranges.windows(2).all(|w| w[0].end == w[1].start));
            assert!(s.ranges.iter().all(|r| !r.is_empty()));
        }
    }

    #[test]
    fn a_bigger_budget_takes_more_layers_and_fits_are_reported() {
        let sizes = vec![4096u64; 12];
        let s = split_layers(&sizes, &[3 * 4096, 9 * 4096]).unwrap();
        assert_eq!(s.ranges, vec![0..3, 3..12]);
        assert!(s.fits(0) && s.fits(1));
        let s = split_layers(&sizes, &[2 * 4096, 2 * 4096]).unwrap();
        assert_eq!(s.ranges, vec![0..6, 6..12]);
        assert!(!s.fits(0) && !s.fits(1));
        assert!(s.report_lines()[1].contains("does not fit"));
    }

    #[test]
    fn impossible_splits_are_refused() {
        assert_eq!(split_layers(&[1, 2], &[]), Err(SplitError::NoHosts));
        assert_eq!(
            split_layers(&[1, 2], &[1, 1, 1]),
            Err(SplitError::TooManyHosts {
                hosts: 3,
                layers: 2
            })
        );
        assert_eq!(
            split_layers(&[1, 2], &[1, 0]),
            Err(SplitError::ZeroBudget { host: 1 })
        );
    }
}
