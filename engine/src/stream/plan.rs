//! The trunk memory plan (pinned prefix + ring slots) and the up-front KV/state memory check.
//!
//! Owns: turning per-layer packed trunk sizes, a byte budget and a requested ring-slot count
//! into how many leading layers are pinned, how many ring slots there are and how big each
//! slot is; refusing a budget that cannot hold even one slot, with the numbers; refusing a
//! request whose KV cache + recurrent state cannot fit, before the run starts; the memory
//! limit that check uses (`MemAvailable` and the memory cgroup headroom, cgroup v2 then v1,
//! with the proc/sys root injectable for tests).
//! Must not: allocate, read anything but /proc and the cgroup files (the trunk reads the
//! weights), or know what a layer contains.
//! Follows upstream: docs/DESIGN.md §3 and the Chinese seed article §3.2-§3.4: pinned layers at
//! their exact size, ring slots all of the largest unpinned layer, a second slot only when it
//! fits (the one-slot fallback), and §5 (KV memory computed before the run).
//!
//! On the fixed point. Pinning more layers makes the largest *unpinned* layer smaller, which
//! frees budget to pin more; the seed iterates "pin what fits next to the slots, resize the
//! slots, repeat" a bounded number of passes, starting from slots of the largest layer. That
//! iteration is monotone and stops at the least fixed point above its start, so it never
//! pins the largest layer unless the budget already covers `ring x largest` — but on K3 the
//! largest layer is layer 0, the first one a prefix pins. Here the same fixed point is
//! solved exactly: the slot size is a function of the prefix length `n`
//! (`slot(n) = max(size[n..])`), so the plan is the largest `n` with
//! `sum(size[..n]) + ring * slot(n) <= budget`, found by one scan over the `L + 1` candidates.
//! It always pins at least as many layers as the bounded iteration (a property test checks
//! this against the seed's loop) and is monotone in the budget.

use super::aligned::{IO_ALIGN, align_down, align_up};
use super::fmt_bytes;

/// Errors of the planners.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error(
        "trunk budget {} ({budget} bytes) cannot fit even one ring slot: the largest layer \
         (layer {largest_layer}) needs a {} slot ({need} bytes) and the whole trunk is {}; \
         raise --trunk-gb to at least {}",
        fmt_bytes(*budget), fmt_bytes(*need), fmt_bytes(*total), fmt_bytes(*need)
    )]
    CannotFitOneSlot {
        budget: u64,
        need: u64,
        largest_layer: usize,
        total: u64,
    },
    #[error("--trunk-ring must be at least 1, got {0}")]
    ZeroRing(usize),
    #[error("the packed trunk has no layers")]
    EmptyTrunk,
    #[error(
        "KV cache and recurrent state for {positions} positions need {} ({} per position x \
         {positions} + {} fixed, prompt-chunk working memory included), but only {} remain ({} memory limit minus {} already planned \
         for trunk, expert cache, global tensors and the embedding rows the request reads){}; shorten the request (prompt + --gen; \
         --max-context for --chat / --serve), decode fewer sequences together (--batch-ids, \
         --serve-batch), use smaller --prefill-chunk, or lower the budgets",
        fmt_bytes(*need), fmt_bytes(*per_position), fmt_bytes(*fixed),
        fmt_bytes(limit.saturating_sub(*planned)), fmt_bytes(*limit), fmt_bytes(*planned),
        longest.map_or(String::new(), |n| format!(": the longest context that fits is {n} positions"))
    )]
    StateTooBig {
        positions: usize,
        need: u64,
        per_position: u64,
        fixed: u64,
        limit: u64,
        planned: u64,
        /// The longest context that fits, when the caller computed it.
        longest: Option<usize>,
    },
}

