//! Eviction policies of the expert cache: the [`EvictionPolicy`] trait and the built-in
//! [`Lru`] (plugins implement the same trait through `stream::plugin`).

use super::*;

/// Chooses which resident expert to evict. Implementations must be deterministic.
pub trait EvictionPolicy: Send {
    fn name(&self) -> &str;
    /// A request was served from `slot`.
    fn on_access(&mut self, key: ExpertKey, slot: usize);
    /// `key` was loaded into `slot`.
    fn on_insert(&mut self, key: ExpertKey, slot: usize);
    /// `key` left `slot` (evicted or failed).
    fn on_remove(&mut self, _key: ExpertKey, _slot: usize) {}
    /// Pick the victim among `candidates` (resident, not needed by the current call; never
    /// empty); returns an index into `candidates`.
    fn choose_victim(&mut self, candidates: &[(ExpertKey, usize)]) -> usize;
    /// Why the policy stopped working as configured (e.g. a plugin fell back), if it did.
    fn failure(&self) -> Option<&str> {
        None
    }
    /// `key` was asked for (before its hit or miss).
    fn on_request(&mut self, _key: ExpertKey) {}
    /// A token (one forward pass) starts.
    fn on_token(&mut self) {}
    /// Whether the policy asked to keep `key` (never offered as a victim while others are).
    fn is_pinned(&self, _key: ExpertKey) -> bool {
        false
    }
}

/// Least recently used; ties (never touched) go to the lowest slot.
#[derive(Debug, Default)]
pub struct Lru {
    pub(super) clock: u64,
    /// Last access time by slot (slots are dense `0..capacity`); 0 = never touched or removed.
    pub(super) last_use: Vec<u64>,
}

impl EvictionPolicy for Lru {
    fn name(&self) -> &str {
        "lru"
    }
    fn on_access(&mut self, _key: ExpertKey, slot: usize) {
        self.clock += 1;
        if slot >= self.last_use.len() {
            self.last_use.resize(slot + 1, 0);
        }
        self.last_use[slot] = self.clock;
    }
    fn on_insert(&mut self, key: ExpertKey, slot: usize) {
        self.on_access(key, slot);
    }
    fn on_remove(&mut self, _key: ExpertKey, slot: usize) {
        if let Some(t) = self.last_use.get_mut(slot) {
            *t = 0;
        }
    }
    fn choose_victim(&mut self, candidates: &[(ExpertKey, usize)]) -> usize {
        candidates
            .iter()
            .enumerate()
            .min_by_key(|(_, (_, slot))| (self.last_use.get(*slot).copied().unwrap_or(0), *slot))
            .map_or(0, |(i, _)| i)
    }
}