/// How the packed trunk is held in memory.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct TrunkPlan {
    pub n_layers: usize,
    /// Sum of the exact layer sizes.
    pub total_bytes: u64,
    pub budget_bytes: u64,
    /// Layers `0..pinned_layers` stay resident.
    pub pinned_layers: usize,
    /// Bytes allocated for the pinned prefix (each layer rounded up to 4096 for O_DIRECT).
    pub pinned_bytes: u64,
    /// Ring slots the other layers rotate through (0 when every layer is pinned).
    pub ring_slots: usize,
    /// Size of every ring slot: the largest unpinned layer rounded up to 4096.
    pub ring_slot_bytes: u64,
    /// Ring slots asked for (`--trunk-ring`, default 2).
    pub requested_ring: usize,
    /// When two slots do not fit but the budget beyond the pinned prefix holds some streamed
    /// layer beside the one before it: one SHARED ring of this many bytes (a multiple of
    /// 4096: the largest streamed layer or the widest neighbour pair that fits, whichever is
    /// larger) replaces the single slot, and a reader thread reads each layer that fits into
    /// one end while the previous layer computes at the other. 0 otherwise.
    pub shared_ring_bytes: u64,
    /// Streamed layers read ahead (while the streamed layer before them computes, or while
    /// the pinned prefix computes); with uniform slots (>= 2), every streamed layer.
    pub read_ahead_layers: usize,
}

impl TrunkPlan {
    /// Bytes the plan allocates.
    pub fn planned_bytes(&self) -> u64 {
        self.pinned_bytes
            + (self.ring_slots as u64 * self.ring_slot_bytes).max(self.shared_ring_bytes)
    }
    /// The deterministic trunk hit rate: pinned layers / all layers.
    pub fn hit_rate(&self) -> f64 {
        if self.n_layers == 0 {
            0.0
        } else {
            self.pinned_layers as f64 / self.n_layers as f64
        }
    }
    pub fn is_pinned(&self, layer: usize) -> bool {
        layer < self.pinned_layers
    }
    /// A reader thread prefetches layer L+1 while L computes only with >= 2 slots or a
    /// shared ring (never into the one slot the executor reads).
    pub fn prefetch(&self) -> bool {
        self.ring_slots >= 2 || self.shared_ring_bytes > 0
    }
    /// Fewer slots than requested because the budget could not afford them.
    pub fn ring_reduced(&self) -> bool {
        self.pinned_layers < self.n_layers && self.ring_slots < self.requested_ring
    }

    /// The start-up lines: the plan, the fallback note if any, the deterministic hit rate.
    /// (The O_DIRECT line comes from the reader, which knows whether the filesystem agreed.)
    pub fn report_lines(&self) -> Vec<String> {
        let mut v = vec![format!(
            "trunk stream: {} packed, {}/{} layers PINNED ({}), ring {} x {} (budget {})",
            fmt_bytes(self.total_bytes),
            self.pinned_layers,
            self.n_layers,
            fmt_bytes(self.pinned_bytes),
            self.ring_slots,
            fmt_bytes(self.ring_slot_bytes),
            fmt_bytes(self.budget_bytes),
        )];
        if self.shared_ring_bytes > 0 {
            let streamed = self.n_layers - self.pinned_layers;
            v.push(format!(
                "trunk ring: the budget cannot afford {} slots of {}; ONE SHARED ring of {} \
                 instead: a layer is read into one end while the layer before it computes at \
                 the other, when the two fit side by side ({} of {} streamed layers read ahead, \
                 {} synchronously). Output tokens are identical either way.",
                self.requested_ring,
                fmt_bytes(self.ring_slot_bytes),
                fmt_bytes(self.shared_ring_bytes),
                self.read_ahead_layers,
                streamed,
                streamed - self.read_ahead_layers
            ));
        } else if self.ring_slots == 1 {
            v.push(if self.requested_ring >= 2 {
                format!(
                    "trunk ring: the budget cannot afford {} slots of {}; ONE slot, synchronous \
                     reads (reads are not overlapped with compute; raise --trunk-gb). Output \
                     tokens are identical either way.",
                    self.requested_ring,
                    fmt_bytes(self.ring_slot_bytes)
                )
            } else {
                "trunk ring: one slot requested; synchronous reads (not overlapped with compute)"
                    .to_string()
            });
        } else if self.ring_reduced() {
            v.push(format!(
                "trunk ring: {} of {} requested slots fit the budget",
                self.ring_slots, self.requested_ring
            ));
        }
        v.push(format!(
            "deterministic hit rate {:.1}% (a cyclic scan defeats LRU, so a pinned prefix is used instead)",
            100.0 * self.hit_rate()
        ));
        v
    }
}

/// Plan the trunk: `layer_bytes` are the packed layer sizes in layer order, `budget` the trunk
/// budget in bytes, `requested_ring` the ring slots asked for (>= 1). More ring slots are
/// preferred over more pinned layers (the second slot buys the read/compute overlap); if the
/// requested count cannot fit, fewer are used, down to one; if not even one slot fits, the
/// error names the numbers.
///
/// One slot with two or more requested: the slot becomes a shared ring (up to the budget left
/// after the pinned prefix, no larger than the widest neighbour pair that fits) when that lets
/// at least one streamed layer be read while another computes. Real K3 at the laptop budget is
/// the case: layer 0 (2.34 GB, the dense MLP) is twice any other layer, so two uniform slots
/// need 4.7 GB, but its one slot holds any two of layers 1..92 side by side.
pub fn plan_trunk(
    layer_bytes: &[u64],
    budget: u64,
    requested_ring: usize,
) -> Result<TrunkPlan, PlanError> {
    if requested_ring == 0 {
        return Err(PlanError::ZeroRing(requested_ring));
    }
    let n_layers = layer_bytes.len();
    if n_layers == 0 {
        return Err(PlanError::EmptyTrunk);
    }
    let a = IO_ALIGN as u64;
    let sizes: Vec<u64> = layer_bytes.iter().map(|&b| align_up(b, a)).collect();
    // prefix[n] = bytes of layers 0..n; suffix_max[n] = largest of layers n.. (0 for n = L).
    let mut prefix = vec![0u64; n_layers + 1];
    for i in 0..n_layers {
        prefix[i + 1] = prefix[i].saturating_add(sizes[i]);
    }
    let mut suffix_max = vec![0u64; n_layers + 1];
    for i in (0..n_layers).rev() {
        suffix_max[i] = suffix_max[i + 1].max(sizes[i]);
    }
    let total_bytes: u64 = layer_bytes.iter().sum();
    let cost = |n: usize, ring: usize| -> u64 {
        if n == n_layers {
            prefix[n]
        } else {
            prefix[n].saturating_add((ring as u64).saturating_mul(suffix_max[n]))
        }
    };
    for ring in (1..=requested_ring).rev() {
        if let Some(n) = (0..=n_layers).rev().find(|&n| cost(n, ring) <= budget) {
            let (ring_slots, slot) = if n == n_layers {
                (0, 0)
            } else {
                (ring, suffix_max[n])
            };
            let (shared_ring_bytes, read_ahead_layers) = match ring_slots {
                0 => (0, 0),
                1 if requested_ring >= 2 => shared_ring(&sizes[n..], n > 0, budget - prefix[n]),
                1 => (0, 0),
                _ => (0, n_layers - n),
            };
            return Ok(TrunkPlan {
                n_layers,
                total_bytes,
                budget_bytes: budget,
                pinned_layers: n,
                pinned_bytes: prefix[n],
                ring_slots,
                ring_slot_bytes: slot,
                requested_ring,
                shared_ring_bytes,
                read_ahead_layers,
            });
        }
    }
    // One slot fits iff budget >= the largest layer (any prefix either pins it or streams it).
    // The layer named is the one `pack-trunk` names: the largest in bytes, the first of equals
    // (several can round up to the same slot).
    let (largest_layer, need) = layer_bytes
        .iter()
        .copied()
        .enumerate()
        .max_by_key(|&(i, s)| (s, std::cmp::Reverse(i)))
        .map_or((0, 0), |(i, s)| (i, align_up(s, a)));
    Err(PlanError::CannotFitOneSlot {
        budget,
        need,
        largest_layer,
        total: total_bytes,
    })
}

/// The shared ring for the streamed layers `streamed` (4096-rounded sizes, in order) in at
/// most `room` bytes: `(ring bytes, layers read ahead)`, or `(0, 0)` when no layer could be
/// read ahead (then the one slot reads synchronously). A streamed layer is read ahead when it
/// fits beside the streamed layer before it in the cyclic order (the ring's two ends hold at
/// most those two); the first one also when a pinned prefix computes before it. The ring is
/// no larger than that needs: the largest layer, or the largest neighbour pair that fits in
/// `room` (real K3 at the laptop preset: two 1.16 GB layers fit in layer 0's 2.34 GB, so
/// the ring costs nothing over the single slot). One streamed layer is never re-read (the
/// single slot keeps it), so it gets no ring.
fn shared_ring(streamed: &[u64], after_pinned: bool, room: u64) -> (u64, usize) {
    let room = align_down(room, IO_ALIGN as u64);
    let n = streamed.len();
    if n < 2 {
        return (0, 0);
    }
    let pair = |i: usize| streamed[(i + n - 1) % n].saturating_add(streamed[i]);
    let ahead = (0..n)
        .filter(|&i| (i == 0 && after_pinned) || pair(i) <= room)
        .count();
    if ahead == 0 {
        return (0, 0);
    }
    let largest = streamed.iter().copied().max().unwrap_or(0);
    let widest_pair = (0..n).map(pair).filter(|&p| p <= room).max().unwrap_or(0);
    (largest.max(widest_pair), ahead)
}

/// Memory for the KV cache (MLA layers) and recurrent state (KDA layers) of one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct StateMemory {
    /// Bytes added per position (the executor computes it from the model: MLA cache rows).
    pub bytes_per_position: u64,
    /// Bytes independent of length (KDA state, conv history, scratch).
    pub fixed_bytes: u64,
    /// Positions the request can reach (prompt + generated).
    pub positions: usize,
}

impl StateMemory {
    pub fn total(&self) -> u64 {
        self.bytes_per_position
            .saturating_mul(self.positions as u64)
            .saturating_add(self.fixed_bytes)
    }
}

/// Refuse up front a request whose state cannot fit next to what is already planned.
/// `limit` is the memory the process may use (see [`memory_limit_bytes`]); `planned` is what
/// the trunk plan, expert cache and global tensors take. Returns the state bytes.
pub fn check_state_memory(state: &StateMemory, planned: u64, limit: u64) -> Result<u64, PlanError> {
    let need = state.total();
    let avail = limit.saturating_sub(planned);
    if need > avail {
        return Err(PlanError::StateTooBig {
            positions: state.positions,
            need,
            per_position: state.bytes_per_position,
            fixed: state.fixed_bytes,
            limit,
            planned,
            longest: None,
        });
    }
    Ok(need)
}

impl PlanError {
    /// [`PlanError::StateTooBig`] naming the longest context that fits; others unchanged.
    pub fn with_longest(mut self, n: usize) -> PlanError {
        if let PlanError::StateTooBig { longest, .. } = &mut self {
            *longest = Some(n);
        }
        self
    }
}

/// The memory facts moved to [`crate::platform::memory`]; re-exported here for existing paths.
pub use crate::platform::memory::{
    CGROUP_V1_UNLIMITED, CgroupMemory, CgroupVersion, MemoryLimit, cgroup_memory_at, memory_limit,
    memory_limit_at, memory_limit_bytes, parse_meminfo_available, parse_reserved_pool_free,
    reserved_pool_free_bytes,
};

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const K: u64 = 4096;

    /// The seed's bounded fixed-point loop (C engine, `k3_trunk.c`), for comparison only.
    fn seed_fixed_point(sizes: &[u64], budget: u64, ring: u64) -> Option<(usize, u64)> {
        let max = sizes.iter().copied().max().unwrap_or(0);
        let mut slot = align_up(max, K);
        let mut npin = 0usize;
        for _ in 0..4 {
            let avail = budget.saturating_sub(slot * ring);
            let (mut n, mut used) = (0usize, 0u64);
            while n < sizes.len() && used + align_up(sizes[n], K) <= avail {
                used += align_up(sizes[n], K);
                n += 1;
            }
            let mut need = sizes[n..].iter().copied().max().unwrap_or(0);
            if need == 0 {
                need = K;
            }
            if n == npin && align_up(need, K) == slot {
                break;
            }
            npin = n;
            slot = align_up(need, K);
        }
        let pinned: u64 = sizes[..npin].iter().map(|&s| align_up(s, K)).sum();
        (pinned + ring * slot <= budget).then_some((npin, slot))
    }

    #[test]
    fn everything_fits_pins_all_without_ring() {
        let p = plan_trunk(&[5 * K, 3 * K, 3 * K], 11 * K, 2).expect("plan");
        assert_eq!(
            (p.pinned_layers, p.ring_slots, p.ring_slot_bytes),
            (3, 0, 0)
        );
        assert_eq!(p.pinned_bytes, 11 * K);
        assert!((p.hit_rate() - 1.0).abs() < 1e-12);
    }

    #[test]
    fn two_slots_preferred_then_one_slot_fallback() {
        // layers: 4K, 2K, 2K, 2K (x4096). Budget 8K: 2 slots of 4K and nothing pinned, or pin
        // layer 0 + 2 slots of 2K = 8K -> 1 pinned, 2 slots of 2K.
        let sizes = [4 * K, 2 * K, 2 * K, 2 * K];
        let p = plan_trunk(&sizes, 8 * K, 2).expect("plan");
        assert_eq!(
            (p.pinned_layers, p.ring_slots, p.ring_slot_bytes),
            (1, 2, 2 * K)
        );
        // Budget 5K: 2 slots never fit (>= 4K+2x2K = 8K or 2x4K); one slot: pin layer 0 needs
        // 4K+2K = 6K > 5K, so 0 pinned + one slot of 4K.
        let p = plan_trunk(&sizes, 5 * K, 2).expect("plan");
        assert_eq!(
            (p.pinned_layers, p.ring_slots, p.ring_slot_bytes),
            (0, 1, 4 * K)
        );
        assert!(p.ring_reduced());
        // ...widened to a shared ring: layers 2 and 3 fit beside the layer before them (2K +
        // 2K), layers 0 and 1 do not (2K + 4K, 4K + 2K). 4K (the largest layer) holds the
        // widest pair that fits, so the ring costs nothing over the single slot.
        assert_eq!((p.shared_ring_bytes, p.read_ahead_layers), (4 * K, 2));
        assert!(p.prefetch());
        assert_eq!(p.planned_bytes(), 4 * K);
        // Layers 4K, 3K, 1K, 1K in 6K: neighbour pairs 1K+4K, 4K+3K, 3K+1K, 1K+1K; all but
        // 4K + 3K fit, the widest is 5K: a 5K ring (not the whole 6K), 3 layers read ahead.
        let p = plan_trunk(&[4 * K, 3 * K, K, K], 6 * K, 2).expect("plan");
        assert_eq!((p.pinned_layers, p.ring_slots), (0, 1));
        assert_eq!((p.shared_ring_bytes, p.read_ahead_layers), (5 * K, 3));
        assert_eq!(p.planned_bytes(), 5 * K);
        let lines = p.report_lines().join("\n");
        assert!(lines.contains("ONE SHARED ring"), "{lines}");
        assert!(
            lines.contains("3 of 4 streamed layers read ahead, 1 synchronously"),
            "{lines}"
        );
        assert!(lines.contains("deterministic hit rate 0.0%"), "{lines}");
        // No two neighbours fit in 5K (3K + 3K, 4K + 3K): the one slot reads synchronously.
        let p = plan_trunk(&[4 * K, 3 * K, 3 * K, 3 * K], 5 * K, 2).expect("plan");
        assert_eq!(
            (p.pinned_layers, p.ring_slots, p.ring_slot_bytes),
            (0, 1, 4 * K)
        );
        assert_eq!((p.shared_ring_bytes, p.read_ahead_layers), (0, 0));
        assert!(!p.prefetch());
        assert_eq!(p.planned_bytes(), 4 * K);
        let lines = p.report_lines().join("\n");
        assert!(lines.contains("ONE slot, synchronous"), "{lines}");
        // One slot asked for: never widened.
        let p = plan_trunk(&sizes, 5 * K, 1).expect("plan");
        assert_eq!((p.ring_slots, p.shared_ring_bytes), (1, 0));
    }

    #[test]
    fn real_k3_laptop_budget_gets_a_shared_ring() {
        // The release's trunk (`k3-run plan` of models/tests/data/kimi-k3-config.json): layer
        // 0 KDA + dense MLP 2,341,213,184 B, KDA + MoE 1,267,744,256 B, MLA + MoE 844,335,616 B;
        // MLA at layers 3, 7, ..., 91 and 92. The laptop preset's 3.00 GB cannot pin layer 0
        // next to a slot or hold two 2.34 GB slots: one slot of layer 0's size.
        let mut sizes = vec![2_341_213_184u64];
        sizes.extend((1..93).map(|l| {
            if l % 4 == 3 || l == 92 {
                844_335_616u64
            } else {
                1_267_744_256
            }
        }));
        let p = plan_trunk(&sizes, 3_000_000_000, 2).expect("plan");
        assert_eq!((p.pinned_layers, p.ring_slots), (0, 1));
        assert_eq!(p.ring_slot_bytes, align_up(2_341_213_184, K));
        // Two KDA + MoE layers (2.54 GB) do not fit in layer 0's slot: the ring widens to
        // that pair, and every layer but 0 and 1 (beside layer 0) is read ahead.
        assert_eq!(p.shared_ring_bytes, align_up(2 * 1_267_744_256, K));
        assert!(p.shared_ring_bytes > p.ring_slot_bytes);
        assert_eq!(p.planned_bytes(), p.shared_ring_bytes);
        assert_eq!(p.read_ahead_layers, 91);
        // At the ultra preset's 2.5 GB the ring stays one slot: only the 46 layers with an MLA
        // layer beside the one before them are read ahead (45 KDA-after-KDA pairs and layers
        // 0 and 1 are not).
        let p = plan_trunk(&sizes, 2_500_000_000, 2).expect("plan");
        assert_eq!(p.shared_ring_bytes, p.ring_slot_bytes);
        assert_eq!(p.read_ahead_layers, 46);
        // Desktop (16 GB) keeps two uniform slots and pins a prefix.
        let p = plan_trunk(&sizes, 16_000_000_000, 2).expect("plan");
        assert_eq!((p.ring_slots, p.shared_ring_bytes), (2, 0));
        assert_eq!(p.read_ahead_layers, 93 - p.pinned_layers);
    }

    #[test]
    fn cannot_fit_one_slot_names_the_numbers() {
        let err = plan_trunk(&[3 * K, 9 * K, 2 * K], 8 * K, 2).expect_err("too small");
        let msg = err.to_string();
        assert!(msg.contains("layer 1"), "{msg}");
        assert!(msg.contains(&(9 * K).to_string()), "{msg}");
        assert!(msg.contains(&(8 * K).to_string()), "{msg}");
        assert!(matches!(
            plan_trunk(&[K], K, 0),
            Err(PlanError::ZeroRing(0))
        ));
        assert!(matches!(plan_trunk(&[], K, 1), Err(PlanError::EmptyTrunk)));
        // layers 0 and 1 round up to the same slot: the one named is the larger in bytes
        // (what `pack-trunk` names), and the slot is the rounded size
        let err = plan_trunk(&[K - 100, K - 10, 200], 100, 1).expect_err("too small");
        let msg = err.to_string();
        assert!(msg.contains("layer 1"), "{msg}");
        assert!(msg.contains(&K.to_string()), "{msg}");
    }

    #[test]
    fn unaligned_sizes_are_rounded_to_4096() {
        let p = plan_trunk(&[5000, 100, 100], 3 * K, 1).expect("plan");
        // 5000 -> 8192: pin layer 0 (8192) + one slot of 4096 = 12288 > 3K budget? 3K = 12288.
        assert_eq!(
            (p.pinned_layers, p.ring_slots, p.ring_slot_bytes),
            (1, 1, K)
        );
        assert_eq!(p.pinned_bytes, 2 * K);
        assert_eq!(p.total_bytes, 5200);
    }

    #[test]
    fn seed_iteration_misses_pinning_the_largest_layer() {
        // Slots of the largest layer (2 x 10K) exceed 12K, so the seed's loop pins nothing and
        // two slots do not fit; pinning layer 0 leaves 2 slots of 1K: 10K + 2K = 12K.
        let sizes = [10 * K, K, K, K];
        assert_eq!(seed_fixed_point(&sizes, 12 * K, 2), None);
        let p = plan_trunk(&sizes, 12 * K, 2).expect("plan");
        assert_eq!(
            (p.pinned_layers, p.ring_slots, p.ring_slot_bytes),
            (1, 2, K)
        );
        assert_eq!(p.planned_bytes(), 12 * K);
    }

    #[test]
    fn state_memory_check() {
        let s = StateMemory {
            bytes_per_position: 1000,
            fixed_bytes: 500,
            positions: 10,
        };
        assert_eq!(check_state_memory(&s, 100, 10_600).expect("fits"), 10_500);
        let err = check_state_memory(&s, 200, 10_600).expect_err("too big");
        let msg = err.to_string();
        assert!(msg.contains("10 positions"), "{msg}");
        assert!(msg.contains("10.50 KB"), "{msg}");
        assert!(msg.contains("10.40 KB remain"), "{msg}");
    }

    fn sizes_strategy() -> impl Strategy<Value = Vec<u64>> {
        prop::collection::vec(1u64..200_000, 1..40)
    }

    proptest! {
        #[test]
        fn plan_fits_budget_and_is_self_consistent(
            sizes in sizes_strategy(), budget in 0u64..4_000_000, ring in 1usize..4
        ) {
            if let Ok(p) = plan_trunk(&sizes, budget, ring) {
                prop_assert!(p.planned_bytes() <= budget);
                let al: Vec<u64> = sizes.iter().map(|&s| align_up(s, K)).collect();
                prop_assert_eq!(p.pinned_bytes, al[..p.pinned_layers].iter().sum::<u64>());
                if p.pinned_layers < sizes.len() {
                    prop_assert!(p.ring_slots >= 1 && p.ring_slots <= ring);
                    prop_assert_eq!(p.ring_slot_bytes, *al[p.pinned_layers..].iter().max().unwrap());
                    // No longer prefix fits with the same ring count.
                    for n in p.pinned_layers + 1..=sizes.len() {
                        let slot = al[n..].iter().copied().max().unwrap_or(0);
                        let c = al[..n].iter().sum::<u64>()
                            + if n == sizes.len() { 0 } else { p.ring_slots as u64 * slot };
                        prop_assert!(c > budget, "prefix {} would fit ({} <= {})", n, c, budget);
                    }
                } else {
                    prop_assert_eq!(p.ring_slots, 0);
                }
                // A shared ring only widens a single slot that two or more were asked for.
                if p.shared_ring_bytes > 0 {
                    prop_assert!(p.ring_slots == 1 && ring >= 2);
                    prop_assert!(p.shared_ring_bytes >= p.ring_slot_bytes);
                    prop_assert!(p.read_ahead_layers >= 1);
                    prop_assert!(p.read_ahead_layers <= sizes.len() - p.pinned_layers);
                }
                // Never worse than the seed's bounded iteration with the same ring count.
                if p.ring_slots > 0
                    && let Some((n_seed, _)) = seed_fixed_point(&sizes, budget, p.ring_slots as u64)
                {
                    prop_assert!(p.pinned_layers >= n_seed);
                }
            } else {
                // Infeasible exactly when the budget is below the largest (aligned) layer.
                let max = sizes.iter().map(|&s| align_up(s, K)).max().unwrap();
                prop_assert!(budget < max);
            }
        }

        #[test]
        fn plan_is_monotone_in_budget(
            sizes in sizes_strategy(), b1 in 0u64..4_000_000, extra in 0u64..2_000_000, ring in 1usize..4
        ) {
            let b2 = b1 + extra;
            let p1 = plan_trunk(&sizes, b1, ring);
            let p2 = plan_trunk(&sizes, b2, ring);
            if let Ok(p1) = p1 {
                let p2 = p2.expect("more budget cannot make a plan infeasible");
                // Ring slots never drop as the budget grows (all-pinned counts as enough).
                let r = |p: &TrunkPlan| if p.ring_slots == 0 { usize::MAX } else { p.ring_slots };
                prop_assert!(r(&p2) >= r(&p1));
                // With the same ring count, the pinned prefix never shrinks.
                if p1.ring_slots == p2.ring_slots {
                    prop_assert!(p2.pinned_layers >= p1.pinned_layers);
                }
                // With one slot requested, pinned count is monotone outright.
                let q1 = plan_trunk(&sizes, b1, 1).expect("one slot fits if ring fits");
                let q2 = plan_trunk(&sizes, b2, 1).expect("one slot fits if ring fits");
                prop_assert!(q2.pinned_layers >= q1.pinned_layers);
            }
        }
    }
}
